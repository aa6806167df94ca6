"""The first layer split of a job: DeepSpeed's partition methods, or boundaries the user gives."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.topology.layout import check_parts, even_parts, partition_weights


def compute_parts(
    partition: str | Sequence[int],
    stages: int,
    param_counts: Sequence[int],
    layer_names: Sequence[str],
) -> tuple[int, ...]:
    """Layer boundaries for ``stages`` stages by DeepSpeed's methods or an explicit list."""
    num_layers = len(param_counts)
    if stages > num_layers:
        raise BambooConfigError(
            f"a pipeline cannot have more stages than layers (stages: {stages}, layers: {num_layers}); "
            f"use stages <= {num_layers} or split the model into more layers in configure_pipeline()"
        )
    from deepspeed.runtime.utils import partition_balanced, partition_uniform

    if not isinstance(partition, str):
        parts = [int(p) for p in partition]
    elif partition == "uniform":
        parts = list(partition_uniform(num_items=num_layers, num_parts=stages))
    else:  # "parameters", or "type:REGEX": balance the layers whose class name matches
        weights = partition_weights(partition, param_counts, layer_names)
        assert weights is not None
        if not any(weights):
            raise BambooConfigError(
                f"partition {partition!r} matches no layer class (classes: {sorted(set(layer_names))})"
            )
        parts = list(partition_balanced(weights=weights, num_parts=stages))
    parts = [int(p) for p in parts]  # DeepSpeed returns numpy integers
    try:
        check_parts(parts, stages, num_layers)
    except BambooConfigError as err:
        if isinstance(partition, str):
            raise BambooConfigError(
                f"partition {partition!r} cannot cut {num_layers} layers into {stages} stages: {err}; "
                f"use partition='uniform' or an explicit list such as {list(even_parts(num_layers, stages))}"
            ) from None
        raise
    return tuple(parts)
