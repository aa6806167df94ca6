"""The communication process's connect to its generation's store ends when a member is lost, or at its timeout:
a store whose host died meanwhile (a failover inside a failover) must not hold a node for the whole timeout."""

from __future__ import annotations

import socket
import threading

import pytest

from lightning_bamboo.engine.comm_process import CommAborted, CommProcess

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
