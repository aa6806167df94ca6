"""measure_link with real processes (gloo on CPU): every rank gets the same positive numbers."""

from __future__ import annotations

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.membership.address import free_port
from lightning_bamboo.planner.network import measure_link


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
    mp.start_processes(_worker, args=(world, free_port(), results), nprocs=world, join=True, start_method="spawn")
    found = dict(results.get(timeout=10) for _ in range(world))
    assert sorted(found) == [0, 1, 2]
    assert len(set(found.values())) == 1  # broadcast from the sender: one answer everywhere
    bandwidth, latency = found[0]
    assert bandwidth > 0 and latency > 0


def test_without_a_process_group_it_says_what_to_do() -> None:
    with pytest.raises(BambooConfigError, match="bandwidth"):
        measure_link()


def test_noise_larger_than_the_transfer_gives_a_finite_bandwidth(monkeypatch) -> None:
    """On a loaded host the 1-byte round trip once took longer than the 1 MiB one: 10^15 bytes/s came out."""
    import lightning_bamboo.planner.network as network

    # seconds per round trip; the first of each list is the warm-up, not counted
    trips = {1: [0.0001, 0.004, 0.002, 0.003], 2**20: [0.0001, 0.0015, 0.0030, 0.0018]}
    monkeypatch.setattr(network.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(network.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(network.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(network.dist, "broadcast", lambda tensor, src: None)
    monkeypatch.setattr(network, "_round_trips", lambda tensor, *args: trips[tensor.numel()])
    bandwidth, latency = network.measure_link(num_bytes=2**20)
    assert latency == pytest.approx(0.001)  # half the fastest 1-byte round trip
    assert bandwidth == pytest.approx(2**20 / 0.00075)  # latency left in: half the fastest 1 MiB round trip
    trips[1], trips[2**20] = [0.0001, 0.002, 0.003], [0.0001, 0.0102, 0.011]  # a transfer well above the latency: latency taken off
    assert network.measure_link(num_bytes=2**20, repeats=2)[0] == pytest.approx(2**20 / (0.0051 - 0.001))
