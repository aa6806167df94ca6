"""Builders of the healthy step (off, lazy, eager with RF in the waits) and of the failover step."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

from lightning_bamboo.schedule.action import Action, Kind, ScheduleError
from lightning_bamboo.schedule.costs import Costs
from lightning_bamboo.schedule.dryrun import execute
from lightning_bamboo.schedule.placement import replica_stage
from lightning_bamboo.schedule.program import Schedule, Tick, check_shape
from lightning_bamboo.topology.layout import replica_holder


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
    """Replica sync per rank: for each stage with a live replica, its owner ships ``S>`` and the holder
    receives ``S<``. Ships go first: an owner ships without waiting, and a holder waits for its replica's
    gradients last of all, once the step's loss went out (the first stage, whose replica the last stage
    holds, ships last)."""
    per_rank: list[list[Action]] = [[] for _ in range(p)]
    for holder, stage in enumerate(replicas):
        if stage is None:
            continue
        owner = layout[stage]
        per_rank[owner].append(Action(Kind.SEND_SYNC, stage, peer=holder))
        per_rank[holder].append(Action(Kind.RECV_SYNC, stage, peer=owner))
    for actions in per_rank:
        actions.sort(key=lambda a: a.is_recv)
    return per_rank


def updates_replica_at_end(stage: int, stages: int) -> bool:
    """Where the holder on stage ``stage`` of ``stages`` applies its replica's update (``U``): in the step's
    longest wait. Stage ``i`` of ``p`` waits about ``(p - 1 - i) * B`` for its first gradient (its successors'
    forwards and backwards of the first micro-batch, less its own warm-up forwards) and ``i * B`` at the end
    of its schedule (for the replica's gradients, until the first stage ran its last backward); ``i * F`` for
    its first activation is never the longest. True: at the end (the later half of the stages, the last one
    always); under eager, where the end also holds the redundant forwards, in the wait for the first
    activation instead. False: before the first gradient's receive."""
    return 2 * stage > stages - 1


def _place_update(programs: list[list[list[Action]]], p: int, replicas: Sequence[int | None], eager: bool) -> None:
    """Put each holder's ``U`` where ``updates_replica_at_end`` says, or before its first RF if that comes
    earlier (an RF runs on the replica's weights of this step)."""
    for rank, program in enumerate(programs):
        target = replicas[rank]
        if target is None or not program:
            continue
        for tick in program:
            tick[:] = [a for a in tick if a.kind is not Kind.REPLICA_UPDATE]
        update = Action(Kind.REPLICA_UPDATE, target)
        at_end = updates_replica_at_end(rank, p)
        wanted = Kind.RECV_ACT if at_end else Kind.RECV_GRAD
        spot = None if at_end and not eager else next(
            ((t, i) for t, tick in enumerate(program) for i, a in enumerate(tick)
             if a.kind is wanted or a.kind is Kind.REDUNDANT_FORWARD), None)
        if spot is None:  # right after OPT: the wait at the end of the step
            program[-1].insert(next(i for i, a in enumerate(program[-1]) if a.kind is Kind.OPTIMIZER) + 1, update)
        else:
            program[spot[0]].insert(spot[1], update)


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
        program[-1] += [Action(Kind.REDUCE_TIED), Action(Kind.REDUCE), Action(Kind.OPTIMIZER)] + sync[rank]
        programs.append(program)
    _place_update(programs, p, replicas, eager=False)
    return programs


def _freeze(programs: list[list[list[Action]]]) -> tuple[tuple[Tick, ...], ...]:
    return tuple(tuple(tuple(tick) for tick in program) for program in programs)


def build_schedule(stages: int, micro_batches: int, redundancy: str = "off", *, costs: Costs | None = None,
                   rf_budget: int | None = None, kept: Sequence[bool] | None = None) -> Schedule:
    """One healthy training step.

    ``"off"``: DeepSpeed's TrainSchedule, action for action. ``"lazy"``: the same plus the replica's actions
    (node r holds stage ``(r + 1) % stages``): each owner ships the gradients its OPT finished, ``S>``, to the
    holder, which receives them last, ``S<``, and applies them in the next step's ``U``, placed in its longest
    wait (``updates_replica_at_end``). ``"eager"``: lazy plus redundant forwards of the replica
    stage placed where the rank would wait (see ``_place_rf``): with ``rf_budget=None`` only into those
    waits, given ``costs``; the micro-batches left out are recomputed on failure (F and B on the replica). An
    int ``rf_budget`` caps RFs per rank at that number and puts those that fit no wait just before TIE
    (outside the bubbles, costing time): ``rf_budget=micro_batches`` computes every RF.
    ``kept`` (lazy and eager; per stage, ``topology.replicas.kept_replicas``): only the replicas of the stages it
    marks are held (``redundancy="auto"``); a rank holding none has no ``U``, ``S<`` or RF, a stage whose replica
    is not kept no ``S>``. None: every stage's.
    """
    check_shape(stages, micro_batches, redundancy)
    if kept is not None and (len(kept) != stages or redundancy == "off"):
        raise ScheduleError(f"kept names one flag per stage, for lazy or eager (stages: {stages}, redundancy: "
                            f"{redundancy!r}, kept: {list(kept)})")
    if rf_budget is not None and (not isinstance(rf_budget, int) or isinstance(rf_budget, bool) or rf_budget < 0):
        raise ScheduleError(f"rf_budget must be None (waits only) or an int >= 0, got {rf_budget!r}")
    if rf_budget is not None and redundancy != "eager":
        raise ScheduleError(f"rf_budget only applies to redundancy='eager', got redundancy={redundancy!r}")
    p, m = stages, micro_batches
    layout = tuple(range(p))
    replicas: tuple[int | None, ...] = (tuple(None for _ in range(p)) if redundancy == "off"
                                        else tuple(replica_stage(r, p) if kept is None or kept[replica_stage(r, p)]
                                                   else None for r in range(p)))
    programs = _assemble(p, m, layout, replicas, None)
    if redundancy == "eager":
        programs = _place_rf(programs, p, m, layout, replicas, costs or Costs(), rf_budget)
        _place_update(programs, p, replicas, eager=True)
    return Schedule(p, m, redundancy, _freeze(programs), layout, replicas)


def build_failover(stages: int, micro_batches: int, dead: int, *, redundancy: str = "lazy",
                   reuse_rf: Iterable[int] = (), kept: Sequence[bool] | None = None) -> Schedule:
    """The step run right after node ``dead`` is lost (the step in flight, redone once): its predecessor in
    the ring, ``replica_holder(dead)``, runs its own stage and ``dead``'s stage from the replica (for
    ``dead == 0`` that is rank ``stages - 1`` running stages ``stages - 1`` and 0). The merged rank's step
    ``t`` holds both stages' step ``t`` (the hand-off between adjacent stages is local). Micro-batches in
    ``reuse_rf`` (eager only; see ``Schedule.redundant_forwards``) skip the dead stage's forward: the kept RF
    output is sent on and their backward is ``RB``. Replicas still backed by a live holder keep being synced;
    the dead stage's and its successor's are gone until the pipeline is rebuilt. No RF is placed. ``kept``: as in
    ``build_schedule``; the dead stage's replica must be one of them."""
    check_shape(stages, micro_batches, redundancy)
    if redundancy == "off":
        raise ScheduleError("a failover step needs the replica: redundancy must be 'lazy' or 'eager', got 'off'")
    if not isinstance(dead, int) or isinstance(dead, bool) or not 0 <= dead < stages:
        raise ScheduleError(f"dead must be a rank in [0, {stages}), got {dead!r}")
    reuse = frozenset(reuse_rf)
    if reuse and redundancy != "eager":
        raise ScheduleError(f"reuse_rf={sorted(reuse)} needs redundancy='eager' (lazy keeps no RF outputs)")
    if kept is not None and (len(kept) != stages or not kept[dead]):
        raise ScheduleError(f"a failover of rank {dead} needs its replica: kept names one flag per stage and marks "
                            f"stage {dead} (kept: {list(kept)})")
    p, m = stages, micro_batches
    holder = replica_holder(dead, p)
    layout = tuple(holder if s == dead else s for s in range(p))
    replicas = tuple(None if r in (dead, holder) or (kept is not None and not kept[replica_stage(r, p)])
                     else replica_stage(r, p) for r in range(p))
    programs = _assemble(p, m, layout, replicas, dead, reuse)
    return Schedule(p, m, redundancy, _freeze(programs), layout, replicas, dead, reuse)


def _place_rf(programs: list[list[list[Action]]], p: int, m: int, layout: Sequence[int],
              replicas: Sequence[int | None], costs: Costs, budget: int | None) -> list[list[list[Action]]]:
    """Eager placement. Simulate the lazy step with ``costs``; wherever a rank waits ``w`` slots for a peer
    before an action, insert ``floor(w / forward)`` RFs just before it, lowest ready micro-batch first (RF of
    stage s+1 on micro-batch k is ready once the rank ran F(s, k); RF of stage 0 on the last rank once it
    loaded k). The step ends when every rank is done (the runtime commits it everywhere or nowhere), so a
    rank also waits from OPT to the end of the slowest rank, less its own work after OPT: RFs filling that
    wait run just before OPT. An RF never outlasts the wait it fills, so the step does not lengthen. Then,
    if ``budget`` is an int, RFs beyond it are dropped and missing ones up to it go before TIE."""
    schedule = Schedule(p, m, "lazy", _freeze(programs), tuple(layout), tuple(replicas))
    timing = execute(schedule, costs)
    step_end = max(t[-1][2] for t in timing if t)
    out: list[list[list[Action]]] = []
    for rank, program in enumerate(programs):
        target = replicas[rank]
        if target is None:  # this rank keeps no replica (``kept``): nothing to place
            out.append(program)
            continue
        cap = m if budget is None else budget
        ready: list[int] = []
        placed: list[int] = []
        new_program: list[list[Action]] = []
        index = 0
        after_opt = False
        for tick in program:
            new_tick: list[Action] = []
            for position, action in enumerate(tick):
                arrive, start, _ = timing[rank][index]
                index += 1
                if action.kind is Kind.OPTIMIZER:
                    after_opt = True  # what follows (U, S>, S<) waits for the step's end; count it here
                    start = step_end - sum(costs.of(a) for a in tick[position:])
                elif after_opt:
                    start = arrive
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
