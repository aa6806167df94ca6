"""A local launcher whose workers survive each other's death: one process per node, a store, a watcher.

Lightning's launcher and torchrun's agent kill every worker when one dies, which is exactly
what a spot cluster must not do. This one starts ``nodes`` copies of a command with the
environment of a one-process-per-node cluster (``RANK``/``LOCAL_RANK``/``WORLD_SIZE``, the
store URL and the node names), announces a worker that dies in the membership store at once
(so the survivors learn of it in milliseconds, not after a lease expires), and returns when
every worker has exited::

    python -m lightning_bamboo.launcher --nodes 4 -- python train.py --stages 4

Across machines, run one supervisor per machine against a shared etcd, each naming its node, the
initial pipeline and the address its peers reach it at::

    python -m lightning_bamboo.launcher --store etcd://10.0.0.1:2379 --node node1 \
        --peers node0,node1,node2,node3 --addr 10.0.0.12 -- python train.py --stages 4

A supervisor started later with ``--join`` (and no ``--peers``) adds a standby node that a
``RebalanceCallback`` admits into the running job. With ``--min-nodes N`` instead of ``--peers`` the
job forms of the machines that registered first once they run N nodes (``membership.fleet``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_bamboo.engine.groups import free_port
from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.membership.node import (
    ADDR_ENV,
    JOB_ENV,
    JOIN_ENV,
    MACHINE_ENV,
    NODE_ENV,
    NODES_ENV,
    STORE_ENV,
    descendants,
    idle_priority_supported,
    joiner_env,
    leave_idle_priority,
)

#: the variables that bind process groups to an interface (set from --addr unless the user set them)
INTERFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

#: signals that stop a supervisor (a machine shutting down, Kubernetes deleting a pod, Ctrl-C)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

#: seconds a stopped supervisor's workers get to hand over their work before they are SIGKILLed
STOP_GRACE_SECONDS = 30.0


def node_names(nodes: int) -> list[str]:
    return [f"node{i}" for i in range(nodes)]


#: every variable the launcher sets in a worker's environment, with what it holds (``--help`` and the docs list them)
WORKER_ENV: tuple[tuple[str, str], ...] = (
    (NODE_ENV, "the worker's node: node0.. (--nodes), NAME (--node) or NAME.0 .. NAME.K-1 (--workers K)"),
    (NODES_ENV, "the job's initial nodes in rank order, comma-separated (a standby node: its own name)"),
    (STORE_ENV, "the membership store's URL (--store; 'embedded' becomes the private server's)"),
    (JOB_ENV, "the job's name (--job): its key space in the store"),
    (JOIN_ENV, "1 for a standby node, which waits until a reconfiguration admits it (unset otherwise)"),
    (MACHINE_ENV, "with --node: the machine (failure domain) the worker runs on"),
    (ADDR_ENV, "with --node: the address the machine's peers reach it at (--addr)"),
    ("RANK", "the worker's rank in the initial job (a standby node: 0)"),
    ("WORLD_SIZE", "the number of nodes in the initial job (a standby node: 1)"),
    ("LOCAL_RANK", "the same as RANK (a standby node: 0); on a GPU machine, the GPU the worker uses"),
    ("NODE_RANK", "0: to Lightning the job is one node whose LOCAL_RANK is the global rank"),
    ("MASTER_ADDR", "where the initial process group meets (with --node: the first node's --addr)"),
    ("MASTER_PORT", "the initial process group's port (a free one, chosen by the launcher)"),
    ("OMP_NUM_THREADS", "this machine's cores divided among its workers, when several share it, unless set"),
    ("GLOO_SOCKET_IFNAME", "the interface that owns --addr (127.0.0.1: loopback), unless one of the two is set"),
    ("NCCL_SOCKET_IFNAME", "the same interface, as =NAME"),
)


def worker_env_help() -> str:
    """``--help``'s epilog: the environment each worker gets."""
    width = max(len(name) for name, _ in WORKER_ENV)
    lines = [f"  {name:<{width}}  {meaning}" for name, meaning in WORKER_ENV]
    return "\n".join(["environment of each worker (besides the launcher's own):", *lines])


def visible_gpus() -> int:
    """The GPUs a worker started here sees (``CUDA_VISIBLE_DEVICES`` applied); 0 on a machine without CUDA.
    torch is loaded already (the package's import brings it); counting GPUs creates no CUDA context."""
    import torch

    return int(torch.cuda.device_count())


def worker_device(env: Mapping[str, str], gpus: int) -> str:
    """The device a worker with environment ``env`` uses on a machine with ``gpus`` GPUs: the GPU
    ``LOCAL_RANK`` (Lightning's and DeepSpeed's choice), or the CPU where there is none."""
    if gpus == 0:
        return "cpu"
    local = int(env.get("LOCAL_RANK", "0"))
    return f"cuda:{local}" if local < gpus else f"cuda:{local} (this machine has {gpus} GPU(s))"



class Cluster:
    """Worker processes, one per node, sharing a store; a dead worker is announced at once.

    ``spawn`` starts a node, ``kill`` sends it a real signal, ``poll`` reaps exited workers
    (announcing the unexpected deaths in the store) and returns them.
    """

    def __init__(self, store: str = "embedded", job: str = "bamboo", env: Mapping[str, str] | None = None,
                 local_workers: int | None = None, *, report: bool = False, pid_dir: str | None = None) -> None:
        """``report``: print one line per worker it starts on stderr (node, pid, rank, device); ``pid_dir``: keep
        ``<node>.pid`` there for each running worker (written atomically at its start, removed once it exited)."""
        from lightning_bamboo.membership import connect, resolve_store
        from lightning_bamboo.membership.address import bind_env
        from lightning_bamboo.membership.registry import Registry

        self.url, self._server = resolve_store(store)
        self.job = job
        self.env = {**os.environ, **(env or {}), STORE_ENV: self.url, JOB_ENV: job, "NODE_RANK": "0",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        if not any(k in self.env for k in INTERFACE_VARS):
            # gloo would bind to whatever the host name resolves to (loopback where it resolves to nothing)
            self.env.update(bind_env(self.env.get(ADDR_ENV, "127.0.0.1")))
        if local_workers and "OMP_NUM_THREADS" not in self.env:
            # ``local_workers`` processes share this machine's cores: split them (as torchrun and Lightning's
            # launchers do for the processes they start) instead of each using them all
            self.env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // local_workers))
        self.procs: dict[str, subprocess.Popen] = {}
        self.codes: dict[str, int] = {}
        self.report, self.pid_dir = report, pid_dir
        self._gpus = visible_gpus() if report else 0
        if pid_dir is not None:
            os.makedirs(pid_dir, exist_ok=True)
        self.store = connect(self.url)
        self._reporter = Registry(self.store, job, "launcher")

    def spawn(self, name: str, command: Sequence[str], rank: int, world: Sequence[str], **popen: object) -> None:
        env = {**self.env, **self._rank_env(name, rank, world)}
        env.pop(JOIN_ENV, None)
        self._start(name, command, env, popen)

    def _rank_env(self, name: str, rank: int, world: Sequence[str]) -> dict[str, str]:
        return {JOB_ENV: self.job, NODES_ENV: ",".join(world), "WORLD_SIZE": str(len(world)), "RANK": str(rank),
                "LOCAL_RANK": str(rank), NODE_ENV: name, "MASTER_ADDR": self.env["MASTER_ADDR"],
                "MASTER_PORT": self.env["MASTER_PORT"]}

    def offered(self, job: str) -> set[str]:
        """The running workers of ``job`` that offered their process to the next job (``offer_process``)."""
        return self.offered_by(job) & set(self.running)

    def offered_by(self, job: str) -> set[str]:
        """The names under which processes offered themselves in ``job`` (``offer_process``), running or not."""
        from lightning_bamboo.membership.registry import job_prefix

        return {kv.key.rsplit("/", 1)[1] for kv in self.store.get_prefix(f"{job_prefix(job)}{OFFER_KEY}").kvs}

    def reuse(self, name: str, args: Sequence[str], rank: int | None, world: Sequence[str], offered_in: str,
              process: str | None = None, log: str | None = None) -> None:
        """Run the worker again with ``args`` as rank ``rank`` of ``world`` in the current job, in ``name``'s
        running process (or the one that offered itself as ``process``), which offered it in job ``offered_in``:
        no new interpreter, no imports. ``rank`` None: as a node that joins the current job (standby until
        admitted, as ``spawn_joiner`` starts one). ``log``: the file its output goes to from now on."""
        from lightning_bamboo.membership.registry import job_prefix

        env = self._rank_env(name, rank, world) if rank is not None else {
            JOB_ENV: self.job, "MASTER_ADDR": self.env["MASTER_ADDR"], "MASTER_PORT": self.env["MASTER_PORT"],
            **joiner_env(name)}
        assignment = {"env": env, "args": list(args), "log": log}
        self.store.put(f"{job_prefix(offered_in)}{ASSIGN_KEY}{process or name}", json.dumps(assignment))

    def adopt(self, name: str, proc: subprocess.Popen) -> None:
        """Worker ``name`` runs in ``proc``, a process started elsewhere (a warm pool's, given its assignment)."""
        self.codes.pop(name, None)
        self.procs[name] = proc
        self._write_pid(name, proc.pid)

    def spawn_joiner(self, name: str, command: Sequence[str], idle: bool = False, **popen: object) -> None:
        """Start a node that joins the running job: standby until a reconfiguration admits it.

        ``idle``: start it at idle CPU priority (where this process may raise it back, see
        ``idle_priority_supported``); it returns to normal priority when admitted. For nodes that
        share the running nodes' cores (a local cluster): their start-up and wait then take only
        the cycles training leaves, as a separate machine's would take none."""
        env = {**self.env, JOB_ENV: self.job, **joiner_env(name)}
        self._start(name, command, env, popen)
        if idle and idle_priority_supported():
            # before the new interpreter starts a thread (its threads inherit the policy); no preexec_fn,
            # which is unsafe in a process with threads
            try:
                os.sched_setscheduler(self.procs[name].pid, os.SCHED_IDLE, os.sched_param(0))
            except ProcessLookupError:  # it died at once; poll() reports it
                pass

    def _start(self, name: str, command: Sequence[str], env: dict[str, str], popen: Mapping[str, object]) -> None:
        self.codes.pop(name, None)
        proc = self.procs[name] = subprocess.Popen(list(command), env=env, **popen)  # type: ignore[call-overload]
        self._write_pid(name, proc.pid)
        if self.report:
            role = ("standby (joins the running job)" if env.get(JOIN_ENV) == "1"
                    else f"rank {env['RANK']} of {env['WORLD_SIZE']}")
            print(f"[launcher] {name}: pid {proc.pid}, {role}, device {worker_device(env, self._gpus)}",
                  file=sys.stderr, flush=True)

    def _pid_file(self, name: str) -> str | None:
        return None if self.pid_dir is None else os.path.join(self.pid_dir, f"{name}.pid")

    def _write_pid(self, name: str, pid: int) -> None:
        """``<pid_dir>/<name>.pid``, written whole or not at all: a reader never sees a partial number."""
        path = self._pid_file(name)
        if path is None:
            return
        temporary = os.path.join(os.path.dirname(path), f".{name}.pid.{os.getpid()}.tmp")
        with open(temporary, "w") as f:
            f.write(f"{pid}\n")
        os.replace(temporary, path)

    def _remove_pid(self, name: str) -> None:
        path = self._pid_file(name)
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    def new_job(self, job: str) -> None:
        """Later workers (e.g. a restart from a checkpoint) use a fresh key space in the store."""
        from lightning_bamboo.membership.registry import job_prefix

        self.job = self._reporter.job = job
        self._reporter.base = job_prefix(job)
        self.env["MASTER_PORT"] = str(free_port())  # a process kept from the last job may still hold the old one

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to worker ``name``; SIGKILL and SIGSTOP reach its own child processes too (its
        communication processes): a machine that vanishes or hangs takes all of them with it."""
        proc = self.procs.get(name)
        if proc is not None and proc.poll() is None:
            family = descendants(proc.pid) if sig in (signal.SIGKILL, signal.SIGSTOP) else []
            proc.send_signal(sig)
            for pid in family:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)

    @property
    def running(self) -> list[str]:
        return [n for n, p in self.procs.items() if n not in self.codes and p.poll() is None]

    def job_finished(self) -> bool:
        """Whether a worker of the current job marked it finished (``Session.finish``)."""
        return self.finished_nodes() is not None

    def finished_nodes(self) -> frozenset[str] | None:
        """The current job's nodes when it finished (``Session.finish``): each of them must exit 0; a node the
        job lost or released before is not one. None: not finished (or the store does not answer); an empty
        set: finished, by a writer that did not name its nodes."""
        from lightning_bamboo.membership.keys import FINISHED_KEY
        from lightning_bamboo.membership.registry import job_prefix

        try:
            kv = self.store.get(f"{job_prefix(self.job)}{FINISHED_KEY}")
        except Exception:  # noqa: BLE001 - a store that does not answer: not known to be finished
            return None
        if kv is None:
            return None
        try:
            nodes = json.loads(kv.value)
        except ValueError:
            return frozenset()
        return frozenset(nodes) if isinstance(nodes, list) else frozenset()

    def poll(self, announce_always: bool = False) -> dict[str, int]:
        """Reap workers that exited since the last call; announce the ones that died.

        A death is announced while other workers of this cluster run (they are its audience), or
        always with ``announce_always`` (a one-node supervisor: its peers run elsewhere).
        """
        exited = {}
        for name, proc in self.procs.items():
            if name in self.codes or proc.poll() is None:
                continue
            self.codes[name] = exited[name] = proc.returncode
            self._remove_pid(name)
            if proc.returncode != 0 and (announce_always or self.running):
                try:  # tell the survivors now; the lease would take its TTL
                    self._reporter.announce_loss(name, f"process exited with {proc.returncode}", timeout=2.0)
                except Exception as err:  # noqa: BLE001 - the lease is the backstop
                    print(f"[launcher] could not announce the loss of {name}: {err}", file=sys.stderr)
        return exited

    def close(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            self._remove_pid(name)
        self.store.close()
        if self._server is not None:
            self._server.stop()


#: keys of a restart in the same processes, under the failed job's prefix: ``offer/<node>`` (the worker
#: waits to be given the next job), ``assign/<node>`` (its rank environment and arguments there)
OFFER_KEY, ASSIGN_KEY = "offer/", "assign/"


class _Stop:
    """What :func:`stopping` saw: the signal that stopped the supervisor, and when its grace ends."""

    signum: int | None = None
    deadline: float | None = None

    def overdue(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline


@contextlib.contextmanager
def stopping(cluster: Cluster, grace: float = STOP_GRACE_SECONDS) -> Iterator[_Stop]:
    """While a supervisor runs: a stop signal forwards SIGTERM to its workers (a preemption notice:
    under ``PreemptionCallback`` each hands its stage over at the next step boundary) instead of
    leaving them orphaned; a second signal, or ``grace`` seconds, and they are SIGKILLed (the
    caller's loop checks :meth:`_Stop.overdue`). Before any worker runs, a stop signal raises
    ``SystemExit`` (128 + the signal), which ends a wait at a rendezvous. Outside the main thread it
    changes nothing."""
    stop = _Stop()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum: int, _frame: object) -> None:
        if not cluster.running:  # nothing started yet (or left): stop here, the caller's finally cleans up
            raise SystemExit(128 + signum)
        first = stop.signum is None
        stop.signum = signum
        if first:
            stop.deadline = time.monotonic() + grace
        print(f"[launcher] {signal.Signals(signum).name}: "
              + (f"workers notified (SIGTERM), {grace:g} s to hand over" if first else "workers killed"),
              file=sys.stderr, flush=True)
        for name in cluster.running:
            cluster.kill(name, signal.SIGTERM if first else signal.SIGKILL)

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


#: seconds a worker may run on after its job was marked finished; past them it is a hung node (killed) unless it
#: still works: a process that used CPU in the last second is ending (on a loaded machine an interpreter's exit
#: can take longer), one stopped or idle is hung (a frozen node, a wait that never ends)
FINISHED_GRACE_SECONDS = 10.0
#: seconds after the job finished past which a worker is killed even while it still uses CPU
FINISHED_LIMIT_SECONDS = 120.0


def _cpu_seconds(pid: int) -> float | None:
    """CPU seconds used by ``pid`` and its descendants; None where it is stopped (SIGSTOP) or gone."""
    total = 0.0
    for i, member in enumerate([pid, *descendants(pid)]):
        try:
            with open(f"/proc/{member}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            if i == 0:
                return None
            continue
        if i == 0 and fields[0] in ("T", "t"):
            return None
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return total


class _HangWatch:
    """Which workers are hung after the job finished: past the grace and using no CPU (or stopped), or past the limit."""

    def __init__(self, finished_at: float) -> None:
        self.finished_at = finished_at
        self.seen: dict[str, tuple[float, float | None]] = {}  # name -> (when, CPU seconds then)

    def hung(self, name: str, pid: int, now: float) -> bool:
        if now - self.finished_at <= FINISHED_GRACE_SECONDS:
            return False
        if now - self.finished_at > FINISHED_LIMIT_SECONDS:
            return True
        cpu = _cpu_seconds(pid)
        when, before = self.seen.get(name, (None, None))
        if when is None or now - when >= 1.0:
            self.seen[name] = (now, cpu)
        if cpu is None:
            return True
        return when is not None and now - when >= 1.0 and before is not None and cpu - before < 0.02


def _wait_for_workers(cluster: Cluster, stop: _Stop, deadline: float | None = None,
                      announce_always: bool = False, kill_hung: bool = False) -> set[str]:
    """Poll until every worker exited; SIGKILL the rest when a stop's grace is over, or with ``kill_hung``
    when they run on ``FINISHED_GRACE_SECONDS`` after the job finished (a frozen node never exits by
    itself). Only ``launch`` asks for that: all its workers are ranks of the job; a machine's supervisor
    also runs standby nodes, which may still be starting when the job finishes. Returns the workers killed
    as hung."""
    finished_at, checked, hung = None, 0.0, set()
    watch: _HangWatch | None = None
    while cluster.running:
        cluster.poll(announce_always=announce_always)
        if stop.overdue():
            for name in cluster.running:
                cluster.kill(name, signal.SIGKILL)
        now = time.monotonic()
        if kill_hung and finished_at is None and now - checked > 1.0:
            checked = now
            finished_at = now if cluster.job_finished() else None
        if finished_at is not None:
            watch = watch or _HangWatch(finished_at)
            for name in cluster.running:
                if name in hung or watch.hung(name, cluster.procs[name].pid, now):
                    if name not in hung:
                        hung.add(name)
                        print(f"[launcher] {name} still runs {now - finished_at:.0f} s after the job finished, "
                              "stopped or using no CPU (hung): killed", file=sys.stderr, flush=True)
                    cluster.kill(name, signal.SIGKILL)
        if deadline is not None and now > deadline:
            raise TimeoutError(f"workers still running after the launcher's timeout: {cluster.running}")
        time.sleep(0.05)
    # a worker that exited after the last poll (``running`` reaps it) has its code recorded, and its death announced
    cluster.poll(announce_always=announce_always)
    return hung


def offer_process(timeout: float = 60.0) -> dict[str, Any] | None:
    """Offer this worker's process to the job that follows its failed one; wait for an assignment.

    Called by a worker whose job ended with a fatal loss (a standby node's too, once its job was
    abandoned), after releasing what the job held (``lightning_bamboo.strategy.bamboo.release_for_restart``).
    Returns ``{"env": ..., "args": ..., "log": ...}``: set the environment, write to the log file if one is
    named, and run the worker again with the arguments (a restart from the last checkpoint without a new interpreter: no imports, seconds saved
    per node), or None when no assignment came within ``timeout`` seconds (exit then; the launcher
    starts a fresh process)."""
    from lightning_bamboo.membership import connect
    from lightning_bamboo.membership.registry import job_prefix, wait_for_key

    base, node = job_prefix(os.environ[JOB_ENV]), os.environ[NODE_ENV]
    store = connect(os.environ[STORE_ENV])
    try:
        store.put(f"{base}{OFFER_KEY}{node}", "1")
        kv = wait_for_key(store, f"{base}{ASSIGN_KEY}{node}", timeout)
        if kv is None:
            return None
        assignment = dict(json.loads(kv.value))
        if JOIN_ENV not in assignment["env"]:
            # it serves the job now (a standby node or a pooled process waited at idle priority); as a standby
            # node again it waits at the priority it has until admitted
            leave_idle_priority()
            os.environ.pop(JOIN_ENV, None)  # it ran as a standby node, and runs in the pipeline now
        return assignment
    finally:
        store.close()


@dataclass(frozen=True)
class JobResult:
    """How a local job ended: each node's exit code (negative: killed by that signal), the nodes the launcher
    killed as hung after the job finished, and the job's nodes when it finished (None: it never finished;
    empty: finished without naming them)."""

    codes: Mapping[str, int]
    hung: frozenset[str] = frozenset()
    finished_nodes: frozenset[str] | None = None

    @property
    def ok(self) -> bool:
        """The launcher's exit status is 0: some node finished cleanly, every other one was killed (a node the job
        lost: SIGKILL, as a preemption or a frozen machine's end), and every node that was still in the job when it
        finished exited 0 (one the launcher had to kill as hung did not finish cleanly)."""
        codes = self.codes.values()
        if not (any(c == 0 for c in codes) and all(c in (0, -signal.SIGKILL) for c in codes)):
            return False
        return not (self.finished_nodes or frozenset()) & {n for n, c in self.codes.items() if c != 0}

    def failed_members(self) -> list[str]:
        """The nodes still in the job when it finished that did not exit 0."""
        return sorted(n for n in self.finished_nodes or () if self.codes.get(n, 0) != 0)


def run_job(
    command: Sequence[str],
    nodes: int,
    *,
    store: str = "embedded",
    job: str = "bamboo",
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    stop_grace: float = STOP_GRACE_SECONDS,
    report: bool = False,
    pid_dir: str | None = None,
) -> JobResult:
    """Run ``command`` as ``nodes`` workers on this machine; returns how each ended (``launch`` for the codes).

    ``report``: one line per worker on stderr as it starts (node, pid, rank, device); ``pid_dir``: ``<node>.pid``
    there while each worker runs."""
    if nodes < 1:
        raise BambooConfigError(f"a job needs at least one node (nodes: {nodes})")
    names = node_names(nodes)
    cluster = Cluster(store, job, env, local_workers=nodes, report=report, pid_dir=pid_dir)
    try:
        with stopping(cluster, stop_grace) as stop:
            for rank, name in enumerate(names):
                cluster.spawn(name, command, rank, names)
            hung = _wait_for_workers(cluster, stop, None if timeout is None else time.monotonic() + timeout,
                                     kill_hung=True)
        return JobResult(dict(cluster.codes), frozenset(hung), cluster.finished_nodes())
    finally:
        cluster.close()


def launch(
    command: Sequence[str],
    nodes: int,
    *,
    store: str = "embedded",
    job: str = "bamboo",
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    stop_grace: float = STOP_GRACE_SECONDS,
    report: bool = False,
    pid_dir: str | None = None,
) -> dict[str, int]:
    """Run ``command`` as ``nodes`` workers; returns each node's exit code (negative: killed by that signal)."""
    return dict(run_job(command, nodes, store=store, job=job, env=env, timeout=timeout, stop_grace=stop_grace,
                        report=report, pid_dir=pid_dir).codes)


@dataclass(frozen=True)
class NodePlan:
    """What one supervisor runs: its workers (node names), the job's initial nodes and the environment they share.

    Pure: built from the command line without contacting anything but this machine's interfaces
    (``--dry-run`` prints it).
    """

    machine: str
    workers: tuple[str, ...]
    #: the initial pipeline's nodes in rank order; empty for a standby machine (``--join``)
    nodes: tuple[str, ...]
    addr: str
    env: Mapping[str, str]
    command: tuple[str, ...]
    #: the node that publishes the initial process group's address in the store (None: a standby machine)
    publisher: str | None
    #: --min-nodes / --max-nodes: the job's nodes are known only once enough machines registered
    min_nodes: int | None = None
    max_nodes: int | None = None

    def rank(self, worker: str) -> int | None:
        return self.nodes.index(worker) if worker in self.nodes else None

    def describe(self) -> str:
        lines = [f"machine {self.machine}: {len(self.workers)} worker(s) bound to {self.env['GLOO_SOCKET_IFNAME']} "
                 f"({self.addr}); one failure domain"]
        if self.min_nodes is not None:
            most = "" if self.max_nodes is None else f", at most {self.max_nodes}"
            lines.append(f"the job forms once machines with {self.min_nodes} node(s){most} registered, in the order "
                         "they registered; a machine that comes later starts as standby")
        if self.nodes:
            lines.append(f"job nodes in rank order: {','.join(self.nodes)}; {self.publisher} publishes the process "
                         f"group's address{' (this machine)' if self.publisher in self.workers else ''}")
        for local, worker in enumerate(self.workers):
            rank = self.rank(worker)
            role = ("rank decided at the rendezvous" if self.min_nodes is not None else "standby (joins a running job)"
                    if rank is None else f"rank {rank} of {len(self.nodes)}")
            lines.append(f"  {worker}: {role}, local worker {local}")
        lines.append("environment: " + " ".join(f"{k}={v}" for k, v in sorted(self.env.items())))
        lines.append("command: " + shlex.join(self.command))
        return "\n".join(lines)


def job_nodes(machines: Sequence[str], workers: int | None) -> list[str]:
    """The job's nodes in rank order: each machine's first worker, then each one's second, ...

    Machine-interleaved, so that neighbouring ranks (a stage and its replica holder, in a
    pipeline of consecutive ranks) sit on different machines whenever there are two or more.
    """
    if workers is None:
        return list(machines)
    return [f"{machine}.{i}" for i in range(workers) for machine in machines]


def plan_node(
    command: Sequence[str],
    node: str,
    *,
    store: str,
    peers: Sequence[str] = (),
    addr: str = "127.0.0.1",
    join: bool = False,
    workers: int | None = None,
    job: str = "bamboo",
    min_nodes: int | None = None,
    max_nodes: int | None = None,
) -> NodePlan:
    """Check a supervisor's arguments and work out what it runs (``supervise`` runs it)."""
    from lightning_bamboo.membership import parse_store_url
    from lightning_bamboo.membership.address import bind_env, source_address
    from lightning_bamboo.membership.registry import job_prefix

    if store == "embedded":
        raise BambooConfigError(
            "a node on its own needs a shared store: pass --store etcd://HOST:PORT (or embedded://HOST:PORT of a "
            "running server); 'embedded' starts a private one"
        )
    parse_store_url(store)
    job_prefix(job)  # checks the name
    if [bool(peers), min_nodes is not None, join].count(True) != 1:
        raise BambooConfigError(
            f"give --peers (the initial pipeline's machines, in order), --min-nodes N (the job forms once N nodes "
            f"registered) or --join (a standby machine), exactly one (peers: {list(peers)}, min-nodes: {min_nodes}, "
            f"join: {join})"
        )
    if max_nodes is not None and min_nodes is None:
        raise BambooConfigError(f"--max-nodes {max_nodes} goes with --min-nodes N (a job formed by count)")
    if min_nodes is not None:
        from lightning_bamboo.membership.fleet import choose_roster

        choose_roster([], min_nodes, max_nodes)  # checks the bounds
    if workers is not None and workers < 1:
        raise BambooConfigError(f"--workers must be at least 1 (got {workers}); it is the number of workers on this machine")
    if len(set(peers)) != len(peers):
        raise BambooConfigError(f"--peers names a machine twice ({list(peers)}); list each machine once")
    if peers and node not in peers:
        raise BambooConfigError(f"--node {node!r} is not one of --peers {list(peers)}; list every initial node, this one too")
    if "." in node and workers is not None:
        raise BambooConfigError(f"with --workers, --node names a machine and must not contain '.' (got {node!r}): its "
                                f"workers are {node}.0 .. {node}.{workers - 1}")
    if addr == "auto":
        _, host, port = parse_store_url(store)
        addr = source_address(host, port)
    mine = job_nodes([node], workers)
    nodes = job_nodes(peers, workers)
    env = {ADDR_ENV: addr, **bind_env(addr), MACHINE_ENV: node}
    return NodePlan(machine=node, workers=tuple(mine), nodes=tuple(nodes), addr=addr, env=env,
                    command=tuple(command), publisher=nodes[0] if nodes else None,
                    min_nodes=min_nodes, max_nodes=max_nodes)


def supervise(
    command: Sequence[str],
    node: str,
    *,
    store: str,
    peers: Sequence[str] = (),
    addr: str = "127.0.0.1",
    join: bool = False,
    workers: int | None = None,
    job: str = "bamboo",
    env: Mapping[str, str] | None = None,
    timeout: float = 300.0,
    min_nodes: int | None = None,
    max_nodes: int | None = None,
    stop_grace: float = STOP_GRACE_SECONDS,
    report: bool = False,
    pid_dir: str | None = None,
) -> int:
    """Run one machine's nodes of a job whose other nodes run elsewhere (one supervisor per machine).

    Returns 0 if every worker here exited with 0, else the first other exit code. The machine of
    the first node publishes the address of the initial process group in the store (``addr``
    and a free port there); the others wait for it (at most ``timeout`` s). A worker that dies is
    announced in the store at once, so its peers fail over in milliseconds. Every process group
    binds to the interface that owns ``addr``. ``report`` and ``pid_dir`` as for ``run_job``.
    """
    from lightning_bamboo.membership.registry import job_prefix

    plan = plan_node(command, node, store=store, peers=peers, addr=addr, join=join, workers=workers, job=job,
                     min_nodes=min_nodes, max_nodes=max_nodes)
    chosen = {k: os.environ[k] for k in INTERFACE_VARS if k in os.environ}  # the user's choice wins over ours
    cluster = Cluster(store, job, {**plan.env, **chosen, **(env or {})},
                      local_workers=len(plan.workers) if len(plan.workers) > 1 else None, report=report,
                      pid_dir=pid_dir)
    try:
        with stopping(cluster, stop_grace) as stop:
            if min_nodes is not None:
                from lightning_bamboo.membership.fleet import fleet_rendezvous

                roster = fleet_rendezvous(cluster.store, job_prefix(job), node, len(plan.workers), min_nodes, max_nodes,
                                          timeout)
                join = roster is None
                plan = plan_node(command, node, store=store, peers=roster or (), addr=addr, join=join, workers=workers,
                                 job=job)
                print(f"[launcher] {node}: " + ("the job formed without this machine: standby" if join else
                                                f"the job formed of {','.join(plan.nodes)}"), file=sys.stderr)
            if join:
                for worker in plan.workers:
                    cluster.spawn_joiner(worker, command)
            else:
                key = f"{job_prefix(job)}master"
                if plan.publisher in plan.workers:
                    master = {"host": plan.addr, "port": free_port(plan.addr)}
                    cluster.store.put(key, json.dumps(master))
                else:
                    master = _wait_for_key(cluster.store, key, timeout, f"the first node {plan.publisher!r} to publish its address")
                cluster.env.update({"MASTER_ADDR": str(master["host"]), "MASTER_PORT": str(master["port"])})
                for worker in plan.workers:
                    cluster.spawn(worker, command, plan.nodes.index(worker), plan.nodes)
            _wait_for_workers(cluster, stop, announce_always=True)
        failed = [cluster.codes[w] for w in plan.workers if cluster.codes[w] != 0]
        return failed[0] if failed else 0
    finally:
        cluster.close()


def _wait_for_key(store: Any, key: str, timeout: float, what: str) -> dict[str, Any]:
    from lightning_bamboo.membership.registry import wait_for_key

    kv = wait_for_key(store, key, timeout)
    if kv is None:
        raise BambooConfigError(f"waited {timeout:g} s for {what} ({key} in the store); start that node, or raise --timeout")
    return dict(json.loads(kv.value))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_bamboo.launcher", description=__doc__.splitlines()[0],
                                     epilog=worker_env_help() + "\n\nAt each worker's start the launcher prints "
                                     "one line on stderr: '[launcher] NODE: pid PID, rank R of N, device DEVICE'.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=None, help="run this many nodes here (one machine)")
    parser.add_argument("--node", default=None, help="run this machine's node(s) here (one supervisor per machine)")
    parser.add_argument("--workers", type=int, default=None,
                        help="with --node: run K workers here, nodes NAME.0 .. NAME.K-1 (the machine is one failure domain)")
    parser.add_argument("--peers", default="", help="with --node: the initial pipeline's machines, in order, comma-separated")
    parser.add_argument("--min-nodes", type=int, default=None,
                        help="with --node, instead of --peers: the job forms of the machines registered first, once they "
                             "run this many nodes; later machines start as standby")
    parser.add_argument("--max-nodes", type=int, default=None, help="with --min-nodes: at most this many nodes in the job")
    parser.add_argument("--join", action="store_true", help="with --node: a standby machine joining a running job")
    parser.add_argument("--addr", default="127.0.0.1",
                        help="with --node: this machine's IP address that its peers reach (process groups bind to its interface); "
                        "'auto': the one it reaches the store from")
    parser.add_argument("--timeout", type=float, default=300.0, help="with --node: seconds to wait for the first node")
    parser.add_argument("--store", default="embedded", help="embedded (default) or etcd://HOST:PORT")
    parser.add_argument("--job", default="bamboo")
    parser.add_argument("--stop-grace", type=float, default=STOP_GRACE_SECONDS,
                        help="seconds the workers get to hand over after SIGTERM/SIGINT/SIGHUP to this launcher (they get "
                             "SIGTERM, a preemption notice) before they are killed; a second signal kills them at once")
    parser.add_argument("--pid-dir", default=None, metavar="DIR",
                        help="write DIR/NODE.pid (the worker's process id) for each worker while it runs: written "
                             "whole when it starts, removed once it exited (kill -9 $(cat DIR/node2.pid) preempts node2)")
    parser.add_argument("--dry-run", action="store_true", help="check the arguments, print what would run, run nothing")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the worker command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the worker command after --")
    if (args.nodes is None) == (args.node is None):
        parser.error("give --nodes N (all nodes on this machine) or --node NAME (one machine of a larger job)")
    if args.node is not None:
        peers = [p for p in args.peers.split(",") if p]
        if args.dry_run:
            plan = plan_node(command, args.node, store=args.store, peers=peers, addr=args.addr, join=args.join,
                             workers=args.workers, job=args.job, min_nodes=args.min_nodes, max_nodes=args.max_nodes)
            print(plan.describe())
            return 0
        code = supervise(command, args.node, store=args.store, peers=peers, addr=args.addr, join=args.join,
                         workers=args.workers, job=args.job, timeout=args.timeout, min_nodes=args.min_nodes,
                         max_nodes=args.max_nodes, stop_grace=args.stop_grace, report=True, pid_dir=args.pid_dir)
        print(f"[launcher] {args.node} exit code: {code}", file=sys.stderr)
        return 0 if code == 0 else 1
    if args.workers is not None:
        parser.error("--workers goes with --node (a machine of a larger job); on one machine use --nodes N")
    if args.dry_run:
        print(f"{args.nodes} node(s) here: {','.join(node_names(args.nodes))}; store {args.store}")
        print("command: " + shlex.join(command))
        return 0
    result = run_job(command, args.nodes, store=args.store, job=args.job, stop_grace=args.stop_grace, report=True,
                     pid_dir=args.pid_dir)
    print("[launcher] exit codes: " + ", ".join(f"{n}={c}" for n, c in result.codes.items()), file=sys.stderr)
    if result.failed_members():
        print(f"[launcher] the job finished with {','.join(sorted(result.finished_nodes or ()))}, and "
              f"{','.join(result.failed_members())} did not exit 0 after it (killed as hung: "
              f"{','.join(sorted(result.hung)) or 'none'}): the job did not end cleanly", file=sys.stderr)
    return 0 if result.ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BambooConfigError as err:  # a wrong argument: the rule and the fix, without a traceback
        print(f"python -m lightning_bamboo.launcher: error: {err}", file=sys.stderr)
        sys.exit(2)
