"""Designs for a damaged pipeline, modelled before one is built (issue 63: a damaged pipeline keeps training).

With several data-parallel pipelines the runtime drops a pipeline that lost a node; its survivors stand by until
nodes arrive to make it whole again. Two ways to keep them training, each a policy of the simulator:

- **reroute** (ReCycle's idea): the same stage of the other pipelines computes the lost node's micro-batches, in
  their bubbles first. That is :class:`lightning_bamboo.sim.successors.Recycle` (no replicas, the step slowed by
  :func:`~lightning_bamboo.sim.model.rerouted_slowdown`), replayed with this runtime's measured costs.
- **fail over in the pipeline**: :class:`BambooInPipeline` below.

``docs/sim.md`` says which the simulator favours, with what inputs, and why.
"""

from __future__ import annotations

import dataclasses

from lightning_bamboo.sim.ledger import Ledger
from lightning_bamboo.sim.model import samples_per_second, step_rate
from lightning_bamboo.sim.params import SimParams
from lightning_bamboo.sim.policies import Bamboo


def matched_share_slowdown(pipelines: int, damaged: int, slowdown: float) -> float:
    """Step-time factor of ``pipelines`` pipelines of which ``damaged`` run ``slowdown`` times slower, when each
    pipeline's share of the fixed global batch is matched to its speed (a damaged pipeline takes fewer
    micro-batches): the job's rate is the sum of its pipelines' (bubbles aside)."""
    if not 0 <= damaged <= pipelines or pipelines < 1 or slowdown < 1:
        raise ValueError(f"need 0 <= damaged <= pipelines and slowdown >= 1 (got {damaged}, {pipelines}, {slowdown})")
    return pipelines / (pipelines - damaged + damaged / slowdown)


class BambooInPipeline(Bamboo):
    """Fail over in the pipeline: with several pipelines no pipeline is dropped, and none keeps a replica.

    A lost node's predecessor in its pipeline takes its stage over, receiving the stage's weights and optimizer
    state from the same stage of another pipeline (a move: ``reconfigure_seconds``, after the step in flight is lost:
    ``failover_seconds``); it then runs both stages (``failover_slowdown``), and the damaged pipeline trains a share
    of the global batch matched to its speed (:func:`matched_share_slowdown`). A loss its pipeline cannot take (the
    predecessor lost too, or already running two stages) drops that pipeline as the runtime does; a stage with no
    copy left is fatal; a loss while a stage is on its way is handled as the runtime handles it. Standby nodes take
    the lost places at the next decision of the reconfiguration policy, whose risk rule (rebuild when too many nodes
    run two stages) protects replicas, which this design does not rely on.
    One pipeline keeps replicas and fails over as Bamboo does (``redundancy="auto"``).
    """

    name = "bamboo_in_pipeline"
    redundancy = "auto"

    def __init__(self, params: SimParams, ledger: Ledger) -> None:
        super().__init__(params, ledger)
        self.config = dataclasses.replace(self.config, max_overloaded_fraction=1.0)
        self.moved_by = 0.0  # when the last stage taken over has arrived

    def _keep_damaged(self, lost: set[str], pause: float) -> bool:
        layout = self.layout
        assert layout is not None
        if layout.pipelines < 2 or self.ledger.t < self.moved_by:
            return False  # one pipeline fails over from its replica; a loss during a move: as the runtime
        # lost nodes not taken over yet (a taken one's predecessor runs its stage: it is overloaded)
        fresh = {n for n in lost if layout.replica_holder(n) not in self.overloaded}
        keep: list[tuple[str, ...]] = []
        drop: list[tuple[str, ...]] = []
        holders: list[str] = []
        for row in layout.grid:
            stages = [s for s, n in enumerate(row) if n in fresh]
            taken = all(row[s - 1] not in lost and row[s - 1] not in self.overloaded and row[s] not in self.overloaded
                        and any(other[s] not in lost for other in layout.grid if other != row) for s in stages)
            (keep if taken else drop).append(row)
            holders += [row[s - 1] for s in stages] if taken else []
        if not keep:
            return False  # no pipeline can take its losses: as the runtime (a stage without a copy is fatal)
        self._restart({n for row in drop for n in row})
        self.overloaded = (self.overloaded - {n for row in drop for n in row} - lost) | set(holders)
        new = layout if not drop else dataclasses.replace(layout, grid=tuple(keep),
                                                           micro_batches=self.config.micro_batches(len(keep)))
        damaged = sum(bool(lost & set(row)) for row in keep)
        self.ledger.recoveries["redundant"] += 1
        self.ledger.pause("failover", pause)
        if holders:  # the stages taken over arrive from another pipeline's copy
            self.ledger.pause("reconfigure", self.params.reconfigure_seconds)
            self.moved_by = self.ledger.paused_until
        factor = matched_share_slowdown(new.pipelines, damaged, self.params.failover_slowdown)
        self.layout = new
        replicas = self._replicas(new)
        self.ledger.active = len(new.nodes) - len(lost & set(new.nodes))
        self.ledger.rate = samples_per_second(new, self.params, redundancy=replicas) / factor
        self.ledger.step_rate = step_rate(new, self.params, redundancy=replicas) / factor
        self.ledger.mark()
        return True
