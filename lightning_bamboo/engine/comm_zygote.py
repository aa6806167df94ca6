"""The communication processes' *zygote*: a process that imported torch and does nothing else, and forks a
communication process (``comm_process.CommProcess``) in milliseconds whenever a generation needs one.

A plain ``python`` (2 s of a core to import torch), or, for a worker forked from a preloaded interpreter
(``launcher.forks``), a fork of that worker taken before it runs anything. Never a fork of a worker running gloo
or store threads, never a re-import of the user's main module (``multiprocessing``'s way).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import sendfds
from typing import Any

from lightning_bamboo.errors import BambooError
from lightning_bamboo.membership.teardown import leave_without_teardown


class ZygoteDied(BambooError, RuntimeError):
    """No communication process could be started: the zygote died twice."""


class Child:
    """A communication process forked by the zygote (not this process's child: the zygote reaps it)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def alive(self) -> bool:
        from lightning_bamboo.membership.node import process_alive

        return process_alive(self.pid)

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


_ZYGOTE: dict[str, Any] = {"proc": None}
_ZYGOTE_LOCK = threading.Lock()


def prepare(fork: bool = False) -> None:
    """Start this worker's zygote now (its torch import takes seconds), so the first generation need not wait.

    ``fork``: as a fork of this process, for a caller at the top of a new worker (``launcher.forks``): one thread,
    no CUDA, nothing opened yet, and a stack whose unwinding ends the process, so the children it forks leave
    through ``SystemExit`` without running any worker's code on the way; the zygote itself, which ran nothing but
    forks, ends with ``leave_without_teardown`` (no teardown of the heap it shares with the worker)."""
    with _ZYGOTE_LOCK:
        _start_zygote(fork)


class _ForkedZygote:
    """The zygote as a fork of this process (its child: waited for here), with the ``Popen`` calls used on it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: gone all the same
                self.returncode = -1
            else:
                self.returncode = os.waitstatus_to_exitcode(status) if pid else None
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def wait(self) -> int | None:
        while self.poll() is None:
            time.sleep(0.01)
        return self.returncode


def _start_zygote(fork: bool = False) -> tuple[subprocess.Popen | _ForkedZygote, socket.socket, Connection, list[bool]]:
    zygote = _ZYGOTE["proc"]
    if zygote is None or zygote[0].poll() is not None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        proc: subprocess.Popen | _ForkedZygote
        if fork:
            from lightning_bamboo.engine.comm_child import zygote_main

            pid = os.fork()
            if pid == 0:  # the zygote; its children leave through SystemExit, up the caller's stack (``prepare``)
                mine.close()
                zygote_main(theirs.fileno())
                leave_without_teardown(flush=False)  # the zygote itself ran nothing but forks
            proc = _ForkedZygote(pid)
        else:
            code = f"from lightning_bamboo.engine.comm_child import zygote_main; zygote_main({theirs.fileno()})"
            proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),), close_fds=True)
        theirs.close()
        zygote = _ZYGOTE["proc"] = (proc, mine, Connection(os.dup(mine.fileno())), [False])
    return zygote


def zygote_pid() -> int | None:
    """The pid of this worker's zygote, while it runs (None before the first generation, or after it ended)."""
    zygote = _ZYGOTE["proc"]
    return zygote[0].pid if zygote is not None and zygote[0].poll() is None else None


def fork_child() -> tuple[Child, socket.socket, Connection]:
    """A new communication process from the zygote (started, or started again, if needed)."""
    for _ in range(2):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with _ZYGOTE_LOCK:
                proc, sock, conn, up = _start_zygote()
                try:
                    if not up[0]:
                        conn.recv()  # "up": torch is imported. trusted: its zygote, over a socketpair made here
                        up[0] = True
                    conn.send("fork")
                    sendfds(sock, [theirs.fileno()])
                    pid = conn.recv()  # trusted: its zygote, over a socketpair made here
                except (EOFError, OSError):
                    proc.kill()
                    proc.wait()
                    _ZYGOTE["proc"] = None
                    continue
        finally:
            theirs.close()
        child = Connection(os.dup(mine.fileno()))
        try:
            child.recv()  # "up". trusted: its communication process, over a socketpair made here
        except EOFError:
            continue
        return Child(int(pid)), mine, child
    raise ZygoteDied("a communication process could not be started (its zygote died twice)")
