"""A rank's program as DeepSpeed-like instructions, the form the pipeline engine runs."""

from __future__ import annotations

from lightning_bamboo.schedule.action import Action, Kind
from lightning_bamboo.schedule.program import Schedule

_DEEPSPEED_NAMES = {
    Kind.LOAD: "LoadMicroBatch", Kind.FORWARD: "ForwardPass", Kind.BACKWARD: "BackwardPass",
    Kind.SEND_ACT: "SendActivation", Kind.RECV_ACT: "RecvActivation", Kind.SEND_GRAD: "SendGrad",
    Kind.RECV_GRAD: "RecvGrad", Kind.REDUCE_TIED: "ReduceTiedGrads", Kind.REDUCE: "ReduceGrads",
    Kind.OPTIMIZER: "OptimizerStep", Kind.REDUNDANT_FORWARD: "RedundantForward",
    Kind.REDUNDANT_BACKWARD: "RedundantBackward", Kind.SEND_SYNC: "SendReplicaSync",
    Kind.RECV_SYNC: "RecvReplicaSync", Kind.REPLICA_UPDATE: "ReplicaUpdate",
}
_REPLICA_KINDS = (Kind.REDUNDANT_FORWARD, Kind.REDUNDANT_BACKWARD, Kind.SEND_SYNC, Kind.RECV_SYNC, Kind.REPLICA_UPDATE)


def deepspeed_steps(schedule: Schedule, rank: int) -> list[list[tuple[str, dict[str, int], Action]]]:
    """``rank``'s program as DeepSpeed-like instructions: per step, ``(class name, kwargs, action)``.

    DeepSpeed's own instructions (LoadMicroBatch, ForwardPass, BackwardPass, Send/RecvActivation,
    Send/RecvGrad) get ``{"buffer_id": Schedule.buffer_id(action)}``; ReduceTiedGrads, ReduceGrads and
    OptimizerStep get ``{}`` — for ``redundancy="off"`` this equals TrainSchedule's ``(type(cmd).__name__,
    cmd.kwargs)`` step for step. The replica's instructions (RedundantForward, RedundantBackward, ReplicaUpdate,
    SendReplicaSync, RecvReplicaSync) get ``stage``, ``micro_batch``/``buffer_id`` and ``peer`` as applicable. On a rank that
    runs two stages read ``action.stage`` to pick the stage's module and buffers.
    """
    out = []
    for tick in schedule.programs[rank]:
        step = []
        for a in tick:
            kwargs: dict[str, int] = {}
            if a.kind in _REPLICA_KINDS:
                kwargs["stage"] = a.stage  # type: ignore[assignment]
                if a.micro_batch is not None:
                    kwargs["micro_batch"] = a.micro_batch
                if a.peer is not None:
                    kwargs["peer"] = a.peer
            buf = schedule.buffer_id(a)
            if buf is not None:
                kwargs["buffer_id"] = buf
            step.append((_DEEPSPEED_NAMES[a.kind], kwargs, a))
        out.append(step)
    return out
