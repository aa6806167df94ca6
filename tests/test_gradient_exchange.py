"""The gradient exchange's parts that need no peer: its chunks (sender and receiver derive them from the
same layers) and the helper thread that copies and sends during the last backward."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_bamboo.engine.replica import CHUNK_NUMEL, _Copier, chunk_plan


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
    # several chunks that can leave one by one, but not a message per parameter
    assert 1 < len(chunks) < len(block) * 3 and all(stop - start >= CHUNK_NUMEL for _, _, start, stop in chunks[:-1])


def test_no_parameters_no_chunks():
    assert chunk_plan([]) == []


def test_the_copier_runs_jobs_in_order_and_drain_waits_for_them():
    copier, gate, done = _Copier(), threading.Event(), []
    dst = torch.zeros(4)
    copier.submit(gate.wait)  # holds the thread until released
    copier.submit(lambda: dst.copy_(torch.arange(4.0)))
    copier.submit(lambda: done.append(dst.sum().item()))
    threading.Timer(0.2, gate.set).start()
    copier.drain()
    assert done == [6.0] and torch.equal(dst, torch.arange(4.0))
    copier.close()


def test_a_failed_job_surfaces_at_drain_and_skips_the_rest():
    copier, ran = _Copier(), []
    copier.submit(lambda: torch.zeros(3).copy_(torch.zeros(5)))  # wrong size
    copier.submit(lambda: ran.append(1))
    with pytest.raises(RuntimeError, match="sending gradients early failed"):
        copier.drain()
    assert ran == []
    copier.submit(lambda: ran.append(2))  # the error was handed over: later jobs run again
    copier.drain()
    assert ran == [2]
    copier.close()


def test_drain_after_close_raises_instead_of_waiting_forever():
    copier = _Copier()
    copier.close()
    copier._thread.join(timeout=5)
    with pytest.raises(RuntimeError, match="closed"):
        copier.drain()
