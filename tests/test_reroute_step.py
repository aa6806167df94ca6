"""The rerouted step's time model (``schedule.reroute``): a lost node's micro-batches on the same stage of the other
pipelines, timed with the step's dependencies."""

from __future__ import annotations

import pytest

from lightning_bamboo.schedule import Costs, ScheduleError
from lightning_bamboo.schedule.reroute import rerouted_step


@pytest.mark.parametrize("costs", [Costs(), Costs(forward=1, backward=1.5)])
@pytest.mark.parametrize(("stages", "micro_batches"), [(1, 3), (2, 1), (2, 2), (4, 4), (4, 8), (6, 3)])
def test_a_healthy_step_takes_the_1f1b_time(stages, micro_batches, costs):
    step = rerouted_step(stages, (micro_batches,) * 2, (), costs)
    assert step.makespan == step.healthy == pytest.approx((micro_batches + stages - 1) * (costs.forward + costs.backward))
    assert step.slowdown == 1.0


@pytest.mark.parametrize(("pipelines", "stages", "micro_batches"), [(2, 2, 2), (2, 4, 4), (3, 4, 6), (4, 6, 6)])
def test_the_lost_nodes_work_moves_to_the_same_stage_and_none_is_lost(pipelines, stages, micro_batches):
    for stage in range(stages):
        step = rerouted_step(stages, (micro_batches,) * pipelines, {(1, stage)})
        busy = dict(step.busy)
        assert (1, stage) not in busy and len(busy) == pipelines * stages - 1
        assert sum(busy.values()) == pytest.approx(pipelines * stages * micro_batches * 3)  # every F and B, once
        helpers = [busy[(q, stage)] for q in range(pipelines) if q != 1]
        assert sum(helpers) == pytest.approx(pipelines * micro_batches * 3)  # the stage's work, on its live nodes
        assert step.makespan >= max(busy.values())


@pytest.mark.parametrize(("pipelines", "stages", "micro_batches"), [(2, 2, 2), (2, 4, 4), (4, 4, 4), (4, 12, 12)])
def test_a_loss_on_the_last_stage_is_never_faster_rerouted_than_dropping_its_pipeline(pipelines, stages, micro_batches):
    # the last stage idles only until the first micro-batch arrives, when every pipeline's arrives: the rerouted work
    # adds to the helpers' own, as the dropped pipeline's micro-batches add to the whole pipelines'
    healthy = rerouted_step(stages, (micro_batches,) * pipelines).makespan
    dropped = rerouted_step(stages, (micro_batches * pipelines // (pipelines - 1),) * (pipelines - 1)).makespan
    rerouted = rerouted_step(stages, (micro_batches,) * pipelines, {(0, stages - 1)})
    assert rerouted.healthy == healthy
    assert rerouted.makespan >= dropped - 1e-9


def test_a_middle_stage_hides_some_of_the_rerouted_work_in_its_idle_slots():
    # 4 pipelines of 12 stages, 12 micro-batches each (the simulator's 48-node job): 4 extra micro-batches on each
    # copy of stage 6 cost less than a dropped pipeline's 4 on every node of the 3 whole ones
    healthy = rerouted_step(12, (12,) * 4).makespan
    dropped = rerouted_step(12, (16,) * 3).makespan / healthy
    middle = rerouted_step(12, (12,) * 4, {(0, 6)}).slowdown
    assert 1.0 < middle < dropped


def test_pipelines_of_one_size_are_alike_and_the_model_checks_its_input():
    first, last = rerouted_step(4, (4, 4, 4), {(0, 1)}), rerouted_step(4, (4, 4, 4), {(2, 1)})
    assert (first.makespan, first.healthy) == (last.makespan, last.healthy)
    assert (0, 1) not in dict(first.busy) and (2, 1) not in dict(last.busy)  # named as asked, whatever was timed
    assert sorted(dict(first.busy).values()) == sorted(dict(last.busy).values())
    with pytest.raises(ScheduleError, match=r"stage 1 has no live node left .*restarts from its checkpoint"):
        rerouted_step(3, (2, 2), {(0, 1), (1, 1)})
    with pytest.raises(ScheduleError, match=r"outside 2 pipeline\(s\) x 3 stage\(s\)"):
        rerouted_step(3, (2, 2), {(2, 0)})
    with pytest.raises(ScheduleError, match="stages must be an int >= 1"):
        rerouted_step(0, (2,))
