"""Step time of a layout, scaled from one reference step time with the 1F1B pipeline formula.

A step of a ``pipelines x stages`` layout takes ``(m + stages - 1)`` slots of the slowest stage,
where ``m`` is the largest number of micro-batches a pipeline runs (1F1B: ``stages - 1`` slots of
fill and drain). A slot's length is proportional to the layers of the widest stage. The absolute
scale comes from ``step_seconds`` measured (or assumed) at ``step_pipelines x stages``.
"""

from __future__ import annotations

import math

from lightning_bamboo.schedule.reroute import rerouted_step
from lightning_bamboo.sim.params import SimParams
from lightning_bamboo.topology.layout import even_parts
from lightning_bamboo.topology.policy import Placement, PolicyConfig


def policy_config(params: SimParams) -> PolicyConfig:
    """The reconfiguration policy's settings taken from the simulator's parameters."""
    return PolicyConfig(
        stages=params.stages,
        layers=params.layers,
        global_micro_batches=params.global_micro_batches,
        min_stages=params.min_stages,
        max_overloaded_fraction=params.max_overloaded_fraction,
        pipeline_micro_batches=params.pipeline_micro_batches or None,
    )


def _slots(micro_batches: int, parts: tuple[int, ...]) -> float:
    stages = len(parts) - 1
    widest = max(b - a for a, b in zip(parts, parts[1:], strict=False))
    return (micro_batches + stages - 1) * widest


def step_seconds(layout: Placement, params: SimParams) -> float:
    """Seconds per optimizer step of ``layout`` without redundancy or failures.

    A layout of one pipeline scales from ``single_pipeline_step_seconds`` when that is set (measured
    where nodes share compute, so that fewer pipelines are not slower as the formula says), every
    other from ``step_seconds`` at ``step_pipelines``. ``step_fixed_seconds`` of it do not scale.
    """
    pipelines, seconds = params.step_pipelines, params.step_seconds
    if layout.pipelines == 1 and params.single_pipeline_step_seconds:
        pipelines, seconds = 1, params.single_pipeline_step_seconds
    fixed = min(params.step_fixed_seconds, seconds)
    reference = reference_slots(params, pipelines)
    return fixed + (seconds - fixed) * _slots(max(layout.micro_batches), layout.parts) / reference


def reference_slots(params: SimParams, pipelines: int | None = None) -> float:
    """Layer-slots of the step that ``step_seconds`` times: ``(m + stages - 1)`` micro-batch slots of the widest
    stage's layers, at ``pipelines`` (default ``step_pipelines``) pipelines of ``stages`` (a layer-slot: one layer's
    forward and backward of one micro-batch)."""
    ref_m = max(policy_config(params).micro_batches(pipelines or params.step_pipelines))
    return _slots(ref_m, even_parts(params.layers, params.stages))


def step_rate(
    layout: Placement | None, params: SimParams, *, redundancy: bool = False, overloaded: bool = False
) -> float:
    """Optimizer steps per second of ``layout``; Bamboo adds its redundancy overhead and the
    failover slowdown while a node runs two stages."""
    if layout is None:
        return 0.0
    seconds = step_seconds(layout, params)
    if redundancy:
        seconds *= 1.0 + params.redundancy_overhead
    if overloaded:
        seconds *= params.failover_slowdown
    return 1.0 / seconds


def samples_per_step(layout: Placement, params: SimParams) -> int:
    return params.micro_batch_size * sum(layout.micro_batches)


def samples_per_second(
    layout: Placement | None, params: SimParams, *, redundancy: bool = False, overloaded: bool = False
) -> float:
    """Training rate of ``layout`` in samples per second (see :func:`step_rate`)."""
    if layout is None:
        return 0.0
    return samples_per_step(layout, params) * step_rate(
        layout, params, redundancy=redundancy, overloaded=overloaded
    )


def young_interval(save_seconds: float, mean_seconds_between_failures: float) -> float:
    """Young's checkpoint interval ``sqrt(2 * save * MTBF)`` (0 when there are no failures)."""
    if not math.isfinite(mean_seconds_between_failures) or save_seconds <= 0:
        return 0.0
    return math.sqrt(2.0 * save_seconds * mean_seconds_between_failures)


def runtime_interval(save_seconds: float, elapsed_seconds: float, failures: int) -> float:
    """The checkpoint interval a running job can choose: Young-Daly ``sqrt(2 * save * MTBF)`` with the
    MTBF estimated from what it has seen, ``max(elapsed, save) / (failures + 1)`` (one failure is
    counted ahead, so that a job that has seen none still saves, less often the longer it runs)."""
    if save_seconds <= 0:
        return 0.0
    mtbf = max(elapsed_seconds, save_seconds) / (failures + 1)
    return math.sqrt(2.0 * save_seconds * mtbf)


def rerouted_slowdown(layout: Placement, lost: set[str] | frozenset[str]) -> float:
    """Step-time factor of ``layout`` while ``lost`` nodes' micro-batches go to the same stage of
    the other pipelines (ReCycle-style rerouting; ``inf`` when a stage has no node left).

    The rerouted step is timed with its dependencies (``schedule.reroute``: list scheduling of the
    step's graph, a forward costing 1 and a backward 2, as the schedule's model): the extra work of
    a stage competes with its own where the micro-batches of every pipeline arrive together, and
    fills the idle slots only at the fill and the drain. The slowest node sets the step (the
    pipelines meet at the gradient all-reduce).
    """
    positions = {(q, s) for q, row in enumerate(layout.grid) for s, node in enumerate(row) if node in lost}
    if not positions:
        return 1.0
    stages = layout.stages
    if any(all((q, s) in positions for q in range(layout.pipelines)) for s in range(stages)):
        return math.inf
    return rerouted_step(stages, tuple(layout.micro_batches), positions).slowdown
