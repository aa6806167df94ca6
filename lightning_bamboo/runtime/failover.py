"""Failover: the survivors of a loss agree on the lost nodes and rebuild from their own stages and replicas."""

from __future__ import annotations

import faulthandler
import logging
import time
from typing import Any, NoReturn

from lightning_bamboo.engine.comm_process import CommAborted
from lightning_bamboo.engine.replica_location import must_fit
from lightning_bamboo.engine.ties import held_layers
from lightning_bamboo.errors import BambooError, FatalLoss, PeerLost, Released
from lightning_bamboo.membership.collectives import BarrierTimeoutError
from lightning_bamboo.membership.records import Failover
from lightning_bamboo.runtime.stage import NodeStage
from lightning_bamboo.testing import faults
from lightning_bamboo.topology.apart import apart_warning, rows_of
from lightning_bamboo.topology.failover import layout_tag, plan_loss
from lightning_bamboo.topology.layout import Layout
from lightning_bamboo.topology.replicas import kept_replicas

log = logging.getLogger(__name__)

#: what a failover captures before it rebuilds: the layout it left, the layer states, the optimizer
_Captured = dict[str, Any]


def fail_over(stage: NodeStage, err: Exception, step: int, in_flight: bool = True) -> bool:
    """Rebuild the pipeline from the survivors' own stages and replicas; True if the step had committed.

    Every attempt starts from the same captured state (the layers this node held before the
    loss) with the union of the losses seen so far, so a node lost *during* a failover only
    makes the survivors agree on a larger set and try again; no wait is unbounded.
    """
    session = stage.require_session()
    started = time.monotonic()
    if not stage.config.redundant:
        raise FatalLoss(f"lost {list(getattr(err, 'lost', ()))} with redundancy='off': no replica to take over")
    old, layout = stage.require_stage()
    log.info("%s: failover starts", session.node)
    committed = session.committed(step)
    if committed and old.phase != "idle":
        old.apply_step()  # every node had its gradients in: the step counts
    elif not committed:
        old.discard_step()
    base: _Captured = {
        "nodes": list(session.nodes),
        "pipelines": layout.pipelines,
        "parts": tuple(layout.parts),
        # the layers' own tensors where they are in host memory (no second copy of a CPU stage and replica): the
        # old engine never runs again, and the new layers copy them in (a GPU stage's are copied out here)
        "states": {**old.own_states(copy=False), **(old.replica.states(copy=False) if old.replica else {})},
        # the layer objects themselves: the new stage and replica take over those they keep (no second build, no
        # copy of their weights); nothing changes them until the failover converges, so every attempt may
        "layers": (held_layers(old.module), held_layers(old.replica.module) if old.replica else {}),
        # which pipeline's copies this node's layers are: a neighbour of the same lineage needs none of them sent
        "lineage": layout.pipeline_of_rank(stage.rank),
        # which stages' replicas the old layout kept: a pipeline fails over only from those
        "kept": stage.kept(layout),
        "optimizer": old.optimizer,
        "last_loss": old.last_loss,
        # eager: the successor's forwards of the failed step, reused when this node takes its stage over
        "reuse": None if committed or old.redundant is None or not old.redundant.kept or old.replica is None
        else (old.replica.forward_layers, dict(old.redundant.kept)),
    }
    old.release_exchange()  # the old engine never runs again: its gradient buffers go now, not when it is collected
    log.info("%s: state captured (%.2f s)", session.node, time.monotonic() - started)
    suspected = set(getattr(err, "lost", ()))
    # nodes an attempt released (their pipeline was dropped): they stand by at once and take part in no later
    # attempt, so a loss inside the failover makes every survivor decide again without them (they join the agreed
    # set; a survivor that comes late reads them there), and the rebalancer admits them once the job trains again
    released_before: set[str] = set()
    # A failover should take well under a detection timeout; if one does not, every thread's stack
    # goes to stderr (the node's log) so the wait can be named.
    faulthandler.dump_traceback_later(max(4 * stage.config.detection_timeout, 10.0), repeat=True)
    try:
        plan, rank, world = session.until_agreed(
            lambda lost: _fail_over_once(stage, base, lost, step, released_before), suspected, len(base["nodes"]),
            (PeerLost, BarrierTimeoutError, CommAborted),
            lambda: BambooError(f"failover at step {step} did not converge after {len(base['nodes'])} attempts"),
            during="during the failover")
    finally:
        faulthandler.cancel_dump_traceback_later()
    seconds = time.monotonic() - started
    # a released node may have left before another survivor decided: the lost set then names it too
    released = set(plan.released) | session.released() | released_before if base["pipelines"] > 1 else set()
    session.record_failover(Failover(
        step=step, lost=tuple(sorted(set(base["nodes"]) - set(plan.order) - released)), committed=committed,
        seconds=seconds, redone=in_flight and not committed, order=tuple(plan.order), parts=tuple(plan.parts),
        pipelines=plan.pipelines, released=tuple(sorted(released)), rows=tuple(tuple(r) for r in plan.rows),
        old_parts=tuple(base["parts"]), old_pipelines=base["pipelines"],
    ))
    log.warning("%s: failover done in %.2f s (rank %d of %d)", session.node, seconds, rank, world)
    # the nodes it released are offered for admission before the next step is trained (the redone one, or after a
    # notice the next one), not a commit later: the rebalancer can take them back at once (``PipelineRunner``)
    session.offer_released(released, step)
    if committed:
        stage.require_stage()[0].last_loss = base["last_loss"]
    return committed

def _fail_over_once(stage: NodeStage, base: _Captured, suspected: set[str], step: int,
                    released_before: set[str]) -> tuple[Any, int, int]:
    session = stage.require_session()
    lost = session.decide_lost(tuple(suspected | released_before), base["nodes"])
    if session.node in lost:
        # the survivors agreed on a set that names this node (released by an attempt of theirs it had not seen, or
        # taken for lost): they go on without it, so it stands by, to be admitted again, as a released node does
        release(stage, step, f"the survivors' lost set {sorted(lost)} names it; they went on without it")
    plan = plan_loss(base["nodes"], base["pipelines"], base["parts"], lost, replicas=stage.config.redundant,
                     kept=base["kept"])
    log.warning("%s: lost %s at step %d; new layout %s (%d pipeline(s)) parts %s%s", session.node, sorted(lost),
                step, plan.order, plan.pipelines, plan.parts,
                f"; released {list(plan.released)}" if plan.released else "")
    if session.node in plan.released:
        release(stage, step)
    released_before |= set(plan.released)
    # a failover moves no data, so it cannot re-place a fatal pair it leaves on one machine: say so, once per node
    new_stages = len(plan.order) // plan.pipelines
    if warning := apart_warning(rows_of(plan.order, new_stages),
                                where=f"{session.node}: the failover of step {step}",
                                fix="a failover moves no data, so a reconfiguration does it (RebalanceCallback, "
                                    "once the overloaded share passes its max_overloaded_fraction)",
                                kept=kept_replicas(plan.order, new_stages, stage.config.redundancy)):
        log.warning("%s", warning)
    # The group's tag names its members: survivors that saw a released node's lease end (it left)
    # and those that did not agree on the same layout, so they must meet in the same group.
    rank, world = session.reform(list(plan.order), tag=layout_tag(plan.order))
    log.info("%s: process group re-formed", session.node)
    with must_fit(f"{session.node}'s stage and replica after the failover of step {step} (parts {plan.parts})",
                  stage.device, stage.config.replica_placement != "host"):
        faults.reached(session.node, "failover")  # fault injection (BAMBOO_FAIL_AT=node@failover)
        stage.enter_group(rank, world)
        # This node's layers in the new layout, each from its own copy or its replica (no disk, no transfer).
        layout = Layout(world // plan.pipelines, plan.pipelines, plan.parts)
        stage.rebuild(layout, rank, base["states"], base["optimizer"], reuse=base["reuse"], pool=base["layers"],
                      lineage=base["lineage"], stage_lineage=base["lineage"])  # its new stage: layers it held
    return plan, rank, world

def release(stage: NodeStage, step: int, why: str = "its pipeline lost a node; the whole pipelines train on",
            left_out: bool = False) -> NoReturn:
    """Leave the layout (this node's pipeline was dropped, or the others' recovery at ``step`` went on without it:
    ``why``) and stand by in this process (``Released``), to be admitted again as any standby node is; the store says
    it was released, not lost (``Session.release``, ``left_out`` by a restart's shape)."""
    session = stage.require_session()
    log.warning("%s: released at step %d (%s); it stands by in its process", session.node, step, why)
    session.release(left_out)
    stage.stand_by()
    raise Released(f"{session.node} was released at step {step}: {why}")
