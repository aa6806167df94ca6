"""The schedule's action IR: ``Kind``, ``Action`` and its string form, ``ScheduleError``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from lightning_bamboo.errors import BambooConfigError

REDUNDANCY_MODES = ("off", "lazy", "eager")


class ScheduleError(BambooConfigError):
    """A schedule breaks a rule; ``rank``, ``step`` and ``action`` say where (None when not tied to one)."""

    def __init__(self, message: str, rank: int | None = None, step: int | None = None,
                 action: Action | None = None) -> None:
        where = []
        if rank is not None:
            where.append(f"rank {rank}")
        if step is not None:
            where.append(f"step {step}")
        if action is not None:
            where.append(f"action {action}")
        super().__init__((", ".join(where) + ": " if where else "") + message)
        self.rank = rank
        self.step = step
        self.action = action


class Kind(Enum):
    """What an action does; the value is its token in the string form."""

    LOAD = "L"                   # load micro-batch (inputs on the first stage, labels on the last)
    FORWARD = "F"
    BACKWARD = "B"
    REDUNDANT_FORWARD = "RF"     # forward of the replica stage; graph and output kept for RB
    REDUNDANT_BACKWARD = "RB"    # backward of a stage through the graph a previous RF kept
    SEND_ACT = "A>"
    RECV_ACT = "A<"
    SEND_GRAD = "G>"
    RECV_GRAD = "G<"
    SEND_SYNC = "S>"             # owner ships its stage's reduced gradients to the replica holder
    RECV_SYNC = "S<"
    REDUCE_TIED = "TIE"          # DeepSpeed's ReduceTiedGrads
    REDUCE = "RED"               # DeepSpeed's ReduceGrads (data-parallel all-reduce)
    OPTIMIZER = "OPT"            # the rank's gradient finish (unscale, clip); its update applies once the step commits
    REPLICA_UPDATE = "U"         # the holder applies its replica's update of the last step (its weights for this one)


_COMPUTE = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.REDUNDANT_FORWARD, Kind.REDUNDANT_BACKWARD})
_PER_MICRO_BATCH = _COMPUTE | {Kind.LOAD, Kind.SEND_ACT, Kind.RECV_ACT, Kind.SEND_GRAD, Kind.RECV_GRAD}
_SENDS = frozenset({Kind.SEND_ACT, Kind.SEND_GRAD, Kind.SEND_SYNC})
_RECVS = frozenset({Kind.RECV_ACT, Kind.RECV_GRAD, Kind.RECV_SYNC})
_RANK_WIDE = frozenset({Kind.REDUCE_TIED, Kind.REDUCE, Kind.OPTIMIZER})
for _kind in Kind:  # flags on the members: Enum hashing is slow in the dry run's inner loop
    _kind.send = _kind in _SENDS  # type: ignore[attr-defined]
    _kind.recv = _kind in _RECVS  # type: ignore[attr-defined]
    _kind.compute = _kind in _COMPUTE  # type: ignore[attr-defined]
    _kind.needs = (_kind not in _RANK_WIDE, _kind in _PER_MICRO_BATCH, _kind in _SENDS or _kind in _RECVS)  # type: ignore[attr-defined]
_ACTION_RE = re.compile(r"^(\d+)?(RF|RB|TIE|RED|OPT|L|F|B|A|G|S|U)(\d+)?(?:([<>])(\d+))?$")


@dataclass(frozen=True)
class Action:
    """One action of one rank: ``kind``, the ``stage`` it computes for, the ``micro_batch``, the ``peer`` rank.

    String form ``{stage}{token}{micro_batch}{>|<}{peer}``, parts absent when not applicable:
    ``"1F3"`` forward of stage 1 on micro-batch 3; ``"0L3"`` load micro-batch 3 for stage 0;
    ``"2RF3"`` redundant forward of (replica) stage 2; ``"2RB3"`` its lazy backward;
    ``"0A3>1"`` stage 0 sends its output activation of micro-batch 3 to rank 1 and ``"1A3<0"`` stage 1
    receives it from rank 0 (a send carries the producing stage, a receive the consuming stage);
    ``"1G3>0"`` / ``"0G3<1"`` the same for the gradient flowing back; ``"1S>0"`` rank 1 ships stage 1's
    finished gradients to rank 0, which holds stage 1's replica and receives ``"1S<1"``; ``"1U"`` rank 0
    applies the update of stage 1's replica that the last step's ``S<`` brought;
    ``"TIE"``, ``"RED"``, ``"OPT"`` are rank-wide.
    """

    kind: Kind
    stage: int | None = None
    micro_batch: int | None = None
    peer: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            raise ScheduleError(f"Action.kind must be a Kind, got {self.kind!r}; use Kind.FORWARD etc.")
        needs_stage, needs_mb, needs_peer = self.kind.needs  # type: ignore[attr-defined]
        for name, value, needed in (("stage", self.stage, needs_stage), ("micro_batch", self.micro_batch, needs_mb),
                                    ("peer", self.peer, needs_peer)):
            if needed and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ScheduleError(f"{self.kind.name} needs a non-negative int {name}, got {value!r}; "
                                    f"pass {name}=...")
            if not needed and value is not None:
                raise ScheduleError(f"{self.kind.name} takes no {name}, got {value!r}; leave it None")

    @property
    def is_send(self) -> bool:
        return self.kind.send  # type: ignore[attr-defined,no-any-return]

    @property
    def is_recv(self) -> bool:
        return self.kind.recv  # type: ignore[attr-defined,no-any-return]

    @property
    def is_comm(self) -> bool:
        return self.kind.send or self.kind.recv  # type: ignore[attr-defined,no-any-return]

    @property
    def is_compute(self) -> bool:
        return self.kind.compute  # type: ignore[attr-defined,no-any-return]

    def __str__(self) -> str:
        token = self.kind.value
        arrow = ""
        if self.is_comm:
            token, arrow = token[0], token[1] + str(self.peer)
        stage = "" if self.stage is None else str(self.stage)
        mb = "" if self.micro_batch is None else str(self.micro_batch)
        return f"{stage}{token}{mb}{arrow}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``Action.parse("0A3>1") == Action(Kind.SEND_ACT, 0, 3, peer=1)``."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ScheduleError(f"cannot parse action {text!r}: expected [stage]TOKEN[micro_batch][>|<peer] with "
                                "TOKEN in L F B RF RB A G S U TIE RED OPT, e.g. '1F3', '0A3>1', 'OPT'")
        stage, token, mb, arrow, peer = match.groups()
        if token in "AGS":
            if arrow is None:
                raise ScheduleError(f"communication action {text!r} needs '>peer' (send) or '<peer' (receive)")
            token += arrow
        elif arrow is not None:
            raise ScheduleError(f"action {text!r}: only A, G and S take a peer")
        return cls(Kind(token), None if stage is None else int(stage), None if mb is None else int(mb),
                   None if peer is None else int(peer))
