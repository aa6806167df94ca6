"""What one micro-batch holds in each layer of a stage: the tensors its forward saves for backward, and its output.

Measured once per engine, at its first training forward, on a copy of that forward's input: the layers run once
more with autograd on, each under a hook that counts what it saves (its parameters not counted, a storage once),
and what they produce is dropped. The process's random streams and the layers' buffers (a batch norm's running
statistics) are left as they were, so the step that follows computes what it would have computed.
``planner.memory`` turns these sizes into the node's activations.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch


def nbytes(value: Any) -> int:
    """The bytes of a tensor, or of the tensors in a tuple or list."""
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(nbytes(v) for v in value)
    return 0


def _fresh(value: Any) -> Any:
    """A graph leaf with ``value``'s data (floating tensors require grad, as a received activation does)."""
    if torch.is_tensor(value):
        return value.detach().requires_grad_(value.is_floating_point())
    return tuple(_fresh(v) for v in value)


def measure_layers(calls: Iterable[tuple[int, Callable[[Any], Any]]], module: torch.nn.Module, x: Any,
                   autocast: contextlib.AbstractContextManager[Any] | None = None) -> dict[int, tuple[int, int]]:
    """``{layer: (saved bytes, output bytes)}`` for one micro-batch ``x`` through ``calls`` (``(global index,
    layer)`` in order, the layers of ``module``); the layer before the first gets ``(0, bytes of x)`` (what the stage
    receives)."""
    held = {p.untyped_storage().data_ptr() for p in module.parameters()}
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    calls = list(calls)
    if not calls:
        return {}
    sizes = {calls[0][0] - 1: (0, nbytes(x))}
    devices = [t.device.index or 0 for t in ([x] if torch.is_tensor(x) else []) if t.device.type == "cuda"]
    with torch.random.fork_rng(devices=devices), torch.enable_grad(), autocast or contextlib.nullcontext():
        x = _fresh(x)
        for index, call in calls:
            seen: dict[int, int] = {}

            def pack(t: torch.Tensor, seen: dict[int, int] = seen) -> torch.Tensor:
                storage = t.untyped_storage()
                if storage.data_ptr() not in held:
                    seen[storage.data_ptr()] = storage.nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = call(x)
            sizes[index] = (sum(seen.values()), nbytes(y))
            x = _fresh(y)
    with torch.no_grad():
        for buffer, before in buffers:
            buffer.copy_(before)
    return sizes
