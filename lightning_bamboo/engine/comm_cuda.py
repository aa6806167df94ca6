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
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

TRANSPORTS = ("gloo", "nccl")
_MIN_SLAB = 4096


def size_class(nbytes: int) -> int:
    return max(_MIN_SLAB, 1 << max(0, nbytes - 1).bit_length())


class SlabPool:
    """Buffers lent to operations by size class (powers of two, at least 4 KiB); each is shared with the
    communication process once: ``take`` returns how (``_allocate``'s second value) for a new one."""

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

    def trim(self, min_bytes: int) -> int:
        """Give back the memory of the idle buffers of ``min_bytes`` or more where that keeps them usable; the bytes
        given back (none here: see ``_Slabs``)."""
        return 0

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
    return pickle.loads(payload)


def settle(tensors: list[torch.Tensor]) -> None:
    """Wait for the work queued on the current streams of the GPUs that ``tensors`` live on."""
    for index in sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"}):
        torch.cuda.current_stream(index).synchronize()


class NcclGroup:
    """A group's NCCL side in the communication process, on GPU ``device``.

    Gloo matches a send with its receive by peer *and tag*; NCCL only by order between two ranks. So
    that an exchange whose two ends post different tags in different orders (the replica exchange
    posts its receives before the pipeline's next sends) matches as under gloo, each tag in use gets
    a communicator of its own (made at its first send or receive, on both ends alike: a prefix of
    the store per tag). Collectives use the group's first communicator. Each communicator is made at
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
        self._by_tag: dict[int, Any] = {}
        self._scratch = torch.zeros(1, device=f"cuda:{device}")

    def for_tag(self, tag: int) -> Any:
        import torch.distributed as dist

        pg = self._by_tag.get(tag)
        if pg is None:
            store = dist.PrefixStore(f"tag{tag}", self._store)
            pg = self._by_tag[tag] = dist.ProcessGroupNCCL(store, self._rank, self._size, self._options)
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
