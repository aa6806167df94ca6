"""A step thread left behind by a failover must never communicate again (no process group needed but one)."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_bamboo.engine.pipe import ABANDONED, AbandonedStep, PeerLost, StepGuard
from lightning_bamboo.engine.replica import GradientExchange


def test_an_abandoned_step_thread_raises_before_its_next_call() -> None:
    lost, blocked = threading.Event(), threading.Event()
    calls: list[str] = []
    ended: list[BaseException] = []

    def next_send() -> None:  # stands for DeepSpeed's next p2p call after the blocked one returns
        calls.append("send on whatever group is the default now")

    def step() -> None:
        try:
            blocked.wait()  # a receive from a peer that answers only after the failover moved on
            next_send()
        except BaseException as err:
            ended.append(err)
            raise

    guard = StepGuard(lost, lambda: ("node4",), detection_timeout=1.0)
    threading.Timer(0.2, lost.set).start()
    with pytest.raises(PeerLost, match="node4"):
        guard.run(step)
    thread = ABANDONED[-1]
    assert thread.is_alive()
    blocked.set()  # the old group's receive completes
    thread.join(timeout=5.0)
    assert not thread.is_alive()
    assert calls == []
    assert len(ended) == 1 and isinstance(ended[0], AbandonedStep)


def test_the_gradient_exchange_keeps_the_group_it_was_made_in() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=10))
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore("g0", store), rank=0, world_size=1)
        exchange = GradientExchange(None, send_to=None, recv_from=None)
        old = dist.group.WORLD
        assert exchange.group is old
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.PrefixStore("g1", store), rank=0, world_size=1)
        assert dist.group.WORLD is not old and exchange.group is old  # never the failover's new group
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
