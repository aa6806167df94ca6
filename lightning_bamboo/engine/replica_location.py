"""Where a replica lives on a GPU, and the copies between the GPU and host memory on a side stream.

A replica holds its successor's weights, gradients and optimizer state: about four times the
stage's fp32 weights with AdamW (``REPLICA_BYTES_PER_PARAMETER``). On a GPU that is memory the
own stage's activations may need. ``replica_device`` decides by a budget: the replica goes to the
GPU when it fits (``placement="auto"``: in the budget, by default what is free once the stage is
built less a quarter of the GPU for activations), else to pinned host memory, where its update
runs on the CPU and its redundant forwards run on a copy of its weights on the GPU, refreshed
after each update (``Replica.compute_module``). ``"device"`` and ``"host"`` force one or the other.
On CPU the replica is in host memory like everything else.

The copies between a GPU and pinned host memory (the replica's weights to its GPU copy, a stage's
gradients to the host before they travel) run on a side stream per GPU: they wait for the work that
produced their sources, and the compute stream waits only where it uses what they wrote (or the
host thread waits for a copy to the host before it hands the buffer on), instead of a device-wide
synchronization.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from lightning_bamboo.errors import BambooConfigError, OutOfDeviceMemory

#: where a replica may live (``BambooStrategy(replica_placement=...)``)
PLACEMENTS = ("auto", "device", "host")
#: fp32 weights, gradients and two optimizer moments (AdamW) per parameter
REPLICA_BYTES_PER_PARAMETER = 16
#: under ``"auto"`` without a budget: the share of the GPU's memory kept free for activations
ACTIVATION_RESERVE = 0.25

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def check_placement(placement: str, budget: int | None) -> None:
    """The placement options, checked when the strategy is made (not at the first step)."""
    if placement not in PLACEMENTS:
        raise BambooConfigError(f"replica_placement must be one of {PLACEMENTS} (replica_placement: {placement!r})")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise BambooConfigError(
            f"replica_memory_budget must be a number of bytes >= 0 or None (replica_memory_budget: {budget!r}); "
            "e.g. 8 * 2**30 for 8 GiB of the GPU's memory")
    if budget is not None and placement != "auto":
        raise BambooConfigError(
            f"replica_memory_budget applies to replica_placement='auto' (replica_placement: {placement!r}, "
            f"replica_memory_budget: {budget}); leave one of them at its default")


def replica_bytes(parameters: int) -> int:
    """The memory a replica of ``parameters`` parameters takes (weights, gradients, optimizer state)."""
    return parameters * REPLICA_BYTES_PER_PARAMETER


def replica_device(device: torch.device, parameters: int, placement: str = "auto", budget: int | None = None,
                   memory: tuple[int, int] | None = None) -> torch.device:
    """Where a replica of ``parameters`` parameters of a stage on ``device`` lives: ``device``, or the host.

    ``memory``: the GPU's (free, total) bytes (default: asked of the GPU now, once the stage is built).
    """
    if device.type != "cuda" or placement == "device":
        return device
    if placement == "host":
        return torch.device("cpu")
    free, total = memory if memory is not None else torch.cuda.mem_get_info(device)
    allowed = min(free, budget) if budget is not None else free - int(total * ACTIVATION_RESERVE)
    return device if replica_bytes(parameters) <= allowed else torch.device("cpu")


#: what to change when a stage's layers, its replica or their update do not fit on the GPU (the first where the
#: replica is on the GPU)
HOST_FIX = 'replica_placement="host" (the replica in pinned host memory, its update a layer at a time on the GPU)'
FIXES = ("a deeper pipeline (more stages: fewer layers per GPU), activation_checkpointing, or a smaller "
         "micro_batch_size")


@contextlib.contextmanager
def must_fit(what: str, device: torch.device, replica_on_gpu: bool = True) -> Iterator[None]:
    """Run the block; a CUDA out-of-memory error in it becomes ``OutOfDeviceMemory`` naming ``what`` did not fit
    on ``device``, the GPU's memory then, and the fixes (``replica_placement="host"`` first where
    ``replica_on_gpu``): a node that runs out of memory in a replica's update or a failover ends with that message,
    not torch's allocator message alone."""
    try:
        yield
    except torch.OutOfMemoryError as err:
        fixes = f"{HOST_FIX}, {FIXES}" if replica_on_gpu else FIXES
        raise OutOfDeviceMemory(
            f"{what} did not fit in the memory of {device}{_memory_now(device)}. Fix: {fixes}. "
            f"(torch: {str(err).splitlines()[0] if str(err) else type(err).__name__})") from err


def _memory_now(device: torch.device) -> str:
    if device.type != "cuda" or not torch.cuda.is_available():
        return ""
    try:
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
    except RuntimeError:  # (the device in a state that cannot say)
        return ""
    return f" ({allocated / 2**30:.2f} GiB allocated by this process, {free / 2**30:.2f} GiB free of {total / 2**30:.2f})"


#: after a step: the share of the GPU that must stay unused at the step's peak for a replica to be (or stay) on it
STEP_MARGIN = 0.05


def replica_stays_on_gpu(on_gpu: bool, parameters: int, free: int, total: int, reserved: int, peak: int) -> bool:
    """Where a replica of ``parameters`` parameters lives once a step has run (``"auto"`` without a budget), from the
    facts of that step: the GPU's ``free`` and ``total`` bytes now, what this process's allocator ``reserved`` and the
    ``peak`` it allocated during the step (its stage, activations, buffers, and the replica or its forwards' copy).

    What the step's peak left of the GPU is ``free + reserved - peak``. A replica on the GPU stays while that is at
    least ``STEP_MARGIN`` of the GPU; one in host memory moves there when that is so with the replica's state added
    (its weights are there already: the forwards' copy)."""
    headroom = free + reserved - peak
    margin = int(total * STEP_MARGIN)
    if on_gpu:
        return headroom >= margin
    return headroom - (replica_bytes(parameters) - 4 * parameters) >= margin


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """This process's side stream on GPU ``device`` (one per GPU, made at first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def copy_to_device(sources: Sequence[torch.Tensor], targets: Sequence[torch.Tensor], device: torch.device) -> None:
    """Copy host ``sources`` (pinned: the copies run asynchronously) into ``targets`` on ``device``, on its side
    stream; work queued later on the current stream waits for them."""
    stream, current = side_stream(device), torch.cuda.current_stream(device)
    stream.wait_stream(current)  # the targets are not in use by earlier work any more
    with torch.cuda.stream(stream):
        for source, target in zip(sources, targets, strict=True):
            target.copy_(source, non_blocking=True)
    current.wait_stream(stream)


def gather_to_host(pieces: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """``pieces`` (on one GPU) flattened into one pinned host buffer (``out`` when it is one of that size), copied
    on the GPU's side stream once the current stream produced them; returns when the copy is done."""
    device = pieces[0].device
    numel = sum(p.numel() for p in pieces)
    if out is None or out.numel() != numel or out.dtype != pieces[0].dtype or not out.is_pinned():
        out = torch.empty(numel, dtype=pieces[0].dtype, pin_memory=True)
    stream = side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        offset = 0
        for piece in pieces:
            out[offset : offset + piece.numel()].copy_(piece.reshape(-1), non_blocking=True)
            offset += piece.numel()
    stream.synchronize()  # the pieces (made on the current stream) may be freed once this returns
    return out


def detached(value: Any) -> Any:
    """``value`` (a tensor or a tuple of them) detached from its graph."""
    if torch.is_tensor(value):
        return value.detach()
    return tuple(detached(v) for v in value)


def on_host(value: Any) -> Any:
    """``value`` in host memory: as it is on CPU, else a pinned copy (the copy runs asynchronously)."""
    if torch.is_tensor(value):
        if value.device.type == "cpu":
            return value
        return torch.empty_like(value, device="cpu", pin_memory=True).copy_(value, non_blocking=True)
    return tuple(on_host(v) for v in value)


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` (a tensor or a tuple of them) on ``device``."""
    if torch.is_tensor(value):
        return value.to(device)
    return tuple(to_device(v, device) for v in value)


def as_leaf(value: Any) -> Any:
    """A graph leaf with ``value``'s data (floating tensors require grad, so a lazy backward yields their gradient)."""
    if torch.is_tensor(value):
        return value.detach().clone().requires_grad_(value.is_floating_point())
    return tuple(as_leaf(v) for v in value)


def saved_on_host(device: torch.device) -> Any:
    """Keep the tensors an RF's graph saves in host memory (pinned) on an accelerator; on CPU they are there already."""
    import contextlib

    if device.type == "cpu":
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=True)
