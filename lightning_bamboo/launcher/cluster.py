"""The launcher's workers on one machine: ``Cluster`` starts, watches and announces them; ``stopping`` hands a
supervisor's stop signal to them with a grace; ``wait_for_workers`` waits for them, killing a worker that is
hung after its job finished (stopped, or idle past the grace)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Union

from lightning_bamboo.errors import CONFIG_EXIT_CODE
from lightning_bamboo.membership.address import free_port
from lightning_bamboo.membership.keys import JobKeys
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
    restore_normal_priority,
)

if TYPE_CHECKING:
    from lightning_bamboo.launcher.forks import ForkedProcess, ForkServer

#: a worker's process: started as its own ``python``, or forked from the preloaded one
Worker = Union[subprocess.Popen, "ForkedProcess"]

#: keys of a restart in the same processes, under the failed job's prefix: ``offer/<node>`` (the worker
#: waits to be given the next job), ``assign/<node>`` (its rank environment and arguments there); built by
#: ``JobKeys.offer``/``JobKeys.assign``, these names are kept for importers
OFFER_KEY, ASSIGN_KEY = "offer/", "assign/"

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
    ("LOCAL_RANK", "the worker's index on its machine: i for NAME.i (--workers K), the rank (--nodes N); on a GPU "
                   "machine the GPU it uses, cuda:LOCAL_RANK of those CUDA_VISIBLE_DEVICES shows"),
    ("LOCAL_WORLD_SIZE", "the workers on this machine: K (--workers K), N (--nodes N), 1 (--node alone)"),
    ("NODE_RANK", "0: unused, BambooStrategy takes RANK and WORLD_SIZE as they are (devices = workers per machine)"),
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


#: files that exist where a GPU kernel driver is loaded (NVIDIA's, AMD's for ROCm): without any, no GPU is visible
GPU_DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")


def visible_gpus() -> int:
    """The GPUs a worker started here sees (``CUDA_VISIBLE_DEVICES`` applied); 0 on a machine without CUDA.
    Counting them creates no CUDA context; on a machine without a GPU driver it does not even load torch (1.5 s of
    the launcher's start on 2 cores)."""
    if not any(os.path.exists(path) for path in GPU_DRIVER_FILES):
        return 0
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
                 local_workers: int | None = None, *, report: bool = False, pid_dir: str | None = None,
                 local_ranks: Mapping[str, int] | None = None, preload: Sequence[str] = (),
                 preload_log: Any = subprocess.DEVNULL, preload_runs: Sequence[str] | None = None) -> None:
        """``report``: print one line per worker it starts on stderr (node, pid, rank, device); ``pid_dir``: keep
        ``<node>.pid`` there for each running worker (written atomically at its start, removed once it exited).
        ``local_ranks``: each worker's index on this machine (its ``LOCAL_RANK``, the GPU it uses); a worker not
        named there gets its rank (one machine runs the whole job), a standby node 0. ``preload``: modules that an
        interpreter imports once, whose forks are the workers (``launcher.forks``), its own output to ``preload_log``:
        those of ``python -m MODULE`` for each module of ``preload_runs`` (default: ``preload``; ``("*",)``: any
        module, and ``python SCRIPT.py`` too); other commands start as they are."""
        from lightning_bamboo.membership import connect, resolve_store
        from lightning_bamboo.membership.address import bind_env
        from lightning_bamboo.membership.lease import Registry

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
        self.local_ranks = dict(local_ranks or {})
        self.env["LOCAL_WORLD_SIZE"] = str(len(self.local_ranks) or local_workers or 1)
        self.procs: dict[str, Worker] = {}
        self.codes: dict[str, int] = {}
        self.report, self.pid_dir = report, pid_dir
        self._gpus = visible_gpus() if report else 0
        if pid_dir is not None:
            os.makedirs(pid_dir, exist_ok=True)
        self.store = connect(self.url)
        self._reporter = Registry(self.store, job, "launcher")
        self.forks: ForkServer | None = None
        if preload:
            from lightning_bamboo.launcher.forks import SHARED_ENV, ForkServer, ForkServerRefused

            runs, scripts = preload_runs, preload_runs is not None and "*" in preload_runs
            shared = self.env.get(SHARED_ENV)
            if shared:  # a server of this machine's that imported already (``forks.start_shared``), if it fits
                try:
                    self.forks = ForkServer(preload, self.env, runs=runs, scripts=scripts, address=shared)
                except ForkServerRefused as err:
                    print(f"[launcher] {err}", file=sys.stderr, flush=True)
            if self.forks is None:
                self.forks = ForkServer(preload, self.env, log=preload_log, runs=runs, scripts=scripts)

    def start_process(self, command: Sequence[str], env: Mapping[str, str], **popen: Any) -> Worker:
        """A process of ``command`` with ``env``: forked from the preloaded interpreter where it runs one of its
        modules and ``popen`` asks only for output files, else a new one (``subprocess.Popen``)."""
        if self.forks is not None and self.forks.accepts(command) and set(popen) <= {"stdout", "stderr"}:
            return self.forks.start(command, env, **popen)
        return subprocess.Popen(list(command), env=dict(env), **popen)

    def spawn(self, name: str, command: Sequence[str], rank: int, world: Sequence[str], **popen: object) -> None:
        env = {**self.env, **self.rank_env(name, rank, world)}
        env.pop(JOIN_ENV, None)
        self._start(name, command, env, popen)

    def rank_env(self, name: str, rank: int, world: Sequence[str]) -> dict[str, str]:
        """The variables a worker of ``name`` at ``rank`` of the job of ``world`` gets beside the shared ``env``."""
        return {JOB_ENV: self.job, NODES_ENV: ",".join(world), "WORLD_SIZE": str(len(world)), "RANK": str(rank),
                "LOCAL_RANK": str(self.local_ranks.get(name, rank)), NODE_ENV: name, "MASTER_ADDR": self.env["MASTER_ADDR"],
                "MASTER_PORT": self.env["MASTER_PORT"]}

    def offered(self, job: str) -> set[str]:
        """The running workers of ``job`` that offered their process to the next job (``offer_process``)."""
        return self.offered_by(job) & set(self.running)

    def offered_by(self, job: str) -> set[str]:
        """The names under which processes offered themselves in ``job`` (``offer_process``), running or not."""
        return {kv.key.rsplit("/", 1)[1] for kv in self.store.get_prefix(JobKeys(job).offer()).kvs}

    def reuse(self, name: str, args: Sequence[str], rank: int | None, world: Sequence[str], offered_in: str,
              process: str | None = None, log: str | None = None) -> None:
        """Run the worker again with ``args`` as rank ``rank`` of ``world`` in the current job, in ``name``'s
        running process (or the one that offered itself as ``process``), which offered it in job ``offered_in``:
        no new interpreter, no imports. ``rank`` None: as a node that joins the current job (standby until
        admitted, as ``spawn_joiner`` starts one). ``log``: the file its output goes to from now on."""
        env = self.rank_env(name, rank, world) if rank is not None else {
            JOB_ENV: self.job, "MASTER_ADDR": self.env["MASTER_ADDR"], "MASTER_PORT": self.env["MASTER_PORT"],
            **self._joiner_env(name)}
        assignment = {"env": env, "args": list(args), "log": log}
        self.store.put(JobKeys(offered_in).assign(process or name), json.dumps(assignment))

    def adopt(self, name: str, proc: Worker) -> None:
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
        env = {**self.env, JOB_ENV: self.job, **self._joiner_env(name)}
        self._start(name, command, env, popen)
        if idle and idle_priority_supported():
            # before the new interpreter starts a thread (its threads inherit the policy); no preexec_fn,
            # which is unsafe in a process with threads
            try:
                os.sched_setscheduler(self.procs[name].pid, os.SCHED_IDLE, os.sched_param(0))
            except ProcessLookupError:  # it died at once; poll() reports it
                pass

    def _joiner_env(self, name: str) -> dict[str, str]:
        """A standby node's environment: a job of its own (rank 0 of 1), on its own GPU of this machine."""
        return {**joiner_env(name), "LOCAL_RANK": str(self.local_ranks.get(name, 0))}

    def _start(self, name: str, command: Sequence[str], env: dict[str, str], popen: Mapping[str, object]) -> None:
        self.codes.pop(name, None)
        proc = self.procs[name] = self.start_process(command, env, **popen)
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
        self.job = self._reporter.job = job  # its keys follow the job (``Registry.keys``)
        self.env["MASTER_PORT"] = str(free_port())  # a process kept from the last job may still hold the old one

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to worker ``name``; SIGKILL and SIGSTOP reach its own child processes too (its
        communication processes): a machine that vanishes or hangs takes all of them with it."""
        proc = self.procs.get(name)
        if proc is not None:
            signal_worker(proc, sig)

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
        try:
            kv = self.store.get(JobKeys(self.job).finished)
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
            code = None if name in self.codes else proc.poll()
            if code is None:
                continue
            self.codes[name] = exited[name] = code
            self._remove_pid(name)
            if code not in (0, CONFIG_EXIT_CODE) and (announce_always or self.running):
                self.announce_loss(name, f"process exited with {code}")
        return exited

    def announce_loss(self, name: str, reason: str) -> None:
        """Tell the job's nodes now that worker ``name`` is gone (its lease would take its TTL)."""
        try:
            self._reporter.announce_loss(name, reason, timeout=2.0)
        except Exception as err:  # noqa: BLE001 - the lease is the backstop
            print(f"[launcher] could not announce the loss of {name}: {err}", file=sys.stderr)

    def close(self) -> None:
        for name, proc in self.procs.items():
            signal_worker(proc, signal.SIGKILL, wait=True)
            self._remove_pid(name)
        self.store.close()
        if self.forks is not None:
            self.forks.close()
        if self._server is not None:
            self._server.stop()


def signal_worker(proc: Worker, sig: int, wait: bool = False) -> None:
    """Send ``sig`` to a running worker; SIGKILL and SIGSTOP reach the processes it started too (its communication
    zygote and processes: a machine that vanishes or hangs takes all of them with it, and a worker that is
    ended leaves none behind). ``wait``: until it has exited."""
    if proc.poll() is not None:
        return
    family = descendants(proc.pid) if sig in (signal.SIGKILL, signal.SIGSTOP) else []
    proc.send_signal(sig)
    for pid in family:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    if wait:
        proc.wait()


#: seconds the launcher waits for a machine's first worker to reach the job's start before it starts the others anyway
FIRST_WORKER_SECONDS = 30.0


def spawn_after_first(cluster: Cluster, stop: _Stop, first: str, start: Callable[[str], None], others: Sequence[str],
                      limit: float = FIRST_WORKER_SECONDS) -> bool:
    """Start ``first``, and the ``others`` once it got past its script's checks to the job's start rendezvous
    (``JobKeys.reached``): a configuration the script refuses is then refused by one process, before the others
    start (on a GPU machine each costs seconds of imports), and a script that fails before its job fails once.
    After ``limit`` seconds without a word from it (a script that does long work first) the others start anyway.
    Returns False, starting none of them, where ``first`` failed before (refused: exit ``CONFIG_EXIT_CODE``; any
    other error: a script that fails before its job fails once) or the launcher was stopped. A ``first`` that
    exited 0 (a script that ends without a job) does not hold the others back; one SIGKILLed meanwhile (preempted,
    as any node may be) is announced lost, and the job starts without it."""
    key = JobKeys(cluster.job).reached(first)
    with contextlib.suppress(Exception):  # a key left by an earlier job of this name (etcd) must not open the gate
        cluster.store.delete(key)
    start(first)
    if not others:
        return True
    deadline = time.monotonic() + limit
    while True:
        cluster.poll()
        code = cluster.codes.get(first)
        if code == -signal.SIGKILL:  # preempted while it started, as any node can be: the job starts without it
            print(f"[launcher] {first} was killed before it reached the job's start: starting {', '.join(others)} "
                  "without it", file=sys.stderr, flush=True)
            cluster.announce_loss(first, "killed while the job started")
            break
        if code == 0:  # a script that ends without a job (``--help``, nothing left to train): the others run it too
            break
        if code is not None:
            if code != CONFIG_EXIT_CODE:  # a refusal says why itself
                print(f"[launcher] {first} ended with exit code {code} before it reached the job's start: "
                      f"{', '.join(others)} not started", file=sys.stderr, flush=True)
            return False
        if stop.signum is not None:
            return False
        with contextlib.suppress(Exception):  # a store that does not answer now: asked again
            if cluster.store.get(key) is not None:
                break
        if time.monotonic() > deadline:
            print(f"[launcher] {first} has not reached the job's start in {limit:g} s: starting {', '.join(others)}",
                  file=sys.stderr, flush=True)
            break
        time.sleep(0.05)
    for name in others:
        start(name)
    return True


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


class HangWatch:
    """Which workers are hung after the job finished: past the grace and using no CPU (or stopped), or past the limit."""

    def __init__(self, finished_at: float) -> None:
        self.finished_at = finished_at
        self.seen: dict[str, tuple[float, float | None]] = {}  # name -> (when, CPU seconds then)

    def hung(self, name: str, pid: int, now: float) -> bool:
        if now - self.finished_at <= FINISHED_GRACE_SECONDS:
            return False
        if now - self.finished_at > FINISHED_LIMIT_SECONDS:
            return True
        when, before = self.seen.get(name, (None, None))
        if when is not None and now - when < 1.0:
            return False  # /proc is read once a second per worker, not at every poll
        cpu = _cpu_seconds(pid)
        self.seen[name] = (now, cpu)
        return cpu is None or (before is not None and cpu - before < 0.02)


def wait_for_workers(cluster: Cluster, stop: _Stop, deadline: float | None = None,
                     announce_always: bool = False, kill_hung: bool = False) -> set[str]:
    """Poll until every worker exited (``Supervisor``); returns the workers killed as hung."""
    return Supervisor(cluster, stop, deadline, announce_always, kill_hung).run()


class Supervisor:
    """The launcher's wait for its workers, one concern a method, each asked at every poll: a stop whose grace is
    over (``stop_overdue``), the job's end (``job_end``: every worker at normal priority again), a refused
    configuration (``refusal``), workers still running after the end (``hung_workers``), and the launcher's own
    ``deadline`` (``past_deadline``).

    ``kill_hung``: SIGKILL the workers that run on ``FINISHED_GRACE_SECONDS`` after the job finished (a frozen node
    never exits by itself). Only ``launch`` asks for that: all its workers are ranks of the job or standby nodes it
    released; a machine's supervisor also runs standby nodes, which may still be starting when the job finishes.
    ``announce_always``: announce every worker's death in the store, also a clean exit's.
    """

    def __init__(self, cluster: Cluster, stop: _Stop, deadline: float | None = None, announce_always: bool = False,
                 kill_hung: bool = False) -> None:
        self.cluster, self.stop, self.deadline = cluster, stop, deadline
        self.announce_always, self.kill_hung = announce_always, kill_hung
        self.finished_at: float | None = None  # when this supervisor saw the job finished
        self.hung: set[str] = set()  # the workers killed as hung
        self._checked = 0.0  # the last time the store was asked whether the job finished
        self._watch: HangWatch | None = None
        self._told_refusal = False

    def run(self) -> set[str]:
        """Poll until every worker exited; returns the workers killed as hung."""
        cluster = self.cluster
        while cluster.running:
            cluster.poll(announce_always=self.announce_always)
            self.stop_overdue()
            now = time.monotonic()
            self.job_end(now)
            self.refusal()
            self.hung_workers(now)
            self.past_deadline(now)
            time.sleep(0.05)
        # a worker that exited after the last poll (``running`` reaps it) has its code recorded, and its death announced
        cluster.poll(announce_always=self.announce_always)
        return self.hung

    def _kill_all(self) -> None:
        for name in self.cluster.running:
            self.cluster.kill(name, signal.SIGKILL)

    def stop_overdue(self) -> None:
        """A stop signal's grace is over: SIGKILL every worker still running."""
        if self.stop.overdue():
            self._kill_all()

    def job_end(self, now: float) -> None:
        """With ``kill_hung``, once a second: has the job finished? Then every worker runs at normal priority again:
        a standby waiting at idle priority on busy cores gets a few milliseconds of CPU a second, too few to see the
        end and exit, and would be taken for hung."""
        if not self.kill_hung or now - self._checked <= 1.0:
            return
        self._checked = now
        if self.finished_at is None:
            self.finished_at = now if self.cluster.job_finished() else None
        if self.finished_at is not None:
            for name in self.cluster.running:
                restore_normal_priority(self.cluster.procs[name].pid)

    def refusal(self) -> None:
        """A worker refused the job's configuration (exit ``CONFIG_EXIT_CODE``): the same script refuses everywhere,
        so the others are stopped (said once)."""
        refused = [n for n, c in self.cluster.codes.items() if c == CONFIG_EXIT_CODE]
        if not refused or self.finished_at is not None or not self.cluster.running:
            return
        if not self._told_refusal:
            self._told_refusal = True
            print(f"[launcher] {refused[0]} ended with exit {CONFIG_EXIT_CODE}: the job's configuration was "
                  "refused (the worker that refused it says why): no worker trained; stopping the others",
                  file=sys.stderr, flush=True)
        self._kill_all()

    def hung_workers(self, now: float) -> None:
        """After the job finished: a worker stopped or using no CPU past the grace (``HangWatch``) is SIGKILLed."""
        if self.finished_at is None:
            return
        self._watch = self._watch or HangWatch(self.finished_at)
        for name in self.cluster.running:
            if name in self.hung or self._watch.hung(name, self.cluster.procs[name].pid, now):
                if name not in self.hung:
                    self.hung.add(name)
                    print(f"[launcher] {name} still runs {now - self.finished_at:.0f} s after the job finished, "
                          "stopped or using no CPU (hung): killed", file=sys.stderr, flush=True)
                self.cluster.kill(name, signal.SIGKILL)

    def past_deadline(self, now: float) -> None:
        if self.deadline is not None and now > self.deadline:
            raise TimeoutError(f"workers still running after the launcher's timeout: {self.cluster.running}")
