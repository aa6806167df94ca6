"""Workers started as forks of a preloaded interpreter: a node's process in milliseconds instead of seconds.

A worker that starts as ``python -m MODULE`` spends 4-5 s of a core importing torch, DeepSpeed and Lightning
before it runs a line of its own; on a machine whose cores the running nodes share (the demo's local cluster,
a test) every start, every warm process and every replacement costs that again. A :class:`ForkServer` is a
``python`` that imported those modules once, at start, and then only forks: each child becomes the worker,
a process of its own (its own pid, its own output, killed by a real signal like any other), with the
environment, arguments and output files it was given, and runs ``MODULE`` as ``__main__``.

The server is single-threaded (a fork copies no lock held by a thread that is not there) and never
initialises CUDA, so a worker may. A child leaves nothing of the server behind: its signal handlers are the
defaults, it holds only standard input, its own output and what it opens itself, and its Python random state
is fresh. Its exit is the interpreter's own (``SystemExit`` out of the server's loop: the worker's ``atexit``
handlers run, as in a ``python`` of its own). The server reaps its children and reports each exit status
to the process that asked for the fork, where :class:`ForkedProcess` stands for the child with the
``subprocess.Popen`` calls the launcher makes on a worker.

The server dies with the process that started it (``PR_SET_DEATHSIG``); a child whose server is gone is
reported as killed once it has ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import recvfds, sendfds
from typing import IO, Any

from lightning_bamboo.membership.node import die_with_parent, process_alive


class ForkedProcess:
    """A worker forked by a :class:`ForkServer`: not this process's child, so its exit status comes from the server."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self.server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        if self.returncode is None and self.server.lost and not process_alive(self.pid):
            self._exited(-signal.SIGKILL)  # its server is gone, so is it: how it ended is not known
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._ended.wait(0.1 if left is None else min(0.1, left))
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class ForkServer:
    """A ``python`` that imported ``modules`` and forks the workers of ``python -m MODULE`` for each MODULE of ``runs``
    (default: ``modules``, which must then do nothing but define things when imported, as a ``__main__`` guard
    makes sure).

    ``env``: the server's environment (what the modules read when imported, such as ``DS_ACCELERATOR``); each
    worker gets its own. ``accepts(command)`` says whether a command can be forked here; ``start`` forks it.
    """

    def __init__(self, modules: Sequence[str], env: Mapping[str, str], log: int | IO[Any] = subprocess.DEVNULL,
                 runs: Sequence[str] | None = None, scripts: bool = False) -> None:
        """``log``: where the server's own output goes (what the modules print when imported); ``runs``: the
        modules it runs (``("*",)``: any); ``scripts``: it also forks ``python SCRIPT.py ARGS`` (the script run as
        ``__main__``, its directory first on ``sys.path``)."""
        self.modules = tuple(modules)
        self.runs = tuple(self.modules if runs is None else runs)
        self.scripts = scripts
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        code = f"from lightning_bamboo.launcher.forks import serve; serve({theirs.fileno()}, {list(self.modules)!r})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], env=dict(env), pass_fds=(theirs.fileno(),),
                                     close_fds=True, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        theirs.close()
        self._sock, self._conn = mine, Connection(os.dup(mine.fileno()))
        self._lock = threading.Lock()  # one fork request at a time: its pid answers it
        self._exits = threading.Lock()  # the children and the exits that came before their pid was read
        self._children: dict[int, ForkedProcess] = {}
        self._early: dict[int, int] = {}  # exits reported before the request's answer was read
        self._pids: queue.SimpleQueue[int | None] = queue.SimpleQueue()  # the pid of each fork, in order; None: lost
        self.lost = False
        self._reader = threading.Thread(target=self._read, name="fork-server reader", daemon=True)
        self._reader.start()

    def accepts(self, command: Sequence[str]) -> bool:
        if len(command) < 2 or os.path.realpath(command[0]) != os.path.realpath(sys.executable):
            return False
        if command[1] == "-m":
            return len(command) >= 3 and (command[2] in self.runs or "*" in self.runs)
        return self.scripts and command[1].endswith(".py") and not command[1].startswith("-")

    def start(self, command: Sequence[str], env: Mapping[str, str], stdout: int | IO[Any] | None = None,
              stderr: int | IO[Any] | None = None, cwd: str | os.PathLike[str] | None = None) -> ForkedProcess:
        """Fork ``command`` (``python -m MODULE ARGS`` or ``python SCRIPT.py ARGS``) with ``env``; its output to ``stdout``/``stderr`` (files
        or descriptors; ``None``: this process's own, ``subprocess.STDOUT`` for stderr: with stdout)."""
        out = sys.stdout.fileno() if stdout is None else _fileno(stdout)
        err = out if stderr == subprocess.STDOUT else (sys.stderr.fileno() if stderr is None else _fileno(stderr))
        module = command[1] == "-m"
        request = {"module": command[2] if module else None, "script": None if module else command[1],
                   "argv": list(command[3:] if module else command[2:]), "env": dict(env),
                   "cwd": os.fspath(cwd) if cwd is not None else os.getcwd()}
        with self._lock:
            if self.lost:
                raise OSError("the fork server has ended")
            self._conn.send_bytes(json.dumps(request).encode())
            sendfds(self._sock, [out, err])
            pid = self._pids.get()
            if pid is None:
                raise OSError(f"the fork server ended before it forked the worker: did an import of {', '.join(self.modules)} "
                              f"fail? (python -c 'import {', '.join(self.modules)}' says why)")
            proc = ForkedProcess(self, pid, list(command))
            with self._exits:
                if pid in self._early:
                    proc._exited(self._early.pop(pid))
                else:
                    self._children[pid] = proc
        return proc

    def _read(self) -> None:
        try:
            while True:
                kind, pid, code = json.loads(self._conn.recv_bytes())
                if kind == "pid":
                    self._pids.put(pid)
                    continue
                with self._exits:
                    proc = self._children.pop(pid, None)
                    if proc is None:
                        self._early[pid] = code
                if proc is not None:
                    proc._exited(code)
        except (EOFError, OSError, ValueError):
            self.lost = True
            self._pids.put(None)

    def close(self) -> None:
        """End the server (its children run on, as a ``python`` started by this process would)."""
        with contextlib.suppress(OSError):
            self._conn.close()
        with contextlib.suppress(OSError):
            self._sock.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join(5.0)


def _fileno(stream: int | IO[Any]) -> int:
    return stream if isinstance(stream, int) else stream.fileno()


# ---------------------------------------------------------------------------------------------
# the server
# ---------------------------------------------------------------------------------------------

def serve(fd: int, modules: Sequence[str]) -> None:
    """The server's loop: import ``modules``, then fork a worker per request and report each one's exit."""
    import gc
    import importlib

    die_with_parent(True)  # a server whose launcher (or demo) was killed waits for no more requests
    for module in modules:
        importlib.import_module(module)
    gc.freeze()  # the imports are kept for the server's life: no collection walks them, in it or in a child
    sock = socket.socket(fileno=fd)
    conn = Connection(os.dup(fd))
    while True:
        ready, _, _ = select.select([conn], [], [], 0.05)
        _reap(conn)
        if not ready:
            continue
        try:
            request = json.loads(conn.recv_bytes())
            out, err = recvfds(sock, 2)
        except (EOFError, OSError):
            return  # the process that started it closed its end (or ended): no more workers to start
        pid = os.fork()
        if pid == 0:
            sock.close()
            conn.close()
            _become_worker(request, out, err)  # raises SystemExit: the interpreter ends as the worker's
        os.close(out)
        os.close(err)
        try:
            conn.send_bytes(json.dumps(["pid", pid, None]).encode())
        except OSError:
            return


def _reap(conn: Connection) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        with contextlib.suppress(OSError):
            conn.send_bytes(json.dumps(["exit", pid, os.waitstatus_to_exitcode(status)]).encode())


def _become_worker(request: dict[str, Any], out: int, err: int) -> None:
    import random
    import runpy

    for number in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            if number not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(number, signal.default_int_handler if number == signal.SIGINT else signal.SIG_DFL)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.closerange(3, max(os.sysconf("SC_OPEN_MAX"), 1024))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()  # a fresh interpreter's own: never its siblings'
    module, script = request["module"], request["script"]
    # the command line it stands for (a released node starts it again with it: membership.node.rejoin_as_standby)
    sys.orig_argv = [sys.executable, *(["-m", module] if module else [script]), *request["argv"]]
    # sys.path[0] as python sets it: the script's directory, or the working directory for -m
    sys.path[0] = os.path.dirname(os.path.abspath(script)) if script else os.getcwd()
    zygote = sys.modules.get("lightning_bamboo.engine.comm_zygote")
    if zygote is not None:  # preloaded: the worker's communication zygote is a fork of it now, before it runs anything
        zygote.prepare(fork=True)
    code: Any = 0
    try:
        if module:
            sys.argv = ["-m", *request["argv"]]
            sys.modules.pop(module, None)  # preloaded as a module; it runs as __main__, as under ``python -m``
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *request["argv"]]
            runpy.run_path(script, run_name="__main__")
    except SystemExit as end:
        code = end.code
    except BaseException:  # noqa: BLE001 - printed as a python of its own prints it, and its status is 1
        sys.excepthook(*sys.exc_info())
        code = 1
    raise SystemExit(code)

