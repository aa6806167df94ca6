"""Pure failover rules: who serves which layers after a loss, and when a loss is fatal."""

from __future__ import annotations

import pytest
import torch

from lightning_bamboo.engine.replica import equal_states
from lightning_bamboo.errors import BambooConfigError, FatalLoss
from lightning_bamboo.topology import check_replica_memory, layout_tag, plan_failover, plan_loss

NODES = ["n0", "n1", "n2", "n3"]
PARTS = [0, 2, 4, 6, 8]


def table(plan):
    return [(seg.stage, seg.node, seg.source) for seg in plan.segments]


def test_middle_node_lost_predecessor_runs_both_stages():
    plan = plan_failover(NODES, PARTS, {"n2"})
    assert plan.order == ("n0", "n1", "n3") and plan.parts == (0, 2, 6, 8)
    assert table(plan) == [(0, "n0", "own"), (1, "n1", "own"), (2, "n1", "replica"), (3, "n3", "own")]


def test_last_node_lost():
    plan = plan_failover(NODES, PARTS, {"n3"})
    assert plan.order == ("n0", "n1", "n2") and plan.parts == (0, 2, 4, 8)
    assert plan.segments_of("n2") == plan.segments[2:]


def test_first_node_lost_wraps_without_moving_data():
    # n3 holds stage 0's replica but its own stage 3 is not next to stage 0: stage 3 goes to
    # n2, which holds stage 3's replica. Nothing moves over the network.
    plan = plan_failover(NODES, PARTS, {"n0"})
    assert plan.order == ("n3", "n1", "n2") and plan.parts == (0, 2, 4, 8)
    assert table(plan) == [(0, "n3", "replica"), (1, "n1", "own"), (2, "n2", "own"), (3, "n2", "replica")]


def test_two_losses_far_apart():
    plan = plan_failover(NODES, PARTS, {"n1", "n3"})
    assert plan.order == ("n0", "n2") and plan.parts == (0, 4, 8)


@pytest.mark.parametrize("lost", [{"n1", "n2"}, {"n3", "n0"}, {"n0", "n2"}])
def test_adjacent_losses_are_fatal(lost):
    with pytest.raises(FatalLoss, match="restore its last checkpoint"):
        plan_failover(NODES, PARTS, lost)


def test_every_single_loss_keeps_every_layer_once():
    for stages in range(2, 9):
        nodes = [f"n{i}" for i in range(stages)]
        parts = list(range(0, 2 * stages + 1, 2))
        for dead in nodes:
            plan = plan_failover(nodes, parts, {dead})
            assert dead not in plan.order and len(plan.order) == stages - 1
            assert plan.parts[0] == 0 and plan.parts[-1] == parts[-1]
            assert list(plan.parts) == sorted(set(plan.parts))


def test_equal_states_finds_a_one_bit_difference():
    a = {0: {"weights": {"w": torch.ones(3)}, "optimizer": {"w": {"state": {"momentum_buffer": torch.zeros(3)}, "group": 0}}}}
    b = {0: {"weights": {"w": torch.ones(3)}, "optimizer": {"w": {"state": {"momentum_buffer": torch.zeros(3)}, "group": 0}}}}
    assert equal_states(a, b) == []
    b[0]["optimizer"]["w"]["state"]["momentum_buffer"][1] = torch.finfo(torch.float32).tiny
    assert equal_states(a, b) == ["layer 0 optimizer w differs"]


def test_not_enough_host_memory_for_the_replica():
    with pytest.raises(BambooConfigError, match=r"not enough host memory for the replica of layers 2..3: it needs about 0.06 GiB .* 0.01 GiB are free"):
        check_replica_memory(range(2, 4), params=4 * 2**20, available_bytes=2**20 * 10)


# ---------------------------------------------------------------------- data-parallel pipelines (plan_loss)
# 2 pipelines x 2 stages in rank order: rank r runs stage r // 2 of pipeline r % 2
GRID = ["a0", "b0", "a1", "b1"]  # pipeline a: a0 -> a1, pipeline b: b0 -> b1


def test_a_pipeline_that_lost_a_node_is_dropped_and_the_whole_one_trains_on():
    plan = plan_loss(GRID, 2, [0, 4, 8], {"a1"})
    assert plan.order == ("b0", "b1") and plan.pipelines == 1 and plan.parts == (0, 4, 8)
    assert plan.released == ("a0",) and plan.rows == (("b0", "b1"),)
    assert [s.source for s in plan.segments] == ["own", "own"]  # nothing moves, no replica is used


def test_whole_pipelines_keep_their_rank_order():
    six = ["a0", "b0", "c0", "a1", "b1", "c1"]  # 3 pipelines x 2 stages
    plan = plan_loss(six, 3, [0, 4, 8], {"b0"})
    assert plan.order == ("a0", "c0", "a1", "c1") and plan.pipelines == 2 and plan.released == ("b1",)


def test_when_every_pipeline_lost_a_node_the_fullest_fails_over_alone():
    six = ["a0", "b0", "a1", "b1", "a2", "b2"]  # 2 pipelines x 3 stages
    plan = plan_loss(six, 2, [0, 2, 5, 8], {"a1", "b0", "b2"})
    assert plan.order == ("a0", "a2") and plan.parts == (0, 5, 8) and plan.pipelines == 1  # a0 runs a1's stage
    assert plan.released == ("b1",) and plan.rows == (("a0", "a1", "a2"),)


def test_when_every_pipeline_lost_the_same_stage_they_all_fail_over():
    six = ["a0", "b0", "a1", "b1", "a2", "b2"]  # 2 pipelines x 3 stages
    plan = plan_loss(six, 2, [0, 2, 5, 8], {"a1", "b1"})  # (a machine holding stage 1 of both)
    assert plan.order == ("a0", "b0", "a2", "b2") and plan.parts == (0, 5, 8) and plan.pipelines == 2
    assert plan.released == () and plan.rows == (("a0", "a1", "a2"), ("b0", "b1", "b2"))
    assert [s.source for s in plan.segments] == ["own", "replica", "own"]  # a0 (b0) serves stage 1 from its replica


def test_a_data_parallel_loss_no_pipeline_survives_is_fatal():
    six = ["a0", "b0", "a1", "b1", "a2", "b2"]  # 2 pipelines x 3 stages
    with pytest.raises(FatalLoss, match="every pipeline lost a node"):
        plan_loss(six, 2, [0, 2, 5, 8], {"a0", "a1", "b1", "b2"})  # each lost a node and its replica holder
    # redundancy='off' is a plain pipeline: every loss restarts from the checkpoint, a whole pipeline or not
    with pytest.raises(FatalLoss, match="redundancy='off'"):
        plan_loss(GRID, 2, [0, 4, 8], {"a1"}, replicas=False)


def test_one_pipeline_is_plain_failover():
    plan = plan_loss(NODES, 1, PARTS, {"n2"})
    assert (plan.order, plan.parts, plan.released) == (("n0", "n1", "n3"), (0, 2, 6, 8), ())


def test_the_process_group_tag_follows_the_layout():
    assert layout_tag(["b0", "b1"]) == layout_tag(("b0", "b1")) != layout_tag(["b1", "b0"])
