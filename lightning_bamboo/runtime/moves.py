"""Layouts that change with no loss: a reconfiguration between steps, and a standby node's admission."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from lightning_bamboo.engine.comm_process import CommAborted
from lightning_bamboo.engine.construct import ensure_deepspeed_comm
from lightning_bamboo.engine.reconfigure import move_layers
from lightning_bamboo.engine.ties import held_layers
from lightning_bamboo.engine.transfer import exchange_objects
from lightning_bamboo.errors import BambooConfigError, FatalLoss, PeerLost, Released
from lightning_bamboo.membership.collectives import BarrierTimeoutError
from lightning_bamboo.membership.records import Reconfiguration
from lightning_bamboo.testing import faults
from lightning_bamboo.topology.layout import Layout
from lightning_bamboo.topology.transfer import transfer_plan

if TYPE_CHECKING:
    from lightning_bamboo.runtime.host import PipelineModel
    from lightning_bamboo.runtime.stage import NodeStage

log = logging.getLogger(__name__)


def reconfigure(stage: NodeStage, order: list[str], parts: tuple[int, ...], reason: str = "",
                pipelines: int = 1, elastic: bool = True) -> float:
    """Change the layout between two steps, with no loss: standby nodes join, layers move point to point.

    ``order`` (the nodes in rank order: rank ``r`` runs stage ``r // pipelines`` of pipeline
    ``r % pipelines``) may add standby nodes to the current ones, never drop one; ``parts`` is
    the new layer split, ``pipelines`` the new number of data-parallel pipelines (the global
    batch stays: each pipeline's share of micro-batches follows; ``elastic`` says whether the data
    is loaded by global steps, which a change of pipelines needs). Every layer a node must run and
    does not run now comes from the node that runs it (weights and optimizer state; no disk);
    joining nodes also get the host's training state; replicas are rebuilt by the ring exchange.
    Call at a step boundary on every node of the pipeline (``RebalanceCallback`` does). Returns the
    seconds it took. A node lost meanwhile ends in ``FatalLoss`` (restart from the last checkpoint).
    """
    session, layout, engine = stage.session, stage.layout, stage.engine
    if session is None or layout is None or engine is None:
        raise BambooConfigError("reconfigure() needs a job started by the Bamboo launcher and setup() done")
    started = time.monotonic()
    old_order, old_parts, order, parts = list(session.nodes), tuple(layout.parts), list(order), tuple(parts)
    if (order, parts, pipelines) == (old_order, old_parts, layout.pipelines):
        return 0.0
    if pipelines != layout.pipelines and not elastic:
        raise BambooConfigError(
            f"changing the number of pipelines ({layout.pipelines} -> {pipelines}) needs the training data loaded "
            "by global steps (a DataLoader with a sequential or random sampler, which the strategy shards); this "
            "job's sampler is sharded per pipeline"
        )
    moves = transfer_plan(old_order, old_parts, order, parts, layout.pipelines, pipelines)  # validates the layout
    step = stage.host.global_step()
    joiners = [n for n in order if n not in old_order]
    sender = next(n for n in order if n in old_order)
    record = Reconfiguration(generation=session.generation + 1, order=tuple(order), parts=parts,
                             old_order=tuple(old_order), old_parts=old_parts, sender=sender, tag="reconf", step=step,
                             reason=reason, pipelines=pipelines, old_pipelines=layout.pipelines)
    if joiners and session.node == old_order[0]:
        session.admit(record)
        faults.reached(session.node, "admit")  # fault injection (BAMBOO_FAIL_AT=node@admit)
    meta = stage.host.training_state() if joiners and session.node == sender else None
    # The old engine never runs again: its layers' own tensors (no copy), and the layer objects, which the new stage
    # and replica take over where they keep a layer (nothing built or loaded again)
    own = engine.own_states(copy=False)
    replica = engine.replica.states(copy=False) if engine.replica is not None else {}
    objects = (held_layers(engine.module), held_layers(engine.replica.module) if engine.replica else {})
    lineage = layout.pipeline_of_rank(stage.rank)  # the old pipeline whose copies they are
    engine.release_exchange()
    held, hyper = own, engine.optimizer
    log.warning("%s: reconfiguring at step %d: %s parts %s -> %s parts %s (%s)", session.node, step, old_order,
                list(old_parts), order, list(parts), reason)
    try:
        rank, world = session.reform(order, tag="reconf")
        stage.enter_group(rank, world)

        def move() -> dict[int, dict[str, Any]]:
            received = move_layers(moves, session.node, order, held)
            for joiner in joiners if meta is not None else ():
                exchange_objects(meta, send_to=order.index(joiner), recv_from=None)
            return received

        received = session.guard().run(move)
        held = {**replica, **own, **received}
        faults.reached(session.node, "reconfigure")  # fault injection (BAMBOO_FAIL_AT=node@reconfigure)
        # a layer that arrived is built from its states; the new stage's layers are of one lineage when every one
        # it received came from a node of this node's old pipeline
        sources = {m.src for m in moves if m.dst == session.node}
        same = all(layout.pipeline_of_rank(old_order.index(src)) == lineage for src in sources)
        stage.rebuild(Layout(world // pipelines, pipelines, parts), rank, held, hyper,
                       pool=(_without(objects[0], received), _without(objects[1], received)), lineage=lineage,
                       stage_lineage=lineage if same else None)
    except (PeerLost, BarrierTimeoutError, CommAborted) as err:
        # the joiners stand by again (``start_admitted``): the restart is of the nodes that ran before
        raise FatalLoss(f"a node was lost while the pipeline was reconfigured at step {step} ({err}); "
                        "the run must restore its last checkpoint", standing=tuple(joiners)) from err
    seconds = time.monotonic() - started
    session.record_reconfiguration(dataclasses.replace(record, seconds=seconds))
    log.warning("%s: reconfigured in %.2f s (rank %d of %d)", session.node, seconds, rank, world)
    return seconds


def _without(layers: dict[int, Any], received: dict[int, Any]) -> dict[int, Any]:
    """``layers`` but those that arrived (a layer that arrived is built from its states)."""
    return {i: layer for i, layer in layers.items() if i not in received}


def start_admitted(stage: NodeStage, model: PipelineModel, record: Reconfiguration, rank: int,
                   gradient_clipping: float = 0.0) -> dict[str, Any]:
    """A joining node's start: its layers come from the running nodes (the admission ``record`` says
    which), and so does the training state it returns (the host's ``training_state`` of the sender)."""
    session = stage.require_session()
    stage.probe(model)
    ensure_deepspeed_comm(stage.backend)
    order = list(record.order)

    def receive() -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
        moves = transfer_plan(list(record.old_order), record.old_parts, order, record.parts, record.old_pipelines,
                              record.pipelines)
        held = move_layers(moves, session.node, order, {})
        return held, exchange_objects(None, send_to=None, recv_from=order.index(record.sender))

    try:
        held, meta = session.guard().run(receive)
        stage.resolve_precision(meta["bamboo"].get("loss_scale"), gradient_clipping)  # fp16: the running nodes' scale
        pipelines = record.pipelines
        layout = Layout(len(order) // pipelines, pipelines, record.parts)
        stage.rebuild(layout, rank, held, meta["bamboo"]["param_groups"], fresh_optimizer=True)
    except (PeerLost, BarrierTimeoutError, CommAborted, FatalLoss) as err:
        # the running nodes go back to their last layout (or restart without this node): it stands by again, as a
        # node released from a dropped pipeline does
        log.warning("%s: a node was lost while this node was admitted at step %d (%s); it stands by again",
                    session.node, record.step, err)
        stage.stand_by()
        raise Released(f"{session.node}'s admission at step {record.step} failed: {err}") from err
    return meta
