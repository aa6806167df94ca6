"""The communication process of ``comm_process``: the worker's zygote, and the child it forks per generation.

The zygote imports torch once and forks a child per generation on request; the child forms the
generation's groups (gloo, or NCCL on the worker's GPU: ``comm_cuda``) and runs the operations the
worker sends it (see ``comm_process``). The zygote never initialises CUDA, so a forked child may.
"""

from __future__ import annotations

import datetime
import gc
import math
import mmap
import os
import queue
import signal
import socket
import struct
import threading
import warnings
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import recvfds
from typing import Any

import torch


class UntrustedChannel(RuntimeError):
    """The socket a communication process was given could lead to another process than its own worker's."""


def private_channel(fd: int) -> tuple[socket.socket, Connection]:
    """The socket ``fd`` and a ``Connection`` on it, once it is known to lead only to this user's own process.

    What comes through it is unpickled (``Connection.recv``: the worker's requests and CUDA IPC handles), so it must
    be an unnamed Unix socket (an end of a ``socketpair`` its worker made and passed down: no path or port anyone
    else could connect to) whose peer runs as this user; anything else is refused (``UntrustedChannel``)."""
    sock = socket.socket(fileno=fd)
    named = sock.family != socket.AF_UNIX or bool(sock.getsockname()) or bool(sock.getpeername())
    peer_uid = os.getuid()
    if not named and hasattr(socket, "SO_PEERCRED"):
        _, peer_uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if named or peer_uid != os.getuid():
        sock.detach()
        raise UntrustedChannel(
            f"a communication process unpickles what comes through its socket, so it takes only an unnamed Unix socket "
            f"to a process of its own user (got {sock.family!r}, named: {named}, peer uid {peer_uid}, "
            f"this uid {os.getuid()}); start it through comm_process.CommProcess")
    return sock, Connection(os.dup(fd))


def zygote_main(fd: int) -> None:
    """The worker's zygote: torch imported once; forks a communication process per generation on request.

    A fork of this single-threaded process is safe (a fork of the worker, which runs gloo and store
    threads, would not be). A forked child serves its generation and ends with ``leave_without_teardown`` (no teardown);
    the zygote itself ends when the worker's end of the socket closes.
    """
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel: no zombies to wait for
    # Everything here so far is torch's import, kept for the process's life: the exit's full collection need not
    # walk it (at a job's end every node's worker and zygote exit at once; on 2 cores that took seconds, issue 41)
    gc.freeze()
    sock, conn = private_channel(fd)
    try:
        conn.send("up")
    except OSError:  # the worker ended while torch was imported
        return
    while True:
        try:
            conn.recv()  # trusted: its worker, through private_channel
            (child_fd,) = recvfds(sock, 1)
        except (EOFError, OSError):
            return  # the worker closed its end: it exits
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            sock.close()
            conn.close()
            _child_main(child_fd)
            from lightning_bamboo.membership.teardown import leave_without_teardown

            leave_without_teardown(flush=True)  # it ran no worker code; nobody reads its status (SIGCHLD ignored)
        os.close(child_fd)
        try:
            conn.send(pid)
        except OSError:
            return


def _child_main(fd: int) -> None:
    """A forked communication process: told which generation to serve, serves it."""
    sock, conn = private_channel(fd)
    try:
        conn.send("up")
        start = conn.recv()  # trusted: its worker, through private_channel
    except (EOFError, OSError):  # never used: the worker ended
        return
    if start is None:
        return
    host, port, prefix, timeout, transport, device = start
    _serve(host, port, prefix, timeout, conn, sock, transport, device)


def _serve(host: str, port: int, prefix: str, timeout: float, conn: Any, sock: socket.socket, transport: str,
           device: int | None) -> None:
    """The child: the generation's groups; each operation runs on its channel's thread, its outcome goes back."""
    import torch.distributed as dist

    from lightning_bamboo.engine.comm_cuda import ChannelStream, NcclGroup, open_shared, tag_lane

    tcp = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=timeout))
    groups: dict[int, dict[str, Any]] = {}
    slabs: dict[int, torch.Tensor] = {}
    send_lock = threading.Lock()

    def reply(op_id: int, outcome: str | None) -> None:
        with send_lock:
            conn.send((op_id, outcome))

    def form(op_id: int, gid: int, name: str, rank: int, size: int) -> None:
        entry = groups[gid]
        try:
            store = dist.PrefixStore(f"{prefix}/{name}", tcp)
            if transport == "nccl":
                assert device is not None
                entry["pg"] = NcclGroup(store, rank, size, timeout, device)
            else:
                entry["pg"] = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=timeout))
            outcome = None
        except Exception as err:  # noqa: BLE001 - the caller's wait raises it
            outcome = entry["error"] = f"{type(err).__name__}: {err}"
        entry["ready"].set()
        reply(op_id, outcome)

    def start(gid: int, op: str, tensors: list[torch.Tensor], args: tuple) -> Any:
        entry = groups[gid]
        entry["ready"].wait()
        if entry["error"] is not None:
            raise RuntimeError(f"the group did not form: {entry['error']}")
        return _start(entry["pg"], op, tensors, args)

    def finish(stream: ChannelStream, op_id: int, work: Any, later: tuple | None) -> None:
        try:
            if later is not None:  # NCCL, or its group was still forming when it came: start it now
                work = start(*later)
            stream.wait(work)
            outcome = None
        except Exception as err:  # noqa: BLE001 - the caller's wait raises it
            outcome = f"{type(err).__name__}: {err}"
        reply(op_id, outcome)

    # Gloo: operations start in the order they come, as in the caller's own process (gloo matches sends
    # and receives by peer and tag in that order; collectives queue in it). Their completions are waited
    # for by one thread per channel, in order: a channel is a group's collectives, or its sends to (or
    # receives from) one peer with one tag.
    # NCCL: a channel is a group's collectives, or its sends to (receives from) one peer on one lane
    # (``comm_cuda.lane_of``), and each operation starts in its channel's thread, after the one before it:
    # a lane's order is kept, and the first message of a lane, which forms its communicator and waits
    # until the peer's first message on it forms it too, holds up only its own lane (two ranks that first
    # use two lanes in opposite orders would otherwise each wait in the other's).
    channels: dict[tuple, queue.SimpleQueue] = {}

    def channel_key(gid: int, op: str, args: tuple) -> tuple:
        if op not in ("send", "recv"):
            return (gid, "collective")
        if transport == "nccl":
            return (gid, op, args[0], tag_lane(args[1]))
        return (gid, op, *args)

    def channel(jobs: queue.SimpleQueue) -> None:
        if transport == "nccl":
            torch.cuda.set_device(device)
        stream = ChannelStream(device if transport == "nccl" else None)
        while True:
            finish(stream, *jobs.get())

    reply(-1, None)  # connected to the store: ready
    while True:
        try:
            request = conn.recv()  # trusted: its worker, through private_channel
        except (EOFError, ConnectionResetError):  # the caller died or exited (a clean close sends None): nothing
            # more to do, nobody to tell
            # its groups' threads die with the interpreter, and torch's C++ says so ("terminate called without an
            # active exception") on the stderr of a node that is already gone: not a message for the user
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
            return
        if request is None:
            return
        if request[0] == "drop":  # idle buffers the worker dropped (``CommProcess.trim``): no operation uses them
            for sid in request[1]:
                slabs.pop(sid, None)
            continue
        if request[0] == "group":
            _, op_id, gid, name, rank, size = request
            groups[gid] = {"ready": threading.Event(), "pg": None, "error": None}
            threading.Thread(target=form, args=(op_id, gid, name, rank, size), daemon=True).start()
            continue
        _, op_id, gid, op, specs, args, new_slabs = request
        if new_slabs:  # GPU memory: its CUDA IPC handle; host memory: file descriptors right after the request
            count = sum(payload is None for _, _, payload in new_slabs)
            fds = iter(recvfds(sock, count) if count else [])
            for sid, size, payload in new_slabs:
                slabs[sid] = map_memory(next(fds), size) if payload is None else open_shared(payload)
        tensors = [view_of(slabs[sid], dtype, shape) for sid, dtype, shape in specs]
        key = channel_key(gid, op, args)
        jobs = channels.get(key)
        if jobs is None:
            jobs = channels[key] = queue.SimpleQueue()
            threading.Thread(target=channel, args=(jobs,), daemon=True).start()
        work, later = None, None
        if groups[gid]["ready"].is_set() and transport != "nccl":
            try:
                work = start(gid, op, tensors, args)
            except Exception as err:  # noqa: BLE001 - reported when its turn comes
                work = _Failed(err)
        else:
            later = (gid, op, tensors, args)
        jobs.put((op_id, work, later))
        del tensors, work, later  # its channel holds them until it is done: a dropped buffer's view goes with it


class _Failed:
    """An operation that could not start: its wait raises why."""

    def __init__(self, err: Exception) -> None:
        self.err = err

    def wait(self) -> None:
        raise self.err


def _start(group: Any, op: str, tensors: list[torch.Tensor], args: tuple) -> Any:
    """Start ``op`` on ``group`` (a gloo group, or a ``comm_cuda.NcclGroup``); returns its work."""
    import torch.distributed as dist

    from lightning_bamboo.engine.comm_cuda import NcclGroup

    nccl = isinstance(group, NcclGroup)
    if op in ("send", "recv"):  # NCCL: the lane's own communicator, in which order alone matches
        pg, tag = (group.for_message(op, *args), 0) if nccl else (group, args[1])
        return pg.send(tensors, args[0], tag) if op == "send" else pg.recv(tensors, args[0], tag)
    if op == "barrier" and nccl:
        return group.barrier()
    pg = group.pg if nccl else group
    if op == "allreduce":
        reduce = dist.AllreduceOptions()
        reduce.reduceOp = getattr(dist.ReduceOp, args[0])
        return pg.allreduce(tensors, reduce)
    if op == "broadcast":
        broadcast = dist.BroadcastOptions()
        broadcast.rootRank, broadcast.rootTensor = args[0], 0
        return pg.broadcast(tensors, broadcast)
    if op == "allgather":  # tensors: the input, then one output per rank
        return pg.allgather([tensors[1:]], [tensors[0]])
    if op == "allgather_base":  # tensors: the input, then the output
        return pg._allgather_base(tensors[1], tensors[0])
    if op == "barrier":
        return pg.barrier()
    raise ValueError(f"unknown operation {op!r}")


def new_memory_file(name: str, size: int) -> tuple[torch.Tensor, int]:
    """A new memory file of ``size`` bytes, mapped as a uint8 tensor, and its descriptor (the caller closes it)."""
    fd = os.memfd_create(name)
    try:
        os.ftruncate(fd, size)
        return map_memory(os.dup(fd), size), fd
    except BaseException:
        os.close(fd)
        raise


def map_memory(fd: int, size: int) -> torch.Tensor:
    """A memory file's ``size`` bytes as a uint8 tensor (the mapping outlives the descriptor)."""
    try:
        memory = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "non-writable buffer": an mmap is writable
        return torch.frombuffer(memory, dtype=torch.uint8)


def remove_pages(slab: torch.Tensor) -> bool:
    """Free the pages of a mapped memory file's ``slab`` (``madvise(MADV_REMOVE)``: in every process that maps it);
    the mapping stays and reads zeros until written. False where the system refuses."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    done = libc.madvise(ctypes.c_void_p(slab.data_ptr()), ctypes.c_size_t(slab.numel() * slab.element_size()),
                        mmap.MADV_REMOVE)
    return done == 0


def view_of(slab: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    nbytes = math.prod(shape) * dtype.itemsize
    return slab[:nbytes].view(dtype).view(shape)
