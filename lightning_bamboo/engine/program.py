"""The training step an engine with a replica runs: its stage's program of ``schedule.build_schedule``, as
DeepSpeed instructions.

DeepSpeed's own instructions come out as ``TrainSchedule`` yields them (the same steps, buffers and order); the
replica's actions of the schedule are instructions of their own, which ``BambooPipelineEngine`` executes:

- ``ReplicaUpdate`` (``U``): apply the replica's update that the last step committed, where the builder put it
  (``schedule.build.updates_replica_at_end``: the rank's longest wait), and before the first redundant forward.
- ``RedundantForward`` (``RF``): the successor's forward, its graph kept for a lazy backward.
- ``SendReplicaSync`` (``S>``): ship the gradients ``OptimizerStep`` finished to the replica's holder.
- ``RecvReplicaSync`` (``S<``): wait for the replica's gradients. The schedule puts it last; DeepSpeed
  broadcasts the step's loss after the schedule, so these run after that (:attr:`BambooTrainSchedule.after_loss`):
  the loss goes out first, and the first stage, whose replica the last stage holds, ships last of all.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

from deepspeed.runtime.pipe import schedule as ds_schedule

from lightning_bamboo.schedule import Costs, build_schedule, deepspeed_steps


class RedundantForward(ds_schedule.PipeInstruction):
    """Forward of the replica (the successor's stage) on micro-batch ``micro_batch``, its graph kept.

    The input is what this stage sent the successor for that micro-batch (the loaded inputs
    when the replica is stage 0, on the last stage). The output and the graph (its saved tensors
    in host memory) are what a lazy backward of the successor's stage needs after a failure;
    they are freed when the step commits.
    """


class ReplicaUpdate(ds_schedule.PipeInstruction):
    """Apply the replica's committed update of the last step (its weights for this step)."""


class SendReplicaSync(ds_schedule.PipeInstruction):
    """Ship this stage's finished gradients (unscaled, clipped) to the holder of its replica, without waiting."""


class RecvReplicaSync(ds_schedule.PipeInstruction):
    """Wait for the gradients of the replica this rank holds (applied by the next step's ``ReplicaUpdate``)."""


_REPLICA_INSTRUCTIONS: dict[str, type[ds_schedule.PipeInstruction]] = {
    cls.__name__: cls for cls in (RedundantForward, ReplicaUpdate, SendReplicaSync, RecvReplicaSync)}


def _instruction(name: str, kwargs: dict[str, int]) -> ds_schedule.PipeInstruction:
    cls = _REPLICA_INSTRUCTIONS.get(name) or getattr(ds_schedule, name)
    return cls(**kwargs)


@functools.lru_cache(maxsize=64)
def program_steps(stages: int, micro_batches: int, stage_id: int, redundancy: str, costs: Costs | None = None,
                  kept: tuple[bool, ...] | None = None) -> tuple[tuple[tuple[str, dict[str, int]], ...], ...]:
    """The steps of one stage as (instruction name, kwargs), built once per shape, mode, costs and kept replicas
    (eager's placement simulates every rank: milliseconds, not to be paid every step)."""
    schedule = build_schedule(stages, micro_batches, redundancy, costs=costs if redundancy == "eager" else None,
                              kept=kept)
    return tuple(tuple((name, kwargs) for name, kwargs, _action in step)
                 for step in deepspeed_steps(schedule, stage_id))


class BambooTrainSchedule(ds_schedule.TrainSchedule):
    """DeepSpeed's ``TrainSchedule`` running ``build_schedule(stages, micro_batches, redundancy)``'s program of
    ``stage_id`` (``redundancy`` ``"lazy"`` or ``"eager"``; ``costs``: where eager's RFs are placed, None for
    the schedule model's F = 1, B = 2; ``kept``: the stages whose replicas are held, None for every one: a rank
    holding no replica gets no ``U``/``S<``, a stage without one no ``S>``). ``steps()`` yields all but the replica
    receives, :attr:`after_loss`."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, redundancy: str,
                 costs: Costs | None = None, kept: tuple[bool, ...] | None = None) -> None:
        super().__init__(micro_batches, stages, stage_id)
        self.redundancy, self.costs, self.kept = redundancy, costs, kept
        self.program = program_steps(stages, micro_batches, stage_id, redundancy, costs, kept)
        #: the receives of the replica's gradients, run by the engine once the step's loss went out
        self.after_loss = [_instruction(name, kwargs) for step in self.program for name, kwargs in step
                           if name == "RecvReplicaSync"]

    def steps(self) -> Iterator[list[ds_schedule.PipeInstruction]]:
        for step in self.program:
            yield [_instruction(name, kwargs) for name, kwargs in step if name != "RecvReplicaSync"]


def redundant_forwards_placed(stages: int, micro_batches: int, stage_id: int, costs: Costs | None) -> int:
    """RFs per step that eager places on ``stage_id`` with ``costs``."""
    return sum(1 for step in program_steps(stages, micro_batches, stage_id, "eager", costs)
               for name, _ in step if name == "RedundantForward")
