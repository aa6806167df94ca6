"""The rank-based pipeline layout: stages x pipelines, layer boundaries and micro-batching (pure, no torch)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_bamboo.errors import BambooConfigError

#: ``"auto"`` keeps a replica only of the stages without a data-parallel copy on another machine (``replicas``)
REDUNDANCY_MODES = ("off", "lazy", "eager", "auto")
#: replicas where a loss would otherwise lose work: under the Bamboo launcher, of every stage with no data-parallel
#: copy on another machine (one pipeline: lazy); see ``BambooStrategy``'s ``redundancy``. The strategy, the DeepSpeed
#: door and the planner (``lightning-bamboo plan``) default to it
DEFAULT_REDUNDANCY = "auto"


@dataclass(frozen=True)
class Layout:
    """``pipelines`` data-parallel copies of a pipeline of ``stages`` stages cut at ``parts``.

    ``parts`` is DeepSpeed's form: ``stages + 1`` increasing layer boundaries from 0 to the
    number of layers; stage ``s`` owns layers ``parts[s] .. parts[s+1]-1``.
    Global rank ``r`` runs stage ``r // pipelines`` of pipeline ``r % pipelines``, as in
    DeepSpeed's ``PipeDataParallelTopology``.
    """

    stages: int
    pipelines: int
    parts: tuple[int, ...]

    def __post_init__(self) -> None:
        check_parts(self.parts, self.stages, self.parts[-1] if self.parts else 0)
        if self.pipelines < 1:
            raise BambooConfigError(f"pipelines must be at least 1 (pipelines: {self.pipelines})")

    @property
    def world_size(self) -> int:
        return self.stages * self.pipelines

    @property
    def num_layers(self) -> int:
        return self.parts[-1]

    def stage_of_rank(self, rank: int) -> int:
        return rank // self.pipelines

    def pipeline_of_rank(self, rank: int) -> int:
        return rank % self.pipelines

    def layers_of_stage(self, stage: int) -> range:
        return range(self.parts[stage], self.parts[stage + 1])

    def stage_of_layer(self, layer: int) -> int:
        for stage in range(self.stages):
            if self.parts[stage] <= layer < self.parts[stage + 1]:
                return stage
        raise BambooConfigError(f"layer {layer} is outside the model (layers: {self.num_layers})")


def replica_holder(stage: int, stages: int) -> int:
    """The stage whose node holds ``stage``'s replica (its predecessor in the ring): ``(stage - 1) % stages``."""
    return (stage - 1) % stages


def machine_of(node: str) -> str:
    """The machine (failure domain) of a node: ``NAME`` for the workers ``NAME.0 .. NAME.K-1`` that the
    launcher's ``--workers K`` starts on one machine, else the node itself (one node per machine)."""
    machine, dot, worker = node.rpartition(".")
    return machine if dot and machine and worker.isdigit() else node


def resolve_stages(world_size: int, stages: int | None) -> tuple[int, int]:
    """``(stages, pipelines)`` for ``world_size`` processes; ``stages=None`` means one pipeline."""
    stages = world_size if stages is None else stages
    if stages < 1:
        raise BambooConfigError(f"stages must be at least 1 (stages: {stages})")
    if world_size % stages:
        lower = max(s for s in range(1, stages + 1) if world_size % s == 0)
        raise BambooConfigError(
            f"the number of processes must be a multiple of stages "
            f"(devices x num_nodes: {world_size}, stages: {stages}); "
            f"use devices={stages * max(1, world_size // stages)} or stages={lower}"
        )
    return stages, world_size // stages


def even_parts(layers: int, stages: int) -> tuple[int, ...]:
    """Layer boundaries (DeepSpeed's ``parts`` form) giving each stage ``layers // stages`` layers or one more,
    the later stages taking the extra ones: stage ``s`` starts at layer ``s * layers // stages``."""
    if stages < 1 or layers < stages:
        raise BambooConfigError(
            f"cannot split {layers} layers over {stages} stages: need 1 <= stages <= layers; "
            "use fewer stages or a model with more layers"
        )
    return tuple(s * layers // stages for s in range(stages + 1))


def _example(num_layers: int, stages: int) -> str:
    """The fix an error message suggests: the even split, or fewer stages when there is none."""
    if 1 <= stages <= num_layers:
        return f"e.g. {list(even_parts(num_layers, stages))}"
    return f"e.g. {list(even_parts(num_layers, num_layers))} (at most {num_layers} stages)" if num_layers else \
        "a model needs at least one layer"


def balanced_parts(costs: Sequence[float], stages: int) -> tuple[int, ...]:
    """Layer boundaries minimising the most expensive stage (contiguous split of ``costs``, one per layer)."""
    layers = len(costs)
    bounds = even_parts(layers, stages)  # validates the sizes
    if len(set(costs)) <= 1:
        return bounds

    def cuts(limit: float) -> list[int] | None:
        """Greedy: fill each stage up to ``limit``; None when more than ``stages`` stages are needed."""
        parts, load = [0], 0.0
        for i, cost in enumerate(costs):
            if cost > limit:
                return None
            # keep enough layers for the stages still to come
            if load + cost > limit or layers - i < stages - (len(parts) - 1):
                parts.append(i)
                load = 0.0
            load += cost
        parts.append(layers)
        return parts if len(parts) - 1 <= stages else None

    lo, hi = max(costs), float(sum(costs))
    for _ in range(60):
        mid = (lo + hi) / 2
        if cuts(mid) is None:
            lo = mid
        else:
            hi = mid
    parts = cuts(hi)
    assert parts is not None
    # the greedy may use fewer stages: split the largest stages until there are exactly ``stages``
    while len(parts) - 1 < stages:
        widest = max(range(len(parts) - 1), key=lambda s: parts[s + 1] - parts[s])
        parts.insert(widest + 1, (parts[widest] + parts[widest + 1]) // 2)
    return tuple(parts)


def check_parts(parts: Sequence[int], stages: int, num_layers: int) -> None:
    """Raise unless ``parts`` cuts ``num_layers`` layers into ``stages`` non-empty stages."""
    parts = list(parts)
    if len(parts) != stages + 1:
        raise BambooConfigError(
            f"a partition lists stages + 1 layer boundaries (stages: {stages}, boundaries given: {len(parts)}: "
            f"{parts}); {_example(num_layers, stages)}"
        )
    if parts[0] != 0 or parts[-1] != num_layers:
        raise BambooConfigError(
            f"a partition starts at layer 0 and ends at the number of layers "
            f"(layers: {num_layers}, partition: {parts}); {_example(num_layers, stages)}"
        )
    for stage in range(stages):
        if parts[stage + 1] <= parts[stage]:
            raise BambooConfigError(
                f"every stage needs at least one layer, but partition {parts} leaves stage {stage} "
                f"{'empty' if parts[stage + 1] == parts[stage] else 'with a negative range'} "
                f"(layers {parts[stage]}..{parts[stage + 1] - 1}); make the boundaries strictly increasing, "
                f"{_example(num_layers, stages)}"
            )


def check_partition_option(partition: str | Sequence[int], stages: int | None) -> None:
    """Check what can be checked of ``partition`` before the model is known."""
    if isinstance(partition, str):
        if partition not in ("parameters", "uniform") and not partition.startswith("type:"):
            raise BambooConfigError(
                f"partition must be 'parameters', 'uniform', 'type:REGEX' or a list of layer boundaries "
                f"(partition: {partition!r})"
            )
        if partition.startswith("type:"):
            try:
                re.compile(partition[5:], re.IGNORECASE)
            except re.error as err:
                raise BambooConfigError(f"partition {partition!r} is not a valid regular expression: {err}") from None
        return
    parts = list(partition)
    if not all(isinstance(p, int) for p in parts):
        raise BambooConfigError(f"a partition list holds integer layer boundaries (partition: {parts})")
    if stages is not None and len(parts) != stages + 1:
        raise BambooConfigError(
            f"a partition lists stages + 1 layer boundaries (stages: {stages}, boundaries given: {len(parts)}: {parts})"
        )
    if parts and parts[0] != 0:
        raise BambooConfigError(f"a partition starts at layer 0 (partition: {parts})")
    for stage in range(len(parts) - 1):
        if parts[stage + 1] <= parts[stage]:
            raise BambooConfigError(
                f"every stage needs at least one layer, but partition {parts} leaves stage {stage} empty "
                f"(boundaries {parts[stage]} and {parts[stage + 1]}); make the boundaries strictly increasing"
            )


def partition_weights(
    partition: str | Sequence[int], param_counts: Sequence[int], layer_names: Sequence[str]
) -> list[int] | None:
    """What a named ``partition`` balances per layer: parameter counts (``"parameters"``), 1 per layer
    whose class matches (``"type:REGEX"``); None for ``"uniform"`` and explicit boundaries."""
    if not isinstance(partition, str) or partition == "uniform":
        return None
    if partition == "parameters":
        return list(param_counts)
    pattern = re.compile(partition[5:], re.IGNORECASE)  # "type:REGEX"
    return [1 if pattern.search(name) else 0 for name in layer_names]


def micro_batches(batch_size: int, micro_batch_size: int, pipelines: int) -> int:
    """Number of micro-batches a pipeline splits its ``batch_size`` samples into."""
    if batch_size % micro_batch_size:
        global_batch = batch_size * pipelines
        raise BambooConfigError(
            f"the batch must split into whole micro-batches: batch size {batch_size} per pipeline "
            f"(global batch {global_batch} = {batch_size} x {pipelines} pipelines) is not a multiple of "
            f"micro_batch_size x pipelines = {micro_batch_size} x {pipelines} = {micro_batch_size * pipelines}; "
            f"use a DataLoader batch_size that is a multiple of {micro_batch_size} (and drop_last=True "
            f"if the last batch is short)"
        )
    return batch_size // micro_batch_size


def split_micro_batches(total: int, pipelines: int) -> tuple[int, ...]:
    """``total`` micro-batches over ``pipelines`` pipelines, the first ones taking the remainder."""
    if pipelines < 1 or total < pipelines:
        raise BambooConfigError(
            f"cannot give {pipelines} pipelines at least one micro-batch each out of {total}: "
            "need 1 <= pipelines <= global micro-batches; raise the global batch or use fewer pipelines"
        )
    base, extra = divmod(total, pipelines)
    return tuple(base + (1 if p < extra else 0) for p in range(pipelines))


def pipeline_share(global_batch: int, micro_batch_size: int, pipelines: int, pipeline: int) -> tuple[int, int, int]:
    """``(first, count, total)``: pipeline ``pipeline`` trains micro-batches ``first .. first+count-1`` of a
    global batch of ``total`` micro-batches, split as the reconfiguration policy splits them
    (``split_micro_batches``: the first pipelines take one more when they do not divide evenly)."""
    if global_batch % micro_batch_size:
        raise BambooConfigError(
            f"the batch must split into whole micro-batches: the global batch of {global_batch} samples (DataLoader "
            f"batch_size x the pipelines the job started with) is not a multiple of micro_batch_size "
            f"{micro_batch_size}; use a DataLoader batch_size that is a multiple of {micro_batch_size} (and "
            f"drop_last=True if the last batch is short)"
        )
    total = global_batch // micro_batch_size
    shares = split_micro_batches(total, pipelines)
    return sum(shares[:pipeline]), shares[pipeline], total


def check_replica_memory(layers: range, params: int, available_bytes: int) -> None:
    """A replica needs fp32 weights, gradients and up to two optimizer moments in host memory."""
    need = params * 4 * 4
    if need > available_bytes:
        raise BambooConfigError(
            f"not enough host memory for the replica of layers {layers.start}..{layers.stop - 1}: it needs about "
            f"{need / 2**30:.2f} GiB (weights, gradients, optimizer state) and {available_bytes / 2**30:.2f} GiB are "
            f"free; use more stages (smaller stages), machines with more memory, or redundancy='off'"
        )
