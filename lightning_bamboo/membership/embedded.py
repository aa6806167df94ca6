"""Embedded membership store: a stdlib key/value server on a loopback TCP port (``embedded://``; its client is
``embedded_client.EmbeddedStore``)."""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import logging
import random
import signal
import socket
import socketserver
import sys
import threading
import time
from dataclasses import asdict
from typing import Any

from lightning_bamboo.membership.credentials import MAKE_TOKEN, is_loopback, store_token
from lightning_bamboo.membership.protocol import (
    Event,
    KeyValue,
    LeaseExpiredError,
    StoreCredentialsError,
)
from lightning_bamboo.membership.wire import MAX_REQUEST_BYTES, BadRequest, Unauthorized, parse_request

log = logging.getLogger(__name__)

#: Events kept for ``wait_for_change``; older waits get ``Change(compacted=True)``.
HISTORY_EVENTS = 100_000
#: The server answers a wait after at most this long; the client re-issues until its own timeout.
MAX_SERVER_WAIT = 30.0
#: Smallest lease TTL the server grants (seconds).
MIN_TTL = 0.05


class _State:
    """The store's data; every method runs under ``self.cond``'s lock."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.kvs: dict[str, KeyValue] = {}
        self.keys: list[str] = []  # self.kvs's keys, sorted: a prefix read is a bisect, not a sort of every key
        self.revision = 1  # etcd starts at 1 too; revision 0 never names a change
        self.history: collections.deque[Event] = collections.deque(maxlen=HISTORY_EVENTS)
        self.leases: dict[int, list[Any]] = {}  # id -> [ttl, expires_at, set(keys)]
        self.next_lease = random.randrange(1, 2**40)
        self.stopping = False

    # -- helpers (lock held) --
    def _bump(self) -> int:
        self.revision += 1
        return self.revision

    def _delete_keys(self, keys: list[str], rev: int) -> int:
        n = 0
        for key in sorted(keys):
            kv = self.kvs.pop(key, None)
            if kv is None:
                continue
            del self.keys[bisect.bisect_left(self.keys, key)]
            n += 1
            if kv.lease and kv.lease in self.leases:
                self.leases[kv.lease][2].discard(key)
            self.history.append(Event("delete", key, "", rev))
        return n

    def _put(self, key: str, value: str, lease: int) -> KeyValue:
        if lease and lease in self.leases and self.leases[lease][1] <= time.monotonic():
            self._revoke(lease)  # expired but not reaped yet
        if lease and lease not in self.leases:
            raise LeaseExpiredError(f"lease {lease} is not held by the store (expired or revoked)")
        rev = self._bump()
        old = self.kvs.get(key)
        if old is not None and old.lease and old.lease != lease and old.lease in self.leases:
            self.leases[old.lease][2].discard(key)
        kv = KeyValue(
            key=key,
            value=value,
            create_revision=old.create_revision if old else rev,
            mod_revision=rev,
            version=(old.version + 1) if old else 1,
            lease=lease,
        )
        if old is None:
            bisect.insort(self.keys, key)
        self.kvs[key] = kv
        if lease:
            self.leases[lease][2].add(key)
        self.history.append(Event("put", key, value, rev))
        self.cond.notify_all()
        return kv

    def expire_leases(self, now: float) -> float | None:
        """Revoke every lease past its deadline; return the next deadline (or None)."""
        expired = [lid for lid, (_, exp, _) in self.leases.items() if exp <= now]
        for lid in expired:
            self._revoke(lid)
        return min((exp for _, exp, _ in self.leases.values()), default=None)

    def _revoke(self, lid: int) -> None:
        entry = self.leases.pop(lid, None)
        if entry is None:
            return
        keys = [k for k in entry[2] if k in self.kvs and self.kvs[k].lease == lid]
        if keys:
            self._delete_keys(keys, self._bump())
        self.cond.notify_all()

    def _range(self, prefix: str) -> list[KeyValue]:
        out, i = [], bisect.bisect_left(self.keys, prefix)
        while i < len(self.keys) and self.keys[i].startswith(prefix):
            out.append(self.kvs[self.keys[i]])
            i += 1
        return out

    def holds(self, key: str, lease: int) -> bool:
        """``key`` exists with ``lease`` attached and the lease has not run out (a write's guard)."""
        kv, entry = self.kvs.get(key), self.leases.get(lease)
        return kv is not None and kv.lease == lease and entry is not None and entry[1] > time.monotonic()

    # -- operations (called with the lock held) --
    def op_put(self, key: str, value: str, lease: int = 0) -> dict[str, Any]:
        return {"kv": asdict(self._put(key, value, lease))}

    def op_get(self, key: str) -> dict[str, Any]:
        kv = self.kvs.get(key)
        return {"kv": asdict(kv) if kv else None, "revision": self.revision}

    def op_get_prefix(self, prefix: str) -> dict[str, Any]:
        return {"kvs": [asdict(kv) for kv in self._range(prefix)], "revision": self.revision}

    def op_delete(self, key: str) -> dict[str, Any]:
        if key not in self.kvs:
            return {"deleted": 0}
        n = self._delete_keys([key], self._bump())
        self.cond.notify_all()
        return {"deleted": n}

    def op_delete_prefix(self, prefix: str) -> dict[str, Any]:
        keys = [kv.key for kv in self._range(prefix)]
        if not keys:
            return {"deleted": 0}
        n = self._delete_keys(keys, self._bump())
        self.cond.notify_all()
        return {"deleted": n}

    def op_cas(self, key: str, value: str, expected_revision: int, lease: int = 0) -> dict[str, Any]:
        cur = self.kvs.get(key)
        cur_rev = cur.mod_revision if cur else 0
        if cur_rev != expected_revision:
            return {"swapped": False, "kv": asdict(cur) if cur else None}
        return {"swapped": True, "kv": asdict(self._put(key, value, lease))}

    def op_grant(self, ttl: float) -> dict[str, Any]:
        ttl = max(float(ttl), MIN_TTL)
        lid = self.next_lease
        self.next_lease += 1
        self.leases[lid] = [ttl, time.monotonic() + ttl, set()]
        self.cond.notify_all()  # the reaper may need an earlier wake-up
        return {"id": lid, "ttl": ttl}

    def op_keep_alive(self, lease: int) -> dict[str, Any]:
        entry = self.leases.get(lease)
        if entry is None or entry[1] <= time.monotonic():
            self._revoke(lease)
            return {"alive": False}
        entry[1] = time.monotonic() + entry[0]
        return {"alive": True}

    def op_revoke(self, lease: int) -> dict[str, Any]:
        self._revoke(lease)
        return {}

    def op_wait(self, prefix: str, after_revision: int, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + min(float(timeout), MAX_SERVER_WAIT)
        after = int(after_revision)
        while True:
            oldest = self.history[0].revision if self.history else self.revision + 1
            if after + 1 < oldest and len(self.history) == self.history.maxlen:
                return {"events": [], "revision": self.revision, "compacted": True}
            newer = []
            for e in reversed(self.history):  # newest first; stop at the first old event
                if e.revision <= after:
                    break
                if e.key.startswith(prefix):
                    newer.append(asdict(e))
            events = newer[::-1]
            if events:
                return {"events": events, "revision": self.revision, "compacted": False}
            # Nothing under the prefix up to the current revision: wait for the next change.
            after = max(after, self.revision)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.stopping:
                return {"events": [], "revision": after, "compacted": False}
            self.cond.wait(remaining)


class _Handler(socketserver.StreamRequestHandler):
    """One client connection: newline-delimited JSON requests, one JSON response line each."""

    server: _Server

    def handle(self) -> None:
        state = self.server.state
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.track(self.connection, add=True)
        try:
            while not state.stopping:
                line = self.rfile.readline(MAX_REQUEST_BYTES + 1)
                if not line:
                    return
                if len(line) > MAX_REQUEST_BYTES:  # refused unread: the rest of the line is skipped, never kept
                    while not line.endswith(b"\n") and not state.stopping:
                        line = self.rfile.readline(1 << 16)
                        if not line:
                            return
                    self._answer({"ok": False, "error": "bad_request", "message": f"a request is at most "
                                  f"{MAX_REQUEST_BYTES} bytes; this one was skipped unread"})
                    continue
                try:
                    name, args, guard = parse_request(line, self.server.token)
                    op = getattr(state, "op_" + name)
                    with state.cond:
                        if state.stopping:
                            return
                        if guard is not None and not state.holds(*guard):
                            resp = {"ok": False, "error": "fenced", "message": f"{guard[0]!r} is not held by lease "
                                    f"{guard[1]} any more: its owner may have been declared lost"}
                        else:
                            resp = {"ok": True, **op(**args)}
                except Unauthorized as e:
                    resp = {"ok": False, "error": "unauthorized", "message": str(e)}
                except BadRequest as e:
                    resp = {"ok": False, "error": "bad_request", "message": str(e)}
                except LeaseExpiredError as e:
                    resp = {"ok": False, "error": "lease", "message": str(e)}
                except Exception as e:  # a malformed request must not kill the server
                    resp = {"ok": False, "error": "bad_request", "message": f"{type(e).__name__}: {e}"}
                self._answer(resp)
        except OSError:
            return
        finally:
            self.server.track(self.connection, add=False)

    def _answer(self, resp: dict[str, Any]) -> None:
        self.wfile.write(json.dumps(resp).encode() + b"\n")
        self.wfile.flush()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], state: _State, token: str | None) -> None:
        self.state, self.token = state, token
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(addr, _Handler)

    def track(self, conn: socket.socket, *, add: bool) -> None:
        with self._conns_lock:
            (self._conns.add if add else self._conns.discard)(conn)

    def close_connections(self) -> None:
        with self._conns_lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class EmbeddedServer:
    """The embedded store server. Start it in the launcher process; clients connect with ``url``.

    ``start()`` returns once the port is bound and serving; ``stop()`` closes every connection,
    wakes every waiter and joins the threads (bounded). Usable as a context manager.

    ``token``: a shared secret every request must carry (compared in constant time); by default
    ``$BAMBOO_STORE_TOKEN``, or none. A server that listens beyond loopback refuses to start without one:
    anyone who reaches its port could otherwise write the job's membership.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None) -> None:
        token = token if token is not None else store_token()
        if token is None and not is_loopback(host):
            raise StoreCredentialsError(
                f"the embedded store would listen on {host}, beyond loopback, where anyone who reaches the port "
                f"could change the job's membership; set a shared token in the environment of the store and of every "
                f"launcher ({MAKE_TOKEN}), or listen on 127.0.0.1"
            )
        self._state = _State()
        self._server = _Server((host, port), self._state, token)
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"embedded://{host!s}:{port}"

    def start(self) -> EmbeddedServer:
        serve = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.5}, name="bamboo-store", daemon=True
        )
        reaper = threading.Thread(target=self._reap, name="bamboo-store-leases", daemon=True)
        self._threads = [serve, reaper]
        for t in self._threads:
            t.start()
        return self

    def _reap(self) -> None:
        st = self._state
        with st.cond:
            while not st.stopping:
                nxt = st.expire_leases(time.monotonic())
                wait = 1.0 if nxt is None else min(1.0, max(0.0, nxt - time.monotonic()))
                st.cond.wait(wait)

    def stop(self, timeout: float = 5.0) -> None:
        with self._state.cond:
            self._state.stopping = True
            self._state.cond.notify_all()
        self._server.shutdown()
        self._server.close_connections()
        self._server.server_close()
        for t in self._threads:
            t.join(timeout)

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    """Run a server in the foreground: prints its URL on the first stdout line; stops on SIGTERM/SIGINT.
    Beyond loopback it needs $BAMBOO_STORE_TOKEN, a shared secret every client gives too."""
    p = argparse.ArgumentParser(
        prog="python -m lightning_bamboo.membership.embedded", description=main.__doc__
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server = EmbeddedServer(args.host, args.port)
    except StoreCredentialsError as err:  # the rule and the fix, without a traceback
        print(f"python -m lightning_bamboo.membership.embedded: error: {err}", file=sys.stderr)
        sys.exit(2)
    with server.start():
        print(server.url, flush=True)
        while not stop.wait(1.0):
            pass
    sys.stdout.flush()


if __name__ == "__main__":
    main()
