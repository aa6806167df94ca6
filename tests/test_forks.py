"""launcher.forks: workers forked from a preloaded interpreter behave as a ``python -m MODULE`` of their own would:
their own environment, arguments, output, random state and exit status, real signals, nothing of the server's."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from lightning_bamboo.launcher.forks import ForkServer, ForkServerRefused, start_shared
from tests.helpers import REPO

PROBE = "tests.scripts.fork_probe"


@pytest.fixture
def server():
    # the server's own environment differs from every worker's: a worker must see only its own
    forks = ForkServer(["json", "tests.helpers"], {**os.environ, "PYTHONPATH": str(REPO), "PROBE_SERVER": "1"},
                       runs=[PROBE, "tests.scripts.release_probe"])
    yield forks
    forks.close()


def _probe(server: ForkServer, tmp_path, how: str, new_session: bool = False, **env: str) -> tuple[object, dict, str]:
    out = tmp_path / f"out-{how}-{len(list(tmp_path.iterdir()))}.log"
    with open(out, "wb") as log:
        proc = server.start([sys.executable, "-m", PROBE, how], {"PYTHONPATH": str(REPO), **env}, stdout=log,
                            stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=new_session)
    return proc, out


def _report(out) -> dict:
    return json.loads(out.read_text().splitlines()[0])


@pytest.mark.timeout(120)
def test_a_forked_worker_gets_its_own_environment_arguments_output_and_status(server, tmp_path):
    assert server.accepts([sys.executable, "-m", PROBE, "0"]) and not server.accepts([sys.executable, "x.py"])
    assert not server.accepts([sys.executable, "-m", "json"])  # preloaded, not one it runs
    first, first_out = _probe(server, tmp_path, "3", PROBE_NAME="a")
    second, second_out = _probe(server, tmp_path, "0", new_session=True, PROBE_NAME="b")
    assert first.wait(60) == 3 and second.wait(60) == 0
    a, b = _report(first_out), _report(second_out)
    assert not a["session_leader"] and b["session_leader"]  # start_new_session: os.killpg(pid) reaches all it starts
    assert a["pid"] == first.pid and b["pid"] == second.pid and first.pid != second.pid
    assert a["env"] == {"PROBE_NAME": "a"} and b["env"] == {"PROBE_NAME": "b"}  # not the server's PROBE_SERVER
    assert a["argv"] == ["3"] and a["orig_argv"] == [sys.executable, "-m", PROBE, "3"]
    assert a["cwd"] == str(tmp_path) and a["main"] == "__main__" and a["file"] == "fork_probe.py"
    assert a["random"] != b["random"]  # each a fresh random state, as interpreters of their own
    assert a["sigterm_default"] and a["fds"] == [0, 1, 2, 3]  # 3: its listing of /proc/self/fd; nothing inherited
    # a fresh interpreter's dispositions: SIGPIPE ignored (a write to a closed pipe raises BrokenPipeError; at the
    # default a forked demo driver died of it, -13, with nothing said), SIGXFSZ too, Python's SIGINT handler
    fresh = subprocess.run([sys.executable, "-m", PROBE, "0"], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                           capture_output=True, text=True, timeout=60)
    assert a["signals"] == json.loads(fresh.stdout.splitlines()[0])["signals"]
    assert a["signals"]["SIGPIPE"] == str(signal.SIG_IGN) and a["signals"]["SIGTERM"] == str(signal.SIG_DFL)
    assert not a["preloaded"]  # run as __main__ only, as under python -m
    assert first_out.read_text().splitlines()[-1] == "atexit ran"  # the interpreter's own exit


@pytest.mark.timeout(120)
def test_a_forked_worker_keeps_ignored_what_its_client_ignores_as_an_exec_would(server, tmp_path):
    """A shell's background job runs with SIGINT ignored, and an interpreter it starts keeps it ignored: a worker
    forked for such a client does too (it had Python's handler, so a suite started in the background failed here)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        worker, out = _probe(server, tmp_path, "0")
        assert worker.wait(60) == 0
        fresh = subprocess.run([sys.executable, "-m", PROBE, "0"], cwd=tmp_path,
                               env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)
    finally:
        signal.signal(signal.SIGINT, previous)
    signals = json.loads(fresh.stdout.splitlines()[0])["signals"]
    assert signals["SIGINT"] == str(int(signal.SIG_IGN))  # (the probe prints a disposition's number)
    assert _report(out)["signals"] == signals


@pytest.mark.timeout(120)
def test_a_forked_worker_that_raises_or_is_killed_reports_it(server, tmp_path):
    failing, failing_out = _probe(server, tmp_path, "raise")
    assert failing.wait(60) == 1
    assert "RuntimeError: the probe fails" in failing_out.read_text() and "Traceback" in failing_out.read_text()
    sleeping, sleeping_out = _probe(server, tmp_path, "sleep")
    with pytest.raises(subprocess.TimeoutExpired):
        sleeping.wait(0.5)
    assert sleeping.poll() is None
    sleeping.send_signal(signal.SIGKILL)
    assert sleeping.wait(60) == -signal.SIGKILL and sleeping.returncode == -signal.SIGKILL


@pytest.mark.timeout(120)
def test_a_worker_outlives_its_ended_server_and_is_reported_once_gone(server, tmp_path):
    sleeping, _ = _probe(server, tmp_path, "sleep")
    server.close()  # the server is killed: its children run on, as processes of their own
    assert server.lost and sleeping.poll() is None
    os.kill(sleeping.pid, signal.SIGKILL)
    assert sleeping.wait(60) == -signal.SIGKILL  # known only to be gone
    with pytest.raises(OSError, match="has ended"):
        _probe(server, tmp_path, "0")


@pytest.mark.timeout(120)
def test_a_script_is_forked_as_python_would_run_it(tmp_path):
    """``python SCRIPT.py ARGS`` (what the launcher's --preload forks): the script as ``__main__``, its own
    arguments, and its command line kept for a worker that starts itself again."""
    script = str(REPO / "tests" / "scripts" / "fork_probe.py")
    forks = ForkServer(["json"], {**os.environ, "PYTHONPATH": str(REPO)}, runs=("*",), scripts=True)
    try:
        assert forks.accepts([sys.executable, script, "0"]) and forks.accepts([sys.executable, "-m", "any.module"])
        assert not forks.accepts(["/bin/sh", script]) and not forks.accepts([sys.executable, "-c", "pass"])
        out = tmp_path / "out.log"
        with open(out, "wb") as log:
            proc = forks.start([sys.executable, script, "5"], {"PYTHONPATH": str(REPO)}, stdout=log, stderr=log)
        assert proc.wait(60) == 5
        report = _report(out)
        assert report["argv"] == ["5"] and report["orig_argv"] == [sys.executable, script, "5"]
        assert report["main"] == "__main__" and report["fds"] == [0, 1, 2, 3]
    finally:
        forks.close()


@pytest.fixture
def shared(tmp_path_factory):
    """A shared server (``start_shared``) that imported torch and lightning_bamboo in an environment of two threads
    and ERROR logs."""
    address = str(tmp_path_factory.mktemp("shared") / "forks.sock")
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "2",
           "BAMBOO_LOG_LEVEL": "ERROR"}
    proc = start_shared(address, ["torch", "lightning_bamboo.logs"], env)
    yield address, env
    proc.kill()
    proc.wait()


def _alive(pid: int) -> bool:
    from lightning_bamboo.membership.node import process_alive

    return process_alive(pid)


@pytest.mark.timeout(120)
def test_a_shared_server_forks_for_each_launcher_its_own_workers_and_reports_each_exit_to_its_launcher(shared, tmp_path):
    """Two launchers at one shared server: each worker gets its own environment (its thread count too, though torch
    was imported with another, and its log level), arguments and status, reported to the launcher that asked for it."""
    address, env = shared
    first = ForkServer(["torch"], env, runs=[PROBE], address=address)
    second = ForkServer(["torch"], {**env, "OMP_NUM_THREADS": "1"}, runs=[PROBE], address=address)
    try:
        a, a_out = _probe(first, tmp_path, "3", PROBE_NAME="a", OMP_NUM_THREADS="1", BAMBOO_LOG_LEVEL="INFO")
        b, b_out = _probe(second, tmp_path, "4", PROBE_NAME="b")
        assert a.wait(60) == 3 and b.wait(60) == 4
        got_a, got_b = _report(a_out), _report(b_out)
        assert (got_a["pid"], got_a["env"], got_a["argv"], got_a["threads"]) == (a.pid, {"PROBE_NAME": "a"}, ["3"], 1)
        assert (got_a["log_level"], got_b["log_level"]) == (logging.INFO, logging.NOTSET)  # theirs, not the server's
        # no thread count given: the one torch was imported with, as a python of its own would take from the variable
        assert (got_b["env"], got_b["argv"], got_b["threads"]) == ({"PROBE_NAME": "b"}, ["4"], 2)
        assert got_a["fds"] == [0, 1, 2, 3] and got_a["main"] == "__main__"  # nothing of the server or its clients
        sleeping, _ = _probe(second, tmp_path, "sleep")
        assert _alive(sleeping.pid)
    finally:
        first.close()
    assert _alive(sleeping.pid)  # the other launcher's worker runs on
    second.close()  # its launcher is gone: so is its worker
    deadline = time.monotonic() + 30
    while _alive(sleeping.pid):
        assert time.monotonic() < deadline, "a worker outlived the connection of the launcher that started it"
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_a_launcher_whose_workers_import_differently_is_refused_by_the_shared_server(shared):
    address, env = shared
    with pytest.raises(ForkServerRefused, match=r"imported with \{'PYTHONPATH': \('/elsewhere',"):
        ForkServer(["torch"], {**env, "PYTHONPATH": "/elsewhere"}, address=address)
    with pytest.raises(ForkServerRefused, match="no shared fork server at"):
        ForkServer(["torch"], env, address=address + ".gone")
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:  # connects and never greets
        silent.connect(address)
        ForkServer(["torch"], env, address=address).close()  # served all the same, within the greeting's wait


@pytest.mark.timeout(120)
def test_a_shared_servers_address_appears_only_once_it_listens(tmp_path):
    """``start_shared`` returns once the address exists, and a launcher connects at once: a connect between the
    socket's bind and its listen is refused, and the launcher falls back to a process of its own. A server whose
    listen is slowed by a second (a busy machine) must still never be refused."""
    address = str(tmp_path / "forks.sock")
    slowed = ("import socket, time\n"
              "listen = socket.socket.listen\n"
              "socket.socket.listen = lambda self, *a: (time.sleep(1.0), listen(self, *a))[1]\n"
              "from lightning_bamboo.launcher.forks import serve_shared\n"
              f"serve_shared({address!r}, [])\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", slowed], env=env, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(address):
            assert proc.poll() is None and time.monotonic() < deadline, "the server never listened"
            time.sleep(0.001)
        ForkServer([], env, address=address).close()  # greeted, not refused
    finally:
        proc.kill()
        assert proc.wait(30) == -signal.SIGKILL
    assert os.listdir(tmp_path) == ["forks.sock"]  # no name of its own left behind


@pytest.mark.timeout(120)
def test_lightnings_launcher_forks_the_other_ranks_at_the_shared_server(shared, monkeypatch, capfd):
    """``Trainer(strategy="bamboo", devices=N)`` under Lightning's own launcher, with ``BAMBOO_PRELOAD`` and a shared
    server: rank 1 is a fork of the server (its child, not this process's), running this program again with
    Lightning's rank variables, and reports its exit as a process of its own would."""
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    import __main__
    from lightning_bamboo.strategy.patches import make_launcher_class

    address, env = shared
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    monkeypatch.setenv("DS_ACCELERATOR", env["DS_ACCELERATOR"])  # imported as the server did, else it is refused
    monkeypatch.setenv("BAMBOO_PRELOAD", "torch")
    monkeypatch.setenv("BAMBOO_FORK_SERVER", address)
    monkeypatch.setattr(sys, "argv", [str(REPO / "tests" / "scripts" / "fork_probe.py"), "7"])
    monkeypatch.setattr(__main__, "__spec__", None)  # as under python SCRIPT.py
    for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.setenv(name, "")  # recorded, so that what the launcher sets below is undone after the test
        monkeypatch.delenv(name)  # (left set, a later Trainer in this process believes it was launched by torchrun)
    launcher = make_launcher_class(_SubprocessScriptLauncher)(LightningEnvironment(), num_processes=2, num_nodes=1)
    launcher._call_children_scripts()
    (child,) = launcher.procs
    assert child.wait(60) == 7 and child.returncode == 7
    report = _report_of(capfd.readouterr().out)
    assert report["pid"] == child.pid and report["argv"] == ["7"] and report["local_rank"] == "1"
    assert report["ppid"] != os.getpid() and report["threads"] is not None  # the server's child, torch preloaded
    assert os.environ["WORLD_SIZE"] == "2" and os.environ["LOCAL_RANK"] == "0"  # this rank's, as Lightning sets them


def _report_of(output: str) -> dict:
    return json.loads(next(line for line in output.splitlines() if line.startswith("{")))


def test_preload_is_refused_for_a_module_it_cannot_import_and_on_a_machine_with_gpus(monkeypatch):
    from lightning_bamboo.errors import BambooConfigError
    from lightning_bamboo.launcher import jobs as launcher

    launcher.check_preload([])  # nothing to preload: nothing to check
    launcher.check_preload(["torch", "lightning.pytorch"])  # importable here, no GPU here
    with pytest.raises(BambooConfigError, match="--preload names no_such_module_here, which this python"):
        launcher.check_preload(["torch", "no_such_module_here"])
    # a machine with GPUs (none here: the count the launcher reads is set to 2)
    monkeypatch.setattr(launcher, "visible_gpus", lambda: 2)
    with pytest.raises(BambooConfigError, match=r"machine with GPUs \(2 visible\) may initialise the CUDA driver"):
        launcher.check_preload(["torch"])


@pytest.mark.timeout(120)
def test_the_suites_run_forks_python_commands_at_its_shared_server_as_popen_would_run_them(tmp_path):
    """``tests.helpers.run``: a ``python -m MODULE`` command is a fork of the suite's shared fork server (not a child
    of this process), leads a session of its own, and reports its output and status as ``subprocess.run`` would; one
    that outlives its timeout is killed, and one asked to start plainly (``PRELOAD_ENV: ""``) is this process's child."""
    from lightning_bamboo.launcher import PRELOAD_ENV
    from tests.helpers import PYTHON, run

    env = {"PROBE_NAME": "r"}  # (the working directory, the repository, is first on sys.path under -m)
    forked = run([PYTHON, "-m", PROBE, "5"], timeout=60, env=env)
    report = json.loads(forked.stdout.splitlines()[0])
    assert forked.returncode == 5 and forked.stdout.splitlines()[-1] == "atexit ran"
    assert report["ppid"] != os.getpid() and report["session_leader"] and report["env"] == {"PROBE_NAME": "r"}
    plain = run([PYTHON, "-m", PROBE, "0"], timeout=60, env={**env, PRELOAD_ENV: ""})
    assert plain.returncode == 0 and json.loads(plain.stdout.splitlines()[0])["ppid"] == os.getpid()
    started = time.monotonic()
    with pytest.raises(AssertionError, match="did not finish in 3 s") as timed_out:
        run([PYTHON, "-m", PROBE, "sleep"], timeout=3, env=env)
    assert time.monotonic() - started < 30
    pid = json.loads(str(timed_out.value).split("output:\n")[1].splitlines()[0])["pid"]
    deadline = time.monotonic() + 10
    while _alive(pid):
        assert time.monotonic() < deadline, "a forked command outlived its timeout"
        time.sleep(0.05)


def _lines(out, count: int, limit: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        lines = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
        if len(lines) >= count:
            return lines
        time.sleep(0.05)
    raise AssertionError(f"{out} has fewer than {count} reports: {out.read_text()}")


@pytest.fixture
def started():
    """The probes a test started: killed with their descendants at its end, so that a failed test leaves no standby
    process waiting for a signal (the workers of a fork server outlive it)."""
    from lightning_bamboo.launcher.cluster import signal_worker

    procs: list = []
    yield procs
    for proc in procs:
        signal_worker(proc, signal.SIGKILL, wait=True)


def _probe_module(server: ForkServer, tmp_path, module: str, how: str, env: dict[str, str],
                  started: list) -> tuple[object, object]:
    out = tmp_path / f"out-{how}-{len(list(tmp_path.iterdir()))}.log"
    with open(out, "wb") as log:
        proc = server.start([sys.executable, "-m", module, how], env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    started.append(proc)
    return proc, out
