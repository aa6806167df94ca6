"""Policies published after Bamboo, in the same simulator: ReCycle-style rerouting and Parcae-style migration.

Both are models of the published ideas under stated assumptions (docs/sim.md), not their code:
neither keeps replicas of a neighbour's stage, so neither pays Bamboo's redundancy overhead; both
recover a lost stage from the same stage of another data-parallel pipeline.
"""

from __future__ import annotations

import zlib

from lightning_bamboo.sim.ledger import Ledger
from lightning_bamboo.sim.model import rerouted_slowdown, samples_per_second, step_rate
from lightning_bamboo.sim.params import SimParams
from lightning_bamboo.sim.policies import Policy
from lightning_bamboo.sim.trace import TraceEvent
from lightning_bamboo.topology.policy import Placement, fresh_placement


class _DataParallelRecovery(Policy):
    """Shared parts: fixed depth, fresh layouts of whole pipelines, fatal when a stage has no copy left."""

    def __init__(self, params: SimParams, ledger: Ledger) -> None:
        super().__init__(params, ledger)
        self.lost: set[str] = set()  # layout nodes gone since the layout was built
        self.domains: dict[str, str] = {}
        self.fatal = False

    def on_add(self, event: TraceEvent) -> None:
        self.domains[event.node] = f"t{event.ms}"

    def _lost_in_layout(self, event: TraceEvent) -> bool:
        """Forget ``event.node``; True when it was a running node of the layout (a preemption)."""
        alive_before = set(self.ready)
        super().on_remove(event)
        hit = self.layout is not None and event.node in self.layout.nodes and event.node in alive_before
        if hit:
            self.ledger.preemptions += 1
        return hit and not self.fatal

    def _stage_gone(self, node: str) -> bool:
        assert self.layout is not None
        stage = self.layout.position(node)[1]
        return all(row[stage] in self.lost for row in self.layout.grid)

    def _fatal(self) -> None:
        """No copy of a stage is left: back to the last asynchronous checkpoint, restart."""
        self.fatal = True
        self.ledger.recoveries["checkpoint"] += 1
        self.ledger.rollback()
        self.ledger.pause("restart", self.params.restart_seconds, restart=True)

    def _fresh(self) -> Placement | None:
        pipelines = len(self.ready) // self.params.stages
        cap = self.config.max_pipelines
        pipelines = pipelines if cap is None else min(pipelines, cap)
        if not pipelines:
            return None
        return fresh_placement(self.ready, pipelines, self.params.stages, self.config, self.domains)

    def _run(self, layout: Placement | None, slowdown: float = 1.0) -> None:
        self.layout = layout
        self.ledger.active = len(layout.nodes) if layout else 0
        self.ledger.rate = samples_per_second(layout, self.params) / slowdown
        self.ledger.step_rate = step_rate(layout, self.params) / slowdown
        self.ledger.mark()

    def _restart_or_suspend(self, layout: Placement | None) -> None:
        """Start ``layout`` after a fatal loss or an idle spell (None: nothing can run)."""
        if layout is None:
            if self.layout is not None and not self.fatal:
                self.ledger.recoveries["checkpoint"] += 1  # too few nodes to hold the model
                self.ledger.rollback()
            self.ledger.pause("restart", 0.0, restart=True)
        elif self.started and not self.fatal:
            self.ledger.pause("restart", self.params.restart_seconds, restart=True)
        self.started = self.started or layout is not None
        self.fatal = False
        self.lost = set()
        self._run(layout)


class Recycle(_DataParallelRecovery):
    """ReCycle-style: a lost node's micro-batches go to the same stage of the other pipelines.

    No pipeline is dropped: the step slows as :func:`~lightning_bamboo.sim.model.rerouted_slowdown`
    says (extra work fills the bubbles first). The layout is rebuilt (``reconfigure_seconds``) when
    a fresh layout of whole pipelines from the nodes at hand is faster than the rerouted one, e.g.
    when new nodes can fill the holes. Fatal only when a stage lost every copy.
    """

    name = "recycle"

    def on_remove(self, event: TraceEvent) -> None:
        if not self._lost_in_layout(event):
            return
        self.lost.add(event.node)
        if self._stage_gone(event.node):
            self._fatal()
            return
        self.ledger.recoveries["redundant"] += 1
        self.ledger.pause("failover", 0.0 if event.notice_seconds > 0 else self.params.failover_seconds)
        assert self.layout is not None
        self._run(self.layout, rerouted_slowdown(self.layout, self.lost))

    def settle(self) -> None:
        fresh = self._fresh()
        if self.layout is None or self.fatal:
            if fresh is not None or self.layout is not None:
                self._restart_or_suspend(fresh)
            return
        current = self.ledger.rate
        if fresh is not None and samples_per_second(fresh, self.params) > current + 1e-9 * current:
            self.ledger.reconfigurations += 1
            self.ledger.pause("reconfigure", self.params.reconfigure_seconds)
            self.lost = set()
            self._run(fresh)


def foreseen(node: str, fraction: float) -> bool:
    """Whether an availability predictor foresees ``node``'s removal: a fixed share ``fraction`` of
    node names, chosen by a hash so that every policy and every run see the same removals foreseen."""
    return zlib.crc32(node.encode()) / 2**32 < fraction


class Parcae(_DataParallelRecovery):
    """Parcae-style: migrate before a preemption lands when it is foreseen, re-plan on every change.

    A removal with a notice, or one of the share ``predicted_fraction`` a predictor foresees, costs
    a migration pause (``migration_seconds``) and loses nothing. An unforeseen one also loses the
    step in flight (``failover_seconds``) and copies the stage from another pipeline; fatal when no
    pipeline holds it. After either, and when joins allow another pipeline, the layout is re-planned
    as whole pipelines of the nodes at hand.
    """

    name = "parcae"

    def __init__(self, params: SimParams, ledger: Ledger) -> None:
        super().__init__(params, ledger)
        self.replan = False

    def on_remove(self, event: TraceEvent) -> None:
        if not self._lost_in_layout(event):
            return
        self.lost.add(event.node)
        if event.notice_seconds > 0 or foreseen(event.node, self.params.predicted_fraction):
            self.ledger.reconfigurations += 1
            self.ledger.pause("reconfigure", self.params.migration_seconds)
        elif self._stage_gone(event.node):
            self._fatal()
            return
        else:
            self.ledger.recoveries["redundant"] += 1
            self.ledger.pause("failover", self.params.failover_seconds)
            self.ledger.pause("reconfigure", self.params.migration_seconds)
        self.replan = True

    def settle(self) -> None:
        fresh = self._fresh()
        if self.layout is None or self.fatal:
            if fresh is not None or self.layout is not None:
                self._restart_or_suspend(fresh)
            self.replan = False
            return
        if fresh is None:
            self.replan = False
            self._restart_or_suspend(None)
            return
        if self.replan or fresh.pipelines > self.layout.pipelines:
            if not self.replan:  # a join: migrate state to the new nodes while training goes on
                self.ledger.reconfigurations += 1
                self.ledger.pause("reconfigure", self.params.migration_seconds)
            self.replan = False
            self.lost = set()
            self._run(fresh)
