"""Machines as failure domains: the job's rank order, where replica holders sit, and which traffic crosses machines.

A spot preemption takes a whole machine, with every worker on it. A stage's replica is held by its predecessor in
the pipeline (``layout.replica_holder``), so a stage whose holder shares its machine is lost with its replica: the
replicas then cost memory and traffic every step and never save one. The failover planner has one more such pair:
stage 0's node and stage ``S - 2``'s (``apart.fatal_pairs``). The launcher's ``--workers K`` names a machine's
workers ``NAME.0 .. NAME.K-1`` (``layout.machine_of``); its rank order decides the placement, because rank ``r``
runs stage ``r // pipelines`` of pipeline ``r % pipelines`` (``Layout``).

With ``P`` pipelines of ``S`` stages over ``N = P * S`` ranks, stage ``s`` of pipeline ``p`` is rank ``s * P + p``,
so the node holding rank ``r``'s replica is rank ``r - P`` (mod ``N``: the last stage's is the first's), and stage
0's partner is rank ``r + (S - 2) * P``. Every fatal pair is on two machines exactly when no two such ranks share a
machine: a colouring of the machines over the ranks, each used ``K`` times. :func:`machine_order` finds one (the
blocks or interleaved order where either does, a search for every depth at once, else ``apart.place_apart``; no
torch); :func:`fatal_conflicts`, :func:`replica_conflicts` and :func:`cross_machine_traffic` check and count any
order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.topology.apart import (
    apart_possible,
    apart_warning,
    order_of,
    place_apart,
    rows_of,
    shared_pairs,
)
from lightning_bamboo.topology.failover import fatal_stage_pairs
from lightning_bamboo.topology.layout import machine_of

#: assignments the search may try before it gives up (it needs a few hundred for 8 machines x 8 workers)
SEARCH_BUDGET = 50_000


def interleaved(machines: Sequence[str], workers: int) -> list[str]:
    """Each machine's first worker, then each one's second, ...: ``m0.0 m1.0 .. m0.1 m1.1 ..``.

    Neighbouring ranks are on different machines, which keeps every replica holder on another machine in one
    pipeline of all the ranks, and at every depth whose pipelines count is not a multiple of the machines."""
    return [f"{machine}.{i}" for i in range(workers) for machine in machines]


def blocks(machines: Sequence[str], workers: int) -> list[str]:
    """Each machine's workers together: ``m0.0 m0.1 .. m1.0 m1.1 ..``. With at least as many pipelines as workers
    per machine, every replica holder is on another machine and each stage's data-parallel group shares as few
    machines as it can: the all-reduce, the largest traffic, stays on the machine's own links."""
    return [f"{machine}.{i}" for machine in machines for i in range(workers)]


def _pipelines(nodes: int, stages: int) -> int:
    if stages < 1 or nodes % stages:
        raise BambooConfigError(
            f"the nodes must split into pipelines of `stages` stages (nodes: {nodes}, stages: {stages}); use a "
            f"depth that divides {nodes}: {[s for s in range(1, nodes + 1) if nodes % s == 0]}")
    return nodes // stages


def depths(nodes: int) -> list[int]:
    """The pipeline depths with replicas (2 stages or more) that ``nodes`` ranks can run: the divisors above 1."""
    return [s for s in range(2, nodes + 1) if nodes % s == 0]


def placement_possible(machines: int, workers: int, stages: int) -> bool:
    """Whether ``machines`` machines of ``workers`` workers can run pipelines of ``stages`` stages with every pair of
    nodes whose joint loss is fatal on two machines (a node and its replica holder; stage 0 and stage ``S - 2``).

    A machine holds at most ``stages // 2`` nodes of a pipeline and two machines at most ``stages - 1`` (from 3
    stages a ring needs 3 machines), so ``workers <= pipelines * (stages // 2)`` and, for an even depth from 4,
    ``2 * workers <= pipelines * (stages - 1)``: ``apart.apart_possible`` with every machine alike. One stage has no
    replica: nothing to place."""
    if stages < 2:
        return True
    pipelines = _pipelines(machines * workers, stages)
    return apart_possible([workers] * machines, pipelines, stages)


def replica_conflicts(order: Sequence[str], stages: int,
                      machine: Callable[[str], str] = machine_of) -> list[tuple[str, str]]:
    """``(node, holder)`` for every node whose replica holder runs on its own machine, in rank order (``order``: the
    job's nodes by rank, run as pipelines of ``stages`` stages)."""
    pipelines = _pipelines(len(order), stages)
    if stages < 2:
        return []
    n = len(order)
    return [(order[r], order[(r - pipelines) % n]) for r in range(n)
            if machine(order[r]) == machine(order[(r - pipelines) % n])]


def fatal_conflicts(order: Sequence[str], stages: int, machine: Callable[[str], str] = machine_of,
                    kept: Sequence[bool] | None = None) -> list[tuple[str, str, str]]:
    """``(node, node, machine)`` for every pair of nodes whose joint loss is fatal (``apart.fatal_pairs``) that runs
    on one machine (``order``: the job's nodes by rank, run as pipelines of ``stages`` stages; ``kept``: the stages
    whose replicas are kept, ``replicas.kept_replicas``, None: every one)."""
    _pipelines(len(order), stages)
    return list(shared_pairs(rows_of(order, stages), machine, kept))


def _rank_pairs(n: int, stages: int) -> list[tuple[int, int]]:
    """The ranks of every fatal pair of ``n`` ranks run as pipelines of ``stages`` stages."""
    pipelines = n // stages
    return [(a * pipelines + p, b * pipelines + p) for a, b in fatal_stage_pairs(stages) for p in range(pipelines)]


def _search(machines: Sequence[str], workers: int, pairs: Sequence[tuple[int, int]], budget: int) -> list[str] | None:
    """A rank order in which the two ranks of every pair in ``pairs`` run on two machines; None if the search found
    none within ``budget`` assignments. Depth first over ranks; a machine not used yet is tried only as the first
    unused one (machines are interchangeable), and machines with more workers left go first."""
    m, n = len(machines), len(machines) * workers
    colour: list[int] = [-1] * n
    left = [workers] * m
    tried = 0
    partners: list[set[int]] = [set() for _ in range(n)]
    for a, b in pairs:
        partners[a].add(b)
        partners[b].add(a)

    def fits(r: int, c: int) -> bool:
        return all(colour[q] != c for q in partners[r])

    def place(r: int, used: int) -> bool:
        nonlocal tried
        if r == n:
            return True
        candidates = sorted((c for c in range(min(used + 1, m)) if left[c]), key=lambda c: (-left[c], c))
        for c in candidates:
            tried += 1
            if tried > budget:
                return False
            if not fits(r, c):
                continue
            colour[r], left[c] = c, left[c] - 1
            if place(r + 1, max(used, c + 1)):
                return True
            colour[r], left[c] = -1, left[c] + 1
        return False

    if not place(0, 0):
        return None
    seen = [0] * m
    order = []
    for c in colour:
        order.append(f"{machines[c]}.{seen[c]}")
        seen[c] += 1
    return order


def machine_order(machines: Sequence[str], workers: int, stages: int | None = None,
                  budget: int = SEARCH_BUDGET) -> list[str]:
    """The job's nodes (``NAME.i``) in rank order, with every pair of nodes whose joint loss is fatal on two machines.

    ``stages``: the pipeline depth the job runs; every such pair is then on two machines wherever
    :func:`placement_possible` says it can be, with the fewest all-reduce links across machines of the
    :func:`blocks` and :func:`interleaved` orders, else ``apart.place_apart``'s order (where no order can, the one
    with the fewest pairs on one machine; the strategy warns at start). ``None`` (depth unknown to the launcher): an
    order that does so at every depth the nodes can run, where a search finds one (8 machines x 8 workers, 4 x 2),
    else the machine-interleaved order (3 x 2, 2 x 2: right at some depths only; the strategy warns at start when
    the depth it runs is not one of them). The interleaved order is kept wherever it already suffices, so a working
    job's ranks never move.
    """
    if workers < 1:
        raise BambooConfigError(f"a machine runs at least one worker (workers: {workers})")
    order = interleaved(machines, workers)
    if not order:
        return order  # a standby machine: no job nodes yet
    n = len(order)
    if stages is not None:
        _pipelines(n, stages)
        if stages < 2:
            return order
        safe = [o for o in (blocks(machines, workers), order) if not fatal_conflicts(o, stages)]
        if safe:  # the fewest all-reduce links across machines; the interleaved order on a tie
            return min(reversed(safe), key=lambda o: cross_machine_traffic(o, stages).allreduce[0])
        return list(order_of(place_apart(rows_of(order, stages))))
    wanted = [s for s in depths(n) if placement_possible(len(machines), workers, s)]
    if all(not fatal_conflicts(order, s) for s in wanted):
        return order
    found = _search(machines, workers, sorted({pair for s in wanted for pair in _rank_pairs(n, s)}), budget)
    return order if found is None else found


@dataclass(frozen=True)
class Traffic:
    """Links of each kind of traffic, and how many of them cross machines.

    ``activations``: consecutive stages of a pipeline (forward activations one way, their gradients back);
    ``replica``: a stage and its replica holder (the replica's refresh every step, ring-closing link included);
    ``allreduce``: the data-parallel gradient all-reduce of each stage over the pipelines, counted as a ring
    (``P`` links for ``P > 2`` pipelines, 1 for 2, none for 1)."""

    activations: tuple[int, int]  # (crossing, total)
    replica: tuple[int, int]
    allreduce: tuple[int, int]

    def describe(self) -> str:
        return ", ".join(f"{kind} {cross} of {total}" for kind, (cross, total) in
                         (("activations", self.activations), ("replica", self.replica),
                          ("all-reduce", self.allreduce))) + " links cross machines"


def cross_machine_traffic(order: Sequence[str], stages: int, machine: Callable[[str], str] = machine_of) -> Traffic:
    """Which links of the job (``order``: nodes by rank, pipelines of ``stages`` stages) cross machines."""
    pipelines = _pipelines(len(order), stages)
    grid = [[order[s * pipelines + p] for s in range(stages)] for p in range(pipelines)]

    def count(pairs: list[tuple[str, str]]) -> tuple[int, int]:
        return sum(machine(a) != machine(b) for a, b in pairs), len(pairs)

    activations = [(row[s], row[s + 1]) for row in grid for s in range(stages - 1)]
    replica = [(row[s], row[s - 1]) for row in grid for s in range(stages)] if stages > 1 else []
    ring = [(p, (p + 1) % pipelines) for p in range(pipelines if pipelines > 2 else pipelines - 1)]
    allreduce = [(grid[a][s], grid[b][s]) for s in range(stages) for a, b in ring]
    return Traffic(count(activations), count(replica), count(allreduce))


def replica_placement_report(order: Sequence[str], stages: int, machine: Callable[[str], str] = machine_of,
                             kept: Sequence[bool] | None = None) -> str:
    """One line on whether ``order`` at depth ``stages`` keeps every pair of nodes whose joint loss is fatal (a node
    and its replica holder; stage 0 and stage ``S - 2``) on two machines; where not, which pairs share a machine,
    why (no order can) and the fix."""
    if stages < 2:
        return f"depth {stages}: no replicas"
    warning = apart_warning(rows_of(order, stages), (), machine, where=f"depth {stages}",
                            fix=f"start every launcher with --stages {stages} so that it orders the nodes for this "
                                "depth", kept=kept)
    return warning or (f"depth {stages}: every replica holder is on another machine than the stage it holds, and no "
                       "machine holds two nodes whose joint loss is fatal")
