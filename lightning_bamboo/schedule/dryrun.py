"""The dry run: every rank executed with blocking transfers; ``validate`` and ``simulate`` build on it."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_bamboo.schedule.action import Action, Kind, ScheduleError
from lightning_bamboo.schedule.costs import Costs
from lightning_bamboo.schedule.program import Schedule
from lightning_bamboo.schedule.rules import Rank, check, finish_check


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


def execute(schedule: Schedule, costs: Costs) -> list[list[tuple[float, float, float]]]:
    """Dry-run every rank with blocking sends and receives (a transfer happens when both ends reach it; a replica's
    gradients are shipped without waiting and received once shipped), checking data dependencies; return per
    rank, per action (arrival, start, end) times."""
    p = schedule.stages
    ranks = [Rank(schedule, r) for r in range(p)]
    shipped: dict[tuple, float] = {}  # replica gradients shipped (S>) and not yet received: when they arrive
    progress = True
    while progress:
        progress = False
        for st in ranks:
            while st.pos < len(st.items):
                step, a = st.items[st.pos]
                if not a.is_comm:
                    check(schedule, st, step, a)
                    end = st.clock + costs.of(a)
                    st.timing.append((st.clock, st.clock, end))
                    st.clock = end
                    st.pos += 1
                    progress = True
                    continue
                if a.peer is None or not 0 <= a.peer < p or a.peer in (st.rank, schedule.dead):
                    check(schedule, st, step, a)           # raises: no such peer
                if a.kind is Kind.SEND_SYNC or a.kind is Kind.RECV_SYNC:
                    if not _sync(schedule, st, step, a, costs, shipped):
                        break                              # its gradients are not shipped yet
                    progress = True
                    continue
                other = ranks[a.peer]  # type: ignore[index]
                if other.pos >= len(other.items):
                    raise ScheduleError(f"{a} waits on rank {a.peer}, which has finished its step; add "
                                        f"{_expected_partner(st.rank, a)} to rank {a.peer}", st.rank, step, a)
                ostep, oa = other.items[other.pos]
                if not oa.is_comm or oa.peer != st.rank or oa.kind is Kind.RECV_SYNC or oa.kind is Kind.SEND_SYNC:
                    break                       # the peer is busy elsewhere; come back later
                if _channel(st.rank, a) != _channel(other.rank, oa) or a.is_send == oa.is_send:
                    raise ScheduleError(
                        f"ranks {st.rank} and {other.rank} block on each other: rank {st.rank} is at {a} (step "
                        f"{step}) but rank {other.rank} is at {oa} (step {ostep}); the two must agree on the "
                        f"order of their transfers; rank {other.rank} should be at {_expected_partner(st.rank, a)}",
                        st.rank, step, a)
                check(schedule, st, step, a)
                check(schedule, other, ostep, oa)
                start = max(st.clock, other.clock)
                end = start + costs.of(a)
                st.timing.append((st.clock, start, end))
                other.timing.append((other.clock, start, end))
                st.clock = other.clock = end
                st.pos += 1
                other.pos += 1
                progress = True
    stuck = [st for st in ranks if st.head is not None]
    for st in stuck:
        step, a = st.head  # type: ignore[misc]
        if a.kind is Kind.RECV_SYNC and ranks[a.peer].head is None:  # type: ignore[index]
            raise ScheduleError(f"{a} waits for rank {a.peer}'s {_expected_partner(st.rank, a)}, which it never "
                                f"ships; add it after rank {a.peer}'s OPT", st.rank, step, a)
    if not stuck and shipped:
        (source, holder, _, stage, _) = next(iter(shipped))
        raise ScheduleError(f"rank {source} ships stage {stage}'s gradients to rank {holder}, which never receives "
                            f"them; add {stage}S<{source} to rank {holder}")
    if stuck:
        lines = [f"rank {st.rank} at step {st.head[0]}: {st.head[1]}" for st in stuck]  # type: ignore[index]
        first = stuck[0]
        raise ScheduleError("deadlock: every blocked rank waits on a peer that waits elsewhere (" +
                            "; ".join(lines) + "); reorder the transfers so each send meets its receive",
                            first.rank, first.head[0], first.head[1])  # type: ignore[index]
    for st in ranks:
        if st.rank != schedule.dead:
            finish_check(schedule, st)
    return [st.timing for st in ranks]


def _sync(schedule: Schedule, st: Rank, step: int, a: Action, costs: Costs, shipped: dict[tuple, float]) -> bool:
    """Run a replica sync action of ``st`` if it can run: ``S>`` never waits (the owner ships without waiting, as
    the engine does), ``S<`` waits until its gradients were shipped. False: ``S<`` must wait."""
    channel = _channel(st.rank, a)
    if a.kind is Kind.SEND_SYNC:
        check(schedule, st, step, a)
        end = st.clock + costs.of(a)
        shipped[channel] = end
        st.timing.append((st.clock, st.clock, end))
    else:
        if channel not in shipped:
            return False
        check(schedule, st, step, a)
        end = max(st.clock, shipped.pop(channel))
        st.timing.append((st.clock, end, end))
    st.clock = end
    st.pos += 1
    return True


def validate(schedule: Schedule) -> None:
    """Raise ``ScheduleError`` (naming rank, step, action) unless every send meets its receive on the peer in
    a consistent order, every data dependency holds on the rank that needs it, every stage runs each
    micro-batch's forward and backward once, and the dry run with blocking transfers finishes on all ranks."""
    execute(schedule, Costs())


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
    timing = execute(schedule, costs)
    stripped = Schedule(schedule.stages, schedule.micro_batches, schedule.redundancy,
                        tuple(tuple(tuple(a for a in tick if a.kind is not Kind.REDUNDANT_FORWARD) for tick in prog)
                              for prog in schedule.programs),
                        schedule.layout, schedule.replicas, schedule.dead, schedule.reuse_rf)
    base_timing = execute(stripped, costs)
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
