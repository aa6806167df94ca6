"""A launcher or demo that is told to stop (SIGTERM, as Kubernetes and systemd do) leaves no process behind.

Real processes and real signals: the launcher forwards SIGTERM to its workers as a preemption
notice, SIGKILLs those that do not leave within its grace, and the demo ends through its cleanup.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_bamboo.membership.node import descendants
from tests.helpers import REPO

pytestmark = [pytest.mark.timeout(180)]

# a worker: says it runs, then on SIGTERM writes the file <out>/<node> and exits 0 (a handover);
# with IGNORE set it ignores SIGTERM (a worker stuck in a collective). It tells the launcher it reached its job, as
# a worker's session does, so that the launcher starts the next one at once.
WORKER = """
import os, signal, sys, time
from pathlib import Path
from lightning_bamboo.membership import connect
from lightning_bamboo.membership.keys import JobKeys
out = Path(sys.argv[1])
node = os.environ["BAMBOO_NODE"]
store = connect(os.environ["BAMBOO_STORE"])
store.put(JobKeys(os.environ["BAMBOO_JOB"]).reached(node), "1")
store.close()
def leave(signum, frame):
    (out / node).write_text("notice")
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if os.environ.get("IGNORE") else leave)
(out / f"{node}.tmp").write_text(str(os.getpid()))
(out / f"{node}.tmp").rename(out / f"{node}.pid")
while True:
    time.sleep(0.1)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for its parent counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _launch(tmp_path: Path, nodes: int, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "lightning_bamboo.launcher", "--nodes", str(nodes), *extra, "--",
           sys.executable, "-c", WORKER, str(tmp_path)]
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for_pids(tmp_path: Path, nodes: int, proc: subprocess.Popen) -> list[int]:
    deadline = time.monotonic() + 60
    while len(pids := sorted(tmp_path.glob("*.pid"))) < nodes:
        assert proc.poll() is None, f"the launcher exited early: {proc.stderr.read() if proc.stderr else ''}"
        assert time.monotonic() < deadline, "the workers did not start within 60 s"
        time.sleep(0.05)
    # each worker installs its SIGTERM handler before it puts its pid file in place (whole, by a rename)
    return [int(p.read_text()) for p in pids]


def _kill_all(proc: subprocess.Popen, tmp_path: Path) -> None:
    """A test's cleanup, passed or failed: the launcher and every worker that wrote its pid."""
    proc.kill()
    for path in tmp_path.glob("*.pid"):
        with contextlib.suppress(ValueError, ProcessLookupError):
            os.kill(int(path.read_text()), signal.SIGKILL)


def test_a_stopped_launcher_gives_its_workers_notice_and_leaves_none_behind(tmp_path):
    proc = _launch(tmp_path, 2)
    try:
        pids = _wait_for_pids(tmp_path, 2, proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        _kill_all(proc, tmp_path)
    assert "SIGTERM: workers notified" in err
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".pid")) == ["node0", "node1"]
    assert not any(_alive(pid) for pid in pids)


def test_workers_that_ignore_the_notice_are_killed_after_the_grace(tmp_path):
    proc = _launch(tmp_path, 2, "--stop-grace", "2", env={"IGNORE": "1"})
    try:
        pids = _wait_for_pids(tmp_path, 2, proc)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        waited = time.monotonic() - sent
    finally:
        _kill_all(proc, tmp_path)
    assert not any(_alive(pid) for pid in pids)
    assert waited >= 2.0, f"the launcher killed them after {waited:.1f} s, before its grace of 2 s"  # (no speed bound)
    assert "node0=-9" in err and "node1=-9" in err  # the true status: killed


def _store_waits_on(key: str) -> bool:
    """Whether a connection to the embedded store server (in this process) is held in a wait for ``key``."""
    from lightning_bamboo.membership import embedded

    for frame in list(sys._current_frames().values()):
        while frame is not None:
            code = frame.f_code
            if code.co_name == "op_wait" and code.co_filename == embedded.__file__ and frame.f_locals.get("prefix") == key:
                return True
            frame = frame.f_back
    return False


def test_a_launcher_stopped_before_its_workers_start_exits_at_once(tmp_path):
    # --node with --peers: the second machine waits for the first to publish its address; nothing runs yet
    from lightning_bamboo.membership import EmbeddedServer
    from lightning_bamboo.membership.keys import job_prefix

    server = EmbeddedServer().start()
    try:
        cmd = [sys.executable, "-m", "lightning_bamboo.launcher", "--store", server.url,
               "--node", "m1", "--peers", "m0,m1", "--", sys.executable, "-c", WORKER, str(tmp_path)]
        proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            # the launcher is in its wait for m0's address (its stop handler is in place by then): the store
            # holds its request for the key
            deadline = time.monotonic() + 60
            while not _store_waits_on(f"{job_prefix('bamboo')}master"):
                assert proc.poll() is None, f"the launcher exited early: {proc.stderr.read() if proc.stderr else ''}"
                assert time.monotonic() < deadline, "the launcher did not wait for m0's address within 60 s"
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=30)
        finally:
            proc.kill()
    finally:
        server.stop()
    assert code == 128 + signal.SIGTERM
    assert not list(tmp_path.glob("*.pid"))


def test_a_demo_stopped_with_sigterm_leaves_no_worker_running(tmp_path):
    workdir = tmp_path / "demo"
    cmd = [sys.executable, "-m", "lightning_bamboo.cli", "demo", "--nodes", "2", "--steps", "400", "--preempt", "",
           "--workdir", str(workdir)]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def workers() -> list[int]:
        """The demo's processes: its nodes (forks of its preloaded interpreter, which is one too), their
        communication processes, its store's."""
        return [pid for pid in descendants(proc.pid) if _alive(pid)]

    try:
        deadline = time.monotonic() + 120
        while not (workdir / "checkpoints").exists() or len(workers()) < 3:  # training has started
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the demo's workers did not start within 120 s"
            time.sleep(0.2)
        running = workers()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
    assert code == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in running) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in running), "a worker outlived the demo"
