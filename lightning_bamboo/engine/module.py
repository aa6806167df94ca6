"""Building the layers of a pipeline under a fixed seed, and a PipelineModule cut at given boundaries."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from lightning_bamboo.errors import BambooConfigError


@dataclass
class BuiltLayers:
    """The layers of a model built in order under one seed; those not kept are ``None``."""

    layers: list[Any]  # nn.Module, a plain callable, or None where the layer lives elsewhere
    param_counts: list[int]  # trainable parameters per layer (DeepSpeed's "parameters" weights)
    names: list[str]  # class name per layer (DeepSpeed's "type:REGEX" partitioning)


def build_layers(
    factory: Callable[[], Sequence[Any]], seed: int, keep: Callable[[int], bool] = lambda i: True
) -> BuiltLayers:
    """Call ``factory`` under ``torch.manual_seed(seed)`` and build its LayerSpecs in order.

    The weights equal ``torch.manual_seed(seed); nn.Sequential(*factory())`` whatever is kept,
    because every layer is built in the same order on every process. Layers for which
    ``keep(index)`` is false are dropped as soon as they are counted. The caller's RNG state
    is left as it was.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        specs = list(factory())
        if not specs:
            raise BambooConfigError("configure_pipeline() returned no layers; return a list of nn.Module layers")
        layers: list[Any] = []
        counts: list[int] = []
        names: list[str] = []
        for index, spec in enumerate(specs):
            if isinstance(spec, TiedLayerSpec):
                raise BambooConfigError(
                    f"layer {index} is a TiedLayerSpec, which lightning_bamboo does not support yet; "
                    f"share the weight explicitly (e.g. copy it after the step) or untie it"
                )
            layer = spec.build() if isinstance(spec, LayerSpec) else spec
            specs[index] = None  # let a LayerSpec-built layer that is not kept be freed
            if not isinstance(layer, nn.Module) and not callable(layer):
                raise BambooConfigError(
                    f"configure_pipeline() must return nn.Module layers, LayerSpecs or callables; "
                    f"layer {index} is a {type(layer).__name__}"
                )
            counts.append(
                sum(p.numel() for p in layer.parameters() if p.requires_grad) if isinstance(layer, nn.Module) else 0
            )
            names.append(type(layer).__name__ if isinstance(layer, nn.Module) else getattr(layer, "__name__", "fn"))
            layers.append(layer if keep(index) else None)
    return BuiltLayers(layers, counts, names)


class BambooPipelineModule(PipelineModule):
    """A ``PipelineModule`` cut at explicit layer boundaries (``parts``) instead of by a method.

    Layers that other stages own may be ``None``: only this stage's layers are touched.
    """

    def __init__(self, layers: Sequence[Any], parts: Sequence[int], **kwargs: Any) -> None:
        self._bamboo_parts = list(parts)
        super().__init__(layers=layers, **kwargs)
        self._layer_specs: list[Any] = [None] * self._num_layers  # drop references to the other stages' layers

    def _partition_layers(self, method: str = "uniform") -> None:  # noqa: ARG002 - DeepSpeed's signature
        num_stages = self._topo.get_dim("pipe")
        stage_id = self._topo.get_coord(self.global_rank).pipe
        if len(self._bamboo_parts) != num_stages + 1:
            raise BambooConfigError(
                f"partition {self._bamboo_parts} has {len(self._bamboo_parts) - 1} stages but the topology has {num_stages}"
            )
        self.parts = list(self._bamboo_parts)
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])
