"""HydrozoaTuner with the real BambooStrategy: 4 processes on CPU (gloo), compared with plain PyTorch.

One Lightning run (tests/scripts/tuner_fit.py): the strategy is left at its defaults (4 stages,
micro-batch 1, DeepSpeed's 'parameters' split) and the module's batch at 1; the memory limit
admits no single-stage layout. The tuner must replace all of that before the engine exists.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.helpers import PYTHON, REPO, max_abs_diff, reference_weights, run

pytestmark = pytest.mark.timeout(300)

SCRIPT = str(REPO / "tests" / "scripts" / "tuner_fit.py")
DEVICES, STEPS, GLOBAL_BATCH = 4, 4, 8
LOGGED = re.compile(
    r"HydrozoaTuner: (\d+) pipeline\(s\) x (\d+) stage\(s\), micro-batch (\d+) x (\d+), "
    r"batch (\d+) per pipeline \((\d+) per step\), partition \[([\d, ]+)\]"
)


@pytest.fixture(scope="module")
def tuned_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tuner")
    proc = run([PYTHON, SCRIPT, "--out", str(out), "--devices", str(DEVICES), "--steps", str(STEPS),
                "--global-batch", str(GLOBAL_BATCH), "--memory-bytes", str(2**19)], timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    ranks = {}
    for path in out.glob("rank*.json"):
        record = json.loads(path.read_text())
        ranks[record["rank"]] = record
    return out, proc.stdout, ranks


def test_every_rank_applies_the_plan_rank0_logged(tuned_run):
    _, stdout, ranks = tuned_run
    assert sorted(ranks) == list(range(DEVICES))
    logged = LOGGED.findall(stdout)
    assert len(logged) == 1, stdout[-3000:]  # rank 0 logs it, once
    pipelines, stages, mbs, m, per_pipeline, per_step = (int(x) for x in logged[0][:6])
    partition = [int(x) for x in logged[0][6].split(",")]
    plan = ranks[0]["plan"]
    # one plan, measured on rank 0 and broadcast: every rank holds it to the last timing digit
    assert all(ranks[r]["plan"] == plan for r in ranks)
    assert (plan["pipelines"], plan["stages"], plan["micro_batch_size"], plan["micro_batches"],
            plan["partition"]) == (pipelines, stages, mbs, m, partition)
    assert stages >= 2, "the memory limit admits no single-stage layout"
    for record in ranks.values():
        assert record["layout"] == {"stages": stages, "pipelines": pipelines, "parts": partition,
                                    "micro_batch_size": mbs}
        # every node loads the step's global batch (the plan's batch per pipeline x pipelines); the engine
        # runs its pipeline's share as m micro-batches of mbs
        assert record["batches"] == [[per_pipeline * pipelines, m, mbs]] * STEPS
    assert per_pipeline * pipelines == per_step == GLOBAL_BATCH  # global batch fixed


def test_tuned_run_equals_single_process(tuned_run):
    out, _, ranks = tuned_run
    plan = ranks[0]["plan"]
    per_pipeline = plan["micro_batch_size"] * plan["micro_batches"]
    expected = reference_weights(STEPS, per_pipeline, plan["pipelines"], plan["micro_batch_size"])
    got = torch.load(out / "final.pt")
    assert max_abs_diff(got, expected) <= 1e-5
    # the tuner's batch matters: one sample per pipeline (the module's own setting) trains other weights
    assert max_abs_diff(got, reference_weights(STEPS, 1, plan["pipelines"], 1)) > 1e-3
