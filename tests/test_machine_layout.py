"""Machines as failure domains (pure): the launcher's rank order keeps every replica holder on another machine.

Rank ``r`` runs stage ``r // P`` of pipeline ``r % P``; a stage's replica is held by its predecessor in the
pipeline, rank ``r - P`` (the first stage's by the last). A machine's preemption takes all its workers, so a
holder on its own stage's machine never saves a step. The three fleets of docs/membership.md: 8 machines x 8
GPUs, 4 x 2 and 3 x 2.
"""

from __future__ import annotations

import pytest

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.launcher import job_nodes, plan_node, resolve_workers
from lightning_bamboo.topology import Layout, machine_of
from lightning_bamboo.topology.machines import (
    blocks,
    cross_machine_traffic,
    depths,
    fatal_conflicts,
    interleaved,
    machine_order,
    placement_possible,
    replica_conflicts,
    replica_placement_report,
)


def fleet(machines: int) -> list[str]:
    return [f"m{i}" for i in range(machines)]


def holders_by_layout(order: list[str], stages: int) -> dict[str, str]:
    """Every node's replica holder, worked out through ``Layout`` itself (not the module under test)."""
    layout = Layout(stages, len(order) // stages, tuple(range(stages + 1)))
    rank = {(layout.pipeline_of_rank(r), layout.stage_of_rank(r)): order[r] for r in range(len(order))}
    return {rank[p, s]: rank[p, (s - 1) % stages] for p, s in rank}


def test_the_old_interleaved_order_put_every_replica_of_an_8_by_8_fleet_on_its_own_machine():
    # what the issue found: 8 stages x 8 pipelines, m0.0 m1.0 .. m7.0 m0.1 ..: rank r and r - 8 on one machine
    old = interleaved(fleet(8), 8)
    holders = holders_by_layout(old, 8)
    assert all(machine_of(node) == machine_of(holder) for node, holder in holders.items())
    assert len(replica_conflicts(old, 8)) == 64


@pytest.mark.parametrize("stages", [None, 2, 4, 8, 16, 32, 64])
def test_8_machines_of_8_gpus_keep_every_replica_holder_on_another_machine(stages):
    order = machine_order(fleet(8), 8, stages)
    assert sorted(order) == sorted(interleaved(fleet(8), 8))  # every worker once
    for depth in depths(64) if stages is None else [stages]:
        holders = holders_by_layout(order, depth)
        assert all(machine_of(n) != machine_of(h) for n, h in holders.items()), depth
        assert replica_conflicts(order, depth) == [] and fatal_conflicts(order, depth) == [], depth


def test_8_by_8_at_depth_8_runs_a_stage_per_machine_and_keeps_the_all_reduce_on_the_machine():
    order = machine_order(fleet(8), 8, 8)
    assert order == blocks(fleet(8), 8)  # m0.0 .. m0.7 are stage 0 of the 8 pipelines
    traffic = cross_machine_traffic(order, 8)
    assert traffic.activations == (56, 56)  # consecutive stages: always another machine
    assert traffic.replica == (64, 64)  # every replica refresh crosses: that is the point
    assert traffic.allreduce == (0, 64)  # each stage's 8 data-parallel copies share one machine's links


@pytest.mark.parametrize("stages", [None, 2, 4, 8])
def test_4_machines_of_2_keep_every_replica_holder_on_another_machine(stages):
    order = machine_order(fleet(4), 2, stages)
    for depth in depths(8) if stages is None else [stages]:
        assert replica_conflicts(order, depth) == [] and fatal_conflicts(order, depth) == [], depth
        assert all(machine_of(n) != machine_of(h) for n, h in holders_by_layout(order, depth).items())


def test_4_by_2_without_a_depth_gets_one_order_right_at_every_depth():
    # the interleaved order has 2 stages of 4 pipelines on one machine (rank r and r + 4); this one never does
    assert replica_conflicts(interleaved(fleet(4), 2), 2) != []
    assert machine_order(fleet(4), 2) == ["m0.0", "m1.0", "m2.0", "m3.0", "m1.1", "m0.1", "m3.1", "m2.1"]
    assert cross_machine_traffic(machine_order(fleet(4), 2, 4), 4).allreduce == (0, 4)


def test_3_machines_of_2_have_no_order_right_at_every_depth_but_one_for_each_depth():
    # 6 ranks: at depth 2, 3 and 6 every rank neighbours every other one at some depth: no single order serves
    default = machine_order(fleet(3), 2)
    assert default == ["m0.0", "m1.0", "m2.0", "m0.1", "m1.1", "m2.1"]  # the namespace tests' ranks, unchanged
    assert replica_conflicts(default, 3) == [] and replica_conflicts(default, 6) == []
    assert fatal_conflicts(default, 3) == [] and fatal_conflicts(default, 6) == []
    assert len(replica_conflicts(default, 2)) == 6
    for depth in (2, 3, 6):
        assert fatal_conflicts(machine_order(fleet(3), 2, depth), depth) == [], depth
    assert "--stages 2" in replica_placement_report(default, 2)


def test_one_machine_cannot_keep_a_replica_elsewhere_and_says_why():
    assert not placement_possible(1, 4, 2) and not placement_possible(1, 4, 4)
    order = machine_order(["solo"], 4, 4)
    assert len(replica_conflicts(order, 4)) == 4
    assert len(fatal_conflicts(order, 4)) == 5  # the 4 neighbours and stage 0 with stage 2
    report = replica_placement_report(order, 4)
    assert "depth 4 puts 5 pair(s) of nodes whose joint loss is fatal on one machine" in report
    assert "solo.0 (stage 0) and solo.2 (stage 2) on solo" in report
    assert "cannot, whatever the placement (rule: a pipeline of 4 stages has at most 2 node(s) on one machine" in report
    assert report.endswith("fix: more machines")


def test_two_machines_cannot_hold_an_odd_ring():
    # 3 stages on 2 machines: a ring of 3 needs 3 machines
    assert not placement_possible(2, 3, 3)
    assert placement_possible(3, 2, 3) and placement_possible(2, 2, 2)


def test_two_machines_cannot_hold_a_ring_of_4_or_more_either():
    # alternating m0 m1 m0 m1 keeps every replica holder elsewhere, but stage 0 and stage S - 2 meet on m0: when
    # stage 0 is lost, its holder (the last node) hands its own stage to stage S - 2's node, lost with it
    order = machine_order(fleet(2), 3, 6)
    assert replica_conflicts(order, 6) == [] and fatal_conflicts(order, 6) == [("m0.0", "m0.2", "m0")]
    assert not placement_possible(2, 2, 4) and not placement_possible(2, 3, 6)
    assert placement_possible(3, 2, 6) and placement_possible(3, 4, 4)  # 3 machines: (2, 1, 1) per ring of 4
    assert "or a depth of 2" in replica_placement_report(order, 6)  # 3 pipelines of 2 can


@pytest.mark.parametrize("machines", range(1, 6))
@pytest.mark.parametrize("workers", range(1, 6))
def test_the_order_for_a_depth_is_right_exactly_where_placement_possible_says_it_can_be(machines, workers):
    for depth in depths(machines * workers):
        order = machine_order(fleet(machines), workers, depth)
        assert sorted(order) == sorted(interleaved(fleet(machines), workers))
        assert (fatal_conflicts(order, depth) == []) == placement_possible(machines, workers, depth), depth
        for node, holder in holders_by_layout(order, depth).items():  # the replica rule is part of it
            assert machine_of(node) != machine_of(holder) or not placement_possible(machines, workers, depth)


def test_a_depth_that_does_not_divide_the_nodes_is_refused_with_the_depths_that_do():
    with pytest.raises(BambooConfigError, match=r"nodes: 6, stages: 4\).*\[1, 2, 3, 6\]"):
        machine_order(fleet(3), 2, 4)


def test_traffic_counts_links_per_kind():
    # 3 x 2 at depth 3 (2 pipelines): blocks keep each stage's pair on one machine
    order = machine_order(fleet(3), 2, 3)
    assert order == ["m0.0", "m0.1", "m1.0", "m1.1", "m2.0", "m2.1"]
    traffic = cross_machine_traffic(order, 3)
    assert traffic.activations == (4, 4) and traffic.replica == (6, 6) and traffic.allreduce == (0, 3)
    assert traffic.describe() == "activations 4 of 4, replica 6 of 6, all-reduce 0 of 3 links cross machines"
    single = cross_machine_traffic(["a", "b"], 2)  # one worker per machine: each node its own machine
    assert single.activations == (1, 1) and single.replica == (2, 2) and single.allreduce == (0, 0)


def test_the_launcher_orders_by_machine_and_numbers_workers_on_their_machine():
    assert job_nodes(fleet(8), 8, 8) == blocks(fleet(8), 8)
    assert job_nodes(fleet(3), None) == fleet(3)
    plan = plan_node(["python", "train.py"], "m1", store="etcd://10.0.0.1:2379", peers=fleet(4), addr="127.0.0.3",
                     workers=2, stages=4)
    assert plan.nodes == tuple(machine_order(fleet(4), 2, 4))
    assert [plan.local_rank(w) for w in plan.workers] == [0, 1]
    envs = {w: plan.worker_env(w) for w in plan.workers}
    assert {w: (e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for w, e in envs.items()} == {"m1.0": ("0", "2"),
                                                                                        "m1.1": ("1", "2")}
    assert {w: e["RANK"] for w, e in envs.items()} == {w: str(plan.nodes.index(w)) for w in plan.workers}
    assert all(e["WORLD_SIZE"] == "8" for e in envs.values())
    assert "every replica holder is on another machine" in plan.placement()
    described = plan.describe()
    assert "m1.1: rank" in described and "LOCAL_RANK 1 (GPU 1 on a GPU machine)" in described
    standby = plan_node(["true"], "m9", store="etcd://10.0.0.1:2379", join=True, workers=2)
    assert standby.worker_env("m9.1")["LOCAL_RANK"] == "1" and standby.worker_env("m9.1")["WORLD_SIZE"] == "1"


def test_the_launcher_says_which_depths_its_default_order_serves():
    plan = plan_node(["true"], "m0", store="etcd://10.0.0.1:2379", peers=fleet(3), addr="127.0.0.3", workers=2)
    assert plan.placement() == ("replicas: every holder on another machine, and no machine holding two nodes whose "
                                "joint loss is fatal, at depth 3,6; not at depth 2 (pass --stages D to order the "
                                "nodes for depth D)")


def test_workers_auto_takes_the_gpu_count_and_is_refused_without_gpus():
    assert resolve_workers("auto", 8) == 8 and resolve_workers("3", 0) == 3 and resolve_workers(None, 0) is None
    with pytest.raises(BambooConfigError, match=r"--workers auto .* this machine has none .* pass --workers K"):
        resolve_workers("auto", 0)
    with pytest.raises(BambooConfigError, match="a number or 'auto'"):
        resolve_workers("eight", 8)


def test_the_strategy_warns_at_start_where_a_replica_holder_shares_its_machine(monkeypatch, caplog):
    from lightning_bamboo.strategy.checks import check_local_rank, warn_if_replicas_share_machines

    monkeypatch.setenv("BAMBOO_STORE", "etcd://127.0.0.1:1")
    monkeypatch.setenv("BAMBOO_NODES", ",".join(interleaved(fleet(3), 2)))
    assert warn_if_replicas_share_machines("lazy", 3, 6) is None  # 2 pipelines of 3: all holders elsewhere
    assert warn_if_replicas_share_machines("off", 2, 6) is None  # no replicas, nothing to say
    with caplog.at_level("WARNING", logger="lightning_bamboo.strategy"):
        message = warn_if_replicas_share_machines("lazy", 2, 6)
    assert message is not None and "depth 2 puts 3 pair(s) of nodes whose joint loss is fatal on one machine" in message
    assert "m0.0 (stage 0 of pipeline 0) and m0.1 (stage 1 of pipeline 0) on m0" in message
    assert "start every launcher with --stages 2" in message and message in caplog.text
    assert warn_if_replicas_share_machines("lazy", 2, 4) is None  # started without 2 of its nodes: another layout
    check_local_rank(1, 2)
    with pytest.raises(BambooConfigError, match=r"LOCAL_RANK 2.*devices=2.*LOCAL_WORLD_SIZE"):
        check_local_rank(2, 2)
