"""Redundant computation with real processes: replicas stay exact, and SIGKILLed nodes are taken over without rollback."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import PYTHON, REPO, max_abs_diff, reference_weights, run

pytestmark = pytest.mark.timeout(300)

FIT = [str(REPO / "tests" / "scripts" / "fit_gpt.py"), "--batch-size", "8", "--micro-batch-size", "2"]


def _lines(stdout: str, key: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{") and key in line]


@pytest.mark.parametrize("stages, optimizer", [(2, "adam"), (4, "sgd")])
def test_replicas_equal_their_originals_after_every_step(tmp_path, stages, optimizer):
    proc = run([PYTHON, *FIT, "--devices", str(stages), "--stages", str(stages), "--steps", "5", "--partition", "uniform",
                "--redundancy", "lazy", "--check-replicas", "--optimizer", optimizer, "--out", str(tmp_path)], timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    checks = _lines(proc.stdout, "replica_check")
    assert [c["replica_check"] for c in checks] == [1, 2, 3, 4, 5]
    assert all(c["problems"] == [] for c in checks), checks


@pytest.mark.parametrize("kill", ["node2@7", "node3@7", "node0@7", "node2@7:5"],
                         ids=["middle", "last", "first", "mid-step"])
def test_sigkill_is_taken_over_and_weights_equal_the_run_without_it(tmp_path, kill):
    """4 stages, one node SIGKILLed at step 7 of 20: the run ends at step 20 with the clean run's weights."""
    proc = run([PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", "4", "--", PYTHON, *FIT, "--devices", "4",
                "--stages", "4", "--steps", "20", "--partition", "uniform", "--redundancy", "lazy", "--out", str(tmp_path)],
               timeout=240, env={"BAMBOO_FAIL_AT": kill})
    assert proc.returncode == 0, proc.stdout[-4000:]
    victim = kill.split("@")[0]
    assert f"{victim}=-9" in proc.stdout and "=-6" not in proc.stdout, proc.stdout[-2000:]
    summary = _lines(proc.stdout, "global_step")[-1]
    assert summary["global_step"] == 20 and summary["world_size"] == 3
    (failover,) = summary["failovers"]
    assert failover["lost"] == [victim] and failover["step"] == 7 and not failover["committed"]
    got = torch.load(tmp_path / "final.pt")
    assert max_abs_diff(got, reference_weights(20, 8, 1, 2)) <= 1e-5
