"""Communication that can be aborted at once: the backend runs in a process of its own.

A gloo (or NCCL) operation cannot be cancelled from its own process: torch 2.13's ``abort()`` and
``shutdown()`` leave a receive from a frozen peer blocked (``benchmarks/abort.py``,
``docs/comm.md``). Here every process group of a *generation* (the job's group and the groups made
from it with ``new_group``) lives in one child process, a :class:`CommProcess`: the caller's
operations go to it over a pipe, their tensors through shared-memory buffers lent from a pool (each
shared with the child once, so after the first steps a message costs two copies and a pipe message).
:meth:`CommProcess.abort` kills the child; the pipe's end of file then wakes every wait at once with
:class:`CommAborted`, the reader thread ends, and the group's sockets and memory go with the child.

``torch.distributed`` sees it as a backend of its own, :data:`BACKEND` (``"bamboo"``): after
:func:`open_generation` (or with ``MASTER_ADDR``/``MASTER_PORT`` set, as under Lightning), a
``init_process_group(BACKEND, ...)`` makes DeepSpeed's pipeline engine, the replica exchange,
Lightning's collectives and ``new_group`` all use it unchanged. A failover calls
:func:`abort_generation`: every operation of the old generation ends within milliseconds, however
it was blocked, and no thread of it is left.

A child is forked from the worker's *zygote* (``comm_zygote``), which imported torch and does nothing else: a plain ``python``
(2 s of a core to import torch), or, for a worker forked from a preloaded interpreter (``launcher.forks``), a
fork of that worker taken before it runs anything (milliseconds). Never a fork of a worker running gloo or
store threads, never a re-import of the user's main module (``multiprocessing``'s way). A fork of the zygote
costs milliseconds, so a failover's new generation waits for no import, and nothing imports in the background
while the job trains.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.reduction import sendfds
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from lightning_bamboo.engine.comm_child import new_memory_file, remove_pages, view_of
from lightning_bamboo.engine.comm_cuda import TRANSPORTS, CudaSlabs, SlabPool, settle
from lightning_bamboo.engine.comm_zygote import ZygoteDied, fork_child
from lightning_bamboo.errors import BambooError

log = logging.getLogger(__name__)

#: the ``torch.distributed`` backend name of the abortable groups
BACKEND = "bamboo"

_COLLECTIVES = ("allreduce", "broadcast", "allgather", "allgather_base", "barrier")
_OPS = ("send", "recv", *_COLLECTIVES)
#: transfer buffers of this size or more are given back as soon as their operation is done, not kept for the next
#: message of their size: messages that large (a layer's weights and optimizer state in a failover or a move) come
#: once, and their buffer, mapped by the worker and its communication process, held the layer's size again until the
#: next trim (a pipeline's activations, a tied gradient's pieces and the exchange's chunks are far smaller)
ONE_OFF_BYTES = 64 << 20
#: the environment variable that picks the transport of the groups formed through torch's env:// route
TRANSPORT_ENV = "BAMBOO_COMM_TRANSPORT"
#: a folder: each process writes there the sends and receives it posts, in order (``PID.jsonl``), for
#: ``comm_cuda.lane_mismatches`` (a gloo run's messages checked for NCCL's matching)
TRACE_ENV = "BAMBOO_COMM_TRACE"


class CommAborted(BambooError, RuntimeError):
    """The communication process of this generation was aborted (or died): its operations are over."""


# ---------------------------------------------------------------------------------------------
# the caller's side
# ---------------------------------------------------------------------------------------------

class CommWork:
    """One operation in flight; :meth:`wait` returns when it is done, raises if it failed or was aborted."""

    def __init__(self, owner: CommProcess, op_id: int, outputs: list[tuple[torch.Tensor, torch.Tensor]],
                 lent: list[int]) -> None:
        self._owner, self._id = owner, op_id
        self._outputs, self._lent = outputs, lent
        self.done = threading.Event()
        self.error: str | None = None
        self._future: Future | None = None

    def _finish(self, error: str | None) -> None:
        if error is None:
            try:
                with torch.no_grad():  # a target may be a parameter (DeepSpeed broadcasts weights): data, not a graph
                    for staged, target in self._outputs:
                        target.copy_(staged)
                settle([t for pair in self._outputs for t in pair])  # copied before the buffers are lent again
            except Exception as err:  # noqa: BLE001 - the caller's wait raises it; the reader thread goes on
                error = f"the result could not be copied into the caller's tensor: {err!r}"
        self.error = error
        slabs = self._owner._slabs
        slabs.give(self._lent)
        if any(slabs.size(sid) >= ONE_OFF_BYTES for sid in self._lent):
            self._owner.trim(ONE_OFF_BYTES)  # a one-off transfer (a layer in a failover): its buffer goes now
        with self._owner._lock:
            self.done.set()
            future = self._future
        if future is not None:
            self._settle(future)

    def _settle(self, future: Future) -> None:
        if self.error is None:
            future.set_result([target for _, target in self._outputs])
        else:
            future.set_exception(CommAborted(self._message()))

    def _message(self) -> str:
        return f"{self._owner.name}: operation {self._id} ended: {self.error}"

    def wait(self, timeout: float | None = None) -> None:
        if not self.done.wait(timeout):
            raise TimeoutError(f"{self._owner.name}: operation {self._id} not done within {timeout} s")
        if self.error is not None:
            raise CommAborted(self._message())

    def future(self) -> Future:
        future: Future = Future()
        with self._owner._lock:
            if not self.done.is_set():
                self._future = future
                return future
        self._settle(future)
        return future


class _Slabs(SlabPool):
    """Shared host memory (memory files); each is shared by its file descriptor (pass it on, then close it)."""

    def _allocate(self, sid: int, size: int) -> tuple[torch.Tensor, int]:
        return new_memory_file(f"bamboo-comm-{sid}", size)

    def _release(self, slab: torch.Tensor) -> None:
        """Its pages go back to the system now (``MADV_REMOVE``: out of the memory file, so out of the communication
        process too, before it drops its mapping), whatever view of it is left."""
        remove_pages(slab)


class CommProcess:
    """The groups of one generation in a child process (see the module docstring).

    ``host``/``port``: a ``torch.distributed.TCPStore`` the ranks share; ``prefix`` names this
    generation's groups in it (each generation needs its own). With ``rank`` and ``world_size`` the
    job's group ("world") is formed at once; :meth:`group` forms more. ``transport``: ``"gloo"`` (host
    memory; GPU tensors are staged through it) or ``"nccl"`` (on GPU ``device``, default the current
    one); see ``comm_cuda``.
    """

    def __init__(self, host: str, port: int, prefix: str, rank: int | None = None, world_size: int | None = None,
                 timeout: float = 300.0, transport: str = "gloo", device: int | None = None,
                 abort_if: Callable[[], bool] | None = None) -> None:
        self.name = f"comm[{prefix}]" if rank is None else f"comm[{prefix} rank {rank}]"
        self.prefix = prefix
        self._names: dict[int, tuple[str, int]] = {}  # each group's name and this process's rank in it
        self.timeout, self.transport = timeout, transport
        self._slabs: _Slabs | CudaSlabs
        if transport == "nccl":
            if not torch.cuda.is_available():
                raise BambooError("the NCCL transport needs a CUDA GPU, and torch sees none; use transport='gloo'")
            device = torch.cuda.current_device() if device is None else device
            self._slabs = CudaSlabs(torch.device("cuda", device))
        elif transport == "gloo":
            device, self._slabs = None, _Slabs()
        else:
            raise ValueError(f"unknown transport {transport!r}; one of {TRANSPORTS}")
        try:
            self._proc, self._sock, self._conn = fork_child()
        except ZygoteDied as err:
            raise CommAborted(str(err)) from None
        self._conn.send((host, port, prefix, timeout, transport, device))
        self._pending: dict[int, CommWork] = {}
        self._lock = threading.Lock()
        self._next = 0
        self._groups = 0
        self._ended: str | None = None
        # Its connect to the generation's store is waited for in slices: a store whose host was lost meanwhile
        # (a failover inside a failover) would hold it for the whole timeout, twice (torch retries), with the
        # loss already known. ``abort_if`` (a member was lost) or the timeout ends the wait and the child.
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.1):
            lost = abort_if is not None and abort_if()
            if lost or time.monotonic() > deadline:
                self._proc.kill()
                self._conn.close()
                self._sock.close()
                why = "a member was lost" if lost else f"not within {timeout:g} s"
                raise CommAborted(f"{self.name}: the communication process did not reach the store at {host}:{port} "
                                  f"({why})")
        try:
            self._conn.recv()  # trusted: its own communication process, over a socketpair made here
        except EOFError:
            raise CommAborted(f"{self.name}: the communication process died before it reached the store at "
                              f"{host}:{port}") from None
        self._reader = threading.Thread(target=self._read, name=f"{self.name} reader", daemon=True)
        self._reader.start()
        trace = os.environ.get(TRACE_ENV)
        self._trace = open(os.path.join(trace, f"{os.getpid()}.jsonl"), "a", buffering=1) if trace else None  # noqa: SIM115
        self.world = -1
        if rank is not None:
            assert world_size is not None
            self.world = self.group("world", rank, world_size)

    # -- groups --
    def group(self, name: str, rank: int, size: int, abort_if: Callable[[], bool] = lambda: False,
              within: float | None = None) -> int:
        """Form group ``name`` (the same name on each of its ``size`` ranks); returns its handle.

        Waits up to ``within`` seconds (default: the timeout), in slices: when ``abort_if()`` turns true
        (a member was lost), the generation is aborted and ``CommAborted`` raised, so that nobody waits on a
        dead member.
        """
        with self._lock:
            self._check()
            gid, self._groups = self._groups, self._groups + 1
            self._names[gid] = (name, rank)
            work = self._register([], [])
            self._send(("group", work._id, gid, name, rank, size), work._id)
        within = self.timeout if within is None else within
        deadline = time.monotonic() + within
        while not work.done.wait(0.1):
            if abort_if():
                self.abort()
                raise CommAborted(f"{self.name}: a member was lost while group {name!r} formed")
            if time.monotonic() > deadline:
                self.abort()
                raise CommAborted(f"{self.name}: group {name!r} of {size} did not form within {within:g} s")
        work.wait()
        return gid

    # -- operations --
    def send(self, tensor: torch.Tensor, peer: int, tag: int = 0, group: int | None = None) -> CommWork:
        return self.post(self._gid(group), "send", [tensor], [], (peer, tag))

    def recv(self, tensor: torch.Tensor, peer: int, tag: int = 0, group: int | None = None) -> CommWork:
        return self.post(self._gid(group), "recv", [tensor], [0], (peer, tag))

    def allreduce(self, tensor: torch.Tensor, op: str = "SUM", group: int | None = None) -> CommWork:
        """Reduce ``tensor`` over the ranks (``op``: a ``torch.distributed.ReduceOp`` name), in place."""
        return self.post(self._gid(group), "allreduce", [tensor], [0], (op,))

    def _gid(self, group: int | None) -> int:
        gid = self.world if group is None else group
        if gid < 0:
            raise ValueError(f"{self.name}: no group given and no world group formed")
        return gid

    def post(self, gid: int, op: str, tensors: Sequence[torch.Tensor], outputs: Sequence[int],
             args: tuple = ()) -> CommWork:
        """Start ``op`` on group ``gid`` with ``tensors``; those at the indices ``outputs`` are written back."""
        if op not in _OPS:
            raise ValueError(f"unknown operation {op!r}; one of {_OPS}")
        specs, fds, staged, lent = [], [], [], []
        new: list[tuple[int, int, bytes | None]] = []
        # the tensors the operation only writes (a receive's, a gather's outputs) need not be copied in
        write_only = set(outputs) if op in ("recv", "allgather", "allgather_base") else set()
        for index, tensor in enumerate(tensors):
            sid, slab, share = self._slabs.take(tensor.numel() * tensor.element_size())
            lent.append(sid)
            if isinstance(share, int):  # host memory: its file descriptor goes after the request
                new.append((sid, int(slab.numel()), None))
                fds.append(share)
            elif share is not None:  # GPU memory: its CUDA IPC handle
                new.append((sid, int(slab.numel()), share))
            view = view_of(slab, tensor.dtype, tensor.shape)
            if index not in write_only:
                view.copy_(tensor)  # to host memory from a GPU: returns when copied
            staged.append(view)
            specs.append((sid, tensor.dtype, tuple(tensor.shape)))
        if self.transport == "nccl":
            settle(staged)  # the communication process reads them once told to
        try:
            with self._lock:
                if self._ended is not None:
                    self._slabs.give(lent)
                    raise CommAborted(f"{self.name}: {self._ended}")
                work = self._register([(staged[i], tensors[i]) for i in outputs], lent)
                self._send(("op", work._id, gid, op, specs, args, new), work._id, fds)
                if self._trace is not None and op in ("send", "recv"):
                    self._write_trace(gid, op, args, tensors[0])
        finally:
            for fd in fds:
                os.close(fd)
        return work

    def _write_trace(self, gid: int, op: str, args: tuple, tensor: torch.Tensor) -> None:
        assert self._trace is not None
        name, rank = self._names[gid]
        self._trace.write(json.dumps({"gen": self.prefix, "group": name, "rank": rank, "op": op, "peer": args[0],
                                      "tag": args[1], "bytes": tensor.numel() * tensor.element_size()}) + "\n")

    def _register(self, outputs: list[tuple[torch.Tensor, torch.Tensor]], lent: list[int]) -> CommWork:
        op_id, self._next = self._next, self._next + 1
        work = self._pending[op_id] = CommWork(self, op_id, outputs, lent)
        return work

    def _send(self, message: tuple, op_id: int, fds: Sequence[int] = ()) -> None:
        try:
            self._conn.send(message)
            if fds:
                sendfds(self._sock, list(fds))
        except OSError as err:
            del self._pending[op_id]
            raise CommAborted(f"{self.name}: the communication process is gone ({err})") from None

    def _check(self) -> None:
        if self._ended is not None:
            raise CommAborted(f"{self.name}: {self._ended}")

    def _read(self) -> None:
        while True:
            try:
                op_id, outcome = self._conn.recv()  # trusted: its own communication process, over a socketpair made here
            except (EOFError, OSError):
                self._end("the communication process ended (aborted, or it died)")
                return
            with self._lock:
                work = self._pending.pop(op_id, None)
            if work is not None:
                work._finish(outcome)

    def _end(self, why: str) -> None:
        with self._lock:
            self._ended = self._ended or why
            pending, self._pending = self._pending, {}
        for work in pending.values():
            work._finish(why)

    # -- ending --
    def abort(self) -> None:
        """End this generation's groups now: every wait raises ``CommAborted``; no thread is left behind."""
        self._end("aborted")
        self._proc.kill()
        if self._reader is not threading.current_thread():
            self._reader.join()  # the pipe's end of file (the child is gone) ends it
        self._conn.close()
        self._sock.close()
        self._slabs.release()  # the buffers go now, not when the last object of this generation is collected
        if self._trace is not None:
            self._trace.close()

    def trim(self, min_bytes: int = 1 << 20) -> int:
        """Drop the idle transfer buffers of ``min_bytes`` or more, here and in the communication process (host
        memory or GPU memory); the bytes given back."""
        dropped, given = self._slabs.trim(min_bytes)
        if dropped:
            with self._lock:
                if self._ended is None:
                    try:
                        self._conn.send(("drop", dropped))
                    except OSError:
                        pass  # it is gone: so are its views
        if given:
            log.debug("%s: transfer buffers: %d bytes given back, %d kept", self.name, given, self.buffer_bytes)
        return given

    @property
    def buffer_bytes(self) -> int:
        """The bytes of the transfer buffers this generation holds (each mapped in both processes)."""
        return self._slabs.total_bytes

    def close(self) -> None:
        """End the groups when nothing is in flight (the child exits by itself); abort otherwise."""
        with self._lock:
            busy = bool(self._pending)
        if busy or self._ended is not None:
            self.abort()
            return
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._reader.join(10.0)  # it ends when the child has exited
        self.abort()  # kills the child if it did not exit
        self._ended = "closed"

    @property
    def alive(self) -> bool:
        return self._proc.alive()

    @property
    def child_pid(self) -> int:
        """The communication process's pid."""
        return self._proc.pid


# ---------------------------------------------------------------------------------------------
# the torch.distributed backend
# ---------------------------------------------------------------------------------------------

class _Work(dist.Work):
    def __init__(self, work: CommWork) -> None:
        super().__init__()
        self._work = work

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        seconds = None if timeout is None or timeout.total_seconds() <= 0 else timeout.total_seconds()
        self._work.wait(seconds)
        return True

    def is_completed(self) -> bool:
        return self._work.done.is_set()

    def is_success(self) -> bool:
        return self._work.done.is_set() and self._work.error is None

    def get_future(self) -> Future:
        return self._work.future()


class AbortableGroup(dist.ProcessGroup):
    """A ``torch.distributed`` process group whose operations run in the generation's :class:`CommProcess`."""

    def __init__(self, comm: CommProcess, gid: int, rank: int, size: int) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # (the stubs know only the store-first form)
        self.comm, self.gid = comm, gid
        self._rank, self._size = rank, size

    def getBackendName(self) -> str:
        return BACKEND

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def _post(self, op: str, tensors: Sequence[torch.Tensor], outputs: Sequence[int], args: tuple = ()) -> _Work:
        return _Work(self.comm.post(self.gid, op, tensors, outputs, args))

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Work:
        _one(tensors, "send")
        return self._post("send", tensors, [], (dst, tag))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Work:
        _one(tensors, "recv")
        return self._post("recv", tensors, [0], (src, tag))

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:  # type: ignore[override]
        _one(tensors, "allreduce")
        op = "SUM" if opts is None else opts.reduceOp.op.name
        return self._post("allreduce", tensors, [0], (op,))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:  # type: ignore[override]
        _one(tensors, "broadcast")
        return self._post("broadcast", tensors, [0], (0 if opts is None else opts.rootRank,))

    def allgather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]
                  input_tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        _one(input_tensors, "allgather")
        outputs = output_tensors[0]
        return self._post("allgather", [input_tensors[0], *outputs], range(1, len(outputs) + 1))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:
        return self._post("allgather_base", [input, output], [1])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:
        return self._allgather_base(output, input, opts)

    def barrier(self, opts: Any = None) -> _Work:
        return self._post("barrier", [], [])


def _one(tensors: Sequence[torch.Tensor], op: str) -> None:
    if len(tensors) != 1:
        raise ValueError(f"{BACKEND} backend: {op} takes one tensor per call, got {len(tensors)}")


_GENERATION: dict[str, Any] = {"comm": None, "abort_if": lambda: False, "within": None, "transport": None,
                               "device": None}


def use_transport(transport: str, device: torch.device | int | None = None) -> None:
    """The transport (``"gloo"`` or ``"nccl"``, see ``comm_cuda``) and GPU of the generations opened from now on."""
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; one of {TRANSPORTS}")
    index = device.index if isinstance(device, torch.device) else device
    _GENERATION.update(transport=transport, device=index)


def gpu_direct() -> bool:
    """Whether the current generation (or, before one, the next) runs NCCL: a GPU tensor then travels from GPU memory
    to GPU memory (through the transfer buffers in GPU memory), and is best sent from where it is."""
    comm = _GENERATION["comm"]
    transport = comm.transport if comm is not None else _GENERATION["transport"] or os.environ.get(TRANSPORT_ENV)
    return transport == "nccl"


def open_generation(host: str, port: int, prefix: str, timeout: float,
                    abort_if: Callable[[], bool] | None = None) -> CommProcess:
    """Start the communication process of the next generation (the current one is aborted first).

    ``init_process_group(BACKEND, ...)`` and every ``new_group`` after it then form their groups in
    it; ``abort_if``: a check, polled while a group forms, that a member was lost (default: the one
    given to :func:`watch_while_forming`). Its transport: :func:`use_transport`'s, else
    ``$BAMBOO_COMM_TRANSPORT``, else gloo.
    """
    check = abort_if or _GENERATION["abort_if"]
    abort_generation()
    transport = _GENERATION["transport"] or os.environ.get(TRANSPORT_ENV) or "gloo"
    comm = CommProcess(host, port, prefix, timeout=timeout, transport=transport, device=_GENERATION["device"],
                       abort_if=check)
    _GENERATION.update(comm=comm, abort_if=check)
    return comm


def watch_while_forming(abort_if: Callable[[], bool], within: float | None = None) -> None:
    """Poll ``abort_if`` while the groups of the current (or next) generation form: true gives up at once;
    ``within``: the most seconds a group may take to form (default: the group's timeout)."""
    _GENERATION.update(abort_if=abort_if, within=within)


def abort_generation() -> bool:
    """Abort every operation of the current generation at once (a failover's first act); True if there was one."""
    comm = _GENERATION["comm"]
    _GENERATION["comm"] = None
    if comm is None:
        return False
    comm.abort()
    return True


def buffer_bytes() -> int:
    """The bytes of the current generation's transfer buffers (0 without one)."""
    comm = _GENERATION["comm"]
    return comm.buffer_bytes if comm is not None else 0


def communication_pids() -> list[int]:
    """The pids of this worker's communication processes: its zygote's and the current generation's child's."""
    from lightning_bamboo.engine.comm_zygote import zygote_pid

    comm = _GENERATION["comm"]
    return [pid for pid in (zygote_pid(), comm.child_pid if comm is not None else None) if pid is not None]


def trim_buffers(min_bytes: int = 1 << 20) -> int:
    """Give back the memory of the current generation's idle transfer buffers of ``min_bytes`` or more: those of a
    transfer that will not come again (a failover's layers, the first steps' gradients before they go through shared
    memory) would otherwise stay for the rest of the generation. A later transfer of that size gets a new one."""
    comm = _GENERATION["comm"]
    return comm.trim(min_bytes) if comm is not None else 0


def _create(options: Any, backend_options: Any = None) -> AbortableGroup:
    comm = _GENERATION["comm"]
    timeout = options.timeout.total_seconds() if options.timeout is not None else 300.0
    if comm is None and dist.is_initialized():
        raise CommAborted(f"group {options.group_id!r}: this generation's communication was aborted (a failover "
                          "forms the next one)")
    if comm is None:  # the job's first group, formed by torch's env:// rendezvous (Lightning, DeepSpeed)
        try:
            host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        except (KeyError, ValueError):
            raise BambooError(
                f"the {BACKEND!r} backend needs lightning_bamboo.engine.comm_process.open_generation(...) first, "
                "or MASTER_ADDR and MASTER_PORT of the job's TCPStore in the environment") from None
        comm = open_generation(host, port, f"bamboo-comm/{port}", timeout)
    gid = comm.group(options.group_id, options.group_rank, options.group_size, _GENERATION["abort_if"],
                     _GENERATION["within"])
    return AbortableGroup(comm, gid, options.group_rank, options.group_size)


def register_backend() -> None:
    """Make :data:`BACKEND` a ``torch.distributed`` backend (once per process; done on import)."""
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


register_backend()
