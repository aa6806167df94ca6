"""The data path of a job whose number of pipelines changes: global steps, and each pipeline's share of one."""

from __future__ import annotations

import pytest

from lightning_bamboo.data import StepSampler
from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.topology import pipeline_share


def test_every_node_gets_the_same_global_steps_in_one_order():
    sampler = StepSampler(range(20), global_batch=8, shuffle=False)
    assert list(sampler) == [list(range(8)), list(range(8, 16)), [16, 17, 18, 19]] and len(sampler) == 3
    shuffled = StepSampler(range(20), global_batch=8, shuffle=True, seed=3)
    first = list(shuffled)
    assert sorted(i for step in first for i in step) == list(range(20)) and first != list(sampler)
    shuffled.set_epoch(1)
    assert list(shuffled) != first  # a new order per epoch, the same on every node (seed + epoch)
    assert shuffled.sampler is shuffled  # where Lightning looks for set_epoch


def test_a_short_last_step_is_padded_to_a_multiple_or_dropped():
    assert list(StepSampler(range(10), 8, shuffle=False, multiple=4))[-1] == [8, 9, 0, 1]
    assert list(StepSampler(range(10), 8, shuffle=False, drop_last=True)) == [list(range(8))]


def test_resuming_at_a_cursor_sees_the_rest_of_the_epoch_then_whole_epochs():
    sampler = StepSampler(range(24), global_batch=8, shuffle=True, seed=1)
    whole = list(sampler)
    sampler.resume_at(0, 16)
    assert list(sampler) == whole[2:] and len(sampler) == 3  # Lightning counts the steps already done
    sampler.set_epoch(1)
    assert len(list(sampler)) == 3


def test_pipeline_shares_cover_every_micro_batch_once_whatever_the_number_of_pipelines():
    assert [pipeline_share(16, 2, 2, p) for p in range(2)] == [(0, 4, 8), (4, 4, 8)]
    assert [pipeline_share(16, 2, 3, p) for p in range(3)] == [(0, 3, 8), (3, 3, 8), (6, 2, 8)]
    for pipelines in range(1, 9):
        covered = [i for p in range(pipelines) for i in range(*_span(pipeline_share(16, 2, pipelines, p)))]
        assert covered == list(range(8))


def _span(share: tuple[int, int, int]) -> tuple[int, int]:
    first, count, _ = share
    return first, first + count


@pytest.mark.parametrize(("args", "message"), [
    ((6, 4, 1, 0), r"global batch of 6 samples .* not a multiple of micro_batch_size 4"),
    ((8, 2, 5, 0), r"cannot give 5 pipelines at least one micro-batch each out of 4"),
])
def test_bad_shares_are_refused(args, message):
    with pytest.raises(BambooConfigError, match=message):
        pipeline_share(*args)


def test_a_dataloader_with_its_own_distributed_sampler_is_kept_and_told_what_a_resume_does(caplog):
    """The strategy keeps a user's ``DistributedSampler`` as it is (its shards are the pipelines'), and says, once per
    loader, that a run resumed mid-epoch then starts the epoch again, and what to pass instead."""
    import logging

    import torch

    from lightning_bamboo.strategy.loading import PipelineData

    data = list(range(32))
    own = torch.utils.data.DataLoader(data, batch_size=4, sampler=torch.utils.data.DistributedSampler(
        data, num_replicas=1, rank=0, shuffle=True, seed=0))
    with caplog.at_level(logging.WARNING, logger="lightning_bamboo.strategy.loading"):
        assert PipelineData().loader(own, True, 1, 0, update=None) is own
    assert "starts the epoch again; pass shuffle=True or False instead" in caplog.text
    plain = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    steps = PipelineData().loader(plain, True, 1, 0, update=None)
    assert [len(b) for b in steps.batch_sampler][:2] == [4, 4]  # the strategy's global steps, resumable
