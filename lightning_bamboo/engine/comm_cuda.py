"""GPU tensors in the abortable communication layer (``comm_process``): buffers on the GPU, ordering.

Two transports carry a generation's operations (``CommProcess(transport=...)``):

- ``"gloo"``: the communication process runs gloo on host memory; a GPU tensor is copied into a
  shared host buffer before the operation and back after it. Works wherever gloo does (several
  processes sharing one GPU included; NCCL refuses two ranks on one GPU).
- ``"nccl"``: the communication process holds an NCCL communicator on the worker's GPU and runs the
  operations on buffers in GPU memory that the *worker* allocated and shared with it through CUDA
  IPC (the worker owns them: when the communication process is killed, nothing the worker uses
  goes with it). A host tensor (a message of the replica exchange) is staged through them too.

Ordering across the two processes is made explicit at the two hand-overs: the worker waits for its
copies into a buffer (its current stream) before the communication process may read it; the
communication process waits for the NCCL kernel on a stream of the operation's channel before it
reports the operation done; the worker's copies out of a buffer are waited for before the buffer is
lent again. A receive blocked on a lost peer blocks only its channel's stream, so the abort (a kill
of the communication process) releases it and the communicator's GPU memory at once.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Mapping, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

TRANSPORTS = ("gloo", "nccl")
_MIN_SLAB = 4096


#: size classes per doubling of the transfer buffers (``size_class``): a buffer is at most 1/8 larger than its message
_CLASSES_PER_DOUBLING = 8


def size_class(nbytes: int) -> int:
    """The size of the buffer a message of ``nbytes`` is lent: at least 4 KiB, else ``nbytes`` rounded up to an
    eighth of its power of two (a 65 MiB message gets 72 MiB, not 128)."""
    if nbytes <= _MIN_SLAB:
        return _MIN_SLAB
    step = (1 << ((nbytes - 1).bit_length() - 1)) // _CLASSES_PER_DOUBLING
    return -(-nbytes // step) * step


#: the point-to-point tags in use (``engine.exchange``, ``engine.ties``): DeepSpeed's activations and gradients and a
#: failover's layers (0), the tied gradients, the replica exchange's "read"s, offer and header, and from
#: ``CHUNK_TAGS`` on its chunks, one tag each
PIPELINE_TAG, TIE_TAG, READ_TAGS, OFFER_TAG, HEADER_TAG = 0, 0xA0, (0xAE, 0xAD), 0xAF, 0xB0
CHUNK_TAGS = HEADER_TAG + 1
#: the NCCL lanes' tags (``lane_of``): one per tag above, and one for every chunk; each in two directions
LANES = (PIPELINE_TAG, TIE_TAG, *READ_TAGS, OFFER_TAG, HEADER_TAG, CHUNK_TAGS)


def tag_lane(tag: int) -> int:
    """The tag a lane is named by: ``tag``'s own, or ``CHUNK_TAGS`` for every chunk of the replica's gradients."""
    return CHUNK_TAGS if tag >= CHUNK_TAGS else tag


def lane_of(tag: int, src: int, dst: int) -> tuple[int, int]:
    """The lane a message of ``tag`` from rank ``src`` to ``dst`` travels on under NCCL: its tag's (the chunks of the
    replica exchange's gradients share one: both ends post them in chunk order) and its direction (0: to the higher
    rank, 1: to the lower).

    NCCL runs the messages of one communicator between two ranks one after another, in the order each rank posted
    them, and a large send waits for its receive. A lane that carried both directions would need both ranks to post
    them interleaved alike (in a 2-stage ring each node owns a stage and holds the other's replica: both post a
    header receive first, and would wait for each other); a lane of one direction needs only that the receiver posts
    its receives in the order the sender posted the sends, which is gloo's matching by tag wherever a lane's tags
    come in one order (``lane_mismatches`` checks a gloo run's trace for it)."""
    return tag_lane(tag), int(src > dst)


def lane_mismatches(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Where NCCL would pair other messages than gloo did in the run ``records`` trace, or wait for ever
    (``CommProcess``'s, ``$BAMBOO_COMM_TRACE``: each process's sends and receives in the order it posted them, with
    ``gen``, ``group``, ``rank``, ``op``, ``peer``, ``tag`` and ``bytes``).

    Gloo pairs a send with the receive of its peer and tag, and a send does not wait for its receive. NCCL runs the
    messages of two ranks on one lane (``lane_of``) one after the other, in the order each rank posted them, and a
    large send waits for its receive: so per generation, group, pair of ranks and lane, each message must face its
    receive at the same place in the other rank's order (same tag, same bytes), as far as both go (a receive posted
    for a step that never came, or messages cut short by a failover, end one of them early)."""
    orders: dict[tuple, list[tuple[str, int, int]]] = {}
    for r in records:
        rank, peer = int(r["rank"]), int(r["peer"])
        src, dst = (rank, peer) if r["op"] == "send" else (peer, rank)
        orders.setdefault((r["gen"], r["group"], rank, peer, lane_of(int(r["tag"]), src, dst)), []).append(
            (str(r["op"]), int(r["tag"]), int(r["bytes"])))
    facing = {"send": "recv", "recv": "send"}
    found = []
    for key in sorted(orders, key=str):
        gen, group, rank, peer, lane = key
        theirs = orders.get((gen, group, peer, rank, lane), [])
        if rank > peer and theirs:
            continue  # the pair was looked at from the lower rank
        for place, (mine, other) in enumerate(zip(orders[key], theirs, strict=False)):  # as far as both go
            if (facing[mine[0]], *mine[1:]) != other:
                found.append(f"{gen} {group} ranks {rank} and {peer}, lane {lane[0]:#x} direction {lane[1]}: message "
                             f"{place} is (op, tag, bytes) {mine} on {rank}, {other} on {peer}")
                break
    return found


class SlabPool:
    """Buffers lent to operations by size class (``size_class``); each is shared with the communication process once:
    ``take`` returns how (``_allocate``'s second value) for a new one. A buffer is lent again once its operation is
    done; ``trim`` drops the idle ones of a transfer that will not come again."""

    def __init__(self) -> None:
        self._free: dict[int, list[int]] = {}
        self.tensors: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._next = 0

    def _allocate(self, sid: int, size: int) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    def take(self, nbytes: int) -> tuple[int, torch.Tensor, Any]:
        """A free buffer of at least ``nbytes``: ``(id, tensor, share)``, ``share`` None unless it is new."""
        size = size_class(nbytes)
        with self._lock:
            free = self._free.setdefault(size, [])
            if free:
                sid = free.pop()
                return sid, self.tensors[sid], None
            sid, self._next = self._next, self._next + 1
            self.tensors[sid], share = self._allocate(sid, size)
        return sid, self.tensors[sid], share

    def give(self, sids: list[int]) -> None:
        with self._lock:
            for sid in sids:
                tensor = self.tensors.get(sid)
                if tensor is not None:  # (none after ``release``)
                    self._free[int(tensor.numel())].append(sid)

    def size(self, sid: int) -> int:
        """The bytes of buffer ``sid`` (0 once it was dropped)."""
        with self._lock:
            tensor = self.tensors.get(sid)
            return int(tensor.numel()) if tensor is not None else 0

    @property
    def total_bytes(self) -> int:
        """The bytes of every buffer this pool holds, lent or idle."""
        with self._lock:
            return sum(int(t.numel()) for t in self.tensors.values())

    def trim(self, min_bytes: int) -> tuple[list[int], int]:
        """Drop the idle buffers of ``min_bytes`` or more: their ids (the communication process drops its views of
        them too) and their bytes."""
        dropped, given = [], 0
        with self._lock:
            for size, sids in self._free.items():
                if size >= min_bytes:
                    for sid in sids:
                        self._release(self.tensors.pop(sid))
                        dropped.append(sid)
                        given += size
                    sids.clear()
        return dropped, given

    def _release(self, slab: torch.Tensor) -> None:
        """A dropped buffer's memory goes back once nothing uses it (the communication process dropped its view)."""

    def release(self) -> None:
        """Drop every buffer (the generation ended): each is freed once no operation's view of it is left."""
        with self._lock:
            self._free.clear()
            self.tensors.clear()


class CudaSlabs(SlabPool):
    """Buffers in the worker's GPU memory; each is shared by its CUDA IPC handle (pickled bytes)."""

    def __init__(self, device: torch.device) -> None:
        import torch.multiprocessing  # noqa: F401 - registers the CUDA IPC reductions ForkingPickler uses

        super().__init__()
        self.device = device

    def _allocate(self, sid: int, size: int) -> tuple[torch.Tensor, bytes]:
        slab = torch.empty(size, dtype=torch.uint8, device=self.device)
        return slab, bytes(ForkingPickler.dumps(slab))


def open_shared(payload: bytes) -> torch.Tensor:
    """The communication process's view of a buffer the worker shared (``CudaSlabs.take``)."""
    return pickle.loads(payload)  # trusted: a CUDA IPC handle from its own worker, through comm_child.private_channel


def settle(tensors: list[torch.Tensor]) -> None:
    """Wait for the work queued on the current streams of the GPUs that ``tensors`` live on."""
    for index in sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"}):
        torch.cuda.current_stream(index).synchronize()


class NcclGroup:
    """A group's NCCL side in the communication process, on GPU ``device``.

    Gloo matches a send with its receive by peer *and tag*; NCCL only by order between two ranks. So
    that an exchange whose two ends post different tags in different orders (the replica exchange
    posts its receives before the pipeline's next sends) matches as under gloo, each *lane* in use
    (``lane_of``: a tag, or the range of tags both ends post in one order, in one direction) gets a
    communicator of its own (made at its first send or receive, on both ends alike: a prefix of the
    store per lane). A generation has at most ``2 * len(LANES)`` of them per peer pair, however many
    chunks a replica's gradients travel in. Collectives use the group's first communicator. Each communicator is made at
    its first operation, as torch does by default.
    """

    def __init__(self, store: Any, rank: int, size: int, seconds: float, device: int) -> None:
        import datetime

        import torch.distributed as dist

        torch.cuda.set_device(device)
        self._store, self._rank, self._size = store, rank, size
        self._options = dist.ProcessGroupNCCL.Options()
        self._options._timeout = datetime.timedelta(seconds=seconds)
        self.pg: Any = dist.ProcessGroupNCCL(store, rank, size, self._options)
        self.lanes: dict[tuple[int, int], Any] = {}
        self._lanes_lock = threading.Lock()
        self._scratch = torch.zeros(1, device=f"cuda:{device}")

    def for_message(self, op: str, peer: int, tag: int) -> Any:
        """The communicator of the lane (``lane_of``) of a send to ``peer`` or a receive from it, made at its first
        use."""
        import torch.distributed as dist

        lane = lane_of(tag, self._rank, peer) if op == "send" else lane_of(tag, peer, self._rank)
        with self._lanes_lock:  # channels of several peers share a lane, and start operations from their threads
            pg = self.lanes.get(lane)
            if pg is None:
                store = dist.PrefixStore(f"lane{lane[0]}-{lane[1]}", self._store)
                pg = self.lanes[lane] = dist.ProcessGroupNCCL(store, self._rank, self._size, self._options)
        return pg

    def barrier(self) -> Any:
        return self.pg.allreduce([self._scratch])


class ChannelStream:
    """The stream a channel's operations are waited on, so that an operation blocked on a lost peer
    holds up only its own channel (on the shared default stream it would hold up every channel)."""

    def __init__(self, device: int | None) -> None:
        self.stream = torch.cuda.Stream(device) if device is not None else None

    def wait(self, work: Any) -> None:
        if self.stream is None:
            work.wait()
            return
        with torch.cuda.stream(self.stream):
            work.wait()  # NCCL: this stream waits for the operation's kernels
        self.stream.synchronize()
