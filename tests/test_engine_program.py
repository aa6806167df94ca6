"""The program an engine runs: a stage's schedule compiled to DeepSpeed instructions, and the engine's options."""

from __future__ import annotations

import pytest
from deepspeed.runtime.pipe import schedule as ds_schedule

from lightning_bamboo.engine.pipe import EngineOptions
from lightning_bamboo.engine.program import (
    BambooTrainSchedule,
    RecvReplicaSync,
    RedundantForward,
    ReplicaUpdate,
    SendReplicaSync,
)
from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.schedule import Costs, build_schedule

REPLICA_INSTRUCTIONS = (ReplicaUpdate, SendReplicaSync, RecvReplicaSync, RedundantForward)


def _named(steps):
    return [[(type(cmd).__name__, cmd.kwargs) for cmd in step] for step in steps]


@pytest.mark.parametrize("redundancy", ["lazy", "eager"])
def test_a_stages_program_is_deepspeeds_step_plus_the_replicas_instructions(redundancy):
    for stages in range(2, 6):
        for micro_batches in (1, 3, 8):
            for stage in range(stages):
                ours = BambooTrainSchedule(micro_batches, stages, stage, redundancy)
                steps = list(ours)
                theirs = _named(ds_schedule.TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage))
                # DeepSpeed's instructions, step for step, with the same buffers and order
                assert [[c for c in step if c[0] not in {k.__name__ for k in REPLICA_INSTRUCTIONS}]
                        for step in _named(steps)] == theirs, (stages, micro_batches, stage)
                kinds = [type(cmd) for step in steps for cmd in step]
                assert kinds.count(ReplicaUpdate) == 1 and kinds.count(SendReplicaSync) == 1
                assert RecvReplicaSync not in kinds  # run by the engine once the loss went out
                assert [type(cmd) for cmd in ours.after_loss] == [RecvReplicaSync]
                assert ours.after_loss[0].kwargs == {"stage": (stage + 1) % stages, "peer": (stage + 1) % stages}
                # the update before the first redundant forward; the ship after the optimizer step's finish
                assert kinds.index(ReplicaUpdate) < min([kinds.index(RedundantForward)] if RedundantForward in kinds
                                                        else [len(kinds)])
                assert kinds.index(SendReplicaSync) > kinds.index(ds_schedule.OptimizerStep)
                if redundancy == "lazy":
                    assert RedundantForward not in kinds


def test_eagers_forwards_follow_the_placement_costs():
    counted = {costs: sum(isinstance(cmd, RedundantForward) for step in BambooTrainSchedule(8, 2, 0, "eager", costs)
                          for cmd in step)
               for costs in (None, Costs(forward=1, backward=1.7))}
    assert counted == {None: len(build_schedule(2, 8, "eager").redundant_forwards(0)),
                       Costs(forward=1, backward=1.7):
                           len(build_schedule(2, 8, "eager", costs=Costs(forward=1, backward=1.7)).redundant_forwards(0))}
    assert counted[None] == 3 and counted[Costs(forward=1, backward=1.7)] < 3


@pytest.mark.parametrize("kwargs, message", [
    ({"redundancy": "lasy"}, "redundancy must be one of"),
    ({"rf_costs": "guess"}, "rf_costs must be 'measured' or a Costs"),
    ({"seed": "1"}, "seed must be None or an int"),
])
def test_engine_options_are_checked(kwargs, message):
    with pytest.raises(BambooConfigError, match=message):
        EngineOptions(**kwargs)
    assert EngineOptions().redundancy == "off" and EngineOptions().rf_costs == "measured"
