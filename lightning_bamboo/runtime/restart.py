"""A restart in the running processes: the survivors of a fatal loss form a layout of themselves and start a fresh
stage, which the caller then loads from the last checkpoint.

A fatal loss is a node lost with its replica holder: no survivor holds the lost layers, so the step cannot be
redone and the job goes back to its last complete checkpoint. The survivors need no new process for that: they
agreed on the lost set in the failover that found the loss fatal, so each computes the same new layout, forms
its process group (a new generation) and builds its stage from the model's description. Loading the
checkpoint's weights, optimizer state and training state is the front door's (its checkpoint format and loop).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from lightning_bamboo.errors import BambooError, FatalLoss, PeerLost
from lightning_bamboo.membership.collectives import BarrierTimeoutError
from lightning_bamboo.membership.records import Restart
from lightning_bamboo.runtime.stage import NodeStage
from lightning_bamboo.topology.failover import layout_tag

log = logging.getLogger(__name__)


def restart_depth(survivors: int, stages: int, redundant: bool) -> int:
    """The depth of the restarted job: the running depth if the survivors make whole pipelines of it, else one
    pipeline of them all. Fewer survivors than a replica needs (2) end the job with ``FatalLoss``."""
    if survivors < (2 if redundant else 1):
        raise FatalLoss(f"{survivors} node(s) left after a fatal loss: a job with replicas needs at least 2; start it "
                        "again from its last checkpoint with more nodes")
    return stages if survivors % stages == 0 else survivors


def restart_after_fatal_loss(stage: NodeStage, model: Any, err: FatalLoss) -> Restart:
    """Form the survivors' layout and build this node's fresh stage (seed weights: load the checkpoint next).

    Call on every survivor after ``err`` ended a step or a collective. A node lost meanwhile makes the survivors
    agree on a larger set and try again; a node that the others declared lost ends with ``err``. Returns the
    restart's record (also among the session's ``failovers``).
    """
    session = stage.require_session()
    started = time.monotonic()
    before = list(session.nodes)
    layout = stage.require_stage()[1]
    suspected: set[str] = set()
    for _attempt in range(len(before)):
        lost = session.decide_lost(tuple(suspected), before)  # the set the fatal failover agreed on, or larger
        order = [n for n in before if n not in lost]
        if session.node not in order:
            raise err  # declared lost itself (it froze, say): the others go on without it
        stages = restart_depth(len(order), layout.stages, stage.config.redundant)
        try:
            rank, world = session.reform(order, tag=layout_tag(order))
            break
        except (PeerLost, BarrierTimeoutError) as again:
            suspected |= set(getattr(again, "lost", ())) | session.detector.lost
            log.warning("%s: another loss while the job restarted (%s); trying again with %s", session.node, again,
                        sorted(suspected | lost))
    else:
        raise BambooError(f"the restart after a fatal loss did not converge after {len(before)} attempts")
    stage.enter_group(rank, world)
    stage.assign(stages)
    stage.start(model, world, rank, fitting=True, gradient_clipping=stage.gradient_clipping)
    record = Restart(lost=tuple(sorted(set(before) - set(order))), order=tuple(order), stages=stages,
                     pipelines=world // stages, seconds=time.monotonic() - started, reason=str(err))
    session.record_failover(record)
    log.warning("%s: fatal loss of %s; the job restarts in its running processes as %d stage(s) x %d pipeline(s) "
                "(rank %d of %d)", session.node, list(record.lost), stages, world // stages, rank, world)
    return record
