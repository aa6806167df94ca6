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
