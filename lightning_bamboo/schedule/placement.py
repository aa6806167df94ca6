"""Where stages and replicas sit in the ring, and DeepSpeed's buffers of a stage."""

from __future__ import annotations


def replica_stage(rank: int, stages: int) -> int:
    """The stage whose replica node ``rank`` holds: its successor in the ring, ``(rank + 1) % stages``."""
    return (rank + 1) % stages


def num_pipe_buffers(stage: int, stages: int, micro_batches: int) -> int:
    """Buffers DeepSpeed's TrainSchedule allocates on ``stage``: ``max(2, min(stages - stage, micro_batches))``."""
    return max(2, min(stages - stage, micro_batches))


def buffer_id(stage: int, micro_batch: int, stages: int, micro_batches: int) -> int:
    """DeepSpeed's buffer of ``micro_batch`` on ``stage`` (cyclic): ``micro_batch % num_pipe_buffers``."""
    return micro_batch % num_pipe_buffers(stage, stages, micro_batches)
