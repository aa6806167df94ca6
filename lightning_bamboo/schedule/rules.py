"""The rules an action must meet on its rank when it runs: data dependencies, placement, once only."""

from __future__ import annotations

from typing import Any

from lightning_bamboo.schedule.action import Action, Kind, ScheduleError
from lightning_bamboo.schedule.program import Schedule


class Rank:
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


def check(schedule: Schedule, st: Rank, step: int, a: Action) -> None:
    """Raise unless ``a`` may run now on ``st.rank``; then record what it produced."""
    _in_bounds(schedule, st, step, a)
    _on_its_rank(schedule, st, step, a)
    _BY_KIND[a.kind.value](schedule, st, step, a, a.stage, a.micro_batch)


def _in_bounds(schedule: Schedule, st: Rank, step: int, a: Action) -> None:
    """The stage, micro-batch and peer exist in this step; a peer is another live rank."""
    p, m, rank, s, k = schedule.stages, schedule.micro_batches, st.rank, a.stage, a.micro_batch
    if s is not None and not 0 <= s < p:
        _fail(rank, step, a, f"stage {s} is outside [0, {p})", "use a stage of this pipeline")
    if k is not None and not 0 <= k < m:
        _fail(rank, step, a, f"micro-batch {k} is outside [0, {m})", "use a micro-batch of this step")
    if a.is_comm and (a.peer == rank or not 0 <= a.peer < p or a.peer == schedule.dead):  # type: ignore[operator]
        _fail(rank, step, a, f"peer {a.peer} is not another live rank (dead: {schedule.dead})", "talk to a live neighbour")


_OWN_STAGE = (Kind.LOAD, Kind.FORWARD, Kind.BACKWARD, Kind.REDUNDANT_BACKWARD, Kind.SEND_ACT, Kind.SEND_GRAD,
              Kind.RECV_ACT, Kind.RECV_GRAD, Kind.SEND_SYNC)


def _on_its_rank(schedule: Schedule, st: Rank, step: int, a: Action) -> None:
    """An action of a stage (all but RF, S< and the rank-wide ones) runs on the rank of that stage."""
    s = a.stage
    if a.kind in _OWN_STAGE and s not in st.own:
        _fail(st.rank, step, a, f"stage {s} runs on rank {schedule.layout[s]}, not here (rank {st.rank} runs {sorted(st.own)})",  # type: ignore[index]
              "put the action on the rank of its stage")


def _load(schedule: Schedule, st: Rank, step: int, a: Action, s: Any, k: Any) -> None:
    """Only the first and last stages load, each micro-batch once."""
    p, have, rank = schedule.stages, st.have, st.rank
    if s not in (0, p - 1):
        _fail(rank, step, a, f"only the first and last stages load micro-batches, not stage {s}", "drop the load")
    _once(have, rank, step, a, ("L", s, k))
    have.add(("Lany", k))


def _forward(schedule: Schedule, st: Rank, step: int, a: Action, s: Any, k: Any) -> None:
    """F runs once, after its input (loaded, received or computed here) and, on the last stage, its labels."""
    p, have, rank = schedule.stages, st.have, st.rank
    if ("saved", s, k) in have:
        _fail(rank, step, a, f"F({s}, {k}) is recomputed although its RF output is reused", "drop it or drop k from reuse_rf")
    if s == 0 and ("L", 0, k) not in have:
        _fail(rank, step, a, f"F(0, {k}) before micro-batch {k} was loaded", f"put 0L{k} before it")
    if s > 0 and not _has_input(have, s, k):
        _fail(rank, step, a, f"F({s}, {k}) before its input arrived", f"receive {s}A{k}<... or run {s - 1}F{k} first")
    if s == p - 1 and ("L", s, k) not in have:
        _fail(rank, step, a, f"the last stage's F({s}, {k}) needs its labels", f"put {s}L{k} before it")
    _once(have, rank, step, a, ("F", s, k))


def _backward(schedule: Schedule, st: Rank, step: int, a: Action, s: Any, k: Any) -> None:
    """B follows its F (RB a kept RF) and the output gradient; a stage's backward of a micro-batch runs once."""
    p, have, rank, kind = schedule.stages, st.have, st.rank, a.kind
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


def _redundant_forward(schedule: Schedule, st: Rank, step: int, a: Action, s: Any, k: Any) -> None:
    """RF computes the rank's replica stage, after the input this rank made for it (F of s - 1, or the load)."""
    have, rank = st.have, st.rank
    if schedule.replicas[rank] != s:
        _fail(rank, step, a, f"rank {rank} holds the replica of stage {schedule.replicas[rank]}, not {s}",
              "RF only the replica stage")
    if s == 0 and ("Lany", k) not in have:
        _fail(rank, step, a, f"RF(0, {k}) before micro-batch {k} was loaded on this rank", "run it after the load")
    if s > 0 and ("F", s - 1, k) not in have:
        _fail(rank, step, a, f"RF({s}, {k}) before this rank computed its input F({s - 1}, {k})", "run it after that forward")
    if ("U", s) not in have:
        _fail(rank, step, a, f"RF({s}, {k}) before the replica's update of the last step", f"put {s}U before the first RF")
    _once(have, rank, step, a, ("RF", s, k))


def _replica_update(schedule: Schedule, st: Rank, step: int, a: Action, s: Any, k: Any) -> None:
    """U applies the last step's update of the replica this rank holds, once per step."""
    if schedule.replicas[st.rank] != s:
        _fail(st.rank, step, a, f"rank {st.rank} holds the replica of stage {schedule.replicas[st.rank]}, not {s}",
              "update the replica this rank holds")
    _once(st.have, st.rank, step, a, ("U", s))


def _send_act(schedule: Schedule, st: Rank, step: int, a: Action, s: Any, k: Any) -> None:
    """A stage's output goes to the rank of the next stage, once computed (or kept by an RF)."""
    p, have, rank = schedule.stages, st.have, st.rank
    if s == p - 1 or schedule.layout[s + 1] != a.peer:
        _fail(rank, step, a, f"stage {s}'s output goes to rank {None if s == p - 1 else schedule.layout[s + 1]}, not {a.peer}",
              "send to the rank of the next stage")
    if ("F", s, k) not in have and ("saved", s, k) not in have:
        _fail(rank, step, a, f"sending the output of ({s}, {k}) before computing it", f"run {s}F{k} first")
    _once(have, rank, step, a, ("sentA", s, k))


def _send_grad(schedule: Schedule, st: Rank, step: int, a: Action, s: Any, k: Any) -> None:
    """A stage's input gradient goes to the rank of the previous stage, after its backward."""
    have, rank = st.have, st.rank
    if s == 0 or schedule.layout[s - 1] != a.peer:
        _fail(rank, step, a, f"stage {s}'s input gradient goes to rank {None if s == 0 else schedule.layout[s - 1]}, "
              f"not {a.peer}", "send to the rank of the previous stage")
    if ("B", s, k) not in have and ("RB", s, k) not in have:
        _fail(rank, step, a, f"sending the input gradient of ({s}, {k}) before its backward", f"run {s}B{k} first")
    _once(have, rank, step, a, ("sentG", s, k))


def _recv_act(schedule: Schedule, st: Rank, step: int, a: Action, s: Any, k: Any) -> None:
    """A stage's input comes from the rank of the previous stage."""
    if s == 0 or schedule.layout[s - 1] != a.peer:
        _fail(st.rank, step, a, f"stage {s}'s input comes from rank {None if s == 0 else schedule.layout[s - 1]}, not {a.peer}",
              "receive from the rank of the previous stage")
    _once(st.have, st.rank, step, a, ("act", s, k))


def _recv_grad(schedule: Schedule, st: Rank, step: int, a: Action, s: Any, k: Any) -> None:
    """A stage's output gradient comes from the rank of the next stage."""
    p = schedule.stages
    if s == p - 1 or schedule.layout[s + 1] != a.peer:
        _fail(st.rank, step, a, f"stage {s}'s output gradient comes from rank {None if s == p - 1 else schedule.layout[s + 1]}, "
              f"not {a.peer}", "receive from the rank of the next stage")
    _once(st.have, st.rank, step, a, ("grad", s, k))


def _send_sync(schedule: Schedule, st: Rank, step: int, a: Action, s: Any, k: Any) -> None:
    """The owner ships its stage's gradients to the replica's holder after OPT finished them (unscaled, clipped:
    what its own optimizer consumes)."""
    holder = [r for r, rs in enumerate(schedule.replicas) if rs == s]
    if a.peer not in holder:
        _fail(st.rank, step, a, f"stage {s}'s replica lives on {holder or 'no rank'}, not rank {a.peer}", "sync to the holder")
    if ("OPT",) not in st.have:
        _fail(st.rank, step, a, f"shipping stage {s}'s gradients before OPT finished them", "put S> after OPT")
    _once(st.have, st.rank, step, a, ("S>", s))


def _recv_sync(schedule: Schedule, st: Rank, step: int, a: Action, s: Any, k: Any) -> None:
    """The holder receives its replica stage's gradients from the stage's owner, after its own OPT (the engine
    waits for them once the step's loss went out; the next step's U applies them)."""
    rank = st.rank
    if schedule.replicas[rank] != s or schedule.layout[s] != a.peer:
        _fail(rank, step, a, f"rank {rank} holds the replica of {schedule.replicas[rank]} and stage {s} runs on rank "
              f"{schedule.layout[s]}", "receive the replica's stage from its owner")
    if ("OPT",) not in st.have:
        _fail(rank, step, a, f"receiving stage {s}'s gradients before this rank's OPT", "put S< after OPT")
    _once(st.have, rank, step, a, ("S<", s))


def _reduce(schedule: Schedule, st: Rank, step: int, a: Action, s: Any, k: Any) -> None:
    """TIE and RED come after the last backward of every stage the rank runs."""
    have, kind = st.have, a.kind
    missing = [(t, j) for t in sorted(st.own) for j in range(schedule.micro_batches) if ("B", t, j) not in have
               and ("RB", t, j) not in have]
    if missing:
        _fail(st.rank, step, a, f"{kind.name} before the backward of {missing[:4]}{'...' if len(missing) > 4 else ''}",
              "reduce after the last backward")
    _once(have, st.rank, step, a, (kind.value,))


def _optimizer(schedule: Schedule, st: Rank, step: int, a: Action, s: Any, k: Any) -> None:
    """OPT comes after RED."""
    have = st.have
    if ("RED",) not in have:
        _fail(st.rank, step, a, "OPT before RED", "reduce the gradients first")
    _once(have, st.rank, step, a, ("OPT",))


#: the rule of each kind, by its token (a str key: Enum hashing is slow in the dry run's inner loop)
_BY_KIND = {
    Kind.LOAD.value: _load,
    Kind.FORWARD.value: _forward,
    Kind.BACKWARD.value: _backward,
    Kind.REDUNDANT_BACKWARD.value: _backward,
    Kind.REDUNDANT_FORWARD.value: _redundant_forward,
    Kind.SEND_ACT.value: _send_act,
    Kind.SEND_GRAD.value: _send_grad,
    Kind.RECV_ACT.value: _recv_act,
    Kind.RECV_GRAD.value: _recv_grad,
    Kind.SEND_SYNC.value: _send_sync,
    Kind.RECV_SYNC.value: _recv_sync,
    Kind.REDUCE_TIED.value: _reduce,
    Kind.REDUCE.value: _reduce,
    Kind.OPTIMIZER.value: _optimizer,
    Kind.REPLICA_UPDATE.value: _replica_update,
}


def finish_check(schedule: Schedule, st: Rank) -> None:
    m, have = schedule.micro_batches, st.have
    for s in sorted(st.own):
        for k in range(m):
            if ("F", s, k) not in have and ("saved", s, k) not in have:
                raise ScheduleError(f"stage {s} never runs the forward of micro-batch {k}; add {s}F{k}", st.rank)
            if ("B", s, k) not in have and ("RB", s, k) not in have:
                raise ScheduleError(f"stage {s} never runs the backward of micro-batch {k}; add {s}B{k}", st.rank)
    if ("OPT",) not in have:
        raise ScheduleError("the step ends without OPT; end the last step with TIE RED OPT", st.rank)
    replica = schedule.replicas[st.rank]
    if replica is not None and ("U", replica) not in have:
        raise ScheduleError(f"rank {st.rank} holds the replica of stage {replica} but never applies its update; "
                            f"add {replica}U", st.rank)
    opt = next(i for i, (_, a) in enumerate(st.items) if a.kind is Kind.OPTIMIZER)
    last = 0
    for step, a in st.items[opt + 1:]:
        place = _AFTER_OPT.index(a.kind) if a.kind in _AFTER_OPT else -1
        if place < last:
            raise ScheduleError(f"only U, then S>, then S< may follow OPT (S< waits until the step's loss went out), "
                                f"found {a}", st.rank, step, a)
        last = place


#: what may follow OPT, in this order (``finish_check``)
_AFTER_OPT = (Kind.REPLICA_UPDATE, Kind.SEND_SYNC, Kind.RECV_SYNC)
