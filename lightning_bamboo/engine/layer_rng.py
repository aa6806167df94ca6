"""Random numbers that belong to a layer, not to the process that runs it.

Dropout (or any layer that draws from torch's default generators) takes its numbers from the
process's stream. In a pipeline that stream is the stage's: when a failover hands a stage's layers
to its predecessor, when a reconfiguration moves a layer, when a checkpoint is resumed in another
layout or an eager redundant forward runs the successor's layers on the predecessor, the same layer
would draw other numbers than in a run without preemptions, and the weights would part from it.

So while training, each layer's forward draws from a stream of its own, seeded by what the layer
computes and never by where: ``layer_seed(seed, step, layer, micro_batch)`` with the layer's global
index and the micro-batch's index in the step's global batch (``pipeline_share``'s ``first`` plus the
local index). Nothing has to travel with a layer: every process that runs it, on any stage of any
layout, draws the same numbers. The process's own streams are saved before and restored after, so
anything else the process draws (its loss, its data) is unchanged by the layers it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(x: int) -> int:
    """SplitMix64's finaliser: every input bit reaches every output bit."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def layer_seed(seed: int, step: int, layer: int, micro_batch: int) -> int:
    """The seed of ``layer``'s forward on global micro-batch ``micro_batch`` of training step ``step`` (63 bits)."""
    x = 0
    for part in (seed, step, layer, micro_batch):
        x = _mix((x + (part & _MASK) + _GOLDEN) & _MASK)
    return x >> 1


@dataclass(frozen=True)
class StepKeys:
    """What the layers' seeds of one training step are made of: the job's seed, the step, and the global index
    of this pipeline's first micro-batch; ``cuda``: the GPU whose generator the layers draw from, if any."""

    seed: int
    step: int
    first_micro_batch: int = 0
    cuda: int | None = None

    def generators(self) -> list[torch.Generator]:
        generators = [torch.default_generator]
        if self.cuda is not None:
            generators.append(torch.cuda.default_generators[self.cuda])
        return generators


def run_layers(calls: Iterable[tuple[int, Callable[[Any], Any]]], x: Any, keys: StepKeys | None,
               micro_batch: int) -> Any:
    """Run ``(global index, layer)`` pairs in order on ``x``; with ``keys``, each layer draws from its own stream
    for local micro-batch ``micro_batch`` (see the module docstring), the process's streams restored after."""
    if keys is None:
        for _, layer in calls:
            x = layer(x)
        return x
    generators = keys.generators()
    saved = [g.get_state() for g in generators]
    global_micro_batch = keys.first_micro_batch + micro_batch
    try:
        for index, layer in calls:
            seed = layer_seed(keys.seed, keys.step, index, global_micro_batch)
            for generator in generators:
                generator.manual_seed(seed)
            x = layer(x)
    finally:
        for generator, state in zip(generators, saved, strict=True):
            generator.set_state(state)
    return x


def run_layers_checkpointed(calls: Sequence[tuple[int, Callable[[Any], Any]]], x: Any, keys: StepKeys | None,
                            micro_batch: int, every: int) -> Any:
    """``run_layers`` in activation-checkpointed segments of ``every`` layers (0, or no autograd: plainly).

    A segment keeps only its input; its backward runs its forward again. With ``keys`` each layer re-seeds its
    streams from them, so the recompute draws the same dropout masks and the gradients are bit for bit those of
    ``run_layers``; without keys, torch restores the process's streams for the recompute.
    """
    if not every or not torch.is_grad_enabled():
        return run_layers(calls, x, keys, micro_batch)
    from torch.utils.checkpoint import checkpoint

    for start in range(0, len(calls), every):
        x = checkpoint(run_layers, list(calls[start : start + every]), x, keys, micro_batch, use_reentrant=False,
                       preserve_rng_state=keys is None)
    return x
