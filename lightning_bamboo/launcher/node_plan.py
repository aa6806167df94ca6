"""What one machine's supervisor runs: its workers, the job's nodes in rank order (every pair whose joint loss is
fatal on two machines), the environment they share; pure, from the command line (``--dry-run`` prints it)."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.membership.node import ADDR_ENV, MACHINE_ENV


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
    #: --store and --job: the job's store and name
    store: str = ""
    job: str = "bamboo"

    @property
    def joining(self) -> bool:
        """A standby machine (``--join``, or a job formed by count without it): its workers wait for an admission."""
        return not self.nodes and self.min_nodes is None

    def formed(self, roster: Sequence[str] | None) -> NodePlan:
        """This plan once a job formed by count (``--min-nodes``) chose its machines, ``roster`` (None: the job formed
        without this machine, which then stands by)."""
        # --workers as given: None where the machine's one worker carries its name
        count = None if self.workers == (self.machine,) else len(self.workers)
        nodes = tuple(job_nodes(roster, count, self.stages)) if roster else ()
        return replace(self, nodes=nodes, publisher=nodes[0] if nodes else None, min_nodes=None, max_nodes=None)

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
    from lightning_bamboo.membership.keys import job_prefix

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
                    min_nodes=min_nodes, max_nodes=max_nodes, stages=stages, store=store, job=job)
