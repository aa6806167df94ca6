"""The embedded membership store's client, ``EmbeddedStore`` (``embedded://HOST:PORT``): newline JSON requests
on pooled connections to an ``embedded.EmbeddedServer``, with its token, bounded retries and slow-answer reports."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from typing import Any

from lightning_bamboo.membership.credentials import TOKEN_ENV, store_token
from lightning_bamboo.membership.protocol import (
    DEFAULT_TIMEOUT,
    FIRST_ATTEMPT_SECONDS,
    SLOW_ANSWER_SECONDS,
    Change,
    Event,
    Fenced,
    Guard,
    KeyValue,
    Lease,
    LeaseExpiredError,
    PutIfAbsentFromCAS,
    Snapshot,
    StoreCredentialsError,
    StoreError,
    StoreTimeoutError,
    StoreUnavailableError,
    deadline_for,
)
from lightning_bamboo.membership.wire import MAX_REQUEST_BYTES

log = logging.getLogger(__name__)


class _Ambiguous(Exception):
    """The request was sent but no answer came back: it may or may not have been applied."""


def _with_guard(req: dict[str, Any], guard: Guard | None) -> dict[str, Any]:
    return req if guard is None else {**req, "guard": [guard[0], int(guard[1])]}


class EmbeddedStore(PutIfAbsentFromCAS):
    """Client of an ``EmbeddedServer`` (``embedded://HOST:PORT``); see ``Store`` for the contract.

    ``request_timeout``: the bound of a call given no timeout, and how long after its hold time a wait's
    answer may come (the server lives in a launcher process, which a loaded machine can starve for seconds).
    """

    def __init__(self, host: str, port: int, *, connect_timeout: float = 5.0, request_timeout: float = DEFAULT_TIMEOUT,
                 token: str | None = None) -> None:
        self.url = f"embedded://{host}:{port}"
        self.request_timeout = deadline_for(request_timeout)
        self._addr = (host, port)
        self._token = token if token is not None else store_token()
        self._pool: list[tuple[socket.socket, Any]] = []
        self._lock = threading.Lock()
        self._closed = False
        # Fail fast (bounded) with a clear error if nobody serves this URL.
        self._call({"op": "get", "key": ""}, connect_timeout)

    # -- transport --
    def _unavailable(self, why: str, timeout: float) -> StoreUnavailableError:
        return StoreUnavailableError(
            f"membership store {self.url} did not answer within {timeout:.1f} s ({why}); "
            "the embedded store lives in the launcher process: check that it is still running "
            "and that --store names its URL"
        )

    def _conn(self, timeout: float) -> tuple[socket.socket, Any]:
        with self._lock:
            if self._closed:
                raise StoreError(f"membership store client {self.url} is closed")
            if self._pool:
                return self._pool.pop()
        sock = socket.create_connection(self._addr, timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock, sock.makefile("rb")

    def _release(self, conn: tuple[socket.socket, Any]) -> None:
        with self._lock:
            if not self._closed:
                self._pool.append(conn)
                return
        conn[0].close()

    def _call(self, req: dict[str, Any], timeout: float, extra: float = 0.0) -> dict[str, Any]:
        """Send one request; retry while the server is unreachable, up to ``timeout`` (+``extra`` for waits)."""
        deadline = time.monotonic() + timeout
        payload = json.dumps(req if self._token is None else {**req, "token": self._token}).encode() + b"\n"
        if len(payload) > MAX_REQUEST_BYTES:
            raise StoreError(f"a {req['op']!r} request of {len(payload)} bytes is over the embedded store's limit of "
                             f"{MAX_REQUEST_BYTES} (etcd's default is 1.5 MiB); send less through the store")
        delay = 0.02
        last: str | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if last is not None:
                    raise self._unavailable(last, timeout)
                remaining = FIRST_ATTEMPT_SECONDS  # no attempt yet: ask once all the same
            try:
                conn = self._conn(remaining)
            except OSError as e:  # refused / unreachable: nothing was sent, safe to retry
                last = f"{type(e).__name__}: {e}"
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 0.5)
                continue
            sock, rfile = conn
            sent = False
            try:
                sock.settimeout(remaining + extra)
                sock.sendall(payload)
                sent = True
                self._await_answer(sock, req, remaining + extra)
                line = rfile.readline()
                if not line:
                    raise ConnectionResetError("server closed the connection")
            except TimeoutError as e:
                sock.close()
                raise StoreTimeoutError(
                    f"membership store {self.url} accepted the connection but did not answer a "
                    f"{req['op']!r} request within {remaining + extra:.1f} s; the launcher process "
                    "holding the store may be frozen (a node waits for the store as long as the job's "
                    "detection_timeout allows)"
                ) from e
            except OSError as e:
                sock.close()
                last = f"{type(e).__name__}: {e}"
                if sent and req["op"] in ("cas",):
                    raise _Ambiguous(last) from e
                continue  # a stale pooled connection or a restarted server: try a fresh one
            self._release(conn)
            resp = json.loads(line)
            if resp["ok"]:
                return resp
            if resp["error"] == "fenced":
                raise Fenced(f"membership store {self.url} refused a guarded {req['op']!r}: {resp['message']}")
            if resp["error"] == "unauthorized":
                raise StoreCredentialsError(
                    f"membership store {self.url} refused the request: {resp['message']}. Give every launcher the "
                    f"store's token in ${TOKEN_ENV}" + ("" if self._token is None else " (this one's differs)"))
            if resp["error"] == "lease":
                raise LeaseExpiredError(
                    f"{resp['message']} at {self.url}; grant a new lease and put the keys again"
                )
            raise StoreError(f"membership store {self.url} rejected {req['op']!r}: {resp['message']}")

    def _await_answer(self, sock: socket.socket, req: dict[str, Any], window: float) -> None:
        """Return once an answer to ``req`` is arriving on ``sock``, or ``window`` s after it was sent
        (the socket's timeout, set by the caller). An answer that is late is logged once, as a slow store,
        and still waited for: a paused server answers when it resumes."""
        due = (float(req["timeout"]) if req["op"] == "wait" else 0.0) + SLOW_ANSWER_SECONDS
        if window <= due:
            return
        start = time.monotonic()
        sock.settimeout(due)
        try:
            sock.recv(1, socket.MSG_PEEK)  # the answer's first byte, left for the reader
        except TimeoutError:
            log.warning("membership store %s is slow: no answer to a %r request %.1f s after it was due; "
                        "waiting up to %.1f s in all", self.url, req["op"], SLOW_ANSWER_SECONDS, window)
        finally:
            sock.settimeout(max(window - (time.monotonic() - start), 1e-3))

    def _deadline(self, timeout: float | None) -> float:
        return deadline_for(timeout, self.request_timeout)

    # -- Store --
    def put(
        self, key: str, value: str, *, lease: int = 0, timeout: float | None = None, guard: Guard | None = None
    ) -> int:
        req = _with_guard({"op": "put", "key": key, "value": value, "lease": lease}, guard)
        return int(self._call(req, self._deadline(timeout))["kv"]["mod_revision"])

    def get(self, key: str, *, timeout: float | None = None) -> KeyValue | None:
        resp = self._call({"op": "get", "key": key}, self._deadline(timeout))
        return KeyValue(**resp["kv"]) if resp["kv"] else None

    def get_prefix(self, prefix: str, *, timeout: float | None = None) -> Snapshot:
        resp = self._call({"op": "get_prefix", "prefix": prefix}, self._deadline(timeout))
        return Snapshot(tuple(KeyValue(**kv) for kv in resp["kvs"]), int(resp["revision"]))

    def delete(self, key: str, *, timeout: float | None = None, guard: Guard | None = None) -> bool:
        return bool(self._call(_with_guard({"op": "delete", "key": key}, guard), self._deadline(timeout))["deleted"])

    def delete_prefix(self, prefix: str, *, timeout: float | None = None, guard: Guard | None = None) -> int:
        req = _with_guard({"op": "delete_prefix", "prefix": prefix}, guard)
        return int(self._call(req, self._deadline(timeout))["deleted"])

    def compare_and_put(
        self,
        key: str,
        value: str,
        *,
        expected_revision: int,
        lease: int = 0,
        timeout: float | None = None,
        guard: Guard | None = None,
    ) -> tuple[bool, KeyValue | None]:
        t = self._deadline(timeout)
        req = {
            "op": "cas",
            "key": key,
            "value": value,
            "expected_revision": int(expected_revision),
            "lease": lease,
        }
        try:
            resp = self._call(_with_guard(req, guard), t)
        except _Ambiguous:
            kv = self.get(key, timeout=t)
            swapped = kv is not None and kv.value == value and kv.lease == lease
            if not swapped and guard is not None:
                held = self.get(guard[0], timeout=t)
                if held is None or held.lease != guard[1]:
                    raise Fenced(f"membership store {self.url} refused a guarded 'cas': {guard[0]!r} is not held "
                                 f"by lease {guard[1]} any more") from None
            return swapped, kv
        return bool(resp["swapped"]), (KeyValue(**resp["kv"]) if resp["kv"] else None)

    def grant_lease(self, ttl: float, *, timeout: float | None = None) -> Lease:
        if not ttl > 0:
            raise StoreError(f"a lease needs ttl > 0 seconds (got {ttl!r})")
        resp = self._call({"op": "grant", "ttl": float(ttl)}, self._deadline(timeout))
        return Lease(int(resp["id"]), float(resp["ttl"]))

    def keep_alive(self, lease: int, *, timeout: float | None = None) -> bool:
        return bool(self._call({"op": "keep_alive", "lease": lease}, self._deadline(timeout))["alive"])

    def revoke_lease(self, lease: int, *, timeout: float | None = None) -> None:
        self._call({"op": "revoke", "lease": lease}, self._deadline(timeout))

    def wait_for_change(self, prefix: str, after_revision: int, timeout: float) -> Change:
        total = self._deadline(timeout)
        deadline = time.monotonic() + total
        after = int(after_revision)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return Change((), after)
            # The server holds the request up to `remaining`; its answer may come a request timeout later
            # (a slow store delays a wait; it does not end it).
            resp = self._call(
                {"op": "wait", "prefix": prefix, "after_revision": after, "timeout": remaining},
                remaining,
                extra=self.request_timeout,
            )
            if resp["events"] or resp["compacted"]:
                return Change(
                    tuple(Event(**e) for e in resp["events"]), int(resp["revision"]), resp["compacted"]
                )
            after = max(after, int(resp["revision"]))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, []
        for sock, rfile in pool:
            rfile.close()
            sock.close()

    def __enter__(self) -> EmbeddedStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


