"""Planner (pure): cost model by hand, solver against brute force, search, Plan JSON, bad input."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import replace

import pytest

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.planner import (
    Hardware,
    LayerCost,
    LayerProfile,
    LayerTooLargeError,
    ModelProfile,
    NoFeasiblePlanError,
    NoSplit,
    Plan,
    Split,
    estimate_step,
    plan,
    plan_table,
    redundancy_cost,
    solve_split,
)

MiB = 2**20


def layer(fwd: float, bwd: float, *, out: int = 0, act: int = 0, params: int = 0, update: float = 0.0,
          sizes: tuple[int, ...] = (1,), name: str = "l") -> LayerProfile:
    """A layer whose time and activations grow linearly with the micro-batch size."""
    costs = tuple((s, LayerCost(fwd * s, bwd * s, out * s, act * s)) for s in sizes)
    return LayerProfile(name, params, params, 2 * params, update, costs)


def model(*layers: LayerProfile) -> ModelProfile:
    return ModelProfile(tuple(layers))


FAST = Hardware(memory_bytes=10**12, bandwidth_bytes_per_second=1e30, latency_seconds=0.0)


def random_profile(rng: random.Random, num_layers: int, sizes: tuple[int, ...] = (1, 2)) -> ModelProfile:
    layers = []
    for i in range(num_layers):
        costs = tuple(
            (s, LayerCost(rng.uniform(0.1, 2) * s, rng.uniform(0.1, 4) * s, rng.randint(1, 5) * 1000 * s,
                          rng.randint(0, 8) * 1000 * s))
            for s in sizes
        )
        params = rng.randint(0, 20) * 1000
        layers.append(LayerProfile(f"l{i}", params, params, 2 * params, rng.uniform(0, 0.5), costs))
    return ModelProfile(tuple(layers))


def random_hardware(rng: random.Random) -> Hardware:
    return Hardware(
        memory_bytes=rng.randint(40, 200) * 1000,
        bandwidth_bytes_per_second=rng.choice([1e3, 1e4, 1e5]),
        latency_seconds=rng.uniform(0, 0.2),
        micro_batch_overhead_seconds=rng.choice([0.0, rng.uniform(0, 0.5)]),
        step_overhead_seconds=rng.choice([0.0, rng.uniform(0, 1)]),
        compute_scale=rng.choice([1.0, rng.uniform(0.5, 3)]),
    )


def brute_split(profile, hw, stages, mbs, micro_batches, pipelines, checkpoint_every=0):
    best = None
    for cuts in itertools.combinations(range(1, profile.num_layers), stages - 1):
        parts = (0, *cuts, profile.num_layers)
        est = estimate_step(profile, hw, parts, mbs, micro_batches, pipelines, checkpoint_every)
        if est.max_memory_bytes <= hw.memory_bytes and (best is None or est.step_seconds < best[0]):
            best = (est.step_seconds, parts)
    return best


# --- cost model, by hand ---------------------------------------------------------------------------


def test_balanced_pipeline_is_m_plus_p_minus_1_slots() -> None:
    # 4 layers of F=1, B=2 on 2 stages: a slot is 6 s; 1F1B with 4 micro-batches takes 4 + 2 - 1 slots
    prof = model(*(layer(1, 2) for _ in range(4)))
    est = estimate_step(prof, FAST, [0, 2, 4], 1, micro_batches=4)
    assert est.step_seconds == pytest.approx((4 + 2 - 1) * 6)
    assert [s.busy_seconds for s in est.stages] == pytest.approx([6, 6])


def test_engine_overheads_and_compute_scale() -> None:
    # per micro-batch and stage 0.5 s of engine work, 2 s per step, workers twice as slow as profiled
    hw = Hardware(memory_bytes=10**9, bandwidth_bytes_per_second=1e30, latency_seconds=0.0,
                  micro_batch_overhead_seconds=0.5, step_overhead_seconds=2.0, compute_scale=2.0)
    prof = model(*(layer(1, 2) for _ in range(4)))
    est = estimate_step(prof, hw, [0, 2, 4], 1, micro_batches=4)
    assert est.step_seconds == pytest.approx((4 + 2 - 1) * (2 * 6 + 0.5) + 2.0)


def test_transfers_busy_both_neighbours_and_add_to_latency() -> None:
    # 1000 bytes at 1000 B/s + 0.5 s latency = 1.5 s per message; forward + backward message per micro-batch
    hw = Hardware(memory_bytes=10**9, bandwidth_bytes_per_second=1000, latency_seconds=0.5)
    prof = model(layer(1, 2, out=1000), layer(1, 2, out=1000))
    est = estimate_step(prof, hw, [0, 1, 2], 1, micro_batches=3)
    assert [s.comm_seconds for s in est.stages] == pytest.approx([3.0, 3.0])
    assert est.step_seconds == pytest.approx((3 - 1) * (3 + 3) + (3 + 3) + 2 * 1.5)


def test_in_flight_memory_follows_1f1b_warm_up() -> None:
    # stage k holds min(m, p - k) micro-batches: 4, 3, 2, 1 on 4 stages with 8 micro-batches
    prof = model(*(layer(1, 1, act=100) for _ in range(4)))
    est = estimate_step(prof, FAST, [0, 1, 2, 3, 4], 1, micro_batches=8)
    assert [s.in_flight for s in est.stages] == [4, 3, 2, 1]
    assert [s.memory_bytes for s in est.stages] == [400, 300, 200, 100]
    few = estimate_step(prof, FAST, [0, 1, 2, 3, 4], 1, micro_batches=2)
    assert [s.in_flight for s in few.stages] == [2, 2, 2, 1]


def test_activation_checkpointing_keeps_segment_inputs_per_micro_batch_and_one_segment_again() -> None:
    # 8 layers of F=1, B=2, each saving 100 bytes and putting out 10; stage 0 of 2 holds 2 micro-batches in flight
    prof8 = model(*(layer(1, 2, act=100, out=10) for _ in range(8)))
    plain = estimate_step(prof8, FAST, [0, 4, 8], 1, micro_batches=3)
    assert plain.stages[0].memory_bytes == 2 * (400 + 10) and plain.stages[0].backward_seconds == 8
    # segments of 2: a micro-batch keeps the second segment's input (layer 1's output) and the stage's output; one
    # backward holds a segment's 200 again; every backward first runs its forward again (4 s more per stage)
    every2 = estimate_step(prof8, FAST, [0, 4, 8], 1, micro_batches=3, checkpoint_every=2)
    assert every2.stages[0].memory_bytes == 200 + 2 * (10 + 10)
    assert every2.stages[0].backward_seconds == 8 + 4
    assert every2.step_seconds == plain.step_seconds + (3 - 1) * 4 + 2 * 4  # the busiest stage, and the latency
    prof = model(*(layer(1, 2, act=100, out=10) for _ in range(4)))
    # two stages of 2 layers, every layer a segment: stage 0 keeps 2 micro-batches of (layer 0's output + its
    # own output to send), the last stage 1 of (its input + layer 2's output)
    every1 = estimate_step(prof, FAST, [0, 2, 4], 1, micro_batches=3, checkpoint_every=1)
    assert [s.memory_bytes for s in every1.stages] == [100 + 2 * (10 + 10), 100 + 1 * (10 + 10)]
    with pytest.raises(BambooConfigError, match="activation checkpointing is a number of layers per segment"):
        estimate_step(prof, FAST, [0, 4], 1, 3, checkpoint_every=-1)


def test_allreduce_tail_grows_with_pipelines() -> None:
    hw = Hardware(memory_bytes=10**9, bandwidth_bytes_per_second=1000, latency_seconds=0.0)
    prof = model(layer(1, 1, params=1000))
    one = estimate_step(prof, hw, [0, 1], 1, 1, pipelines=1)
    four = estimate_step(prof, hw, [0, 1], 1, 1, pipelines=4)
    assert one.tail_seconds == 0
    assert four.tail_seconds == pytest.approx(2 * 3 / 4 * 1000 / 1000)  # ring: 2 (d-1)/d bytes / bandwidth


# --- solver ------------------------------------------------------------------------------------------


def test_heavy_embedding_and_head_get_their_own_stages() -> None:
    #   layers  [emb 5][1][1][1][1][head 5]  ->  | emb | 1 1 1 1 | head |
    prof = model(layer(5, 0), *(layer(1, 0) for _ in range(4)), layer(5, 0))
    result = solve_split(prof, FAST, stages=3, micro_batch_size=1, micro_batches=8)
    assert isinstance(result, Split)
    assert result.partition == (0, 1, 5, 6)


def test_uniform_layers_split_evenly() -> None:
    prof = model(*(layer(1, 2) for _ in range(8)))
    result = solve_split(prof, FAST, stages=4, micro_batch_size=1, micro_batches=8)
    assert isinstance(result, Split) and result.partition == (0, 2, 4, 6, 8)


def test_memory_limit_moves_the_cut_away_from_the_fastest_split() -> None:
    # time wants [0, 2, 4]; stage 0 holds 2 micro-batches of layer 0's big activations, so it must stay alone
    prof = model(layer(1, 1, act=300), layer(1, 1, act=100), layer(1, 1, act=100), layer(1, 1, act=100))
    hw = Hardware(memory_bytes=700, bandwidth_bytes_per_second=1e30, latency_seconds=0.0)
    free = solve_split(prof, FAST, 2, 1, 4)
    tight = solve_split(prof, hw, 2, 1, 4)
    assert isinstance(free, Split) and free.partition == (0, 2, 4)
    assert isinstance(tight, Split) and tight.partition == (0, 1, 4)
    assert max(s.memory_bytes for s in tight.estimate.stages) <= 700


@pytest.mark.parametrize("seed, checkpointing", [(20260521, False), (20261128, True)],
                         ids=["plain", "activation-checkpointing"])
def test_solver_equals_brute_force_on_random_instances(seed, checkpointing) -> None:
    from lightning_bamboo.planner.solver import SegmentTables

    rng = random.Random(seed)
    feasible = 0
    for _ in range(250):
        num_layers = rng.randint(1, 9)
        prof = random_profile(rng, num_layers)
        hw = random_hardware(rng)
        stages = rng.randint(1, min(num_layers, 5))
        mbs, m, d = rng.choice((1, 2)), rng.randint(1, 8), rng.randint(1, 4)
        every = rng.randint(1, 4) if checkpointing else 0  # layers per checkpointed segment (0: none)
        result = solve_split(prof, hw, stages, mbs, m, d, tables=SegmentTables(prof, hw, mbs, every))
        expected = brute_split(prof, hw, stages, mbs, m, d, every)
        if expected is None:
            assert isinstance(result, NoSplit), (prof, hw, stages, mbs, m, d, every)
            continue
        feasible += 1
        assert isinstance(result, Split), (result, expected)
        assert result.estimate.step_seconds == pytest.approx(expected[0], rel=1e-9, abs=1e-12)
        again = estimate_step(prof, hw, result.partition, mbs, m, d, every)
        assert again.step_seconds == pytest.approx(result.estimate.step_seconds)
        assert again.max_memory_bytes <= hw.memory_bytes
    assert feasible >= 100  # the instances exercise the solver, not only the infeasible path


def test_a_model_that_fits_no_layout_fits_with_activation_checkpointing_and_pays_its_recompute() -> None:
    # 8 layers saving 1000 bytes each per sample: 2 workers of 5000 bytes cannot hold 4 micro-batches of 4 layers
    prof = model(*(layer(1, 2, act=1000, out=10) for _ in range(8)))
    hw = Hardware(memory_bytes=5000, bandwidth_bytes_per_second=1e30, latency_seconds=0.0)
    with pytest.raises(NoFeasiblePlanError, match=r"activation checkpointing \(activation_checkpointing=1\)"):
        plan(prof, hw, 2, 4)
    chosen = plan(prof, hw, 2, 4, activation_checkpointing=1)
    assert chosen.activation_checkpointing == 1 and max(chosen.stage_memory_bytes) <= 5000
    roomy = plan(prof, replace(hw, memory_bytes=10**9), 2, 4)
    assert chosen.predicted_step_seconds > roomy.predicted_step_seconds  # the forwards run again
    assert Plan.from_json(chosen.to_json()) == chosen


def test_search_equals_brute_force_over_layouts() -> None:
    rng = random.Random(7)
    for _ in range(30):
        prof = random_profile(rng, rng.randint(2, 6))
        hw = Hardware(memory_bytes=rng.randint(80, 300) * 1000, bandwidth_bytes_per_second=1e4, latency_seconds=0.01)
        world, batch = rng.randint(1, 6), rng.choice((4, 8, 12))
        best = None
        for stages in range(1, min(world, prof.num_layers) + 1):
            if world % stages or batch % (world // stages):
                continue
            d = world // stages
            for mbs in prof.micro_batch_sizes:
                if (batch // d) % mbs:
                    continue
                found = brute_split(prof, hw, stages, mbs, batch // d // mbs, d)
                if found is not None and (best is None or found[0] < best):
                    best = found[0]
        if best is None:
            with pytest.raises(NoFeasiblePlanError):
                plan(prof, hw, world, batch)
        else:
            assert plan(prof, hw, world, batch).predicted_step_seconds == pytest.approx(best, rel=1e-9)


# --- search ------------------------------------------------------------------------------------------


def test_cheap_gradients_make_pure_data_parallelism_win() -> None:
    prof = model(*(layer(1, 2, sizes=(1, 2, 4)) for _ in range(4)))
    chosen = plan(prof, FAST, world_size=4, global_batch=16)
    assert (chosen.stages, chosen.pipelines) == (1, 4)  # no bubbles, free all-reduce
    assert chosen.micro_batch_size * chosen.micro_batches * chosen.pipelines == 16
    assert all(a.samples_per_second <= chosen.samples_per_second for a in chosen.alternatives)


def test_memory_forces_a_pipeline_and_scale_batch_grows_the_batch() -> None:
    prof = model(*(layer(1, 2, params=100, sizes=(1, 2)) for _ in range(4)))  # 400 bytes static per layer
    hw = Hardware(memory_bytes=900, bandwidth_bytes_per_second=1e30, latency_seconds=0.0)
    chosen = plan(prof, hw, world_size=4, global_batch=8)
    assert chosen.stages >= 2
    assert max(chosen.stage_memory_bytes) <= 900
    assert any("above the memory limit" in r.reason for r in chosen.infeasible)
    scaled = plan(prof, hw, world_size=4, global_batch=8, scale_batch=True)
    assert scaled.global_batch == 8 * scaled.pipelines


def test_plan_json_round_trip_and_contract_keys() -> None:
    prof = model(*(layer(1, 2, out=10, act=10, params=10, sizes=(1, 2)) for _ in range(6)))
    hw = Hardware(memory_bytes=10**6, bandwidth_bytes_per_second=1e3, latency_seconds=1e-3)
    chosen = plan(prof, hw, world_size=4, global_batch=8)
    data = json.loads(chosen.to_json())
    for key in ("stages", "pipelines", "micro_batch_size", "micro_batches", "partition", "predicted_step_seconds"):
        assert key in data
    assert data["partition"][0] == 0 and data["partition"][-1] == 6 and len(data["partition"]) == data["stages"] + 1
    assert Plan.from_dict(data) == chosen
    assert Plan.from_json(chosen.to_json()) == chosen


def test_plan_table_is_a_lookup_per_world_size() -> None:
    prof = model(*(layer(1, 2, params=100, out=50, sizes=(1, 2)) for _ in range(4)))
    hw = Hardware(memory_bytes=1000, bandwidth_bytes_per_second=1e4, latency_seconds=0.0)
    table = plan_table(prof, hw, max_world_size=6, global_batch=8)
    for w in (2, 4):
        fresh = plan(prof, hw, w, 8)
        assert replace(table.lookup(w), planning_seconds=0) == replace(fresh, planning_seconds=0)
    # 1 worker cannot hold 4 x 400 bytes; 5 workers: depth 5 > 4 layers and 1 stage does not fit
    with pytest.raises(NoFeasiblePlanError, match="1 worker"):
        table.lookup(1)
    with pytest.raises(NoFeasiblePlanError, match="5 stages need at least 5 layers"):
        table.lookup(5)
    with pytest.raises(BambooConfigError, match="1..6"):
        table.lookup(7)
    assert "no layout" in table.format()
    assert type(table).from_dict(json.loads(json.dumps(table.to_dict()))) == table


# --- bad input ---------------------------------------------------------------------------------------


def test_model_that_fits_no_layout_names_the_least_memory_needed() -> None:
    prof = model(*(layer(1, 1, params=MiB, sizes=(1,)) for _ in range(4)))  # 4 MiB static per layer
    hw = Hardware(memory_bytes=6 * MiB)
    with pytest.raises(NoFeasiblePlanError, match=r"least memory any layout needs is 8\.0 MiB.*6\.0 MiB"):
        plan(prof, hw, world_size=2, global_batch=4)


def test_memory_below_one_layer_is_refused_with_numbers() -> None:
    prof = model(layer(1, 1, params=MiB), layer(1, 1, params=3 * MiB))
    hw = Hardware(memory_bytes=8 * MiB)
    with pytest.raises(LayerTooLargeError, match=r"layer 1 .* 12\.0 MiB .* limit 8\.0 MiB"):
        plan(prof, hw, world_size=4, global_batch=4)
    with pytest.raises(LayerTooLargeError):
        plan_table(prof, hw, max_world_size=4, global_batch=4)


def test_world_size_without_a_valid_layout() -> None:
    # 3 layers that need 2 workers: 5 workers can only be 1 x 5 (too deep) or 5 x 1 (too full)
    prof = model(*(layer(1, 1, params=100) for _ in range(3)))
    hw = Hardware(memory_bytes=900)
    with pytest.raises(NoFeasiblePlanError, match=r"5 worker\(s\).*5 stages need at least 5 layers"):
        plan(prof, hw, world_size=5, global_batch=5)
    assert plan(prof, hw, world_size=5, global_batch=4, allow_idle=True).stages * 1 <= 5


@pytest.mark.parametrize(
    "make",
    [
        lambda: LayerCost(-1.0, 0.0, 0, 0),
        lambda: LayerProfile("x", 0, 0, 0, 0.0, ()),
        lambda: ModelProfile(()),
        lambda: ModelProfile((layer(1, 1, sizes=(1,)), layer(1, 1, sizes=(1, 2)))),
        lambda: Hardware(memory_bytes=0),
        lambda: estimate_step(model(layer(1, 1)), FAST, [0, 0, 1], 1, 1),
        lambda: plan(model(layer(1, 1)), FAST, world_size=0, global_batch=1),
    ],
)
def test_bad_values_raise_config_errors(make) -> None:
    with pytest.raises(BambooConfigError):
        make()


# --- the replica every worker holds under redundancy lazy/eager --------------------------------------------------


def _with_replica(profile, partition, est):
    """Each stage's memory plus the static bytes of its successor's stage (the last stage holds stage 0's)."""
    segs = list(zip(partition, partition[1:], strict=False))
    static = [sum(layer.static_bytes for layer in profile.layers[a:b]) for a, b in segs]
    return [s.memory_bytes + (static[(k + 1) % len(segs)] if len(segs) > 1 else 0) for k, s in enumerate(est.stages)]


def test_with_replicas_every_split_fits_and_one_is_found_where_brute_force_finds_one() -> None:
    """Random instances whose memory limit lies between what the best split needs without replicas and what it needs
    with them: the split solve_split(replica=True) returns always fits with each worker's replica of its successor;
    it finds one exactly where brute force over every split finds one; it is the fastest in most cases and within
    25% of it in all (the search over reserves is not exhaustive)."""
    rng = random.Random(20261127)
    found = exist = optimal = 0
    for _ in range(1500):
        num_layers = rng.randint(2, 9)
        prof, hw = random_profile(rng, num_layers), random_hardware(rng)
        stages = rng.randint(2, min(num_layers, 5))
        mbs, m, d = rng.choice((1, 2)), rng.randint(1, 8), rng.randint(1, 4)
        plain = solve_split(prof, hw, stages, mbs, m, d)
        if not isinstance(plain, Split):
            continue
        low, high = plain.estimate.max_memory_bytes, max(_with_replica(prof, plain.partition, plain.estimate))
        if high <= low:
            continue
        hw = replace(hw, memory_bytes=rng.randint(low, high - 1))  # the plain best does not fit with its replicas
        best = None
        for cuts in itertools.combinations(range(1, num_layers), stages - 1):
            parts = (0, *cuts, num_layers)
            est = estimate_step(prof, hw, parts, mbs, m, d)
            if max(_with_replica(prof, parts, est)) <= hw.memory_bytes and (best is None or est.step_seconds < best):
                best = est.step_seconds
        result = solve_split(prof, hw, stages, mbs, m, d, replica=True)
        if isinstance(result, Split):
            assert max(_with_replica(prof, result.partition, result.estimate)) <= hw.memory_bytes
        if best is None:
            assert isinstance(result, NoSplit) and "successor's replica" in result.reason
            continue
        exist += 1
        assert isinstance(result, Split), (prof, hw, stages, mbs, m, d)
        found += 1
        assert result.estimate.step_seconds <= 1.25 * best + 1e-12
        optimal += result.estimate.step_seconds <= best * (1 + 1e-9)
    assert exist >= 30 and optimal >= 0.75 * exist, (exist, optimal)


def test_a_plan_with_replicas_goes_deeper_where_the_replica_would_not_fit() -> None:
    """Four equal layers, 4 workers: without replicas 2 stages x 2 pipelines is fastest; with each worker also
    holding its successor's 2 layers it does not fit, and the plan is 4 stages, whose stage plus replica fits."""
    layers = [layer(1.0, 2.0, params=10 * MiB, update=0.1, sizes=(1,)) for _ in range(4)]
    prof = model(*layers)
    hw = Hardware(memory_bytes=100 * MiB, bandwidth_bytes_per_second=1e12, latency_seconds=0.0)
    free = plan(prof, hw, world_size=4, global_batch=8)
    assert (free.stages, free.pipelines) == (2, 2)
    held = plan(prof, hw, world_size=4, global_batch=8, replica=True)
    assert held.stages == 4 and max(held.stage_memory_bytes) <= hw.memory_bytes
    assert all("successor's replica" in r.reason for r in held.infeasible if r.stages == 2 and r.pipelines == 2)


def test_auto_holds_replicas_only_in_layouts_that_need_them() -> None:
    """``redundancy="auto"`` (the strategy's default) resolved per layout: on the four workers above, 2 x 2 keeps no
    replica (each stage has a copy in the other pipeline, on another machine) and wins as without replicas; with every
    worker on one machine no copy is elsewhere, so auto is lazy and goes 4 deep as ``replica=True`` does. Two workers
    make one pipeline, where auto is lazy: its 2 stages fit, not with their replicas."""
    layers = [layer(1.0, 2.0, params=10 * MiB, update=0.1, sizes=(1,)) for _ in range(4)]
    prof = model(*layers)
    hw = Hardware(memory_bytes=100 * MiB, bandwidth_bytes_per_second=1e12, latency_seconds=0.0)
    apart = plan(prof, hw, world_size=4, global_batch=8, replica=True, redundancy="auto")
    assert (apart.stages, apart.pipelines, apart.redundancy) == (2, 2, "off")
    assert apart.stage_memory_bytes == apart.stage_memory_without_replica_bytes
    together = plan(prof, hw, world_size=4, global_batch=8, replica=True, redundancy="auto", copies_apart=False)
    lazy = plan(prof, hw, world_size=4, global_batch=8, replica=True, redundancy="lazy")
    assert (together.stages, together.redundancy, together.partition) == (4, "lazy", lazy.partition)
    assert together.predicted_step_seconds == pytest.approx(lazy.predicted_step_seconds)
    assert plan(prof, hw, world_size=2, global_batch=8).stages == 2  # 2 x 1: its stages fit, without replicas
    with pytest.raises(NoFeasiblePlanError, match="successor's replica"):
        plan(prof, hw, world_size=2, global_batch=8, replica=True, redundancy="auto")  # one pipeline: lazy's replicas
    with pytest.raises(BambooConfigError, match="'auto'"):
        plan(prof, hw, world_size=4, global_batch=8, redundancy="sometimes")


# --- the redundancy's time: replica update, gradient shipping, eager's redundant forwards ---------------------------


def test_the_redundancys_work_fills_each_stages_bubbles_before_it_adds_to_the_step() -> None:
    """Four equal stages (F 1, B 2, no transfers): each waits (p - 1)(F + B) = 9 per step. The replica's update
    (0.1) fits there, and eager places 8 of the successor's forwards in the 8.9 left (all 8 of 8; 8 of 16);
    neither adds to the step. An update of 10 overflows by 1, and leaves eager no room for a forward."""
    prof = model(*[layer(1.0, 2.0, update=0.1) for _ in range(4)])
    parts = [0, 1, 2, 3, 4]
    est = estimate_step(prof, FAST, parts, 1, 8)
    assert est.step_seconds == pytest.approx(7 * 3 + 12 + 0.1)
    lazy = redundancy_cost(prof, FAST, est, 1, 8, "lazy")
    assert lazy.idle_seconds == pytest.approx((9.0,) * 4) and lazy.work_seconds == pytest.approx((0.1,) * 4)
    assert lazy.step_seconds == 0.0 and lazy.forwards == (0,) * 4
    eager = redundancy_cost(prof, FAST, est, 1, 8, "eager")
    assert eager.forwards == (8,) * 4 and eager.work_seconds == pytest.approx((8.1,) * 4) and eager.step_seconds == 0.0
    assert lazy.kept_bytes == (0,) * 4 and eager.kept_bytes == (0,) * 4  # these layers save nothing
    saving = model(*[layer(1.0, 2.0, update=0.1, act=100, out=10) for _ in range(4)])
    kept = redundancy_cost(saving, FAST, estimate_step(saving, FAST, parts, 1, 8), 1, 8, "eager")
    # each of a stage's kept forwards: its successor's 100 saved bytes, its input (10; none into stage 0) and output
    assert kept.kept_bytes == (kept.forwards[0] * 120, kept.forwards[1] * 120, kept.forwards[2] * 120,
                               kept.forwards[3] * 110) and min(kept.forwards) > 0
    est16 = estimate_step(prof, FAST, parts, 1, 16)
    eager16 = redundancy_cost(prof, FAST, est16, 1, 16, "eager")
    assert eager16.forwards == (8,) * 4 and eager16.step_seconds == 0.0
    assert redundancy_cost(prof, FAST, est16, 1, 16, "off").step_seconds == 0.0
    heavy = model(*[layer(1.0, 2.0, update=10.0) for _ in range(4)])
    est_heavy = estimate_step(heavy, FAST, parts, 1, 8)
    assert redundancy_cost(heavy, FAST, est_heavy, 1, 8, "lazy").step_seconds == pytest.approx(10 - 9)
    heavy_eager = redundancy_cost(heavy, FAST, est_heavy, 1, 8, "eager")
    assert heavy_eager.forwards == (0,) * 4 and heavy_eager.step_seconds == pytest.approx(10 - 9)
    one_stage = estimate_step(prof, FAST, [0, 4], 1, 8)
    assert redundancy_cost(prof, FAST, one_stage, 1, 8, "eager").step_seconds == 0.0  # nothing to replicate


def test_gradients_shipped_over_a_slow_link_add_what_the_link_cannot_carry_in_the_step() -> None:
    """100 MB of gradients per stage at 1 MB/s take 100 s per step; the link carries no activations (outputs of 0
    bytes), so the 33.1 s step hides 33.1 of them and the step grows by 66.9."""
    prof = model(*[layer(1.0, 2.0, params=100_000_000, update=0.1) for _ in range(4)])
    slow = Hardware(memory_bytes=10**12, bandwidth_bytes_per_second=1e6, latency_seconds=0.0)
    est = estimate_step(prof, slow, [0, 1, 2, 3, 4], 1, 8)
    cost = redundancy_cost(prof, slow, est, 1, 8, "lazy")
    assert cost.ship_seconds == pytest.approx((100.0,) * 4)
    assert cost.step_seconds == pytest.approx(100 - est.step_seconds)
    with pytest.raises(BambooConfigError, match=r"redundancy must be one of \['off', 'lazy', 'eager'\] \(got 'always'\)"):
        redundancy_cost(prof, slow, est, 1, 8, "always")


def test_a_plan_that_prices_the_redundancy_ranks_every_layout_with_it() -> None:
    """On random models: the plan's step is its split's estimate plus the redundancy's time, and no layout it
    considered does better with that time counted."""
    rng = random.Random(11)
    checked = 0
    for _ in range(60):
        prof = random_profile(rng, rng.randint(3, 6), sizes=(1, 2))
        hw = random_hardware(rng)
        world, batch = rng.choice([2, 3, 4, 6]), rng.choice([4, 8, 12])
        try:
            off = plan(prof, hw, world, batch)
            lazy = plan(prof, hw, world, batch, redundancy="lazy")
        except NoFeasiblePlanError:
            continue
        assert lazy.redundancy == "lazy" and off.redundancy_seconds == 0.0
        est = estimate_step(prof, hw, lazy.partition, lazy.micro_batch_size, lazy.micro_batches, lazy.pipelines)
        extra = redundancy_cost(prof, hw, est, lazy.micro_batch_size, lazy.micro_batches, "lazy").step_seconds
        assert lazy.redundancy_seconds == pytest.approx(extra)
        assert lazy.predicted_step_seconds == pytest.approx(est.step_seconds + extra)
        assert all(alt.samples_per_second <= lazy.samples_per_second * (1 + 1e-12) for alt in lazy.alternatives)
        checked += 1
    assert checked >= 20
    with pytest.raises(BambooConfigError, match=r"redundancy must be one of"):
        plan(prof, hw, 2, 4, redundancy="sometimes")


def test_where_the_gradients_shipped_overflow_the_step_the_plan_takes_data_parallelism() -> None:
    """Two workers, two layers (F 1, B 2, update 5): a 2-stage pipeline (20 s a step) beats two data-parallel
    workers (22 s: each updates both layers; their all-reduce has a fast link). Under lazy the pipeline also ships
    25 MB of gradients per stage over a 1 MB/s link: 25 s against a 20 s step, 5 s added, and data parallelism
    (nothing to replicate) wins."""
    prof = model(*[layer(1.0, 2.0, params=25_000_000, update=5.0) for _ in range(2)])
    hw = Hardware(memory_bytes=10**12, bandwidth_bytes_per_second=1e6, allreduce_bandwidth_bytes_per_second=1e30,
                  latency_seconds=0.0)
    off = plan(prof, hw, world_size=2, global_batch=4)
    assert (off.stages, off.pipelines) == (2, 1) and off.predicted_step_seconds == pytest.approx(20.0)
    lazy = plan(prof, hw, world_size=2, global_batch=4, redundancy="lazy")
    assert (lazy.stages, lazy.pipelines) == (1, 2) and lazy.predicted_step_seconds == pytest.approx(22.0)
    pipeline = next(alt for alt in lazy.alternatives if (alt.stages, alt.pipelines, alt.micro_batch_size) == (2, 1, 1))
    assert pipeline.predicted_step_seconds == pytest.approx(25.0)


def test_a_plan_shows_each_stages_memory_with_and_without_its_replica() -> None:
    layers = [layer(1.0, 2.0, params=10 * MiB, update=0.1, sizes=(1,)) for _ in range(4)]
    prof = model(*layers)
    hw = Hardware(memory_bytes=100 * MiB, bandwidth_bytes_per_second=1e12, latency_seconds=0.0)
    held = plan(prof, hw, world_size=4, global_batch=8, replica=True, redundancy="lazy")
    replica = 4 * 10 * MiB  # the successor's one layer: parameters, gradients, two AdamW moments
    assert [a - b for a, b in zip(held.stage_memory_bytes, held.stage_memory_without_replica_bytes, strict=True)] \
        == [replica] * 4
    assert Plan.from_json(held.to_json()) == held
    text = plan_table(prof, hw, 4, 8, replica=True, redundancy="lazy").format()
    assert "no-rep MiB" in text and "+rc s" in text
    assert "no-rep MiB" not in plan_table(prof, replace(hw, memory_bytes=10**12), 4, 8).format()
