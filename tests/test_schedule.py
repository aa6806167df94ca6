"""The RC schedule as pictures: literal Step x Rank tables, sweeps that must validate, broken schedules caught."""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
from pathlib import Path

import pytest

from lightning_bamboo.schedule import (
    Action,
    Costs,
    Kind,
    Schedule,
    ScheduleError,
    build_failover,
    build_schedule,
    deepspeed_steps,
    format_table,
    replica_holder,
    replica_stage,
    simulate,
    validate,
)

# How to read the tables: a row is one DeepSpeed step, a cell the actions of that step on that rank, in order.
# "0L1" loads micro-batch 1 for stage 0, "0F1"/"0B1" forward/backward, "0A1>1" sends stage 0's output of
# micro-batch 1 to rank 1 and "1A1<0" receives it, "G" is the gradient flowing back, "1RF0" is rank 0's
# redundant forward of its successor's stage 1, "0RB0" a backward through such a kept forward, "0S>1"/"0S<0"
# ship stage 0's finished gradients to its replica holder, "1U" applies them to the replica in the next step. Forward of micro-batch k on stage s runs at step
# 2k + s, its backward at 2k + 2p - 1 - s (DeepSpeed's TrainSchedule).


def table(text: str) -> str:
    return text.lstrip("\n")


def test_off_two_stages_is_deepspeeds_1f1b():
    assert format_table(build_schedule(2, 3, "off")) == table("""
        Rank 0                | Rank 1
Step 0: 0L0 0F0               |
Step 1: 0A0>1                 | 1A0<0 1L0 1F0
Step 2: 0L1 0F1               | 1B0
Step 3: 0G0<1 0A1>1 0B0       | 1G0>0 1A1<0 1L1 1F1
Step 4: 0L2 0F2               | 1B1
Step 5: 0G1<1 0A2>1 0B1       | 1G1>0 1A2<0 1L2 1F2
Step 6:                       | 1B2
Step 7: 0G2<1 0B2 TIE RED OPT | 1G2>0 TIE RED OPT
""")


def test_lazy_two_stages_adds_only_the_replica_actions():
    # rank 0 holds stage 1's replica and rank 1 stage 0's (the ring). Each owner ships what its OPT finished
    # (S>) and receives its replica's gradients last (S<); the next step's U applies them, in the rank's longest
    # wait: before the first gradient on rank 0, at the end (waiting for stage 0's gradients) on rank 1.
    assert format_table(build_schedule(2, 3, "lazy")) == table("""
        Rank 0                          | Rank 1
Step 0: 0L0 0F0                         |
Step 1: 0A0>1                           | 1A0<0 1L0 1F0
Step 2: 0L1 0F1                         | 1B0
Step 3: 1U 0G0<1 0A1>1 0B0              | 1G0>0 1A1<0 1L1 1F1
Step 4: 0L2 0F2                         | 1B1
Step 5: 0G1<1 0A2>1 0B1                 | 1G1>0 1A2<0 1L2 1F2
Step 6:                                 | 1B2
Step 7: 0G2<1 0B2 TIE RED OPT 0S>1 1S<1 | 1G2>0 TIE RED OPT 0U 1S>0 0S<0
""")


def test_eager_two_stages_fills_the_waits_only():
    # F=1, B=2. Rank 0 ran F0, F1 by t=2 and waits for 0G0 until t=4 (rank 1 runs F0, B0): RF0, RF1 fit, after
    # U (an RF runs on the replica's weights of this step). It waits 1 slot for 0G2 (rank 1's B2 ends 1 after
    # rank 0's B1): RF2. Rank 1 cannot use its first wait (nothing loaded yet), so its U goes there, and it
    # waits 2 slots for stage 0's gradients at the end: RF of stage 0 on mb 0 and 1, run before its OPT.
    schedule = build_schedule(2, 3, "eager")
    assert format_table(schedule) == table("""
        Rank 0                               | Rank 1
Step 0: 0L0 0F0                              |
Step 1: 0A0>1                                | 0U 1A0<0 1L0 1F0
Step 2: 0L1 0F1                              | 1B0
Step 3: 1U 1RF0 1RF1 0G0<1 0A1>1 0B0         | 1G0>0 1A1<0 1L1 1F1
Step 4: 0L2 0F2                              | 1B1
Step 5: 0G1<1 0A2>1 0B1                      | 1G1>0 1A2<0 1L2 1F2
Step 6:                                      | 1B2
Step 7: 1RF2 0G2<1 0B2 TIE RED OPT 0S>1 1S<1 | 1G2>0 TIE RED 0RF0 0RF1 OPT 1S>0 0S<0
""")
    sim = simulate(schedule)
    assert sim.makespan == sim.baseline == 12      # 3 F + 3 B on a rank = 9, plus (p - 1)(F + B) = 3
    assert sim.bubble == (3, 3)
    assert sim.rc == (3, 2) and sim.rc_outside == (0, 0)


def test_failover_two_stages_both_directions():
    # rank 1 died: rank 0 runs stages 0 and 1, step t holding both stages' step t, hand-off local.
    assert format_table(build_failover(2, 3, dead=1)) == table("""
        Rank 0          | Rank 1 (dead)
Step 0: 0L0 0F0         |
Step 1: 1L0 1F0         |
Step 2: 0L1 0F1 1B0     |
Step 3: 0B0 1L1 1F1     |
Step 4: 0L2 0F2 1B1     |
Step 5: 0B1 1L2 1F2     |
Step 6: 1B2             |
Step 7: 0B2 TIE RED OPT |
""")
    # rank 0 died while eager: rank 1 (holder of stage 0) kept RF of micro-batches 0 and 1, so it only loads
    # them for stage 0, feeds the kept outputs to stage 1, and back-propagates through them (RB).
    assert format_table(build_failover(2, 3, dead=0, redundancy="eager", reuse_rf=[0, 1])) == table("""
        Rank 0 (dead) | Rank 1
Step 0:               | 0L0
Step 1:               | 1L0 1F0
Step 2:               | 1B0 0L1
Step 3:               | 1L1 1F1 0RB0
Step 4:               | 1B1 0L2 0F2
Step 5:               | 1L2 1F2 0RB1
Step 6:               | 1B2
Step 7:               | 0B2 TIE RED OPT
""")


def test_four_stages_off_and_lazy():
    off = build_schedule(4, 4, "off")
    assert format_table(off) == table("""
         Rank 0                | Rank 1            | Rank 2          | Rank 3
Step 00: 0L0 0F0               |                   |                 |
Step 01: 0A0>1                 | 1A0<0 1F0         |                 |
Step 02: 0L1 0F1               | 1A0>2             | 2A0<1 2F0       |
Step 03: 0A1>1                 | 1A1<0 1F1         | 2A0>3           | 3A0<2 3L0 3F0
Step 04: 0L2 0F2               | 1A1>2             | 2A1<1 2F1       | 3B0
Step 05: 0A2>1                 | 1A2<0 1F2         | 2G0<3 2A1>3 2B0 | 3G0>2 3A1<2 3L1 3F1
Step 06: 0L3 0F3               | 1G0<2 1A2>2 1B0   | 2G0>1 2A2<1 2F2 | 3B1
Step 07: 0G0<1 0A3>1 0B0       | 1G0>0 1A3<0 1F3   | 2G1<3 2A2>3 2B1 | 3G1>2 3A2<2 3L2 3F2
Step 08:                       | 1G1<2 1A3>2 1B1   | 2G1>1 2A3<1 2F3 | 3B2
Step 09: 0G1<1 0B1             | 1G1>0             | 2G2<3 2A3>3 2B2 | 3G2>2 3A3<2 3L3 3F3
Step 10:                       | 1G2<2 1B2         | 2G2>1           | 3B3
Step 11: 0G2<1 0B2             | 1G2>0             | 2G3<3 2B3       | 3G3>2
Step 12:                       | 1G3<2 1B3         | 2G3>1           |
Step 13: 0G3<1 0B3 TIE RED OPT | 1G3>0 TIE RED OPT | TIE RED OPT     | TIE RED OPT
""")
    lazy = build_schedule(4, 4, "lazy")
    rows = format_table(lazy).splitlines()
    assert rows[8] == "Step 07: 1U 0G0<1 0A3>1 0B0              | 1G0>0 1A3<0 1F3             | 2G1<3 2A2>3 2B1          | 3G1>2 3A2<2 3L2 3F2"
    assert rows[-1] == (
        "Step 13: 0G3<1 0B3 TIE RED OPT 0S>3 1S<1 | 1G3>0 TIE RED OPT"
        " 1S>0 2S<2 | TIE RED OPT 3U 2S>1 3S<3 | TIE RED OPT 0U 3S>2 0S<0")
    # lazy differs from off only by the replica's actions: U in the longest wait, the sync after OPT
    replica_kinds = (Kind.SEND_SYNC, Kind.RECV_SYNC, Kind.REPLICA_UPDATE)
    assert off.programs == tuple(tuple(tuple(a for a in tick if a.kind not in replica_kinds) for tick in prog)
                                 for prog in lazy.programs)


def test_four_stages_eager():
    # Rank 0 finishes F0..F3 at t=4 and waits for 0G0 until t=10 (6 slots) but only 4 inputs exist: RF0..RF3.
    # Ranks 2 and 3 wait at the end for rank 0's last backward (the step ends on every rank together): their RFs
    # there run before their OPT.
    schedule = build_schedule(4, 4, "eager")
    assert format_table(schedule) == table("""
         Rank 0                                 | Rank 1                            | Rank 2                     | Rank 3
Step 00: 0L0 0F0                                |                                   |                            |
Step 01: 0A0>1                                  | 1A0<0 1F0                         |                            |
Step 02: 0L1 0F1                                | 1A0>2                             | 3U 2A0<1 2F0               |
Step 03: 0A1>1                                  | 1A1<0 1F1                         | 2A0>3                      | 0U 3A0<2 3L0 3F0
Step 04: 0L2 0F2                                | 1A1>2                             | 2A1<1 2F1                  | 3B0
Step 05: 0A2>1                                  | 1A2<0 1F2                         | 3RF0 3RF1 2G0<3 2A1>3 2B0  | 3G0>2 3A1<2 3L1 3F1
Step 06: 0L3 0F3                                | 2U 2RF0 2RF1 2RF2 1G0<2 1A2>2 1B0 | 2G0>1 2A2<1 2F2            | 3B1
Step 07: 1U 1RF0 1RF1 1RF2 1RF3 0G0<1 0A3>1 0B0 | 1G0>0 1A3<0 1F3                   | 2G1<3 2A2>3 2B1            | 3G1>2 3A2<2 3L2 3F2
Step 08:                                        | 1G1<2 1A3>2 1B1                   | 2G1>1 2A3<1 2F3            | 3B2
Step 09: 0G1<1 0B1                              | 1G1>0                             | 2G2<3 2A3>3 2B2            | 3G2>2 3A3<2 3L3 3F3
Step 10:                                        | 2RF3 1G2<2 1B2                    | 2G2>1                      | 3B3
Step 11: 0G2<1 0B2                              | 1G2>0                             | 3RF2 2G3<3 2B3             | 3G3>2
Step 12:                                        | 1G3<2 1B3                         | 2G3>1                      |
Step 13: 0G3<1 0B3 TIE RED OPT 0S>3 1S<1        | 1G3>0 TIE RED OPT 1S>0 2S<2       | TIE RED 3RF3 OPT 2S>1 3S<3 | TIE RED 0RF0 0RF1 0RF2 0RF3 OPT 3S>2 0S<0
""")
    sim = simulate(schedule)
    assert sim.overhead == 0 and sim.rc == (4, 4, 4, 4)
    assert sim.bubble == (9, 9, 9, 9)              # (p - 1)(F + B) = 3 * 3


def test_four_stages_failover_middle_and_wraparound():
    # rank 2 died: rank 1 runs stages 1 and 2 and talks to rank 3 for stage 2; stage 3's replica (on rank 2)
    # is gone, stage 2's became the real one, so only stages 0 and 1 are still synced.
    assert format_table(build_failover(4, 4, dead=2)) == table("""
         Rank 0                          | Rank 1                          | Rank 2 (dead) | Rank 3
Step 00: 0L0 0F0                         |                                 |               |
Step 01: 0A0>1                           | 1A0<0 1F0                       |               |
Step 02: 0L1 0F1                         | 2F0                             |               |
Step 03: 0A1>1                           | 1A1<0 1F1 2A0>3                 |               | 3A0<1 3L0 3F0
Step 04: 0L2 0F2                         | 2F1                             |               | 3B0
Step 05: 0A2>1                           | 1A2<0 1F2 2G0<3 2A1>3 2B0       |               | 3G0>1 3A1<1 3L1 3F1
Step 06: 0L3 0F3                         | 1B0 2F2                         |               | 3B1
Step 07: 1U 0G0<1 0A3>1 0B0              | 1G0>0 1A3<0 1F3 2G1<3 2A2>3 2B1 |               | 3G1>1 3A2<1 3L2 3F2
Step 08:                                 | 1B1 2F3                         |               | 3B2
Step 09: 0G1<1 0B1                       | 1G1>0 2G2<3 2A3>3 2B2           |               | 3G2>1 3A3<1 3L3 3F3
Step 10:                                 | 1B2                             |               | 3B3
Step 11: 0G2<1 0B2                       | 1G2>0 2G3<3 2B3                 |               | 3G3>1
Step 12:                                 | 1B3                             |               |
Step 13: 0G3<1 0B3 TIE RED OPT 0S>3 1S<1 | 1G3>0 TIE RED OPT 1S>0          |               | TIE RED OPT 0U 0S<0
""")
    # rank 0 died: the last rank holds stage 0's replica, so it runs stages 3 and 0 (first and last).
    wrap = build_failover(4, 4, dead=0)
    assert wrap.layout == (3, 1, 2, 3)
    assert wrap.stages_of(3) == (0, 3)
    rows = format_table(wrap).splitlines()
    assert rows[1] == "Step 00:               |                        |                          | 0L0 0F0"
    assert rows[2] == "Step 01:               | 1A0<3 1F0              |                          | 0A0>1"
    validate(wrap)


# ---------------------------------------------------------------------------------------------------------
# Sweeps
# ---------------------------------------------------------------------------------------------------------

def _live_invariants(schedule: Schedule, seen: set[Action]) -> None:
    p, m = schedule.stages, schedule.micro_batches
    for rank, program in enumerate(schedule.programs):
        if rank == schedule.dead:
            assert program == ()
            continue
        assert len(program) == 2 * (m + p - 1)
        for tick in program:
            for action in tick:
                if action not in seen:
                    assert Action.parse(str(action)) == action
                    seen.add(action)


def test_sweep_every_mode_validates_and_eager_is_free():
    costs = Costs()
    seen: set[Action] = set()
    for m in range(1, 17):
        validate(build_schedule(1, m))
    for p in range(2, 9):
        for m in range(1, 17):
            for mode in ("off", "lazy"):
                schedule = build_schedule(p, m, mode)
                validate(schedule)
                _live_invariants(schedule, seen)
            eager = build_schedule(p, m, "eager")
            sim = simulate(eager, costs)
            _live_invariants(eager, seen)
            assert sim.overhead == 0, (p, m)
            for rank in range(p):
                assert sim.rc_in_bubbles[rank] == sim.rc[rank] <= sim.bubble[rank], (p, m, rank)
                assert eager.redundant_forwards(rank) <= set(range(m))
            for dead in range(p):
                validate(build_failover(p, m, dead))
                holder = replica_holder(dead, p)
                kept = eager.redundant_forwards(holder)
                mid = eager.redundant_forwards(holder, before_step=m + p - 1)
                for reuse in {kept, mid}:
                    failover = build_failover(p, m, dead, redundancy="eager", reuse_rf=reuse)
                    validate(failover)
                    _live_invariants(failover, seen)
                    merged = [a for _, a in failover.actions(holder)]
                    assert {a.micro_batch for a in merged if a.kind is Kind.REDUNDANT_BACKWARD} == reuse
                    assert {a.micro_batch for a in merged if a.kind is Kind.FORWARD and a.stage == dead} \
                        == set(range(m)) - reuse


@pytest.mark.parametrize("costs", [Costs(forward=1, backward=3, send=0.25), Costs(forward=2, backward=2, load=1),
                                   Costs(forward=1.5, backward=2.5, send=1, sync=2)])
def test_eager_placement_is_free_under_other_costs(costs):
    for p in (2, 3, 5, 8):
        for m in (1, 3, 8, 13):
            sim = simulate(build_schedule(p, m, "eager", costs=costs), costs)
            assert sim.overhead == 0, (p, m)
            assert all(rc <= bubble for rc, bubble in zip(sim.rc, sim.bubble, strict=True)), (p, m)


def test_sweep_full_eager_budget_costs_at_least_the_missing_bubble():
    # Every RF computed: a rank's work is busy + rc, so the step lengthens by at least rc - bubble on it.
    for p in range(2, 9):
        for m in (1, 4, 8, 16):
            sim = simulate(build_schedule(p, m, "eager", rf_budget=m))
            assert sim.rc == tuple(m * Costs().forward for _ in range(p))
            assert sim.overhead >= max(r - b for r, b in zip(sim.rc, sim.bubble, strict=True))
            assert all(i + o == r for i, o, r in zip(sim.rc_in_bubbles, sim.rc_outside, sim.rc, strict=True))


def test_replica_sync_costs_one_transfer_whatever_the_depth():
    # every owner ships without waiting, then waits for its replica's gradients: one transfer time, never p
    for p in range(2, 9):
        for m in (1, 4):
            with_sync = simulate(build_schedule(p, m, "lazy"), Costs(sync=1)).makespan
            assert with_sync - simulate(build_schedule(p, m, "off"), Costs(sync=1)).makespan == 1, (p, m)


def test_design_arithmetic_two_stages_eight_micro_batches():
    # DESIGN: at p=2, m=8, B=2F, each stage idles (p-1)(F+B) = 3F while eager RC of every micro-batch is 8F.
    bubbles_only = simulate(build_schedule(2, 8, "eager"))
    assert bubbles_only.bubble == (3, 3) and bubbles_only.overhead == 0
    assert bubbles_only.rc[0] == 3                  # rank 0 uses all 3 slots; the other 5 RFs are skipped
    everything = simulate(build_schedule(2, 8, "eager", rf_budget=8))
    assert everything.overhead >= 8 - 3


def test_off_equals_deepspeed_train_schedule():
    ds = pytest.importorskip("deepspeed.runtime.pipe.schedule")
    for p in range(1, 9):
        for m in range(1, 17):
            schedule = build_schedule(p, m)
            for rank in range(p):
                ours = [[(name, kwargs) for name, kwargs, _ in step] for step in deepspeed_steps(schedule, rank)]
                theirs = [[(type(cmd).__name__, cmd.kwargs) for cmd in step]
                          for step in ds.TrainSchedule(micro_batches=m, stages=p, stage_id=rank)]
                assert ours == theirs, (p, m, rank)


def test_deepspeed_steps_names_rc_instructions():
    steps = deepspeed_steps(build_schedule(2, 3, "eager"), 0)
    assert [(n, k) for n, k, _ in steps[3][:1]] == [("ReplicaUpdate", {"stage": 1})]
    assert [(n, k) for n, k, _ in steps[3][1:3]] == [("RedundantForward", {"stage": 1, "micro_batch": 0,
                                                                          "buffer_id": 0}),
                                                    ("RedundantForward", {"stage": 1, "micro_batch": 1,
                                                                          "buffer_id": 1})]
    assert [(n, k) for n, k, _ in steps[-1][-2:]] == [("SendReplicaSync", {"stage": 0, "peer": 1}),
                                                      ("RecvReplicaSync", {"stage": 1, "peer": 1})]


# ---------------------------------------------------------------------------------------------------------
# Broken schedules are caught
# ---------------------------------------------------------------------------------------------------------

def _edit(schedule: Schedule, rank: int, step: int, new_tick: list[str]) -> Schedule:
    programs = [list(p) for p in schedule.programs]
    programs[rank][step] = tuple(Action.parse(x) for x in new_tick)
    return dataclasses.replace(schedule, programs=tuple(tuple(p) for p in programs))


def test_transfers_in_inconsistent_order_are_caught_with_the_table():
    # rank 1 receives micro-batch 1's activation before sending micro-batch 0's gradient: both block.
    broken = _edit(build_schedule(2, 3), 1, 3, ["1A1<0", "1G0>0", "1L1", "1F1"])
    with pytest.raises(ScheduleError) as info:
        validate(broken)
    err = info.value
    assert (err.rank, err.step, str(err.action)) == (1, 3, "1A1<0")
    assert "rank 0 is at 0G0<1 (step 3)" in str(err) and "rank 0 should be at 0A1>1" in str(err)
    shown = format_table(broken, error_at=err.step).splitlines()
    assert shown[4].startswith("Step 3:") and shown[4].endswith("<-- ERROR HERE")
    assert sum("ERROR HERE" in line for line in shown) == 1


def test_data_dependency_is_caught():
    # stage 0 sends micro-batch 2's activation before computing it
    schedule = build_schedule(2, 3)
    broken = _edit(_edit(schedule, 0, 4, ["0L2"]), 0, 5, ["0G1<1", "0A2>1", "0F2", "0B1"])
    with pytest.raises(ScheduleError, match=re.escape("rank 0, step 5, action 0A2>1: sending the output of (0, 2) "
                                                      "before computing it; run 0F2 first")):
        validate(broken)


def test_missing_backward_and_wrong_peer_are_caught():
    schedule = build_schedule(2, 3)
    with pytest.raises(ScheduleError, match=r"rank 0, step 7, action TIE: REDUCE_TIED before the backward of \[\(0, 2\)\]"):
        validate(_edit(schedule, 0, 7, ["0G2<1", "TIE", "RED", "OPT"]))
    with pytest.raises(ScheduleError, match="not another live rank"):
        validate(_edit(schedule, 0, 1, ["0A0>0"]))


def test_three_rank_cycle_is_a_deadlock():
    # every rank waits for its replica's gradients before it ships its own: 0 -> 2 -> 1 -> 0 each wait on the next
    lazy = build_schedule(3, 1, "lazy")
    last = len(lazy.programs[0]) - 1
    broken = lazy
    for rank, ticks in {0: ["1S<1", "0S>2"], 1: ["2S<2", "1S>0"], 2: ["0S<0", "2S>1"]}.items():
        tick = [str(a) for a in lazy.programs[rank][last]]
        broken = _edit(broken, rank, last, [x for x in tick if "S" not in x] + ticks)
    with pytest.raises(ScheduleError, match="deadlock") as info:
        validate(broken)
    message = str(info.value)
    assert all(f"rank {r} at step {last}" in message for r in range(3))


def _without(schedule: Schedule, rank: int, text: str) -> Schedule:
    programs = [list(p) for p in schedule.programs]
    programs[rank] = [tuple(a for a in tick if str(a) != text) for tick in programs[rank]]
    return dataclasses.replace(schedule, programs=tuple(tuple(p) for p in programs))


def test_replica_actions_out_of_place_are_caught():
    lazy, eager = build_schedule(2, 3, "lazy"), build_schedule(2, 3, "eager")
    with pytest.raises(ScheduleError, match=re.escape("rank 0 holds the replica of stage 1 but never applies its "
                                                      "update; add 1U")):
        validate(_without(lazy, 0, "1U"))
    with pytest.raises(ScheduleError, match=re.escape("rank 0, step 3, action 1RF0: RF(1, 0) before the replica's "
                                                      "update of the last step; put 1U before the first RF")):
        validate(_edit(eager, 0, 3, ["1RF0", "1U", "1RF1", "0G0<1", "0A1>1", "0B0"]))
    with pytest.raises(ScheduleError, match=re.escape("rank 0, step 7, action 0S>1: shipping stage 0's gradients "
                                                      "before OPT finished them; put S> after OPT")):
        validate(_edit(lazy, 0, 7, ["0G2<1", "0B2", "TIE", "RED", "0S>1", "OPT", "1S<1"]))
    with pytest.raises(ScheduleError, match=re.escape("rank 1, step 7, action 0S<0: receiving stage 0's gradients "
                                                      "before this rank's OPT; put S< after OPT")):
        validate(_edit(lazy, 1, 7, ["1G2>0", "TIE", "RED", "0S<0", "OPT", "0U", "1S>0"]))
    with pytest.raises(ScheduleError, match=re.escape("rank 1, step 7, action 1S>0: only U, then S>, then S< may "
                                                      "follow OPT")):
        validate(_edit(lazy, 1, 7, ["1G2>0", "TIE", "RED", "OPT", "0U", "0S<0", "1S>0"]))
    with pytest.raises(ScheduleError, match=re.escape("rank 1, step 7, action 0S<0: 0S<0 waits for rank 0's 0S>1, "
                                                      "which it never ships")):
        validate(_without(lazy, 0, "0S>1"))
    with pytest.raises(ScheduleError, match=re.escape("rank 0 ships stage 0's gradients to rank 1, which never "
                                                      "receives them; add 0S<0 to rank 1")):
        validate(_without(lazy, 1, "0S<0"))
    with pytest.raises(ScheduleError, match=re.escape("rank 0 holds the replica of stage 1, not 0")):
        validate(_edit(lazy, 0, 3, ["0U", "0G0<1", "0A1>1", "0B0"]))


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_the_replica_update_runs_in_the_longest_wait(mode):
    # Where U runs is data of the schedule: before the first gradient's receive on the earlier half of the
    # stages, at the end (lazy) or before the first activation's receive (eager) on the later half, and
    # always before the first RF.
    for p in range(2, 9):
        for m in (1, 2, 5, 8):
            schedule = build_schedule(p, m, mode)
            for rank in range(p):
                actions = [a for _, a in schedule.actions(rank)]
                kinds = [a.kind for a in actions]
                at = kinds.index(Kind.REPLICA_UPDATE)
                assert kinds.count(Kind.REPLICA_UPDATE) == 1 and actions[at].stage == (rank + 1) % p
                rfs = [i for i, k in enumerate(kinds) if k is Kind.REDUNDANT_FORWARD]
                if 2 * rank > p - 1 and mode == "lazy":
                    wanted = kinds.index(Kind.OPTIMIZER) + 1
                else:
                    receive = kinds.index(Kind.RECV_ACT if 2 * rank > p - 1 else Kind.RECV_GRAD)
                    wanted = min([receive, *rfs]) - 1  # just before it
                assert at == wanted and all(at < i for i in rfs), (p, m, rank)


# ---------------------------------------------------------------------------------------------------------
# String form, placement, bad input
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, action", [
    ("1F3", Action(Kind.FORWARD, 1, 3)),
    ("0L12", Action(Kind.LOAD, 0, 12)),
    ("2RF3", Action(Kind.REDUNDANT_FORWARD, 2, 3)),
    ("2RB0", Action(Kind.REDUNDANT_BACKWARD, 2, 0)),
    ("0A3>1", Action(Kind.SEND_ACT, 0, 3, peer=1)),
    ("1A3<0", Action(Kind.RECV_ACT, 1, 3, peer=0)),
    ("1G3>0", Action(Kind.SEND_GRAD, 1, 3, peer=0)),
    ("0G3<1", Action(Kind.RECV_GRAD, 0, 3, peer=1)),
    ("1S>0", Action(Kind.SEND_SYNC, 1, peer=0)),
    ("1S<1", Action(Kind.RECV_SYNC, 1, peer=1)),
    ("TIE", Action(Kind.REDUCE_TIED)),
    ("RED", Action(Kind.REDUCE)),
    ("OPT", Action(Kind.OPTIMIZER)),
    ("2U", Action(Kind.REPLICA_UPDATE, 2)),
])
def test_string_form_round_trips(text, action):
    assert Action.parse(text) == action
    assert str(action) == text


@pytest.mark.parametrize("text", ["1X3", "0A3", "1F3>0", "F3", "1S3>0", "OPT1", "U", "1U2", ""])
def test_bad_strings_are_rejected(text):
    with pytest.raises(ScheduleError):
        Action.parse(text)


def test_module_imports_only_the_standard_library_and_the_pure_rooms():
    import lightning_bamboo.schedule as package

    files = sorted(Path(package.__file__).parent.glob("*.py"))
    assert len(files) > 1
    for file in files:
        tree = ast.parse(file.read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
        assert imported - set(sys.stdlib_module_names) <= {"__future__", "lightning_bamboo"}, file.name
        assert not any(node.module and node.module not in ("lightning_bamboo.errors", "lightning_bamboo.topology.layout")
                       and node.module.startswith("lightning_bamboo") and not node.module.startswith("lightning_bamboo.schedule.")
                       for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)), file.name


def test_ring_placement():
    assert [replica_stage(r, 4) for r in range(4)] == [1, 2, 3, 0]
    assert [replica_holder(s, 4) for s in range(4)] == [3, 0, 1, 2]
    assert build_schedule(4, 2, "lazy").replicas == (1, 2, 3, 0)
    assert build_schedule(4, 2, "off").replicas == (None, None, None, None)


def test_bad_input_states_rule_and_fix():
    with pytest.raises(ScheduleError, match=r"needs >= 2 stages.*use redundancy='off'"):
        build_schedule(1, 4, "lazy")
    with pytest.raises(ScheduleError, match=r"redundancy must be one of \('off', 'lazy', 'eager'\), got 'eagre'"):
        build_schedule(2, 4, "eagre")
    with pytest.raises(ScheduleError, match="micro_batches must be an int >= 1, got 0"):
        build_schedule(2, 0)
    with pytest.raises(ScheduleError, match="rf_budget only applies"):
        build_schedule(2, 4, "lazy", rf_budget=2)
    with pytest.raises(ScheduleError, match="needs the replica"):
        build_failover(2, 4, 1, redundancy="off")
    with pytest.raises(ScheduleError, match="lazy keeps no RF outputs"):
        build_failover(2, 4, 1, reuse_rf=[0])
    with pytest.raises(ScheduleError, match=r"dead must be a rank in \[0, 2\), got 2"):
        build_failover(2, 4, 2)
    with pytest.raises(ScheduleError, match="FORWARD needs a non-negative int micro_batch"):
        Action(Kind.FORWARD, 1)
    with pytest.raises(ScheduleError, match="Costs.forward must be > 0"):
        Costs(forward=0)
    assert issubclass(ScheduleError, ValueError)
