"""Bamboo's redundant-computation pipeline schedule as pure data: actions, builders, validate, simulate, format."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from lightning_bamboo.errors import BambooConfigError

__all__ = [
    "Action",
    "Costs",
    "Kind",
    "REDUNDANCY_MODES",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "build_failover",
    "build_schedule",
    "buffer_id",
    "deepspeed_steps",
    "format_table",
    "num_pipe_buffers",
    "replica_holder",
    "replica_stage",
    "simulate",
    "validate",
]

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
    OPTIMIZER = "OPT"            # optimizer step of the rank's stages and of its replica


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
_ACTION_RE = re.compile(r"^(\d+)?(RF|RB|TIE|RED|OPT|L|F|B|A|G|S)(\d+)?(?:([<>])(\d+))?$")


@dataclass(frozen=True)
class Action:
    """One action of one rank: ``kind``, the ``stage`` it computes for, the ``micro_batch``, the ``peer`` rank.

    String form ``{stage}{token}{micro_batch}{>|<}{peer}``, parts absent when not applicable:
    ``"1F3"`` forward of stage 1 on micro-batch 3; ``"0L3"`` load micro-batch 3 for stage 0;
    ``"2RF3"`` redundant forward of (replica) stage 2; ``"2RB3"`` its lazy backward;
    ``"0A3>1"`` stage 0 sends its output activation of micro-batch 3 to rank 1 and ``"1A3<0"`` stage 1
    receives it from rank 0 (a send carries the producing stage, a receive the consuming stage);
    ``"1G3>0"`` / ``"0G3<1"`` the same for the gradient flowing back; ``"1S>0"`` rank 1 ships stage 1's
    reduced gradients to rank 0, which holds stage 1's replica and receives ``"1S<1"``;
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
                                "TOKEN in L F B RF RB A G S TIE RED OPT, e.g. '1F3', '0A3>1', 'OPT'")
        stage, token, mb, arrow, peer = match.groups()
        if token in "AGS":
            if arrow is None:
                raise ScheduleError(f"communication action {text!r} needs '>peer' (send) or '<peer' (receive)")
            token += arrow
        elif arrow is not None:
            raise ScheduleError(f"action {text!r}: only A, G and S take a peer")
        return cls(Kind(token), None if stage is None else int(stage), None if mb is None else int(mb),
                   None if peer is None else int(peer))


# ----------------------------------------------------------------------------------------------------------
# Placement and DeepSpeed's buffers
# ----------------------------------------------------------------------------------------------------------

def replica_stage(rank: int, stages: int) -> int:
    """The stage whose replica node ``rank`` holds: its successor in the ring, ``(rank + 1) % stages``."""
    return (rank + 1) % stages


def replica_holder(stage: int, stages: int) -> int:
    """The node holding ``stage``'s replica (its predecessor in the ring): ``(stage - 1) % stages``."""
    return (stage - 1) % stages


def num_pipe_buffers(stage: int, stages: int, micro_batches: int) -> int:
    """Buffers DeepSpeed's TrainSchedule allocates on ``stage``: ``max(2, min(stages - stage, micro_batches))``."""
    return max(2, min(stages - stage, micro_batches))


def buffer_id(stage: int, micro_batch: int, stages: int, micro_batches: int) -> int:
    """DeepSpeed's buffer of ``micro_batch`` on ``stage`` (cyclic): ``micro_batch % num_pipe_buffers``."""
    return micro_batch % num_pipe_buffers(stage, stages, micro_batches)


# ----------------------------------------------------------------------------------------------------------
# Costs and the schedule
# ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Costs:
    """Time of each action in slots; RF costs ``forward``, RB ``backward``; one message costs ``send``."""

    forward: float = 1
    backward: float = 2
    load: float = 0
    send: float = 0
    sync: float = 0
    reduce: float = 0
    optimizer: float = 0

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "load", "send", "sync", "reduce", "optimizer"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ScheduleError(f"Costs.{name} must be a number >= 0, got {value!r}")
        if self.forward <= 0:
            raise ScheduleError(f"Costs.forward must be > 0 (it sizes the RF slots), got {self.forward}")

    def of(self, action: Action) -> float:
        kind = action.kind
        if kind in (Kind.FORWARD, Kind.REDUNDANT_FORWARD):
            return self.forward
        if kind in (Kind.BACKWARD, Kind.REDUNDANT_BACKWARD):
            return self.backward
        if kind is Kind.LOAD:
            return self.load
        if kind in (Kind.SEND_SYNC, Kind.RECV_SYNC):
            return self.sync
        if action.is_comm:
            return self.send
        if kind is Kind.OPTIMIZER:
            return self.optimizer
        return self.reduce


Tick = tuple[Action, ...]


@dataclass(frozen=True)
class Schedule:
    """One training step of one pipeline: ``programs[rank][step]`` is the tuple of actions of that step.

    Steps are DeepSpeed's: ``2 * (micro_batches + stages - 1)`` of them on every live rank, and the actions of
    step ``t`` on two neighbours are each other's partners (a barrier between steps cannot deadlock).
    Rank ``r`` is node ``r`` of the pipeline; ``layout[stage]`` is the rank that runs the stage;
    ``replicas[rank]`` is the stage whose replica the rank holds (None: none); ``dead`` is the failed rank of
    a failover step (its program is empty); ``reuse_rf`` the micro-batches of the dead stage whose RF the
    holder had finished before the failure (their forward is not recomputed and their backward is RB).
    """

    stages: int
    micro_batches: int
    redundancy: str
    programs: tuple[tuple[Tick, ...], ...]
    layout: tuple[int, ...]
    replicas: tuple[int | None, ...]
    dead: int | None = None
    reuse_rf: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        _check_shape(self.stages, self.micro_batches, self.redundancy)
        p = self.stages
        for name, seq in (("programs", self.programs), ("replicas", self.replicas), ("layout", self.layout)):
            if len(seq) != p:
                raise ScheduleError(f"Schedule.{name} needs one entry per stage/rank ({p}), got {len(seq)}")
        if self.dead is not None and not 0 <= self.dead < p:
            raise ScheduleError(f"dead rank must be in [0, {p}), got {self.dead}")
        for stage, rank in enumerate(self.layout):
            if not 0 <= rank < p or rank == self.dead:
                raise ScheduleError(f"layout[{stage}] = {rank} is not a live rank in [0, {p}) (dead: {self.dead})")
        if self.dead is not None and self.programs[self.dead]:
            raise ScheduleError(f"dead rank {self.dead} must have an empty program")
        bad = sorted(k for k in self.reuse_rf if not 0 <= k < self.micro_batches)
        if bad:
            raise ScheduleError(f"reuse_rf micro-batches {bad} are outside [0, {self.micro_batches})")

    @property
    def mode(self) -> str:
        """``"off"``, ``"lazy"``, ``"eager"`` or ``"failover"``."""
        return "failover" if self.dead is not None else self.redundancy

    @property
    def num_steps(self) -> int:
        return max(len(program) for program in self.programs)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` runs (two on the rank that took over a dead successor)."""
        return tuple(s for s, r in enumerate(self.layout) if r == rank)

    def actions(self, rank: int) -> list[tuple[int, Action]]:
        """``rank``'s actions in execution order, each with its step."""
        return [(step, action) for step, tick in enumerate(self.programs[rank]) for action in tick]

    def buffer_id(self, action: Action) -> int | None:
        """The buffer DeepSpeed would use for ``action``: per stage for L/F/B/A/G (each stage of a merged
        rank keeps its own buffers), the micro-batch itself for RF/RB (kept until the step commits), None for
        rank-wide actions and sync."""
        if action.kind in (Kind.REDUNDANT_FORWARD, Kind.REDUNDANT_BACKWARD):
            return action.micro_batch
        if action.micro_batch is None or action.stage is None:
            return None
        return buffer_id(action.stage, action.micro_batch, self.stages, self.micro_batches)

    def redundant_forwards(self, rank: int, before_step: int | None = None) -> frozenset[int]:
        """Micro-batches whose RF ``rank`` has finished before ``before_step`` (all steps when None): pass it
        as ``reuse_rf`` of the failover step when ``rank``'s successor dies at that step."""
        return frozenset(a.micro_batch for step, a in self.actions(rank)
                         if a.kind is Kind.REDUNDANT_FORWARD and (before_step is None or step < before_step)
                         and a.micro_batch is not None)

    def __str__(self) -> str:
        return format_table(self)


def _check_shape(stages: object, micro_batches: object, redundancy: object) -> None:
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ScheduleError(f"stages must be an int >= 1, got {stages!r}")
    if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
        raise ScheduleError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
    if redundancy not in REDUNDANCY_MODES:
        raise ScheduleError(f"redundancy must be one of {REDUNDANCY_MODES}, got {redundancy!r}")
    if redundancy != "off" and stages < 2:
        raise ScheduleError(f"redundancy={redundancy!r} needs >= 2 stages (a replica of the successor), got "
                            f"stages={stages}; use redundancy='off' or more stages")


# ----------------------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=65536)
def _stage_tick(stage: int, step: int, p: int, m: int, layout: tuple[int, ...]) -> tuple[Action, ...]:
    """The actions of ``stage`` at ``step`` of DeepSpeed's synchronous 1F1B (TrainSchedule), without the
    final reduce/optimizer actions. Forward of micro-batch k runs at step ``2k + stage``, its backward at
    step ``2k + 2p - 1 - stage``; so forward and backward steps of a stage alternate, and at every step each
    stage talks to at most one neighbour."""
    out: list[Action] = []
    valid = range(m).__contains__
    if (step - stage) % 2 == 0:                         # forward step
        cur, prev = (step - stage) // 2, (step - 2 * p + stage) // 2
        if stage > 0 and valid(prev):
            out.append(Action(Kind.SEND_GRAD, stage, prev, peer=layout[stage - 1]))
        if stage > 0 and valid(cur):
            out.append(Action(Kind.RECV_ACT, stage, cur, peer=layout[stage - 1]))
        if stage in (0, p - 1) and valid(cur):
            out.append(Action(Kind.LOAD, stage, cur))
        if valid(cur):
            out.append(Action(Kind.FORWARD, stage, cur))
    else:                                               # backward step
        cur, prev = (step - 2 * p + 1 + stage) // 2, (step - 1 - stage) // 2
        if stage < p - 1 and valid(cur):
            out.append(Action(Kind.RECV_GRAD, stage, cur, peer=layout[stage + 1]))
        if stage < p - 1 and valid(prev):
            out.append(Action(Kind.SEND_ACT, stage, prev, peer=layout[stage + 1]))
        if valid(cur):
            out.append(Action(Kind.BACKWARD, stage, cur))
    return tuple(out)


def _sync_actions(p: int, layout: Sequence[int], replicas: Sequence[int | None]) -> list[list[Action]]:
    """Replica sync per rank: for each stage with a live replica, its owner sends ``S>`` and the holder
    receives ``S<``. Transfers run along the ring (rank r sends to r - 1, receives from r + 1); even ranks
    send first and odd ranks receive first, so the blocking ring finishes in at most three transfer times
    whatever ``p`` (a single global order would take ``p``)."""
    per_rank: list[list[Action]] = [[] for _ in range(p)]
    for holder, stage in enumerate(replicas):
        if stage is None:
            continue
        owner = layout[stage]
        per_rank[owner].append(Action(Kind.SEND_SYNC, stage, peer=holder))
        per_rank[holder].append(Action(Kind.RECV_SYNC, stage, peer=owner))
    for rank, actions in enumerate(per_rank):
        actions.sort(key=lambda a: a.is_send == (rank % 2 == 1))
    return per_rank


def _assemble(p: int, m: int, layout: tuple[int, ...], replicas: Sequence[int | None],
              dead: int | None, reuse: frozenset[int] = frozenset()) -> list[list[list[Action]]]:
    """Per rank, per step: the stage ticks of the stages the rank runs (in the rank's own stage first, then
    the adopted one), local hand-offs dropped, with TIE, RED, replica sync and OPT closing the last step."""
    steps = 2 * (m + p - 1)
    sync = _sync_actions(p, layout, replicas)
    programs: list[list[list[Action]]] = []
    for rank in range(p):
        if rank == dead:
            programs.append([])
            continue
        own = [s for s, r in enumerate(layout) if r == rank]
        own.sort(key=lambda s: (s != rank, s))
        program = []
        for step in range(steps):
            tick: list[Action] = []
            for stage in own:
                for a in _stage_tick(stage, step, p, m, layout):
                    if a.is_comm and a.peer == rank:
                        continue                                     # both stages here: a local hand-off
                    if a.stage == dead and a.micro_batch in reuse:   # taken over: forward kept by RF
                        if a.kind is Kind.FORWARD:
                            continue
                        if a.kind is Kind.BACKWARD:
                            a = Action(Kind.REDUNDANT_BACKWARD, a.stage, a.micro_batch)
                    tick.append(a)
            program.append(tick)
        program[-1] += [Action(Kind.REDUCE_TIED), Action(Kind.REDUCE)] + sync[rank] + [Action(Kind.OPTIMIZER)]
        programs.append(program)
    return programs


def _freeze(programs: list[list[list[Action]]]) -> tuple[tuple[Tick, ...], ...]:
    return tuple(tuple(tuple(tick) for tick in program) for program in programs)


def build_schedule(stages: int, micro_batches: int, redundancy: str = "off", *, costs: Costs | None = None,
                   rf_budget: int | None = None) -> Schedule:
    """One healthy training step.

    ``"off"``: DeepSpeed's TrainSchedule, action for action. ``"lazy"``: the same plus replica sync (node r
    holds stage ``(r + 1) % stages``; each owner ships its reduced gradients ``S>`` to the holder before OPT,
    and the holder's OPT steps the replica too). ``"eager"``: lazy plus redundant forwards of the replica
    stage placed where the rank would wait (see ``_place_rf``): with ``rf_budget=None`` only into those
    waits, given ``costs``; the micro-batches left out are recomputed on failure (F and B on the replica). An
    int ``rf_budget`` caps RFs per rank at that number and puts those that fit no wait just before TIE
    (outside the bubbles, costing time): ``rf_budget=micro_batches`` computes every RF.
    """
    _check_shape(stages, micro_batches, redundancy)
    if rf_budget is not None and (not isinstance(rf_budget, int) or isinstance(rf_budget, bool) or rf_budget < 0):
        raise ScheduleError(f"rf_budget must be None (waits only) or an int >= 0, got {rf_budget!r}")
    if rf_budget is not None and redundancy != "eager":
        raise ScheduleError(f"rf_budget only applies to redundancy='eager', got redundancy={redundancy!r}")
    p, m = stages, micro_batches
    layout = tuple(range(p))
    replicas: tuple[int | None, ...] = (tuple(None for _ in range(p)) if redundancy == "off"
                                        else tuple(replica_stage(r, p) for r in range(p)))
    programs = _assemble(p, m, layout, replicas, None)
    if redundancy == "eager":
        programs = _place_rf(programs, p, m, layout, replicas, costs or Costs(), rf_budget)
    return Schedule(p, m, redundancy, _freeze(programs), layout, replicas)


def build_failover(stages: int, micro_batches: int, dead: int, *, redundancy: str = "lazy",
                   reuse_rf: Iterable[int] = ()) -> Schedule:
    """The step run right after node ``dead`` is lost (the step in flight, redone once): its predecessor in
    the ring, ``replica_holder(dead)``, runs its own stage and ``dead``'s stage from the replica (for
    ``dead == 0`` that is rank ``stages - 1`` running stages ``stages - 1`` and 0). The merged rank's step
    ``t`` holds both stages' step ``t`` (the hand-off between adjacent stages is local). Micro-batches in
    ``reuse_rf`` (eager only; see ``Schedule.redundant_forwards``) skip the dead stage's forward: the kept RF
    output is sent on and their backward is ``RB``. Replicas still backed by a live holder keep being synced;
    the dead stage's and its successor's are gone until the pipeline is rebuilt. No RF is placed."""
    _check_shape(stages, micro_batches, redundancy)
    if redundancy == "off":
        raise ScheduleError("a failover step needs the replica: redundancy must be 'lazy' or 'eager', got 'off'")
    if not isinstance(dead, int) or isinstance(dead, bool) or not 0 <= dead < stages:
        raise ScheduleError(f"dead must be a rank in [0, {stages}), got {dead!r}")
    reuse = frozenset(reuse_rf)
    if reuse and redundancy != "eager":
        raise ScheduleError(f"reuse_rf={sorted(reuse)} needs redundancy='eager' (lazy keeps no RF outputs)")
    p, m = stages, micro_batches
    holder = replica_holder(dead, p)
    layout = tuple(holder if s == dead else s for s in range(p))
    replicas = tuple(None if r in (dead, holder) else replica_stage(r, p) for r in range(p))
    programs = _assemble(p, m, layout, replicas, dead, reuse)
    return Schedule(p, m, redundancy, _freeze(programs), layout, replicas, dead, reuse)


def _place_rf(programs: list[list[list[Action]]], p: int, m: int, layout: Sequence[int],
              replicas: Sequence[int | None], costs: Costs, budget: int | None) -> list[list[list[Action]]]:
    """Eager placement. Simulate the lazy step with ``costs``; wherever a rank waits ``w`` slots for a peer
    before an action, insert ``floor(w / forward)`` RFs just before it, lowest ready micro-batch first (RF of
    stage s+1 on micro-batch k is ready once the rank ran F(s, k); RF of stage 0 on the last rank once it
    loaded k). An RF never outlasts the wait it fills, so no action moves and the step does not lengthen.
    Then, if ``budget`` is an int, RFs beyond it are dropped and missing ones up to it go before TIE."""
    schedule = Schedule(p, m, "lazy", _freeze(programs), tuple(layout), tuple(replicas))
    timing = _execute(schedule, costs)
    out: list[list[list[Action]]] = []
    for rank, program in enumerate(programs):
        target = replicas[rank]
        assert target is not None
        cap = m if budget is None else budget
        ready: list[int] = []
        placed: list[int] = []
        new_program: list[list[Action]] = []
        index = 0
        for tick in program:
            new_tick: list[Action] = []
            for action in tick:
                arrive, start, _ = timing[rank][index]
                index += 1
                slots = math.floor((start - arrive) / costs.forward + 1e-9)
                while slots > 0 and ready and len(placed) < cap:
                    k = ready.pop(0)
                    placed.append(k)
                    new_tick.append(Action(Kind.REDUNDANT_FORWARD, target, k))
                    slots -= 1
                new_tick.append(action)
                if (target > 0 and action.kind is Kind.FORWARD and action.stage == target - 1) or \
                        (target == 0 and action.kind is Kind.LOAD and action.micro_batch not in ready + placed):
                    ready.append(action.micro_batch)  # type: ignore[arg-type]
            new_program.append(new_tick)
        if budget is not None:
            rest = [k for k in range(m) if k not in placed][: max(0, budget - len(placed))]
            last = new_program[-1]
            at = next(i for i, a in enumerate(last) if a.kind is Kind.REDUCE_TIED)
            last[at:at] = [Action(Kind.REDUNDANT_FORWARD, target, k) for k in rest]
        out.append(new_program)
    return out


# ----------------------------------------------------------------------------------------------------------
# Execution model: data dependencies, blocking send/receive, time
# ----------------------------------------------------------------------------------------------------------

def _channel(rank: int, a: Action) -> tuple:
    """Identity of the message an action sends or receives: (source, destination, what, producing stage, mb)."""
    if a.kind is Kind.SEND_ACT:
        return (rank, a.peer, "A", a.stage, a.micro_batch)
    if a.kind is Kind.RECV_ACT:
        return (a.peer, rank, "A", a.stage - 1, a.micro_batch)  # type: ignore[operator]
    if a.kind is Kind.SEND_GRAD:
        return (rank, a.peer, "G", a.stage, a.micro_batch)
    if a.kind is Kind.RECV_GRAD:
        return (a.peer, rank, "G", a.stage + 1, a.micro_batch)  # type: ignore[operator]
    if a.kind is Kind.SEND_SYNC:
        return (rank, a.peer, "S", a.stage, None)
    return (a.peer, rank, "S", a.stage, None)


def _expected_partner(rank: int, a: Action) -> Action:
    kind = {Kind.SEND_ACT: Kind.RECV_ACT, Kind.RECV_ACT: Kind.SEND_ACT, Kind.SEND_GRAD: Kind.RECV_GRAD,
            Kind.RECV_GRAD: Kind.SEND_GRAD, Kind.SEND_SYNC: Kind.RECV_SYNC, Kind.RECV_SYNC: Kind.SEND_SYNC}[a.kind]
    shift = {Kind.SEND_ACT: 1, Kind.RECV_ACT: -1, Kind.SEND_GRAD: -1, Kind.RECV_GRAD: 1}.get(a.kind, 0)
    return Action(kind, a.stage + shift, a.micro_batch, peer=rank)  # type: ignore[operator]


class _Rank:
    """Progress of one rank in the dry run: what it holds and how far it got."""

    def __init__(self, schedule: Schedule, rank: int) -> None:
        self.rank = rank
        self.items = schedule.actions(rank)
        self.pos = 0
        self.clock = 0.0
        self.have: set[tuple] = set()
        self.timing: list[tuple[float, float, float]] = []
        self.own = set(schedule.stages_of(rank))
        if schedule.dead is not None and schedule.layout[schedule.dead] == rank:
            self.have |= {("saved", schedule.dead, k) for k in schedule.reuse_rf}
        self.recv_sync_total = sum(1 for _, a in self.items if a.kind is Kind.RECV_SYNC)

    @property
    def head(self) -> tuple[int, Action] | None:
        return self.items[self.pos] if self.pos < len(self.items) else None


def _fail(rank: int, step: int, a: Action, rule: str, fix: str) -> None:
    raise ScheduleError(f"{rule}; {fix}", rank, step, a)


def _once(have: set[tuple], rank: int, step: int, a: Action, key: tuple) -> None:
    if key in have:
        _fail(rank, step, a, f"{a} runs twice on rank {rank}", "each action of a step runs once")
    have.add(key)


def _has_input(have: set[tuple], s: Any, k: Any) -> bool:
    return ("act", s, k) in have or ("F", s - 1, k) in have or ("saved", s - 1, k) in have


def _has_grad(have: set[tuple], s: Any, k: Any, p: int) -> bool:
    return s == p - 1 or ("grad", s, k) in have or ("B", s + 1, k) in have or ("RB", s + 1, k) in have


def _check(schedule: Schedule, st: _Rank, step: int, a: Action) -> None:
    """Raise unless ``a`` may run now on ``st.rank``; then record what it produced."""
    p, m, have, rank = schedule.stages, schedule.micro_batches, st.have, st.rank
    s: Any = a.stage
    k: Any = a.micro_batch

    if s is not None and not 0 <= s < p:
        _fail(rank, step, a, f"stage {s} is outside [0, {p})", "use a stage of this pipeline")
    if k is not None and not 0 <= k < m:
        _fail(rank, step, a, f"micro-batch {k} is outside [0, {m})", "use a micro-batch of this step")
    if a.is_comm and (a.peer == rank or not 0 <= a.peer < p or a.peer == schedule.dead):  # type: ignore[operator]
        _fail(rank, step, a, f"peer {a.peer} is not another live rank (dead: {schedule.dead})", "talk to a live neighbour")
    kind = a.kind
    if kind in (Kind.LOAD, Kind.FORWARD, Kind.BACKWARD, Kind.REDUNDANT_BACKWARD, Kind.SEND_ACT, Kind.SEND_GRAD,
                Kind.RECV_ACT, Kind.RECV_GRAD, Kind.SEND_SYNC) and s not in st.own:
        _fail(rank, step, a, f"stage {s} runs on rank {schedule.layout[s]}, not here (rank {rank} runs {sorted(st.own)})",  # type: ignore[index]
             "put the action on the rank of its stage")

    if kind is Kind.LOAD:
        if s not in (0, p - 1):
            _fail(rank, step, a, f"only the first and last stages load micro-batches, not stage {s}", "drop the load")
        _once(have, rank, step, a, ("L", s, k))
        have.add(("Lany", k))
    elif kind is Kind.FORWARD:
        if ("saved", s, k) in have:
            _fail(rank, step, a, f"F({s}, {k}) is recomputed although its RF output is reused", "drop it or drop k from reuse_rf")
        if s == 0 and ("L", 0, k) not in have:
            _fail(rank, step, a, f"F(0, {k}) before micro-batch {k} was loaded", f"put 0L{k} before it")
        if s > 0 and not _has_input(have, s, k):
            _fail(rank, step, a, f"F({s}, {k}) before its input arrived", f"receive {s}A{k}<... or run {s - 1}F{k} first")  # type: ignore[operator]
        if s == p - 1 and ("L", s, k) not in have:
            _fail(rank, step, a, f"the last stage's F({s}, {k}) needs its labels", f"put {s}L{k} before it")
        _once(have, rank, step, a, ("F", s, k))
    elif kind in (Kind.BACKWARD, Kind.REDUNDANT_BACKWARD):
        if kind is Kind.BACKWARD and ("F", s, k) not in have:
            _fail(rank, step, a, f"B({s}, {k}) before F({s}, {k})", "run the forward first")
        if kind is Kind.REDUNDANT_BACKWARD and ("saved", s, k) not in have:
            _fail(rank, step, a, f"RB({s}, {k}) without a kept RF of ({s}, {k})", "use B, or add k to reuse_rf")
        if kind is Kind.REDUNDANT_BACKWARD and s == p - 1 and ("L", s, k) not in have:
            _fail(rank, step, a, f"RB of the last stage needs the labels of micro-batch {k}", f"put {s}L{k} before it")
        if not _has_grad(have, s, k, p):
            _fail(rank, step, a, f"backward of ({s}, {k}) before its output gradient arrived", f"receive {s}G{k}<... first")
        if ("B", s, k) in have or ("RB", s, k) in have:
            _fail(rank, step, a, f"the backward of ({s}, {k}) runs twice", "run it once")
        have.add(("B" if kind is Kind.BACKWARD else "RB", s, k))
    elif kind is Kind.REDUNDANT_FORWARD:
        if schedule.replicas[rank] != s:
            _fail(rank, step, a, f"rank {rank} holds the replica of stage {schedule.replicas[rank]}, not {s}",
                 "RF only the replica stage")
        if s == 0 and ("Lany", k) not in have:
            _fail(rank, step, a, f"RF(0, {k}) before micro-batch {k} was loaded on this rank", "run it after the load")
        if s > 0 and ("F", s - 1, k) not in have:  # type: ignore[operator]
            _fail(rank, step, a, f"RF({s}, {k}) before this rank computed its input F({s - 1}, {k})", "run it after that forward")  # type: ignore[operator]
        _once(have, rank, step, a, ("RF", s, k))
    elif kind is Kind.SEND_ACT:
        if s == p - 1 or schedule.layout[s + 1] != a.peer:  # type: ignore[operator]
            _fail(rank, step, a, f"stage {s}'s output goes to rank {None if s == p - 1 else schedule.layout[s + 1]}, not {a.peer}",  # type: ignore[operator]
                 "send to the rank of the next stage")
        if ("F", s, k) not in have and ("saved", s, k) not in have:
            _fail(rank, step, a, f"sending the output of ({s}, {k}) before computing it", f"run {s}F{k} first")
        _once(have, rank, step, a, ("sentA", s, k))
    elif kind is Kind.SEND_GRAD:
        if s == 0 or schedule.layout[s - 1] != a.peer:  # type: ignore[operator]
            _fail(rank, step, a, f"stage {s}'s input gradient goes to rank {None if s == 0 else schedule.layout[s - 1]}, "  # type: ignore[operator]
                 f"not {a.peer}", "send to the rank of the previous stage")
        if ("B", s, k) not in have and ("RB", s, k) not in have:
            _fail(rank, step, a, f"sending the input gradient of ({s}, {k}) before its backward", f"run {s}B{k} first")
        _once(have, rank, step, a, ("sentG", s, k))
    elif kind is Kind.RECV_ACT:
        if s == 0 or schedule.layout[s - 1] != a.peer:  # type: ignore[operator]
            _fail(rank, step, a, f"stage {s}'s input comes from rank {None if s == 0 else schedule.layout[s - 1]}, not {a.peer}",  # type: ignore[operator]
                 "receive from the rank of the previous stage")
        _once(have, rank, step, a, ("act", s, k))
    elif kind is Kind.RECV_GRAD:
        if s == p - 1 or schedule.layout[s + 1] != a.peer:  # type: ignore[operator]
            _fail(rank, step, a, f"stage {s}'s output gradient comes from rank {None if s == p - 1 else schedule.layout[s + 1]}, "  # type: ignore[operator]
                 f"not {a.peer}", "receive from the rank of the next stage")
        _once(have, rank, step, a, ("grad", s, k))
    elif kind is Kind.SEND_SYNC:
        holder = [r for r, rs in enumerate(schedule.replicas) if rs == s]
        if a.peer not in holder:
            _fail(rank, step, a, f"stage {s}'s replica lives on {holder or 'no rank'}, not rank {a.peer}", "sync to the holder")
        if ("RED",) not in have:
            _fail(rank, step, a, f"syncing stage {s} before its gradients were reduced", "put S> after RED")
        _once(have, rank, step, a, ("S>", s))
    elif kind is Kind.RECV_SYNC:
        if schedule.replicas[rank] != s or schedule.layout[s] != a.peer:  # type: ignore[index]
            _fail(rank, step, a, f"rank {rank} holds the replica of {schedule.replicas[rank]} and stage {s} runs on rank "
                 f"{schedule.layout[s]}", "receive the replica's stage from its owner")  # type: ignore[index]
        _once(have, rank, step, a, ("S<", s))
    elif kind in (Kind.REDUCE_TIED, Kind.REDUCE):
        missing = [(t, j) for t in sorted(st.own) for j in range(m) if ("B", t, j) not in have
                   and ("RB", t, j) not in have]
        if missing:
            _fail(rank, step, a, f"{kind.name} before the backward of {missing[:4]}{'...' if len(missing) > 4 else ''}",
                 "reduce after the last backward")
        _once(have, rank, step, a, (kind.value,))
    elif kind is Kind.OPTIMIZER:
        if ("RED",) not in have:
            _fail(rank, step, a, "OPT before RED", "reduce the gradients first")
        got = sum(1 for key in have if key[0] == "S<")
        if got != st.recv_sync_total:
            _fail(rank, step, a, "OPT before the replica's gradients arrived", "put S< before OPT")
        _once(have, rank, step, a, ("OPT",))


def _finish_check(schedule: Schedule, st: _Rank) -> None:
    m, have = schedule.micro_batches, st.have
    for s in sorted(st.own):
        for k in range(m):
            if ("F", s, k) not in have and ("saved", s, k) not in have:
                raise ScheduleError(f"stage {s} never runs the forward of micro-batch {k}; add {s}F{k}", st.rank)
            if ("B", s, k) not in have and ("RB", s, k) not in have:
                raise ScheduleError(f"stage {s} never runs the backward of micro-batch {k}; add {s}B{k}", st.rank)
    if ("OPT",) not in have:
        raise ScheduleError("the step ends without OPT; end the last step with TIE RED OPT", st.rank)
    if st.items and st.items[-1][1].kind is not Kind.OPTIMIZER:
        raise ScheduleError(f"OPT must be the rank's last action, found {st.items[-1][1]} after it", st.rank,
                            st.items[-1][0], st.items[-1][1])


def _execute(schedule: Schedule, costs: Costs) -> list[list[tuple[float, float, float]]]:
    """Dry-run every rank with blocking sends and receives (a transfer happens when both ends reach it),
    checking data dependencies; return per rank, per action (arrival, start, end) times."""
    p = schedule.stages
    ranks = [_Rank(schedule, r) for r in range(p)]
    progress = True
    while progress:
        progress = False
        for st in ranks:
            while st.pos < len(st.items):
                step, a = st.items[st.pos]
                if not a.is_comm:
                    _check(schedule, st, step, a)
                    end = st.clock + costs.of(a)
                    st.timing.append((st.clock, st.clock, end))
                    st.clock = end
                    st.pos += 1
                    progress = True
                    continue
                if a.peer is None or not 0 <= a.peer < p or a.peer in (st.rank, schedule.dead):
                    _check(schedule, st, step, a)           # raises: no such peer
                other = ranks[a.peer]  # type: ignore[index]
                if other.pos >= len(other.items):
                    raise ScheduleError(f"{a} waits on rank {a.peer}, which has finished its step; add "
                                        f"{_expected_partner(st.rank, a)} to rank {a.peer}", st.rank, step, a)
                ostep, oa = other.items[other.pos]
                if not oa.is_comm or oa.peer != st.rank:
                    break                       # the peer is busy elsewhere; come back later
                if _channel(st.rank, a) != _channel(other.rank, oa) or a.is_send == oa.is_send:
                    raise ScheduleError(
                        f"ranks {st.rank} and {other.rank} block on each other: rank {st.rank} is at {a} (step "
                        f"{step}) but rank {other.rank} is at {oa} (step {ostep}); the two must agree on the "
                        f"order of their transfers; rank {other.rank} should be at {_expected_partner(st.rank, a)}",
                        st.rank, step, a)
                _check(schedule, st, step, a)
                _check(schedule, other, ostep, oa)
                start = max(st.clock, other.clock)
                end = start + costs.of(a)
                st.timing.append((st.clock, start, end))
                other.timing.append((other.clock, start, end))
                st.clock = other.clock = end
                st.pos += 1
                other.pos += 1
                progress = True
    stuck = [st for st in ranks if st.head is not None]
    if stuck:
        lines = [f"rank {st.rank} at step {st.head[0]}: {st.head[1]}" for st in stuck]  # type: ignore[index]
        first = stuck[0]
        raise ScheduleError("deadlock: every blocked rank waits on a peer that waits elsewhere (" +
                            "; ".join(lines) + "); reorder the transfers so each send meets its receive",
                            first.rank, first.head[0], first.head[1])  # type: ignore[index]
    for st in ranks:
        if st.rank != schedule.dead:
            _finish_check(schedule, st)
    return [st.timing for st in ranks]


def validate(schedule: Schedule) -> None:
    """Raise ``ScheduleError`` (naming rank, step, action) unless every send meets its receive on the peer in
    a consistent order, every data dependency holds on the rank that needs it, every stage runs each
    micro-batch's forward and backward once, and the dry run with blocking transfers finishes on all ranks."""
    _execute(schedule, Costs())


# ----------------------------------------------------------------------------------------------------------
# Simulation
# ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Simulation:
    """Result of ``simulate``; per-rank tuples are indexed by rank (zeros for a dead rank).

    ``makespan``: time of the step; ``baseline``: the same schedule's time with RF costing nothing;
    ``overhead = makespan - baseline``. ``busy``: compute time of the rank's own stages (F, B, RB);
    ``bubble = baseline - busy``: slots the rank idles without RC. ``rc``: RF time;
    ``rc_outside = min(rc, overhead)``: RF time that lengthened the step (charged to each rank that ran RF);
    ``rc_in_bubbles = rc - rc_outside``. ``steps``: number of DeepSpeed steps.
    """

    steps: int
    makespan: float
    baseline: float
    busy: tuple[float, ...]
    bubble: tuple[float, ...]
    rc: tuple[float, ...]
    rc_in_bubbles: tuple[float, ...]
    rc_outside: tuple[float, ...]

    @property
    def overhead(self) -> float:
        return self.makespan - self.baseline


def simulate(schedule: Schedule, costs: Costs | None = None) -> Simulation:
    """Validate ``schedule`` and time it with ``costs`` (blocking transfers, one action at a time per rank)."""
    costs = costs or Costs()
    timing = _execute(schedule, costs)
    stripped = Schedule(schedule.stages, schedule.micro_batches, schedule.redundancy,
                        tuple(tuple(tuple(a for a in tick if a.kind is not Kind.REDUNDANT_FORWARD) for tick in prog)
                              for prog in schedule.programs),
                        schedule.layout, schedule.replicas, schedule.dead, schedule.reuse_rf)
    base_timing = _execute(stripped, costs)
    makespan = max((t[-1][2] for t in timing if t), default=0.0)
    baseline = max((t[-1][2] for t in base_timing if t), default=0.0)
    overhead = makespan - baseline
    busy, bubble, rc, inside, outside = [], [], [], [], []
    for rank in range(schedule.stages):
        acts = [a for _, a in schedule.actions(rank)]
        own = sum(costs.of(a) for a in acts if a.kind in (Kind.FORWARD, Kind.BACKWARD, Kind.REDUNDANT_BACKWARD))
        red = sum(costs.of(a) for a in acts if a.kind is Kind.REDUNDANT_FORWARD)
        live = bool(acts)
        busy.append(own)
        bubble.append(baseline - own if live else 0.0)
        rc.append(red)
        outside.append(min(red, overhead))
        inside.append(red - min(red, overhead))
    return Simulation(schedule.num_steps, makespan, baseline, tuple(busy), tuple(bubble), tuple(rc),
                      tuple(inside), tuple(outside))


# ----------------------------------------------------------------------------------------------------------
# Table
# ----------------------------------------------------------------------------------------------------------

def format_table(schedule: Schedule, error_at: int | None = None) -> str:
    """Step x Rank table: one row per DeepSpeed step, one column per rank, a cell lists that step's actions
    in order; a dead rank's column is headed ``(dead)``; row ``error_at`` ends with ``<-- ERROR HERE``."""
    p, steps = schedule.stages, schedule.num_steps
    width = len(str(max(steps - 1, 0)))
    labels = [f"Step {str(t).zfill(width)}" for t in range(steps)]
    heads = [f"Rank {r}" + (" (dead)" if r == schedule.dead else "") for r in range(p)]
    cells = [[" ".join(map(str, prog[t])) if t < len(prog) else "" for prog in schedule.programs]
             for t in range(steps)]
    widths = [max([len(heads[r])] + [len(row[r]) for row in cells]) for r in range(p)]
    lead = len(labels[0]) + 2 if labels else 6
    lines = [(" " * lead + " | ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True))).rstrip()]
    for t, (label, row) in enumerate(zip(labels, cells, strict=True)):
        line = (f"{label}: " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))).rstrip()
        if error_at == t:
            line += "  <-- ERROR HERE"
        lines.append(line)
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------------
# Towards the engine
# ----------------------------------------------------------------------------------------------------------

_DEEPSPEED_NAMES = {
    Kind.LOAD: "LoadMicroBatch", Kind.FORWARD: "ForwardPass", Kind.BACKWARD: "BackwardPass",
    Kind.SEND_ACT: "SendActivation", Kind.RECV_ACT: "RecvActivation", Kind.SEND_GRAD: "SendGrad",
    Kind.RECV_GRAD: "RecvGrad", Kind.REDUCE_TIED: "ReduceTiedGrads", Kind.REDUCE: "ReduceGrads",
    Kind.OPTIMIZER: "OptimizerStep", Kind.REDUNDANT_FORWARD: "RedundantForward",
    Kind.REDUNDANT_BACKWARD: "RedundantBackward", Kind.SEND_SYNC: "SendReplicaSync",
    Kind.RECV_SYNC: "RecvReplicaSync",
}


def deepspeed_steps(schedule: Schedule, rank: int) -> list[list[tuple[str, dict[str, int], Action]]]:
    """``rank``'s program as DeepSpeed-like instructions: per step, ``(class name, kwargs, action)``.

    DeepSpeed's own instructions (LoadMicroBatch, ForwardPass, BackwardPass, Send/RecvActivation,
    Send/RecvGrad) get ``{"buffer_id": Schedule.buffer_id(action)}``; ReduceTiedGrads, ReduceGrads and
    OptimizerStep get ``{}`` — for ``redundancy="off"`` this equals TrainSchedule's ``(type(cmd).__name__,
    cmd.kwargs)`` step for step. RC instructions (RedundantForward, RedundantBackward, SendReplicaSync,
    RecvReplicaSync) get ``stage``, ``micro_batch``/``buffer_id`` and ``peer`` as applicable. On a rank that
    runs two stages read ``action.stage`` to pick the stage's module and buffers.
    """
    out = []
    for tick in schedule.programs[rank]:
        step = []
        for a in tick:
            kwargs: dict[str, int] = {}
            if a.kind in (Kind.REDUNDANT_FORWARD, Kind.REDUNDANT_BACKWARD, Kind.SEND_SYNC, Kind.RECV_SYNC):
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
