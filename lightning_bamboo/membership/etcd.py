"""etcd v3 membership store (``etcd://HOST:PORT``) over etcd's JSON gateway, using etcd3gw's client."""

from __future__ import annotations

import base64
import json
import logging
import math
import re
import time
from typing import Any

from lightning_bamboo.membership.credentials import PASSWORD_ENV, EtcdCredentials
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
    StorePermissionError,
    StoreTimeoutError,
    StoreUnavailableError,
    deadline_for,
)

log = logging.getLogger(__name__)

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
    ``request_timeout`` bounds a call given no timeout of its own.
    """

    def __init__(self, host: str, port: int, *, connect_timeout: float = 5.0, request_timeout: float = DEFAULT_TIMEOUT,
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
        self.request_timeout = deadline_for(request_timeout)
        creds = self._credentials = credentials or EtcdCredentials()
        query = creds.query()
        self.url = f"etcd://{host}:{port}" + (f"?{query}" if query else "")
        creds.check_files(self.url)
        session = _session(requests, creds)
        self._client = etcd3gw.client(host=host, port=port, timeout=connect_timeout,
                                      protocol="https" if creds.tls else "http", session=session)
        adapter = HTTPAdapter(pool_connections=4, pool_maxsize=32)
        self._client.session.mount("http://", adapter)
        self._client.session.mount("https://", adapter)
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
                if _certificate_refused(str(cause)) or "HTTP request to an HTTPS server" in str(e):
                    raise self._tls_refused(cause) from None
            if time.monotonic() + 0.1 >= deadline:
                raise self._unavailable(last, connect_timeout)
            time.sleep(0.1)
        if creds.user is not None:
            self._authenticate(connect_timeout)

    def _tls_refused(self, cause: BaseException) -> StoreCredentialsError:
        if not self._credentials.tls:
            return StoreCredentialsError(f"etcd at {self.url} serves TLS: give cacert= (the CA that signed its "
                                         "certificate) and, if it asks for one, cert= and key= (--cacert, --cert, --key)")
        found = re.search(r"\[SSL[^\]]*\][^()'\"]*", str(cause))
        reason = found.group(0).strip() if found else _one_line(str(cause))[-200:]
        return StoreCredentialsError(
            f"TLS with etcd at {self.url} failed ({reason}); check cacert= (the CA that signed etcd's certificate) "
            "and cert=/key= (a client certificate signed by a CA etcd trusts)")

    def _authenticate(self, timeout: float) -> None:
        """Log in as the URL's user (its password from the environment or a file: ``credentials``); every request
        then carries the token etcd gave (and logs in again when etcd says the token expired)."""
        password = self._credentials.password(self.url)
        self._client.session.headers.pop("Authorization", None)
        resp = self._post("auth/authenticate", {"name": self._credentials.user, "password": password}, timeout,
                          login=False)
        self._client.session.headers["Authorization"] = str(resp["token"])

    def _unavailable(self, why: str, timeout: float) -> StoreUnavailableError:
        host, port, scheme = self._client.host, self._client.port, self._client.protocol
        return StoreUnavailableError(
            f"etcd at {self.url} did not answer within {timeout:.1f} s ({why}). Start etcd there, e.g. "
            f"`etcd --listen-client-urls {scheme}://{host}:{port} --advertise-client-urls {scheme}://{host}:{port}`, "
            "or check --store (use --store embedded for a single machine)"
            + ("" if self._credentials.tls else "; if etcd serves TLS, give cacert= (and cert=, key=) in the URL")
        )

    def _refused(self, path: str, payload: dict[str, Any], body: str) -> StoreError | None:
        """The error for etcd's refusal of a request on the grounds of who asks (None: not such a refusal)."""
        user = self._credentials.user
        if "authentication failed" in body:
            return StoreCredentialsError(
                f"etcd at {self.url} refused user {user!r}: {body}; check the password in ${PASSWORD_ENV} or the "
                "file password-file= names")
        if "user name is empty" in body or "user name not found" in body:
            return StoreCredentialsError(
                f"etcd at {self.url} has authentication on and this process gave no user it knows ({body}); give "
                f"user=NAME (--user) and its password in ${PASSWORD_ENV} or a file named by password-file=")
        if "CommonName of client" in body:
            return StoreCredentialsError(
                f"etcd at {self.url} refuses, through its JSON gateway (this client's way in) and with authentication "
                "on, a client certificate that has a CommonName (it cannot map it to a user); use cert=/key= of a "
                "certificate without a CN (e.g. subject /O=NAME), and user= with its password for who you are")
        if "authentication is not enabled" in body:
            return StoreCredentialsError(f"etcd at {self.url} has authentication off, but user={user} was given; "
                                         "drop user=, or turn authentication on (etcdctl auth enable)")
        if "permission denied" in body:
            key = _unb64(payload.get("key") or _txn_key(payload))
            what = f"{key!r}" if key else f"lease {payload.get('ID')} (its keys)"
            return StorePermissionError(
                f"etcd at {self.url} refused {path} on {what} to user {user!r}: permission denied; nothing was "
                f"changed. Give the user's role readwrite on the job's prefix (etcdctl role grant-permission ROLE "
                f"readwrite --prefix=true {_job_prefix_of(key) if key else '/bamboo/JOB/'})")
        return None

    # -- transport --
    def _post(
        self, path: str, payload: dict[str, Any], timeout: float, *, idempotent: bool = True, login: bool = True
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
            sent = time.monotonic()
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
                if _certificate_refused(str(e)):  # no retry will change that (a TLS EOF, a reset: retried below)
                    raise self._tls_refused(e) from None
                last = f"{type(e).__name__}: {e}"
                if not idempotent and not (isinstance(e, rq.exceptions.ConnectionError) and _not_sent(e)):
                    raise _Ambiguous(last) from e
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 0.25)
                continue
            if (took := time.monotonic() - sent) > SLOW_ANSWER_SECONDS:
                log.warning("etcd at %s is slow: %s answered after %.1f s (the request's bound: %.1f s)",
                            self.url, path, took, timeout)
            if resp.status_code == 200:
                return resp.json()
            body = _error_body(resp)
            if login and self._credentials.user is not None and _token_expired(body):
                self._authenticate(max(remaining, FIRST_ATTEMPT_SECONDS))  # then the request again, as it was
                login = False
                continue
            refused = self._refused(path, payload, body)
            if refused is not None:
                raise refused
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

    def _deadline(self, timeout: float | None) -> float:
        return deadline_for(timeout, self.request_timeout)

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
            return int(self._guarded(guard, {"request_put": payload}, self._deadline(timeout))["header"]["revision"])
        return int(self._post("kv/put", payload, self._deadline(timeout))["header"]["revision"])

    def get(self, key: str, *, timeout: float | None = None) -> KeyValue | None:
        kvs = self._post("kv/range", {"key": _b64(key)}, self._deadline(timeout)).get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str, *, timeout: float | None = None) -> Snapshot:
        key = _b64(prefix) if prefix else _b64(b"\0")
        resp = self._post(
            "kv/range", {"key": key, "range_end": _b64(_range_end(prefix))}, self._deadline(timeout)
        )
        return Snapshot(tuple(_kv(d) for d in resp.get("kvs", [])), int(resp["header"]["revision"]))

    def _delete_range(self, payload: dict[str, Any], timeout: float | None, guard: Guard | None) -> int:
        if guard is not None:
            done = self._guarded(guard, {"request_delete_range": payload}, self._deadline(timeout))
            return int(done.get("response_delete_range", {}).get("deleted", 0))
        return int(self._post("kv/deleterange", payload, self._deadline(timeout)).get("deleted", 0))

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
        t = self._deadline(timeout)
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
        resp = self._post("lease/grant", {"TTL": max(1, math.ceil(ttl)), "ID": 0}, self._deadline(timeout))
        if resp.get("error"):
            raise StoreError(f"etcd at {self.url} refused a lease of {ttl} s: {resp['error']}")
        return Lease(int(resp["ID"]), float(resp["TTL"]))

    def keep_alive(self, lease: int, *, timeout: float | None = None) -> bool:
        resp = self._post("lease/keepalive", {"ID": lease}, self._deadline(timeout))
        return int(resp.get("result", {}).get("TTL", 0)) > 0

    def revoke_lease(self, lease: int, *, timeout: float | None = None) -> None:
        try:
            self._post("lease/revoke", {"ID": lease}, self._deadline(timeout))
        except LeaseExpiredError:
            pass

    def wait_for_change(self, prefix: str, after_revision: int, timeout: float) -> Change:
        total = self._deadline(timeout)
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
                    self._after_refusal(last, create)
                    time.sleep(0.05)
                    continue
                change = self._read_watch(resp, after, create)
            except (rq.exceptions.RequestException, ValueError):
                change = None  # read timeout (nothing happened), or etcd went away mid-wait: re-watch
            finally:
                resp.close()
            if change is not None:
                return change
            # The stream ended early (etcd closing): pause briefly so a flapping server cannot cause a tight loop.
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def _after_refusal(self, why: str, create: dict[str, Any]) -> None:
        """A watch refused: log in again when the token expired; raise when the credentials do not allow it."""
        if self._credentials.user is not None and _token_expired(why):
            self._authenticate(FIRST_ATTEMPT_SECONDS)
            return
        refused = self._refused("watch", create, why)
        if refused is not None:
            raise refused

    def _read_watch(self, resp: Any, after: int, create: dict[str, Any]) -> Change | None:
        """Read one watch stream until it yields events or a compaction notice; None if it ended."""
        buf = b""
        for chunk in resp.iter_content(chunk_size=None):
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if not line.strip():
                    continue
                result = json.loads(line).get("result", {})
                if result.get("canceled") and result.get("cancel_reason"):
                    self._after_refusal(str(result["cancel_reason"]), create)
                    return None
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


def _session(requests: Any, creds: EtcdCredentials) -> Any:
    """A requests session that verifies etcd's certificate with ``cacert`` (even where $REQUESTS_CA_BUNDLE is set:
    requests lets that variable override a session's own CA) and presents the client certificate."""

    class Session(requests.Session):  # type: ignore[misc,name-defined]
        def merge_environment_settings(self, *args: Any, **kwargs: Any) -> Any:
            settings = super().merge_environment_settings(*args, **kwargs)
            if creds.cacert is not None:
                settings["verify"] = creds.cacert
            return settings

    session = Session()
    if creds.cacert is not None:
        session.verify = creds.cacert
    if creds.cert is not None:
        session.cert = (creds.cert, creds.key)
    return session


#: what OpenSSL says when a certificate is refused, by either side (not a connection cut short: that is retried)
_CERTIFICATE_REFUSALS = ("CERTIFICATE_VERIFY_FAILED", "ALERT_BAD_CERTIFICATE", "ALERT_UNKNOWN_CA",
                         "CERTIFICATE_REQUIRED", "ALERT_CERTIFICATE_", "WRONG_VERSION_NUMBER", "ALERT_HANDSHAKE_FAILURE")


def _certificate_refused(text: str) -> bool:
    return any(refusal in text for refusal in _CERTIFICATE_REFUSALS)


def _token_expired(body: str) -> bool:
    """etcd's answer to a request whose token it no longer takes (expired, or its auth store changed)."""
    return "invalid auth token" in body or "revision of auth store is old" in body


def _txn_key(payload: dict[str, Any]) -> str | None:
    for op in payload.get("success", []):
        for request in op.values():
            if isinstance(request, dict) and request.get("key"):
                return str(request["key"])
    return None


def _job_prefix_of(key: str) -> str:
    """``/bamboo/<job>/`` of a job's key (the prefix an etcd role grants), else the key itself."""
    parts = key.split("/")
    return "/".join(parts[:3]) + "/" if len(parts) > 3 and parts[1] == "bamboo" else key


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _error_body(resp: Any) -> str:
    try:
        body = resp.json()
        return str(body.get("message") or body.get("error") or body)
    except ValueError:
        return resp.text[:200]
