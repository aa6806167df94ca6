"""A process group whose operations can be aborted at once: the backend runs in a process of its own.

A gloo (or NCCL) operation cannot be cancelled from its own process: torch 2.13's ``abort()`` and
``shutdown()`` leave a receive from a frozen peer blocked (``benchmarks/abort.py``,
``docs/comm.md``). Here the group lives in a child process, one per generation: the caller's
operations go to it over a pipe, and their tensors are shared with it once (a buffer is named by a
key afterwards, so a message costs what gloo's does). :meth:`CommProcess.abort` kills the child;
the pipe's end of file then wakes every wait at once with :class:`CommAborted`, the reader thread
ends, and the group's sockets and memory go with the child. A failover would abort the old
generation's ``CommProcess`` and start the next one.

Not yet used by the engine: DeepSpeed's pipeline engine and the replica exchange still call
``torch.distributed`` (see ``docs/comm.md``).
"""

from __future__ import annotations

import datetime
import queue
import threading
from typing import Any

import torch

from lightning_bamboo.errors import BambooError

_OPS = ("send", "recv", "allreduce")


class CommAborted(BambooError):
    """The communication process of this generation was aborted (or died): its operations are over."""


def _serve(host: str, port: int, prefix: str, rank: int, world_size: int, timeout: float, conn: Any) -> None:
    """The child: one process group; each request runs on its channel's thread, its completion goes back."""
    import torch.distributed as dist

    store = dist.PrefixStore(prefix, dist.TCPStore(host, port, None, False,
                                                   timeout=datetime.timedelta(seconds=timeout)))
    group: Any = dist.ProcessGroupGloo(store, rank, world_size, datetime.timedelta(seconds=timeout))
    buffers: dict[tuple[int, int, int], torch.Tensor] = {}
    send_lock = threading.Lock()
    conn.send(("ready", None, None))

    def run(op_id: int, op: str, tensor: torch.Tensor, peer: int, tag: int) -> None:
        try:
            if op == "allreduce":
                group.allreduce([tensor]).wait()
            else:
                (group.send if op == "send" else group.recv)([tensor], peer, tag).wait()
            outcome = None
        except Exception as err:  # noqa: BLE001 - the caller's wait raises it
            outcome = f"{type(err).__name__}: {err}"
        with send_lock:
            conn.send(("done", op_id, outcome))

    # one thread per channel (operation kind and peer), fed in order: a channel's operations keep their
    # order, different channels run at the same time, and no thread is started per operation
    channels: dict[tuple[str, int], queue.SimpleQueue] = {}

    def channel(jobs: queue.SimpleQueue) -> None:
        while True:
            run(*jobs.get())

    while True:
        try:
            request = conn.recv()
        except EOFError:  # the caller closed the pipe or died: nothing more to do
            return
        if request is None:
            return
        op_id, op, key, tensor, peer, tag = request
        if tensor is not None:
            buffers[key] = tensor
        jobs = channels.get((op, peer))
        if jobs is None:
            jobs = channels[(op, peer)] = queue.SimpleQueue()
            threading.Thread(target=channel, args=(jobs,), daemon=True).start()
        jobs.put((op_id, op, buffers[key], peer, tag))


class CommWork:
    """One operation in flight; :meth:`wait` returns when it is done, raises if it failed or was aborted."""

    def __init__(self, owner: CommProcess, op_id: int) -> None:
        self._owner, self._id = owner, op_id
        self.done = threading.Event()
        self.error: str | None = None

    def wait(self, timeout: float | None = None) -> None:
        if not self.done.wait(timeout):
            raise TimeoutError(f"{self._owner.name}: operation {self._id} not done within {timeout} s")
        if self.error is not None:
            raise CommAborted(f"{self._owner.name}: operation {self._id} ended: {self.error}")


class CommProcess:
    """A gloo group of ``world_size`` ranks in a child process (see the module docstring).

    ``host``/``port``: a ``torch.distributed.TCPStore`` the ranks share; ``prefix`` names this
    generation's group in it (each generation needs its own).
    """

    def __init__(self, host: str, port: int, prefix: str, rank: int, world_size: int,
                 timeout: float = 300.0) -> None:
        import torch.multiprocessing as tmp

        self.name = f"comm[{prefix} rank {rank}]"
        ctx = tmp.get_context("spawn")
        self._conn, remote = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(host, port, prefix, rank, world_size, timeout, remote),
                                 name=self.name, daemon=False)
        self._proc.start()
        remote.close()
        self._pending: dict[int, CommWork] = {}
        self._shared: dict[tuple[int, int, int], torch.Tensor] = {}
        self._lock = threading.Lock()
        self._next = 0
        self._ended: str | None = None
        try:
            kind, _, _ = self._conn.recv()
        except EOFError:
            self._proc.join()
            raise CommAborted(f"{self.name}: the communication process died while the group formed "
                              f"(exit code {self._proc.exitcode})") from None
        if kind != "ready":
            raise CommAborted(f"{self.name}: unexpected first message {kind!r}")
        self._reader = threading.Thread(target=self._read, name=f"{self.name} reader", daemon=True)
        self._reader.start()

    # -- operations --
    def send(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> CommWork:
        return self._post("send", tensor, peer, tag)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> CommWork:
        return self._post("recv", tensor, peer, tag)

    def allreduce(self, tensor: torch.Tensor) -> CommWork:
        """Sum ``tensor`` over the ranks, in place."""
        return self._post("allreduce", tensor, -1, 0)

    def _post(self, op: str, tensor: torch.Tensor, peer: int, tag: int) -> CommWork:
        if op not in _OPS:
            raise ValueError(f"unknown operation {op!r}; one of {_OPS}")
        if tensor.device.type != "cpu":
            raise ValueError(f"{self.name}: only CPU tensors so far (got {tensor.device})")
        with self._lock:
            if self._ended is not None:
                raise CommAborted(f"{self.name}: {self._ended}")
            key = _key(tensor)
            first = key not in self._shared
            if first:  # once per buffer: a step's buffers are allocated once and reused
                tensor.share_memory_()
                key = _key(tensor)
                self._shared[key] = tensor
            op_id, self._next = self._next, self._next + 1
            work = self._pending[op_id] = CommWork(self, op_id)
            try:
                self._conn.send((op_id, op, key, tensor if first else None, peer, tag))
            except OSError as err:
                del self._pending[op_id]
                raise CommAborted(f"{self.name}: the communication process is gone ({err})") from None
        return work

    def _read(self) -> None:
        while True:
            try:
                kind, op_id, outcome = self._conn.recv()
            except (EOFError, OSError):
                self._end("the communication process ended (aborted, or it died)")
                return
            if kind == "done":
                with self._lock:
                    work = self._pending.pop(op_id, None)
                if work is not None:
                    work.error = outcome
                    work.done.set()

    def _end(self, why: str) -> None:
        with self._lock:
            self._ended = self._ended or why
            pending, self._pending = self._pending, {}
        for work in pending.values():
            work.error = why
            work.done.set()

    # -- ending --
    def abort(self) -> None:
        """End this generation's group now: every wait raises ``CommAborted``; no thread is left behind."""
        self._end("aborted")
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join()
        self._reader.join()  # the pipe's end of file ends it
        self._conn.close()

    def close(self) -> None:
        """End the group when nothing is in flight (the child exits by itself)."""
        with self._lock:
            busy = bool(self._pending)
        if busy:
            self.abort()
            return
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._proc.join(10.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._reader.join()
        self._end("closed")
        self._conn.close()

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()


def _key(tensor: torch.Tensor) -> tuple[int, int, int]:
    return tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()), int(tensor.numel())
