"""A node's memory before the job starts, by owner: its stage, its replica, activations, buffers, communication process,
baseline (no torch).

What a worker holds, in the moments of a step that need the most (its *phases*; the peak is the largest):

- **forward-backward** (1F1B): the stage's weights, optimizer state and gradients; the replica's weights and optimizer
  state; ``min(m, p - k)`` micro-batches in flight on stage ``k`` of ``p``, each keeping the activations its layers
  saved for backward, the stage's input and output (the last stage also the loss's log-softmax of its output); one
  backward's working set (the gradients into and out of a layer: twice the stage's largest output, twice more for the
  loss); from the second micro-batch on, the new gradient of the largest parameter, made whole before autograd adds it
  to the one so far (a tied embedding's: its whole table, for every micro-batch's backward); eager's kept redundant
  forwards; the buffers below.
- **update**: the activations are freed and given back (``engine.heap``); the optimizer allocates its temporaries
  (torch's single-tensor AdamW: two tensors of the largest parameter's size, ``optimizer_temporaries``).
- **replica update**: the same for the replica's largest parameter, at the program's ``U``: before the first gradient
  (the earlier half of the stages: the warm-up's micro-batches in flight) or at the end of the schedule.
- **gradient reduction** (tied layers, several pipelines): the received copies and the flat bucket.

Buffers: the gradient exchange's. Through shared memory (its replica's holder on the same host) each half of the buffer
holds one step's gradients, 4 bytes per parameter, and stays resident once written (``engine.exchange``, rule 4). A
node maps the two halves its own gradients leave in and the two its replica's arrive in. Over the process group
(another host) the owner keeps a send buffer and the transfer buffers its chunks are copied into (4 + 4 per own
parameter), the holder two receive buffers and the transfer buffers (8 + 4 per replica parameter). The transfer buffers of the communication process are shared memory
mapped by the worker too: the pipeline's messages (one of each size sent and received), a tied gradient's pieces
(``TIE_ROUNDS`` rounds of ``TIE_PIECE_BYTES`` each way), several pipelines' all-reduce (4 per own parameter).

Weights, gradients and masters are fp32 whatever the precision (``engine.precision``: autocast over fp32 masters).
The baseline is the interpreter with torch, DeepSpeed and Lightning imported, and the framework's objects; the
communication processes (``engine.comm_process``: a zygote and a child per generation) add their own interpreter with
torch, shared between the two.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from lightning_bamboo.errors import BambooConfigError

MiB = 2**20
GiB = 2**30
#: what holds memory on a node, in the order ``NodeMemory.format`` prints them (``lightning-bamboo plan``'s contract)
OWNERS = ("stage", "replica", "activations", "buffers", "communication process", "baseline")
EXCHANGES = ("shared", "network")
#: the engine's constants these terms follow (``tests/test_memory_model.py`` checks they agree): a transfer buffer's
#: smallest size and its classes per doubling (``comm_cuda.size_class``), a tied gradient's piece, rounds in flight
SLAB_MIN_BYTES, SLAB_CLASSES = 4096, 8
TIE_PIECE_BYTES, TIE_ROUNDS = 4 << 22, 3
#: measured on this project's machine (``benchmarks/memory.py``): a worker's RSS with torch 2.13, DeepSpeed 0.19.8 and
#: Lightning 2.6.6 imported, before it builds anything; the communication processes' anonymous memory (torch's import
#: heap, which the zygote and its child share), counted once
BASELINE_BYTES = 410 * MiB
#: tensors of the largest parameter's size that an update allocates: torch's single-tensor AdamW (the CPU's default)
#: takes the square root of the second moment and divides it (a fused AdamW: none)
UPDATE_TEMPORARIES = 2
#: what a worker's RSS holds beyond the baseline and its tensors once it trains (the engine, the process groups, the
#: allocator's free heap), measured there too
FRAMEWORK_BYTES = 70 * MiB
COMMUNICATION_BYTES = 150 * MiB


def fixed_bytes(settings: MemorySettings | None = None) -> int:
    """What a worker holds besides its model's layers: the baseline, the framework's objects and its communication
    processes (the planner takes them off a worker's memory before it fits layers into the rest)."""
    settings = settings or MemorySettings()
    return settings.baseline_bytes + settings.framework_bytes + settings.communication_bytes


def slab_bytes(nbytes: int) -> int:
    """The transfer buffer a message of ``nbytes`` is lent (``engine.comm_cuda.size_class``)."""
    if nbytes <= 0:
        return 0
    if nbytes <= SLAB_MIN_BYTES:
        return SLAB_MIN_BYTES
    step = (1 << ((nbytes - 1).bit_length() - 1)) // SLAB_CLASSES
    return -(-nbytes // step) * step


@dataclass(frozen=True)
class LayerMemory:
    """One pipeline layer: its parameters, and what one micro-batch of it holds."""

    params: int  # trainable parameters
    largest: int = 0  # elements of its largest parameter tensor (an update's temporaries are of its size)
    activation_bytes: int = 0  # per micro-batch: the tensors saved for backward
    output_bytes: int = 0  # per micro-batch: its output (what crosses a cut after it)
    tie: str = ""  # a ``TiedLayerSpec`` key: copies of it on several stages exchange their gradients

    def __post_init__(self) -> None:
        for name in ("params", "largest", "activation_bytes", "output_bytes"):
            if getattr(self, name) < 0:
                raise BambooConfigError(f"LayerMemory.{name} must be >= 0 (got {getattr(self, name)})")
        if self.largest > self.params:
            raise BambooConfigError(f"a layer's largest parameter ({self.largest} elements) cannot exceed its "
                                    f"parameters ({self.params}); pass the largest tensor's numel")


@dataclass(frozen=True)
class MemorySettings:
    """What the model needs beyond the layers: the optimizer, the exchange's transport, the fixed costs."""

    optimizer_bytes_per_param: int = 8  # AdamW/Adam: two fp32 moments; SGD with momentum: 4; none: 0
    optimizer_temporaries: int = UPDATE_TEMPORARIES  # of the largest parameter; a fused AdamW: 0
    exchange: str = "shared"  # the replica's holder on the same host ("shared") or another ("network")
    baseline_bytes: int = BASELINE_BYTES
    framework_bytes: int = FRAMEWORK_BYTES
    communication_bytes: int = COMMUNICATION_BYTES

    def __post_init__(self) -> None:
        if self.exchange not in EXCHANGES:
            raise BambooConfigError(f"MemorySettings.exchange is one of {EXCHANGES} (got {self.exchange!r}): 'shared' "
                                    "when a node's replica holder runs on its host, 'network' when on another")
        for name in ("optimizer_bytes_per_param", "optimizer_temporaries", "baseline_bytes", "framework_bytes",
                     "communication_bytes"):
            if getattr(self, name) < 0:
                raise BambooConfigError(f"MemorySettings.{name} must be >= 0 (got {getattr(self, name)})")


@dataclass(frozen=True)
class Item:
    owner: str
    what: str
    bytes: int


@dataclass(frozen=True)
class Phase:
    """One moment of a step and what the worker holds then."""

    name: str
    items: tuple[Item, ...]

    @property
    def total(self) -> int:
        return sum(item.bytes for item in self.items)

    def by_owner(self) -> dict[str, int]:
        return {owner: sum(i.bytes for i in self.items if i.owner == owner) for owner in OWNERS}


@dataclass(frozen=True)
class NodeMemory:
    """The predicted peak of one node: its worker's phases (``peak``: the largest) and its communication process."""

    stage: int
    replica_stage: int | None
    phases: tuple[Phase, ...]
    communication_bytes: int

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda phase: phase.total)

    @property
    def peak_bytes(self) -> int:
        """The worker's peak RSS (its communication processes not included: ``total_bytes``)."""
        return self.peak.total

    @property
    def total_bytes(self) -> int:
        """What the node needs of its machine: the worker's peak and its communication processes."""
        return self.peak_bytes + self.communication_bytes

    def by_owner(self) -> dict[str, int]:
        """The peak by owner, the communication process included (``OWNERS``' order)."""
        return {**self.peak.by_owner(), "communication process": self.communication_bytes}

    def format(self) -> str:
        """One line: the peak by owner, in GiB."""
        owners = ", ".join(f"{owner} {value / GiB:.2f}" for owner, value in self.by_owner().items())
        replica = f" + replica of {self.replica_stage}" if self.replica_stage is not None else ""
        return (f"stage {self.stage}{replica}: {self.total_bytes / GiB:.2f} GiB at its {self.peak.name} ({owners}; "
                f"worker {self.peak_bytes / GiB:.2f} GiB)")


def _ranges(parts: Sequence[int], num_layers: int) -> list[range]:
    parts = list(parts)
    if len(parts) < 2 or parts[0] != 0 or parts[-1] != num_layers or any(b <= a for a, b in pairwise(parts)):
        raise BambooConfigError(f"a partition lists stages + 1 increasing layer boundaries from 0 to {num_layers} "
                                f"(got {parts})")
    return [range(a, b) for a, b in pairwise(parts)]


def stage_activations(layers: Sequence[LayerMemory], stage: range, last: bool, checkpoint_every: int = 0
                      ) -> tuple[int, int]:
    """``(per micro-batch in flight, once)``: what each micro-batch in flight on ``stage`` holds (its layers' saved
    activations, or with checkpointing every ``checkpoint_every`` layers only the segments' inputs; the stage's input
    and output; on the last stage the loss's log-softmax of the output), and what one backward holds besides (its
    working set: twice the stage's largest output, twice more on the last stage for the loss's gradients; with
    checkpointing the largest segment's activations, recomputed)."""
    first = stage.start
    inp = layers[first - 1].output_bytes if first > 0 else 0
    out = layers[stage.stop - 1].output_bytes
    largest_output = max(layers[i].output_bytes for i in stage)
    once = 2 * largest_output + (2 * out if last else 0)
    if checkpoint_every:
        segments = [range(s, min(s + checkpoint_every, stage.stop)) for s in range(first, stage.stop, checkpoint_every)]
        kept = sum(layers[s.start - 1].output_bytes for s in segments[1:])
        once += max(sum(layers[i].activation_bytes for i in s) for s in segments)
    else:
        kept = sum(layers[i].activation_bytes for i in stage)
    return kept + inp + out + (out if last else 0), once


def _tie_buffers(layers: Sequence[LayerMemory], stage: range, ranges: Sequence[range]) -> tuple[int, int]:
    """A stage's tied copies whose other copies are on other stages: ``(transfer buffers, received copy)``."""
    slabs = received = 0
    for key in sorted({layers[i].tie for i in stage if layers[i].tie}):
        copies = [i for i, layer in enumerate(layers) if layer.tie == key]
        remote = [i for i in copies if i not in stage]
        if not remote:
            continue
        nbytes = 4 * layers[copies[0]].params
        pieces = -(-nbytes // TIE_PIECE_BYTES)
        peers = len({next(k for k, r in enumerate(ranges) if i in r) for i in remote})
        slabs += 2 * peers * min(pieces, TIE_ROUNDS) * slab_bytes(min(nbytes, TIE_PIECE_BYTES))
        received += nbytes * len(remote)
    return slabs, received


def updates_replica_at_end(stage: int, stages: int, eager: bool) -> bool:
    """Where the holder on ``stage`` applies its replica's update (``schedule.build.updates_replica_at_end``): at the
    end of its schedule (the later half of the stages), else before its first gradient; under eager the later half
    updates in the wait for its first activation, before any micro-batch is in flight."""
    return 2 * stage > stages - 1 and not eager


def node_memory(layers: Sequence[LayerMemory], parts: Sequence[int], stage: int, micro_batches: int, *,
                redundancy: str = "off", pipelines: int = 1, checkpoint_every: int = 0, eager_forwards: int | None = None,
                settings: MemorySettings | None = None) -> NodeMemory:
    """The predicted memory of the node that runs stage ``stage`` of the pipeline cut at ``parts`` (DeepSpeed's form).

    ``redundancy`` "lazy" or "eager": it holds the replica of its successor's stage (the last stage holds stage 0's).
    ``eager_forwards``: eager's redundant forwards kept per step (default: every micro-batch's). ``pipelines``: the
    data-parallel degree (more than one all-reduces the gradients). ``checkpoint_every``: activation checkpointing's
    layers per segment (0: off).

    Through shared memory both halves of an exchange's buffer count in the RSS of both processes that map them from
    the second step on (``engine.exchange``, rule 4): the owner's gradients are views of a half from its last
    backward on (the last stage copies them there at its ship), the holder's replica reads them in its update.
    """
    settings = settings or MemorySettings()
    ranges = _ranges(parts, len(layers))
    p, m = len(ranges), micro_batches
    if not 0 <= stage < p or m < 1 or pipelines < 1 or checkpoint_every < 0:
        raise BambooConfigError(f"node_memory needs 0 <= stage < {p} stages, micro_batches >= 1, pipelines >= 1 and "
                                f"checkpoint_every >= 0 (got stage {stage}, {m}, {pipelines}, {checkpoint_every})")
    if redundancy not in ("off", "lazy", "eager"):
        raise BambooConfigError(f"redundancy is 'off', 'lazy' or 'eager' (got {redundancy!r})")
    mine = ranges[stage]
    redundant = redundancy != "off" and p > 1
    eager = redundancy == "eager"
    successor = (stage + 1) % p
    held = ranges[successor] if redundant else range(0)
    own = sum(layers[i].params for i in mine)
    rep = sum(layers[i].params for i in held)
    obp, temps = settings.optimizer_bytes_per_param, settings.optimizer_temporaries
    last = stage == p - 1
    per_micro_batch, once = stage_activations(layers, mine, last, checkpoint_every)
    in_flight = min(m, p - stage)
    inp = layers[mine.start - 1].output_bytes if mine.start > 0 else 0
    out = layers[mine.stop - 1].output_bytes

    base = [Item("baseline", "interpreter, imports", settings.baseline_bytes),
            Item("baseline", "framework: engine, groups, allocator", settings.framework_bytes),
            Item("stage", "weights", 4 * own), Item("stage", "optimizer state", obp * own)]
    if rep:
        base += [Item("replica", "weights", 4 * rep), Item("replica", "optimizer state", obp * rep)]
    base.append(Item("buffers", "pipeline messages' transfer buffers",
                     2 * (slab_bytes(inp) + (slab_bytes(out) if not last else 0))))
    if last:  # DeepSpeed keeps the last micro-batch's output and the loss's input until the next step
        base.append(Item("activations", "the last micro-batch's output, kept", 2 * out))
    tie_slabs, tie_received = _tie_buffers(layers, mine, ranges)
    if tie_slabs:
        base.append(Item("buffers", "tied gradient's transfer buffers", tie_slabs))
    if pipelines > 1:
        base.append(Item("buffers", "all-reduce's transfer buffer", slab_bytes(4 * own)))
    grads = [Item("stage", "gradients", 4 * own)]
    shared = redundant and settings.exchange == "shared"
    if redundant and not shared:
        base += [Item("buffers", "replica's receive buffers", 8 * rep),
                 Item("buffers", "replica's chunks' transfer buffers", 4 * rep),
                 Item("buffers", "own gradients' send buffer", 4 * own),
                 Item("buffers", "own chunks' transfer buffers", 4 * own)]
    if shared:  # both halves of both exchanges stay resident once written (``engine.exchange``, rule 4)
        base += [Item("buffers", "own gradients' shared halves", 8 * own),
                 Item("buffers", "replica's gradients' shared halves", 8 * rep)]
    # the own gradients at the step's end: views of their half (counted above) but on the last stage
    written = grads if last or not shared else []

    largest = max((layers[i].largest for i in mine), default=0)
    flight = [Item("activations", f"{in_flight} micro-batch(es) in flight", in_flight * per_micro_batch),
              Item("activations", "one backward's working set", once)]
    if m > 1:  # autograd accumulates: the next micro-batch's gradient of a parameter is whole before it is added
        flight.append(Item("stage", "a gradient being accumulated (the largest parameter's)", 4 * largest))
    if eager and redundant:
        forwards = m if eager_forwards is None else eager_forwards
        successor_act, _ = stage_activations(layers, held, successor == p - 1)
        flight.append(Item("activations", "eager's kept redundant forwards", forwards * successor_act))
    phases = [Phase("forward-backward", tuple(base + grads + flight))]
    if shared and not last:  # before the last backward the gradients so far are copied into their half
        kept = [item for item in flight if item.what.startswith("eager")]
        phases.append(Phase("write-ahead", tuple(base + grads + kept + [
            Item("activations", "the last micro-batch in flight", per_micro_batch), flight[1]])))
    reduce = [Item("stage", "tied copy received", tie_received)] if tie_received else []
    if pipelines > 1:
        reduce.append(Item("stage", "all-reduce's flat bucket", 4 * own))
    if reduce:
        phases.append(Phase("gradient reduction", tuple(base + written + reduce)))
    if rep:
        rep_temps = [Item("replica", "update's temporaries",
                          temps * 4 * max((layers[i].largest for i in held), default=0))]
        if updates_replica_at_end(stage, p, eager):  # after the gradient reduction, before the ship
            phases.append(Phase("replica update", tuple(base + written + rep_temps)))
        else:  # before the next step's first gradient (under eager the later half: before any micro-batch)
            warm = 0 if eager and 2 * stage > p - 1 else in_flight * per_micro_batch
            waiting = [Item("activations", f"{in_flight} warm-up micro-batch(es)", warm)] if warm else []
            phases.append(Phase("replica update", tuple(base + waiting + rep_temps)))
    if last and shared:  # the ship copies the own gradients into their half
        phases.append(Phase("ship", tuple(base + grads)))
    update = [Item("stage", "update's temporaries", temps * 4 * largest)]
    phases.append(Phase("update", tuple(base + written + update)))
    return NodeMemory(stage, successor if redundant else None, tuple(phases), settings.communication_bytes)


def moving_memory(layers: Sequence[LayerMemory], parts: Sequence[int], stage: int, moved: Sequence[int], *,
                  redundancy: str = "lazy", settings: MemorySettings | None = None) -> Phase:
    """A failover or a move, on the node that ran ``stage`` of ``parts`` and sends or receives the layers ``moved``
    (the replica ring's, a move's): its old stage and replica are still held while a layer travels, one per message,
    serialised with its optimizer state (``engine.transfer.exchange_objects``) and copied into a transfer buffer (the
    larger layer counts twice)."""
    settings = settings or MemorySettings()
    ranges = _ranges(parts, len(layers))
    p = len(ranges)
    mine = ranges[stage]
    held = ranges[(stage + 1) % p] if redundancy != "off" and p > 1 else range(0)
    per_param = 4 + settings.optimizer_bytes_per_param
    largest = max((per_param * layers[i].params for i in moved), default=0)
    tie_slabs, _ = _tie_buffers(layers, mine, ranges)
    last = stage == p - 1
    return Phase("failover", (
        Item("baseline", "interpreter, imports", settings.baseline_bytes),
        Item("baseline", "framework: engine, groups, allocator", settings.framework_bytes),
        Item("stage", "weights and optimizer state, before it", per_param * sum(layers[i].params for i in mine)),
        Item("replica", "weights and optimizer state, before it", per_param * sum(layers[i].params for i in held)),
        Item("buffers", "tied gradient's transfer buffers", tie_slabs),
        Item("activations", "the last micro-batch's output, kept", 2 * layers[mine.stop - 1].output_bytes if last else 0),
        Item("buffers", "a layer in transit: serialised, and its transfer buffer", 2 * largest)))


def pipeline_memory(layers: Sequence[LayerMemory], parts: Sequence[int], micro_batches: int, **options: object
                    ) -> list[NodeMemory]:
    """``node_memory`` of every stage of the pipeline cut at ``parts``."""
    return [node_memory(layers, parts, k, micro_batches, **options) for k in range(len(parts) - 1)]  # type: ignore[arg-type]


@dataclass(frozen=True)
class MemoryTable:
    """Every node's predicted memory, printable as ``lightning-bamboo plan`` shows it."""

    nodes: tuple[NodeMemory, ...] = field(default=())

    def format(self) -> str:
        return "\n".join(f"  node {k}: {node.format()}" for k, node in enumerate(self.nodes))
