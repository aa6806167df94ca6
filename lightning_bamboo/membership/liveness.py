"""A node's liveness port: a peer whose process is gone is known at once, not a lease later.

A lease tells a dead node from a slow one only when its TTL runs out (0.8 x the detection timeout). But when a
process dies on a machine whose kernel still answers (a crash, a kill, every process of a machine killed), a
connection to a port that process listened on is refused at once: the kernel answers it with a reset. So each node
listens on one port of its address (``Listener``, published with its registration as ``meta["alive"]``) and accepts
and closes whatever connects. A node that meets a communication error, waits in a rendezvous, or sees its step
stall probes the ports of the nodes it works with (``Session.probe_peers``, which decides what counts) and announces
the loss of those that refused (``Registry.announce_loss``): everyone's loss detector sees it within its poll, and
the failover agrees on every dead node in one round.

A refusal is certain for the process that published the port: the socket is closed only when that process ends (a
child it forks closes its copy at once, ``os.register_at_fork``), and a port taken by another process afterwards
accepts, which says nothing. A machine that answers neither of two connections (``probe``'s ``unreachable``) is
gone silent or cut off; the session counts that only for a stalled step and only for a minority of its peers. An
accepted connection (a frozen process: its kernel still queues connections) says nothing, and the lease decides as
before. The listener reads nothing from a connection, so it gives a caller on the network no more than the kernel
does: whether the port is open.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: seconds a probe waits for a connection to be refused or accepted; a machine that answers does so in well under it
PROBE_SECONDS = 0.3
#: after a refusal, how long the ports of the refused node's machine-mates that still answered are probed again
#: (every ``SIBLING_POLL_SECONDS``): a machine's processes die one after another, each port closing once the kernel
#: tore down that process's memory (tens of milliseconds for a process of gigabytes)
SIBLING_SECONDS = 0.3
SIBLING_POLL_SECONDS = 0.05
#: the key of a node's registration (``NodeInfo.meta``) that holds its liveness port as ``host:port``
META_KEY = "alive"


class Listener:
    """A listening socket on ``host`` (an ephemeral port) whose thread accepts and closes every connection."""

    def __init__(self, host: str) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        self._sock.listen(1024)  # a full queue drops connections: a live node would look unreachable
        self.address = f"{host}:{self._sock.getsockname()[1]}" if family == socket.AF_INET else \
            f"[{host}]:{self._sock.getsockname()[1]}"
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="bamboo-liveness", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            conn.close()

    def close(self) -> None:
        """Stop listening: connections to the port are refused from now on."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self._sock.close()

    def close_in_child(self) -> None:
        """In a process forked from this one: drop the inherited socket, so that the port is refused once the
        process that published it ends, whatever its children do."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()


_LISTENER: Listener | None = None
_LOCK = threading.Lock()


def listener(host: str) -> Listener:
    """This process's liveness listener on ``host``, started on the first call; it lives as long as the process (a
    standby node that registers again publishes the same port)."""
    global _LISTENER
    with _LOCK:
        if _LISTENER is None or _LISTENER._closed:
            _LISTENER = Listener(host)
            os.register_at_fork(after_in_child=_LISTENER.close_in_child)
        return _LISTENER


def _split(address: str) -> tuple[str, int] | None:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class Probe:
    """What a probe found: ``refused``, the names whose port refused (their process is gone); ``unreachable``, those
    whose machine answered neither of two connections (gone silent, or cut off); ``answered``, those that accepted."""

    refused: frozenset[str] = frozenset()
    unreachable: frozenset[str] = frozenset()
    answered: frozenset[str] = frozenset()


def probe(addresses: Mapping[str, str], timeout: float = PROBE_SECONDS) -> Probe:
    """Probe every ``host:port`` of ``addresses`` (name -> address) at once; returns within ``timeout`` seconds.

    A second connection goes out at half the timeout to each address that has not answered, so one dropped packet
    does not make a machine unreachable (the kernel itself sends its next SYN only after a second). A machine that
    answers does so in well under the timeout: its kernel answers, however busy its processes are. An address that
    cannot be read is left out."""
    selector = selectors.DefaultSelector()
    refused: set[str] = set()
    answered: set[str] = set()
    pending: dict[str, int] = {}  # name -> connections still in flight
    targets: dict[str, tuple[str, int]] = {}
    socks: list[socket.socket] = []

    def connect(name: str) -> None:
        host, port = targets[name]
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        socks.append(sock)
        sock.setblocking(False)
        code = sock.connect_ex((host, port))
        if code == errno.ECONNREFUSED:
            refused.add(name)
        elif code == 0:
            answered.add(name)
        elif code in (errno.EINPROGRESS, errno.EAGAIN, errno.EWOULDBLOCK):
            selector.register(sock, selectors.EVENT_WRITE, name)
            pending[name] = pending.get(name, 0) + 1
        # anything else (no route, network down): no answer from that machine

    try:
        for name, address in addresses.items():
            parsed = _split(address)
            if parsed is not None:
                targets[name] = parsed
                connect(name)
        start = time.monotonic()
        again, deadline = start + timeout / 2, start + timeout
        second = False
        while True:
            now = time.monotonic()
            if not second and now >= again:
                second = True
                for name in [n for n in targets if n not in refused and n not in answered]:
                    connect(name)
            if now >= deadline or (second and not selector.get_map()) or \
                    not (set(targets) - refused - answered):
                break
            if not selector.get_map():
                time.sleep(max(0.0, again - now))
                continue
            for key, _ in selector.select(max(0.0, (deadline if second else again) - now)):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code == errno.ECONNREFUSED:
                    refused.add(key.data)
                elif code == 0:
                    answered.add(key.data)
                selector.unregister(sock)
    finally:
        selector.close()
        for sock in socks:
            sock.close()
    answered -= refused  # a refusal on either connection is the answer that counts
    unreachable = set(targets) - refused - answered
    return Probe(frozenset(refused), frozenset(unreachable), frozenset(answered))
