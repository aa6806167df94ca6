"""Measure latency and bandwidth between two ranks by ping-pong (a collective: every rank calls it)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from lightning_bamboo.errors import BambooConfigError


def _round_trips(tensor: torch.Tensor, rank: int, src: int, dst: int, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        if rank == src:
            dist.send(tensor, dst)
            dist.recv(tensor, dst)
        elif rank == dst:
            dist.recv(tensor, src)
            dist.send(tensor, src)
        if tensor.device.type == "cuda":
            torch.cuda.synchronize(tensor.device)
        times.append(time.perf_counter() - start)
    return times


def measure_link(
    num_bytes: int = 4 * 2**20,
    repeats: int = 5,
    warmup: int = 1,
    src: int = 0,
    dst: int = 1,
    device: str | torch.device = "cpu",
) -> tuple[float, float]:
    """``(bandwidth bytes/s, latency s)`` of the link ``src`` <-> ``dst``, the same on every rank.

    Latency is half the fastest round trip of one byte; bandwidth is ``num_bytes`` over half the
    fastest round trip of ``num_bytes``, latency taken off (the fastest: on a shared host noise
    only adds time). When taking the latency off leaves less than half of the transfer, the
    difference is noise (a loaded host once gave 10^15 bytes/s): then the latency stays in, which
    underestimates the bandwidth by at most 2x instead of making it infinite. Use the device the
    workers send from (``cuda`` under NCCL).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise BambooConfigError(
            "measure_link needs an initialised process group (torch.distributed.init_process_group); "
            "pass the bandwidth instead (Hardware(bandwidth_bytes_per_second=...))"
        )
    world = dist.get_world_size()
    if world < 2 or not (0 <= src < world and 0 <= dst < world) or src == dst:
        raise BambooConfigError(
            f"measure_link needs two distinct ranks of the group (world size: {world}, src: {src}, dst: {dst}); "
            f"with one process there is no link to measure"
        )
    if num_bytes < 2 or repeats < 1 or warmup < 0:
        raise BambooConfigError(
            f"measure_link needs num_bytes >= 2, repeats >= 1, warmup >= 0 (got {num_bytes}, {repeats}, {warmup})"
        )
    rank = dist.get_rank()
    dev = torch.device(device)
    small = _round_trips(torch.zeros(1, dtype=torch.uint8, device=dev), rank, src, dst, warmup + repeats)[warmup:]
    big = _round_trips(torch.zeros(num_bytes, dtype=torch.uint8, device=dev), rank, src, dst, warmup + repeats)[warmup:]
    latency = min(small) / 2
    one_way = min(big) / 2
    transfer = one_way - latency if one_way - latency >= one_way / 2 else one_way
    result = torch.tensor([num_bytes / max(transfer, 1e-9), latency], dtype=torch.float64, device=dev)
    dist.broadcast(result, src)
    bandwidth, latency = (float(v) for v in result.tolist())
    return bandwidth, latency
