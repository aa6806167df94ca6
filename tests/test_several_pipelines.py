"""Two pipelines that lose nodes at the same step end exactly where the same nodes leaving with a notice do.

Several pipelines are not bit-equal to their clean run once their number changes: the global batch's
micro-batch gradients are then summed in another grouping (each pipeline's share first), which moves
the last bits (``benchmarks/noise_floor.py`` measures how far that drifts). What a fault may not add is
anything beyond that regrouping: a lost or repeated sample, a step applied twice, an optimizer state
left behind. So the kill is compared with a run that regroups at the same step without any loss (the same
nodes leave with a notice): weights and every AdamW tensor bit-equal, every step on the clean run's samples, every
run exiting 0. The second pipeline is lost whole and the first loses a node: no survivor is released, so no
admission lands at a step that timing decides (four survivors would train again as two pipelines of 2 from the step
that admits the released ones, which two runs need not share).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from lightning_bamboo.testing import chaos
from tests.helpers import PYTHON, run

pytestmark = pytest.mark.timeout(600)

STEPS, AT = 24, 8


def demo(tmp_path, preempt: str) -> dict:
    proc = run([PYTHON, "-m", "lightning_bamboo.cli", "demo", "--nodes", "6", "--stages", "3", "--steps", str(STEPS),
                "--optimizer", "adamw", "--checkpoint-every", "8", "--step-delay", "0.3", "--quiet",
                "--report", str(tmp_path / "report.json"), "--save-weights", str(tmp_path / "weights.pt"),
                "--workdir", str(tmp_path / "work"), "--preempt", preempt], timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["steps_completed"] == STEPS
    work = tmp_path / "work"
    return {"report": report, "weights": torch.load(tmp_path / "weights.pt", weights_only=True),
            "optimizer": chaos.optimizer_states(chaos.final_checkpoint(work)), "samples": chaos.samples_by_step(work)}


def test_a_pipeline_and_a_node_of_the_other_killed_at_once_add_nothing_to_the_regrouping(tmp_path):
    # node i starts on stage i // 2 of pipeline i % 2: pipeline 1 is node1, node3, node5; node2 runs pipeline 0's
    # second stage (node0 holds its replica)
    lost = ["node1", "node2", "node3", "node5"]
    killed = demo(tmp_path / "kill", ",".join(f"{n}@{AT}" for n in lost))
    left = demo(tmp_path / "leave", ",".join(f"{n}@{AT - 1}:3" for n in lost))
    (failover,) = killed["report"]["failovers"]
    assert sorted(failover["lost"]) == lost and failover["old_pipelines"] == 2 and not failover["released"]
    assert failover["pipelines"] == 1 and killed["report"]["recoveries"]["redundant"] == 1
    (reference,) = left["report"]["failovers"]
    # both runs train on two pipelines up to the same step and on one after it
    assert (reference["step"], reference["pipelines"]) == (failover["step"], 1), (reference, failover)
    assert chaos.max_difference(killed["weights"], left["weights"]) == 0.0
    assert chaos.max_difference(killed["optimizer"], left["optimizer"]) == 0.0
    # every step trained once, on the same samples as the other run (the global batch, whoever trained it)
    assert chaos.sample_problems(left["samples"], killed["samples"], STEPS) == []
    assert chaos.sample_problems(killed["samples"], left["samples"], STEPS) == []


def test_a_stage_lost_in_every_pipeline_fails_each_over_and_ends_bit_equal_to_the_clean_run(tmp_path):
    """node2 and node3 run stage 1 of pipelines 0 and 1 (as a machine holding one stage of every pipeline does); both
    are killed in step 8. Both pipelines fail over alike from their replicas (node0 and node1 take stage 1 over),
    nobody is released, and the job trains as two pipelines at every step, as the clean run does: weights and every
    AdamW tensor bit-equal, every step on the clean run's samples."""
    killed = demo(tmp_path / "kill", f"node2@{AT},node3@{AT}")
    clean = demo(tmp_path / "clean", "")
    (failover,) = killed["report"]["failovers"]
    assert sorted(failover["lost"]) == ["node2", "node3"] and not failover["released"], failover
    assert (failover["old_pipelines"], failover["pipelines"]) == (2, 2), failover
    assert killed["report"]["recoveries"]["redundant"] == 1
    assert chaos.max_difference(killed["weights"], clean["weights"]) == 0.0
    assert chaos.max_difference(killed["optimizer"], clean["optimizer"]) == 0.0
    assert chaos.sample_problems(clean["samples"], killed["samples"], STEPS) == []


def test_released_nodes_stand_by_in_their_processes_and_come_back_as_a_pipeline(tmp_path):
    """Three pipelines of two stages (a user's Lightning script under the launcher, ``RebalanceCallback``): node1
    and node2, each of another pipeline, are SIGKILLed in step 8. Their pipelines are dropped and their survivors
    released; each stands by in its own process (no exec: the launcher started each worker once) and the rebalancer
    admits the two back as a second pipeline. Every worker but the killed ones exits 0."""
    from lightning_bamboo.testing import faults
    from tests.helpers import launcher_exit_codes

    proc = run([PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", "6", "--", PYTHON, "benchmarks/spot_user.py",
                "--stages", "2", "--steps", "40", "--out", str(tmp_path)], timeout=400,
               env=faults.environment(["node1@8", "node2@8"]))
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert launcher_exit_codes(proc.stdout) == {"node0": 0, "node1": -9, "node2": 0, "node3": 0, "node4": 0,
                                                "node5": 0} | {"node2": -9}, proc.stdout[-3000:]
    released = sorted(set(re.findall(r"(node\d): released at step 8 .* it stands by in its process", proc.stdout)))
    assert len(released) == 2, proc.stdout[-4000:]
    for node in released:
        assert len(re.findall(rf"\[launcher\] {node}: pid \d+", proc.stdout)) == 1  # started once: no new process
        assert re.search(rf"{node}: admitted as rank \d of 4 at step \d+", proc.stdout), proc.stdout[-4000:]
    records = [json.loads(line) for path in tmp_path.glob("steps-*.jsonl") for line in path.read_text().splitlines()]
    assert max(len(r["nodes"]) for r in records if r["step"] > 8) == 4  # two pipelines again, with both
    assert {"node4", "node5"} <= {n for r in records if r["step"] > 8 for n in r["nodes"]} | set(released)
    assert "training_step is not called" not in proc.stdout.split("released at step 8", 1)[1]  # said at the start only
