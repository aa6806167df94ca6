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

A machine that runs many short jobs one after another (a test suite: each job's server would import the same modules
again, 4-5 s of a core and as long before its first worker runs) can keep one *shared* server instead
(:func:`start_shared`, its address in ``$BAMBOO_FORK_SERVER``): a launcher asked to preload forks its workers there,
if that server imported in the environment the launcher's workers have (``IMPORT_VARS``), else it starts its own.
Its workers are not the launcher's descendants, nor in its process group: a launcher that ends, however it ends, takes
the workers it started there with it (the server kills them once their launcher's connection is gone).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.reduction import recvfds, sendfds
from typing import IO, Any, NoReturn, cast

from lightning_bamboo.membership.node import die_with_parent, process_alive

#: the address (a Unix socket's path) of a shared fork server (``start_shared``) that launchers asked to preload use
SHARED_ENV = "BAMBOO_FORK_SERVER"
#: the variables that decide what an import does: a shared server forks only for a launcher whose workers' environment
#: has the values it imported with
IMPORT_VARS = ("PYTHONPATH", "DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES", "PYTHONHASHSEED", "PYTHONSAFEPATH")


#: how long a shared server waits for a connecting launcher's greeting before it closes the connection
GREETING_SECONDS = 5.0


class ForkServerRefused(OSError):
    """A shared fork server imported its modules in another environment (or is gone): start one of your own."""


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
                 runs: Sequence[str] | None = None, scripts: bool = False, address: str | None = None,
                 detached: bool = False) -> None:
        """``log``: where the server's own output goes (what the modules print when imported); ``runs``: the
        modules it runs (``("*",)``: any); ``scripts``: it also forks ``python SCRIPT.py ARGS`` (the script run as
        ``__main__``, its directory first on ``sys.path``). ``address``: fork at the shared server there
        (``start_shared``) instead of starting one; ``ForkServerRefused`` if it imported in another environment
        than ``env``'s (``IMPORT_VARS``) or is gone. ``detached``: the workers forked there run on when this
        process ends (as Lightning's own launcher leaves its other ranks), instead of ending with it."""
        self.modules = tuple(modules)
        self.runs = tuple(self.modules if runs is None else runs)
        self.scripts = scripts
        self.proc: subprocess.Popen[bytes] | None = None
        if address is None:
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            code = f"from lightning_bamboo.launcher.forks import serve; serve({theirs.fileno()}, {list(self.modules)!r})"
            self.proc = subprocess.Popen([sys.executable, "-c", code], env=dict(env), pass_fds=(theirs.fileno(),),
                                         close_fds=True, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
            theirs.close()
            self._sock, self._conn = mine, Connection(os.dup(mine.fileno()))
        else:
            self._sock, self._conn = _greet(address, env, detached)
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
              stderr: int | IO[Any] | None = None, cwd: str | os.PathLike[str] | None = None,
              start_new_session: bool = False) -> ForkedProcess:
        """Fork ``command`` (``python -m MODULE ARGS`` or ``python SCRIPT.py ARGS``) with ``env``; its output to ``stdout``/``stderr`` (files
        or descriptors; ``None``: this process's own, ``subprocess.STDOUT`` for stderr: with stdout).
        ``start_new_session``: the worker leads a session (and process group) of its own, as ``subprocess.Popen``'s,
        so that ``os.killpg(worker.pid, ...)`` reaches it and every process it starts."""
        out = sys.stdout.fileno() if stdout is None else _fileno(stdout)
        err = out if stderr == subprocess.STDOUT else (sys.stderr.fileno() if stderr is None else _fileno(stderr))
        module = command[1] == "-m"
        request = {"module": command[2] if module else None, "script": None if module else command[1],
                   "argv": list(command[3:] if module else command[2:]), "env": dict(env),
                   "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(), "session": start_new_session,
                   "ignored": inherited_ignores()}
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
        """End the server (its children run on, as a ``python`` started by this process would); a shared server's
        connection instead (it kills the children it forked for this one that still run)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # the reader's wait ends, and the server sees the end at once
        with contextlib.suppress(OSError):
            self._conn.close()
        with contextlib.suppress(OSError):
            self._sock.close()
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
        self._reader.join(5.0)


def _greet(address: str, env: Mapping[str, str], detached: bool = False) -> tuple[socket.socket, Connection]:
    """A connection to the shared server at ``address``, which said it imported in ``env``'s ``IMPORT_VARS``
    (``detached``: its workers outlive the connection)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(address)
        conn = Connection(os.dup(sock.fileno()))
        try:
            conn.send_bytes(json.dumps({"vars": {k: env.get(k) for k in IMPORT_VARS}, "detached": detached}).encode())
            ok, reason = json.loads(conn.recv_bytes())  # once its imports are done
        except BaseException:
            conn.close()
            raise
        if not ok:
            conn.close()
            raise ForkServerRefused(reason)
        return sock, conn
    except (OSError, EOFError, ValueError) as err:
        sock.close()
        if isinstance(err, ForkServerRefused):
            raise
        raise ForkServerRefused(f"no shared fork server at {address}: {err}") from err


def start_shared(address: str, modules: Sequence[str], env: Mapping[str, str],
                 log: int | IO[Any] = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
    """Start a fork server that imports ``modules`` in ``env`` and forks workers for every launcher that connects
    to ``address`` (a Unix socket's path, bound before the imports begin: a launcher that connects early waits for
    them). It dies with this process; ending it kills every worker it forked that still runs."""
    code = f"from lightning_bamboo.launcher.forks import serve_shared; serve_shared({address!r}, {list(modules)!r})"
    proc = subprocess.Popen([sys.executable, "-c", code], env=dict(env), close_fds=True, stdin=subprocess.DEVNULL,
                            stdout=log, stderr=log)
    deadline = time.monotonic() + 30.0
    while not os.path.exists(address):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise OSError(f"the shared fork server did not listen at {address} (exit {proc.returncode})")
        time.sleep(0.01)
    return proc


def _fileno(stream: int | IO[Any]) -> int:
    return stream if isinstance(stream, int) else stream.fileno()


# ---------------------------------------------------------------------------------------------
# the server
# ---------------------------------------------------------------------------------------------

def serve(fd: int, modules: Sequence[str]) -> None:
    """The server's loop: import ``modules``, then fork a worker per request and report each one's exit."""
    die_with_parent(True)  # a server whose launcher (or demo) was killed waits for no more requests
    _preload(modules)
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
        pid = _fork_worker(request, out, err, [sock, conn], with_server=False)  # it outlives the server
        try:
            conn.send_bytes(json.dumps(["pid", pid, None]).encode())
        except OSError:
            return


def _preload(modules: Sequence[str]) -> None:
    import gc
    import importlib

    for module in modules:
        importlib.import_module(module)
    gc.freeze()  # the imports are kept for the server's life: no collection walks them, in it or in a child


def _fork_worker(request: dict[str, Any], out: int, err: int, server_ends: Sequence[Any], with_server: bool) -> int:
    """Fork the worker ``request`` asks for (output ``out`` and ``err``, which the server closes), with none of the
    server's ``server_ends`` (its listener, its connections); ``with_server``: it dies with the server. Its pid."""
    pid = os.fork()
    if pid == 0:
        if with_server:
            die_with_parent(True)
        for end in server_ends:
            end.close()
        _become_worker(request, out, err)  # raises SystemExit: the interpreter ends as the worker's
    os.close(out)
    os.close(err)
    return pid


def _reap(conn: Connection | dict[int, Connection]) -> None:
    """Report each child that exited to ``conn`` (or to the connection its pid maps to: a shared server's)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        to = conn.pop(pid, None) if isinstance(conn, dict) else conn
        if to is not None:
            with contextlib.suppress(OSError):
                to.send_bytes(json.dumps(["exit", pid, os.waitstatus_to_exitcode(status)]).encode())


def same_user(sock: socket.socket) -> bool:
    """Whether the process at the other end of the Unix socket ``sock`` runs as this process's user."""
    if not hasattr(socket, "SO_PEERCRED"):  # pragma: no cover - Linux has it; elsewhere the socket's mode decides
        return True
    _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return bool(uid == os.getuid())


def serve_shared(address: str, modules: Sequence[str]) -> None:
    """A shared server's loop (``start_shared``): listen at ``address``, import ``modules``, then answer each
    launcher that connects (whether its workers' environment is the one imported in) and fork its workers."""
    from lightning_bamboo.membership.node import descendants

    die_with_parent(True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # bound under a name of its own and renamed once listening: ``start_shared`` waits for the path to exist, and a
    # connect between bind and listen is refused (a launcher then falls back to a process of its own)
    binding = f"{address}.{os.getpid()}"
    listener.bind(binding)
    os.chmod(binding, 0o600)  # a request here runs a command: only this user may connect (and ``accept`` checks)
    listener.listen(64)
    os.rename(binding, address)
    _preload(modules)
    imported = {k: os.environ.get(k) for k in IMPORT_VARS}
    clients: dict[Connection, socket.socket] = {}
    owners: dict[int, Connection] = {}  # each running child's launcher
    detached: set[Connection] = set()  # launchers whose workers run on without them

    def drop(conn: Connection) -> None:
        """A launcher's connection is gone: so are the workers it started here that still run (unless detached)."""
        for pid in [p for p, c in owners.items() if c is conn and conn not in detached]:
            for member in [pid, *descendants(pid)]:
                with contextlib.suppress(OSError):
                    os.kill(member, signal.SIGKILL)
        with contextlib.suppress(OSError):
            conn.close()
        with contextlib.suppress(OSError):
            clients.pop(conn).close()
        detached.discard(conn)

    while True:
        waited: list[Any] = [listener, *clients]
        ready, _, _ = select.select(waited, [], [], 0.05)
        _reap(owners)
        for source in ready:
            if source is listener:
                sock, _ = listener.accept()
                if not same_user(sock):  # whoever else reached the socket is not served (nor told why)
                    sock.close()
                    continue
                conn = Connection(os.dup(sock.fileno()))
                try:
                    if not conn.poll(GREETING_SECONDS):  # one that never greets must not hold every other launcher
                        raise EOFError("no greeting")
                    hello = json.loads(conn.recv_bytes())
                    theirs = hello["vars"]
                    differ = {k: (theirs.get(k), v) for k, v in imported.items() if theirs.get(k) != v}
                    conn.send_bytes(json.dumps([not differ, f"the shared fork server imported with {differ} "
                                                            "(yours, its): start a server of your own"]).encode())
                except (EOFError, OSError, ValueError, AttributeError, KeyError, TypeError):
                    differ = {"": (None, None)}
                if differ:
                    conn.close()
                    sock.close()
                else:
                    clients[conn] = sock
                    if hello.get("detached"):
                        detached.add(conn)
                continue
            conn = cast(Connection, source)
            try:
                request = json.loads(conn.recv_bytes())
                out, err = recvfds(clients[conn], 2)
            except (EOFError, OSError, ValueError):
                drop(conn)
                continue
            # ending the shared server ends what it forked
            pid = _fork_worker(request, out, err, [listener, *clients, *clients.values()], with_server=True)
            owners[pid] = conn
            try:
                conn.send_bytes(json.dumps(["pid", pid, None]).encode())
            except OSError:
                drop(conn)


def inherited_ignores() -> list[int]:
    """The signals this process ignores that a child it started would inherit ignored: every one but those that
    ``subprocess`` restores to the default before an exec (SIGPIPE, SIGXFSZ)."""
    restored = {signal.SIGPIPE, signal.SIGXFSZ}
    return [int(number) for number in signal.valid_signals()
            if number not in restored and _ignored(number)]


def _ignored(number: int) -> bool:
    with contextlib.suppress(OSError, ValueError):
        return signal.getsignal(number) == signal.SIG_IGN
    return False


def _become_worker(request: dict[str, Any], out: int, err: int) -> NoReturn:
    import random
    import runpy

    if request.get("session"):
        os.setsid()

    # the dispositions a fresh interpreter its client started would have: what the client ignores stays ignored
    # across an exec (SIGINT included: Python then leaves it ignored), SIGPIPE and SIGXFSZ ignored by Python itself (a
    # write to a closed pipe or socket raises BrokenPipeError instead of killing the process), Python's handler for
    # SIGINT, the rest the default
    ignored = {signal.SIGPIPE, signal.SIGXFSZ, *map(signal.Signals, request.get("ignored", ()))}
    for number in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            if number not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(number, signal.SIG_IGN if number in ignored else
                              signal.default_int_handler if number == signal.SIGINT else signal.SIG_DFL)
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
    logs = sys.modules.get("lightning_bamboo.logs")
    if logs is not None:
        logs.read_level()  # read at import: the server's environment's, not this worker's
    torch = sys.modules.get("torch")
    threads = request["env"].get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # read when torch was imported: the server's value, not this worker's
    module, script = request["module"], request["script"]
    # the command line it stands for
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

