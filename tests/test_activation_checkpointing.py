"""Activation checkpointing is exact: with dropout in every block, a 4-stage job whose stages recompute every layer's
forward in its backward ends with the weights of the same job without checkpointing, through a SIGKILL, in lazy and
eager (real processes under the Bamboo launcher, every exit code checked)."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_bamboo.testing import faults
from tests.helpers import PYTHON, REPO, launcher_exit_codes, max_abs_diff, optimizer_states, run

pytestmark = pytest.mark.timeout(300)

JOB = [PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", "4", "--", PYTHON,
       str(REPO / "tests" / "scripts" / "fit_gpt.py"), "--devices", "4", "--stages", "4", "--partition", "uniform",
       "--batch-size", "8", "--micro-batch-size", "2", "--optimizer", "adamw", "--steps", "10", "--dropout", "0.2"]


def _job(out, *extra, kill=None):
    proc = run([*JOB, *extra, "--out", str(out)], timeout=240, env=faults.environment([kill]) if kill else None)
    assert proc.returncode == 0, proc.stdout[-4000:]
    victim = kill.split("@")[0] if kill else None
    assert launcher_exit_codes(proc.stdout) == {f"node{i}": (-9 if f"node{i}" == victim else 0) for i in range(4)}
    summary = [json.JSONDecoder().raw_decode(line)[0] for line in proc.stdout.splitlines()
               if line.startswith('{"global_step"')][-1]
    return summary


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    out = tmp_path_factory.mktemp("plain")
    _job(out, "--redundancy", "lazy")
    return out


@pytest.mark.parametrize("mode, kill", [("lazy", "node2@5"), ("eager", "node1@5:6")], ids=["lazy", "eager-mid-step"])
def test_checkpointed_stages_through_a_kill_equal_the_plain_run(tmp_path, plain, mode, kill):
    summary = _job(tmp_path, "--redundancy", mode, "--activation-checkpointing", "1", kill=kill)
    (failover,) = summary["failovers"]
    assert failover["lost"] == [kill.split("@")[0]] and failover["step"] == 5
    assert max_abs_diff(torch.load(tmp_path / "final.pt"), torch.load(plain / "final.pt")) == 0.0
    assert max_abs_diff(optimizer_states(tmp_path / "final.ckpt"), optimizer_states(plain / "final.ckpt")) == 0.0
