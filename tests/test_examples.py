"""examples/spot_gpt.py as its docstring runs it: under the Bamboo launcher, with a node killed mid-run."""

from __future__ import annotations

import csv
import re

import pytest

from tests.helpers import PYTHON, REPO, run

pytestmark = pytest.mark.timeout(480)


def test_spot_gpt_trains_on_after_a_kill_and_logs_the_failover(tmp_path):
    out = tmp_path / "run"
    proc = run([PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", "3", "--", PYTHON, "examples/spot_gpt.py",
                "--steps", "10", "--out", str(out), "--checkpoint-every", "5"], timeout=420,
               env={"BAMBOO_FAIL_AT": "node1@4"})  # node1's process SIGKILLs itself in step 4
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert re.search(r"exit codes: .*node1=-9", proc.stdout), proc.stdout[-2000:]
    assert {p.name for p in out.glob("*.pid")} == {"node0.pid", "node1.pid", "node2.pid"}
    assert re.search(r"^step 10: loss [\d.]+, nodes node0 node2, failovers 1$", proc.stdout, re.M), proc.stdout[-3000:]
    with open(out / "csv" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    failover = [r for r in rows if r["bamboo/failovers"] == "1.0"]
    assert len(failover) == 1, rows
    assert failover[0]["bamboo/live_nodes"] == "2.0" and 0 < float(failover[0]["bamboo/recovery_seconds"]) < 60
    assert [r["bamboo/live_nodes"] for r in rows if r["bamboo/failovers"] == "0.0"] == ["3.0"]
    assert max(int(r["step"]) for r in rows if r["train_loss"]) == 9  # logged every 5 steps up to the last
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step")), "no async checkpoint"


def test_spot_gpt_yaml_names_classes_that_exist():
    proc = run([PYTHON, "-m", "lightning_bamboo.cli", "fit", "--config", "examples/spot_gpt.yaml", "--print_config"],
               timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:]
    for name in ("AsyncCheckpoint", "PreemptionCallback", "RebalanceCallback",
                 "examples.spot_gpt.SpotGPT", "redundancy: lazy"):
        assert name in proc.stdout, (name, proc.stdout[-3000:])
