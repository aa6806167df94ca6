"""RebalanceCallback: at every step boundary, ask the reconfiguration policy what the pipeline should be, and do it.

Bamboo's runtime keeps training through a loss by letting the lost node's predecessor run both
stages (failover). That node is then *overloaded* and the job runs at the pace of its double
stage; standby nodes may be waiting to help. At each step boundary this callback describes the
cluster to :func:`lightning_bamboo.topology.policy.reconfigure` (the live pipeline nodes, the
standby nodes that registered, which nodes are overloaded) and executes its decision with
``PipelineRunner.reconfigure``: layers and optimizer state move point to point, joining nodes
get Lightning's training state, replicas are rebuilt. Every decision that changes something is
logged with its measured cost.

When: at the start of every step, after the strategy has handled nodes that left with a notice,
so every node of the pipeline is in the same generation at the same step. What: each node
computes the decision from what it knows, and the first proposal put in the store for that
generation and step is the one every node executes (standby lists seen at slightly different
times cannot split the pipeline). Cost without a change: two small store calls per step.

It needs the Bamboo launcher (membership in a store); elsewhere nothing can change and it only
keeps the layout. With ``admit=True`` (the default) standby nodes are reported at every commit.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from lightning.pytorch import Callback

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.topology.policy import (
    Decision,
    Placement,
    PolicyConfig,
    machine_of,
    moved_nodes,
    reconfigure,
    split_micro_batches,
)

log = logging.getLogger(__name__)


class RebalanceCallback(Callback):
    """Rebalance, re-deepen or grow the pipeline at step boundaries, as the reconfiguration policy decides.

    Args:
        stages: the preferred pipeline depth (default: the depth the job started with). When
            fewer nodes remain the pipeline gets shallower; when standby nodes come back it gets
            this deep again.
        min_stages: the shallowest pipeline to run (default 2: a replica needs a second stage).
        max_overloaded_fraction: Bamboo's risk rule: rebuild as soon as ``2 * overloaded / active``
            exceeds this (default 0.05, i.e. any overloaded node in a small job).
        admit: let standby nodes join (they are started with ``BAMBOO_JOIN=1``, see
            ``Cluster.spawn_joiner``).

    With a ``HydrozoaTuner`` among the trainer's callbacks, a new layout's layer split is the
    planner's for that depth (``HydrozoaTuner.split_for``: its profile, cost model and memory
    limit), not an even one.
    """

    def __init__(
        self, stages: int | None = None, min_stages: int = 2, max_overloaded_fraction: float = 0.05, admit: bool = True
    ) -> None:
        if stages is not None and stages < 1:
            raise BambooConfigError(f"RebalanceCallback(stages={stages}): the preferred depth must be >= 1, or None")
        if min_stages < 1:
            raise BambooConfigError(f"RebalanceCallback(min_stages={min_stages}) must be >= 1")
        if not 0.0 <= max_overloaded_fraction <= 1.0:
            raise BambooConfigError(
                f"RebalanceCallback(max_overloaded_fraction={max_overloaded_fraction}) must be in [0, 1]; use e.g. 0.05"
            )
        self.stages, self.min_stages, self.admit = stages, min_stages, admit
        self.max_overloaded_fraction = max_overloaded_fraction
        self.layout: Placement | None = None  # the policy's view: lost nodes stay in it until a decision drops them
        self.decisions: list[dict[str, Any]] = []  # every decision that changed something, with its cost
        self._deferred: str | None = None
        self._failovers_seen = 0  # failover records of the strategy already taken into the policy's view
        self._unhook: Callable[[], None] = _no_hook  # removes at_step_start from the runner
        self._pl_module: Any = None
        #: (stages, micro-batch size, micro-batches) -> the planner's split, or None; set from a HydrozoaTuner in setup
        self.split_for: Any = None
        #: relative cost per layer for the policy's splits, from the strategy's ``partition`` (None: equal)
        self.layer_costs: tuple[float, ...] | None = None
        self.micro_batch_size = 1

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if getattr(trainer.strategy, "runner", None) is None:
            raise BambooConfigError(
                f"RebalanceCallback reconfigures a BambooStrategy; this trainer runs {type(trainer.strategy).__name__}. "
                "Use Trainer(strategy='bamboo')"
            )
        runner = trainer.strategy.runner
        if self.admit:
            runner.admit_standby()
        self._pl_module = pl_module
        self._unhook()
        self._unhook = runner.before_step(self.at_step_start)  # called by the runner: see the module docstring
        from lightning_bamboo.callbacks.tuner import HydrozoaTuner

        tuner = next((c for c in trainer.callbacks if isinstance(c, HydrozoaTuner)), None)
        if tuner is not None:
            self.split_for = tuner.split_for
        self.micro_batch_size = int(getattr(trainer.strategy, "micro_batch_size", 1) or 1)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        current = self._runtime(trainer)
        if (self.layout is None or not set(current.nodes) <= set(self.layout.nodes)
                or (current.stages, current.pipelines) != (self.layout.stages, self.layout.pipelines)):
            # a fresh start, or a restart in another layout: a job restarted from a checkpoint holds no
            # overloaded node, whatever the saved view said (a node admitted into a running job gets the
            # view of the layout it was admitted into, which is its runtime's)
            self.layout = current
        if self.stages is None:
            self.stages = max(self.layout.stages, current.stages)
        self.layer_costs = trainer.strategy.runner.layer_costs()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._unhook()
        self._unhook = _no_hook

    def at_step_start(self, runner: Any, step: int) -> None:
        """Decide (agreed through the store) and reconfigure if the decision changes the pipeline."""
        if runner.session is None or self.layout is None or runner.layout is None:
            return
        self._follow_failovers(runner.failovers)
        mine = self.decide(runner.nodes, runner.standby, runner.layout.num_layers)
        proposal = {"action": mine.action, "reason": mine.reason, "moved": list(mine.moved), "layout": _layout_json(mine.layout),
                    "by": runner.node}
        agreed = runner.agree("rebalance", step, proposal)
        if agreed["action"] == "keep":
            return
        new = _layout_from_json(agreed["layout"])
        elastic = runner.global_micro_batches is not None
        if new is None or (new.pipelines != runner.layout.pipelines and not elastic):
            reason = f"{agreed['action']} deferred: " + (
                "no layout (too few nodes)" if new is None else
                f"{new.pipelines} pipelines, but this job's sampler fixes the number of pipelines"
            )
            if reason != self._deferred:
                log.warning("RebalanceCallback: %s", reason)
                self._deferred = reason
            return
        order = list(new.order)  # rank r runs stage r // pipelines of pipeline r % pipelines
        parts = tuple(new.parts)
        self.layout, self._deferred = new, None  # before the move: a joining node gets this state
        seconds = runner.reconfigure(order, parts, reason=f"{agreed['action']}: {agreed['reason']}",
                                     pipelines=new.pipelines)
        event = {"step": step, "action": agreed["action"], "reason": agreed["reason"], "order": order,
                 "parts": list(parts), "pipelines": new.pipelines, "moved": agreed["moved"], "seconds": seconds}
        self.decisions.append(event)
        log.warning("RebalanceCallback: step %d %s (%s) -> %s parts %s in %.2f s", step, agreed["action"],
                    agreed["reason"], order, list(parts), seconds)
        module = self._pl_module
        module.log("rebalance/seconds", seconds, on_step=True, on_epoch=False, rank_zero_only=True)
        module.log("rebalance/count", float(len(self.decisions)), on_step=True, on_epoch=False, rank_zero_only=True)

    def _follow_failovers(self, failovers: list[dict[str, Any]]) -> None:
        """After a failover of a data-parallel layout, reason about the pipelines it kept.

        A failover of one pipeline leaves its lost nodes in the policy's view (their replica holders
        are overloaded); one of several pipelines dropped the pipelines that lost nodes (their
        survivors come back as standby nodes), or kept one that failed over on its own: the policy's
        view becomes those pipelines, lost nodes included.
        """
        assert self.layout is not None
        for record in failovers[self._failovers_seen:]:
            if record.get("old_pipelines", 1) > 1 and record.get("rows"):
                rows = tuple(tuple(r) for r in record["rows"])
                total = sum(self.layout.micro_batches)
                self.layout = Placement(rows, tuple(record["old_parts"]), split_micro_batches(total, len(rows)))
        self._failovers_seen = len(failovers)

    # ------------------------------------------------------------------ the decision (pure)
    def decide(self, nodes: list[str], standby: list[str], layers: int) -> Decision:
        """The policy's decision for pipeline ``nodes`` (the runtime's, after any failover) and ``standby`` nodes."""
        assert self.layout is not None and self.stages is not None
        layout = self.layout
        lost = [n for n in layout.nodes if n not in nodes]
        overloaded = sorted({layout.replica_holder(n) for n in lost} & set(nodes))
        micro = sum(layout.micro_batches)
        config = PolicyConfig(
            stages=self.stages, layers=layers, global_micro_batches=micro,
            min_stages=min(self.min_stages, self.stages), max_overloaded_fraction=self.max_overloaded_fraction,
            layer_costs=self.layer_costs if self.layer_costs is not None and len(self.layer_costs) == layers else None,
        )
        # a machine's workers (launcher --workers) are one failure domain: placed nodes avoid a neighbour of their own
        domains = {n: machine_of(n) for n in [*nodes, *standby]}
        decision = reconfigure(nodes + standby, standby, layout, overloaded, config, domains)
        new = decision.layout
        if self.split_for is None or new is None or decision.action == "keep":
            return decision
        planned = self.split_for(new.stages, self.micro_batch_size, max(new.micro_batches), new.pipelines)
        if planned is None or tuple(planned) == tuple(new.parts):
            return decision
        planned_layout = dataclasses.replace(new, parts=tuple(planned))
        return Decision(decision.action, planned_layout, f"{decision.reason}; layer split by HydrozoaTuner",
                        moved_nodes(layout, planned_layout))

    @staticmethod
    def _runtime(trainer: Any) -> Placement:
        """The pipeline the strategy runs now, as the policy's ``Placement`` (its ``layout`` is the runner's)."""
        runner = trainer.strategy.runner
        runtime, names = runner.layout, runner.nodes
        grid = tuple(tuple(names[s * runtime.pipelines + p] for s in range(runtime.stages)) for p in range(runtime.pipelines))
        total = trainer.strategy.global_micro_batches
        if total:  # global batches: the pipelines share each step's micro-batches
            return Placement(grid, tuple(runtime.parts), split_micro_batches(int(total), runtime.pipelines))
        return Placement(grid, tuple(runtime.parts), (runner.micro_batches,) * runtime.pipelines)

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        return {"layout": _layout_json(self.layout), "stages": self.stages, "decisions": list(self.decisions)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if (saved := _layout_from_json(state_dict.get("layout"))) is not None:
            self.layout = saved
        self.stages = state_dict.get("stages", self.stages)
        self.decisions = list(state_dict.get("decisions", []))


def _no_hook() -> None:
    pass


def _layout_json(layout: Placement | None) -> dict[str, Any] | None:
    if layout is None:
        return None
    return {"grid": [list(r) for r in layout.grid], "parts": list(layout.parts), "micro_batches": list(layout.micro_batches)}


def _layout_from_json(saved: dict[str, Any] | None) -> Placement | None:
    if saved is None:
        return None
    return Placement(tuple(tuple(r) for r in saved["grid"]), tuple(saved["parts"]), tuple(saved["micro_batches"]))
