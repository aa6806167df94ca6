"""The chunks the gradient exchange sends in: sender and receiver derive them from the same layers."""

from __future__ import annotations

import pytest

from lightning_bamboo.engine.replica import CHUNK_NUMEL, chunk_plan


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
