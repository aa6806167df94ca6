"""Cost model of one training step: stage time, boundary transfers, 1F1B pipeline time, memory (no torch).

Model (every term is per micro-batch unless it says otherwise):

- Stage ``k`` runs layers ``[a, b)``: forward ``F_k``, backward ``B_k`` (sums of the layers').
- A cut after layer ``b - 1`` sends that layer's output forward and the same number of bytes of
  gradient backward, once per micro-batch. Transfers are blocking (DeepSpeed's p2p), so both
  ends are busy: ``c(b) = latency + output_bytes / bandwidth`` for each direction.
- Busy time of a stage per micro-batch: ``u_k = F_k + B_k + 2 c(in) + 2 c(out) + o`` where ``o`` is the
  engine's own cost per micro-batch and stage (``Hardware.micro_batch_overhead_seconds``).
- 1F1B step: ``(m - 1) * max_k u_k`` (steady state, paced by the slowest stage) plus the time one
  micro-batch takes through the whole pipeline and back, ``sum_k (F_k + B_k) + 2 * sum_cuts c``,
  plus the tail ``max_k (all-reduce_k + update_k)``: each stage reduces its gradients over the
  ``d`` pipelines (ring: ``2 (d - 1) / d * bytes / bandwidth + 2 (d - 1) latency``) and steps,
  plus a fixed ``Hardware.step_overhead_seconds``. Profiled times are scaled by ``compute_scale``.
  With ``p`` equal stages of time ``t`` this is the textbook ``(m + p - 1) t``.
- Memory of stage ``k`` (0-based): parameters, gradients and optimizer state of its layers, plus
  ``min(m, p - k)`` micro-batches in flight (1F1B warm-up depth), each holding the activations
  saved for backward and the stage's input and output buffers.
- The optimizer's update comes after the activations are freed and allocates ``UPDATE_TEMPORARIES`` tensors of the
  stage's largest parameter (torch's single-tensor AdamW): a stage needs the larger of the two
  (``planner.memory`` models every phase of a node; this is its worker's peak without the fixed costs and buffers).
- Activation checkpointing every ``e`` layers (``checkpoint_every``; segments of ``e`` layers from the stage's
  first, as ``engine.layer_rng.run_layers_checkpointed`` cuts them): a micro-batch in flight keeps only each
  segment's input (and the stage's input and output); one backward at a time holds a whole segment's
  activations again (the largest segment's, once); each backward first runs its segment's forward again, so
  ``B_k`` grows by ``F_k``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import pairwise
from typing import Any

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.planner.memory import UPDATE_TEMPORARIES


def _check_non_negative(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not value >= 0:  # also rejects NaN
            raise BambooConfigError(f"{owner}.{name} must be >= 0 (got {value!r}); measure it again or pass 0")


@dataclass(frozen=True)
class LayerCost:
    """One layer at one micro-batch size: times and activation sizes."""

    forward_seconds: float
    backward_seconds: float
    output_bytes: int  # the tensor passed to the next layer (also its gradient's size)
    activation_bytes: int  # tensors saved for backward while the micro-batch is in flight

    def __post_init__(self) -> None:
        _check_non_negative(
            "LayerCost",
            forward_seconds=self.forward_seconds,
            backward_seconds=self.backward_seconds,
            output_bytes=self.output_bytes,
            activation_bytes=self.activation_bytes,
        )


@dataclass(frozen=True)
class LayerProfile:
    """One layer: sizes that do not depend on the micro-batch, and a cost per micro-batch size."""

    name: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    update_seconds: float
    costs: tuple[tuple[int, LayerCost], ...]  # (micro_batch_size, cost), sizes ascending
    #: its largest trainable parameter tensor: an update's temporaries are of its size (0: not measured)
    largest_param_bytes: int = 0

    def __post_init__(self) -> None:
        _check_non_negative(
            f"LayerProfile[{self.name}]",
            param_bytes=self.param_bytes,
            grad_bytes=self.grad_bytes,
            optimizer_bytes=self.optimizer_bytes,
            update_seconds=self.update_seconds,
            largest_param_bytes=self.largest_param_bytes,
        )
        sizes = [size for size, _ in self.costs]
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise BambooConfigError(
                f"layer {self.name!r} needs costs for distinct micro-batch sizes >= 1 in ascending order "
                f"(got sizes {sizes}); profile at least one micro-batch size"
            )

    @property
    def static_bytes(self) -> int:
        """Parameters, gradients and optimizer state: held whatever the micro-batch."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def at(self, micro_batch_size: int) -> LayerCost:
        for size, cost in self.costs:
            if size == micro_batch_size:
                return cost
        raise BambooConfigError(
            f"layer {self.name!r} was not profiled at micro-batch size {micro_batch_size} "
            f"(profiled: {[s for s, _ in self.costs]}); profile that size or pick one of these"
        )


@dataclass(frozen=True)
class ModelProfile:
    """Per-layer measurements of a model, in pipeline order; JSON round-trips through to/from_dict."""

    layers: tuple[LayerProfile, ...]
    device: str = "unknown"

    def __post_init__(self) -> None:
        if not self.layers:
            raise BambooConfigError("a model profile needs at least one layer (got 0); profile a non-empty model")
        first = [s for s, _ in self.layers[0].costs]
        for layer in self.layers[1:]:
            sizes = [s for s, _ in layer.costs]
            if sizes != first:
                raise BambooConfigError(
                    f"every layer must be profiled at the same micro-batch sizes (layer {self.layers[0].name!r}: "
                    f"{first}, layer {layer.name!r}: {sizes}); profile the model in one call"
                )

    @property
    def micro_batch_sizes(self) -> tuple[int, ...]:
        return tuple(s for s, _ in self.layers[0].costs)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "layers": [
                {
                    **{k: v for k, v in asdict(layer).items() if k != "costs"},
                    "costs": [{"micro_batch_size": s, **asdict(c)} for s, c in layer.costs],
                }
                for layer in self.layers
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelProfile:
        layers = []
        for raw in data["layers"]:
            costs = tuple(
                (int(c["micro_batch_size"]), LayerCost(**{k: v for k, v in c.items() if k != "micro_batch_size"}))
                for c in raw["costs"]
            )
            layers.append(LayerProfile(**{**{k: v for k, v in raw.items() if k != "costs"}, "costs": costs}))
        return cls(layers=tuple(layers), device=str(data.get("device", "unknown")))


@dataclass(frozen=True)
class Hardware:
    """What one worker has and how workers talk: memory limit, bandwidth, latency."""

    memory_bytes: int  # usable per worker, for the model (framework overhead already taken off)
    bandwidth_bytes_per_second: float = 1.0e9  # between adjacent stages
    allreduce_bandwidth_bytes_per_second: float | None = None  # between pipelines; None: same as above
    latency_seconds: float = 5.0e-5  # per message
    micro_batch_overhead_seconds: float = 0.0  # engine bookkeeping per micro-batch on every stage
    step_overhead_seconds: float = 0.0  # per optimizer step, whatever the layout
    compute_scale: float = 1.0  # profiled times x this on the workers (e.g. 2: two workers share a core)

    def __post_init__(self) -> None:
        if not self.memory_bytes > 0:
            raise BambooConfigError(f"Hardware.memory_bytes must be > 0 (got {self.memory_bytes!r})")
        if not self.bandwidth_bytes_per_second > 0:
            raise BambooConfigError(
                f"Hardware.bandwidth_bytes_per_second must be > 0 (got {self.bandwidth_bytes_per_second!r})"
            )
        if self.allreduce_bandwidth_bytes_per_second is not None and not self.allreduce_bandwidth_bytes_per_second > 0:
            raise BambooConfigError(
                "Hardware.allreduce_bandwidth_bytes_per_second must be > 0 or None "
                f"(got {self.allreduce_bandwidth_bytes_per_second!r})"
            )
        _check_non_negative(
            "Hardware",
            latency_seconds=self.latency_seconds,
            micro_batch_overhead_seconds=self.micro_batch_overhead_seconds,
            step_overhead_seconds=self.step_overhead_seconds,
        )
        if not self.compute_scale > 0:
            raise BambooConfigError(f"Hardware.compute_scale must be > 0 (got {self.compute_scale!r}); 1 = as profiled")

    @property
    def allreduce_bandwidth(self) -> float:
        return self.allreduce_bandwidth_bytes_per_second or self.bandwidth_bytes_per_second


def transfer_seconds(num_bytes: float, hw: Hardware) -> float:
    """One message between adjacent stages."""
    return hw.latency_seconds + num_bytes / hw.bandwidth_bytes_per_second


def allreduce_seconds(num_bytes: float, pipelines: int, hw: Hardware) -> float:
    """Ring all-reduce of ``num_bytes`` over ``pipelines`` replicas (0 without data parallelism)."""
    if pipelines <= 1 or num_bytes == 0:
        return 0.0
    d = pipelines
    return 2 * (d - 1) / d * num_bytes / hw.allreduce_bandwidth + 2 * (d - 1) * hw.latency_seconds


def in_flight(stage: int, stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once under 1F1B."""
    return min(micro_batches, stages - stage)


@dataclass(frozen=True)
class StageEstimate:
    """Predicted cost of one stage of a layout."""

    first_layer: int
    end_layer: int  # exclusive
    forward_seconds: float
    backward_seconds: float
    comm_seconds: float  # per micro-batch, both boundaries, both directions
    busy_seconds: float  # forward + backward + comm per micro-batch
    tail_seconds: float  # all-reduce + optimizer update, once per step
    memory_bytes: int
    in_flight: int


@dataclass(frozen=True)
class StepEstimate:
    """Predicted step of one layout: total time, its terms and every stage."""

    step_seconds: float
    steady_seconds: float  # (m - 1) * max busy
    latency_seconds: float  # one micro-batch through and back
    tail_seconds: float  # max (all-reduce + update)
    stages: tuple[StageEstimate, ...]

    @property
    def max_memory_bytes(self) -> int:
        return max(s.memory_bytes for s in self.stages)


def check_partition(partition: Sequence[int], num_layers: int) -> None:
    """DeepSpeed ``parts`` form: stages + 1 strictly increasing boundaries from 0 to num_layers."""
    parts = list(partition)
    if (
        len(parts) < 2
        or parts[0] != 0
        or parts[-1] != num_layers
        or any(b <= a for a, b in pairwise(parts))
    ):
        raise BambooConfigError(
            f"a partition lists stages + 1 strictly increasing layer boundaries from 0 to {num_layers} "
            f"(got {parts}); e.g. {[0, num_layers // 2, num_layers] if num_layers > 1 else [0, 1]}"
        )


def checkpointed_bytes(costs: Sequence[LayerCost], first: int, end: int, every: int) -> tuple[int, int]:
    """A stage of layers ``[first, end)`` checkpointed every ``every`` layers: ``(kept, transient)``, the bytes a
    micro-batch in flight keeps besides the stage's input and output (the inputs of the segments after the
    first), and the largest segment's saved activations, which its backward's recompute holds again."""
    kept = sum(costs[s - 1].output_bytes for s in range(first + every, end, every))
    transient = max(sum(c.activation_bytes for c in costs[s:min(s + every, end)]) for s in range(first, end, every))
    return kept, transient


def check_checkpoint_every(checkpoint_every: int) -> None:
    if checkpoint_every < 0:
        raise BambooConfigError(f"activation checkpointing is a number of layers per segment, >= 0 (0: off; got "
                                f"{checkpoint_every})")


def estimate_step(
    profile: ModelProfile,
    hw: Hardware,
    partition: Sequence[int],
    micro_batch_size: int,
    micro_batches: int,
    pipelines: int = 1,
    checkpoint_every: int = 0,
) -> StepEstimate:
    """The reference evaluation of one layout (the solver must agree with it). ``checkpoint_every``: activation
    checkpointing's layers per segment (0: off); a stage's ``backward_seconds`` then include the recompute."""
    check_partition(partition, profile.num_layers)
    check_checkpoint_every(checkpoint_every)
    if micro_batches < 1 or pipelines < 1:
        raise BambooConfigError(
            f"micro_batches and pipelines must be >= 1 (got {micro_batches}, {pipelines})"
        )
    costs = [layer.at(micro_batch_size) for layer in profile.layers]
    p = len(partition) - 1
    L = profile.num_layers

    def cut(boundary: int) -> float:  # one message across the cut before layer `boundary`
        return transfer_seconds(costs[boundary - 1].output_bytes, hw) if 0 < boundary < L else 0.0

    stages = []
    for k, (a, b) in enumerate(pairwise(partition)):
        fwd = hw.compute_scale * sum(c.forward_seconds for c in costs[a:b])
        bwd = hw.compute_scale * sum(c.backward_seconds for c in costs[a:b])
        comm = 2 * cut(a) + 2 * cut(b)
        grad = sum(layer.grad_bytes for layer in profile.layers[a:b])
        update = hw.compute_scale * sum(layer.update_seconds for layer in profile.layers[a:b])
        tail = allreduce_seconds(grad, pipelines, hw) + update
        n = in_flight(k, p, micro_batches)
        in_bytes = costs[a - 1].output_bytes if a > 0 else 0
        out_bytes = costs[b - 1].output_bytes if b < L else 0
        static = sum(layer.static_bytes for layer in profile.layers[a:b])
        update = UPDATE_TEMPORARIES * max(layer.largest_param_bytes for layer in profile.layers[a:b])
        if checkpoint_every:
            kept, transient = checkpointed_bytes(costs, a, b, checkpoint_every)
            memory = static + max(update, transient + n * (kept + in_bytes + out_bytes))
            bwd += fwd  # each segment's forward again, in its backward
        else:
            memory = static + max(update, n * (sum(c.activation_bytes for c in costs[a:b]) + in_bytes + out_bytes))
        busy = fwd + bwd + comm + hw.micro_batch_overhead_seconds
        stages.append(StageEstimate(a, b, fwd, bwd, comm, busy, tail, memory, n))
    steady = (micro_batches - 1) * max(s.busy_seconds for s in stages)
    latency = (
        sum(s.forward_seconds + s.backward_seconds for s in stages)
        + 2 * sum(cut(b) for b in partition[1:-1])
        + p * hw.micro_batch_overhead_seconds
    )
    tail = max(s.tail_seconds for s in stages) + hw.step_overhead_seconds
    return StepEstimate(steady + latency + tail, steady, latency, tail, tuple(stages))


#: ``redundancy`` values the planner prices (BambooConfig's)
REDUNDANCY_MODES = ("off", "lazy", "eager")


@dataclass(frozen=True)
class RedundancyCost:
    """What Bamboo's redundancy adds to one step of a layout (``redundancy_cost``)."""

    work_seconds: tuple[float, ...]  # per stage: the replica's update (+ eager's redundant forwards)
    idle_seconds: tuple[float, ...]  # per stage: the step's time that stage computes nothing (its bubbles)
    ship_seconds: tuple[float, ...]  # per stage: its gradients sent to the replica holder (its predecessor)
    link_idle_seconds: tuple[float, ...]  # per stage: the step's time its link to the predecessor carries nothing
    forwards: tuple[int, ...]  # per stage, eager: the micro-batches whose successor forward fits its bubbles
    step_seconds: float  # added to the step: the most any stage's work or ship overflows its idle time
    #: per stage, eager: what its kept forwards hold until the step commits (host memory: pinned on a GPU, the
    #: same memory on CPU workers), each the successor's saved activations, its input and its output
    kept_bytes: tuple[int, ...] = ()


def redundancy_cost(
    profile: ModelProfile,
    hw: Hardware,
    est: StepEstimate,
    micro_batch_size: int,
    micro_batches: int,
    redundancy: str,
) -> RedundancyCost:
    """The time Bamboo's redundancy adds to the step ``est`` of a pipeline of ``p >= 2`` stages.

    Stage ``k`` holds the replica of its successor ``s = (k + 1) % p`` (the last stage holds stage 0's). Every
    step (``lazy`` and ``eager``) it applies the replica's optimizer update, ``update_s``, and sends its own
    gradients to its predecessor, who holds its replica: ``ship_k = latency + grad_bytes_k / bandwidth``. The
    engine runs the update where the stage waits (its bubbles) and sends the gradients without waiting, over
    the link to the predecessor while it carries no activations:

    - compute: ``idle_k = step - m busy_k - tail_k`` (``(p - 1)(F + B)`` for equal stages);
    - link: ``link_idle_k = step - 2 m c(cut before k)`` (stage 0's predecessor is the last stage: no
      activations between them);
    - the step grows by ``max_k max(update_s - idle_k, ship_k - link_idle_k, 0)``.

    ``eager`` places the successor's forwards in what is left of the bubbles and nowhere else (the schedule's
    ``rf_budget=None``): ``forwards_k = min(m, floor((idle_k - update_s) / F_s))`` of them; the others are
    recomputed after a failure. Its step is priced as ``lazy``'s; what it buys is a shorter failover. Each kept
    forward holds the successor's saved activations, its input and its output until the step commits
    (``kept_bytes``).

    A lower bound where the bubbles are not where the work is due (a replica update waits for the gradients
    it applies), an upper one where the stages' transfers overlap their compute. ``off``, or one stage: nothing.
    """
    if redundancy not in REDUNDANCY_MODES:
        raise BambooConfigError(f"redundancy must be one of {list(REDUNDANCY_MODES)} (got {redundancy!r})")
    p = len(est.stages)
    if redundancy == "off" or p < 2:
        zeros = (0.0,) * p
        return RedundancyCost(zeros, zeros, zeros, zeros, (0,) * p, 0.0, (0,) * p)
    costs = [layer.at(micro_batch_size) for layer in profile.layers]
    work, idle, ship, link_idle, forwards, kept = [], [], [], [], [], []
    for k, stage in enumerate(est.stages):
        successor = est.stages[(k + 1) % p]
        layers = profile.layers[successor.first_layer:successor.end_layer]
        update = hw.compute_scale * sum(layer.update_seconds for layer in layers)
        idle.append(max(0.0, est.step_seconds - micro_batches * stage.busy_seconds - stage.tail_seconds))
        count = 0
        if redundancy == "eager":
            left = max(0.0, idle[-1] - update)
            count = micro_batches if successor.forward_seconds <= 0 else min(
                micro_batches, int(left / successor.forward_seconds * (1 + 1e-12)))
        forwards.append(count)
        first, end = successor.first_layer, successor.end_layer
        kept.append(count * (sum(c.activation_bytes for c in costs[first:end]) + costs[end - 1].output_bytes
                             + (costs[first - 1].output_bytes if first > 0 else 0)))
        work.append(update + count * successor.forward_seconds)
        grads = sum(layer.grad_bytes for layer in profile.layers[stage.first_layer:stage.end_layer])
        ship.append(transfer_seconds(grads, hw) if grads else 0.0)
        a = stage.first_layer
        activations = 2 * micro_batches * transfer_seconds(costs[a - 1].output_bytes, hw) if a > 0 else 0.0
        link_idle.append(max(0.0, est.step_seconds - activations))
    added = max(max(w - i, s - li, 0.0) for w, i, s, li in zip(work, idle, ship, link_idle, strict=True))
    return RedundancyCost(tuple(work), tuple(idle), tuple(ship), tuple(link_idle), tuple(forwards), added,
                          tuple(kept))
