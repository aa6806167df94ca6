"""The gradient exchange: its chunks (sender and receiver derive them from the same layers) and a real
exchange between two processes."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_bamboo.engine.replica import (
    CHUNK_NUMEL,
    GradientExchange,
    Replica,
    StageContainer,
    chunk_plan,
)


@pytest.mark.parametrize("numels", [[5], [3, 4, 5, 6, 7, 8], [100, 1, 1, 1, 100], [1] * 40, [9, 9, 9, 9]])
@pytest.mark.parametrize("chunk_numel", [1, 10, 25, 1000])
def test_chunks_cover_every_parameter_once_in_order(numels, chunk_numel):
    chunks = chunk_plan(numels, chunk_numel)
    # consecutive, whole parameters, every element once
    assert chunks[0][0] == 0 and chunks[0][2] == 0
    assert chunks[-1][1] == len(numels) and chunks[-1][3] == sum(numels)
    for (_, end, _, stop), (first, _, start, _) in zip(chunks, chunks[1:], strict=False):
        assert (first, start) == (end, stop)
    for first, end, start, stop in chunks:
        assert first < end and stop - start == sum(numels[first:end])
    # every chunk but the last reaches the size, and none holds more parameters than it needs to
    assert all(stop - start >= chunk_numel for _, _, start, stop in chunks[:-1])
    assert all(sum(numels[first : end - 1]) < chunk_numel for first, end, _, _ in chunks)


def test_a_stage_of_the_benchmark_model_travels_in_several_chunks():
    # a GPT block of width 192: attention in, attention out, MLP in, MLP out (with biases) and two norms
    block = [192 * 576, 576, 192 * 192, 192, 192 * 768, 768, 768 * 192, 192, 192, 192, 192, 192]
    chunks = chunk_plan(block * 3)
    # several chunks, but not a message per parameter
    assert 1 < len(chunks) < len(block) * 3 and all(stop - start >= CHUNK_NUMEL for _, _, start, stop in chunks[:-1])


def test_no_parameters_no_chunks():
    assert chunk_plan([]) == []


# ---------------------------------------------------------------------------------------------------------------
# Two real processes on gloo: stage 0's owner ships, its replica holder receives.

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Stage(torch.nn.Module):
    """Three parameters of 300,000 elements: three chunks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (torch.nn.Parameter(torch.randn(300_000)) for _ in range(3))


def _gradients(stage: _Stage) -> None:
    """Two backwards: the first reaches a and b, the second only a; c never gets a gradient."""
    (stage.a * stage.b).sum().backward()
    (stage.a ** 2).sum().backward()


def _exchange_worker(rank: int, port: int, errors) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        stage = _Stage()
        if rank == 0:
            exchange = GradientExchange(None, send_to=1, recv_from=None)
            _gradients(stage)
            exchange.ship(stage)
            exchange.finish_send()
        else:
            replica = Replica(0, StageContainer({0: _Stage()}), torch.optim.SGD(_Stage().parameters(), lr=0.1))
            exchange = GradientExchange(replica, send_to=None, recv_from=0)
            exchange.post_receive()
            _gradients(stage)  # what the owner computed, bit for bit
            exchange.receive()
            got = replica.module.get_submodule("0")
            for name in "abc":
                want, have = getattr(stage, name).grad, getattr(got, name).grad
                assert (want is None) == (have is None), name
                assert want is None or torch.equal(want, have), name
    except BaseException as err:
        errors.put(f"rank {rank}: {err!r}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_gradients_arrive_exactly_in_chunks():
    """Three chunks and a parameter without a gradient: the holder gets the owner's gradients bit for bit
    (and None where the owner has none)."""
    assert len(chunk_plan([300_000] * 3)) == 3
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_exchange_worker, args=(rank, port, errors)) for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.join(timeout=60)
        assert all(proc.exitcode == 0 for proc in procs), [errors.get(timeout=1) for _ in range(errors.qsize())]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
