"""A local launcher whose workers survive each other's death: one process per node, a store, a watcher.

Lightning's launcher and torchrun's agent kill every worker when one dies, which is exactly
what a spot cluster must not do. This one starts ``nodes`` copies of a command with the
environment of a one-process-per-node cluster (``RANK``/``LOCAL_RANK``/``WORLD_SIZE``, the
store URL and the node names), announces a worker that dies in the membership store at once
(so the survivors learn of it in milliseconds, not after a lease expires), and returns when
every worker has exited. It starts the first worker alone and the others once that one is past its
script's checks (at the job's start rendezvous), so a refused configuration or a script that fails before its
job is met by one process, not by every node::

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
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_bamboo.errors import CONFIG_EXIT_CODE, BambooConfigError
from lightning_bamboo.launcher.cluster import (  # noqa: F401 - the launcher's API, as before
    ASSIGN_KEY,
    FINISHED_GRACE_SECONDS,
    FINISHED_LIMIT_SECONDS,
    INTERFACE_VARS,
    OFFER_KEY,
    STOP_GRACE_SECONDS,
    STOP_SIGNALS,
    WORKER_ENV,
    Cluster,
    _cpu_seconds,
    _HangWatch,
    _Stop,
    _wait_for_workers,
    node_names,
    spawn_after_first,
    stopping,
    visible_gpus,
    worker_device,
    worker_env_help,
)
from lightning_bamboo.membership.address import free_port
from lightning_bamboo.membership.node import (
    ADDR_ENV,
    JOB_ENV,
    JOIN_ENV,
    MACHINE_ENV,
    NODE_ENV,
    STORE_ENV,
    leave_idle_priority,
)


def offer_process(timeout: float = 60.0) -> dict[str, Any] | None:
    """Offer this worker's process to the job that follows its failed one; wait for an assignment.

    Called by a worker whose job ended with a fatal loss (a standby node's too, once its job was
    abandoned), after releasing what the job held (``lightning_bamboo.strategy.bamboo.release_for_restart``).
    Returns ``{"env": ..., "args": ..., "log": ...}``: set the environment, write to the log file if one is
    named, and run the worker again with the arguments (a restart from the last checkpoint without a new interpreter: no imports, seconds saved
    per node), or None when no assignment came within ``timeout`` seconds (exit then; the launcher
    starts a fresh process)."""
    from lightning_bamboo.membership import connect
    from lightning_bamboo.membership.keys import JobKeys
    from lightning_bamboo.membership.registry import wait_for_key

    keys, node = JobKeys(os.environ[JOB_ENV]), os.environ[NODE_ENV]
    store = connect(os.environ[STORE_ENV])
    try:
        store.put(keys.offer(node), "1")
        kv = wait_for_key(store, keys.assign(node), timeout)
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
    preload: Sequence[str] = (),
) -> JobResult:
    """Run ``command`` as ``nodes`` workers on this machine; returns how each ended (``launch`` for the codes).

    ``report``: one line per worker on stderr as it starts (node, pid, rank, device); ``pid_dir``: ``<node>.pid``
    there while each worker runs; ``preload``: see :func:`check_preload`."""
    if nodes < 1:
        raise BambooConfigError(f"a job needs at least one node (nodes: {nodes})")
    check_preload(preload)
    names = node_names(nodes)
    cluster = Cluster(store, job, env, local_workers=nodes, report=report, pid_dir=pid_dir, preload=preload,
                      preload_runs=("*",))
    try:
        with stopping(cluster, stop_grace) as stop:
            spawn_after_first(cluster, stop, names[0], lambda name: cluster.spawn(name, command, names.index(name), names),
                              names[1:])
            hung = _wait_for_workers(cluster, stop, None if timeout is None else time.monotonic() + timeout,
                                     kill_hung=True)
        return JobResult(dict(cluster.codes), frozenset(hung), cluster.finished_nodes())
    finally:
        cluster.close()


#: the environment variable that gives ``--preload`` its default (a comma-separated list of modules)
PRELOAD_ENV = "BAMBOO_PRELOAD"


def check_preload(modules: Sequence[str]) -> None:
    """``preload``: modules (``torch,lightning,deepspeed``) that one interpreter imports once; each worker whose
    command is ``python SCRIPT.py`` or ``python -m MODULE`` (this python) starts as a fork of it instead of
    importing them again (4-5 s of a core per worker, per restart in a process of its own). For machines without
    GPUs: refused where CUDA devices are visible, since the import may initialise the CUDA driver, which a forked
    worker then cannot use; refused for a module this python cannot find."""
    if not modules:
        return
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m.split(".")[0]) is None]
    if missing:
        raise BambooConfigError(f"--preload names {', '.join(missing)}, which this python ({sys.executable}) cannot "
                                f"import; install it or leave it out of --preload")
    gpus = visible_gpus()
    if gpus:
        raise BambooConfigError(f"--preload forks every worker from one interpreter that imported "
                                f"{', '.join(modules)}, which on a machine with GPUs ({gpus} visible) may initialise "
                                f"the CUDA driver, which a forked worker cannot use; start the workers without "
                                f"--preload (and unset {PRELOAD_ENV}) here")


def launch(command: Sequence[str], nodes: int, **options: Any) -> dict[str, int]:
    """Run ``command`` as ``nodes`` workers (``options``: ``run_job``'s); returns each node's exit code (negative:
    killed by that signal)."""
    return dict(run_job(command, nodes, **options).codes)


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
    #: --stages: the pipeline depth the nodes are ordered for (None: every depth where one order serves them all)
    stages: int | None = None

    def rank(self, worker: str) -> int | None:
        return self.nodes.index(worker) if worker in self.nodes else None

    def local_rank(self, worker: str) -> int:
        """The worker's index on this machine: its ``LOCAL_RANK``, hence its GPU (``cuda:i`` for ``NAME.i``)."""
        return self.workers.index(worker)

    def worker_env(self, worker: str) -> dict[str, str]:
        """What the launcher sets for ``worker`` besides the job's store and name: ``RANK``/``WORLD_SIZE`` global (a
        standby node: 0 and 1), ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` of this machine (``Cluster`` sets the same)."""
        rank = self.rank(worker)
        return {**self.env, "RANK": str(rank or 0), "WORLD_SIZE": str(len(self.nodes) if rank is not None else 1),
                "LOCAL_RANK": str(self.local_rank(worker)), "LOCAL_WORLD_SIZE": str(len(self.workers))}

    def placement(self) -> str:
        """Where the replica holders sit relative to the machines (the machine is one failure domain)."""
        from lightning_bamboo.topology.machines import depths, fatal_conflicts, replica_placement_report

        if len(self.workers) < 2 or not self.nodes:
            return "replicas: one worker per machine, every replica holder on another machine"
        if self.stages is not None:
            return "replicas at " + replica_placement_report(self.nodes, self.stages)
        safe = [s for s in depths(len(self.nodes)) if not fatal_conflicts(self.nodes, s)]
        unsafe = [s for s in depths(len(self.nodes)) if s not in safe]
        return (f"replicas: every holder on another machine, and no machine holding two nodes whose joint loss is "
                f"fatal, at depth {','.join(map(str, safe)) or 'none'}"
                + (f"; not at depth {','.join(map(str, unsafe))} (pass --stages D to order the nodes for depth D)"
                   if unsafe else ""))

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
            lines.append(f"  {worker}: {role}, LOCAL_RANK {local} (GPU {local} on a GPU machine)")
        if self.min_nodes is None:
            lines.append(self.placement())
        lines.append("environment: " + " ".join(f"{k}={v}" for k, v in sorted(self.env.items())))
        lines.append("command: " + shlex.join(self.command))
        return "\n".join(lines)


def job_nodes(machines: Sequence[str], workers: int | None, stages: int | None = None) -> list[str]:
    """The job's nodes in rank order, every pair of nodes whose joint loss is fatal (a node and its replica holder;
    stage 0 and stage ``S - 2``) on two machines where any order can do it.

    ``stages``: the depth the job runs (``--stages``); without it, an order right at every depth where one
    exists, else machine-interleaved (``m0.0 m1.0 .. m0.1 m1.1 ..``): see ``topology.machines.machine_order``.
    """
    if workers is None:
        return list(machines)
    from lightning_bamboo.topology.machines import machine_order

    return machine_order(machines, workers, stages)


def resolve_workers(value: str | int | None, gpus: int) -> int | None:
    """``--workers``: a number, or ``auto``: this machine's GPU count (``gpus``, ``torch.cuda.device_count()``).
    ``auto`` on a machine without a GPU is refused: one worker there would hide a driver that is not loaded."""
    if value is None or isinstance(value, int):
        return value
    if value == "auto":
        if gpus < 1:
            raise BambooConfigError(
                "--workers auto starts one worker per GPU, and this machine has none (torch.cuda.device_count() is "
                "0: no GPU, no driver, or CUDA_VISIBLE_DEVICES hides them); pass --workers K (e.g. the number of "
                "core groups) on a CPU machine")
        return gpus
    try:
        return int(value)
    except ValueError:
        raise BambooConfigError(f"--workers takes a number or 'auto' (one worker per GPU), not {value!r}") from None


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
    stages: int | None = None,
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
    if stages is not None and stages < 1:
        raise BambooConfigError(f"--stages must be at least 1 (got {stages}); it is the job's pipeline depth")
    mine = [f"{node}.{i}" for i in range(workers)] if workers is not None else [node]
    nodes = job_nodes(peers, workers, stages)
    env = {ADDR_ENV: addr, **bind_env(addr), MACHINE_ENV: node}
    return NodePlan(machine=node, workers=tuple(mine), nodes=tuple(nodes), addr=addr, env=env,
                    command=tuple(command), publisher=nodes[0] if nodes else None,
                    min_nodes=min_nodes, max_nodes=max_nodes, stages=stages)


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
    stages: int | None = None,
    preload: Sequence[str] = (),
) -> int:
    """Run one machine's nodes of a job whose other nodes run elsewhere (one supervisor per machine).

    Returns the job's outcome as this machine saw it (``launcher.outcome.machine_status``): 0 once the job finished
    with every worker here that was still in it exiting 0 (the others exited 0 or were SIGKILLed, a vanished node),
    ``CONFIG_EXIT_CODE`` if one refused the job's configuration, a failed worker's status, or 1 when the job ended
    without finishing. The machine of
    the first node publishes the address of the initial process group in the store (``addr``
    and a free port there); the others wait for it (at most ``timeout`` s). A worker that dies is
    announced in the store at once, so its peers fail over in milliseconds. Every process group
    binds to the interface that owns ``addr``. ``report``, ``pid_dir`` and ``preload`` as for ``run_job``.
    """
    from lightning_bamboo.membership.keys import JobKeys, job_prefix

    plan = plan_node(command, node, store=store, peers=peers, addr=addr, join=join, workers=workers, job=job,
                     min_nodes=min_nodes, max_nodes=max_nodes, stages=stages)
    check_preload(preload)
    chosen = {k: os.environ[k] for k in INTERFACE_VARS if k in os.environ}  # the user's choice wins over ours
    cluster = Cluster(store, job, {**plan.env, **chosen, **(env or {})},
                      local_workers=len(plan.workers) if len(plan.workers) > 1 else None, report=report,
                      pid_dir=pid_dir, local_ranks={w: plan.local_rank(w) for w in plan.workers}, preload=preload,
                      preload_runs=("*",))
    try:
        with stopping(cluster, stop_grace) as stop:
            if min_nodes is not None:
                from lightning_bamboo.membership.fleet import fleet_rendezvous

                roster = fleet_rendezvous(cluster.store, job_prefix(job), node, len(plan.workers), min_nodes, max_nodes,
                                          timeout)
                join = roster is None
                plan = plan_node(command, node, store=store, peers=roster or (), addr=addr, join=join, workers=workers,
                                 job=job, stages=stages)
                print(f"[launcher] {node}: " + ("the job formed without this machine: standby" if join else
                                                f"the job formed of {','.join(plan.nodes)}"), file=sys.stderr)
            if join:
                for worker in plan.workers:
                    cluster.spawn_joiner(worker, command)
            else:
                key = JobKeys(job).master
                if plan.publisher in plan.workers:
                    master = {"host": plan.addr, "port": free_port(plan.addr)}
                    cluster.store.put(key, json.dumps(master))
                else:
                    master = _wait_for_key(cluster.store, key, timeout, f"the first node {plan.publisher!r} to publish its address")
                cluster.env.update({"MASTER_ADDR": str(master["host"]), "MASTER_PORT": str(master["port"])})
                if report and plan.publisher in plan.workers:
                    print(f"[launcher] {plan.placement()}", file=sys.stderr, flush=True)
                spawn_after_first(cluster, stop, plan.workers[0],
                                  lambda worker: cluster.spawn(worker, command, plan.nodes.index(worker), plan.nodes),
                                  plan.workers[1:])
            _wait_for_workers(cluster, stop, announce_always=True)
        from lightning_bamboo.launcher.outcome import machine_status

        return machine_status(cluster, plan.workers)
    finally:
        cluster.close()


def _wait_for_key(store: Any, key: str, timeout: float, what: str) -> dict[str, Any]:
    from lightning_bamboo.membership.registry import wait_for_key

    kv = wait_for_key(store, key, timeout)
    if kv is None:
        raise BambooConfigError(f"waited {timeout:g} s for {what} ({key} in the store); start that node, or raise --timeout")
    return dict(json.loads(kv.value))


def store_with_credentials(args: argparse.Namespace) -> str:
    """``--store`` with ``--cacert``/``--cert``/``--key``/``--user``/``--password-file`` in its query: the URL
    the workers inherit names them (paths and a name; the password stays in the environment or its file)."""
    from lightning_bamboo.membership.credentials import with_credentials

    options = {name: getattr(args, name) for name in ("cacert", "cert", "key", "user", "password_file")}
    if not any(options.values()):
        return str(args.store)
    if not str(args.store).startswith("etcd://"):
        given = ", ".join(f"--{k.replace('_', '-')}" for k, v in options.items() if v)
        raise BambooConfigError(f"{given} are etcd's credentials; give them with --store etcd://HOST:PORT (the "
                                f"embedded store takes a shared token from $BAMBOO_STORE_TOKEN instead)")
    return with_credentials(str(args.store), **options)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_bamboo.launcher", description=__doc__.splitlines()[0],
                                     epilog=worker_env_help() + "\n\nOne worker per GPU: --workers K (or auto) gives "
                                     "worker NAME.i LOCAL_RANK i, so it trains on cuda:i; pass Trainer(devices=K) "
                                     "(or LOCAL_WORLD_SIZE), the GPUs per machine, as everywhere in Lightning.\n"
                                     "At each worker's start the launcher prints one line on stderr: '[launcher] "
                                     "NODE: pid PID, rank R of N, device DEVICE'.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=None, help="run this many nodes here (one machine)")
    parser.add_argument("--node", default=None, help="run this machine's node(s) here (one supervisor per machine)")
    parser.add_argument("--workers", default=None, metavar="K|auto",
                        help="with --node: run K workers here, nodes NAME.0 .. NAME.K-1 (the machine is one failure "
                             "domain); worker NAME.i gets LOCAL_RANK i, GPU i on a GPU machine. 'auto': one per GPU "
                             "(torch.cuda.device_count()); refused on a machine without GPUs")
    parser.add_argument("--stages", type=int, default=None,
                        help="with --node: the pipeline depth the job runs, so that the nodes are ordered with every "
                             "stage's replica holder on another machine at that depth (default: an order that does it "
                             "at every depth where one exists; --dry-run says which)")
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
    parser.add_argument("--store", default="embedded", help="embedded (default) or etcd://HOST:PORT (credentials: "
                        "below, or in the URL's query under the same names: etcd://HOST:PORT?cacert=CA.pem&user=NAME)")
    for option, what in (("cacert", "the CA certificate that signed etcd's (TLS)"),
                         ("cert", "this machine's client certificate for etcd (TLS, with --key)"),
                         ("key", "the client certificate's private key"),
                         ("user", "the etcd user the job runs as; its password from $ETCDCTL_PASSWORD or --password-file, "
                                  "never the command line"),
                         ("password-file", "a file holding the etcd user's password")):
        parser.add_argument(f"--{option}", default=None, metavar="NAME" if option == "user" else "PATH",
                            help=f"etcd: {what} (etcdctl's name; docs/security.md)")
    parser.add_argument("--job", default="bamboo")
    parser.add_argument("--stop-grace", type=float, default=STOP_GRACE_SECONDS,
                        help="seconds the workers get to hand over after SIGTERM/SIGINT/SIGHUP to this launcher (they get "
                             "SIGTERM, a preemption notice) before they are killed; a second signal kills them at once")
    parser.add_argument("--pid-dir", default=None, metavar="DIR",
                        help="write DIR/NODE.pid (the worker's process id) for each worker while it runs: written "
                             "whole when it starts, removed once it exited (kill -9 $(cat DIR/node2.pid) preempts node2)")
    parser.add_argument("--preload", default=os.environ.get(PRELOAD_ENV, ""), metavar="MODULES",
                        help="comma-separated modules (e.g. torch,lightning,deepspeed) imported once by one interpreter "
                             "whose forks are the workers (python SCRIPT.py or python -m MODULE): each starts in "
                             f"milliseconds instead of seconds of imports. Machines without GPUs only. Default: ${PRELOAD_ENV}. With "
                             "$BAMBOO_FORK_SERVER, at that shared interpreter (launcher.forks.start_shared) if it fits")
    parser.add_argument("--dry-run", action="store_true", help="check the arguments, print what would run, run nothing")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the worker command")
    args = parser.parse_args(argv)
    args.store = store_with_credentials(args)
    preload = [m.strip() for m in args.preload.split(",") if m.strip()]
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the worker command after --")
    if (args.nodes is None) == (args.node is None):
        parser.error("give --nodes N (all nodes on this machine) or --node NAME (one machine of a larger job)")
    if args.node is not None:
        peers = [p for p in args.peers.split(",") if p]
        args.workers = resolve_workers(args.workers, visible_gpus() if args.workers == "auto" else 0)
        if args.dry_run:
            plan = plan_node(command, args.node, store=args.store, peers=peers, addr=args.addr, join=args.join,
                             workers=args.workers, job=args.job, min_nodes=args.min_nodes, max_nodes=args.max_nodes,
                             stages=args.stages)
            print(plan.describe())
            return 0
        code = supervise(command, args.node, store=args.store, peers=peers, addr=args.addr, join=args.join,
                         workers=args.workers, job=args.job, timeout=args.timeout, min_nodes=args.min_nodes,
                         max_nodes=args.max_nodes, stop_grace=args.stop_grace, report=True, pid_dir=args.pid_dir,
                         stages=args.stages, preload=preload)
        print(f"[launcher] {args.node} exit code: {code}", file=sys.stderr)
        return code if code in (0, CONFIG_EXIT_CODE) else 1
    if args.workers is not None or args.stages is not None:
        parser.error("--workers and --stages go with --node (a machine of a larger job); on one machine use --nodes N "
                     "(worker i gets LOCAL_RANK i, GPU i on a GPU machine)")
    if args.dry_run:
        print(f"{args.nodes} node(s) here: {','.join(node_names(args.nodes))}; store {args.store}")
        print("command: " + shlex.join(command))
        return 0
    result = run_job(command, args.nodes, store=args.store, job=args.job, stop_grace=args.stop_grace, report=True,
                     pid_dir=args.pid_dir, preload=preload)
    print("[launcher] exit codes: " + ", ".join(f"{n}={c}" for n, c in result.codes.items()), file=sys.stderr)
    if CONFIG_EXIT_CODE in result.codes.values():
        return CONFIG_EXIT_CODE  # refused before it trained: the status of a wrong input, not of a failed run
    if result.failed_members():
        print(f"[launcher] the job finished with {','.join(sorted(result.finished_nodes or ()))}, and "
              f"{','.join(result.failed_members())} did not exit 0 after it (killed as hung: "
              f"{','.join(sorted(result.hung)) or 'none'}): the job did not end cleanly", file=sys.stderr)
    return 0 if result.ok else 1
