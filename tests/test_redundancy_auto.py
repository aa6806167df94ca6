"""``redundancy="auto"``: a successor replica only for stages with no data-parallel copy on another machine, decided
by one pure function that the ranks, the failover planner, the schedule and the policy all ask (no processes)."""

from __future__ import annotations

import pytest
from deepspeed.runtime.pipe import schedule as ds_schedule

from lightning_bamboo.engine.audit import NodeDigest, mismatches
from lightning_bamboo.engine.program import (
    BambooTrainSchedule,
    RecvReplicaSync,
    ReplicaUpdate,
    SendReplicaSync,
)
from lightning_bamboo.errors import BambooConfigError, FatalLoss
from lightning_bamboo.runtime.config import BambooConfig
from lightning_bamboo.schedule import Kind, ScheduleError, build_failover, build_schedule, simulate, validate
from lightning_bamboo.topology import (
    Layout,
    Placement,
    PolicyConfig,
    machine_of,
    plan_failover,
    plan_loss,
    reconfigure,
)
from lightning_bamboo.topology.apart import fatal_pairs, rows_of
from lightning_bamboo.topology.failover import fatal_stage_pairs
from lightning_bamboo.topology.machines import interleaved
from lightning_bamboo.topology.replicas import (
    held_stage,
    kept_in_rows,
    kept_replicas,
    place_for,
    replica_peers,
)

T, F = True, False


# ---------------------------------------------------------------- the decision
def test_one_pipeline_keeps_every_stages_replica_as_lazy_does():
    for order in (["node0", "node1", "node2"], ["m.0", "m.1", "m.2"], interleaved(["a", "b", "c"], 1)):
        assert kept_replicas(order, 3, "auto") == kept_replicas(order, 3, "lazy") == (T, T, T)


def test_two_pipelines_on_interleaved_machines_keep_none():
    order = interleaved(["m0", "m1"], 2)  # the launcher's machine-interleaved order: m0.0 m1.0 m0.1 m1.1
    assert order == ["m0.0", "m1.0", "m0.1", "m1.1"]
    assert kept_replicas(order, 2, "auto") == (F, F)  # stage 0: m0.0 and m1.0; stage 1: m0.1 and m1.1
    assert kept_replicas(order, 2, "lazy") == (T, T)
    assert kept_replicas([f"node{i}" for i in range(6)], 3, "auto") == (F, F, F)  # one node per machine
    # three machines, two pipelines of three: every stage's copies on two machines
    assert kept_replicas(interleaved(["a", "b", "c"], 2), 3, "auto") == (F, F, F)


def test_copies_sharing_a_machine_keep_those_stages_replicas():
    # stage 1 of both pipelines on machine a: only stage 1's replica, on stage 0's nodes
    rows = [["x.0", "a.0", "y.0"], ["z.0", "a.1", "w.0"]]
    assert kept_in_rows(rows, "auto") == (F, T, F)
    # every stage's copies on one machine each (the blocks order of 2 machines x 2 workers): as lazy
    assert kept_replicas(["m0.0", "m0.1", "m1.0", "m1.1"], 2, "auto") == (T, T)
    # stage 0 shares a machine: its failover hands the last stage to stage S - 2, so the last stage's is kept too
    assert kept_in_rows([["a.0", "b.0", "c.0", "d.0"], ["a.1", "e.0", "f.0", "g.0"]], "auto") == (T, F, F, T)
    # three pipelines: one copy on another machine is enough
    assert kept_in_rows([["a.0", "x"], ["a.1", "y"], ["b.0", "z"]], "auto") == (F, F)
    assert kept_in_rows([["a.0", "x"], ["a.1", "y"], ["a.2", "z"]], "auto") == (T, F)


def test_off_and_one_stage_keep_nothing_and_bad_input_is_named():
    assert kept_replicas(["a", "b"], 2, "off") == (F, F)
    assert kept_replicas(["a", "b"], 1, "auto") == (F,)
    with pytest.raises(BambooConfigError, match=r"redundancy must be one of \('off', 'lazy', 'eager', 'auto'\)"):
        kept_replicas(["a", "b"], 2, "sometimes")
    with pytest.raises(BambooConfigError, match="3 nodes do not form pipelines of 2 stages"):
        kept_replicas(["a", "b", "c"], 2, "auto")


def test_each_rank_knows_its_holder_and_the_stage_it_keeps():
    layout = Layout(3, 2, (0, 1, 2, 3))  # rank r: stage r // 2 of pipeline r % 2
    kept = (F, T, F)
    # stage 0's ranks keep stage 1's replica; stage 1's ranks ship to them; stage 2 neither ships nor keeps
    assert [replica_peers(layout, r, kept) for r in range(6)] == [(None, 2), (None, 3), (0, None), (1, None),
                                                                   (None, None), (None, None)]
    assert [held_stage(layout, r, kept) for r in range(6)] == [1, 1, None, None, None, None]
    assert [replica_peers(layout, r, (T, T, T)) for r in (0, 5)] == [(4, 2), (3, 1)]


def test_both_doors_take_auto_and_default_to_it():
    assert BambooConfig(redundancy="auto").redundant
    assert BambooConfig.from_deepspeed({"redundancy": "auto"}, stages=2).redundancy == "auto"
    import lightning_bamboo

    assert lightning_bamboo.BambooStrategy(stages=2, redundancy="auto").redundancy == "auto"
    # the default (rc_overhead_pipelines2.txt: lazy's failover for 1.2% with one pipeline, 0.96x of lazy's step and
    # 0.94x of its memory with two, where off would restart from the checkpoint)
    assert BambooConfig().redundancy == "auto" and BambooConfig.from_deepspeed({}, stages=2).redundancy == "auto"
    assert lightning_bamboo.BambooStrategy().redundancy == "auto"


def test_auto_keeps_nothing_where_no_process_outlives_a_lost_one():
    """Without the Bamboo launcher's membership ``auto`` runs as ``off``; the modes asked for by name run as asked.
    One stage has no successor to hold: ``auto`` takes it, ``lazy`` and ``eager`` are refused with the rule."""
    assert BambooConfig().redundancy_with(membership=False) == "off"
    assert BambooConfig().redundancy_with(membership=True) == "auto"
    assert BambooConfig(redundancy="lazy").redundancy_with(membership=False) == "lazy"
    assert BambooConfig(stages=1).redundancy_with(membership=True) == "auto"
    assert kept_replicas(["a"], 1, "auto") == (F,)
    for mode in ("lazy", "eager"):
        with pytest.raises(BambooConfigError, match=rf"redundancy='{mode}' needs at least 2 stages"):
            BambooConfig(stages=1, redundancy=mode)


# ---------------------------------------------------------------- failover from the replicas that exist
def test_a_loss_in_one_of_two_interleaved_pipelines_drops_it_and_a_loss_in_both_is_fatal():
    order = interleaved(["m0", "m1"], 2)  # pipelines: (m0.0, m0.1) and (m1.0, m1.1)
    kept = kept_replicas(order, 2, "auto")
    plan = plan_loss(order, 2, (0, 2, 4), {"m0.1"}, kept=kept)
    assert (plan.order, plan.pipelines, plan.released) == (("m1.0", "m1.1"), 1, ("m0.0",))
    # a node of each pipeline: lazy fails both pipelines over from their replicas (alike: every survivor trains on),
    # auto has none to fail over from
    lost = {"m0.1", "m1.1"}
    plan = plan_loss(order, 2, (0, 2, 4), lost)
    assert (plan.order, plan.pipelines, plan.parts, plan.released) == (("m0.0", "m1.0"), 2, (0, 4), ())
    with pytest.raises(FatalLoss, match=r"every pipeline lost a node and none can fail over .*stage 1 \(node m0.1\) is "
                                        r"lost and no replica of it is kept"):
        plan_loss(order, 2, (0, 2, 4), lost, kept=kept)


def test_a_pipeline_fails_over_only_from_kept_replicas():
    nodes, parts = ["a", "b", "c"], (0, 1, 2, 3)
    assert plan_failover(nodes, parts, {"b"}, (F, T, F)).order == ("a", "c")
    with pytest.raises(FatalLoss, match="stage 2 .* no replica of it is kept"):
        plan_failover(nodes, parts, {"c"}, (F, T, F))
    # stage 0 kept but not the last stage: the last node cannot hand its own stage to stage S - 2
    with pytest.raises(FatalLoss, match="b keeps no replica of it"):
        plan_failover(nodes, parts, {"a"}, (T, F, F))
    assert plan_failover(nodes, parts, {"a"}, (T, F, T)).order == ("c", "b")


def test_fatal_pairs_count_only_kept_replicas():
    assert fatal_stage_pairs(4) == fatal_stage_pairs(4, (T, T, T, T)) == ((0, 1), (0, 2), (0, 3), (1, 2), (2, 3))
    assert fatal_stage_pairs(4, (F, F, F, F)) == ()
    assert fatal_stage_pairs(3, (F, T, F)) == ()  # stages 0 and 2 end the pipeline alone: no pair to keep apart
    rows = rows_of(interleaved(["m0", "m1"], 2), 2)
    assert fatal_pairs(rows) == (("m0.0", "m0.1"), ("m1.0", "m1.1"))
    assert fatal_pairs(rows, kept_in_rows(rows, "auto")) == ()


# ---------------------------------------------------------------- the program: replica actions where replicas are
def test_the_schedule_has_replica_actions_only_where_replicas_are_kept():
    kept = (F, T, F)
    schedule = build_schedule(3, 4, "lazy", kept=kept)
    validate(schedule)
    assert schedule.replicas == (1, None, None)
    kinds = [{a.kind for _, a in schedule.actions(r)} for r in range(3)]
    assert {Kind.REPLICA_UPDATE, Kind.RECV_SYNC} <= kinds[0] and Kind.SEND_SYNC not in kinds[0]
    assert Kind.SEND_SYNC in kinds[1] and not {Kind.REPLICA_UPDATE, Kind.RECV_SYNC} & kinds[1]
    assert schedule.programs[2] == build_schedule(3, 4, "off").programs[2]  # stage 2: DeepSpeed's own step
    assert simulate(schedule).makespan == simulate(build_schedule(3, 4, "off")).makespan
    eager = build_schedule(3, 4, "eager", kept=kept)
    validate(eager)
    assert {a.stage for r in (1, 2) for _, a in eager.actions(r) if a.kind is Kind.REDUNDANT_FORWARD} == set()
    validate(build_failover(3, 4, 1, kept=kept))
    with pytest.raises(ScheduleError, match="a failover of rank 2 needs its replica"):
        build_failover(3, 4, 2, kept=kept)
    with pytest.raises(ScheduleError, match="kept names one flag per stage"):
        build_schedule(3, 4, "lazy", kept=(T, T))


def test_a_ranks_program_has_the_replica_instructions_of_its_own_replica_and_holder_only():
    kept = (F, T, F)
    kinds = [[type(cmd) for step in BambooTrainSchedule(4, 3, stage, "lazy", kept=kept) for cmd in step]
             for stage in range(3)]
    after = [[type(cmd) for cmd in BambooTrainSchedule(4, 3, stage, "lazy", kept=kept).after_loss] for stage in range(3)]
    assert ReplicaUpdate in kinds[0] and SendReplicaSync not in kinds[0] and after[0] == [RecvReplicaSync]
    assert SendReplicaSync in kinds[1] and ReplicaUpdate not in kinds[1] and after[1] == []
    plain = [[(type(c).__name__, c.kwargs) for c in step] for step in ds_schedule.TrainSchedule(4, 3, 2)]
    assert [[(type(c).__name__, c.kwargs) for c in step] for step in BambooTrainSchedule(4, 3, 2, "lazy", kept=kept)] \
        == plain and after[2] == []


# ---------------------------------------------------------------- the audit and the policy agree with the rule
def test_the_audit_names_a_missing_kept_replica_and_one_held_that_is_not_kept():
    reports = [NodeDigest("a", 0, 0, {}, 1, {}), NodeDigest("b", 1, 0, {}, None, {}), NodeDigest("c", 2, 0, {}, None, {})]
    assert mismatches(reports, 3, "after", kept=(F, T, F)) == []
    assert mismatches(reports, 3, "after", kept=(F, T, T)) == [
        "after step 3: no node holds the replica of stage 2 of pipeline 0 (run by c), which the layout keeps"]
    assert mismatches(reports, 3, "after", kept=(F, F, F)) == [
        "after step 3: a holds a replica of stage 1 of pipeline 0, which the layout keeps none of"]


def test_the_policy_keeps_pipelines_whose_copies_span_machines_under_auto_and_places_pairs_apart_under_lazy():
    rows = [["m0.0", "m0.1"], ["m1.0", "m1.1"]]  # each pipeline on one machine, each stage's copies on two
    assert place_for(rows, "auto") == (("m0.0", "m0.1"), ("m1.0", "m1.1"))
    assert place_for(rows, "lazy") != place_for(rows, "auto")  # lazy keeps a node and its holder on two machines
    layout = Placement((("m0.0", "m0.1"),), (0, 2, 4), (4,))  # one pipeline; two nodes of m1 stand by
    grids = {}
    for redundancy in ("auto", "lazy"):
        config = PolicyConfig(stages=2, layers=4, global_micro_batches=4, redundancy=redundancy)
        decision = reconfigure(["m0.0", "m0.1", "m1.0", "m1.1"], ["m1.0", "m1.1"], layout, [], config)
        assert decision.action == "add_pipeline" and decision.layout is not None and decision.warning is None
        grids[redundancy] = [list(row) for row in decision.layout.grid]
    assert grids["auto"] == rows  # the nodes stay on their stages, and no replica is kept
    assert all(machine_of(a) != machine_of(b) for a, b in grids["lazy"])  # each node and its holder apart
