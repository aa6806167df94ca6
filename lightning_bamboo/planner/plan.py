"""Search micro-batch sizes, depths and data-parallel degrees for a world size; the Plan and the plan table."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from typing import Any

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.planner.costmodel import (
    REDUNDANCY_MODES,
    Hardware,
    ModelProfile,
    StageEstimate,
    redundancy_cost,
)
from lightning_bamboo.planner.memory import LayerMemory, MemorySettings, pipeline_memory
from lightning_bamboo.planner.solver import NoSplit, SegmentTables, replica_bytes, solve_split
from lightning_bamboo.topology.replicas import kept_in_rows


class NoFeasiblePlanError(BambooConfigError):
    """No layout of the model fits the workers' memory (or the world size admits none)."""


class LayerTooLargeError(NoFeasiblePlanError):
    """A single layer does not fit one worker's memory, whatever the layout."""


def _mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


@dataclass(frozen=True)
class Alternative:
    """A feasible layout that lost to the chosen one."""

    stages: int
    pipelines: int
    micro_batch_size: int
    micro_batches: int
    partition: tuple[int, ...]
    predicted_step_seconds: float
    samples_per_second: float


@dataclass(frozen=True)
class Infeasible:
    """A layout that was rejected, and why."""

    stages: int
    pipelines: int
    micro_batch_size: int
    reason: str


@dataclass(frozen=True)
class Plan:
    """The chosen layout for one world size: what BambooStrategy needs, and what the planner predicts."""

    world_size: int
    stages: int
    pipelines: int
    micro_batch_size: int
    micro_batches: int
    global_batch: int  # samples per optimizer step over all pipelines
    partition: tuple[int, ...]  # DeepSpeed's ``parts``: stages + 1 boundaries from 0 to num_layers
    predicted_step_seconds: float
    samples_per_second: float
    stage_seconds: tuple[float, ...]  # busy time per micro-batch (forward + backward + transfers)
    stage_memory_bytes: tuple[int, ...]  # with ``replica``: the successor's replica included
    memory_limit_bytes: int
    scale_batch: bool = False  # Hydrozoa mode: the global batch grows with the pipelines
    stage_estimates: tuple[StageEstimate, ...] = ()
    alternatives: tuple[Alternative, ...] = ()
    infeasible: tuple[Infeasible, ...] = ()
    planning_seconds: float = 0.0
    #: ``redundancy`` priced (``redundancy_cost``): "off", or "lazy"/"eager" with the replicas held and their time;
    #: under "auto" what it is for this layout (``layout_redundancy``)
    redundancy: str = "off"
    redundancy_seconds: float = 0.0  # of ``predicted_step_seconds``: what the redundancy adds to the step
    #: per stage, without the successor's replica (equal to ``stage_memory_bytes`` when no replica is counted)
    stage_memory_without_replica_bytes: tuple[int, ...] = ()
    #: per stage under "eager": the micro-batches whose successor forward fits its bubbles (the rest are
    #: recomputed after a failure); empty otherwise
    redundant_forwards: tuple[int, ...] = ()
    #: per stage under "eager": host memory those forwards hold until the step commits (their saved activations,
    #: inputs and outputs; pinned host memory beside a GPU, the same memory as the stage on CPU workers)
    redundant_forward_bytes: tuple[int, ...] = ()
    #: activation checkpointing's layers per segment the plan was made with (0: off; ``checkpoint_every`` of
    #: ``estimate_step``): memory and backward times count it
    activation_checkpointing: int = 0
    #: per stage, its node's predicted peak (``planner.memory``): ``total_bytes`` (the worker's peak and its
    #: communication processes), ``worker_bytes``, the ``phase`` of the peak and ``owners`` (bytes by owner)
    node_memory: tuple[dict[str, Any], ...] = ()

    def __post_init__(self) -> None:
        parts = list(self.partition)
        if len(parts) != self.stages + 1 or parts[0] != 0 or any(b <= a for a, b in pairwise(parts)):
            raise BambooConfigError(
                f"Plan.partition must list stages + 1 = {self.stages + 1} increasing boundaries from 0 "
                f"(got {parts})"
            )
        if self.stages * self.pipelines > self.world_size:
            raise BambooConfigError(
                f"a plan uses stages x pipelines workers ({self.stages} x {self.pipelines}), "
                f"more than the world size {self.world_size}"
            )
        if self.micro_batch_size * self.micro_batches * self.pipelines != self.global_batch:
            raise BambooConfigError(
                f"global batch must equal micro_batch_size x micro_batches x pipelines "
                f"({self.micro_batch_size} x {self.micro_batches} x {self.pipelines} != {self.global_batch})"
            )

    @property
    def layout(self) -> str:
        return f"{self.pipelines} pipeline(s) x {self.stages} stage(s)"

    @property
    def batch_per_pipeline(self) -> int:
        """The batch each data-parallel rank's dataloader yields per step."""
        return self.micro_batch_size * self.micro_batches

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["layout"] = self.layout
        return json.loads(json.dumps(out))  # tuples -> lists, only JSON types left

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read what ``to_json`` (or ``lightning-bamboo plan --json``) wrote."""
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        raw = {k: v for k, v in data.items() if k != "layout"}
        raw["partition"] = tuple(raw["partition"])
        raw["stage_seconds"] = tuple(raw["stage_seconds"])
        raw["stage_memory_bytes"] = tuple(raw["stage_memory_bytes"])
        raw["stage_memory_without_replica_bytes"] = tuple(raw.get("stage_memory_without_replica_bytes", ()))
        raw["redundant_forwards"] = tuple(raw.get("redundant_forwards", ()))
        raw["redundant_forward_bytes"] = tuple(raw.get("redundant_forward_bytes", ()))
        raw["stage_estimates"] = tuple(StageEstimate(**s) for s in raw.get("stage_estimates", ()))
        raw["alternatives"] = tuple(
            Alternative(**{**a, "partition": tuple(a["partition"])}) for a in raw.get("alternatives", ())
        )
        raw["infeasible"] = tuple(Infeasible(**i) for i in raw.get("infeasible", ()))
        raw["node_memory"] = tuple(raw.get("node_memory", ()))
        return cls(**raw)

    def format_memory(self) -> str:
        """Each node's predicted peak by owner, in GiB (``lightning-bamboo plan``)."""
        gib = 2**30
        return "\n".join(
            f"  node {k}: {node['total_bytes'] / gib:.2f} GiB at its {node['phase']} ("
            + ", ".join(f"{owner} {value / gib:.2f}" for owner, value in node["owners"].items()) + ")"
            for k, node in enumerate(self.node_memory))


def memory_layers(profile: ModelProfile, micro_batch_size: int) -> list[LayerMemory]:
    """The profile's layers as ``planner.memory`` counts them at ``micro_batch_size`` (fp32 gradients: 4 bytes per
    trainable parameter)."""
    out = []
    for layer in profile.layers:
        cost = layer.at(micro_batch_size)
        params = layer.grad_bytes // 4
        out.append(LayerMemory(params, min(layer.largest_param_bytes // 4, params), cost.activation_bytes,
                               cost.output_bytes))
    return out


def node_memory_of(profile: ModelProfile, partition: tuple[int, ...], micro_batch_size: int, micro_batches: int,
                   pipelines: int, redundancy: str, checkpoint_every: int) -> tuple[dict[str, Any], ...]:
    """Every node's predicted peak for a layout (``Plan.node_memory``), with the profiled optimizer's state."""
    params = sum(layer.grad_bytes for layer in profile.layers) // 4
    optimizer = sum(layer.optimizer_bytes for layer in profile.layers)
    settings = MemorySettings(optimizer_bytes_per_param=round(optimizer / params) if params else 0)
    nodes = pipeline_memory(memory_layers(profile, micro_batch_size), partition, micro_batches, redundancy=redundancy,
                            pipelines=pipelines, checkpoint_every=checkpoint_every, settings=settings)
    return tuple({"total_bytes": node.total_bytes, "worker_bytes": node.peak_bytes, "phase": node.peak.name,
                  "owners": node.by_owner()} for node in nodes)


#: ``redundancy`` values ``plan`` takes: the priced ones, and "auto" (the strategy's default), resolved per layout
PLANNED_MODES = (*REDUNDANCY_MODES, "auto")


def layout_redundancy(redundancy: str, stages: int, pipelines: int, copies_apart: bool = True) -> str:
    """What ``redundancy`` is for a layout of ``pipelines`` pipelines of ``stages`` stages: itself, except ``"auto"``,
    which keeps a successor replica only for a stage with no data-parallel copy on another machine
    (``topology.replicas``): ``"lazy"`` with one pipeline, or with several whose copies share one machine
    (``copies_apart`` False: every worker on one machine), ``"off"`` with several whose copies of each stage run on
    two machines or more (the launcher's order across machines, or one worker per machine), and with one stage (it
    has no successor to hold)."""
    if redundancy != "auto":
        return redundancy
    # the runtime's rule on the layout's rows: pipeline p on machine "m<p>" (apart) or every node on "m0"
    rows = [[f"m{p if copies_apart else 0}.{p * stages + s}" for s in range(stages)] for p in range(pipelines)]
    return "lazy" if any(kept_in_rows(rows, "auto")) else "off"


def _layouts(world_size: int, num_layers: int, allow_idle: bool) -> list[tuple[int, int]]:
    """(stages, pipelines) pairs using all workers (or at most all, with ``allow_idle``)."""
    pairs = []
    for stages in range(1, world_size + 1):
        for pipelines in range(1, world_size // stages + 1):
            if allow_idle or stages * pipelines == world_size:
                pairs.append((stages, pipelines))
    return pairs


def _check_layers_fit(profile: ModelProfile, hw: Hardware) -> None:
    smallest = profile.micro_batch_sizes[0]
    for index, layer in enumerate(profile.layers):
        need = layer.static_bytes + layer.at(smallest).activation_bytes
        if need > hw.memory_bytes:
            raise LayerTooLargeError(
                f"layer {index} ({layer.name}) alone needs {_mib(need)} (parameters+gradients+optimizer "
                f"{_mib(layer.static_bytes)}, activations {_mib(layer.at(smallest).activation_bytes)} at "
                f"micro-batch {smallest}), above the per-worker memory limit {_mib(hw.memory_bytes)}: no layout "
                f"can hold it; raise the limit to at least {_mib(need)} or split that layer"
            )


def plan(
    profile: ModelProfile,
    hw: Hardware,
    world_size: int,
    global_batch: int,
    *,
    scale_batch: bool = False,
    allow_idle: bool = False,
    alternatives: int = 5,
    replica: bool = False,
    redundancy: str = "off",
    activation_checkpointing: int = 0,
    copies_apart: bool = True,
    _tables: dict[int, SegmentTables] | None = None,
) -> Plan:
    """The layout with the most samples per second for ``world_size`` workers.

    With ``replica`` (``redundancy`` lazy or eager) every worker also holds its successor's stage, weights,
    gradients and optimizer state, in the same memory: every layout the plan considers fits with it
    (``solve_split``), so where a replica would not fit a deeper pipeline (smaller stages) wins.

    ``redundancy`` ("lazy" or "eager") prices the redundancy's time
    (``costmodel.redundancy_cost``: the replica's update and the gradients shipped to the replica holder, beyond
    what the stage's bubbles and idle link absorb; eager's redundant forwards take only what the bubbles have
    left, and ``redundant_forwards`` says how many fit). Layouts are ranked with it;
    each layout's split is the best one without it. Pass ``replica`` too unless the replicas live elsewhere
    (in host memory while the stages run on GPUs).

    ``redundancy="auto"`` (the strategy's default) is resolved per layout (``layout_redundancy``): a layout of one
    pipeline is priced and fitted as ``lazy`` (its replicas held where ``replica`` says they live), one of several
    pipelines as ``off`` where their copies of each stage run on different machines (``copies_apart``, the default;
    False where every worker shares one machine: then ``lazy`` too). So with enough workers a layout of several
    pipelines may win by the replicas it does not hold.

    ``activation_checkpointing`` (layers per segment, the strategy's option; 0: off): a micro-batch in flight keeps
    only its segments' inputs, a backward holds one segment's activations again and first runs its forward again
    (``costmodel.estimate_step``), so layouts that did not fit may, at the cost of that recompute.

    ``global_batch`` is fixed by default (samples per step over all pipelines). With
    ``scale_batch`` (Hydrozoa) it is the batch of one pipeline and the step's batch grows with
    the number of pipelines. ``allow_idle`` lets a plan leave workers unused.
    """
    if world_size < 1 or global_batch < 1:
        raise BambooConfigError(
            f"world_size and global_batch must be >= 1 (got {world_size}, {global_batch})"
        )
    if redundancy not in PLANNED_MODES:
        raise BambooConfigError(f"redundancy must be one of {list(PLANNED_MODES)} (got {redundancy!r}); "
                                "\"off\" plans without replicas")
    started = time.perf_counter()
    _check_layers_fit(profile, hw)
    tables = _tables if _tables is not None else {}
    feasible: list[tuple[tuple[float, int, int, int], int, int, Alternative, Any]] = []
    rejected: list[Infeasible] = []
    least_memory = float("inf")
    for stages, pipelines in _layouts(world_size, profile.num_layers, allow_idle):
        mode = layout_redundancy(redundancy, stages, pipelines, copies_apart)
        holds = replica and mode != "off" if redundancy == "auto" else replica
        for mbs in profile.micro_batch_sizes:
            per_pipeline = global_batch if scale_batch else global_batch // pipelines
            if not scale_batch and global_batch % pipelines:
                rejected.append(Infeasible(stages, pipelines, mbs, f"global batch {global_batch} is not divisible by {pipelines} pipelines"))
                continue
            if per_pipeline % mbs:
                rejected.append(Infeasible(stages, pipelines, mbs, f"batch per pipeline {per_pipeline} is not divisible by micro-batch size {mbs}"))
                continue
            if stages > profile.num_layers:
                rejected.append(Infeasible(stages, pipelines, mbs, f"{stages} stages need at least {stages} layers (the model has {profile.num_layers})"))
                continue
            micro_batches = per_pipeline // mbs
            if mbs not in tables or tables[mbs].checkpoint_every != activation_checkpointing:
                tables[mbs] = SegmentTables(profile, hw, mbs, activation_checkpointing)
            result = solve_split(profile, hw, stages, mbs, micro_batches, pipelines, tables=tables[mbs], replica=holds)
            if isinstance(result, NoSplit):
                least_memory = min(least_memory, result.min_peak_memory_bytes)
                rejected.append(Infeasible(stages, pipelines, mbs, result.reason))
                continue
            samples = per_pipeline * pipelines
            priced = redundancy_cost(profile, hw, result.estimate, mbs, micro_batches, mode)
            step = result.estimate.step_seconds + priced.step_seconds
            alt = Alternative(stages, pipelines, mbs, micro_batches, result.partition, step, samples / step)
            # most samples/s; ties: fewer workers, fewer stages (fewer failure points), larger micro-batch
            key = (step / samples, stages * pipelines, stages, -mbs)
            feasible.append((key, stages, pipelines, alt, (result, priced, mode, holds)))
    if not feasible:
        shown = "; ".join(f"{r.pipelines}x{r.stages} mb{r.micro_batch_size}: {r.reason}" for r in rejected[:6])
        more = f" (+{len(rejected) - 6} more)" if len(rejected) > 6 else ""
        hint = (
            f"the least memory any layout needs is {_mib(least_memory)} per worker; raise the limit "
            f"({_mib(hw.memory_bytes)}) to that, use smaller micro-batches"
            + (", activation checkpointing (activation_checkpointing=1)" if not activation_checkpointing else "")
            + " or more workers"
            if least_memory != float("inf")
            else "use a world size whose divisors give a depth <= the number of layers, or allow idle workers"
        )
        raise NoFeasiblePlanError(
            f"no layout of {profile.num_layers} layers fits {world_size} worker(s) with "
            f"{_mib(hw.memory_bytes)} each and global batch {global_batch}: {shown}{more}. Fix: {hint}"
        )
    feasible.sort(key=lambda item: item[0])
    _, _, _, best, (result, priced, mode, holds) = feasible[0]
    est = result.estimate
    return Plan(
        world_size=world_size,
        stages=best.stages,
        pipelines=best.pipelines,
        micro_batch_size=best.micro_batch_size,
        micro_batches=best.micro_batches,
        global_batch=best.micro_batch_size * best.micro_batches * best.pipelines,
        partition=best.partition,
        predicted_step_seconds=best.predicted_step_seconds,
        samples_per_second=best.samples_per_second,
        stage_seconds=tuple(s.busy_seconds for s in est.stages),
        stage_memory_bytes=tuple(int(s.memory_bytes + r) for s, r in zip(
            est.stages, replica_bytes(best.partition, tables[best.micro_batch_size]) if holds else [0] * len(est.stages),
            strict=True)),
        memory_limit_bytes=hw.memory_bytes,
        scale_batch=scale_batch,
        stage_estimates=est.stages,
        alternatives=tuple(item[3] for item in feasible[1 : 1 + alternatives]),
        infeasible=tuple(rejected),
        planning_seconds=time.perf_counter() - started,
        redundancy=mode,
        redundancy_seconds=priced.step_seconds,
        redundant_forwards=priced.forwards if mode == "eager" else (),
        redundant_forward_bytes=priced.kept_bytes if mode == "eager" else (),
        stage_memory_without_replica_bytes=tuple(int(s.memory_bytes) for s in est.stages),
        activation_checkpointing=activation_checkpointing,
        node_memory=node_memory_of(profile, best.partition, best.micro_batch_size, best.micro_batches, best.pipelines,
                                   mode if mode != "off" else "lazy" if holds else "off",
                                   activation_checkpointing),
    )


@dataclass(frozen=True)
class PlanTable:
    """A plan for every world size 1..N: re-planning after a join or a leave is a lookup."""

    plans: tuple[Plan | None, ...]  # index w - 1 holds world size w
    errors: tuple[str, ...] = field(default=())  # index w - 1: why world size w has no plan ("" if it has)

    def __post_init__(self) -> None:
        if len(self.errors) != len(self.plans):
            raise BambooConfigError(
                f"PlanTable needs one error entry per world size ({len(self.plans)} plans, {len(self.errors)} errors)"
            )

    @property
    def max_world_size(self) -> int:
        return len(self.plans)

    def lookup(self, world_size: int) -> Plan:
        if not 1 <= world_size <= self.max_world_size:
            raise BambooConfigError(
                f"the plan table covers world sizes 1..{self.max_world_size} (asked for {world_size}); "
                f"build it with max_world_size >= {world_size}"
            )
        found = self.plans[world_size - 1]
        if found is None:
            raise NoFeasiblePlanError(self.errors[world_size - 1])
        return found

    def to_dict(self) -> dict[str, Any]:
        return {
            "plans": [p.to_dict() if p is not None else None for p in self.plans],
            "errors": list(self.errors),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlanTable:
        return cls(
            plans=tuple(Plan.from_dict(p) if p is not None else None for p in data["plans"]),
            errors=tuple(data["errors"]),
        )

    def format(self) -> str:
        """One row per world size, like a table in a README."""
        held = any(p is not None and p.stage_memory_without_replica_bytes and
                   p.stage_memory_without_replica_bytes != p.stage_memory_bytes for p in self.plans)
        priced = any(p is not None and p.redundancy != "off" for p in self.plans)
        header = (f"{'workers':>7} {'stages':>6} {'pipes':>5} {'mb':>3} {'m':>4} {'batch':>6} {'step s':>9} "
                  f"{'samples/s':>10} {'max MiB':>8}" + (f" {'no-rep MiB':>10}" if held else "")
                  + (f" {'+rc s':>7}" if priced else "") + "  partition")
        rows = [header, "-" * len(header)]
        for w, p in enumerate(self.plans, start=1):
            if p is None:
                rows.append(f"{w:>7}  no layout: {self.errors[w - 1][:90]}")
                continue
            rows.append(
                f"{w:>7} {p.stages:>6} {p.pipelines:>5} {p.micro_batch_size:>3} {p.micro_batches:>4} "
                f"{p.global_batch:>6} {p.predicted_step_seconds:>9.4f} {p.samples_per_second:>10.1f} "
                f"{max(p.stage_memory_bytes) / 2**20:>8.1f}"
                + (f" {max(p.stage_memory_without_replica_bytes or p.stage_memory_bytes) / 2**20:>10.1f}" if held else "")
                + (f" {p.redundancy_seconds:>7.4f}" if priced else "") + f"  {list(p.partition)}"
            )
        return "\n".join(rows)


def plan_table(
    profile: ModelProfile,
    hw: Hardware,
    max_world_size: int,
    global_batch: int,
    *,
    scale_batch: bool = False,
    allow_idle: bool = False,
    alternatives: int = 5,
    replica: bool = False,
    redundancy: str = "off",
    activation_checkpointing: int = 0,
    copies_apart: bool = True,
) -> PlanTable:
    """Plans for world sizes 1..max_world_size; a size with no valid layout keeps its error message."""
    if max_world_size < 1:
        raise BambooConfigError(f"max_world_size must be >= 1 (got {max_world_size})")
    _check_layers_fit(profile, hw)  # no world size can help: fail loudly at once
    tables: dict[int, SegmentTables] = {}
    plans: list[Plan | None] = []
    errors: list[str] = []
    for w in range(1, max_world_size + 1):
        try:
            plans.append(
                plan(profile, hw, w, global_batch, scale_batch=scale_batch, allow_idle=allow_idle,
                     alternatives=alternatives, replica=replica, redundancy=redundancy,
                     activation_checkpointing=activation_checkpointing, copies_apart=copies_apart, _tables=tables)
            )
            errors.append("")
        except NoFeasiblePlanError as err:
            plans.append(None)
            errors.append(str(err))
    return PlanTable(tuple(plans), tuple(errors))
