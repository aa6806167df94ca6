"""measure_link with real processes (gloo on CPU): every rank gets the same positive numbers."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.planner.network import measure_link


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results.put((rank, measure_link(num_bytes=2**20, repeats=3)))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(90)
def test_three_ranks_agree_on_the_link() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    world = 3
    mp.start_processes(_worker, args=(world, _free_port(), results), nprocs=world, join=True, start_method="spawn")
    found = dict(results.get(timeout=10) for _ in range(world))
    assert sorted(found) == [0, 1, 2]
    assert len(set(found.values())) == 1  # broadcast from the sender: one answer everywhere
    bandwidth, latency = found[0]
    assert bandwidth > 0 and latency > 0


def test_without_a_process_group_it_says_what_to_do() -> None:
    with pytest.raises(BambooConfigError, match="bandwidth"):
        measure_link()
