"""The communication process's connect to its generation's store, and the worker's own client of the store the new
rank 0 hosts, end when a member is lost, or at their timeout: a store whose host died meanwhile (a failover inside a
failover, a reconfiguration whose first node's machine was killed) must not hold a node for the whole timeout."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from lightning_bamboo.engine.comm_process import CommAborted, CommProcess
from lightning_bamboo.engine.groups import reform_process_group
from lightning_bamboo.errors import PeerLost
from lightning_bamboo.membership import EmbeddedServer, connect
from lightning_bamboo.membership.keys import JobKeys

pytestmark = pytest.mark.timeout(120)  # a hang guard: without the fix the first case waits 2 x 600 s


def _closed_port() -> int:
    """A port nobody listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_loss_ends_the_wait_for_a_store_that_is_gone():
    lost = threading.Event()
    threading.Timer(1.0, lost.set).start()
    with pytest.raises(CommAborted, match=r"did not reach the store .* \(a member was lost\)"):
        CommProcess("127.0.0.1", _closed_port(), "gone", timeout=600.0, abort_if=lost.is_set)
    assert lost.is_set()  # it ended because of the loss, not before it


def test_without_a_loss_the_wait_ends_at_the_timeout():
    with pytest.raises(CommAborted, match=r"did not reach the store .* \(not within 2 s\)"):
        CommProcess("127.0.0.1", _closed_port(), "gone", timeout=2.0)


def test_a_loss_ends_a_joining_nodes_connect_to_the_new_groups_store():
    # a chaos run: the new group's first node published its store's address and its machine was killed; the others
    # waited 60 s in torch's connect, then failed and their supervisors exited 1
    server = EmbeddedServer().start()
    try:
        store = connect(server.url)
        store.put(JobKeys("gone").process_group(3, "reconf"), json.dumps({"host": "127.0.0.1", "port": _closed_port()}))
        lost = threading.Event()
        threading.Timer(1.5, lost.set).start()
        with pytest.raises(PeerLost, match=r"\['n0'\] lost before the new process group formed \(its store at "):
            reform_process_group(store, "gone", 3, ["n0", "n1"], "n1", timeout=90.0, tag="reconf",
                                 gone=lambda: {"n0"} if lost.is_set() else set())
        assert lost.is_set()
    finally:
        server.stop()
