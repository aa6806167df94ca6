"""Redundant computation with real processes: replicas stay exact, and SIGKILLed nodes are taken over without rollback."""

from __future__ import annotations

import json
import re

import pytest
import torch

from lightning_bamboo import consolidate_checkpoint
from lightning_bamboo.schedule import Costs, build_schedule
from lightning_bamboo.testing import faults
from tests.helpers import (
    PYTHON,
    REPO,
    launch_beside_a_standby_machine,
    launcher_exit_codes,
    max_abs_diff,
    optimizer_states,
    reference_weights,
    run,
)

pytestmark = pytest.mark.timeout(300)

FIT = [str(REPO / "tests" / "scripts" / "fit_gpt.py"), "--batch-size", "8", "--micro-batch-size", "2"]


def _lines(stdout: str, key: str) -> list[dict]:
    # raw_decode: another process's log line may follow a JSON line on the same line (one pipe for all)
    return [json.JSONDecoder().raw_decode(line)[0] for line in stdout.splitlines() if line.startswith("{") and key in line]


@pytest.mark.parametrize("stages, optimizer, mode", [(2, "adam", "lazy"), (4, "sgd", "lazy"), (2, "sgd", "eager")])
def test_replicas_equal_their_originals_after_every_step(tmp_path, stages, optimizer, mode):
    proc = run([PYTHON, *FIT, "--devices", str(stages), "--stages", str(stages), "--steps", "5", "--partition", "uniform",
                "--redundancy", mode, "--check-replicas", "--optimizer", optimizer, "--out", str(tmp_path)], timeout=240,
               env={"BAMBOO_LOG_LEVEL": "INFO"})  # where eager's forwards went is an INFO record
    assert proc.returncode == 0, proc.stdout[-4000:]
    checks = _lines(proc.stdout, "replica_check")
    assert [c["replica_check"] for c in checks] == [1, 2, 3, 4, 5]
    assert all(c["problems"] == [] for c in checks), checks
    assert all(c["kept_after_commit"] == [False] * stages for c in checks), checks  # freed when the step commits
    # one host: every stage's gradients go through its holder's shared buffer from the first step on, the owner
    # having taken the offer at its first ship (and the replicas above are still exact)
    assert [c["shared_memory"] for c in checks] == [[True] * stages] * 5, checks
    # from the second step on (once the optimizer was seen to leave its gradients alone, at the first), every stage
    # but the last wrote its gradients there before its last backward, which accumulated into them in place: its
    # ship copied nothing (``GradientExchange.write_ahead``)
    assert [c["written_ahead"] for c in checks] == [[n] * (stages - 1) + [0] for n in range(5)], checks
    # eager: each rank ran the successor's forwards the schedule places in its bubbles, every step; lazy: none.
    # Steps 1-4 place them with the model's costs (F = 1, B = 2) while each rank times its own forwards
    # and backwards; step 5 with the measured ratio, as each rank logged.
    per_step = [len(build_schedule(stages, 4, "eager").redundant_forwards(r)) if mode == "eager" else 0
                for r in range(stages)]
    ran = [c["redundant_forwards"] for c in checks]
    assert ran[:4] == [[n * step for n in per_step] for step in range(1, 5)]
    measured = {int(rank): (float(b), int(n), int(model)) for rank, b, n, model in re.findall(
        r"rank (\d+): eager RFs placed with measured costs F = 1, B = ([\d.]+): (\d+) per step \(the model's F = 1, "
        r"B = 2: (\d+)\)", proc.stdout)}
    if mode == "eager":
        assert sorted(measured) == list(range(stages)), proc.stdout[-3000:]
        for rank, (ratio, n, model) in measured.items():
            costs = Costs(forward=1, backward=ratio)
            assert n == len(build_schedule(stages, 4, "eager", costs=costs).redundant_forwards(rank))
            assert model == per_step[rank] and ran[4][rank] - ran[3][rank] == n
        assert sum(per_step) > 0
    else:
        assert measured == {} and ran[4] == [0] * stages
    if mode == "eager":
        # the forwards run in the bubbles change nothing: the same weights as a single process
        assert max_abs_diff(torch.load(tmp_path / "final.pt"), reference_weights(5, 8, 1, 2, optimizer)) <= 1e-5


@pytest.mark.parametrize("kill, mode, reused", [
    ("node2@7", "lazy", {}), ("node3@7", "lazy", {}), ("node0@7", "lazy", {}), ("node2@7:5", "lazy", {}),
    # eager: node2 dies after node1 ran the RF of micro-batches 0-2 of stage 2 (schedule step 6 of 14)
    ("node2@7:8", "eager", {"node1": 3}),
    # node0 dies when every RF is done: node3 takes stage 0, node2 stage 3, both from kept forwards
    ("node0@7:13", "eager", {"node3": 4, "node2": 4}),
], ids=["middle", "last", "first", "mid-step", "eager-mid-step", "eager-first"])
def test_sigkill_is_taken_over_and_weights_equal_the_run_without_it(tmp_path, kill, mode, reused):
    """4 stages, one node SIGKILLed at step 7 of 20: the run ends at step 20 with the clean run's weights."""
    proc = run([PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", "4", "--", PYTHON, *FIT, "--devices", "4",
                "--stages", "4", "--steps", "20", "--partition", "uniform", "--redundancy", mode, "--out", str(tmp_path),
                "--rf-costs", "1,2"],  # the kill points below name schedule steps of the model's placement
               timeout=240, env=faults.environment([kill]))
    assert proc.returncode == 0, proc.stdout[-4000:]
    victim = kill.split("@")[0]
    assert f"{victim}=-9" in proc.stdout and "=-6" not in proc.stdout, proc.stdout[-2000:]
    summary = _lines(proc.stdout, "global_step")[-1]
    assert summary["global_step"] == 20 and summary["world_size"] == 3
    (failover,) = summary["failovers"]
    assert failover["lost"] == [victim] and failover["step"] == 7 and not failover["committed"]
    got = torch.load(tmp_path / "final.pt")
    assert max_abs_diff(got, reference_weights(20, 8, 1, 2)) <= 1e-5
    found = dict(re.findall(r"(node\d): the redone step reused (\d+) of", proc.stdout))
    assert {node: int(n) for node, n in found.items()} == reused
    for node, n in reused.items():
        assert f"{node}: the redone step reused {n} of {n} kept redundant forwards" in proc.stdout
        assert f"and ran {n} lazy backwards through them" in proc.stdout


@pytest.mark.parametrize("lost", ["node0"])
def test_a_node_lost_while_the_job_starts_is_started_without(tmp_path, lost):
    """``lost`` registers and is SIGKILLed before the first rendezvous: the three others start a 3-stage
    pipeline at once (no restart, no wait for a timeout) and train to the end; nothing had trained, so
    the weights equal the clean run's. node0 is the worker the launcher starts first, alone until it is past its
    checks: killed then, the launcher starts the others without it (another node: ``tests/test_doors.py``, on both
    doors)."""
    proc = run([PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", "4", "--", PYTHON, *FIT, "--devices", "4",
                "--stages", "4", "--steps", "6", "--partition", "uniform", "--redundancy", "lazy", "--out", str(tmp_path)],
               timeout=240, env=faults.environment([f"{lost}@start"]))
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert launcher_exit_codes(proc.stdout) == {f"node{i}": -9 if f"node{i}" == lost else 0 for i in range(4)}
    assert "injected SIGKILL at step start" in proc.stdout
    for node in sorted({"node0", "node1", "node2", "node3"} - {lost}):
        assert f"{node}: ['{lost}'] died while the job started; starting with 3 nodes" in proc.stdout
    summary = _lines(proc.stdout, "global_step")[-1]
    assert summary["global_step"] == 6 and summary["world_size"] == 3 and summary["failovers"] == []
    assert max_abs_diff(torch.load(tmp_path / "final.pt"), reference_weights(6, 8, 1, 2)) <= 1e-5


def test_a_node_lost_in_a_checkpoint_save_is_failed_over_and_the_save_redone(tmp_path):
    """node2 is SIGKILLed inside the checkpoint save after step 8, between two of its collectives: the
    survivors fail the same collective, fail over, save again in the 3-stage layout and train to the end
    with the clean run's weights; the checkpoint of step 8 is complete."""
    proc = run([PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", "4", "--", PYTHON, *FIT, "--devices", "4",
                "--stages", "4", "--steps", "12", "--partition", "uniform", "--redundancy", "lazy", "--save-every", "4",
                "--out", str(tmp_path)],
               timeout=240, env=faults.environment(["node2@save8"]))
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "node2=-9" in proc.stdout and "injected SIGKILL at step save8" in proc.stdout
    summary = _lines(proc.stdout, "global_step")[-1]
    assert summary["global_step"] == 12 and summary["world_size"] == 3
    (failover,) = summary["failovers"]
    assert failover["lost"] == ["node2"] and failover["step"] == 8 and not failover["redone"]  # between steps
    assert max_abs_diff(torch.load(tmp_path / "final.pt"), reference_weights(12, 8, 1, 2)) <= 1e-5
    saved = consolidate_checkpoint(tmp_path / "step8.ckpt")
    assert max_abs_diff(saved, reference_weights(8, 8, 1, 2)) <= 1e-5


def test_a_node_killed_while_its_async_checkpoint_is_written_is_failed_over_and_the_checkpoint_abandoned(tmp_path):
    """AsyncCheckpoint every 4 steps; node2 is SIGKILLed in its writer thread, after the first layer file of the
    step-4 checkpoint (the training thread has moved on). The survivors fail over, give up that checkpoint (its
    writers changed; it never becomes a checkpoint), save steps 8 and 12 in the 3-stage layout, and end with
    the clean run's weights; each committed checkpoint holds the clean run's weights at its step."""
    from lightning_bamboo import checkpoint as ckpt

    proc = run([PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", "4", "--", PYTHON, *FIT, "--devices", "4",
                "--stages", "4", "--steps", "12", "--partition", "uniform", "--redundancy", "lazy", "--async-every", "4",
                "--out", str(tmp_path)],
               timeout=240, env=faults.environment(["node2@asyncwrite4"]))
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "node2=-9" in proc.stdout and "injected SIGKILL at step asyncwrite4" in proc.stdout
    summary = _lines(proc.stdout, "global_step")[-1]
    assert summary["global_step"] == 12 and summary["world_size"] == 3
    assert [f["lost"] for f in summary["failovers"]] == [["node2"]]
    assert max_abs_diff(torch.load(tmp_path / "final.pt"), reference_weights(12, 8, 1, 2)) <= 1e-5
    committed = ckpt.complete_checkpoints(tmp_path / "async")
    assert [p.name for p in committed] == [ckpt.step_name(8), ckpt.step_name(12)]
    for path, step in zip(committed, (8, 12), strict=True):
        assert max_abs_diff(consolidate_checkpoint(path), reference_weights(step, 8, 1, 2)) <= 1e-5


def test_a_checkpoint_whose_writer_a_standby_replaced_in_an_equal_layout_is_abandoned_not_waited_for(tmp_path):
    """``benchmarks/spot_user.py`` (``AsyncCheckpoint`` every 4 steps, ``RebalanceCallback``), 2 stages, and a third
    machine standing by. node1 is SIGKILLed in its writer thread of the step-4 checkpoint; node0 takes its stage
    over, and the rebalancer admits node2 in its place: the same world size and layout as the snapshot's, other
    writers. The step-4 checkpoint is given up at the next save (node1's shard will never come), not waited for for
    the commit timeout while node2 waits for node0 in the save's collective and gives up the job; the run ends with
    the clean run's weights and optimizer state, and every later checkpoint is committed."""
    from lightning_bamboo import checkpoint as ckpt
    steps = 16
    script = [PYTHON, str(REPO / "benchmarks" / "spot_user.py"), "--stages", "2", "--steps", str(steps),
              "--checkpoint-every", "4"]
    # every worker computes with one thread, wherever it runs: the standby machine's launcher would give its one
    # worker every core, and a matrix product summed over other threads rounds otherwise
    one_thread = {"OMP_NUM_THREADS": "1"}
    clean = run([PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", "2", "--", *script, "--out", str(tmp_path / "clean")],
                timeout=240, env=one_thread)
    assert clean.returncode == 0, clean.stdout[-4000:]
    proc, standby = launch_beside_a_standby_machine(
        "replaced", 2, "node2", [*script, "--out", str(tmp_path / "out")], standby_env=one_thread,
        env={**one_thread, **faults.environment(["node1@asyncwrite4"])})
    joined = standby.stdout
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert launcher_exit_codes(proc.stdout) == {"node0": 0, "node1": -9}, proc.stdout[-3000:]
    assert standby.returncode == 0, joined[-4000:]
    assert "injected SIGKILL at step asyncwrite4" in proc.stdout
    assert "node2: admitted as rank 1 of 2" in joined, joined[-3000:]
    assert "abandoning asynchronous checkpoint" in proc.stdout and "Traceback" not in proc.stdout + joined
    committed = [p.name for p in ckpt.complete_checkpoints(tmp_path / "out" / "checkpoints")]
    assert ckpt.step_name(4) not in committed and ckpt.step_name(steps) in committed, committed
    assert max_abs_diff(consolidate_checkpoint(tmp_path / "out" / "final"),
                        consolidate_checkpoint(tmp_path / "clean" / "final")) == 0.0
    assert max_abs_diff(optimizer_states(tmp_path / "out" / "final"),
                        optimizer_states(tmp_path / "clean" / "final")) == 0.0


def test_a_resumed_job_keeps_its_replicas_exact_and_a_kill_after_it_is_bit_exact(tmp_path):
    """4 stages, lazy, Adam with a learning rate that decays at every step: a clean run of 8 steps saves at step
    3; a second run resumes from it and node2 is SIGKILLed at step 5. Every replica equals its original after
    every step of the resumed run (a replica rebuilt from the seed instead of the checkpoint is what a failover
    would train on), and the run ends with the clean run's weights and optimizer state, bit for bit."""
    clean, resumed = tmp_path / "clean", tmp_path / "resumed"
    job = [PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", "4", "--", PYTHON, *FIT, "--devices", "4", "--stages",
           "4", "--steps", "8", "--partition", "uniform", "--redundancy", "lazy", "--optimizer", "adam", "--lr-decay", "0.8"]
    proc = run([*job, "--save-every", "3", "--out", str(clean)], timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    proc = run([*job, "--resume", str(clean / "step3.ckpt"), "--check-replicas", "--audit", "--out", str(resumed)], timeout=240,
               env=faults.environment(["node2@5"]))
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "node2=-9" in proc.stdout, proc.stdout[-2000:]
    checks = _lines(proc.stdout, "replica_check")
    assert [c["replica_check"] for c in checks][:2] == [4, 5] and all(c["problems"] == [] for c in checks), checks
    summary = _lines(proc.stdout, "global_step")[-1]
    (failover,) = summary["failovers"]
    assert failover["lost"] == ["node2"] and failover["step"] == 5
    # the replica audit passed on resuming, after each of steps 3-7 and after the failover's rebuild
    assert summary["audits"] == 1 + 5 + 1, summary
    assert max_abs_diff(torch.load(resumed / "final.pt"), torch.load(clean / "final.pt")) == 0.0
    assert max_abs_diff(optimizer_states(resumed / "final.ckpt"), optimizer_states(clean / "final.ckpt")) == 0.0


def test_the_replica_audit_stops_the_run_naming_layer_step_and_node(tmp_path):
    """Two stages under Lightning's launcher with audit_replicas=True: rank 1 changes one weight of its replica
    (of stage 0) before step 2; the audit after that step stops both processes with an error that names it."""
    proc = run([PYTHON, *FIT, "--devices", "2", "--stages", "2", "--steps", "4", "--partition", "uniform",
                "--redundancy", "lazy", "--optimizer", "adam", "--audit", "--perturb-replica", "2:1",
                "--out", str(tmp_path)], timeout=240)
    assert proc.returncode != 0
    assert "ReplicaAuditError: replica audit failed" in proc.stdout, proc.stdout[-3000:]
    assert "after step 2: rank 1's replica of stage 0 (run by rank 0): layer 0 weights/" in proc.stdout, proc.stdout[-3000:]
    assert "after step 1" not in proc.stdout  # steps 0 and 1 passed
