"""The local launcher's share of one machine: compute threads per worker, standby processes at idle priority,
a worker that hangs after its job finished, and a job's end on every node soon after its last step."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_bamboo import launcher
from lightning_bamboo.launcher import PRELOAD_ENV, Cluster, launch
from lightning_bamboo.membership.node import idle_priority_supported
from lightning_bamboo.testing import faults
from tests.helpers import PRELOAD, PYTHON, REPO, json_reports, launcher_exit_codes, run

# a standby node's process in miniature: reports its policy, starts a thread, is "admitted", reports every thread's
# policy, and its child process's (as the communication zygote is one)
CHILD = """
import json, os, subprocess, sys, threading
from lightning_bamboo.membership.node import leave_idle_priority
before = os.sched_getscheduler(0)
stop = threading.Event()
helper = threading.Thread(target=stop.wait)
helper.start()
helper_before = os.sched_getscheduler(helper.native_id)
sub = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
sub_before = os.sched_getscheduler(sub.pid)
left = leave_idle_priority()
after = {int(t): os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")}
sub_after = os.sched_getscheduler(sub.pid)
stop.set()
sub.communicate(b"")
print(json.dumps({"before": before, "helper_before": helper_before, "left": left, "after": after,
                  "sub_before": sub_before, "sub_after": sub_after}))
"""


def _run_joiner(idle: bool) -> dict:
    cluster = Cluster("embedded", job="prio")
    try:
        out = subprocess.PIPE
        cluster.spawn_joiner("standby0", [sys.executable, "-c", CHILD], idle=idle, stdout=out, cwd=REPO)
        proc = cluster.procs["standby0"]
        stdout, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        return json.loads(stdout)
    finally:
        cluster.close()


@pytest.mark.skipif(not idle_priority_supported(), reason="this user may not raise a thread from idle priority")
def test_a_standby_process_waits_at_idle_priority_and_leaves_it_when_admitted():
    report = _run_joiner(idle=True)
    assert report["before"] == os.SCHED_IDLE and report["helper_before"] == os.SCHED_IDLE  # threads inherit it
    assert report["left"] is True
    assert len(report["after"]) == 2 and set(report["after"].values()) == {os.SCHED_OTHER}
    # the process it started (its communication zygote) waited idle too, and leaves with it
    assert report["sub_before"] == os.SCHED_IDLE and report["sub_after"] == os.SCHED_OTHER


@pytest.mark.skipif(not idle_priority_supported(), reason="this user may not raise a thread from idle priority")
@pytest.mark.timeout(120)
def test_a_standby_starved_at_idle_priority_gets_the_cpu_back_when_the_job_finishes_and_is_not_killed_as_hung():
    """On a machine whose cores are busy, a standby process at idle priority gets almost no CPU (a few ms a second):
    too little to see the job's end and exit, and below what the hang watch takes for alive. Once the job is marked
    finished, the launcher's wait gives its workers normal priority back: the standby (here: 0.3 s of CPU to burn,
    on the one core a busy loop holds) then ends by itself with 0, and none is killed as hung."""
    from lightning_bamboo.launcher.cluster import stopping, wait_for_workers
    from lightning_bamboo.membership.keys import JobKeys

    core = {min(os.sched_getaffinity(0))}
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    cluster = Cluster("embedded", job="starved")
    try:
        os.sched_setaffinity(hog.pid, core)
        burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
        cluster.spawn_joiner("standby0", [sys.executable, "-c", burn], idle=True, cwd=REPO)
        proc = cluster.procs["standby0"]
        os.sched_setaffinity(proc.pid, core)
        time.sleep(3)
        assert proc.poll() is None and os.sched_getscheduler(proc.pid) == os.SCHED_IDLE  # starved: still starting
        cluster.store.put(JobKeys("starved").finished, json.dumps(["node0"]))  # the job ends (standby0 not in it)
        with stopping(cluster) as stop:
            hung = wait_for_workers(cluster, stop, deadline=time.monotonic() + 60, kill_hung=True)
        # it ended by itself with 0: one the launcher killed as hung would be in hung, with -9
        assert hung == set() and cluster.codes == {"standby0": 0}, (hung, cluster.codes)
    finally:
        hog.kill()
        hog.wait(timeout=30)
        cluster.close()


def test_a_standby_process_not_asked_to_idle_runs_at_normal_priority():
    report = _run_joiner(idle=False)
    assert report["before"] == os.SCHED_OTHER and report["left"] is False and report["sub_after"] == os.SCHED_OTHER
    assert set(report["after"].values()) == {os.SCHED_OTHER}


def test_local_workers_split_the_machines_cores_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    for workers, threads in ((1, cores), (cores, 1), (cores * 3, 1)):
        cluster = Cluster("embedded", job="threads", local_workers=workers)
        cluster.close()
        assert cluster.env["OMP_NUM_THREADS"] == str(threads)
    cluster = Cluster("embedded", job="threads")  # workers on machines of their own (supervise): torch's default
    cluster.close()
    assert "OMP_NUM_THREADS" not in cluster.env
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    cluster = Cluster("embedded", job="threads", local_workers=8)
    cluster.close()
    assert cluster.env["OMP_NUM_THREADS"] == "3"


# node0 marks the job finished (as Session.finish does) and exits; node1 hangs: it stops itself (SIGSTOP)
FINISH_OR_HANG = """
import os, signal
from lightning_bamboo.membership import connect
from lightning_bamboo.membership.keys import FINISHED_KEY
from lightning_bamboo.membership.keys import job_prefix
if os.environ["BAMBOO_NODE"] == "node0":
    store = connect(os.environ["BAMBOO_STORE"])
    store.put(job_prefix(os.environ["BAMBOO_JOB"]) + FINISHED_KEY, "1")
    store.close()
else:
    os.kill(os.getpid(), signal.SIGSTOP)
"""


@pytest.mark.timeout(120)  # far below the launcher's own timeout: waiting for that fails the test
def test_a_worker_that_hangs_after_the_job_finished_is_killed_and_the_launcher_returns(monkeypatch):
    """A frozen node never exits: once the job is finished the launcher gives it a grace, then kills it
    (it waited for it until its own timeout before)."""
    monkeypatch.setattr(launcher.cluster, "FINISHED_GRACE_SECONDS", 2.0)
    # the launcher's own timeout (600 s) is not what ends the frozen node: the grace after the job finished is
    codes = launch([sys.executable, "-c", FINISH_OR_HANG], 2, env={"PYTHONPATH": str(REPO)}, timeout=600)
    assert codes == {"node0": 0, "node1": -9}


SLOW_MLP = [PYTHON, "tests/scripts/slow_mlp.py", "--stages", "4", "--steps", "12", "--sleep", "0.3"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("redundancy", "kill", "plain"), [("lazy", None, True), ("eager", None, False),
                                                       ("lazy", "node2@5", False)])
def test_a_finished_job_ends_on_every_node_soon_after_its_last_step(redundancy, kill, plain):
    """Issue 41: 4 nodes with 0.3 s steps finished, then every worker spent more than 10 s in the interpreter's
    exit (full collections over the heap of torch, DeepSpeed and Lightning, 4 workers and their zygotes on 2
    cores at once); the launcher killed them as hung and reported -9 for every node (once 0, a status that
    lied). Every node still in the job exits 0, one killed mid-run is -9, the launcher's status is 0, and
    every process has ended within 15 s of the last step (the bound of a hang, not a speed target). ``plain``: each
    worker its own interpreter, as on GPUs (the exit that was slow: a fork's imports are out of the collector's way),
    else forks of the suite's preloaded server."""
    env = {**faults.environment([kill] if kill else []), PRELOAD_ENV: "" if plain else PRELOAD}
    proc = run([PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", "4", "--", *SLOW_MLP, "--redundancy", redundancy],
               timeout=200, env=env)
    ended = time.time()  # the launcher returns once every worker has exited
    lines, codes = json_reports(proc.stdout), launcher_exit_codes(proc.stdout)
    expected = {f"node{i}": 0 for i in range(4)}
    if kill:
        expected[kill.split("@")[0]] = -9
    # (every error line first: the first node to fail may have said why long before the end of the output)
    why = "\n".join(line for line in proc.stdout.splitlines() if "Error" in line) + "\n...\n" + proc.stdout[-3000:]
    assert codes == expected, why
    assert proc.returncode == 0, why
    # a node lost on purpose is no crash: no traceback, no C++ abort, no schedule table from anyone
    assert not re.search(r"Traceback|terminate called|ERROR", proc.stdout), proc.stdout[-3000:]
    if not kill:  # what runs and how it ended, Lightning's own summary, and nothing a user cannot act on
        told = [line for line in re.sub(r'\{"node": [^{}]*\}', "", proc.stdout).splitlines() if line.strip()]
        assert not [line for line in told if re.search(r"Traceback|warn|WARN", line)], "\n".join(told)
        assert len(told) <= 20, "\n".join(told)
    finished = {line["node"] for line in lines if line.get("global_step") == 12}
    assert finished == {n for n, c in expected.items() if c == 0}, proc.stdout[-3000:]
    last_step = max(line["last_step"] for line in lines if "last_step" in line)
    assert ended - last_step < 15, f"the processes ended {ended - last_step:.1f} s after the last step"


def test_after_the_grace_a_worker_that_still_uses_cpu_is_ending_and_an_idle_or_stopped_one_is_hung():
    """An interpreter's exit can take long on a loaded machine: past the grace the launcher kills only a worker
    that is stopped (a frozen node) or used no CPU in the last second, and any worker past the limit."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    sleeper = "import time; print('ready', flush=True); time.sleep(600)"
    idle = subprocess.Popen([sys.executable, "-c", sleeper], stdout=subprocess.PIPE, text=True)
    stopped = subprocess.Popen([sys.executable, "-c", sleeper], stdout=subprocess.PIPE, text=True)
    try:
        for proc in (idle, stopped):  # started and asleep: an interpreter's start-up uses CPU
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        os.kill(stopped.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{stopped.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            assert time.monotonic() < deadline, "SIGSTOP did not stop the process"
            time.sleep(0.05)
        now = time.monotonic()
        watch = launcher.HangWatch(now - launcher.FINISHED_GRACE_SECONDS - 1)
        assert not watch.hung("early", busy.pid, now - 2)  # within the grace: never
        assert watch.hung("stopped", stopped.pid, now)
        first = {name: watch.hung(name, proc.pid, now) for name, proc in (("busy", busy), ("idle", idle))}
        assert first == {"busy": False, "idle": False}  # one reading is no evidence yet
        time.sleep(1.2)
        later = time.monotonic()
        assert not watch.hung("busy", busy.pid, later) and watch.hung("idle", idle.pid, later)
        assert launcher.HangWatch(later - launcher.FINISHED_LIMIT_SECONDS - 1).hung("busy", busy.pid, later)
    finally:
        for proc in (busy, idle, stopped):
            proc.kill()
            proc.wait(30)
