"""Which stages keep a successor replica: every one under ``lazy`` and ``eager``; under ``auto`` only those with no
data-parallel copy on another machine (pure, no torch).

A replica exists so that a lost stage can be served again at once. With several data-parallel pipelines, every
stage already has a copy in each of the other pipelines (the same weights and optimizer state, kept equal by the
gradient all-reduce); where one of those copies runs on another machine (``layout.machine_of``: a machine is one
failure domain), the loss of a node never takes every copy of its stage, and the failover planner drops the damaged
pipeline while the whole ones train on (``failover.plan_loss``): its replica would be a second copy of what the job
has. ``redundancy="auto"`` keeps a replica of stage ``s`` (on its predecessor, ``layout.replica_holder``, in every
pipeline) only where every copy of ``s`` runs on one machine. With one pipeline that is every stage (``auto`` is
``lazy``); with pipelines whose copies of each stage sit on different machines (the launcher's machine-interleaved
order, or one node per machine), none.

One more replica is needed for a kept one to serve: when stage 0 is lost its holder is the last node, which then
runs stage 0 and its own last stage, not adjacent, and hands the last stage to stage ``S - 2``'s node from that
node's replica of it (``failover.plan_failover``). So from 3 stages, keeping stage 0's replica keeps stage
``S - 1``'s too. Every rank, the failover planner and the reconfiguration policy ask :func:`kept_replicas` of the
same layout and node order, so they agree on where replicas are without a message.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.topology.apart import Grid, place_apart
from lightning_bamboo.topology.layout import REDUNDANCY_MODES, Layout, machine_of

Machine = Callable[[str], str]


def kept_in_rows(rows: Sequence[Sequence[str]], redundancy: str, machine: Machine = machine_of) -> tuple[bool, ...]:
    """Per stage ``s`` of the pipelines ``rows`` (``rows[p][s]``: the node running stage ``s`` of pipeline ``p``):
    whether its replica is kept (by stage ``s - 1``'s node of every pipeline; stage 0's by the last stage's).

    ``"off"``: none; ``"lazy"``, ``"eager"``: every stage; ``"auto"``: the stages whose copies all run on one
    machine, and with stage 0 (from 3 stages) the last stage too (see the module's docstring). One stage: none (no
    successor to hold)."""
    if redundancy not in REDUNDANCY_MODES:
        raise BambooConfigError(f"redundancy must be one of {REDUNDANCY_MODES} (redundancy: {redundancy!r})")
    if not rows or not rows[0]:
        raise BambooConfigError("a layout needs at least one pipeline of one stage (got none)")
    stages = len(rows[0])
    if any(len(row) != stages for row in rows):
        raise BambooConfigError(f"every pipeline needs the same number of stages (got {[len(r) for r in rows]})")
    if stages < 2 or redundancy == "off":
        return (False,) * stages
    if redundancy != "auto":
        return (True,) * stages
    kept = [len({machine(row[s]) for row in rows}) == 1 for s in range(stages)]
    if kept[0] and stages >= 3:
        kept[-1] = True  # stage 0's failover hands the last stage to stage S - 2's node from its replica
    return tuple(kept)


def kept_replicas(order: Sequence[str], stages: int, redundancy: str, machine: Machine = machine_of) -> tuple[bool, ...]:
    """:func:`kept_in_rows` of the job's nodes in rank order (``order[r]`` runs stage ``r // pipelines`` of pipeline
    ``r % pipelines``, as ``Layout`` numbers them) run as pipelines of ``stages`` stages."""
    if stages < 1 or not order or len(order) % stages:
        raise BambooConfigError(f"{len(order)} nodes do not form pipelines of {stages} stages; give a multiple of "
                                f"{stages} nodes")
    pipelines = len(order) // stages
    rows = [[order[s * pipelines + p] for s in range(stages)] for p in range(pipelines)]
    return kept_in_rows(rows, redundancy, machine)


def replica_peers(layout: Layout, rank: int, kept: Sequence[bool]) -> tuple[int | None, int | None]:
    """``(holder, owner)`` of ``rank`` in ``layout``: the rank that keeps this rank's stage's replica (its
    predecessor in its pipeline; None where that replica is not kept), and the rank whose stage this rank keeps a
    replica of (its successor; None where this rank keeps none)."""
    stage, pipeline = layout.stage_of_rank(rank), layout.pipeline_of_rank(rank)
    before = ((stage - 1) % layout.stages) * layout.pipelines + pipeline
    after = ((stage + 1) % layout.stages) * layout.pipelines + pipeline
    return (before if kept[stage] else None), (after if kept[(stage + 1) % layout.stages] else None)


def held_stage(layout: Layout, rank: int, kept: Sequence[bool]) -> int | None:
    """The stage whose replica ``rank`` keeps (its successor's), or None."""
    successor = (layout.stage_of_rank(rank) + 1) % layout.stages
    return successor if layout.stages > 1 and kept[successor] else None


def describe_kept(kept: Sequence[bool], redundancy: str) -> str:
    """One line for the log: which stages keep a replica, and why under ``auto``."""
    stages = [s for s, k in enumerate(kept) if k]
    if redundancy != "auto":
        return f"redundancy {redundancy!r}: " + ("replicas of every stage" if stages else "no replicas")
    if not stages:
        return ("redundancy 'auto': no replicas (every stage has a data-parallel copy on another machine: a loss drops "
                "the damaged pipeline and the whole ones train on)")
    if len(stages) == len(kept):
        return "redundancy 'auto': replicas of every stage (as 'lazy': no stage has a copy on another machine)"
    return (f"redundancy 'auto': replicas of stages {stages} only (their copies share one machine; the other stages "
            f"have a data-parallel copy on another machine)")


def place_for(rows: Sequence[Sequence[str]], redundancy: str, spare: Sequence[str] = (), machine: Machine = machine_of,
              holds: Mapping[str, int] | None = None) -> Grid:
    """``rows`` (the pipelines) placed for ``redundancy``: under ``auto``, several pipelines whose copies of every
    stage already span two machines keep no replica, so there is no pair of nodes whose joint loss a failover could
    not serve to keep apart, and the rows stay as they are (moving nodes would put copies on one machine and bring
    the replicas back); otherwise ``apart.place_apart`` keeps each such pair on two machines."""
    if redundancy == "auto" and len(rows) > 1 and not any(kept_in_rows(rows, redundancy, machine)):
        return tuple(tuple(row) for row in rows)
    return place_apart(rows, spare, machine, holds)
