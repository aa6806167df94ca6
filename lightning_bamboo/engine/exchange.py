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
where the next step waits longest anyway (the program's ``U``, ``schedule.build.updates_replica_at_end``): the
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

The protocol between a stage's owner (``OwnerEnd``) and its replica's holder (``HolderEnd``), step by step:

1. Every ship sends a header (``HEADER_TAG``): a byte per parameter (whether it has a gradient), then the token of
   the shared half this step's gradients are in and the next step's (0: over the process group).
2. Over the process group the gradients follow in chunks of whole parameters (``chunk_plan``, tags
   ``CHUNK_TAGS + i``); both ends derive the chunks from the same layers, and post them in chunk order (NCCL sends
   them all on one lane: ``comm_cuda.lane_of``).
3. The holder offers a shared buffer of two halves once, at its first ``post_receive`` (``OFFER_TAG``; always
   sent, empty when it has none), where its first step waits, long before the owner's first ship; the owner posts
   its receive where its step waits and takes it at its first ship, so every step goes through shared memory if the
   owner could map it, and over the process group if not. The holder posts the chunks' receives of its first step
   only once the header said they come (it cannot know before), and knows from then on.
4. The owner writes a half again only once the holder's "read" for it came (``READ_TAGS[half]``), which
   the holder sends once the replica's update has used the gradients there (they are views of the half); the
   halves are written by turns, so a ship never waits for the update of the step just before it. A half's pages
   stay resident: given back at the "read", they were freed under a failover that still needed them (the DeepSpeed
   door's eager run through a kill mid-step ended 2e-3 away from the clean run's weights).
5. Both ends switch at the step the header names (its "next" token). The owner lets its last backward accumulate
   straight into the half (``write_ahead``) only once its optimizer was seen to leave the gradients alone and set
   them to None: the holder reads them during the next step.

Every wait is a wait for a message from the peer, so a lost peer is noticed as in any other wait of the step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# the tags of its messages (``comm_cuda`` lists every tag in use: a receive posted early must never match another's)
from lightning_bamboo.engine.comm_cuda import CHUNK_TAGS, HEADER_TAG, OFFER_TAG, READ_TAGS
from lightning_bamboo.engine.comm_process import gpu_direct, trim_buffers
from lightning_bamboo.engine.replica import Replica
from lightning_bamboo.engine.replica_location import gather_to_host
from lightning_bamboo.engine.shared_buffer import map_offered_buffer, offer_shared_buffer
from lightning_bamboo.engine.transfer import wait_all
from lightning_bamboo.errors import BambooError

log = logging.getLogger(__name__)


def flat_grads(module: nn.Module, out: torch.Tensor | None = None,
               on_device: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """All gradients of ``module`` in one fp32 buffer (``out`` when it fits), and which parameters had one.

    Gradients on a GPU go to pinned host memory, unless ``on_device`` (the transport carries GPU memory to GPU memory:
    ``comm_process.gpu_direct``): they are gathered on their GPU."""
    params = [p for p in module.parameters() if p.requires_grad]
    mask = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8)
    pieces = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float() for p in params]
    if not pieces:
        return torch.zeros(0), mask
    if pieces[0].is_cuda and not on_device:  # to pinned host memory on a side stream, no device-wide synchronization
        return gather_to_host(pieces, out), mask
    if out is not None and out.numel() == sum(t.numel() for t in pieces) and all(t.device == out.device for t in pieces):
        # a buffer used before: no fresh pages to fault in
        return torch.cat(pieces, out=out), mask
    flat = torch.cat(pieces)
    return (flat if on_device else flat.cpu()), mask


def receive_placement(replica_device: torch.device, hosted: bool, direct: bool) -> tuple[torch.device, bool]:
    """Where a holder receives its replica's gradients over the process group, ``(device, pinned)``: on the replica's
    GPU where the transport carries GPU memory to GPU memory (``direct``) and the replica lives there (no detour
    through host memory); in pinned host memory for a replica kept there on a GPU machine (``hosted``: its update
    copies them to the GPU a layer at a time, asynchronously from pinned memory); else in host memory."""
    if direct and replica_device.type == "cuda" and not hosted:
        return replica_device, False
    return torch.device("cpu"), hosted


def offers_shared_memory(direct: bool, replica_on_gpu: bool) -> bool:
    """Whether a holder offers its owner a shared host buffer for the gradients (rule 3): not where both ends are
    GPUs that the transport connects directly (through host memory would be the detour)."""
    return not (direct and replica_on_gpu)


def set_flat_grads(module: nn.Module, flat: torch.Tensor, mask: torch.Tensor) -> None:
    offset = 0
    params = [p for p in module.parameters() if p.requires_grad]
    for param, has in zip(params, mask.tolist(), strict=True):
        n = param.numel()
        # a view of the received buffer (no copy) where device and dtype already match
        param.grad = flat[offset : offset + n].view_as(param).to(param.device, param.dtype) if has else None
        offset += n


#: the gradients travel over the process group in chunks of whole parameters of at least this many
#: elements (1 MiB of fp32); sender and receiver derive the same chunks, and tags, from their layers
CHUNK_NUMEL = 1 << 18
#: the size of an offer message (JSON of a host identity, token and shared-memory handle)
OFFER_BYTES = 1024
#: bytes after the mask: the token of the shared buffer this step's gradients are in, then the next step's (0: none)
_HEADER = 16


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


class OwnerEnd:
    """The owner's end of the exchange: ships this stage's gradients to its replica holder, rank ``holder``.

    Over the process group, each ship sends the gradients in chunks (rules 1-2); from the third ship on, if the
    holder's offer could be mapped here, it writes them into the halves of the holder's shared buffer by turns,
    or had them accumulate there (``write_ahead``), and sends only the header (rules 3-5).
    """

    def __init__(self, holder: int, group: Any) -> None:
        self.holder, self.group = holder, group
        self._sent: tuple[tuple[torch.Tensor, ...], list[Any]] = ((), [])  # buffers kept alive, requests
        self._send_buffer: torch.Tensor | None = None  # reused step after step (over the process group)
        # the holder's offer being received, then its mapped buffer and first half's token, and the half written next
        self._offer_in: tuple[torch.Tensor, Any] | None = None
        self._offer_answered = False
        self._peer_shared: tuple[torch.Tensor, int] | None = None
        self._half = 0
        # per half, the "read" awaited: (message, token it must name, receive or None while not posted: it is
        # posted where the step waits, off the critical path)
        self._reads: list[tuple[torch.Tensor, int, Any] | None] = [None, None]
        self._written: int | None = None  # the half the gradients were written ahead into (``write_ahead``)
        self.ships_written_ahead = 0  # ships whose gradients were in the shared half already
        # whether the optimizer's step leaves its gradients as they are and lets go of them (None: not seen yet,
        # ``stepped``), and the gradients of the last ship through shared memory with their versions
        self.grads_left_alone: bool | None = None
        self._shipped_grads: tuple[bool, list[tuple[torch.Tensor, torch.Tensor, int]]] = (False, [])

    @property
    def through_shared_memory(self) -> bool:
        """Whether the gradients go to the holder through shared memory (from the next ship on)."""
        return self._peer_shared is not None

    @property
    def next_half(self) -> torch.Tensor | None:
        """The half of the holder's shared buffer that the next ship writes; None over the process group."""
        return self._peer_half(self._half)[0] if self._peer_shared is not None else None

    def post_reads(self) -> None:
        """Post the receives of the holder's offer (once) and of its "read"s awaited (where the step waits)."""
        if self._offer_in is None and not self._offer_answered:
            message = torch.zeros(OFFER_BYTES, dtype=torch.uint8)
            self._offer_in = (message, dist.irecv(message, self.holder, group=self.group, tag=OFFER_TAG))
        for half in (0, 1):
            self._post_read(half)

    def ship(self, own: nn.Module) -> None:
        """Send ``own``'s (final) gradients without waiting (the ship before's are waited for first)."""
        self._finish_requests()
        self._take_offer(sum(p.numel() for p in own.parameters() if p.requires_grad))  # rule 3, at the first ship
        shared = self._peer_half(self._half) if self._peer_shared is not None else None
        written, self._written = self._written == self._half, None
        if shared is not None and written:  # the gradients are in the half already, but those begun since
            flat, mask = shared[0], _complete_written(own, shared[0])
            self.ships_written_ahead += 1
        else:
            if shared is not None:
                self._wait_read(self._half)  # rule 4: the holder read what this half held two ships ago
            flat, mask = flat_grads(own, out=shared[0] if shared is not None else self._send_buffer,
                                    on_device=shared is None and gpu_direct())
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
            requests = [dist.isend(flat[start:end], self.holder, group=self.group, tag=CHUNK_TAGS + index)
                        for index, (_, _, start, end) in enumerate(chunk_plan(numels))]
        following = self._peer_half(self._half)[1] if self._peer_shared is not None else 0
        message = _header(mask, shared[1] if shared is not None else 0, following)
        requests.append(dist.isend(message, self.holder, group=self.group, tag=HEADER_TAG))
        self._sent = ((message, flat), requests)

    def write_ahead(self, own: nn.Module) -> None:
        """Where the step waits before its last backward: write ``own``'s gradients so far into the shared half the
        next ship sends, and make them views of it.

        The last backward then accumulates straight into shared memory (in place, as into any gradient), and the
        ship, on the critical path, copies nothing but the gradients that backward began. Only once the
        optimizer was seen to leave its gradients as they are and set them to None (``stepped``, rule 5): the
        holder reads them there during the next step.
        """
        if self._peer_shared is None or self._written is not None or not self.grads_left_alone:
            return
        half = self._peer_half(self._half)[0]
        params = [p for p in own.parameters() if p.requires_grad]
        if not params or any(p.device.type != "cpu" or p.dtype != half.dtype for p in params):
            return  # (on a GPU, or in another dtype: the ship gathers them to the host as before)
        self._wait_read(self._half)  # rule 4: the holder read what this half held two ships ago
        _, mask = flat_grads(own, out=half)
        set_flat_grads(own, half, mask)  # views of the half (None stays None)
        self._written = self._half

    def stepped(self) -> None:
        """After the optimizer's step of gradients shipped through shared memory: whether it left them as they
        were and set them to None (``write_ahead`` needs both: the holder reads them during the next step).

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
                f"were shared with the replica holder (rank {self.holder}), which reads them during the next step: "
                "its replica would drift. Rule: step() must leave p.grad unchanged and zero_grad() must set it to "
                "None (torch's default), as this optimizer did in the steps before. Fix: use such an optimizer, or "
                "redundancy='off'"
            )
        if self.grads_left_alone is None or not left_alone:
            if not left_alone:
                log.info("the optimizer writes its gradients in place: they are copied for rank %d at each step",
                         self.holder)
            self.grads_left_alone = left_alone

    def finish(self) -> None:
        """Wait until the last gradients sent are gone (kept alive until then), or read from shared memory."""
        self._finish_requests()
        for half in (0, 1):
            self._wait_read(half)

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
            request = dist.irecv(message, self.holder, group=self.group, tag=READ_TAGS[half])
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
            raise RuntimeError(f"rank {self.holder} acknowledged shared buffer {int(message[0].item())}, not "
                               f"{token}: the gradient exchange is out of step")

    def _take_offer(self, numel: int) -> None:
        """The holder's offer, taken at the first ship: the holder sent it at its first wait of the first step, and
        its first wait never depends on this ship. Its buffer is mapped if it is on this host."""
        if self._offer_answered:
            return
        if self._offer_in is None:
            self.post_reads()
        assert self._offer_in is not None
        message, request = self._offer_in
        request.wait()
        self._offer_answered = True
        size = int(message[:4].view(torch.int32).item())
        if not size:
            return  # the holder has no shared memory to offer
        mapped = map_offered_buffer(message[4 : 4 + size].numpy().tobytes(), 2 * numel)
        if mapped is not None:  # else another machine, other layers or no access: the process group carries them
            self._peer_shared = mapped

    def _finish_requests(self) -> None:
        (_buffers, requests), self._sent = self._sent, ((), [])
        wait_all(requests)


class HolderEnd:
    """The replica holder's end of the exchange: takes the owner's (rank ``owner``) gradients into ``replica``.

    It posts the receive where the step first waits, so the gradients travel while this stage still runs its
    last backward; it offers a shared buffer once (rule 3), reads the gradients where the owner wrote them, and
    answers "read" for a half once the replica's update used it (rule 4).
    """

    def __init__(self, replica: Replica, owner: int, group: Any) -> None:
        self.replica, self.owner, self.group = replica, owner, group
        self._recv: tuple[torch.Tensor, torch.Tensor | None, list[Any]] | None = None
        # over the process group, two buffers to receive into by turns: the replica's gradients of one step are
        # views of one until its deferred update is applied, during the next step
        self._recv_buffers: list[torch.Tensor] = []
        # its shared buffer (two halves) and the first half's token (the second's is one more), the offer in
        # flight, whether the owner writes there (None: not known until the first header, rule 3)
        self._shared: tuple[torch.Tensor, int] | None = None
        self._offer: tuple[torch.Tensor, Any] | None = None
        self._owner_writes_shared: bool | None = None
        # per half, the last "read" sent (kept alive until it is gone: the owner receives it at its next ship
        # into that half at the latest, which comes after the gradients it reads now)
        self._read_sent: list[tuple[torch.Tensor, Any] | None] = [None, None]
        self._unread: int | None = None  # the token of the half the replica's gradients are views of

    @property
    def owner_writes_shared(self) -> bool:
        """Whether the owner writes the next gradients into this holder's shared buffer (the last header said so)."""
        return bool(self._owner_writes_shared)

    @property
    def shared_half(self) -> tuple[int, torch.Tensor] | None:
        """The half (0 or 1) of the shared buffer the replica's gradients are views of, and that half, until
        "read" was answered for it; None when they are not in the shared buffer."""
        if self._unread is None or self._shared is None:
            return None
        return self._unread - self._shared[1], self._half_of(self._unread)

    def post_receive(self) -> None:
        """Post the receive of the next gradients (and, once, the offer), if not posted yet."""
        if self._recv is not None:
            return
        params = [p for p in self.replica.module.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in params)
        self._offer_shared(numel)
        if self._shared is None:
            self._owner_writes_shared = False  # nothing offered: every step comes over the process group
        mask = torch.zeros(len(params) + _HEADER, dtype=torch.uint8)
        requests = [dist.irecv(mask, self.owner, group=self.group, tag=HEADER_TAG)]
        # through shared memory the replica reads the owner's buffer: no receive buffer; not known yet (the first
        # step): the chunks' receives are posted once the header said they come (rule 3)
        flat = self._post_chunks(params, requests) if self._owner_writes_shared is False else None
        self._recv = (mask, flat, requests)

    def _post_chunks(self, params: list[nn.Parameter], requests: list[Any]) -> torch.Tensor:
        """Post the receives of the gradients' chunks (over the process group) into a receive buffer; the buffer."""
        flat = self._receive_buffer(sum(p.numel() for p in params))
        for index, (_, _, start, end) in enumerate(chunk_plan(p.numel() for p in params)):
            requests.append(dist.irecv(flat[start:end], self.owner, group=self.group, tag=CHUNK_TAGS + index))
        return flat

    def receive(self) -> None:
        """Wait for the replica's gradients and hand them to it (``replica.pending``)."""
        if self._recv is None:
            return
        self.replica.settle()  # the last step's update, if still due, runs while the gradients travel
        self.acknowledge()  # rule 4: the owner's ship waits for it before it sends what this waits for
        message, received, requests = self._recv
        self._recv = None
        wait_all(requests)
        this, following = _tokens(message)
        if not this and received is None and self._owner_writes_shared is None:  # the first step's, over the group
            chunks: list[Any] = []
            received = self._post_chunks([p for p in self.replica.module.parameters() if p.requires_grad], chunks)
            wait_all(chunks)
        own = (self._shared[1], self._shared[1] + 1) if self._shared is not None else ()
        if {this, following} - {0, *own} or (received is None) != bool(this):
            raise RuntimeError(f"the replica's gradients name shared buffer {this or following} (expected "
                               f"{'one of ' + str(own) if received is None else 0}; this holder offered {own}): the "
                               f"gradient exchange is out of step with rank {self.owner}")
        if this:
            # Read where the owner wrote them, no copy: "read" is answered once the replica's update used them.
            received, self._unread = self._half_of(this), this
        self._owner_writes_shared = bool(following)  # rule 5: both ends switch at the step the header names
        assert received is not None  # (checked above)
        set_flat_grads(self.replica.module, received, message[:-_HEADER])
        self.replica.pending = True

    def acknowledge(self) -> None:
        """Answer "read" for the gradients in a half of the shared buffer once the replica's update has used them
        (the owner writes that half again only then, at its ship after next)."""
        if self._unread is None or self.replica.pending or self.replica.due:
            return
        assert self._shared is not None
        half = self._unread - self._shared[1]
        sent = self._read_sent[half]
        if sent is not None:  # the "read" two steps ago: the owner took it at the ship of what was just read
            sent[1].wait()
        read = torch.tensor([self._unread], dtype=torch.int64)
        self._unread = None
        self._read_sent[half] = (read, dist.isend(read, self.owner, group=self.group, tag=READ_TAGS[half]))

    def finish(self) -> None:
        """Wait until the "read"s sent are gone."""
        for half in (0, 1):
            sent, self._read_sent[half] = self._read_sent[half], None
            if sent is not None:
                sent[1].wait()

    def _receive_buffer(self, numel: int) -> torch.Tensor:
        held = {p.grad.untyped_storage().data_ptr() for p in self.replica.module.parameters() if p.grad is not None}
        device, pinned = receive_placement(self.replica.device, self.replica.hosted, gpu_direct())
        self._recv_buffers = [b for b in self._recv_buffers if b.numel() == numel and b.device == device]
        # one that no gradient of the replica is a view of; else a new one (at most two are kept)
        buffer = next((b for b in self._recv_buffers if b.untyped_storage().data_ptr() not in held), None)
        if buffer is None:
            buffer = torch.empty(numel, device=device, pin_memory=pinned)
            self._recv_buffers = [*self._recv_buffers[-1:], buffer]
        return buffer

    def _offer_shared(self, numel: int) -> None:
        """Once: offer the owner a shared buffer for the gradients (it takes it if it runs on this host).

        The owner waits for this message at its first ship (rule 3), so it is always sent: empty when this
        holder has no shared memory to offer.
        """
        if self._offer is not None:
            return
        payload = b""
        if numel and offers_shared_memory(gpu_direct(), self.replica.device.type == "cuda" and not self.replica.hosted):
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
        self._offer = (message, dist.isend(message, self.owner, group=self.group, tag=OFFER_TAG))

    def _half_of(self, token: int) -> torch.Tensor:
        """The half of this holder's shared buffer that ``token`` names."""
        assert self._shared is not None
        buffer, first = self._shared
        return _half(buffer, token - first)


class GradientExchange:
    """One stage's exchange: ship its gradients to ``send_to`` (its ``owner`` end, the holder of its replica),
    take the replica's from ``recv_from`` (its ``holder`` end, the owner of the stage it holds).

    The two ends are independent (each has its own peer, messages and buffers); this is the engine's one door
    to both, at the points of its step: ``post_receive`` where the step waits, ``write_ahead`` before the last
    backward, ``ship`` at its end, ``receive`` after the loss went out, ``owner_stepped`` and ``acknowledge``
    after the update, ``finish_send`` at the end of training.
    """

    def __init__(self, replica: Replica | None, send_to: int | None, recv_from: int | None, group: Any = None) -> None:
        if recv_from is not None and replica is None:
            raise ValueError(f"receiving replica gradients from rank {recv_from} needs a replica")
        # The group of now, not "the default group" at each call: a step thread a failover left behind
        # must fail on its destroyed group, never post on the new one.
        self.replica, self.send_to, self.recv_from = replica, send_to, recv_from
        self.group = group if group is not None else dist.group.WORLD
        self.owner = OwnerEnd(send_to, self.group) if send_to is not None else None
        self.holder = HolderEnd(replica, recv_from, self.group) if replica is not None and recv_from is not None else None

    def release(self) -> None:
        """Let go of both ends with every buffer they hold, the shared memory's mappings included (a failover:
        this exchange is never used again). A request still in flight keeps what it reads or writes alive."""
        self.owner = self.holder = None

    @property
    def through_shared_memory(self) -> bool:
        """Whether this stage's gradients go to its replica holder through shared memory (from the next ship on)."""
        return self.owner is not None and self.owner.through_shared_memory

    @property
    def ships_written_ahead(self) -> int:
        """Ships whose gradients were in the holder's shared buffer already (``write_ahead``)."""
        return self.owner.ships_written_ahead if self.owner is not None else 0

    @property
    def grads_left_alone(self) -> bool | None:
        """Whether the optimizer leaves the gradients it stepped with alone (None: not seen yet)."""
        return self.owner.grads_left_alone if self.owner is not None else None

    def post_receive(self) -> None:
        """Post what this exchange waits for next: the replica's gradients, and the holder's "read" for the
        gradients last shipped through shared memory (called where the step waits)."""
        if self.owner is not None:
            self.owner.post_reads()
        if self.holder is not None:
            self.holder.post_receive()

    def ship(self, own: nn.Module) -> None:
        """Send ``own``'s (final) gradients without waiting, and make sure the replica's receive is posted."""
        if self.owner is not None:
            self.owner.ship(own)
        if self.holder is not None:
            self.holder.post_receive()  # not the "read" for this ship: that is posted where the next step waits

    def write_ahead(self, own: nn.Module) -> None:
        """Before the last backward: ``own``'s gradients so far into the holder's shared half (``OwnerEnd.write_ahead``)."""
        if self.owner is not None:
            self.owner.write_ahead(own)

    def owner_stepped(self) -> None:
        """After the own optimizer step: whether it left the shipped gradients alone (``OwnerEnd.stepped``)."""
        if self.owner is not None:
            self.owner.stepped()

    def receive(self) -> None:
        """Wait for the replica's gradients and hand them to it (``replica.pending``)."""
        if self.holder is not None:
            self.holder.receive()

    def acknowledge(self) -> None:
        """Answer "read" for the replica's gradients once its update used them (``HolderEnd.acknowledge``); the
        engine calls it where it applied the update."""
        if self.holder is not None:
            self.holder.acknowledge()

    def finish_send(self) -> None:
        """A clean end of both ends (each waits for what the other's peer sends): the last gradients are gone or
        read, and the "read"s this holder sent are gone."""
        if self.owner is not None:
            self.owner.finish()
        if self.holder is not None:
            self.holder.finish()


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
