"""A released node's way back as a standby node in milliseconds: a fork of its worker taken before it ran anything.

A node whose pipeline was dropped comes back as a fresh process of the same command (``node.rejoin_as_standby``):
nothing of the old one (threads blocked on a dead process group, the stage's memory) may survive, and its supervisor
must still see the same process id running. ``exec`` of a new ``python`` does that, at the price of importing torch,
DeepSpeed and Lightning again: 10-12 s at idle priority on a machine whose cores train.

A worker forked from a preloaded interpreter (``launcher.forks``) has those imports already, and for a moment
nothing else: one thread, no CUDA, no group, no store. There, before it runs its command, it forks its *standby
zygote* (:func:`fork_zygote`), a child that waits on a pipe. When the node is released (:func:`hand_over`), the
zygote is told the command and environment of the standby incarnation and becomes it, and the released process
replaces itself (``exec``) by :mod:`lightning_bamboo.membership.proxy`, a ``python`` without site packages that
holds the process id: it forwards every signal it can catch to the standby process, which is its child (so SIGKILL
and SIGSTOP of a worker's descendants reach it too), and ends as it ends, with its status.

A zygote never told ends as soon as its worker does (a pidfd watch, else a poll of its parent), so it outlives no
job: it costs a process that sleeps, pages shared with its worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from lightning_bamboo.membership.teardown import leave_without_teardown

#: seconds between two looks at the parent where no pidfd can watch it
PARENT_POLL_SECONDS = 0.5


@dataclass(frozen=True)
class Zygote:
    """This worker's standby zygote: its process id (this process's child) and the pipe that tells it to go."""

    pid: int
    fd: int


#: this process's standby zygote (``fork_zygote``); None: a released node starts a fresh interpreter
zygote: Zygote | None = None


def fork_zygote(become: Callable[[dict[str, Any]], NoReturn]) -> None:
    """Fork this worker's standby zygote (call it at the top of a new worker: one thread, nothing opened).

    The zygote waits; told to go, it calls ``become(request)`` with the standby incarnation's command (``module``,
    ``script``, ``argv``), environment (``env``) and working directory (``cwd``): ``become`` runs it and leaves
    through ``SystemExit``, up the stack of this call, which ends the process. Not told, it ends with its worker,
    with status 0 and no interpreter teardown (``teardown.leave_without_teardown``: it ran nothing)."""
    global zygote
    read, write = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(write)
        # a terminal's Ctrl-C goes to the whole process group: the zygote leaves with its worker, not with a traceback
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        go = _wait_for_go(read, parent)
        if go is None:  # never told: it ran nothing and holds nothing to flush or hand back
            leave_without_teardown(flush=False)
        os.close(read)
        zygote = None
        if go.get("idle"):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # the main thread: the threads it starts too
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        become(go["request"])
    os.close(read)
    zygote = Zygote(pid, write)


def _wait_for_go(fd: int, parent: int) -> dict[str, Any] | None:
    """The zygote's wait: the message that makes it the standby process, or None once its worker has ended."""
    watch: int | None = None
    with contextlib.suppress(AttributeError, OSError):
        watch = os.pidfd_open(parent)
    if os.getppid() != parent:
        return None
    watched = [fd] if watch is None else [fd, watch]
    received = b""
    while True:
        ready, _, _ = select.select(watched, [], [], PARENT_POLL_SECONDS if watch is None else None)
        if fd in ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            received += chunk
            if b"\n" in received:
                message: dict[str, Any] = json.loads(received.split(b"\n", 1)[0])
                if watch is not None:
                    os.close(watch)
                return message
        elif watch in ready or os.getppid() != parent:
            return None


def command_request(command: Sequence[str]) -> dict[str, Any] | None:
    """``python -m MODULE ARGS`` or ``python SCRIPT ARGS`` (this interpreter, no options) as the zygote runs it; None
    for any other command line (a released node with it starts it with ``exec``)."""
    if len(command) < 2 or command[0] != sys.executable:
        return None
    if command[1] == "-m" and len(command) >= 3:
        return {"module": command[2], "script": None, "argv": list(command[3:])}
    if command[1].startswith("-"):
        return None
    return {"module": None, "script": command[1], "argv": list(command[2:])}


def hand_over(command: Sequence[str], env: Mapping[str, str], idle: bool) -> None:
    """Make this process's standby zygote the node's standby incarnation (``command`` with ``env``, at idle CPU
    priority if ``idle``), and replace this process by the proxy that keeps its process id until that one ends.
    Returns only where it cannot (no zygote, a zygote that is gone, a command it cannot run): the caller then
    starts the command itself."""
    request = command_request(command)
    if zygote is None or request is None:
        return
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(zygote.pid, os.WNOHANG)[0]:  # it ended (killed): reaped, and the caller starts the command
            return
    message = json.dumps({"request": {**request, "env": dict(env), "cwd": os.getcwd()}, "idle": idle}).encode()
    proxy = [sys.executable, "-I", "-S", os.path.join(os.path.dirname(os.path.abspath(__file__)), "proxy.py"),
             str(zygote.pid)]
    # Signals sent from here on wait for the proxy's handlers (the mask lives through exec), which pass them on.
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP})
    try:
        view = memoryview(message + b"\n")
        while view:
            view = view[os.write(zygote.fd, view):]
    except OSError:  # the zygote died meanwhile: the caller starts the command itself
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        return
    try:
        os.execv(proxy[0], proxy)
    except OSError:  # the zygote went: be its proxy in this process (its old threads live on, blocked or idle)
        from lightning_bamboo.membership.proxy import main

        main(zygote.pid)
