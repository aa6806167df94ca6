"""Two pipelines that each lose a node at the same step end exactly where the same pipelines leaving with a notice do.

Several pipelines are not bit-equal to their clean run once their number changes: the global batch's
micro-batch gradients are then summed in another grouping (each pipeline's share first), which moves
the last bits (``benchmarks/noise_floor.py`` measures how far that drifts). What a fault may not add is
anything beyond that regrouping: a lost or repeated sample, a step applied twice, an optimizer state
left behind. So the kill is compared with a run that regroups at the same step without any loss (the
second pipeline leaves whole, with a notice): weights and every AdamW tensor bit-equal, every step on the clean
run's samples, every run exiting 0.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.helpers import PYTHON, REPO, run

sys.path.insert(0, str(REPO / "benchmarks"))
import chaos  # noqa: E402

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


def test_a_node_of_every_pipeline_killed_at_once_adds_nothing_to_the_regrouping(tmp_path):
    # node i starts on stage i // 2 of pipeline i % 2: node2 and node3 run the second stage of each pipeline
    killed = demo(tmp_path / "kill", f"node2@{AT},node3@{AT}")
    left = demo(tmp_path / "leave", f"node1@{AT - 1}:3,node3@{AT - 1}:3,node5@{AT - 1}:3")  # pipeline 1, whole
    (failover,) = killed["report"]["failovers"]
    assert sorted(failover["lost"]) == ["node2", "node3"] and failover["old_pipelines"] == 2
    assert failover["pipelines"] == 1 and killed["report"]["recoveries"]["redundant"] == 1
    (reference,) = left["report"]["failovers"]
    # both runs train on two pipelines up to the same step and on one after it
    assert (reference["step"], reference["pipelines"]) == (failover["step"], 1), (reference, failover)
    assert chaos.max_difference(killed["weights"], left["weights"]) == 0.0
    assert chaos.max_difference(killed["optimizer"], left["optimizer"]) == 0.0
    # every step trained once, on the same samples as the other run (the global batch, whoever trained it)
    assert chaos.sample_problems(left["samples"], killed["samples"], STEPS) == []
    assert chaos.sample_problems(killed["samples"], left["samples"], STEPS) == []
