"""Failover plans: which survivor serves which layers after a loss, with no data moved (pure, no torch)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from functools import cache

from lightning_bamboo.errors import BambooError, FatalLoss
from lightning_bamboo.topology.layout import machine_of, replica_holder


@dataclass(frozen=True)
class Segment:
    """Layers ``start..stop-1`` (old stage ``stage``) served by ``node`` from its ``source`` copy."""

    stage: int
    node: str
    source: str  # "own" or "replica"


@dataclass(frozen=True)
class FailoverPlan:
    """The layout after a loss: ``order[r]`` is new rank ``r``, running stage ``r // pipelines`` (layers
    ``parts[s]..parts[s+1]-1``) of pipeline ``r % pipelines``.

    ``released``: survivors left out (their pipeline lost a node while another pipeline is whole);
    they join the job again as standby nodes. ``rows``: the old pipelines the new layout is made of,
    lost nodes included (what the reconfiguration policy reasons about).
    """

    order: tuple[str, ...]
    parts: tuple[int, ...]
    segments: tuple[Segment, ...]  # every old stage, in layer order (of the pipeline that failed over)
    pipelines: int = 1
    released: tuple[str, ...] = ()
    rows: tuple[tuple[str, ...], ...] = ()

    def segments_of(self, node: str) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.node == node)


def plan_failover(nodes: Sequence[str], parts: Sequence[int], lost: Collection[str],
                  kept: Sequence[bool] | None = None) -> FailoverPlan:
    """Serve every stage of a pipeline from a survivor's own copy or its replica, with no data moved.

    ``nodes[s]`` ran stage ``s`` (layers ``parts[s]..parts[s+1]-1``) and holds the replica of
    stage ``s + 1`` (the ring: the last node holds stage 0's) where ``kept[s + 1]`` (None: every
    replica is kept; ``replicas.kept_replicas``). A lost stage is served by its
    replica holder; the holder then runs two adjacent stages, one contiguous layer range. When
    stage 0 is lost its holder is the last node, whose own stage is not adjacent to stage 0: it
    keeps stage 0 and hands its own last stage to that stage's replica holder. Raises
    ``FatalLoss`` when a lost stage's replica holder is lost too, or its replica is not kept.
    """
    stages = len(nodes)
    lost = set(lost)
    unknown = lost - set(nodes)
    if unknown:
        raise BambooError(f"lost nodes {sorted(unknown)} are not in the pipeline {list(nodes)}")
    kept = tuple(kept) if kept is not None else (True,) * stages
    if len(kept) != stages:
        raise BambooError(f"kept names one flag per stage (stages: {stages}, flags: {len(kept)})")
    serving: list[Segment] = []
    for stage, node in enumerate(nodes):
        if node not in lost:
            serving.append(Segment(stage, node, "own"))
            continue
        if not kept[stage]:
            raise FatalLoss(
                f"stage {stage} (node {node}) is lost and no replica of it is kept (redundancy='auto' keeps none of a "
                f"stage with a data-parallel copy on another machine; lost: {sorted(lost)}); this pipeline cannot "
                "fail over"
            )
        holder = nodes[replica_holder(stage, stages)]
        if holder in lost or holder == node:
            raise FatalLoss(
                f"stage {stage} (node {node}) and its replica holder (node {holder}) are both lost "
                f"(lost: {sorted(lost)}); the run must restore its last checkpoint"
            )
        serving.append(Segment(stage, holder, "replica"))
    # A node may now serve two stages that are not neighbours (only stage 0 and stage p-1): move the
    # last stage to its own replica holder.
    first, last = serving[0], serving[-1]
    if stages > 1 and first.node == last.node and any(s.node != first.node for s in serving):
        holder = nodes[replica_holder(stages - 1, stages)]
        if holder in lost or not kept[stages - 1]:
            why = f"{holder} is lost" if holder in lost else f"{holder} keeps no replica of it"
            raise FatalLoss(
                f"stage {stages - 1} must move to its replica holder {holder} (its node also serves stage 0), "
                f"but {why} (lost: {sorted(lost)}); the run must restore its last checkpoint"
            )
        serving[-1] = Segment(stages - 1, holder, "replica")
    order: list[str] = []
    new_parts = [0]
    for seg in serving:
        if order and order[-1] == seg.node:
            new_parts[-1] = parts[seg.stage + 1]
            continue
        if seg.node in order:
            raise FatalLoss(f"node {seg.node} would serve two separate layer ranges ({serving}); cannot fail over")
        order.append(seg.node)
        new_parts.append(parts[seg.stage + 1])
    return FailoverPlan(tuple(order), tuple(new_parts), tuple(serving))


@cache
def fatal_stage_pairs(stages: int, kept: tuple[bool, ...] | None = None) -> tuple[tuple[int, int], ...]:
    """The pairs of stages ``(a, b)``, ``a < b``, of one pipeline of ``stages`` stages whose nodes lost together are
    fatal: :func:`plan_failover` raises ``FatalLoss`` for them and for neither alone. Asked of the planner itself,
    pair by pair, so the rule that keeps such pairs on two machines cannot drift from it.

    With every replica kept (``kept`` None) that is a node and its replica holder (neighbours in the ring, stage
    ``p - 1`` and stage 0 included) and, from 4 stages, stage 0 and stage ``p - 2``: when stage 0 is lost its holder,
    the last node, takes it and hands its own stage to stage ``p - 2``'s node. One stage has no replica (every loss
    is fatal): no pair to keep apart; nor is there one with a stage whose loss alone ends the pipeline
    (``redundancy="auto"`` keeps no replica of a stage with a data-parallel copy on another machine, which trains on).
    """
    if stages < 2:
        return ()
    nodes = [str(s) for s in range(stages)]
    parts = range(stages + 1)

    def fatal(lost: tuple[str, ...]) -> bool:
        try:
            plan_failover(nodes, parts, lost, kept)
        except FatalLoss:
            return True
        return False

    alone = [fatal((node,)) for node in nodes]
    return tuple((a, b) for a in range(stages) for b in range(a + 1, stages)
                 if not alone[a] and not alone[b] and fatal((nodes[a], nodes[b])))


def plan_loss(
    nodes: Sequence[str], pipelines: int, parts: Sequence[int], lost: Collection[str], replicas: bool = True,
    machine: Callable[[str], str] = machine_of, kept: Sequence[bool] | None = None,
) -> FailoverPlan:
    """The layout after losing ``lost`` from ``pipelines`` data-parallel pipelines (``nodes`` in rank order).

    Every stage of a whole pipeline is also in every other one, so a pipeline that lost a node is
    dropped and the whole ones train on (no data moves; the global batch stays, each pipeline
    takes more micro-batches); its survivors are released. Only when every pipeline lost a node
    do they fail over on their own (``plan_failover``), every one whose new pipeline has the same layer split
    (the pipelines of a layout are alike): a machine holding one stage of every pipeline takes the same stage
    from each, so they all fail over and every survivor trains on. Where the splits differ, the pipelines of one
    split are kept: those keeping the most nodes (whose lost stages all have a live replica holder), of those the
    ones whose new rings put the fewest fatal pairs on one ``machine`` (a failover moves no data, so that is all
    it can choose); the others' survivors are released. ``FatalLoss`` when none can. Without ``replicas`` (``redundancy="off"``: a plain pipeline) every loss is fatal, also
    with several pipelines: such a job restarts from its checkpoint, as checkpoint-restart systems do.
    ``kept`` (per stage: whether its replica is kept, ``replicas.kept_replicas``; None: every one) limits a
    pipeline's failover to the replicas that exist: under ``redundancy="auto"`` with every stage's copies on two
    machines none is kept, so a whole pipeline trains on and a loss in every pipeline is fatal.
    """
    lost = set(lost)
    if not replicas:
        raise FatalLoss(f"lost {sorted(lost)} with redundancy='off': the job restarts from its last checkpoint")
    if pipelines == 1:
        plan = plan_failover(nodes, parts, lost, kept)
        return FailoverPlan(plan.order, plan.parts, plan.segments, rows=(tuple(nodes),))
    if len(nodes) % pipelines:
        raise BambooError(f"{len(nodes)} nodes do not form {pipelines} pipelines of equal depth")
    if unknown := lost - set(nodes):
        raise BambooError(f"lost nodes {sorted(unknown)} are not in the layout {list(nodes)}")
    stages = len(nodes) // pipelines
    rows = [tuple(nodes[s * pipelines + p] for s in range(stages)) for p in range(pipelines)]
    whole = [row for row in rows if not lost & set(row)]
    if whole:
        order = tuple(row[s] for s in range(stages) for row in whole)
        segments = tuple(Segment(s, row[s], "own") for row in whole[:1] for s in range(stages))
        released = tuple(n for n in nodes if n not in order and n not in lost)
        return FailoverPlan(order, tuple(parts), segments, len(whole), released, tuple(whole))
    problems, plans = [], []
    for row in rows:
        try:
            plans.append((row, plan_failover(row, parts, lost & set(row), kept)))
        except FatalLoss as err:
            problems.append(str(err))
    if not plans:
        raise FatalLoss(f"every pipeline lost a node and none can fail over ({'; '.join(problems)}); the run must "
                        "restore its last checkpoint")
    # the pipelines that fail over to one layer split, in rank order; of the splits, the one keeping the most nodes,
    # then the one whose new rings put the fewest fatal pairs on one machine
    alike: dict[tuple[int, ...], list[tuple[tuple[str, ...], FailoverPlan]]] = {}
    for row, plan in plans:
        alike.setdefault(plan.parts, []).append((row, plan))
    group = min(alike.values(), key=lambda g: (-sum(len(p.order) for _, p in g),
                                               sum(_shared(p.order, machine) for _, p in g)))
    depth = len(group[0][1].parts) - 1
    order = tuple(plan.order[s] for s in range(depth) for _, plan in group)
    released = tuple(n for n in nodes if n not in order and n not in lost)
    return FailoverPlan(order, group[0][1].parts, group[0][1].segments, len(group), released,
                        tuple(row for row, _ in group))


def _shared(ring: Sequence[str], machine: Callable[[str], str]) -> int:
    """How many fatal pairs of the pipeline ``ring`` (one node per stage) run on one machine."""
    return sum(machine(ring[a]) == machine(ring[b]) for a, b in fatal_stage_pairs(len(ring)))


def layout_tag(order: Sequence[str]) -> str:
    """A short name for the process group of ``order`` (the same for every node that computed the same layout)."""
    return "g" + hashlib.sha1(",".join(order).encode()).hexdigest()[:12]
