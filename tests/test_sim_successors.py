"""ReCycle-style rerouting and Parcae-style migration on hand-made traces (the toy job of test_sim.py)."""

from __future__ import annotations

import pytest

from lightning_bamboo.sim.model import rerouted_slowdown
from lightning_bamboo.sim.successors import foreseen
from lightning_bamboo.topology import Placement
from tests.test_sim import FOUR, JOIN, R1, R2, run, steps


def test_rerouted_slowdown_keeps_the_steps_dependencies():
    # 2 pipelines x 2 stages, F = 1, B = 2: one micro-batch each is a step of 6 (F F B B down the pipeline)
    one = Placement((("a", "b"), ("c", "d")), (0, 1, 2), (1, 1))
    # a lost: c runs both forwards (0-2); the first backward reaches it at 4 and the second waits for it: 8, not 6 (c's
    # idle slots are before its first backward, when the rerouted backward is not computed yet)
    assert rerouted_slowdown(one, {"a"}) == pytest.approx(8 / 6)
    # b lost: d's two forwards and two backwards take 6 from 1, and a's backward 2 more: 9
    assert rerouted_slowdown(one, {"b"}) == pytest.approx(9 / 6)
    two = Placement((("a", "b"), ("c", "d")), (0, 1, 2), (2, 2))
    assert rerouted_slowdown(two, {"a"}) == pytest.approx(12 / 9)
    # the last stage has no idle slot a rerouted micro-batch can use: as slow as one pipeline of 4 micro-batches
    assert rerouted_slowdown(two, {"b"}) == pytest.approx(15 / 9)
    assert rerouted_slowdown(two, {"a", "c"}) == float("inf")  # stage 0 has no node left


def test_recycle_reroutes_without_dropping_a_pipeline():
    result, policy = run("recycle", FOUR + ["100000,remove,n2"])
    # n2 (stage 0 of [n2, n4]) lost: n1 takes its micro-batch, the step 8/6 as long after the 2 s pause
    # (test_rerouted_slowdown_keeps_the_steps_dependencies); a fresh 1-pipeline layout (2 samples/s) would be slower
    # than that (2.25), so nothing is rebuilt
    assert steps(result) == [(0, R2), (100, 0), (102, pytest.approx(R2 * 6 / 8))]
    assert result.samples == pytest.approx(100 * R2 + 98 * R2 * 6 / 8)
    assert result.recoveries == {"redundant": 1, "checkpoint": 0, "restart": 0}
    assert policy.layout.grid == (("n1", "n3"), ("n2", "n4"))


def test_recycle_slows_when_the_bubbles_are_too_small_and_rebuilds_when_a_node_joins():
    # 4 micro-batches: 2 per pipeline, 0.6 s per 4-sample step (20/3 samples/s); rerouted 0.8 s
    # (5 samples/s); n5 joins at 150 s: two whole pipelines again after a 3 s rebuild
    result, _ = run("recycle", FOUR + ["100000,remove,n2", "150000,add,n5"], global_micro_batches=4)
    assert steps(result) == [(0, pytest.approx(20 / 3)), (100, 0), (102, pytest.approx(5.0)), (150, 0), (153, pytest.approx(20 / 3))]
    assert result.samples == pytest.approx(100 * 20 / 3 + 48 * 5 + 47 * 20 / 3)
    assert result.reconfigurations == 1


def test_recycle_is_fatal_only_when_a_stage_lost_every_copy():
    result, _ = run("recycle", FOUR + ["100000,remove,n1", "100000,remove,n2"])
    # stage 0 was on n1 and n2: checkpoint of 100 s (300 samples), restart 10 s on [n3, n4]
    assert steps(result) == [(0, R2), (100, 0), (110, R1)]
    assert result.samples == pytest.approx(300 + 90 * R1)
    assert result.recoveries == {"redundant": 1, "checkpoint": 1, "restart": 0}


def test_parcae_migrates_a_foreseen_preemption_and_loses_nothing():
    result, policy = run("parcae", FOUR + ["100000,remove,n2"], predicted_fraction=1.0, migration_seconds=4.0)
    # migrated before the loss (4 s), re-planned as one whole pipeline of the 3 nodes left
    assert steps(result) == [(0, R2), (100, 0), (104, R1)]
    assert result.samples == pytest.approx(100 * R2 + 96 * R1)
    assert result.breakdown_hours["lost_work"] == 0 and result.recoveries["checkpoint"] == 0
    assert policy.layout.pipelines == 1


def test_parcae_unforeseen_loss_costs_the_step_and_a_migration():
    result, _ = run("parcae", FOUR + ["100000,remove,n2"], predicted_fraction=0.0, migration_seconds=4.0)
    assert steps(result) == [(0, R2), (100, 0), (106, R1)]  # 2 s failover + 4 s migration
    assert result.recoveries == {"redundant": 1, "checkpoint": 0, "restart": 0}


def test_parcae_unforeseen_loss_of_every_copy_is_fatal():
    result, _ = run("parcae", FOUR + ["100000,remove,n1", "100000,remove,n2"], predicted_fraction=0.0)
    assert steps(result) == [(0, R2), (100, 0), (110, R1)]
    assert result.samples == pytest.approx(300 + 90 * R1)
    assert result.recoveries["checkpoint"] == 1


def test_parcae_takes_joining_nodes_in_by_migration_without_a_restart():
    result, _ = run("parcae", JOIN, migration_seconds=4.0)
    assert steps(result) == [(0, R1), (100, 0), (104, R2)]
    assert result.samples == pytest.approx(100 * R1 + 96 * R2)
    assert result.recoveries == {"redundant": 0, "checkpoint": 0, "restart": 0}


def test_foreseen_share_is_fixed_by_the_name():
    names = [f"node{i}" for i in range(2000)]
    assert not any(foreseen(n, 0.0) for n in names) and all(foreseen(n, 1.0) for n in names)
    share = sum(foreseen(n, 0.3) for n in names) / len(names)
    assert 0.25 < share < 0.35
    assert [foreseen(n, 0.3) for n in names] == [foreseen(n, 0.3) for n in names]
