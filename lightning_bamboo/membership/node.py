"""What a worker process knows of its node: the launcher's environment variables, its address, and
leaving or rejoining the job (idle CPU priority, a fresh standby process)."""

from __future__ import annotations

import functools
import os
import threading

STORE_ENV, JOB_ENV, NODE_ENV, NODES_ENV = "BAMBOO_STORE", "BAMBOO_JOB", "BAMBOO_NODE", "BAMBOO_NODES"
#: set to "1" for a node that joins a running job: it waits as standby until a reconfiguration admits it
JOIN_ENV = "BAMBOO_JOIN"
#: the address this node's peers reach it at (process-group stores are hosted there); default loopback
ADDR_ENV = "BAMBOO_ADDR"
#: the machine (failure domain) a node runs on: its supervisor's --node
MACHINE_ENV = "BAMBOO_MACHINE"


def node_address() -> str:
    """The address this node's peers reach it at (``BAMBOO_ADDR``; loopback by default)."""
    return os.environ.get(ADDR_ENV, "127.0.0.1")


def leave_idle_priority() -> bool:
    """Give every thread of this process and of the processes it started (the communication zygote and
    its children) normal CPU priority again if it runs at idle priority (a standby node started with
    ``Cluster.spawn_joiner(idle=True)``, now admitted). True if it did."""
    if not hasattr(os, "SCHED_IDLE") or os.sched_getscheduler(0) != os.SCHED_IDLE:
        return False
    restore_normal_priority(os.getpid())
    return True


def restore_normal_priority(pid: int) -> int:
    """Move every thread of ``pid`` and of the processes it started that runs at idle CPU priority back to normal
    priority; returns how many it moved. Threads and processes started later inherit their starter's (now normal)
    policy. A standby process waits at idle priority so as to take only the cycles training leaves; once its job
    finished (the launcher calls this then), it needs the CPU to see that and exit, which on a machine whose
    cores are busy it would otherwise never get."""
    if not hasattr(os, "SCHED_IDLE"):
        return 0
    moved = 0
    for member in [pid, *descendants(pid)]:
        try:
            tasks = os.listdir(f"/proc/{member}/task")
        except OSError:  # the process ended meanwhile
            continue
        for tid in map(int, tasks):
            try:
                if os.sched_getscheduler(tid) == os.SCHED_IDLE:
                    os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                    moved += 1
            except (ProcessLookupError, PermissionError):  # the thread ended meanwhile; another user's
                pass
    return moved


def descendants(pid: int) -> list[int]:
    """The processes started by ``pid`` and by them, from ``/proc`` (empty where it cannot be read)."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found



def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (exists and is neither a zombie nor dead), from ``/proc``: also for a process
    that is not this one's child."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def die_with_parent(on: bool) -> None:
    """While ``on``, this process is SIGKILLed when the process that started it ends (a demo's pooled process
    whose controller was killed would wait a day for an assignment; a fork server whose launcher was killed
    would wait for requests). A process given a node turns it off, as every node's process runs on by itself.
    Linux only (``prctl``)."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL) if on else 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's own clean-up is all there is
        return
    if on and os.getppid() == 1:  # the parent ended before the call
        os.kill(os.getpid(), signal.SIGKILL)


def joiner_env(name: str) -> dict[str, str]:
    """The environment that makes worker ``name`` join a running job as a standby node (with the store and
    job variables of the job it joins)."""
    return {NODES_ENV: name, NODE_ENV: name, JOIN_ENV: "1", "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}


@functools.cache
def idle_priority_supported() -> bool:
    """Whether a thread of this process may go to idle CPU priority and back (Linux: root, CAP_SYS_NICE
    or RLIMIT_NICE >= 20); tried on a short-lived thread."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    result: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, name="bamboo-priority-probe")
    thread.start()
    thread.join()
    return result[0]
