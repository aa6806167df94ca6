"""bf16 and fp16 with fp32 master weights and gradient clipping, through real failovers: bit-exact against the run
without them, under the Bamboo launcher (real processes, real SIGKILLs, every exit code checked)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lightning_bamboo.testing import faults
from tests.helpers import (
    PYTHON,
    REPO,
    launcher_exit_codes,
    max_abs_diff,
    optimizer_states,
    reference_weights,
    run,
)

pytestmark = pytest.mark.timeout(300)

STEPS = 12
JOB = [PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", "4", "--", PYTHON,
       str(REPO / "tests" / "scripts" / "fit_gpt.py"), "--devices", "4", "--stages", "4", "--partition", "uniform",
       "--batch-size", "8", "--micro-batch-size", "2", "--optimizer", "adamw", "--clip", "0.5"]
BF16 = ["--precision", "bf16-mixed"]
BF16_DEEPSPEED = ["--ds-config", json.dumps({"bf16": {"enabled": True}})]
#: fp16 whose dynamic loss scale overflows at steps 5, 6 and 11 of 12 (a window of 2 clean steps doubles it past
#: the model's limit, an overflow halves it at once)
FP16 = ["--ds-config", json.dumps({"fp16": {"enabled": True, "initial_scale_power": 19, "hysteresis": 1,
                                            "loss_scale_window": 2}})]


def _job(out, *extra, steps=STEPS, kill=(), timeout=240):
    proc = run([*JOB, "--steps", str(steps), *extra, "--out", str(out)], timeout=timeout,
               env=faults.environment(list(kill)) if kill else None)
    codes = launcher_exit_codes(proc.stdout)
    victims = {k.split("@")[0] for k in kill}
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert {n: c for n, c in codes.items() if n not in victims} == {f"node{i}": 0 for i in range(4) if f"node{i}" not in victims}
    assert all(codes[v] == -9 for v in victims), codes
    lines = [json.JSONDecoder().raw_decode(line)[0] for line in proc.stdout.splitlines() if line.startswith("{")]
    summary = [line for line in lines if "global_step" in line][-1]
    steps_seen = [line for line in lines if "step_end" in line]
    return summary, steps_seen


def _distance(a, b):
    return math.sqrt(sum(float((a[k].double() - b[k].double()).square().sum()) for k in a))


@pytest.fixture(scope="module")
def bf16_clean(tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16_clean")
    summary, steps = _job(out, "--redundancy", "lazy", *BF16, "--save-every", "6")
    return out, summary, steps


def test_bf16_with_clipping_trains_in_bf16_and_clips_by_the_global_norm(bf16_clean):
    out, summary, steps = bf16_clean
    assert summary["global_step"] == STEPS and summary["failovers"] == []
    norms = [s["norm"] for s in steps]
    assert len(norms) == STEPS and all(0 < n < math.inf for n in norms)
    assert max(norms) > 0.5  # the clip (0.5) was active, and the logged norm is the one before clipping
    got = torch.load(out / "final.pt")
    fp32 = reference_weights(STEPS, 8, 1, 2, "adamw", clip=0.5)
    start = reference_weights(0, 8, 1, 2, "adamw")
    assert all(v.dtype == torch.float32 for v in got.values())  # the masters, not bf16 copies
    # bf16 was on: the weights differ from fp32 training's, by a small part of how far training moved them
    assert max_abs_diff(got, fp32) > 1e-3
    assert _distance(got, fp32) < 0.25 * _distance(fp32, start)


@pytest.mark.parametrize("mode, precision, kill", [
    ("lazy", BF16, "node2@5"),
    # eager with DeepSpeed's bf16 section instead of Lightning's flag, node1 killed mid-step, the replica audit on
    ("eager", [*BF16_DEEPSPEED, "--audit"], "node1@5:6"),
], ids=["lazy-lightning-flag", "eager-deepspeed-config"])
def test_bf16_with_clipping_survives_a_sigkill_bit_exact(tmp_path, bf16_clean, mode, precision, kill):
    clean, _, clean_steps = bf16_clean
    summary, steps = _job(tmp_path, "--redundancy", mode, *precision, kill=[kill])
    (failover,) = summary["failovers"]
    assert failover["lost"] == [kill.split("@")[0]] and failover["step"] == 5
    # with the audit: every replica equalled its owner's masters and AdamW state after every step and the rebuild
    assert summary["audits"] == (STEPS + 1 if "--audit" in precision else 0)
    assert max_abs_diff(torch.load(tmp_path / "final.pt"), torch.load(clean / "final.pt")) == 0.0
    assert max_abs_diff(optimizer_states(tmp_path / "final.ckpt"), optimizer_states(clean / "final.ckpt")) == 0.0
    assert [s["norm"] for s in steps] == [s["norm"] for s in clean_steps]  # the same global norm at every step


def _resume_on_two_nodes(checkpoint, out, *precision):
    proc = run([PYTHON, "-m", "lightning_bamboo.launcher", "--nodes", "2", "--", PYTHON,
                str(REPO / "tests" / "scripts" / "fit_gpt.py"), "--devices", "2", "--stages", "2", "--partition",
                "uniform", "--batch-size", "8", "--micro-batch-size", "2", "--optimizer", "adamw", "--clip", "0.5",
                "--steps", str(STEPS), "--redundancy", "lazy", *precision, "--resume", str(checkpoint),
                "--out", str(out)], timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert launcher_exit_codes(proc.stdout) == {"node0": 0, "node1": 0}
    return proc.stdout


def test_bf16_resumed_into_another_layout_is_bit_exact_and_into_fp32_says_so(tmp_path, bf16_clean):
    """The clean run's checkpoint of step 6 (4 stages) resumed by 2 stages on 2 nodes: the clean run's weights and
    optimizer state at step 12 (per-layer norms make the clip coefficient independent of the layout). Resumed in
    fp32 instead, it says what happens and goes on from the fp32 masters: other weights, close to bf16's."""
    clean, _, _ = bf16_clean
    _resume_on_two_nodes(clean / "step6.ckpt", tmp_path / "bf16", *BF16)
    assert max_abs_diff(torch.load(tmp_path / "bf16" / "final.pt"), torch.load(clean / "final.pt")) == 0.0
    assert max_abs_diff(optimizer_states(tmp_path / "bf16" / "final.ckpt"), optimizer_states(clean / "final.ckpt")) == 0.0
    stdout = _resume_on_two_nodes(clean / "step6.ckpt", tmp_path / "fp32")
    assert "was trained in bf16 and this run computes in fp32: it continues from the saved fp32 master weights" in stdout
    fp32, bf16 = torch.load(tmp_path / "fp32" / "final.pt"), torch.load(clean / "final.pt")
    assert 0 < max_abs_diff(fp32, bf16) and _distance(fp32, bf16) < 0.25 * _distance(bf16, reference_weights(0, 8, 1, 2))


def test_fp16_overflows_right_before_and_right_after_failovers_are_exact(tmp_path):
    """fp16 with a dynamic loss scale that overflows at steps 5, 6 and 11: node2 is killed in step 5 and node1 in step
    6, so both redone steps overflow and an overflow (step 5) falls right before the second failover. The run ends
    with the clean run's weights, optimizer state and loss scale; every overflow was skipped on every node."""
    clean, kill = tmp_path / "clean", tmp_path / "kill"
    summary, steps = _job(clean, "--redundancy", "lazy", *FP16)
    overflows = [s["step_end"] - 1 for s in steps if s["overflow"]]
    assert overflows == [5, 6, 11], steps
    killed, killed_steps = _job(kill, "--redundancy", "lazy", *FP16, kill=["node2@5", "node1@6"])
    assert [f["step"] for f in killed["failovers"]] == [5, 6] and killed["world_size"] == 2
    assert [(s["overflow"], s["scale"]) for s in killed_steps] == [(s["overflow"], s["scale"]) for s in steps]
    assert killed["loss_scale"] == summary["loss_scale"] and summary["loss_scale"]["skipped"] == 3
    assert max_abs_diff(torch.load(kill / "final.pt"), torch.load(clean / "final.pt")) == 0.0
    assert max_abs_diff(optimizer_states(kill / "final.ckpt"), optimizer_states(clean / "final.ckpt")) == 0.0
