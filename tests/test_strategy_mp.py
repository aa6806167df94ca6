"""Multi-process acceptance of the strategy: real processes on CPU (gloo), compared with plain PyTorch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import PYTHON, REPO, max_abs_diff, reference_weights, run

pytestmark = pytest.mark.timeout(300)

FIT = str(REPO / "tests" / "scripts" / "fit_gpt.py")
STEPS, BATCH, MBS = 10, 8, 2


def _fit(out, *args: str, timeout: float = 240) -> dict:
    proc = run([PYTHON, FIT, "--out", str(out), "--steps", str(STEPS), "--batch-size", str(BATCH),
                "--micro-batch-size", str(MBS), *args], timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


@pytest.fixture(scope="module")
def two_stage_run(tmp_path_factory):
    """2 stages, checkpoints every 5 steps (lightning.pytorch)."""
    out = tmp_path_factory.mktemp("two_stage")
    summary = _fit(out, "--devices", "2", "--stages", "2", "--save-every", "5")
    return out, summary


def test_two_stages_equal_single_process(two_stage_run):
    out, summary = two_stage_run
    assert summary["global_step"] == STEPS
    got = torch.load(out / "final.pt")
    assert max_abs_diff(got, reference_weights(STEPS, BATCH, 1, MBS)) <= 1e-5
    # the step-5 checkpoint is the reference after 5 steps: checkpoints hold every layer
    from lightning_bamboo import consolidate_checkpoint

    assert max_abs_diff(consolidate_checkpoint(out / "step5.ckpt"), reference_weights(5, BATCH, 1, MBS)) <= 1e-5


def test_resume_mid_epoch_is_bit_exact_in_pytorch_lightning(two_stage_run, tmp_path):
    """Save at step 5 (lightning.pytorch), resume and finish at 10 through pytorch_lightning."""
    out, _ = two_stage_run
    summary = _fit(tmp_path, "--devices", "2", "--stages", "2", "--namespace", "pytorch_lightning",
                   "--resume", str(out / "step5.ckpt"))
    assert summary["global_step"] == STEPS
    resumed, uninterrupted = torch.load(tmp_path / "final.pt"), torch.load(out / "final.pt")
    assert max_abs_diff(resumed, uninterrupted) == 0.0


def test_resume_into_more_pipelines_keeps_the_global_batch(two_stage_run, tmp_path):
    """The step-5 checkpoint of one 2-stage pipeline (4 micro-batches a step) resumed by 3 one-stage pipelines:
    the global batch stays (taken from the checkpoint), shared 2, 1, 1 micro-batches; gradients are weighted
    so that the step still averages over all 4, and the run ends where the uninterrupted one did."""
    out, _ = two_stage_run
    summary = _fit(tmp_path, "--devices", "3", "--stages", "1", "--resume", str(out / "step5.ckpt"))
    assert summary["global_step"] == STEPS
    assert max_abs_diff(torch.load(tmp_path / "final.pt"), torch.load(out / "final.pt")) <= 1e-5


def test_four_stages_equal_single_process(tmp_path):
    _fit(tmp_path, "--devices", "4", "--stages", "4", "--partition", "uniform")
    assert max_abs_diff(torch.load(tmp_path / "final.pt"), reference_weights(STEPS, BATCH, 1, MBS)) <= 1e-5


def test_two_pipelines_of_two_stages_equal_single_process(tmp_path):
    _fit(tmp_path, "--devices", "4", "--stages", "2", "--partition", "0,1,4")
    assert max_abs_diff(torch.load(tmp_path / "final.pt"), reference_weights(STEPS, BATCH, 2, MBS)) <= 1e-5


def test_deepspeed_initialize_equals_single_process(tmp_path):
    proc = run([PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29671",
                str(REPO / "tests" / "scripts" / "ds_gpt.py"), "--out", str(tmp_path)], timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert max_abs_diff(torch.load(tmp_path / "final.pt"), reference_weights(STEPS, BATCH, 1, MBS)) <= 1e-5


def test_trainer_under_torchrun_equals_single_process(tmp_path):
    """torchrun starts the processes (Lightning detects it and launches nothing itself)."""
    proc = run([PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29673", FIT,
                "--out", str(tmp_path), "--steps", str(STEPS), "--devices", "2", "--stages", "2"], timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert max_abs_diff(torch.load(tmp_path / "final.pt"), reference_weights(STEPS, BATCH, 1, MBS)) <= 1e-5


def test_cli_config_equals_single_process(tmp_path):
    config = REPO / "tests" / "scripts" / "gpt_test.yaml"
    script = Path(PYTHON).parent / "lightning-bamboo"  # the console script of the environment running the tests
    proc = run([str(script) if script.exists() else "lightning-bamboo", "fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path),
                "--trainer.callbacks.dirpath", str(tmp_path / "ckpt")], timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    from lightning_bamboo import consolidate_checkpoint

    got = consolidate_checkpoint(tmp_path / "ckpt" / f"step{STEPS}.ckpt")
    assert max_abs_diff(got, reference_weights(STEPS, BATCH, 1, MBS)) <= 1e-5


@pytest.mark.parametrize("case, devices, message", [
    ("tuple", 2, r"needs batches of the form \(inputs, targets\), got a list of length 3"),
    ("divisible", 1, r"the global batch of 6 samples .* is not a multiple of micro_batch_size 4"),
])
def test_bad_batch_fails_with_message_and_no_hang(case, devices, message):
    import re

    proc = run([PYTHON, str(REPO / "tests" / "scripts" / "bad_batch.py"), "--case", case, "--devices", str(devices)],
               timeout=180)
    errors = [json.loads(line)["error"] for line in proc.stdout.splitlines() if line.startswith('{"error"')]
    assert errors and re.search(message, errors[0]), proc.stdout[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_strategy_trains_with_nccl_in_the_communication_process(tmp_path):
    """Lightning's GPU accelerator, one process: the stage on the GPU, the job's group the abortable
    backend with NCCL in its communication process, and the weights those of the CPU reference."""
    proc = run([PYTHON, FIT, "--out", str(tmp_path), "--steps", str(STEPS), "--batch-size", str(BATCH),
                "--micro-batch-size", str(MBS), "--accelerator", "gpu", "--devices", "1", "--stages", "1"],
               timeout=300, env={"DS_ACCELERATOR": "cuda"})
    assert proc.returncode == 0, proc.stdout[-4000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    process = next(line for line in lines if "threads" in line)
    assert (process["device"], process["transport"]) == ("cuda:0", "nccl")
    assert lines[-1]["global_step"] == STEPS
    got = torch.load(tmp_path / "final.pt", map_location="cpu")
    assert max_abs_diff(got, reference_weights(STEPS, BATCH, 1, MBS)) <= 1e-3  # GPU arithmetic, not CPU's bits
