"""etcd v3 membership store (``etcd://HOST:PORT``) over etcd's JSON gateway, using etcd3gw's client."""

from __future__ import annotations

import base64
import json
import math
import time
from typing import Any

from lightning_bamboo.membership.credentials import EtcdCredentials
from lightning_bamboo.membership.protocol import (
    FIRST_ATTEMPT_SECONDS,
    Change,
    Event,
    Fenced,
    Guard,
    KeyValue,
    Lease,
    LeaseExpiredError,
    PutIfAbsentFromCAS,
    Snapshot,
    StoreError,
    StoreTimeoutError,
    StoreUnavailableError,
    deadline_for,
)

#: HTTP statuses after which the call is retried inside its timeout (etcd restarting, no leader yet).
_RETRY_STATUS = {500, 502, 503, 504}


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode("ascii")


def _unb64(s: str | None) -> str:
    return base64.b64decode(s).decode() if s else ""


def _range_end(prefix: str) -> bytes:
    raw = prefix.encode()
    if not raw:
        return b"\0"  # with key "\0": every key
    return raw[:-1] + bytes([raw[-1] + 1])  # UTF-8 never ends with 0xff


def _kv(d: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=_unb64(d["key"]),
        value=_unb64(d.get("value")),
        create_revision=int(d.get("create_revision", 0)),
        mod_revision=int(d.get("mod_revision", 0)),
        version=int(d.get("version", 0)),
        lease=int(d.get("lease", 0)),
    )


def _guard_compare(guard: Guard) -> dict[str, Any]:
    """The txn comparison "``guard``'s key holds ``guard``'s lease" (a missing key holds lease 0: false)."""
    return {"key": _b64(guard[0]), "target": "LEASE", "result": "EQUAL", "lease": int(guard[1])}


class _Ambiguous(Exception):
    """The request reached etcd but the answer did not come back: it may have been applied."""


class EtcdStore(PutIfAbsentFromCAS):
    """A ``Store`` on a real etcd v3 (>= 3.4) server; see ``Store`` for the contract.

    etcd3gw finds the gateway prefix (``/v3/`` on etcd >= 3.4; etcd 3.5 dropped ``/v3beta``) and
    owns the HTTP session. Each call sets its own timeouts, retries while etcd is unreachable or
    has no leader (a restart with the same data dir keeps keys, revisions and leases), and
    raises ``StoreUnavailableError`` naming the endpoint when its time is up. Lease TTLs are
    whole seconds (rounded up); etcd's minimum TTL also depends on its election timeout.
    """

    def __init__(self, host: str, port: int, *, connect_timeout: float = 5.0,
                 credentials: EtcdCredentials | None = None) -> None:
        try:
            import etcd3gw
            import requests
            from requests.adapters import HTTPAdapter
        except ImportError as e:  # pragma: no cover - the dev extra installs it
            raise StoreError(
                f"the etcd store needs etcd3gw ({e}); install it with `pip install 'lightning-bamboo[etcd]'` "
                "or use --store embedded"
            ) from e
        self._requests = requests
        self.url = f"etcd://{host}:{port}"
        self._client = etcd3gw.client(host=host, port=port, timeout=connect_timeout)
        adapter = HTTPAdapter(pool_connections=4, pool_maxsize=32)
        self._client.session.mount("http://", adapter)
        self._closed = False
        deadline = time.monotonic() + connect_timeout
        last = ""
        while True:  # API path discovery (GET /version), bounded, retried while refused
            try:
                self._api = self._client.api_path
                break
            except etcd3gw.exceptions.Etcd3Exception as e:
                cause = e.__context__ if e.__context__ is not None else e
                last = f"{type(cause).__name__}: {str(cause)[:200]}"
            if time.monotonic() + 0.1 >= deadline:
                raise self._unavailable(last, connect_timeout)
            time.sleep(0.1)

    def _unavailable(self, why: str, timeout: float) -> StoreUnavailableError:
        host, port = self._client.host, self._client.port
        return StoreUnavailableError(
            f"etcd at {self.url} did not answer within {timeout:.1f} s ({why}). Start etcd there, e.g. "
            f"`etcd --listen-client-urls http://{host}:{port} --advertise-client-urls http://{host}:{port}`, "
            "or check --store (use --store embedded for a single machine)"
        )

    # -- transport --
    def _post(
        self, path: str, payload: dict[str, Any], timeout: float, *, idempotent: bool = True
    ) -> dict[str, Any]:
        if self._closed:
            raise StoreError(f"etcd store client {self.url} is closed")
        rq = self._requests
        url = self._client.get_url(path)
        deadline = time.monotonic() + timeout
        delay = 0.02
        last: str | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if last is not None:
                    raise self._unavailable(last, timeout)
                remaining = FIRST_ATTEMPT_SECONDS  # no attempt yet: ask once all the same
            try:
                resp = self._client.session.post(url, json=payload, timeout=(min(remaining, 2.0), remaining))
            except rq.exceptions.ReadTimeout as e:
                if not idempotent:
                    raise _Ambiguous(str(e)) from e
                raise StoreTimeoutError(
                    f"etcd at {self.url} accepted {path} but did not answer within {remaining:.1f} s; "
                    "etcd may be overloaded or frozen"
                ) from e
            except rq.exceptions.RequestException as e:  # refused, reset, or a reply cut short
                last = f"{type(e).__name__}: {e}"
                if not idempotent and not (isinstance(e, rq.exceptions.ConnectionError) and _not_sent(e)):
                    raise _Ambiguous(last) from e
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 0.25)
                continue
            if resp.status_code == 200:
                return resp.json()
            body = _error_body(resp)
            if resp.status_code in _RETRY_STATUS:
                last = f"HTTP {resp.status_code}: {body}"
                if not idempotent:
                    raise _Ambiguous(last)
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 0.25)
                continue
            if "lease not found" in body:
                raise LeaseExpiredError(
                    f"etcd at {self.url}: {body}; grant a new lease and put the keys again"
                )
            raise StoreError(f"etcd at {self.url} rejected {path} (HTTP {resp.status_code}): {body}")

    # -- Store --
    def _fenced(self, guard: Guard) -> Fenced:
        return Fenced(f"etcd at {self.url} refused a write guarded by {guard[0]!r}: that key is gone or no longer "
                      f"held by lease {guard[1]}, so its owner may have been declared lost")

    def _holds(self, guard: Guard, timeout: float) -> bool:
        kv = self.get(guard[0], timeout=timeout)
        return kv is not None and kv.lease == guard[1]

    def _guarded(self, guard: Guard, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        """``request`` (one txn operation) applied only while ``guard`` holds, in one transaction; its
        response (``{"response_put": ...}`` or ``{"response_delete_range": ...}``)."""
        txn = {"compare": [_guard_compare(guard)], "success": [request], "failure": []}
        resp = self._post("kv/txn", txn, timeout)  # idempotent: the same guarded write twice is one
        if not resp.get("succeeded", False):
            raise self._fenced(guard)
        return {**resp["responses"][0], "header": resp["header"]}

    def put(
        self, key: str, value: str, *, lease: int = 0, timeout: float | None = None, guard: Guard | None = None
    ) -> int:
        payload: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            payload["lease"] = lease
        if guard is not None:
            return int(self._guarded(guard, {"request_put": payload}, deadline_for(timeout))["header"]["revision"])
        return int(self._post("kv/put", payload, deadline_for(timeout))["header"]["revision"])

    def get(self, key: str, *, timeout: float | None = None) -> KeyValue | None:
        kvs = self._post("kv/range", {"key": _b64(key)}, deadline_for(timeout)).get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str, *, timeout: float | None = None) -> Snapshot:
        key = _b64(prefix) if prefix else _b64(b"\0")
        resp = self._post(
            "kv/range", {"key": key, "range_end": _b64(_range_end(prefix))}, deadline_for(timeout)
        )
        return Snapshot(tuple(_kv(d) for d in resp.get("kvs", [])), int(resp["header"]["revision"]))

    def _delete_range(self, payload: dict[str, Any], timeout: float | None, guard: Guard | None) -> int:
        if guard is not None:
            done = self._guarded(guard, {"request_delete_range": payload}, deadline_for(timeout))
            return int(done.get("response_delete_range", {}).get("deleted", 0))
        return int(self._post("kv/deleterange", payload, deadline_for(timeout)).get("deleted", 0))

    def delete(self, key: str, *, timeout: float | None = None, guard: Guard | None = None) -> bool:
        return self._delete_range({"key": _b64(key)}, timeout, guard) > 0

    def delete_prefix(self, prefix: str, *, timeout: float | None = None, guard: Guard | None = None) -> int:
        key = _b64(prefix) if prefix else _b64(b"\0")
        return self._delete_range({"key": key, "range_end": _b64(_range_end(prefix))}, timeout, guard)

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
        t = deadline_for(timeout)
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = lease
        read = {"request_range": {"key": _b64(key)}}
        # A missing key compares as mod_revision 0, so expected 0 means "only if absent".
        compare = [{"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": int(expected_revision)}]
        failure = [read]
        if guard is not None:
            compare.append(_guard_compare(guard))
            failure.append({"request_range": {"key": _b64(guard[0])}})
        txn = {"compare": compare, "success": [{"request_put": put}, read], "failure": failure}
        try:
            resp = self._post("kv/txn", txn, t, idempotent=False)
        except _Ambiguous:
            kv = self.get(key, timeout=t)
            swapped = kv is not None and kv.value == value and kv.lease == lease
            if not swapped and guard is not None and not self._holds(guard, t):
                raise self._fenced(guard) from None
            return swapped, kv
        swapped = bool(resp.get("succeeded", False))
        if not swapped and guard is not None:
            held = resp["responses"][1]["response_range"].get("kvs", [])
            if not held or _kv(held[0]).lease != guard[1]:
                raise self._fenced(guard)
        kvs = resp["responses"][0 if not swapped else -1]["response_range"].get("kvs", [])
        return swapped, (_kv(kvs[0]) if kvs else None)

    def grant_lease(self, ttl: float, *, timeout: float | None = None) -> Lease:
        if not ttl > 0:
            raise StoreError(f"a lease needs ttl > 0 seconds (got {ttl!r})")
        resp = self._post("lease/grant", {"TTL": max(1, math.ceil(ttl)), "ID": 0}, deadline_for(timeout))
        if resp.get("error"):
            raise StoreError(f"etcd at {self.url} refused a lease of {ttl} s: {resp['error']}")
        return Lease(int(resp["ID"]), float(resp["TTL"]))

    def keep_alive(self, lease: int, *, timeout: float | None = None) -> bool:
        resp = self._post("lease/keepalive", {"ID": lease}, deadline_for(timeout))
        return int(resp.get("result", {}).get("TTL", 0)) > 0

    def revoke_lease(self, lease: int, *, timeout: float | None = None) -> None:
        try:
            self._post("lease/revoke", {"ID": lease}, deadline_for(timeout))
        except LeaseExpiredError:
            pass

    def wait_for_change(self, prefix: str, after_revision: int, timeout: float) -> Change:
        total = deadline_for(timeout)
        deadline = time.monotonic() + total
        after = int(after_revision)
        key = _b64(prefix) if prefix else _b64(b"\0")
        create: dict[str, Any] = {
            "key": key,
            "range_end": _b64(_range_end(prefix)),
            "start_revision": after + 1,
        }
        rq = self._requests
        last = "no attempt"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return Change((), after)
            try:
                resp = self._client.session.post(
                    self._client.get_url("watch"),
                    json={"create_request": create},
                    stream=True,
                    timeout=(min(remaining, 2.0), remaining),
                )
            except rq.exceptions.ConnectionError as e:  # etcd down or restarting: retry until the deadline
                last = f"{type(e).__name__}: {e}"
                if deadline - time.monotonic() <= 0.05:
                    raise self._unavailable(last, total) from e
                time.sleep(0.05)
                continue
            except rq.exceptions.Timeout:
                continue  # no response headers before the (short) read timeout: nothing happened yet
            try:
                if resp.status_code != 200:
                    last = f"HTTP {resp.status_code}: {_error_body(resp)}"
                    time.sleep(0.05)
                    continue
                change = self._read_watch(resp, after)
            except (rq.exceptions.RequestException, ValueError):
                change = None  # read timeout (nothing happened), or etcd went away mid-wait: re-watch
            finally:
                resp.close()
            if change is not None:
                return change
            # The stream ended early (etcd closing): pause briefly so a flapping server cannot cause a tight loop.
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def _read_watch(self, resp: Any, after: int) -> Change | None:
        """Read one watch stream until it yields events or a compaction notice; None if it ended."""
        buf = b""
        for chunk in resp.iter_content(chunk_size=None):
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if not line.strip():
                    continue
                result = json.loads(line).get("result", {})
                compact = int(result.get("compact_revision", 0))
                if compact:
                    return Change((), max(after, compact - 1), compacted=True)
                events = tuple(
                    Event(
                        kind="delete" if e.get("type") == "DELETE" else "put",
                        key=_unb64(e["kv"]["key"]),
                        value=_unb64(e["kv"].get("value")),
                        revision=int(e["kv"]["mod_revision"]),
                    )
                    for e in result.get("events", [])
                )
                if events:
                    # etcd never splits one revision's events across responses (no fragmenting asked).
                    return Change(events, max(e.revision for e in events))
        return None

    def close(self) -> None:
        self._closed = True
        self._client.session.close()

    def __enter__(self) -> EtcdStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _not_sent(e: Exception) -> bool:
    """True when a requests ConnectionError happened before the request reached the server."""
    import requests
    import urllib3.exceptions as u

    if isinstance(e, requests.exceptions.ConnectTimeout):
        return True
    reason = getattr(e.args[0], "reason", None) if e.args else None
    return isinstance(reason, (u.NewConnectionError, u.ConnectTimeoutError))


def _error_body(resp: Any) -> str:
    try:
        body = resp.json()
        return str(body.get("message") or body.get("error") or body)
    except ValueError:
        return resp.text[:200]
