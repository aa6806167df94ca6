"""The successor's stage that a node keeps, and the exchange that keeps it equal to the original.

Freshness mechanism: at the end of every step the owner of a stage ships its (data-parallel
reduced) gradients to the replica holder, and after the step commits both apply the same
optimizer update. Same weights, same optimizer state, same gradients and the same arithmetic
give the same result bit for bit. Cost per step: one copy of the stage's gradients (plus a
one-byte-per-parameter mask of which parameters got a gradient) over the network, sent with
non-blocking point-to-point calls; the replica's update costs one optimizer step of that stage.

Where that cost goes (``GradientExchange``, ``Replica.settle``): the holder posts its receive at
the step's first wait, so the successor's gradients travel while this stage still runs its last
backward; the own gradients leave without waiting, and the replica's gradients are waited for
only after the loss went out. The replica's update is not applied at the step boundary but
where the next step first waits anyway (the first stage before its first gradient arrives, every
other stage before its first activation arrives). The gradient buffers are allocated once and
reused: a fresh buffer of a stage's gradients has its pages faulted in again at every step.

The first stage's last backward ends every 1F1B step, while the other stages' cores are idle
waiting for it: there, copying and sending its gradients would be on the critical path. So, during
that backward (``GradientExchange.copy_early``), a helper thread copies each gradient into the send
buffer as soon as the backward has accumulated its final value, and sends each chunk of the buffer
as soon as all of its gradients are in; ``ship`` is left with the mask and what the backward did
not reach.
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_bamboo import checkpoint as ckpt


class StageContainer(nn.Module):
    """The layers of one stage: module children named by global layer index (like a pipeline stage),
    and ``forward`` running every layer in order, plain callables included (like ``PipelineModule``)."""

    def __init__(self, layers: Mapping[int, Any]) -> None:
        super().__init__()
        self._calls: list[Any] = []
        self.indices = sorted(layers)  # every layer's global index, plain callables included
        for index in sorted(layers):
            layer = layers[index]
            if isinstance(layer, nn.Module):
                self.add_module(str(index), layer)
            self._calls.append(layer)

    def forward(self, inputs: Any) -> Any:
        for layer in self._calls:
            inputs = layer(inputs)
        return inputs


def flat_grads(module: nn.Module, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """All gradients of ``module`` in one fp32 buffer (``out`` when it fits), and which parameters had one."""
    params = [p for p in module.parameters() if p.requires_grad]
    mask = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8)
    pieces = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float() for p in params]
    if not pieces:
        return torch.zeros(0), mask
    if out is not None and out.numel() == sum(t.numel() for t in pieces) and all(t.device == out.device for t in pieces):
        # a buffer used before: no fresh pages to fault in
        return torch.cat(pieces, out=out), mask
    return torch.cat(pieces).cpu(), mask


def set_flat_grads(module: nn.Module, flat: torch.Tensor, mask: torch.Tensor) -> None:
    offset = 0
    params = [p for p in module.parameters() if p.requires_grad]
    for param, has in zip(params, mask.tolist(), strict=True):
        n = param.numel()
        # a view of the received buffer (no copy) where device and dtype already match
        param.grad = flat[offset : offset + n].view_as(param).to(param.device, param.dtype) if has else None
        offset += n


def copy_hyperparameters(source: torch.optim.Optimizer, target: torch.optim.Optimizer) -> None:
    """Give ``target`` the current hyperparameters (lr, ...) of ``source``'s groups, as schedulers set them."""
    for src, dst in zip(source.param_groups, target.param_groups, strict=False):
        for key, value in src.items():
            if key != "params" and key in dst:
                dst[key] = value


class Replica:
    """Layers of stage ``stage`` (the successor's) with their own optimizer, held on this node."""

    def __init__(self, stage: int, module: StageContainer, optimizer: torch.optim.Optimizer) -> None:
        self.stage = stage
        self.module = module
        self.optimizer = optimizer
        self.pending = False  # gradients received for the step in flight, not committed yet
        self.due = False  # a committed update taken on, not applied yet (see ``settle``)

    @property
    def layers(self) -> range:
        return range(self.module.indices[0], self.module.indices[-1] + 1)

    def states(self) -> dict[int, dict[str, Any]]:
        self.settle()
        return ckpt.layer_states(self.module, self.optimizer, self.layers)

    def step(self, own_optimizer: torch.optim.Optimizer | None, defer: bool = False) -> None:
        """Apply the update the owner applies (after the step committed).

        With ``defer`` the update is only taken on (with this step's hyperparameters) and applied by
        ``settle``: the engine calls it where the next step waits for a peer, so the update costs
        idle time instead of the step boundary, and everything that reads or changes the replica
        (states, redundant forwards, the next gradients, a failover) settles it first.
        """
        if own_optimizer is not None:
            copy_hyperparameters(own_optimizer, self.optimizer)  # this step's learning rate, taken now
        self.pending = False
        self.due = True
        if not defer:
            self.settle()

    def settle(self) -> float:
        """Apply the committed update that is due, if any; the seconds it took."""
        if not self.due:
            return 0.0
        started = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.due = False
        return time.perf_counter() - started

    def discard(self) -> None:
        """Forget the gradients of a step that did not commit (a committed update still due is applied first)."""
        self.settle()
        self.optimizer.zero_grad(set_to_none=True)
        self.pending = False


#: the tags of the gradient exchange's messages (the mask, then each chunk of the gradients): DeepSpeed's
#: own point-to-point messages use tag 0 on the same process group, and a receive posted early must
#: never match one of those
REPLICA_TAG = 0xB0
#: the gradients travel in chunks of whole parameters of at least this many elements (1 MiB of fp32),
#: so that a chunk can leave while the backward still computes the gradients of the next
CHUNK_NUMEL = 1 << 18


def chunk_plan(numels: Iterable[int], chunk_numel: int = CHUNK_NUMEL) -> list[tuple[int, int, int, int]]:
    """Split parameters (their sizes in order) into chunks: ``(first param, end param, first element, end element)``.

    Sender and receiver hold the same layers, so both derive the same chunks (and tags) from them.
    """
    chunks, first, start, offset = [], 0, 0, 0
    sizes = list(numels)
    for index, numel in enumerate(sizes):
        offset += numel
        if offset - start >= chunk_numel or index == len(sizes) - 1:
            chunks.append((first, index + 1, start, offset))
            first, start = index + 1, offset
    return chunks


class _Copier:
    """A helper thread running jobs in the order submitted; ``drain`` waits for all of them."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | threading.Event | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="bamboo-grad-copy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if isinstance(job, threading.Event):
                job.set()
                continue
            try:
                if self._error is None:
                    job()
            except BaseException as err:  # handed to the thread that drains
                self._error = err

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def drain(self) -> None:
        done = threading.Event()
        self._jobs.put(done)
        while not done.wait(0.5):
            if not self._thread.is_alive():  # closed before it got there: never returns forever
                raise RuntimeError("the gradient exchange was closed (its peers changed) while a step still used it")
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"sending gradients early failed: {error}") from error

    def close(self) -> None:
        """End the thread once the jobs submitted so far ran."""
        self._jobs.put(None)


class _EarlyShip:
    """The state of one step's early copies: which parameters were copied, which chunks already left."""

    def __init__(self, numels: list[int]) -> None:
        self.chunks = chunk_plan(numels)
        self.offsets = [0, *itertools.accumulate(numels)]  # parameter i is elements offsets[i]:offsets[i + 1]
        self.missing = [end - first for first, end, _, _ in self.chunks]  # parameters still to copy, per chunk
        self.copied: set[int] = set()  # indices of the parameters copied
        self.requests: list[Any] = []  # the sends of the chunks that left
        self.complete = False  # the backward ran to its end


class GradientExchange:
    """One step's exchange: ship this stage's gradients to ``send_to``, take the replica's from ``recv_from``.

    The receive can be posted early (``post_receive``, where the step first waits), so the successor's
    gradients travel as soon as it sends them, while this stage still runs its last backward; only
    this stage's own gradients are shipped on the critical path. The send is not waited for in the
    step (under a commit the receiver has them before anyone applies the step): the next ``ship``
    waits for it first. The gradients travel with a mask of which parameters have one; the first
    stage's in chunks (``chunk_plan``), which ``copy_early`` sends during the last backward as soon
    as each chunk's gradients are final.
    """

    def __init__(self, replica: Replica | None, send_to: int | None, recv_from: int | None, group: Any = None,
                 first_stage: bool = False) -> None:
        if recv_from is not None and replica is None:
            raise ValueError(f"receiving replica gradients from rank {recv_from} needs a replica")
        # Only the first stage's gradients travel in chunks (``copy_early``); every other stage's in one
        # message, which costs its sender less. Both ends know: the receiver holds stage 0's replica.
        self.chunked_send = first_stage
        # The group of now, not "the default group" at each call: a step thread a failover left behind
        # must fail on its destroyed group, never post on the new one.
        self.replica, self.send_to, self.recv_from = replica, send_to, recv_from
        self.group = group if group is not None else dist.group.WORLD
        self._recv: tuple[torch.Tensor, torch.Tensor, list[Any]] | None = None
        self._sent: tuple[tuple[torch.Tensor, ...], list[Any]] = ((), [])  # buffers kept alive, requests
        # Buffers reused step after step (allocating them anew costs more than copying into them): one
        # to send from, two to receive into by turns, as the replica's gradients of one step are views
        # of its receive buffer until its deferred update is applied, during the next step.
        self._send_buffer: torch.Tensor | None = None
        self._recv_buffers: list[torch.Tensor] = []
        self._copier: _Copier | None = None
        self._early: _EarlyShip | None = None  # the early copies of the step in flight

    def _receive_buffer(self, numel: int) -> torch.Tensor:
        assert self.replica is not None
        held = {p.grad.untyped_storage().data_ptr() for p in self.replica.module.parameters() if p.grad is not None}
        self._recv_buffers = [b for b in self._recv_buffers if b.numel() == numel]
        # one that no gradient of the replica is a view of; else a new one (at most two are kept)
        buffer = next((b for b in self._recv_buffers if b.untyped_storage().data_ptr() not in held), None)
        if buffer is None:
            buffer = torch.empty(numel)
            self._recv_buffers = [*self._recv_buffers[-1:], buffer]
        return buffer

    def post_receive(self) -> None:
        if self.recv_from is None or self._recv is not None:
            return
        assert self.replica is not None
        params = [p for p in self.replica.module.parameters() if p.requires_grad]
        mask = torch.zeros(len(params), dtype=torch.uint8)
        flat = self._receive_buffer(sum(p.numel() for p in params))
        requests = [dist.irecv(mask, self.recv_from, group=self.group, tag=REPLICA_TAG)]
        for index, (_, _, start, end) in enumerate(self._chunks([p.numel() for p in params], self.replica.stage == 0)):
            requests.append(dist.irecv(flat[start:end], self.recv_from, group=self.group, tag=REPLICA_TAG + 1 + index))
        self._recv = (mask, flat, requests)

    @staticmethod
    def _chunks(numels: list[int], chunked: bool) -> list[tuple[int, int, int, int]]:
        """The first stage's gradients in chunks (``copy_early``), any other stage's in one message."""
        return chunk_plan(numels, CHUNK_NUMEL if chunked else max(sum(numels), 1))

    def _send_chunk(self, flat: torch.Tensor, index: int, start: int, end: int) -> Any:
        assert self.send_to is not None
        return dist.isend(flat[start:end], self.send_to, group=self.group, tag=REPLICA_TAG + 1 + index)

    @contextlib.contextmanager
    def copy_early(self, own: nn.Module) -> Iterator[None]:
        """Around the last backward of a step: copy each of ``own``'s gradients into the send buffer as
        soon as that backward has accumulated it, and send each chunk once all of its gradients are
        copied, on a helper thread (the other stages wait for this backward: their cores are idle).
        ``ship`` then only sends what the backward did not reach, and the mask.

        Only for parameters on the host (the buffer is); with any other, or nothing to send, the
        backward runs plainly and ``ship`` copies and sends everything.
        """
        params = [p for p in own.parameters() if p.requires_grad]
        if not self.chunked_send or self.send_to is None or not params or any(p.device.type != "cpu" for p in params):
            yield
            return
        self.finish_send()  # the buffer is free again
        numel = sum(p.numel() for p in params)
        if self._send_buffer is None or self._send_buffer.numel() != numel:
            self._send_buffer = torch.empty(numel)
        if self._copier is None:
            self._copier = _Copier()
        buffer, copier = self._send_buffer, self._copier
        early = self._early = _EarlyShip([p.numel() for p in params])

        def copy(index: int, chunk: int, grad: torch.Tensor) -> None:
            buffer[early.offsets[index] : early.offsets[index + 1]].copy_(grad)
            early.copied.add(index)
            early.missing[chunk] -= 1
            if early.missing[chunk] == 0:
                early.requests.append(self._send_chunk(buffer, chunk, *early.chunks[chunk][2:]))

        def hook_for(index: int, chunk: int) -> Any:
            def hook(param: torch.Tensor) -> None:
                assert param.grad is not None
                copier.submit(functools.partial(copy, index, chunk, param.grad.detach().reshape(-1)))
            return hook

        handles = [params[index].register_post_accumulate_grad_hook(hook_for(index, chunk))
                   for chunk, (first, end, _, _) in enumerate(early.chunks) for index in range(first, end)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        early.complete = True  # only when the backward succeeded

    def ship(self, own: nn.Module) -> bool:
        """Send ``own``'s (final) gradients without waiting, and make sure the replica's receive is posted.

        True when (most of) they left during the last backward (``copy_early``).
        """
        early, self._early = self._early, None
        shipped_early = False
        if self.send_to is not None:
            params = [p for p in own.parameters() if p.requires_grad]
            chunks = self._chunks([p.numel() for p in params], self.chunked_send)
            if early is not None and early.complete and early.chunks == chunks:
                assert self._copier is not None and self._send_buffer is not None
                self._copier.drain()  # the last copies and chunks left
                flat, requests = self._send_buffer, early.requests
                for chunk, (first, end, start, stop) in enumerate(chunks):
                    if early.missing[chunk] == 0:
                        continue
                    for index in set(range(first, end)) - early.copied:  # not reached by the last backward
                        piece, grad = flat[early.offsets[index] : early.offsets[index + 1]], params[index].grad
                        if grad is None:
                            piece.zero_()
                        else:
                            piece.copy_(grad.detach().reshape(-1))
                    requests.append(self._send_chunk(flat, chunk, start, stop))
                mask = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8)
                shipped_early = True
            else:
                if early is not None:
                    self._drain(early)
                self.finish_send()
                flat, mask = flat_grads(own, out=self._send_buffer)
                self._send_buffer = flat
                requests = [self._send_chunk(flat, chunk, start, end) for chunk, (_, _, start, end) in enumerate(chunks)]
            requests.append(dist.isend(mask, self.send_to, group=self.group, tag=REPLICA_TAG))
            self._sent = ((mask, flat), requests)
        self.post_receive()
        return shipped_early

    def _drain(self, early: _EarlyShip) -> None:
        """Let the early copies of a step that is not shipped from them finish (their sends are waited for too)."""
        assert self._copier is not None
        self._copier.drain()
        self._sent = (self._sent[0], [*self._sent[1], *early.requests])

    def discard(self) -> None:
        """Forget the early copies of a step that will not be shipped."""
        early, self._early = self._early, None
        if early is not None:
            self._drain(early)

    def receive(self) -> None:
        """Wait for the replica's gradients and hand them to it (``replica.pending``)."""
        if self._recv is None:
            return
        assert self.replica is not None
        self.replica.settle()  # the last step's update, if still due, runs while the gradients travel
        mask, received, requests = self._recv
        self._recv = None
        _wait_all(requests)
        set_flat_grads(self.replica.module, received, mask)
        self.replica.pending = True

    def finish_send(self) -> None:
        """Wait until the last gradients sent are gone (kept alive until then)."""
        (_buffers, requests), self._sent = self._sent, ((), [])
        _wait_all(requests)

    def close(self) -> None:
        """Let the helper thread end (the exchange is replaced: its peers changed)."""
        if self._copier is not None:
            self._copier.close()


def exchange_objects(payload: Any, send_to: int | None, recv_from: int | None) -> Any:
    """Send a picklable object to one rank and receive one from another at the same time."""
    requests = []
    if send_to is not None:
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        requests.append(dist.isend(size, send_to))
    received = None
    if recv_from is not None:
        incoming = torch.zeros(1, dtype=torch.int64)
        _wait_all([dist.irecv(incoming, recv_from)])
    _wait_all(requests)
    requests = []
    if send_to is not None:
        requests.append(dist.isend(data, send_to))
    if recv_from is not None:
        received = torch.empty(int(incoming.item()), dtype=torch.uint8)
        requests.append(dist.irecv(received, recv_from))
    _wait_all(requests)
    if received is None:
        return None
    return torch.load(io.BytesIO(received.numpy().tobytes()), map_location="cpu", weights_only=False)


def _wait_all(requests: Iterable[Any]) -> None:
    for request in requests:
        if request is not None:
            request.wait()


def equal_states(a: Mapping[int, dict[str, Any]], b: Mapping[int, dict[str, Any]]) -> list[str]:
    """Differences between two per-layer states (weights and optimizer state), bit for bit."""
    problems: list[str] = []
    if sorted(a) != sorted(b):
        return [f"layers differ: {sorted(a)} vs {sorted(b)}"]
    for layer in a:
        for part in ("weights", "optimizer"):
            left, right = a[layer][part], b[layer][part]
            if sorted(left) != sorted(right):
                problems.append(f"layer {layer} {part}: keys differ")
                continue
            for name in left:
                if not _equal(left[name], right[name]):
                    problems.append(f"layer {layer} {part} {name} differs")
    return problems


def _equal(x: Any, y: Any) -> bool:
    if torch.is_tensor(x) and torch.is_tensor(y):
        return x.shape == y.shape and x.dtype == y.dtype and bool(torch.equal(x, y))
    if isinstance(x, Mapping) and isinstance(y, Mapping):
        return sorted(x) == sorted(y) and all(_equal(x[k], y[k]) for k in x)
    return bool(x == y)


def free(modules: Iterable[nn.Module]) -> None:
    for module in modules:
        for param in module.parameters():
            param.grad = None
