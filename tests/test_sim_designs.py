"""The runtime's ``redundancy="auto"`` and the fail-over-in-the-pipeline design in the simulator, on hand-made
traces (the toy job of test_sim.py: 2 pipelines x 2 stages, ``FOUR`` places pipeline 0 on n1, n3 and pipeline 1
on n2, n4; a stage's replica lives on its predecessor, stage 0's on the last stage)."""

from __future__ import annotations

import pytest

from lightning_bamboo.sim.designs import matched_share_slowdown
from tests.test_sim import FOUR, R1, R2, run, steps


def test_auto_pays_for_replicas_only_in_a_job_of_one_pipeline():
    # redundancy overhead 0.5: lazy's two pipelines step 1.5x slower, auto's not
    lazy, _ = run("bamboo", FOUR, redundancy_overhead=0.5)
    auto, policy = run("bamboo_auto", FOUR + ["100000,remove,n2"], redundancy_overhead=0.5)
    assert steps(lazy) == [(0, pytest.approx(R2 / 1.5))]
    # n2 lost: its pipeline is dropped (2 s pause) and the one pipeline left keeps replicas again, paying for them
    assert steps(auto) == [(0, R2), (100, 0), (102, pytest.approx(R1 / 1.5))]
    assert policy.layout.grid == (("n1", "n3"),)


def test_auto_has_no_replica_to_fail_over_from_until_the_pipeline_left_has_built_its_own():
    # n1 (stage 0 of pipeline 0) lost: pipeline 0 dropped (a 2 s failover); then n4 (stage 1 of pipeline 1)
    lines = FOUR + ["100000,remove,n1"]
    lazy, _ = run("bamboo", [*lines, "100000,remove,n4"])
    assert lazy.recoveries == {"redundant": 2, "checkpoint": 0, "restart": 0}  # n2 runs n4's stage from its replica
    for at in ("100000", "101000"):  # auto: the pipeline left builds its replicas in that failover: none yet
        auto, _ = run("bamboo_auto", [*lines, f"{at},remove,n4"])
        assert auto.recoveries == {"redundant": 1, "checkpoint": 1, "restart": 0}, at
    auto, _ = run("bamboo_auto", [*lines, "103000,remove,n4"])  # once it has them, it fails over as lazy does
    assert auto.recoveries == {"redundant": 2, "checkpoint": 0, "restart": 0}


def test_matched_shares_make_the_job_as_fast_as_its_pipelines_together():
    assert matched_share_slowdown(4, 0, 2.0) == 1.0
    assert matched_share_slowdown(2, 1, 2.0) == pytest.approx(4 / 3)  # 1 + 1/2 pipelines' worth of 2
    assert matched_share_slowdown(4, 1, 1.5) == pytest.approx(4 / (3 + 1 / 1.5))
    with pytest.raises(ValueError, match="damaged <= pipelines"):
        matched_share_slowdown(2, 3, 2.0)


def test_a_damaged_pipeline_fails_over_in_place_and_a_standby_node_makes_it_whole():
    result, policy = run("bamboo_in_pipeline", FOUR + ["100000,remove,n2", "150000,add,n5"])
    # n2 lost: n4 takes its stage from n1's copy (2 s failover + 3 s move) and runs both stages (2x slower): the
    # job goes at 1 + 1/2 pipelines' rate, 3 * 3/4 samples/s; n5 joins at 150 s and takes n2's place (3 s)
    assert steps(result) == [(0, R2), (100, 0), (105, pytest.approx(R2 * 3 / 4)), (150, 0), (153, R2)]
    assert result.samples == pytest.approx(100 * R2 + 45 * R2 * 3 / 4 + 47 * R2)
    assert result.recoveries == {"redundant": 1, "checkpoint": 0, "restart": 0}
    assert [a for _, a, _ in policy.decisions] == ["start", "rebalance"]
    assert policy.layout.grid == (("n1", "n3"), ("n5", "n4"))


def test_a_damaged_pipeline_that_loses_the_node_running_two_stages_is_dropped_alone():
    result, policy = run("bamboo_in_pipeline", FOUR + ["100000,remove,n2", "120000,remove,n4"])
    # 120 s: n4 ran n2's stage too: pipeline 1 has no node left; pipeline 0 trains alone (2 s pause), at R1
    assert steps(result) == [(0, R2), (100, 0), (105, pytest.approx(R2 * 3 / 4)), (120, 0), (122, R1)]
    assert policy.layout.grid == (("n1", "n3"),)
    assert result.recoveries == {"redundant": 2, "checkpoint": 0, "restart": 0}


def test_a_stage_lost_in_every_pipeline_is_fatal_in_place_too():
    # stage 0 twice: n1's stage is taken over from n2's copy, and n2 is lost while it is on its way
    result, _ = run("bamboo_in_pipeline", FOUR + ["100000,remove,n1", "100000,remove,n2"])
    assert result.recoveries == {"redundant": 1, "checkpoint": 1, "restart": 0}
