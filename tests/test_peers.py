"""The peer benchmark (benchmarks/peers.py): its slice arithmetic, and the plain DeepSpeed script it restarts,
killed after a checkpoint and resumed from it at another depth."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from lightning_bamboo.demo.events import ClusterEvent
from lightning_bamboo.membership.address import free_port
from lightning_bamboo.sim import measured
from tests.helpers import PYTHON, REPO


def test_young_daly_interval():
    # sqrt(2 x 0.05 s x 10 s) = 1 s of steps of 0.1 s; never below one step
    assert measured.young_daly(0.05, 10.0, 0.1) == 10
    assert measured.young_daly(0.001, 1.0, 10.0) == 1


def test_kills_of_running_nodes_only():
    nodes = ["node0", "node1"]
    events = [
        ClusterEvent("join", "spare1", at_seconds=0.0),  # no room: waits
        ClusterEvent("preempt", "node0", at_seconds=1.0),  # a kill; spare1 takes its place
        ClusterEvent("preempt", "spare1", at_seconds=2.0),  # a kill of the replacement
        ClusterEvent("join", "spare2", at_seconds=3.0),  # room: runs
        ClusterEvent("preempt", "spare3", at_seconds=3.5),  # never ours: no kill
        ClusterEvent("preempt", "node1", at_seconds=9.0),  # beyond the horizon
    ]
    assert measured.kills_of_running(events, nodes, width=2, horizon=5.0) == 2
    assert measured.kills_of_running(events, nodes, width=2, horizon=10.0) == 3


def test_equal_wall_time_counts_the_most_steps_finished_within_it():
    # a run that reached step 5, lost 2 steps to a restart and reached 7 later: at 3.0 s it had finished 5 steps
    lines = [{"event": "step", "step": s, "t": 100.0 + t, "pid": 1, "rank": 0}
             for s, t in ((1, 0.0), (2, 0.5), (3, 1.0), (4, 1.5), (5, 2.0))]
    lines += [{"event": "step", "step": s, "t": 100.0 + t, "pid": 2, "rank": 0} for s, t in ((4, 3.5), (5, 4.0), (6, 4.5), (7, 5.0))]
    times = measured.summarize_peer(lines, [], 7)["step_times"]
    assert times == [[1, 0.0], [2, 0.5], [3, 1.0], [4, 1.5], [5, 2.0], [6, 4.5], [7, 5.0]]
    assert measured.progress_at(times, 3.0) == 5 and measured.progress_at(times, 4.6) == 6 and measured.progress_at(times, 99) == 7
    assert measured.progress_at([], 3.0) == 0
    # its own pace: 0.5 s steps with one 2.5 s gap; 5 steps in 3 s at 0.5 s each trained for 2.5 of the 3 s
    assert measured.own_pace_ettr(times, 3.0) == 2.5 / 3.0 and measured.own_pace_ettr(times, 99) == 7 * 0.5 / 99
    assert measured.own_pace_ettr([[1, 0.0]], 3.0) != measured.own_pace_ettr([[1, 0.0]], 3.0)  # no step: NaN
    assert measured.steps_for(10.0, 0.5) == 24 and measured.steps_for(0.1, 10.0) == 1  # a fifth more than the wall needs


def _events(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x] if path.exists() else []


def _workers(world: int, tmp: Path, steps: int, port: int) -> list[subprocess.Popen]:
    """``world`` ranks of benchmarks/peer_train.py with torch's env:// variables (what torchrun gives them)."""
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PEER_NODE": f"node{rank}"}
        procs.append(subprocess.Popen(
            [PYTHON, str(REPO / "benchmarks" / "peer_train.py"), "--steps", str(steps), "--save-dir", str(tmp / "ckpt"),
             "--save-every", "2", "--events", str(tmp / "events.jsonl"), "--timeout", "30"],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
    return procs


@pytest.mark.timeout(120)
def test_peer_resumes_from_its_deepspeed_checkpoint_after_a_kill(tmp_path):
    """Two stages killed (SIGKILL) after step 3, past the checkpoint of step 2: one stage resumes at step 2, with
    the weights and not the momentum (DeepSpeed keeps the optimizer state per stage), and finishes step 5."""
    events = tmp_path / "events.jsonl"
    first = _workers(2, tmp_path, steps=50, port=free_port())
    try:
        deadline = time.monotonic() + 90
        while not any(e["event"] == "step" and e["step"] >= 3 for e in _events(events)):
            assert time.monotonic() < deadline, f"no step 3 within 90 s: {_events(events)}"
            assert all(p.poll() is None for p in first), f"a worker ended: {[p.returncode for p in first]}"
            time.sleep(0.05)
    finally:
        for p in first:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
    assert [p.returncode for p in first] == [-signal.SIGKILL, -signal.SIGKILL]
    killed_at = max(e["step"] for e in _events(events) if e["event"] == "step")
    saved = int((tmp_path / "ckpt" / "latest").read_text().strip().removeprefix("global_step"))
    assert 2 <= saved <= killed_at

    (second,) = _workers(1, tmp_path, steps=killed_at + 2, port=free_port())
    try:
        assert second.wait(timeout=90) == 0
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
            second.wait(timeout=30)
    resumed = [e for e in _events(events) if e["pid"] == second.pid]
    (loaded,) = [e for e in resumed if e["event"] == "loaded"]
    assert (loaded["step"], loaded["depth"], loaded["world"], loaded["optimizer"]) == (saved, 2, 1, "reset")
    assert [e["step"] for e in resumed if e["event"] == "step"] == list(range(saved + 1, killed_at + 3))
    assert [e["step"] for e in resumed if e["event"] == "done"] == [killed_at + 2]


def test_the_simulators_view_of_a_run_keeps_at_most_cap_nodes_running():
    events = [
        ClusterEvent("join", "spare1", at_seconds=1.0),  # beyond the cap: waits
        ClusterEvent("preempt", "node1", at_seconds=2.0),  # spare1 starts in its place
        ClusterEvent("preempt", "spare2", at_seconds=2.5),  # never started: not an event of the run
        ClusterEvent("join", "spare3", at_seconds=3.0),  # waits
        ClusterEvent("preempt", "spare3", at_seconds=4.0),  # lost while waiting: never runs
    ]
    from lightning_bamboo.sim.demo import run_trace

    trace = run_trace(events, ["node0", "node1"], cap=2, ready=0.5)
    assert [(e.ms, e.kind, e.node) for e in trace.events] == [
        (0, "add", "node0"), (0, "add", "node1"), (2500, "remove", "node1"), (2500, "add", "spare1")]


def _wall(wall: float = 100.0) -> dict:
    return {"nodes": 2, "wall": wall, "step_delay": 0.0}


def test_the_predicted_samples_of_an_undisturbed_run_are_its_steps_in_the_wall_time():
    inputs = {"policy": "elastic", "min_stages": 1, "failover_seconds": 10.0, "restart_seconds": 10.0,
              "reconfigure_seconds": 0.0, "ready": 0.0, "checkpoint_save_seconds": 0.0,
              "checkpoint_interval_seconds": 20.0, "step_seconds": 0.5}
    # 100 s of 0.5 s steps of 8 samples, and the first step's, which the run's clock starts after
    assert measured.predict_samples(inputs, [], **_wall(), cap=2) == pytest.approx(100 / 0.5 * 8 + 8)


def test_the_predicted_samples_count_the_most_the_run_had_reached_through_a_rollback():
    # the peer: saves take 0.01 s after every 20 s of training; a kill at 50 s rolls back to the save at 40 s and
    # restarts in 10 s (one node left: depth 1, a step of (4 + 0) x 8 over (4 + 1) x 4 slots: 1.6 x 0.5 s); at 55 s
    # the run had reached what it had at 50 s: 100 steps, since then 5 s (no progress beyond 100 steps yet)
    inputs = {"policy": "elastic", "min_stages": 1, "failover_seconds": 10.0, "restart_seconds": 10.0,
              "reconfigure_seconds": 0.0, "ready": 0.0, "checkpoint_save_seconds": 0.01,
              "checkpoint_interval_seconds": 20.0, "step_seconds": 0.5}
    kill = [ClusterEvent("preempt", "node1", at_seconds=50.0)]
    assert measured.predict_samples(inputs, kill, **_wall(55.0), cap=2) == pytest.approx(50 / 0.5 * 8 + 8, rel=1e-3)
    # at 100 s: 40 s kept, restarted at 60 s, 40 s at 0.8 s a step: 50 more steps
    assert measured.predict_samples(inputs, kill, **_wall(), cap=2) == pytest.approx((80 + 50) * 8 + 8, rel=1e-3)


def test_the_peers_restart_is_the_mean_recovery_that_no_other_kill_interrupted():
    # the kill at 0 s recovered at 30 s, but a kill at 10 s came first (its recovery, 25 s, holds the rest); the kill
    # at 100 s had its own restart; the kill at 200 s was never recovered from
    per_kill = [{"at": 0.0, "recovery": 30.0}, {"at": 10.0, "recovery": 25.0}, {"at": 100.0, "recovery": 20.0},
                {"at": 200.0, "recovery": None}]
    result = {"per_kill": per_kill, "recovery_seconds": [30.0, 25.0, 20.0]}
    inputs = measured.sim_inputs("torchrun", result, every=3, step=0.5, save=0.04)
    assert inputs["restart_seconds"] == pytest.approx(22.5) and inputs["policy"] == "elastic"
    assert inputs["checkpoint_interval_seconds"] == pytest.approx(1.5) and inputs["checkpoint_save_seconds"] == 0.04


def test_a_kept_run_is_reported_again_with_the_simulators_ettr(tmp_path):
    # a 2-node peer run, kept: steps of 0.5 s from t=100; node1 killed at t=130 (30 s after the first step); the
    # job that recovered started at t=131, loaded step 60 at t=160 and stepped on until t=200
    lines = [{"event": "start", "pid": 1, "t": 99.0, "rank": 0}, {"event": "loaded", "pid": 1, "t": 99.5, "rank": 0,
              "step": 0, "optimizer": "loaded", "world": 2}]
    lines += [{"event": "step", "step": s, "t": 100.0 + 0.5 * (s - 1), "pid": 1, "rank": 0} for s in range(1, 61)]
    lines += [{"event": "start", "pid": 2, "t": 131.0, "rank": 0}, {"event": "loading", "pid": 2, "t": 159.0, "rank": 0},
              {"event": "loaded", "pid": 2, "t": 160.0, "rank": 0, "step": 60,
               "optimizer": "loaded", "world": 1}]
    lines += [{"event": "step", "step": s, "t": 160.0 + 0.5 * (s - 60), "pid": 2, "rank": 0} for s in range(61, 141)]
    result = measured.summarize_peer(lines, [(130.0, "node1")], 140)
    result.update(wall=120.0, joins=0, codes={}, agent_restarts=0)
    (tmp_path / "trace.csv").write_text("0,add,a\n0,add,b\n30000,remove,b\n")
    args = {"nodes": 2, "wall": 100.0, "step_delay": 0.0, "time_scale": 1.0, "mtbf": "1m", "steps": 140,
            "run_steps": {"torchrun": 140}, "clean_steps": {"torchrun": 0.5}, "save_seconds": 0.01}
    saved = {"args": args, "trace_file": str(tmp_path / "trace.csv"), "every": 4, "results": {"torchrun": result}}
    (tmp_path / "results.json").write_text(json.dumps(saved))
    proc = subprocess.run([PYTHON, str(REPO / "benchmarks" / "peers.py"), "--from", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout
    row = next(line for line in out.splitlines() if line.startswith("torchrun") and "elastic" in line).split()
    # measured ETTR: the most steps finished 100 s after the first step, over 100 s of 0.5 s steps
    ettr = measured.progress_at(result["step_times"], 100.0) * 8 / (100.0 / 0.5 * 8)
    assert float(row[6]) == pytest.approx(ettr, abs=1e-3)
    assert float(row[4]) == pytest.approx(result["recovery_seconds"][0], abs=0.01)  # the restart the replay pauses
    error = abs(float(row[7]) - float(row[6])) / float(row[6])
    assert proc.returncode == (0 if error <= 0.15 else 1), proc.stderr[-2000:]
