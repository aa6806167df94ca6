"""``Rebalancer``: at every step boundary, ask the reconfiguration policy what the pipeline should be, and do it.

Bamboo's runtime keeps training through a loss by letting the lost node's predecessor run both
stages (failover). That node is then *overloaded* and the job runs at the pace of its double
stage; standby nodes may be waiting to help. At each step boundary the rebalancer describes the
cluster to :func:`lightning_bamboo.topology.policy.reconfigure` (the live pipeline nodes, the
standby nodes that registered, which nodes are overloaded) and executes its decision with
``PipelineRunner.reconfigure``: layers and optimizer state move point to point, joining nodes
get the host's training state, replicas are rebuilt. Every decision that changes something is
kept with its measured cost (``decisions``) and logged.

When: at the start of every step (``PipelineRunner.before_step``), after the runner has served
nodes that left with a notice, so every node of the pipeline is in the same generation at the same
step. What: each node computes the decision from what it knows, and the first proposal put in the
store for that generation and step is the one every node executes (standby lists seen at slightly
different times cannot split the pipeline). Cost without a change: two small store calls per step.

Both front doors drive it: ``RebalanceCallback`` for Lightning, and ``lightning_bamboo.initialize``'s
``"bamboo": {"rebalance": ...}`` for a DeepSpeed loop. It imports no Lightning.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lightning_bamboo.membership.records import Failover, Restart
from lightning_bamboo.topology.apart import apart_warning
from lightning_bamboo.topology.layout import machine_of
from lightning_bamboo.topology.policy import (
    Decision,
    Placement,
    PolicyConfig,
    check_rebalancer,
    moved_nodes,
    rebalance_arguments,
    reconfigure,
    split_micro_batches,
)
from lightning_bamboo.topology.replicas import kept_in_rows

if TYPE_CHECKING:
    from lightning_bamboo.runtime.runner import PipelineRunner

log = logging.getLogger(__name__)

#: (stages, micro-batch size, micro-batches, pipelines) -> a layer split, or None (``HydrozoaTuner.split_for``)
SplitFor = Callable[[int, int, int, int], Any]


class Rebalancer:
    """Rebalance, re-deepen or grow the pipeline at step boundaries, as the reconfiguration policy decides.

    Args:
        stages: the preferred pipeline depth (default: the depth the job started with). When
            fewer nodes remain the pipeline gets shallower; when standby nodes come back it gets
            this deep again. Where this depth would leave live nodes idle (four nodes at 3 stages), shallower
            pipelines that train every one in a shorter step are run instead (``topology.policy.shape_for``).
        min_stages: the shallowest pipeline to run, and the fewest stages the model (with its replicas) fits in
            (default 2: a replica needs a second stage).
        max_overloaded_fraction: Bamboo's risk rule: rebuild as soon as ``2 * overloaded / active``
            exceeds this (default 0.05, i.e. any overloaded node in a small job).
        admit: let standby nodes join (they are started with ``BAMBOO_JOIN=1``, see
            ``Cluster.spawn_joiner``).
    """

    def __init__(
        self, stages: int | None = None, min_stages: int = 2, max_overloaded_fraction: float = 0.05, admit: bool = True
    ) -> None:
        check_rebalancer(type(self).__name__, stages, min_stages, max_overloaded_fraction)
        self.stages, self.min_stages, self.admit = stages, min_stages, bool(admit)
        self.max_overloaded_fraction = float(max_overloaded_fraction)
        self.layout: Placement | None = None  # the policy's view: lost nodes stay in it until a decision drops them
        self.decisions: list[dict[str, Any]] = []  # every decision that changed something, with its cost
        self._deferred: str | None = None
        self._failovers_seen = 0  # failover records of the runner already taken into the policy's view
        self._unhook: Callable[[], None] = _no_hook  # removes at_step_start from the runner
        #: (stages, micro-batch size, micro-batches, pipelines) -> the planner's split, or None
        self.split_for: SplitFor | None = None
        #: relative cost per layer for the policy's splits, from the runner's ``partition`` (None: equal)
        self.layer_costs: tuple[float, ...] | None = None
        self.micro_batch_size = 1
        #: the job's redundancy (the runner's, at ``attach``): which replicas a layout keeps (``PolicyConfig``)
        self.redundancy = "lazy"
        #: called with each decision that changed something (the Lightning callback logs it as metrics)
        self.on_decision: Callable[[dict[str, Any]], None] = _ignore

    # ------------------------------------------------------------------ wiring
    def attach(self, runner: PipelineRunner, micro_batch_size: int = 1) -> None:
        """Run at the start of every step of ``runner`` (and report standby nodes at every commit if ``admit``)."""
        if self.admit:
            runner.admit_standby()
        self.detach()
        self._unhook = runner.before_step(self.at_step_start)
        self.micro_batch_size = max(int(micro_batch_size or 1), 1)
        self.redundancy = runner.config.redundancy

    def detach(self) -> None:
        self._unhook()
        self._unhook = _no_hook

    def begin(self, current: Placement, layer_costs: tuple[float, ...] | None) -> None:
        """Training starts (or resumes) in ``current``, the runtime's layout as a ``Placement``."""
        if (self.layout is None or not set(current.nodes) <= set(self.layout.nodes)
                or (current.stages, current.pipelines) != (self.layout.stages, self.layout.pipelines)):
            # a fresh start, or a restart in another layout: a job restarted from a checkpoint holds no
            # overloaded node, whatever the saved view said (a node admitted into a running job gets the
            # view of the layout it was admitted into, which is its runtime's)
            self.layout = current
        if self.stages is None:
            self.stages = max(self.layout.stages, current.stages)
        self.layer_costs = layer_costs

    # ------------------------------------------------------------------ at every step
    def at_step_start(self, runner: PipelineRunner, step: int) -> None:
        """Decide (agreed through the store) and reconfigure if the decision changes the pipeline."""
        if runner.session is None or self.layout is None or runner.layout is None:
            return
        self._follow_failovers(runner.failovers)
        mine = self.decide(runner.nodes, runner.standby, runner.layout.num_layers)
        proposal = {"action": mine.action, "reason": mine.reason, "moved": list(mine.moved), "layout": layout_json(mine.layout),
                    "by": runner.node}
        agreed = runner.agree("rebalance", step, proposal)
        if agreed["action"] == "keep":
            return
        new = layout_from_json(agreed["layout"])
        elastic = runner.host.global_micro_batches() is not None
        idle = sorted(set(runner.nodes) - set(new.nodes)) if new is not None else []
        if new is None or idle or (new.pipelines != runner.layout.pipelines and not elastic):
            reason = f"{agreed['action']} deferred: " + (
                "no layout (too few nodes)" if new is None else
                f"{new.stages}-stage pipelines leave {idle} of the {len(runner.nodes)} running nodes without layers, "
                f"and a reconfiguration never drops a running node; choose stages (now {self.stages}) that divide the "
                "running nodes" if idle else
                f"{new.pipelines} pipelines, but this job's sampler fixes the number of pipelines"
            )
            if reason != self._deferred:
                log.warning("%s: %s", type(self).__name__, reason)
                self._deferred = reason
            return
        order = list(new.order)  # rank r runs stage r // pipelines of pipeline r % pipelines
        parts = tuple(new.parts)
        # the policy keeps every pair of nodes whose joint loss is fatal on two machines where the nodes allow it
        warning = apart_warning(new.grid, [*runner.nodes, *runner.standby], machine_of,
                                where=f"{type(self).__name__}: the {agreed['action']} layout of step {step}",
                                kept=kept_in_rows(new.grid, self.redundancy))
        self.layout, self._deferred = new, None  # before the move: a joining node gets this state
        seconds = runner.reconfigure(order, parts, reason=f"{agreed['action']}: {agreed['reason']}",
                                     pipelines=new.pipelines)
        event = {"step": step, "action": agreed["action"], "reason": agreed["reason"], "order": order,
                 "parts": list(parts), "pipelines": new.pipelines, "moved": agreed["moved"], "seconds": seconds}
        self.decisions.append(event)
        log.warning("%s: step %d %s (%s) -> %s parts %s in %.2f s", type(self).__name__, step, agreed["action"],
                    agreed["reason"], order, list(parts), seconds)
        if warning:
            log.warning("%s", warning)
        self.on_decision(event)

    def _follow_failovers(self, failovers: Sequence[Failover | Restart]) -> None:
        """After a failover of a data-parallel layout, reason about the pipelines it kept.

        A failover of one pipeline leaves its lost nodes in the policy's view (their replica holders
        are overloaded); one of several pipelines dropped the pipelines that lost nodes (their
        survivors come back as standby nodes), or kept one that failed over on its own: the policy's
        view becomes those pipelines, lost nodes included.
        """
        assert self.layout is not None
        for record in failovers[self._failovers_seen:]:
            if isinstance(record, Failover) and record.old_pipelines > 1 and record.rows:
                total = sum(self.layout.micro_batches)
                self.layout = Placement(record.rows, record.old_parts, split_micro_batches(total, len(record.rows)))
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
            redundancy=self.redundancy,
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
                        moved_nodes(layout, planned_layout), decision.warning)

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        return {"layout": layout_json(self.layout), "stages": self.stages, "decisions": list(self.decisions)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if (saved := layout_from_json(state_dict.get("layout"))) is not None:
            self.layout = saved
        self.stages = state_dict.get("stages", self.stages)
        self.decisions = list(state_dict.get("decisions", []))


def from_config(entry: Any, name: str = '"bamboo.rebalance"') -> Rebalancer | None:
    """A config entry as a ``Rebalancer`` (None for ``false``): ``true`` for the defaults, or a dict of its arguments
    (``stages``, ``min_stages``, ``max_overloaded_fraction``, ``admit``); ``name`` is the entry's, for the errors
    (``topology.policy.rebalance_arguments`` checks it)."""
    arguments = rebalance_arguments(entry, name)
    return None if arguments is None else Rebalancer(**arguments)


def runtime_placement(runner: PipelineRunner, global_micro_batches: int | None) -> Placement:
    """The pipeline ``runner`` runs now, as the policy's ``Placement`` (its ``layout`` is the runner's).

    ``global_micro_batches``: the micro-batches of a step over all pipelines when the data is loaded by
    global steps (the pipelines share them); None: each pipeline has ``runner.micro_batches`` of its own."""
    runtime, names = runner.layout, runner.nodes
    assert runtime is not None, "the runner's stage is built (start) before the rebalancer begins"
    grid = tuple(tuple(names[s * runtime.pipelines + p] for s in range(runtime.stages)) for p in range(runtime.pipelines))
    if global_micro_batches:
        return Placement(grid, tuple(runtime.parts), split_micro_batches(int(global_micro_batches), runtime.pipelines))
    return Placement(grid, tuple(runtime.parts), (runner.micro_batches,) * runtime.pipelines)


def _no_hook() -> None:
    pass


def _ignore(_event: dict[str, Any]) -> None:
    pass


def layout_json(layout: Placement | None) -> dict[str, Any] | None:
    if layout is None:
        return None
    return {"grid": [list(r) for r in layout.grid], "parts": list(layout.parts), "micro_batches": list(layout.micro_batches)}


def layout_from_json(saved: dict[str, Any] | None) -> Placement | None:
    if saved is None:
        return None
    return Placement(tuple(tuple(r) for r in saved["grid"]), tuple(saved["parts"]), tuple(saved["micro_batches"]))
