"""Fencing: once a node's lease may have expired, its runtime's writes are refused; reads go on."""

from __future__ import annotations

import threading
import time

import pytest

from lightning_bamboo.membership import EmbeddedServer, connect
from lightning_bamboo.membership.fence import Fenced, FencedStore
from lightning_bamboo.membership.keys import job_prefix
from lightning_bamboo.membership.lease import Registry
from lightning_bamboo.membership.protocol import StoreUnavailableError

pytestmark = [pytest.mark.timeout(60)]


@pytest.fixture
def store():
    server = EmbeddedServer().start()
    client = connect(server.url)
    try:
        yield client
    finally:
        client.close()
        server.stop()


def test_a_live_node_writes_and_a_node_whose_lease_lapsed_is_fenced(store):
    base = job_prefix("fence")
    node = Registry(store, "fence", "node1", ttl=1.0)
    node.join()
    fenced = FencedStore(store, node)
    fenced.put(f"{base}commit/0/0/node1", "1")  # heartbeats succeed: writes go through
    assert fenced.put_if_absent(f"{base}x", "1")[0] and not fenced.fenced
    node.stop_heartbeat()  # a partition, a frozen machine: no keep-alive gets through any more
    lapsed = threading.Event()
    while not lapsed.wait(0.05):  # bounded by the test's timeout; the lease lapses one TTL after its last renewal
        if node.lease_may_have_expired():
            lapsed.set()
    for write in (lambda: fenced.put(f"{base}commit/0/1/node1", "1"),
                  lambda: fenced.compare_and_put(f"{base}decision/1", '["node0"]', expected_revision=0),
                  lambda: fenced.delete(f"{base}x"), lambda: fenced.delete_prefix(f"{base}commit/"),
                  lambda: fenced.put_if_absent(f"{base}y", "1")):
        with pytest.raises(Fenced, match="node1 refuses to .* its lease may have expired"):
            write()
    assert store.get(f"{base}commit/0/1/node1") is None and store.get(f"{base}decision/1") is None
    assert fenced.get(f"{base}commit/0/0/node1").value == "1"  # it still reads what the others decided
    assert node.lease_may_have_expired()  # once fenced, always fenced


def test_the_store_dropping_the_lease_fences_at_once(store):
    node = Registry(store, "fence2", "node1", ttl=5.0, heartbeat=0.1)
    node.join()
    fenced = FencedStore(store, node)
    store.revoke_lease(node.lease_id)  # as the store does when the lease expires: the next keep-alive says so
    node.lease_lost.wait(5.0)
    with pytest.raises(Fenced):
        fenced.put(f"{job_prefix('fence2')}commit/0/0/node1", "1")


def test_the_store_refuses_a_write_the_node_sent_before_it_knew_its_lease_ended(store):
    # The node's own check passes (its last keep-alive is recent, it has not heard that the lease is
    # gone), as for a write already in flight or sent the moment a partition heals: the store's guard
    # refuses it, in the same step as the write would have been applied.
    base = job_prefix("fence3")
    node = Registry(store, "fence3", "node1", ttl=30.0, heartbeat=10.0)
    node.join()
    fenced = FencedStore(store, node)
    fenced.put(f"{base}commit/0/0/node1", "1")
    store.revoke_lease(node.lease_id)  # the survivors' view: node1's membership is over
    assert not fenced.fenced  # the node does not know yet
    with pytest.raises(Fenced, match="not held by lease"):
        fenced.put(f"{base}commit/0/1/node1", "1")
    with pytest.raises(Fenced):
        fenced.confirm(f"{base}confirmed/node1", "commit checkpoint step-00000001")
    with pytest.raises(Fenced):
        node.announce_loss("node2", "recv failed")  # nor can it declare a healthy peer lost
    assert store.get(f"{base}commit/0/1/node1") is None and store.get(f"{base}lost/node2") is None
    assert store.get(f"{base}confirmed/node1") is None
    node.stop_heartbeat()


def test_a_checkpoint_is_not_committed_when_the_fence_refuses(tmp_path):
    import torch

    from lightning_bamboo import checkpoint as ckpt

    stage = torch.nn.Sequential(torch.nn.Linear(2, 2))
    meta = {"bamboo": ckpt.bamboo_meta(1, [0, 1], 1, None)}

    def shard(fence=None):
        out = ckpt.take_shard(0, stage, None, range(1), writes_layers=True, meta=lambda: meta)
        out.fence = fence
        return out

    ckpt.persist(tmp_path / ckpt.step_name(1), shard(), world_size=1, token="t", timeout=10)

    def refuse(what: str) -> None:
        raise Fenced(f"refuses to {what}")

    with pytest.raises(Fenced, match="commit checkpoint .*step-00000002"):
        ckpt.persist(tmp_path / ckpt.step_name(2), shard(refuse), world_size=1, token="t", timeout=10)
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["step-00000001"]



class _Unresponsive:
    """The store client, with keep-alives that get no answer for ``seconds`` once ``start()`` is called (a store or
    a machine busy for a moment): a call in that window waits for its end, or fails when its own timeout comes
    first, as the real clients do; with ``refuse``, it fails at once (a store restarting: connection refused)."""

    def __init__(self, store, seconds: float, refuse: bool = False) -> None:
        self._store, self._seconds, self._refuse, self.until = store, seconds, refuse, 0.0
        self.calls: list[tuple[float, float]] = []  # (sent, timeout) of each keep-alive

    def start(self, node: Registry) -> None:
        renewed = node.renewed_at
        while node.renewed_at == renewed:  # bounded by the test's timeout: from just after a heartbeat renewed it
            time.sleep(0.02)
        self.until = time.monotonic() + self._seconds

    def __getattr__(self, name):
        return getattr(self._store, name)

    def keep_alive(self, lease_id, *, timeout=None):
        sent = time.monotonic()
        self.calls.append((sent, timeout))
        if sent < self.until:
            if self._refuse:
                raise StoreUnavailableError("connection refused")
            if sent + timeout < self.until:
                time.sleep(timeout)
                raise StoreUnavailableError(f"no answer within {timeout:.2f} s")
            time.sleep(self.until - sent)
        return self._store.keep_alive(lease_id, timeout=timeout)


def _stays_a_member(node: Registry, store, seconds: float) -> None:
    checked_until = time.monotonic() + seconds
    while time.monotonic() < checked_until:
        assert not node.lease_may_have_expired()
        time.sleep(0.02)
    assert store.get(node.node_key(node.node_id)) is not None  # the store kept it a member too


def test_a_store_unresponsive_for_more_than_a_heartbeat_fences_no_one(store):
    """A lease of 2 s, heartbeats every 0.67 s, and keep-alives unanswered for 1.2 s (more than a heartbeat, less
    than the lease): the node stays a member. It used to give up a keep-alive after one heartbeat and try again one
    heartbeat later, when the lease's time was gone: a single slow moment of the store fenced a live node."""
    slow = _Unresponsive(store, 1.2)
    node = Registry(slow, "fence4", "node1", ttl=2.0)
    node.join()
    slow.start(node)
    _stays_a_member(node, store, 3.0)  # the window, and another lease after it
    assert any(timeout > node.heartbeat for sent, timeout in slow.calls if sent < slow.until)  # waited for its end
    node.leave()


def test_a_keep_alive_refused_is_tried_again_at_once(store):
    """Keep-alives refused outright for 1.2 s: the beat tries again every 0.1 s, renews as soon as the store
    answers, and the node is never fenced."""
    refusing = _Unresponsive(store, 1.2, refuse=True)
    node = Registry(refusing, "fence5", "node1", ttl=2.0)
    node.join()
    refusing.start(node)
    _stays_a_member(node, store, 3.0)
    # tried again within the window (a beat a heartbeat apart would have sent one)
    assert len([sent for sent, _ in refusing.calls if sent < refusing.until]) >= 3
    assert node.unreachable_since is None and node.renewed_at >= refusing.until
    node.leave()


def test_a_step_whose_communication_failed_because_this_node_was_declared_lost_says_so(store):
    """A node frozen (or starved) past its lease comes back to find its peers failed over without it: its next
    message fails with 'connection reset by peer'. With no peer lost, the step guard asks the fence, which names
    what happened (``Fenced``, the failed message as its cause) instead of the transport's error."""
    from lightning_bamboo.engine.guard import StepGuard

    node = Registry(store, "thawed", "node0", ttl=1.0)
    node.join()
    fenced = FencedStore(store, node)
    guard = StepGuard(threading.Event(), lambda: (), detection_timeout=0.2,
                      check_fenced=lambda: fenced.check("go on after its communication failed"))

    def step() -> None:
        raise RuntimeError("Connection reset by peer")  # a peer hung up

    with pytest.raises(RuntimeError, match="Connection reset by peer") as live:  # its lease holds: the error stands
        guard.run(step)
    assert not isinstance(live.value, Fenced)
    node.stop_heartbeat()  # frozen: no keep-alive gets through
    deadline = time.monotonic() + 10
    while not node.lease_may_have_expired():
        assert time.monotonic() < deadline, "the lease did not lapse"
        time.sleep(0.05)
    with pytest.raises(Fenced, match="node0 refuses to go on after its communication failed: its lease may have "
                                     "expired .* can join the job again as a new standby node") as thawed:
        guard.run(step)
    assert isinstance(thawed.value.__cause__, RuntimeError)


def test_a_step_blocked_on_peers_that_moved_on_ends_once_this_nodes_lease_may_have_ended(store):
    """Cut off from its peers (a partition), or waiting on an NCCL peer that left, a step may never end by itself:
    the guard checks the fence while it waits, and once this node's lease may have ended it aborts the generation's
    communication and raises ``Fenced`` (here the blocked step ignores the abort: the guard gives it
    ``finish_within`` and raises all the same)."""
    from lightning_bamboo.engine.guard import StepGuard

    node = Registry(store, "cut", "node0", ttl=1.0)
    node.join()
    fenced = FencedStore(store, node)
    guard = StepGuard(threading.Event(), lambda: (), detection_timeout=5.0, finish_within=0.5,
                      check_fenced=lambda: fenced.check("go on with its step"))
    never = threading.Event()
    assert guard.run(lambda: 7) == 7  # a live node's step returns its value
    node.stop_heartbeat()
    with pytest.raises(Fenced, match="node0 refuses to go on with its step"):
        guard.run(never.wait)  # the fence, not the detection timeout (that would raise no Fenced), ended it
    never.set()


def test_a_guarded_collective_after_the_job_is_not_fenced_by_the_lease_its_stop_let_lapse(store):
    """``trainer.save_checkpoint()`` after ``fit`` runs its collectives under the step guard after the session
    stopped (the heartbeat with it), possibly more than a lease later: the node ended a member, so the guard lets it
    run. (Asking the lease itself, as during the job, refused such a save.)"""
    from lightning_bamboo.runtime.session import Session

    class NoGroups:
        def reform(self, store, job, generation, order, me, *, timeout, tag, gone):
            return list(order).index(me), len(order)

        def abort(self) -> None:
            pass

    session = Session(store, "ended", "node0", ["node0"], groups=NoGroups(), detection_timeout=1.0,
                      rendezvous_timeout=20.0).open()
    assert session.guard().run(lambda: 5) == 5
    session.stop()
    deadline = time.monotonic() + 10
    while not session.registry.lease_may_have_expired():
        assert time.monotonic() < deadline, "the lease did not lapse after the heartbeat stopped"
        time.sleep(0.05)
    assert session.guard().run(lambda: time.sleep(0.3) or 6) == 6  # a save takes a while: the guard looks meanwhile
