"""Tied layers' gradients: every copy of a tied module gets the sum of all copies' gradients, in layer order.

A ``TiedLayerSpec`` key (GPT-2's token embedding, used again as the output head) has a copy of its module at each of
its layers (``engine.module.build_layers``). After the backward passes of a step each copy holds the gradient of its
own uses. ``reduce_tied_gradients`` gives every copy the same sum: each holder sends its copies' gradients to the
holders of the others (point-to-point, in the pipeline's own process group) and adds all of them up itself, the
first layer's copy first. The sum is the same bit for bit wherever the copies live: in two stages, or in one
stage after a failover merged them (where DeepSpeed's one shared module would accumulate the uses of every
micro-batch interleaved, and a run with a failover would end with other weights than the run without).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_bamboo.engine.comm_cuda import TIE_TAG  # (the list of every tag in use)
from lightning_bamboo.engine.transfer import wait_all

#: elements per piece of a tied gradient (16 MiB of fp32) and rounds of pieces in flight
PIECE = 1 << 22
WINDOW = 2


def held_layers(module: nn.Module) -> dict[int, nn.Module]:
    """The layers of ``module`` by global index (a stage's children are named by it)."""
    return {int(name): child for name, child in module.named_children() if name.isdigit()}


def reduce_tied_gradients(module: nn.Module, ties: Mapping[str, tuple[int, ...]], rank_of_layer: Callable[[int], int],
                          group: object = None) -> None:
    """Set every gradient of every tied copy ``module`` holds to the sum over the key's copies, in layer order.

    ``rank_of_layer(i)``: the rank (in ``group``, default the whole job) holding layer ``i`` in this pipeline. A
    parameter without a gradient counts as zeros; after this call every tied parameter here has one.
    """
    held = held_layers(module)
    for key in sorted(ties):
        layers = ties[key]
        local = [i for i in layers if i in held]
        if not local:
            continue
        params = {i: list(held[i].parameters()) for i in local}
        # per parameter, the gradient itself (no flat copy of a vocabulary-sized embedding's gradient)
        grads = {i: [_gradient(p) for p in params[i]] for i in local}
        remote = [i for i in layers if i not in held]
        if remote:
            grads.update(_exchange(grads, local, remote, rank_of_layer, group))
        for n, first in enumerate(grads[layers[0]]):
            total = first  # summed in place: every send has completed; a local copy's gradient gets the sum anyway
            for layer in layers[1:]:
                total += grads[layer][n]
            for layer in local:
                _set_gradient(params[layer][n], total)


def _exchange(grads: dict[int, list[torch.Tensor]], local: list[int], remote: list[int],
              rank_of_layer: Callable[[int], int], group: object) -> dict[int, list[torch.Tensor]]:
    """Send each local copy's gradients to every holder of a remote copy; receive the remote copies' (each holder
    sends its copies in layer order, a parameter at a time, and the receives are taken in that order).

    In pieces of ``PIECE`` elements, ``WINDOW`` rounds in flight: a vocabulary-sized gradient does not travel as
    one message, which the communication layer would stage whole (``comm_process``) on both ends. Round ``k`` posts
    the ``k``-th piece of every stream (one per peer and direction) on every rank before any rank waits for it, so no
    wait depends on a piece not posted."""
    like = grads[local[0]]
    received = {i: [torch.empty_like(g) for g in like] for i in remote}
    streams: list[tuple[str, int, list[torch.Tensor]]] = []
    for rank in sorted({rank_of_layer(i) for i in remote}):
        streams.append(("recv", rank, [p for i in remote if rank_of_layer(i) == rank for g in received[i]
                                       for p in _pieces(g)]))
        streams.append(("send", rank, [p for i in local for g in grads[i] for p in _pieces(g)]))
    rounds = max(len(pieces) for _, _, pieces in streams)
    in_flight: list[list[Any]] = []
    for k in range(rounds):
        posted = [(dist.irecv if kind == "recv" else dist.isend)(pieces[k], rank, group=group, tag=TIE_TAG)  # type: ignore[arg-type]
                  for kind, rank, pieces in streams if k < len(pieces)]
        in_flight.append(posted)
        if len(in_flight) > WINDOW:
            wait_all(in_flight.pop(0))
    for posted in in_flight:
        wait_all(posted)
    return received


def _pieces(tensor: torch.Tensor) -> list[torch.Tensor]:
    flat = tensor.view(-1)
    return [flat[start:start + PIECE] for start in range(0, flat.numel(), PIECE)] or [flat]


def _gradient(param: nn.Parameter) -> torch.Tensor:
    if param.grad is None:
        return torch.zeros_like(param)
    return param.grad.detach().contiguous()  # the gradient itself where it is contiguous (a point-to-point send's rule)


def _set_gradient(param: nn.Parameter, total: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = total.clone()
    elif param.grad.data_ptr() != total.data_ptr():
        param.grad.copy_(total)  # in place: the gradient may live in the replica holder's shared memory
