"""The exchange that keeps a replica equal to its stage: the owner's gradients, shipped to the holder.

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
where the next step waits longest anyway (``BambooPipelineEngine.updates_replica_at_end``): the
earlier half of the stages before their first gradient arrives, the later half (the last stage
always) at the end of their schedule, where they wait for the loss until the first stage ran its
last backward (stage i of p waits about p-1-i backwards for its first gradient, i at the end).
The gradient buffers are allocated once and reused: a fresh buffer of a stage's gradients has its
pages faulted in again at every step.

The gradients travel in chunks of whole parameters of about 1 MiB (``chunk_plan``), or through
shared memory between two processes on one host (``GradientExchange``). Copying and sending them
during the first stage's last backward, from a helper thread, was tried and taken out: it made
that backward (the end of every step) about 1 ms longer, and with shared memory there is almost
no send left to hide (``benchmarks/rc_trace.py`` on the commits before and after, in the README).
What is done instead: the stages before the last write their gradients so far into the shared buffer
where the step waits before its last backward, and make them views of it (``write_ahead``); that
backward accumulates into shared memory, and the ship copies nothing (1.2 ms off the first stage's
critical path).
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import secrets
import socket
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from lightning_bamboo.engine.comm_child import map_memory, new_memory_file
from lightning_bamboo.engine.comm_process import trim_buffers
from lightning_bamboo.engine.placement import gather_to_host
from lightning_bamboo.engine.replica import Replica
from lightning_bamboo.errors import BambooError

log = logging.getLogger(__name__)


def flat_grads(module: nn.Module, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """All gradients of ``module`` in one fp32 buffer (``out`` when it fits), and which parameters had one."""
    params = [p for p in module.parameters() if p.requires_grad]
    mask = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8)
    pieces = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float() for p in params]
    if not pieces:
        return torch.zeros(0), mask
    if pieces[0].is_cuda:  # to pinned host memory on a side stream, not a device-wide synchronization
        return gather_to_host(pieces, out), mask
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


#: the tags of the gradient exchange's messages (the mask, then each chunk of the gradients): DeepSpeed's
#: own point-to-point messages use tag 0 on the same process group, and a receive posted early must
#: never match one of those
REPLICA_TAG = 0xB0
#: the gradients travel over the process group in chunks of whole parameters of at least this many
#: elements (1 MiB of fp32); sender and receiver derive the same chunks, and tags, from their layers
CHUNK_NUMEL = 1 << 18
#: the tags of the shared-memory handshake: the holder's offer of its buffer, and its "read" after each step
#: (``READ_TAG`` for the buffer's first half, one less for its second)
OFFER_TAG, READ_TAG = REPLICA_TAG - 1, REPLICA_TAG - 2
#: the size of an offer message (a pickled host identity, token and shared-memory handle)
OFFER_BYTES = 1024
#: bytes after the mask: the token of the shared buffer this step's gradients are in, then the next step's (0: none)
_HEADER = 16


def host_identity() -> str:
    """This machine (host name and boot): two processes share memory only where these are equal."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def offer_shared_buffer(numel: int) -> tuple[torch.Tensor, int, bytes]:
    """A buffer of ``numel`` gradient elements in a memory file, its token, and the offer that names it.

    The peer on this host opens the file through ``/proc/<pid>/fd/<fd>`` (``map_offered_buffer``): no
    manager process is involved (torch's ``file_system`` sharing has one per process, and a peer that
    frees a buffer after that manager died with its process is aborted by the C++ runtime). The memory
    lives while either end maps it; the descriptor is closed when the buffer is freed.
    """
    token = secrets.randbits(62) + 1
    memory, fd = new_memory_file(f"bamboo-grads-{token}", _gradient_bytes(numel))
    buffer = memory.view(torch.get_default_dtype())
    weakref.finalize(buffer, os.close, fd)  # open for the peer while the buffer lives (its mapping needs none)
    return buffer, token, pickle.dumps((host_identity(), token, os.getpid(), fd, numel))


def _gradient_bytes(numel: int) -> int:
    return numel * torch.get_default_dtype().itemsize


def map_offered_buffer(payload: bytes, numel: int) -> tuple[torch.Tensor, int] | None:
    """The buffer a peer offered (``offer_shared_buffer``) and its token, mapped here; None if this
    process cannot map it (another machine, another size, no access to the peer's descriptors)."""
    host, token, pid, fd, offered = pickle.loads(payload)
    if host != host_identity() or offered != numel:
        return None
    path = f"/proc/{pid}/fd/{fd}"
    try:
        if os.readlink(path) != f"/memfd:bamboo-grads-{token} (deleted)":  # not the file offered (another pid space)
            return None
        return map_memory(os.open(path, os.O_RDWR), _gradient_bytes(numel)).view(torch.get_default_dtype()), token
    except (OSError, ValueError) as err:
        log.debug("could not map the replica holder's shared buffer %s: %s", path, err)
        return None


def _header(mask: torch.Tensor, this: int, following: int) -> torch.Tensor:
    return torch.cat([mask, torch.tensor([this, following], dtype=torch.int64).view(torch.uint8)])


def _tokens(message: torch.Tensor) -> tuple[int, int]:
    this, following = message[-_HEADER:].clone().view(torch.int64).tolist()
    return this, following


def _half(buffer: torch.Tensor, half: int) -> torch.Tensor:
    """Half ``half`` (0 or 1) of a shared gradient buffer: the owner writes them by turns."""
    numel = buffer.numel() // 2
    return buffer[half * numel : (half + 1) * numel]


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


class GradientExchange:
    """One step's exchange: ship this stage's gradients to ``send_to``, take the replica's from ``recv_from``.

    The receive can be posted early (``post_receive``, where the step first waits), so the successor's
    gradients travel as soon as it sends them, while this stage still runs its last backward; only
    this stage's own gradients are shipped on the critical path. The send is not waited for in the
    step (under a commit the receiver has them before anyone applies the step): the next ``ship``
    waits for it first. The gradients travel in chunks (``chunk_plan``), with a mask of which
    parameters have one.

    Between two processes on one host they travel through shared memory instead: the holder offers
    a buffer of its own with two halves (``OFFER_TAG``, at its first ``post_receive``); once the owner
    has it mapped, it copies its gradients straight into the halves by turns (or had them accumulate there,
    ``write_ahead``) and sends only the mask;
    the replica's gradients are views of a half, and the holder answers "read" for it (``READ_TAG``
    minus the half, ``acknowledge``) once their update was applied, during the next step; the owner
    writes that half again only then, at the ship after next, so its ship does not wait for the
    holder's update of the step before. The mask message says where the step's gradients are and
    where the next step's will be (a token that names the half), so both ends switch at the same
    step; socket writes of the whole gradients and the receiving thread's reads are saved. Every
    wait is still a wait on a message from the peer, so a lost peer is noticed as before.
    """

    def __init__(self, replica: Replica | None, send_to: int | None, recv_from: int | None, group: Any = None) -> None:
        if recv_from is not None and replica is None:
            raise ValueError(f"receiving replica gradients from rank {recv_from} needs a replica")
        # The group of now, not "the default group" at each call: a step thread a failover left behind
        # must fail on its destroyed group, never post on the new one.
        self.replica, self.send_to, self.recv_from = replica, send_to, recv_from
        self.group = group if group is not None else dist.group.WORLD
        self._forget_buffers()

    def _forget_buffers(self) -> None:
        """Every field of the exchange's protocol state and the buffers it holds, as at its start."""
        self._recv: tuple[torch.Tensor, torch.Tensor | None, list[Any]] | None = None
        self._sent: tuple[tuple[torch.Tensor, ...], list[Any]] = ((), [])  # buffers kept alive, requests
        # Buffers reused step after step (allocating them anew costs more than copying into them): one
        # to send from, two to receive into by turns, as the replica's gradients of one step are views
        # of its receive buffer until its deferred update is applied, during the next step.
        self._send_buffer: torch.Tensor | None = None
        self._recv_buffers: list[torch.Tensor] = []
        # shared memory, holder's end: its buffer (two halves) and the first half's token (the second's is one
        # more), the offer in flight, whether the owner writes there
        self._shared: tuple[torch.Tensor, int] | None = None
        self._offer: tuple[torch.Tensor, Any] | None = None
        self._owner_writes_shared = False
        # per half, the last "read" sent (kept alive until it is gone: the owner receives it at its next ship
        # into that half at the latest, which comes after the gradients it reads now)
        self._read_sent: list[tuple[torch.Tensor, Any] | None] = [None, None]
        self._unread: int | None = None  # the token of the half the replica's gradients are views of
        # owner's end: the holder's offer being received, then its mapped buffer and first token, the half it
        # writes next, and per half the "read" it waits for: (message, token it must name, receive or None
        # while not posted: it is posted where the step waits, off the critical path)
        self._offer_in: tuple[torch.Tensor, Any] | None = None
        self._peer_shared: tuple[torch.Tensor, int] | None = None
        self._half = 0
        self._reads: list[tuple[torch.Tensor, int, Any] | None] = [None, None]
        self._offer_answered = False
        self._written: int | None = None  # the half the own gradients were written ahead into (``write_ahead``)
        self.ships_written_ahead = 0  # ships whose gradients were in the shared half already
        # whether the owner's optimizer step leaves its gradients as they are and lets go of them (None: not seen
        # yet, ``owner_stepped``), and the gradients of the last ship through shared memory with their versions
        self.grads_left_alone: bool | None = None
        self._shipped_grads: tuple[bool, list[tuple[torch.Tensor, torch.Tensor, int]]] = (False, [])

    def release(self) -> None:
        """Let go of every buffer, the shared memory's mappings included (a failover: this exchange is never used
        again). A request still in flight keeps what it reads or writes alive until it ends."""
        self._forget_buffers()

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
        """Post what this exchange waits for next: the replica's gradients, and the holder's "read" for the
        gradients last shipped through shared memory (called where the step waits)."""
        for half in (0, 1):
            self._post_read(half)
        self._post_replica_receive()

    def _post_replica_receive(self) -> None:
        if self.recv_from is None or self._recv is not None:
            return
        assert self.replica is not None
        params = [p for p in self.replica.module.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in params)
        self._offer_shared(numel)
        mask = torch.zeros(len(params) + _HEADER, dtype=torch.uint8)
        requests = [dist.irecv(mask, self.recv_from, group=self.group, tag=REPLICA_TAG)]
        flat = None  # through shared memory the replica reads the owner's buffer: no receive buffer
        if self._owner_writes_shared:
            if self._recv_buffers:
                self._recv_buffers = []  # those of the first steps, over the process group, are not used again
                trim_buffers()  # nor are the transfer buffers their chunks went through
        else:
            flat = self._receive_buffer(numel)
            for index, (_, _, start, end) in enumerate(chunk_plan(p.numel() for p in params)):
                requests.append(dist.irecv(flat[start:end], self.recv_from, group=self.group,
                                           tag=REPLICA_TAG + 1 + index))
        self._recv = (mask, flat, requests)

    def _offer_shared(self, numel: int) -> None:
        """Once: offer the owner a shared buffer for the gradients (it takes it if it runs on this host).

        The owner waits for this message at its second ``ship``, so it is always sent: empty when this
        holder has no shared memory to offer.
        """
        if self._offer is not None or self.recv_from is None:
            return
        payload = b""
        if numel:
            try:
                buffer, token, payload = offer_shared_buffer(2 * numel)  # two halves, written by turns
                if len(payload) <= OFFER_BYTES - 4:
                    self._shared = (buffer, token)
                else:
                    payload = b""
            except OSError as err:  # no shared memory here: the gradients keep coming over the process group
                log.debug("no shared memory for the replica's gradients: %s", err)
                payload = b""
        message = torch.zeros(OFFER_BYTES, dtype=torch.uint8)
        message[:4] = torch.tensor([len(payload)], dtype=torch.int32).view(torch.uint8)
        if payload:
            message[4 : 4 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self._offer = (message, dist.isend(message, self.recv_from, group=self.group, tag=OFFER_TAG))

    def ship(self, own: nn.Module) -> None:
        """Send ``own``'s (final) gradients without waiting, and make sure the replica's receive is posted."""
        self._finish_requests()
        if self.send_to is not None:
            shared = self._peer_half(self._half) if self._peer_shared is not None else None
            written, self._written = self._written == self._half, None
            if shared is not None and written:  # the gradients are in the half already, but those begun since
                flat, mask = shared[0], _complete_written(own, shared[0])
                self.ships_written_ahead += 1
            else:
                if shared is not None:
                    self._wait_read(self._half)  # the holder read what this half held two ships ago
                flat, mask = flat_grads(own, out=shared[0] if shared is not None else self._send_buffer)
            requests: list[Any] = []
            if shared is not None:
                if flat is not shared[0]:  # gradients elsewhere than on the host
                    shared[0].copy_(flat)
                self._shipped_grads = (written, [(p, p.grad, p.grad._version) for p in own.parameters()
                                                 if p.requires_grad and p.grad is not None])
                if self._send_buffer is not None:
                    self._send_buffer = None  # not needed any more, nor the transfer buffers of its chunks
                    trim_buffers()
                self._reads[self._half] = (torch.zeros(1, dtype=torch.int64), shared[1], None)
                self._half = 1 - self._half
            else:
                self._send_buffer = flat
                numels = [p.numel() for p in own.parameters() if p.requires_grad]
                requests = [dist.isend(flat[start:end], self.send_to, group=self.group, tag=REPLICA_TAG + 1 + index)
                            for index, (_, _, start, end) in enumerate(chunk_plan(numels))]
                self._take_offer(sum(numels))  # the next step's gradients go through it, if there is one
            following = self._peer_half(self._half)[1] if self._peer_shared is not None else 0
            message = _header(mask, shared[1] if shared is not None else 0, following)
            requests.append(dist.isend(message, self.send_to, group=self.group, tag=REPLICA_TAG))
            self._sent = ((message, flat), requests)
        self._post_replica_receive()  # not the "read" for this ship: that is posted where the next step waits

    def write_ahead(self, own: nn.Module) -> None:
        """Where the step waits before its last backward: write ``own``'s gradients so far into the shared half the
        next ship sends, and make them views of it.

        The last backward then accumulates straight into shared memory (in place, as into any gradient), and the
        ship, on the critical path, copies nothing but the gradients that backward began. Only once the owner's
        optimizer was seen to leave its gradients as they are and set them to None (``owner_stepped``): the
        holder reads them there during the next step.
        """
        if self.send_to is None or self._peer_shared is None or self._written is not None or not self.grads_left_alone:
            return
        half = self._peer_half(self._half)[0]
        params = [p for p in own.parameters() if p.requires_grad]
        if not params or any(p.device.type != "cpu" or p.dtype != half.dtype for p in params):
            return  # (on a GPU, or in another dtype: the ship gathers them to the host as before)
        self._wait_read(self._half)  # the holder read what this half held two ships ago
        _, mask = flat_grads(own, out=half)
        set_flat_grads(own, half, mask)  # views of the half (None stays None)
        self._written = self._half

    def owner_stepped(self) -> None:
        """After the owner's optimizer step of gradients shipped through shared memory: whether it left them as
        they were and set them to None (``write_ahead`` needs both: the holder reads them during the next step).

        Seen at the first such step, whose gradients are the owner's own; from then on they may be written
        ahead. An optimizer that writes them in place (``SGD(nesterov=True)``'s foreach step does, and a
        ``zero_grad`` that zeroes) keeps the copy at the ship. Should one do so later, after a write-ahead,
        the holder's replica would take those values: that stops training with an error.
        """
        (written, grads), self._shipped_grads = self._shipped_grads, (False, [])
        if not grads:
            return
        left_alone = all(p.grad is None and g._version == v for p, g, v in grads)
        if written and not left_alone:
            raise BambooError(
                "the optimizer's step() changed the gradients in place, or its zero_grad() kept them, after they "
                f"were shared with the replica holder (rank {self.send_to}), which reads them during the next step: "
                "its replica would drift. Rule: step() must leave p.grad unchanged and zero_grad() must set it to "
                "None (torch's default), as this optimizer did in the steps before. Fix: use such an optimizer, or "
                "redundancy='off'"
            )
        if self.grads_left_alone is None or not left_alone:
            if not left_alone:
                log.info("the optimizer writes its gradients in place: they are copied for rank %d at each step",
                         self.send_to)
            self.grads_left_alone = left_alone

    def _peer_half(self, half: int) -> tuple[torch.Tensor, int]:
        """Half ``half`` of the holder's mapped buffer and its token."""
        assert self._peer_shared is not None
        buffer, token = self._peer_shared
        return _half(buffer, half), token + half

    def _post_read(self, half: int) -> None:
        """Post the receive of the holder's "read" for ``half``, if it is awaited and not posted yet."""
        awaited = self._reads[half]
        if awaited is not None and awaited[2] is None:
            message, token, _ = awaited
            request = dist.irecv(message, self.send_to, group=self.group, tag=READ_TAG - half)
            self._reads[half] = (message, token, request)

    def _wait_read(self, half: int) -> None:
        """Wait for the holder's "read" for ``half`` (if one is awaited): it named the half's token."""
        self._post_read(half)
        awaited, self._reads[half] = self._reads[half], None
        if awaited is None:
            return
        message, token, request = awaited
        request.wait()
        if int(message[0].item()) != token:
            raise RuntimeError(f"rank {self.send_to} acknowledged shared buffer {int(message[0].item())}, not "
                               f"{token}: the gradient exchange is out of step")

    @property
    def through_shared_memory(self) -> bool:
        """Whether this stage's gradients go to its replica holder through shared memory (from the next ship on)."""
        return self._peer_shared is not None

    def _take_offer(self, numel: int) -> None:
        """The holder's offer: received from the first ``ship`` on, taken at the second, when the holder has
        long sent it (at its first wait in the first step); its buffer is mapped if it is on this host."""
        if self._offer_answered or self.send_to is None:
            return
        if self._offer_in is None:
            message = torch.zeros(OFFER_BYTES, dtype=torch.uint8)
            self._offer_in = (message, dist.irecv(message, self.send_to, group=self.group, tag=OFFER_TAG))
            return
        message, request = self._offer_in
        request.wait()
        self._offer_answered = True
        size = int(message[:4].view(torch.int32).item())
        if not size:
            return  # the holder has no shared memory to offer
        mapped = map_offered_buffer(message[4 : 4 + size].numpy().tobytes(), 2 * numel)
        if mapped is not None:  # else another machine, other layers or no access: the process group carries them
            self._peer_shared = mapped

    def receive(self) -> None:
        """Wait for the replica's gradients and hand them to it (``replica.pending``)."""
        if self._recv is None:
            return
        assert self.replica is not None
        self.replica.settle()  # the last step's update, if still due, runs while the gradients travel
        self.acknowledge()  # the owner's ship waits for it before it sends what this waits for
        message, received, requests = self._recv
        self._recv = None
        wait_all(requests)
        this, following = _tokens(message)
        own = (self._shared[1], self._shared[1] + 1) if self._shared is not None else ()
        if {this, following} - {0, *own} or (received is None) != bool(this):
            raise RuntimeError(f"the replica's gradients name shared buffer {this or following} (expected "
                               f"{'one of ' + str(own) if received is None else 0}; this holder offered {own}): the "
                               f"gradient exchange is out of step with rank {self.recv_from}")
        if this:
            # Read where the owner wrote them, no copy: "read" is answered once the replica's update used them.
            received, self._unread = self._half_of(this), this
        self._owner_writes_shared = bool(following)
        assert received is not None  # (checked above)
        set_flat_grads(self.replica.module, received, message[:-_HEADER])
        self.replica.pending = True

    def acknowledge(self) -> None:
        """Answer "read" for the gradients in a half of the shared buffer once the replica's update has used them
        (the owner writes that half again only then, at its ship after next). The engine calls it where it
        applied the update; ``receive`` does before it waits."""
        if self._unread is None or self.replica is None or self.replica.pending or self.replica.due:
            return
        assert self._shared is not None
        half = self._unread - self._shared[1]
        sent = self._read_sent[half]
        if sent is not None:  # the "read" two steps ago: the owner took it at the ship of what was just read
            sent[1].wait()
        read = torch.tensor([self._unread], dtype=torch.int64)
        self._unread = None
        self._read_sent[half] = (read, dist.isend(read, self.recv_from, group=self.group, tag=READ_TAG - half))

    def _half_of(self, token: int) -> torch.Tensor:
        """The half of this holder's shared buffer that ``token`` names."""
        assert self._shared is not None
        buffer, first = self._shared
        return _half(buffer, token - first)

    def _finish_requests(self) -> None:
        (_buffers, requests), self._sent = self._sent, ((), [])
        wait_all(requests)

    def finish_send(self) -> None:
        """Wait until the last gradients sent are gone (kept alive until then), or read from shared memory, and
        the "read"s this holder sent are gone (a clean end of both: each waits for what the other sends)."""
        self._finish_requests()
        for half in (0, 1):
            self._wait_read(half)
            sent, self._read_sent[half] = self._read_sent[half], None
            if sent is not None:
                sent[1].wait()


def _complete_written(module: nn.Module, half: torch.Tensor) -> torch.Tensor:
    """After ``GradientExchange.write_ahead``: copy into ``half`` the gradients that are not views of it already
    (those a parameter got first in the last backward), and return which parameters have one."""
    params = [p for p in module.parameters() if p.requires_grad]
    offset, base, size = 0, half.data_ptr(), half.element_size()
    for param in params:
        n = param.numel()
        if param.grad is not None and param.grad.data_ptr() != base + offset * size:
            half[offset : offset + n].copy_(param.grad.detach().reshape(-1))
        offset += n
    return torch.tensor([p.grad is not None for p in params], dtype=torch.uint8)


def exchange_objects(payload: Any, send_to: int | None, recv_from: int | None) -> Any:
    """Send a picklable object to one rank and receive one from another at the same time.

    A stage's states are most of a process's memory: the sender serialises them once and sends that buffer as it
    is, and the receiver keeps one copy of the bytes while it reads them back (a serialised stage each side, no
    more)."""
    requests = []
    if send_to is not None:
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        data = torch.frombuffer(buffer.getbuffer(), dtype=torch.uint8)  # the buffer's own memory, not a copy
        size = torch.tensor([data.numel()], dtype=torch.int64)
        requests.append(dist.isend(size, send_to))
    received = None
    if recv_from is not None:
        incoming = torch.zeros(1, dtype=torch.int64)
        wait_all([dist.irecv(incoming, recv_from)])
    wait_all(requests)
    requests = []
    if send_to is not None:
        requests.append(dist.isend(data, send_to))
    if recv_from is not None:
        received = torch.empty(int(incoming.item()), dtype=torch.uint8)
        requests.append(dist.irecv(received, recv_from))
    wait_all(requests)
    if send_to is not None:
        del data, buffer  # freed before the received bytes are read back
    if received is None:
        return None
    # read back from the received bytes themselves (``torch.load`` reads each tensor into its storage), not a copy
    reader = cast(IO[bytes], _ReadOnly(memoryview(cast(Any, received.numpy()))))
    return torch.load(reader, map_location="cpu", weights_only=False)


class _ReadOnly(io.RawIOBase):
    """A seekable binary file over bytes in memory, read without copying them first (``io.BytesIO`` copies all of
    them): ``torch.load`` reads each tensor straight into its storage (``readinto``)."""

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self._data, self._position = data, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), len(self._data) - self._position))
        memoryview(buffer).cast("B")[:n] = self._data[self._position:self._position + n]
        self._position += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: len(self._data)}[whence]
        self._position = base + offset
        return self._position

    def tell(self) -> int:
        return self._position


def wait_all(requests: Iterable[Any]) -> None:
    """Wait for each request of ``requests``; ``None`` stands for one this rank was not part of."""
    for request in requests:
        if request is not None:
            request.wait()
