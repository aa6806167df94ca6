"""Fencing: once a node's lease may have expired, its runtime's writes are refused; reads go on."""

from __future__ import annotations

import threading

import pytest

from lightning_bamboo.membership import EmbeddedServer, connect
from lightning_bamboo.membership.fence import Fenced, FencedStore
from lightning_bamboo.membership.registry import Registry, job_prefix

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
