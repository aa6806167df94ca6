"""Hand-computed timelines: one preemption, two adjacent preemptions and a join, for each policy.

Every scenario uses a toy job so the arithmetic fits in a comment: 2 stages of 1 layer,
2 micro-batches of 1 sample per step (2 samples/step), 1 s per step with 1 pipeline.
1F1B: a step takes (m + stages - 1) slots, so one pipeline (m=2) takes 3 slots = 1 s -> 2 samples/s,
and two pipelines (m=1 each) take 2 slots = 2/3 s -> 3 samples/s.
"""

from __future__ import annotations

import pytest

from lightning_bamboo.sim.params import SimParams
from lightning_bamboo.sim.simulate import POLICIES, run_policy, simulate
from lightning_bamboo.sim.trace import parse_trace

R1, R2 = 2.0, 3.0  # samples/s with one and with two pipelines (see module docstring)
END = 200.0

TOY = SimParams(
    stages=2,
    min_stages=1,
    layers=2,
    micro_batch_size=1,
    global_micro_batches=2,
    step_seconds=1.0,
    step_pipelines=1,
    redundancy_overhead=0.0,
    failover_slowdown=2.0,
    failover_seconds=2.0,
    reconfigure_seconds=3.0,
    restart_seconds=10.0,
    checkpoint_save_seconds=5.0,
    checkpoint_interval_seconds=40.0,
    bamboo_checkpoint_interval_seconds=50.0,
    node_ready_seconds=0.0,
    rejoin_seconds=0.0,
    max_overloaded_fraction=0.05,
    spot_price=0.9,
    on_demand_price=3.6,
    on_demand_nodes=0,
    nodes=0,
    hours=END / 3600.0,
)

FOUR = ["0,add,n1", "0,add,n2", "0,add,n3", "0,add,n4"]


def run(name: str, lines: list[str], **changes):
    params = TOY.replace(**changes)
    trace = parse_trace(lines, "toy.csv")
    result, policy = run_policy(name, trace, params, END)
    return result, policy


def steps(result) -> list[tuple[float, float]]:
    """(seconds, samples/s) each time the training rate changes before the end of the run."""
    out: list[tuple[float, float]] = []
    for p in result.timeline:
        if p.seconds >= END - 1e-9:
            break
        if not out or p.rate != out[-1][1]:
            out.append((round(p.seconds, 6), p.rate))
    return out


# ---- one preemption: n2 leaves at 100 s. Column-major layout of 4 nodes: [[n1, n3], [n2, n4]],
# so n2's replica holder is n4.


def test_one_preemption_bamboo_drops_the_broken_pipeline_as_the_runtime_does():
    result, policy = run("bamboo", FOUR + ["100000,remove,n2"])
    # topology/failover.py's plan_loss: a whole pipeline is left, so the broken one is dropped (no
    # data moves, 2 s pause) and [n1, n3] trains on with both micro-batches; n4 waits as standby
    assert steps(result) == [(0, R2), (100, 0), (102, R1)]
    assert result.samples == pytest.approx(100 * R2 + 98 * R1)
    assert result.steps_completed == pytest.approx(result.samples / 2)  # 2 samples per step
    assert result.recoveries == {"redundant": 1, "checkpoint": 0, "restart": 0}
    assert result.reconfigurations == 0
    assert result.recovery_hours == pytest.approx(2 / 3600)
    assert policy.layout.grid == (("n1", "n3"),)


THREE = ["0,add,n1", "0,add,n2", "0,add,n3"]
ONE_PIPELINE = {"stages": 3, "layers": 3, "min_stages": 1}  # 1 x 3: (2 + 2) slots of 1 layer = 1 s, 2 samples


def test_one_preemption_in_the_only_pipeline_fails_over_to_the_replica_holder():
    result, policy = run("bamboo", THREE + ["100000,remove,n2"], max_overloaded_fraction=1.0, **ONE_PIPELINE)
    # n1 holds n2's replica and runs both stages from 102 s on: every step takes failover_slowdown
    # (2x) longer; 2 * 1 / 2 overloaded is not above 1.0, so no rebuild
    assert steps(result) == [(0, 2.0), (100, 0), (102, 1.0)]
    assert result.samples == pytest.approx(100 * 2.0 + 98 * 1.0)
    assert result.reconfigurations == 0 and policy.overloaded == {"n1"}


def test_one_preemption_checkpoint_rolls_back_to_the_last_save():
    result, _ = run("checkpoint", FOUR + ["100000,remove,n2"])
    # saves (5 s) after every 40 s of training: 40-45 (120 samples), 85-90 (240); at 100 s
    # (270 samples) roll back to 240, restart 100-110 with 1 pipeline; saves 150-155, 195-200
    assert steps(result) == [
        (0, R2),
        (40, 0),
        (45, R2),
        (85, 0),
        (90, R2),
        (100, 0),
        (110, R1),
        (150, 0),
        (155, R1),
        (195, 0),
    ]
    assert result.samples == pytest.approx(240 + 80 * R1)
    assert result.recoveries["checkpoint"] == 1
    assert result.breakdown_hours["lost_work"] == pytest.approx(10 / 3600)
    assert result.recovery_hours == pytest.approx(20 / 3600)  # 10 s restart + 10 s of lost work
    assert result.breakdown_hours["checkpoint"] == pytest.approx(20 / 3600)


def test_one_preemption_on_demand_and_costs():
    report = simulate(parse_trace(FOUR + ["100000,remove,n2"], "toy.csv"), TOY)
    od, ck, bb = (report.policies[k] for k in ("on_demand", "checkpoint", "bamboo"))
    assert od.samples == pytest.approx(END * R2)  # the trace's peak: 4 nodes, never preempted
    assert od.cost_dollars == pytest.approx(4 * 3.6 * END / 3600)
    # spot: n2 for 100 s, three nodes for 200 s, at 0.9 $/node-hour, the same for both spot policies
    assert ck.cost_dollars == pytest.approx(0.9 * (100 + 3 * 200) / 3600)
    assert bb.cost_dollars == pytest.approx(ck.cost_dollars)
    assert bb.samples_per_dollar == pytest.approx(bb.samples / bb.cost_dollars)
    assert bb.samples_per_second == pytest.approx(bb.samples / END)
    assert report.comparison()["bamboo_vs_checkpoint_throughput"] == pytest.approx(bb.samples / ck.samples)


# ---- two adjacent preemptions: n2 at 110 s, then its replica holder n4 at 120 s


def test_two_adjacent_preemptions_bamboo_falls_back_to_the_checkpoint():
    result, policy = run(
        "bamboo", THREE + ["110000,remove,n2", "120000,remove,n1"], max_overloaded_fraction=1.0, **ONE_PIPELINE
    )
    # async checkpoints after 50 and 100 s of training (200 samples). 110 s: n1 takes over n2
    # (220 samples, 2 s failover, half speed); 120 s: n1 lost too (228 samples) -> fatal: back to
    # 200, restart 120-130 on n3 alone: 1 stage of 3 layers, (2 + 0) x 3 layer-slots = 1.5 s per
    # 2-sample step; 130-200 s at 4/3 samples/s
    assert steps(result) == [(0, 2.0), (110, 0), (112, 1.0), (120, 0), (130, pytest.approx(4 / 3))]
    assert result.samples == pytest.approx(200 + 70 * 4 / 3)
    assert result.recoveries == {"redundant": 1, "checkpoint": 1, "restart": 0}
    assert result.breakdown_hours["lost_work"] == pytest.approx(18 / 3600)  # 10 s + 8 s trained
    assert result.recovery_hours == pytest.approx((2 + 10 + 18) / 3600)
    assert [a for _, a, _ in policy.decisions] == ["start", "recover"]


def test_bamboos_asynchronous_checkpoint_pauses_for_its_snapshot_and_counts_once_it_is_taken():
    result, _ = run(
        "bamboo", THREE + ["110000,remove,n2", "120000,remove,n1"], max_overloaded_fraction=1.0,
        snapshot_seconds=1.0, **ONE_PIPELINE
    )
    # snapshots (1 s pauses) after 50 s of training each: 50-51 (100 samples), 101-102 (200); 110 s: n1 takes
    # over (216 samples, 2 s failover, half speed); 120 s: fatal: back to the snapshot of 200 samples, restart
    # 120-130 on n3 alone, at 4/3 samples/s from 130 s but for the next snapshot, 180-181 s
    assert steps(result) == [(0, 2.0), (50, 0), (51, 2.0), (101, 0), (102, 2.0), (110, 0), (112, 1.0), (120, 0),
                             (130, pytest.approx(4 / 3)), (180, 0), (181, pytest.approx(4 / 3))]
    assert result.breakdown_hours["checkpoint"] == pytest.approx(3 / 3600)
    assert result.samples == pytest.approx(200 + 69 * 4 / 3)
    assert result.breakdown_hours["lost_work"] == pytest.approx(16 / 3600)  # 8 s + 8 s trained after the snapshot


def test_two_adjacent_preemptions_at_the_same_instant_are_fatal_in_the_only_pipeline():
    result, _ = run("bamboo", THREE + ["100000,remove,n2", "100000,remove,n1"], **ONE_PIPELINE)
    # the checkpoint after 100 s of training is taken first (200 samples): nothing lost; the
    # restart replaces the failover pause; n3 alone from 110 s
    assert steps(result) == [(0, 2.0), (100, 0), (110, pytest.approx(4 / 3))]
    assert result.samples == pytest.approx(200 + 90 * 4 / 3)
    assert result.recoveries == {"redundant": 1, "checkpoint": 1, "restart": 0}


def test_two_adjacent_preemptions_with_a_whole_pipeline_left_are_not_fatal():
    # n2 and its replica holder n4 form one pipeline: the runtime drops it and [n1, n3] trains on
    result, policy = run("bamboo", FOUR + ["100000,remove,n2", "100000,remove,n4"])
    assert steps(result) == [(0, R2), (100, 0), (102, R1)]
    assert result.recoveries == {"redundant": 1, "checkpoint": 0, "restart": 0}
    assert policy.layout.grid == (("n1", "n3"),)


def test_two_preemptions_in_different_pipelines_are_not_fatal():
    # n2 and n3 are in different pipelines: two failovers (2 s each), no checkpoint. Then both
    # pipelines are degraded (2*2/2 overloaded > 100%): the survivors n1 (stage 0) and n4
    # (stage 1) form one pipeline without moving any layer (3 s)
    result, policy = run(
        "bamboo", FOUR + ["100000,remove,n2", "100000,remove,n3"], max_overloaded_fraction=1.0
    )
    assert result.recoveries == {"redundant": 2, "checkpoint": 0, "restart": 0}
    assert steps(result) == [(0, R2), (100, 0), (107, R1)]
    assert policy.layout.grid == (("n1", "n4"),)


def test_a_released_survivor_is_usable_only_after_its_standby_restart():
    # As above, but n4 (released when its pipeline is dropped) restarts as a standby process, which
    # takes rejoin_seconds=20 s. Until then n1 alone holds both stages: the policy makes it a
    # pipeline of one node (3 s reconfiguration at 104 s: 1 pipeline of depth 1, 2 micro-batches of
    # 2 layers = 4 slots of the reference's 3 per 1 s, so 1.5 samples/s). At 120 s n4 is ready and
    # takes stage 1 back (3 s): [n1, n4] from 123 s.
    result, policy = run(
        "bamboo",
        FOUR + ["100000,remove,n2", "100000,remove,n3"],
        max_overloaded_fraction=1.0,
        rejoin_seconds=20.0,
    )
    assert steps(result) == [(0, R2), (100, 0), (107, 1.5), (120, 0), (123, R1)]
    assert result.samples == pytest.approx(100 * R2 + 13 * 1.5 + 77 * R1)
    assert result.recoveries == {"redundant": 2, "checkpoint": 0, "restart": 0}
    assert policy.layout.grid == (("n1", "n4"),)


def test_a_released_survivor_removed_while_it_restarts_never_returns():
    result, policy = run(
        "bamboo", FOUR + ["100000,remove,n2", "110000,remove,n4"], rejoin_seconds=20.0
    )
    assert steps(result) == [(0, R2), (100, 0), (102, R1)]
    assert "n4" not in policy.ready and policy.layout.grid == (("n1", "n3"),)


def test_two_adjacent_preemptions_checkpoint():
    result, _ = run("checkpoint", FOUR + ["110000,remove,n2", "120000,remove,n4"])
    # saves 40-45 (120), 85-90 (240); 110 s: back to 240, restart 110-120 on [n1, n3] (n4 waits);
    # n4 leaving at 120 s touches nothing; 120-160 train, 160-165 save, 165-200 train
    assert steps(result) == [
        (0, R2),
        (40, 0),
        (45, R2),
        (85, 0),
        (90, R2),
        (110, 0),
        (120, R1),
        (160, 0),
        (165, R1),
    ]
    assert result.samples == pytest.approx(240 + 75 * R1)
    assert result.recoveries["checkpoint"] == 1
    assert result.preemptions == 1


# ---- a join: n3 and n4 arrive at 100 s


JOIN = ["0,add,n1", "0,add,n2", "100000,add,n3", "100000,add,n4"]


def test_join_bamboo_adds_a_pipeline():
    result, policy = run("bamboo", JOIN)
    assert steps(result) == [(0, R1), (100, 0), (103, R2)]
    assert result.samples == pytest.approx(100 * R1 + 97 * R2)
    assert [a for _, a, _ in policy.decisions] == ["start", "add_pipeline"]
    assert policy.layout.pipelines == 2
    assert result.cost_dollars == pytest.approx(0.9 * (2 * 200 + 2 * 100) / 3600)


def test_join_waits_for_nodes_to_be_ready():
    result, _ = run("bamboo", JOIN, node_ready_seconds=45.0)
    # every node needs 45 s: nothing runs before 45 s; the newcomers are usable at 145 s
    assert steps(result) == [(0, 0), (45, R1), (145, 0), (148, R2)]
    assert result.samples == pytest.approx(100 * R1 + 52 * R2)


def test_join_on_demand_runs_the_peak_cluster_throughout():
    report = simulate(parse_trace(JOIN, "toy.csv"), TOY)
    od = report.policies["on_demand"]
    assert od.samples == pytest.approx(END * R2) and od.node_hours == pytest.approx(4 * END / 3600)
    assert od.recovery_hours == 0 and od.preemptions == 0


def test_join_checkpoint_saves_then_restarts_wider_and_loses_nothing():
    result, _ = run("checkpoint", JOIN)
    # saves 40-45 (80), 85-90 (160); join at 100 s (180 samples): a voluntary restart, so save first
    # (100-105, commits 180), restart 105-115 with 2 pipelines; next save after 40 s of training:
    # 155-160; 160-200 trains
    assert steps(result) == [
        (0, R1),
        (40, 0),
        (45, R1),
        (85, 0),
        (90, R1),
        (100, 0),
        (115, R2),
        (155, 0),
        (160, R2),
    ]
    assert result.samples == pytest.approx(180 + 40 * R2 + 40 * R2)
    assert result.breakdown_hours["lost_work"] == 0.0
    assert result.recoveries["checkpoint"] == 0 and result.reconfigurations == 1


def test_checkpoint_interval_chosen_at_run_time_from_the_preemptions_seen():
    # two pipelines; n2 lost at 100 s. save 5 s; no fixed interval:
    # interval = sqrt(2 * 5 * max(now, 5) / (failures + 1)), asked again when each save ends
    lines = FOUR + ["100000,remove,n2"]
    result, _ = run("checkpoint", lines, checkpoint_interval_seconds=0.0, max_overloaded_fraction=1.0)
    saves, t = [], 0.0
    while True:  # the saves before the loss at 100 s (no failure seen yet), by hand with the rule
        start = t + (2 * 5 * max(t, 5) / 1) ** 0.5
        if start >= 100:
            break
        saves.append(round(start, 6))
        t = start + 5
    got = [s for s, r in steps(result) if r == 0]
    assert got[: len(saves)] == [pytest.approx(s) for s in saves]
    # the loss at 100 s restarts (10 s); the first interval after it counts one failure
    assert got[len(saves)] == 100
    after = [s for s in got if s > 100]
    assert after[0] == pytest.approx(110 + (2 * 5 * 110 / 2) ** 0.5)


def test_checkpoint_oracle_uses_the_whole_traces_mtbf():
    # one removal in 200 s: Young's interval sqrt(2 * 5 * 200) = 44.72 s, known from the start
    result, _ = run("checkpoint_oracle", FOUR + ["100000,remove,n2"], checkpoint_interval_seconds=0.0)
    assert steps(result)[:2] == [(0, R2), (pytest.approx((2 * 5 * 200) ** 0.5), 0)]


def test_notice_lets_both_spot_policies_lose_nothing():
    from lightning_bamboo.sim.trace import Trace, TraceEvent

    events = [TraceEvent(0, "add", f"n{i}") for i in range(1, 5)] + [
        TraceEvent(100_000, "remove", "n2", 30.0)
    ]
    trace = Trace(tuple(events), "notice")
    params = TOY.replace(max_overloaded_fraction=1.0)
    bamboo, _ = run_policy("bamboo", trace, params, END)
    assert steps(bamboo) == [(0, R2), (100, R1)]  # the broken pipeline is dropped with no pause
    ckpt, _ = run_policy("checkpoint", trace, params, END)
    assert ckpt.breakdown_hours["lost_work"] == 0.0  # saved in the grace period


def test_too_few_nodes_suspends_bamboo_and_restarts_when_nodes_return():
    lines = ["0,add,n1", "0,add,n2", "100000,remove,n1", "150000,add,n3"]
    result, policy = run("bamboo", lines, min_stages=2)
    # one node cannot hold the model (min_stages=2): back to the checkpoint of 100 s (200 samples),
    # wait; n3 arrives at 150 s: restart (10 s), one pipeline from 160 s
    assert steps(result) == [(0, R1), (100, 0), (160, R1)]
    assert result.samples == pytest.approx(200 + 40 * R1)
    # n2 first takes over n1's stage (it holds the replica), but alone it is below min_stages
    assert [a for _, a, _ in policy.decisions] == ["start", "suspend", "start"]
    assert result.recoveries == {"redundant": 1, "checkpoint": 1, "restart": 0}
    assert result.breakdown_hours["idle"] == pytest.approx(50 / 3600)


def test_bamboo_shrinks_depth_when_too_few_nodes_remain():
    lines = ["0,add,n1", "0,add,n2", "0,add,n3", "100000,remove,n2"]
    result, policy = run("bamboo", lines, stages=3, layers=3, min_stages=2, step_pipelines=1)
    # 3 stages -> 2 stages of 1-2 layers; 1 pipeline throughout
    assert [a for _, a, _ in policy.decisions] == ["start", "restore_redundancy"]
    assert policy.layout.stages == 2 and policy.layout.parts == (0, 1, 3)
    # reference: m=2, 3 stages of 1 layer: 4 slots of 1 layer = 1 s. Two stages, widest 2 layers:
    # (2 + 1) slots of 2 layers = 6 layer-slots = 1.5 s per step -> 4/3 samples/s
    assert steps(result)[-1] == (105, pytest.approx(2 / 1.5))


def test_join_without_a_fixed_global_batch_doubles_the_batch():
    # pipeline_micro_batches=2: each pipeline keeps 2 micro-batches (1 s per step, 2 samples);
    # two pipelines make 4-sample steps in the same 1 s
    result, _ = run("bamboo", JOIN, pipeline_micro_batches=2)
    assert steps(result) == [(0, 2.0), (100, 0), (103, 4.0)]
    assert result.steps_completed == pytest.approx(100 + 97)
    assert result.samples == pytest.approx(2 * 100 + 4 * 97)


@pytest.mark.parametrize("seed", range(8))
def test_time_adds_up_on_random_traces(seed):
    import random

    from lightning_bamboo.sim.generate import SpotModel, generate_trace

    r = random.Random(seed)
    model = SpotModel(
        nodes=r.randint(2, 24),
        hours=2.0,
        preemption_rate=r.choice([0.2, 1.0]),
        burst=r.randint(1, 4),
        burst_probability=r.random(),
        notice_fraction=r.random(),
        seed=seed,
    )
    stages = r.choice([1, 2, 4])
    params = SimParams(
        stages=stages, min_stages=1, layers=4, global_micro_batches=8, step_pipelines=1, hours=2.0
    )
    report = simulate(generate_trace(model), params, sorted(POLICIES))
    assert set(report.policies) == set(POLICIES)
    for result in report.policies.values():
        b = result.breakdown_hours
        spent = b["training"] + b["idle"] + b["failover"] + b["reconfigure"] + b["restart"] + b["checkpoint"]
        assert spent == pytest.approx(2.0)
        assert 0 <= b["lost_work"] <= b["training"] + 1e-12
        # the samples come from the training time that no rollback took back, at the rates the timeline shows
        kept = (b["training"] - b["lost_work"]) * 3600.0
        rates = [p.rate for p in result.timeline if p.rate > 0]
        slack = 1e-9 * max(1.0, result.samples)
        assert min(rates, default=0.0) * kept - slack <= result.samples <= max(rates, default=0.0) * kept + slack
        # a fixed global batch: every step is 8 micro-batches of micro_batch_size samples
        assert result.samples == pytest.approx(result.steps_completed * params.samples_per_step)


def test_a_measured_single_pipeline_step_time_replaces_the_formula_for_one_pipeline():
    # One preemption as in the first test: [n1, n3] trains on alone from 102 s. Measured at 0.5 s
    # per step (2 samples: 4 samples/s) instead of the formula's 1 s; two pipelines keep 3 samples/s.
    result, _ = run("bamboo", FOUR + ["100000,remove,n2"], single_pipeline_step_seconds=0.5)
    assert steps(result) == [(0, R2), (100, 0), (102, 4.0)]
    assert result.samples == pytest.approx(100 * R2 + 98 * 4.0)


# ---- torchrun elastic (benchmarks/peer_train.py): one pipeline as deep as the nodes it has


def test_elastic_restarts_shallower_at_a_loss_and_deeper_at_a_join_losing_what_was_not_saved():
    # depth 2: 1 s steps (2 samples/s); depth 1: (2 + 0) slots of 2 layers = 4/3 of the 3 slots of 1 -> 1.5/s.
    # saves 40-45 (80 samples), 85-90 (160); n2 lost at 100 s: back to 160, restart 100-110 at depth 1;
    # n3 ready at 130 s: torchrun restarts the workers for it, nothing saved first: back to 160 again,
    # restart 130-140 at depth 2; a save after 40 s of training: 180-185; 185-200 trains
    result, policy = run("elastic", ["0,add,n1", "0,add,n2", "100000,remove,n2", "130000,add,n3"])
    assert steps(result) == [(0, 2.0), (40, 0), (45, 2.0), (85, 0), (90, 2.0), (100, 0), (110, 1.5), (130, 0),
                             (140, 2.0), (180, 0), (185, 2.0)]
    assert result.samples == pytest.approx(160 + 40 * 2.0 + 15 * 2.0)
    assert result.breakdown_hours["lost_work"] == pytest.approx((10 + 20) / 3600)
    assert result.recoveries["checkpoint"] == 1 and result.reconfigurations == 1
    assert policy.layout.grid == (("n1", "n3"),)


def test_elastic_nodes_beyond_the_depth_wait_and_replace_a_lost_one():
    # stages 2: n3 waits; its loss changes nothing; n2's loss restarts at depth 2 with n3 (back to the save
    # at 85-90: 160 samples); no join restarts a pipeline already at full depth
    lines = THREE + ["50000,remove,n3", "60000,add,n4", "100000,remove,n2"]
    result, policy = run("elastic", lines)
    assert steps(result) == [(0, 2.0), (40, 0), (45, 2.0), (85, 0), (90, 2.0), (100, 0), (110, 2.0), (150, 0),
                             (155, 2.0), (195, 0)]
    assert result.recoveries["checkpoint"] == 1 and result.reconfigurations == 0
    assert policy.layout.grid == (("n1", "n4"),)


def test_elastic_a_node_ready_while_a_restart_is_under_way_joins_it():
    # n2 lost at 100 s: back to 160 samples, restart 100-110; n3 ready at 105 s joins that restart (no second
    # rollback, no second pause): depth 2 from 110 s on
    result, policy = run("elastic", ["0,add,n1", "0,add,n2", "100000,remove,n2", "105000,add,n3"])
    assert steps(result)[:7] == [(0, 2.0), (40, 0), (45, 2.0), (85, 0), (90, 2.0), (100, 0), (110, 2.0)]
    assert result.recoveries["checkpoint"] == 1 and result.reconfigurations == 0
    assert result.breakdown_hours["restart"] == pytest.approx(10 / 3600)
    assert policy.layout.grid == (("n1", "n3"),)


def test_a_fixed_part_of_the_step_does_not_scale_with_the_layout():
    # depth 1 of the elastic test: 4/3 of the 1 s step; with 0.4 s of it fixed, 0.4 + 0.6 x 4/3 = 1.2 s: 2/1.2 samples/s
    result, _ = run("elastic", ["0,add,n1", "0,add,n2", "100000,remove,n2"], step_fixed_seconds=0.4)
    assert steps(result)[6] == (110, pytest.approx(2 / 1.2))


def test_elastic_with_whole_pipelines_restarts_narrower_and_wider_losing_what_was_not_saved():
    # 2 x 2 (3 samples/s), saves every 40 s: 40-45 (120), 85-90 (240); n2 lost at 100 s: back to 240, restart
    # 100-110 as 1 x 2 (2 samples/s; n4 waits); n5 ready at 130 s makes 2 x 2 again: back to 240 (nothing saved
    # first, unlike `checkpoint`), restart 130-140; a save 180-185
    result, policy = run("elastic", FOUR + ["100000,remove,n2", "130000,add,n5"])
    assert steps(result) == [(0, R2), (40, 0), (45, R2), (85, 0), (90, R2), (100, 0), (110, R1), (130, 0), (140, R2),
                             (180, 0), (185, R2)]
    assert result.samples == pytest.approx(240 + 40 * R2 + 15 * R2)
    assert result.recoveries["checkpoint"] == 1 and result.reconfigurations == 1
    assert policy.layout.pipelines == 2


def test_a_removal_without_notice_cannot_save_however_cheap_a_save_is():
    from lightning_bamboo.sim.trace import Trace, TraceEvent

    # free saves after every 40 s of training (at 40 and 80 s); n2 lost at 100 s without notice: the 20 s since
    # the save at 80 s are lost, not committed at the removal; with a notice they are saved in it
    start = [TraceEvent(0, "add", f"n{i}") for i in range(1, 5)]
    for notice, lost in ((0.0, 20.0), (30.0, 0.0)):
        trace = Trace((*start, TraceEvent(100_000, "remove", "n2", notice)), "notice")
        result, _ = run_policy("checkpoint", trace, TOY.replace(checkpoint_save_seconds=0.0), END)
        assert result.breakdown_hours["lost_work"] == pytest.approx(lost / 3600)
