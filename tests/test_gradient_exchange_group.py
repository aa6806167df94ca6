"""The gradient exchange stays on the process group it was made in (a failover's new group is never its)."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

from lightning_bamboo.engine.exchange import GradientExchange


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
