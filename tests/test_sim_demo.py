"""The simulator's demo model, trace slicing and the calibration helpers (pure, hand-computed)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import replace

import pytest

from lightning_bamboo.demo.events import ClusterEvent, events_from_trace
from lightning_bamboo.sim.calibration import clean_steps, mean_of, parse_progress, save_steps, step_intervals
from lightning_bamboo.sim.demo import DemoParams, load_demo_params, replay_demo
from lightning_bamboo.sim.params import DEFAULT_PATH, ParamError, load_params, record_measurement
from lightning_bamboo.sim.report import compare_with_demo
from lightning_bamboo.sim.trace import TraceError, parse_trace, slice_trace

NODES = ["node0", "node1", "node2", "node3"]
# 1 s per step at depth 4, 2 s at 3, 3 s at 2; no checkpoints unless a test sets a save time
P = DemoParams(
    step_seconds={4: 1.0, 3: 2.0, 2: 3.0},
    step_seconds_no_redundancy={4: 0.5, 3: 1.0},
    failover_seconds=0.25,
    restart_seconds=10.0,
    checkpoint_save_seconds=0.0,
    end_seconds=1.0,
)


def kill(node: str, at: float) -> ClusterEvent:
    return ClusterEvent("preempt", node, at_seconds=at)


def test_slice_keeps_live_nodes_at_zero_and_shifts_the_window():
    trace = parse_trace(
        ["0,add,a", "0,add,b", "1000,add,c", "2000,remove,a", "3000,add,d", "5000,remove,b"], "t"
    )
    piece = slice_trace(trace, 1.0, 4.0)
    assert [(e.ms, e.kind, e.node) for e in piece.events] == [
        (0, "add", "a"),
        (0, "add", "b"),
        (0, "add", "c"),
        (1000, "remove", "a"),
        (2000, "add", "d"),
    ]
    with pytest.raises(TraceError, match="start < end"):
        slice_trace(trace, 4.0, 4.0)
    with pytest.raises(TraceError, match="no nodes"):
        slice_trace(parse_trace(["0,add,a", "1000,remove,a", "9000,add,b"], "t"), 2.0, 3.0)


def test_progress_lines_give_step_intervals_and_a_restart_replaces_repeated_steps():
    lines = [
        (0.0, "  step    1/8  [#...]  live: a"),
        (1.0, "noise"),
        (1.5, "  step    2/8  [#.]"),
        (3.0, "  step    3/8"),
        (20.0, "  step    3/8"),
        (21.0, "  step    4/8"),
    ]
    progress = parse_progress(lines)
    assert progress == [(0.0, 1), (1.5, 2), (3.0, 3), (20.0, 3), (21.0, 4)]
    assert step_intervals(progress) == {2: 1.5, 3: 1.5, 4: 1.0}
    assert clean_steps(2, 9, 4) == [2, 3, 4, 6, 7, 8]  # 5 and 9 start with the saves of steps 4 and 8
    assert save_steps(2, 9, 4) == [5, 9]
    assert mean_of({2: 1.0, 3: 3.0, 4: 5.0}, [2, 3, 4, 9], "x") == 3.0
    with pytest.raises(Exception, match="no step interval observed for depth 5"):
        mean_of({2: 1.0}, [7, 8], "depth 5")


def test_step_time_is_measured_or_interpolated_or_the_nearest_measured_depth():
    assert P.step_time(3, redundancy=True) == 2.0
    assert P.step_time(5, redundancy=True) == 1.0  # above the measured depths: depth 4's time
    assert P.step_time(1, redundancy=True) == 1.0  # one node has no replica: no-redundancy table, depth 3
    gap = dataclasses.replace(P, step_seconds={4: 1.0, 2: 3.0})
    assert gap.step_time(3, redundancy=True) == pytest.approx(2.0)


def test_clean_run_with_checkpoints():
    # done=1 at t=0; steps end at 1, 2, 3 (+0.5 save after step 2), so step 4 ends at 3.5; end 1 s
    pred = replay_demo([], NODES, dataclasses.replace(P, checkpoint_save_seconds=0.5), 4, checkpoint_every=2)
    assert pred.seconds == pytest.approx(4.5)
    assert pred.samples_per_second == pytest.approx(4 * 8 / 4.5)
    assert pred.recoveries == {"redundant": 0, "checkpoint": 0, "restart": 0}


def test_one_kill_fails_over_redoes_the_step_in_flight_and_slows_to_depth_3():
    # step 2 ends at 1; kill at 1.5 cuts step 3; failover until 1.75, then 2 s steps: 3 at 3.75, 4 at 5.75
    pred = replay_demo([kill("node2", 1.5)], NODES, P, 4)
    assert pred.recoveries == {"redundant": 1, "checkpoint": 0, "restart": 0}
    assert pred.recomputed_steps == 1 and pred.preemptions == 1
    assert pred.seconds == pytest.approx(5.75 + 1.0)


def test_adjacent_kill_restarts_from_the_checkpoint_with_a_standby_node():
    # checkpoint after step 2 (t=1, no save pause); node1 and node2 (its replica holder is node1) die at 2.5:
    # fatal; restart 10 s with node0, node3 and spare1 (joined at 0.5) -> depth 3 at 2 s/step;
    # steps 3 and 4 end at 14.5 and 16.5
    events = [ClusterEvent("join", "spare1", at_seconds=0.5), kill("node1", 2.5), kill("node2", 2.5)]
    pred = replay_demo(events, NODES, P, 4, checkpoint_every=2)
    assert pred.recoveries == {"redundant": 0, "checkpoint": 1, "restart": 0}
    assert pred.recomputed_steps == 1  # step 3 was done at 2.0 and is lost
    assert pred.seconds == pytest.approx(16.5 + 1.0)


def test_a_fatal_loss_restarts_the_survivors_in_their_processes_and_the_others_join_them():
    # node1 and node2 die at 2.5 (checkpoint after step 2): node0 and node3 restart in their running
    # processes (2 s) at depth 2 (3 s/step) from 4.5; spare1 (joined at 0.5) starts as a standby node
    # then and is up 5 s later: step 3 ends at 7.5, spare1 is admitted there, step 4 (depth 3) ends at 9.5
    events = [ClusterEvent("join", "spare1", at_seconds=0.5), kill("node1", 2.5), kill("node2", 2.5)]
    params = replace(P, restart_in_place_seconds=2.0, join_seconds=5.0)
    pred = replay_demo(events, NODES, params, 4, checkpoint_every=2)
    assert pred.recoveries == {"redundant": 0, "checkpoint": 1, "restart": 0}
    assert pred.recomputed_steps == 1
    assert pred.seconds == pytest.approx(9.5 + 1.0)
    # one survivor cannot form a pipeline with replicas: every node starts afresh (restart_seconds, 10 s),
    # node3 and spare1 together at depth 2: steps 3 and 4 end at 15.5 and 18.5
    events = [ClusterEvent("join", "spare1", at_seconds=0.5)] + [kill(n, 2.5) for n in ("node0", "node1", "node2")]
    pred = replay_demo(events, NODES, params, 4, checkpoint_every=2)
    assert pred.recoveries["checkpoint"] == 1
    assert pred.seconds == pytest.approx(18.5 + 1.0)


def test_a_loss_during_a_save_restarts_from_the_save_before_it():
    # no redundancy, 0.5 s steps (step 1 ends at 0), a 0.25 s save after every 2nd step: the saves of
    # steps 2, 4, 6 end at 0.75, 2.0, 3.25. node0 dies at 3.1, inside the save of step 6: the checkpoint
    # is step 4's, although no event came between the saves (the simulator used to fall back to the
    # checkpoint known at the last event: none here, a restart from scratch). Restart 10 s at depth 3
    # (1 s steps): steps 5..8 end at 14.1, 15.1 (+0.25 s save), 16.35, 17.35; then 1 s to the end.
    params = dataclasses.replace(P, checkpoint_save_seconds=0.25)
    pred = replay_demo([kill("node0", 3.1)], NODES, params, 8, redundancy=False, checkpoint_every=2)
    assert pred.recoveries == {"redundant": 0, "checkpoint": 1, "restart": 0}
    assert pred.recomputed_steps == 2  # steps 5 and 6
    assert pred.seconds == pytest.approx(17.35 + 1.0)


def test_without_redundancy_every_loss_restarts_and_standby_losses_do_not():
    # 0.5 s steps; standby spare1 dies (nothing happens); node0 dies at 0.7 during step 3 -> no checkpoint yet:
    # restart from scratch with 3 nodes (1 s steps): steps 1..4 end at 11.7 .. 14.7
    events = [ClusterEvent("join", "spare1", at_seconds=0.1), kill("spare1", 0.2), kill("node0", 0.7)]
    pred = replay_demo(events, NODES, P, 4, redundancy=False, checkpoint_every=100)
    assert pred.recoveries == {"redundant": 0, "checkpoint": 0, "restart": 1}
    assert pred.preemptions == 1 and pred.recomputed_steps == 2
    assert pred.seconds == pytest.approx(14.7 + 1.0)


def test_replay_uses_the_demos_own_view_of_a_trace():
    trace = parse_trace(["0,add,a", "0,add,b", "0,add,c", "0,add,d", "0,add,e", "3000,remove,c"], "t")
    events = events_from_trace(trace, NODES, time_scale=2.0)  # e joins as standby, c = node2 dies at 1.5 s
    # step 2 ends at 1; step 3 is cut at 1.5 and redone on 3 stages from 1.75 (2 s); e is still starting
    # (join_seconds 10): step 4 runs on 3 stages too -> 5.75, + 1 s end
    assert replay_demo(events, NODES, replace(P, join_seconds=10.0), 4).seconds == pytest.approx(6.75)
    # e is up: at the start of step 4 (3.75) it is admitted (a 0.5 s reconfiguration), step 4 on 4 stages
    fast = replace(P, join_seconds=0.0, reconfigure_seconds=0.5)
    prediction = replay_demo(events, NODES, fast, 4)
    assert prediction.seconds == pytest.approx(3.75 + 0.5 + 1.0 + 1.0)
    assert any("admit" in what for _, what in prediction.timeline)


def test_a_standby_process_starting_while_the_pipeline_trains_costs_its_startup():
    # a full pipeline; spare1 joins at 0.5 during step 2 and its process starts at once (a spare place):
    # its start-up costs the training 0.3 s, so steps 2..4 end at 1.3, 2.3, 3.3; + 1 s end
    events = [ClusterEvent("join", "spare1", at_seconds=0.5)]
    assert replay_demo(events, NODES, replace(P, standby_start_seconds=0.3), 4).seconds == pytest.approx(4.3)
    # a second joiner finds no place (a full pipeline plus one spare): it waits without a process, costing nothing
    events.append(ClusterEvent("join", "spare2", at_seconds=1.5))
    assert replay_demo(events, NODES, replace(P, standby_start_seconds=0.3), 4).seconds == pytest.approx(4.3)
    # after node2 is lost at 2.5 (step 4 cut, redone on 3 stages from 2.75), spare2 gets the freed place:
    # its start-up delays the redone step by 0.3 s too; spare1 (up after join_seconds 0) is admitted
    # at the next step start only if steps remain
    events.append(kill("node2", 2.5))
    pred = replay_demo(events, NODES, replace(P, standby_start_seconds=0.3), 4)
    assert pred.recoveries["redundant"] == 1
    assert pred.seconds == pytest.approx(2.75 + 0.3 + 2.0 + 1.0)
    # without replicas no standby process is started, and a full pipeline takes joiners in at no cost
    no_red = replay_demo(events[:2], NODES, replace(P, standby_start_seconds=0.3), 4, redundancy=False)
    assert no_red.seconds == pytest.approx(3 * 0.5 + 1.0)


def test_replay_evens_out_the_layers_after_a_failover_with_nobody_to_admit():
    trace = parse_trace(["0,add,a", "0,add,b", "0,add,c", "0,add,d", "3000,remove,c"], "t")
    events = events_from_trace(trace, NODES, time_scale=2.0)
    prediction = replay_demo(events, NODES, replace(P, reconfigure_seconds=0.5), 4)
    # as above, and the rebalance pause before step 4 (still 3 stages): 1.75 + 2 + 0.5 + 2 + 1
    assert prediction.seconds == pytest.approx(7.25)
    assert prediction.recoveries["redundant"] == 1


def test_demo_measurements_live_in_their_own_section(tmp_path):
    path = tmp_path / "p.json"
    shutil.copy(DEFAULT_PATH, path)
    full = replace(P, restart_in_place_seconds=2.0)  # every parameter set
    for key, value in vars(full).items():
        record_measurement(
            key,
            value if not isinstance(value, dict) else {str(k): v for k, v in value.items()},
            "tests, demo scale",
            path,
            section="demo",
        )
    assert load_demo_params(path) == full
    assert load_params(path) == load_params(DEFAULT_PATH)  # cluster-scale defaults untouched
    data = json.loads(path.read_text())
    assert "not GPU-cluster" in data["demo"]["about"]
    with pytest.raises(ParamError, match="unknown demo parameter"):
        record_measurement("step_secs", 1.0, "x", path, section="demo")
    with pytest.raises(ParamError, match="unknown parameter section"):
        record_measurement("step_seconds", 1.0, "x", path, section="gpu")


def test_compare_with_demo_checks_samples_per_second():
    pred = replay_demo([], NODES, P, 4)
    measured = {
        "steps_completed": 4,
        "recoveries": {"redundant": 0},
        "samples_per_second": pred.samples_per_second * 1.25,
    }
    check = compare_with_demo(measured, pred)
    assert check.rate_error == pytest.approx(0.2) and not check.ok
    assert compare_with_demo({**measured, "samples_per_second": pred.samples_per_second}, pred).ok


def test_a_worker_lost_while_a_restart_starts_is_started_without():
    # no replicas, 0.5 s steps at depth 4, 1 s at 3: node0 dies at 0.7 -> restart of node1..3 + spare1 (depth 4),
    # training would start at 10.7; node1 dies at 5.0 while starting: the others start without it, still at
    # 10.7, at depth 3 (spare2, standby, dies at 6.0); steps 1..4 end at 11.7 .. 14.7, no second restart
    events = [
        ClusterEvent("join", "spare1", at_seconds=0.1),
        ClusterEvent("join", "spare2", at_seconds=0.1),
        kill("node0", 0.7),
        kill("node1", 5.0),
        kill("spare2", 6.0),
    ]
    pred = replay_demo(events, NODES, dataclasses.replace(P, startup_timeout_seconds=20.0), 4, redundancy=False,
                       checkpoint_every=100)
    assert pred.recoveries == {"redundant": 0, "checkpoint": 0, "restart": 1}
    assert pred.seconds == pytest.approx(14.7 + 1.0)
    assert [round(t, 1) for t, _ in pred.timeline] == [0.7, 5.0]
    assert "the others start without it (3 stages)" in pred.timeline[1][1]


def test_a_worker_lost_while_a_restart_starts_costs_the_startup_timeout_when_too_few_are_left():
    # replicas: node1 and its replica holder node0 die together at 0.7 -> restart of node2, node3 (depth 2),
    # training would start at 10.7; node3 dies at 5.0 while starting: one node cannot hold a replica, so
    # that generation waits for it until 10.7 + 20 = 30.7 and fails
    events = [kill("node0", 0.7), kill("node1", 0.7), kill("node3", 5.0)]
    pred = replay_demo(events, NODES, dataclasses.replace(P, startup_timeout_seconds=20.0, step_seconds={2: 3.0, 1: 1.0}),
                       4, checkpoint_every=100)
    assert pred.recoveries["redundant"] == 0 and pred.recoveries["checkpoint"] + pred.recoveries["restart"] == 2
    assert [round(t, 1) for t, _ in pred.timeline][:2] == [0.7, 5.0]
    assert pred.timeline[1][1].endswith("that generation fails at 30.7 s")


def test_checkpoint_restart_takes_a_joining_node_in_by_restarting():
    # c dies at 1.5 s (restart on 3 nodes, 10 s); e joins at 20 s while the pipeline is short: restart again
    trace = parse_trace(["0,add,a", "0,add,b", "0,add,c", "0,add,d", "3000,remove,c", "40000,add,e"], "t")
    events = events_from_trace(trace, NODES, time_scale=2.0)
    prediction = replay_demo(events, NODES, P, 40, redundancy=False)
    assert prediction.recoveries["checkpoint"] + prediction.recoveries["restart"] == 2
    assert [what for _, what in prediction.timeline][-1].startswith("lost []: restart 4 stages")
    with_replicas = replay_demo(events, NODES, P, 40)
    assert with_replicas.recoveries == {"redundant": 1, "checkpoint": 0, "restart": 0}  # e is admitted live instead


def test_the_simulator_imports_only_the_demos_pure_modules():
    """sim models the demo from its events and its shape, never from its command or controller."""
    import ast
    from pathlib import Path

    import lightning_bamboo.sim as sim

    for file in Path(sim.__file__).parent.glob("*.py"):
        tree = ast.parse(file.read_text())
        demo = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module and node.module.startswith("lightning_bamboo.demo")}
        assert demo <= {"lightning_bamboo.demo.events", "lightning_bamboo.demo.shape"}, (file.name, demo)
