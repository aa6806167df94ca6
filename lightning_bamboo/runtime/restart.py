"""A restart in the running processes: the survivors of a fatal loss form a layout of themselves and start a fresh
stage, which the front door then loads from the last complete checkpoint.

A fatal loss is a loss that leaves a stage without any copy (a node lost with its replica holder, a loss in a job
without replicas, a loss inside a recovery): the step cannot be redone, so the job goes back to its last complete
checkpoint. The survivors need no new process for that: they agreed on the lost set in the failover that found the
loss fatal, so each computes the same new layout and forms its process group (a new generation). Two phases, so
that both doors share them: :func:`reform_after_fatal_loss` forms the group and assigns the depth; the door builds
its stage and loads the checkpoint its own way (its format and loop); :func:`restarted` then keeps the record and
logs the restart once, with its cause, the checkpoint, the step resumed from and the seconds it took.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_bamboo.engine.comm_process import CommAborted
from lightning_bamboo.errors import BambooError, FatalLoss, PeerLost
from lightning_bamboo.membership.collectives import BarrierTimeoutError
from lightning_bamboo.membership.records import Restart
from lightning_bamboo.runtime.failover import release
from lightning_bamboo.runtime.session import Session
from lightning_bamboo.runtime.stage import NodeStage
from lightning_bamboo.topology.apart import order_of, rows_of
from lightning_bamboo.topology.failover import layout_tag
from lightning_bamboo.topology.policy import PolicyConfig, shape_for
from lightning_bamboo.topology.replicas import place_for

log = logging.getLogger(__name__)


def restart_shape(survivors: int, depth: int, layers: int, micro_batches: int, per_pipeline: bool = False) -> tuple[int, int]:
    """``(pipelines, depth)`` of the restarted job: the reconfiguration policy's shape for ``survivors`` nodes
    (``topology.policy.shape_for``) with the running ``depth`` preferred: whole pipelines of it where the survivors
    make them, else a shallower depth that trains more of them in less time, else one pipeline as deep as the
    survivors when they are fewer (a lone survivor runs the whole model, without a replica, until nodes join). Never
    deeper than the model's ``layers``. ``micro_batches``: a step's over all pipelines, or each pipeline's with
    ``per_pipeline``. The survivors it leaves out stand by, to be admitted once the restarted job trains."""
    if survivors < 1:
        raise FatalLoss("no node is left after a fatal loss; start the job again from its last checkpoint")
    depth = max(1, min(depth, layers))
    config = PolicyConfig(stages=depth, layers=layers, global_micro_batches=max(1, micro_batches),
                          pipeline_micro_batches=max(1, micro_batches) if per_pipeline else None)
    return shape_for(survivors, config)


def restart_order(survivors: Sequence[str], stages: int, redundancy: str = "lazy") -> list[str]:
    """The restarted job's rank order: every node loads its stage from the checkpoint, so the survivors may sit
    anywhere; each pair of nodes whose joint loss is fatal on two machines where they allow it (``survivors`` in
    their old rank order: every survivor computes the same order; ``redundancy``: which replicas the order keeps,
    ``topology.replicas.place_for``)."""
    return list(order_of(place_for(rows_of(survivors, stages), redundancy)))


@dataclass(frozen=True)
class PendingRestart:
    """A restart between its two phases: the survivors' group is formed, the stage not yet loaded."""

    lost: tuple[str, ...]
    order: tuple[str, ...]
    stages: int
    rank: int
    world: int
    step: int
    reason: str
    started: float  # time.monotonic() when the restart began

    @property
    def pipelines(self) -> int:
        return self.world // self.stages


def reform_after_fatal_loss(stage: NodeStage, err: FatalLoss, step: int) -> PendingRestart:
    """Form the survivors' layout after ``err`` ended step ``step`` (or a collective at it): a new generation of
    the nodes that are up, this process entered in it at its rank, the depth assigned. Build the stage next.

    A node lost meanwhile makes the survivors agree on a larger set and try again. A node that the others' agreed set
    names (it was late, say: they go on without it) or that stood by when the loss came leaves the layout and stands
    by in its process (``Released``, as a node released by a failover): the rebalancer admits it once the restarted
    job trains, and its process never ends with the loss."""
    session = stage.require_session()
    started = time.monotonic()
    before = list(session.nodes)

    def attempt(suspected: set[str]) -> tuple[int, int, int, list[str]]:
        order, stages, why = restart_layout(session, before, suspected, err.standing,
                                            lambda survivors: _shape(stage, survivors), stage.config.redundancy)
        if why is not None:
            release(stage, step, why.reason, left_out=why.left_out)
        return (*session.reform(order, tag=layout_tag(order)), stages, order)

    rank, world, stages, order = session.until_agreed(
        attempt, set(), len(before), (PeerLost, BarrierTimeoutError, CommAborted),
        lambda: BambooError(f"the restart after a fatal loss did not converge after {len(before)} attempts"),
        during="while the job restarted")
    stage.enter_group(rank, world)
    stage.assign(stages)
    return PendingRestart(lost=tuple(sorted(set(before) - set(order))), order=tuple(order), stages=stages, rank=rank,
                          world=world, step=step, reason=str(err), started=started)


@dataclass(frozen=True)
class LeftOut:
    """Why a survivor has no place in the restarted layout; ``left_out``: the shape had none (not the membership)."""

    reason: str
    left_out: bool = False


def restart_layout(session: Session, before: Sequence[str], suspected: set[str], standing: Iterable[str],
                   shape: Callable[[int], tuple[int, int]], redundancy: str) -> tuple[list[str], int, LeftOut | None]:
    """One attempt's ``(order, stages, None)`` of the restarted layout, or ``([], 0, why)`` for a node that has no
    place in it and stands by: the layout of ``before`` (the old one, in rank order) without the agreed lost set
    (``suspected`` added to it) and the nodes that stand by, waiting for an admission (the rebalancer admits them
    once the job trains again): a survivor released by the failover that a loss inside it made fatal (in the lost
    set when this node's attempt saw it, else by its key: it acted on the smaller set before the loss inside was
    seen), and the joiners of a reconfiguration the loss interrupted (``standing``). ``shape(survivors)``: the
    ``(pipelines, depth)`` they restart as (:func:`restart_shape`), asked only of a node that has a place.

    Every survivor computes the same layout from the same agreed set, whenever it reads: the survivors the shape has
    no place for (the last in rank order) say so with a mark (``Session.release(left_out=True)``) that the count of
    survivors skips. The rendezvous counts it: a retry whose shape would hold one of them again (a node lost inside
    the restart) agrees at once on a set without it, as it does for a released node."""
    lost = session.decide_lost(tuple(suspected), list(before))
    away = set(standing) | session.released(session.generation + 1, left_out=False)
    order = [n for n in before if n not in lost and n not in away]
    if session.node not in order:
        return [], 0, LeftOut("the restart after a fatal loss goes on without it: "
                              + ("the survivors' lost set names it" if session.node in lost
                                 else "it stood by when the loss came"))
    pipelines, stages = shape(len(order))  # (decided after the membership: a stand-by needs no stage)
    if session.node in order[pipelines * stages:]:
        return [], 0, LeftOut(f"the restarted layout of {pipelines} x {stages} has no place for it", left_out=True)
    return restart_order(order[: pipelines * stages], stages, redundancy), stages, None


def _shape(stage: NodeStage, survivors: int) -> tuple[int, int]:
    """:func:`restart_shape` for the job ``stage`` runs: its depth, its model's layers, its step's micro-batches."""
    engine, layout = stage.require_stage()
    total = stage.host.global_micro_batches()
    micro = total if total else engine.micro_batches
    return restart_shape(survivors, layout.stages, layout.parts[-1], micro, per_pipeline=not total)


def known_checkpoint(agreed: dict[str, Any], candidates: Callable[[], Iterable[tuple[int, str]]]) -> tuple[int, str] | None:
    """``(step, path)`` of the checkpoint the nodes agreed on through the store (None: none, the job's start), if it
    is one of this node's own ``candidates()``; else ``BambooError``. The store is not trusted (docs/security.md) and
    a checkpoint is code to the loader: a value put there by anyone else cannot make a node load a file it does not
    know as one of the job's checkpoints."""
    if agreed.get("path") is None:
        return None
    path = str(agreed["path"])
    known = {p: step for step, p in candidates()}
    if path not in known:
        raise BambooError(f"the restart's agreed checkpoint {path!r} is not one this node knows of "
                          f"({sorted(known) or 'none'}); it is not loaded (a checkpoint is code to its loader)")
    return known[path], path


def restarted(stage: NodeStage, pending: PendingRestart, checkpoint: str | None, from_step: int) -> Restart:
    """The restart is done: the stage is built and ``checkpoint`` (None: the job's start) loaded at ``from_step``.
    Keeps the record (among the session's ``failovers``) and logs it, once, at WARNING."""
    session = stage.require_session()
    record = Restart(lost=pending.lost, order=pending.order, stages=pending.stages, pipelines=pending.pipelines,
                     seconds=time.monotonic() - pending.started, reason=pending.reason, step=pending.step,
                     checkpoint=checkpoint, from_step=from_step)
    session.record_failover(record)
    log.warning("%s: restarted after a fatal loss at step %d (%s) from %s, step %d, in %.2f s: %d stage(s) x %d "
                "pipeline(s) of %s", session.node, record.step, record.reason,
                checkpoint or "the job's start (no complete checkpoint; the steps before it are trained again)",
                from_step, record.seconds, record.stages, record.pipelines, ",".join(record.order))
    return record
