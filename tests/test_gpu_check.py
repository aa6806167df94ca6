"""`make gpu-check`'s CPU-safe parts: benchmarks/gpu.py's arguments, its report and verdict
(``lightning_bamboo.testing.gpu_check``), and the target's refusal without CUDA.

The measurements need a GPU; what they are turned into does not. The report is a pure function of the
measured numbers, so its form is checked here against numbers made up for the purpose.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from lightning_bamboo.testing import gpu_check
from tests.helpers import REPO


def _script(name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python benchmarks/NAME.py ARGS...`` as a user runs it, its output captured."""
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / f"{name}.py"), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200", **(env or {})})

MEASURED = {
    "gpu": "NVIDIA H100 80GB HBM3", "torch": "2.13.0", "nccl": "2.27.3",
    "host_round_trip_4mib_ms": 1.234, "nccl_layer_allreduce_64mib_ms": 0.6412, "nccl_native_allreduce_64mib_ms": 0.021,
    "nccl_layer_allreduce_1mib_ms": 0.5, "nccl_native_allreduce_1mib_ms": 0.01, "nccl_layer_allreduce_256mib_ms": 1.1,
    "nccl_native_allreduce_256mib_ms": 1.0, "nccl_buffers_after_many_mib": 12.25, "nccl_reserved_growth_mib": 14.0,
    "nccl_buffers_after_trim_mib": 0.0,
    "nccl_layer_over_native": 30.533, "host_abort_s": 0.0123, "nccl_abort_s": 0.0456, "nccl_blocked_before_abort": True,
    "nccl_next_generation_s": 1.5, "step_off_ms": 101.25, "step_lazy_ms": 123.5, "lazy_over_off": 1.2198,
    "step_eager_ms": 140.0, "eager_over_off": 1.3827, "peak_off_gib": 10.5, "peak_lazy_gib": 19.25,
    "peak_eager_gib": 20.0, "stage_parameters": 523_000_000, "model_parameters": 1_000_000_000,
    "model_shape": [2048, 20], "context": 256, "tokens_per_step": 8192, "snapshot_first_s": 2.5, "snapshot_s": 0.875,
    "kill_codes": {"node0": 0, "node1": -9}, "kill_failovers": [(12, ["node1"])], "kill_step_s": 0.75,
    "exact_after_kill": True, "freeze_codes": {"node0": 0, "node1": -9}, "freeze_failovers": [(12, ["node1"])],
    "freeze_step_s": 3.5, "exact_after_freeze": True,
}


def test_arguments_default_to_10_steps_a_loss_at_step_5_and_half_a_billion_parameters_a_stage():
    shown = _script("gpu", "--help")  # the help prints each option's real default
    assert shown.returncode == 0, shown.stderr
    defaults = {m[0]: m[1] for m in re.findall(r"--([a-z-]+) [A-Z_]+\s+[^(]*\(default ([0-9.]+)", shown.stdout)}
    assert (defaults["steps"], defaults["kill-at"], defaults["budget-s"]) == ("10", "5", "300.0"), defaults
    assert (defaults["largest-width"], defaults["largest-budget-s"]) == ("4096", "420.0"), defaults
    parameters = gpu_check.gpt_parameters(int(defaults["n-embd"]), int(defaults["n-layer"]))
    assert 0.5e9 <= parameters / 2 <= 1e9  # the 0.5-1B a stage


def test_a_loss_outside_the_run_is_refused_with_the_rule():
    refused = _script("gpu", "--steps", "10", "--kill-at", "12")
    assert refused.returncode == 2
    assert "0 <= kill-at < steps (kill-at: 12, steps: 10)" in refused.stderr


def test_the_report_reads_the_measured_numbers():
    assert gpu_check.report(MEASURED, 12, skip_pipeline=False) == [
        "GPU: NVIDIA H100 80GB HBM3, torch 2.13.0, NCCL 2.27.3",
        "host transport, 4 MiB round trip between two processes on the GPU: 1.23 ms",
        "NCCL transport, all-reduce (one rank), through the layer / native (target at 64 MiB: 1.10x): 1 MiB 0.500 / "
        "0.010 ms (50.00x), 64 MiB 0.641 / 0.021 ms (30.53x), 256 MiB 1.100 / 1.000 ms (1.10x)",
        "NCCL transport, 200 all-reduces of 200 sizes (1-1.8 MiB): transfer buffers 12.2 MiB, GPU memory reserved "
        "+14.0 MiB; after a trim 0.0 MiB",
        "abort: host transport receive on a frozen peer 0.012 s, NCCL all-reduce without its peer 0.046 s (blocked "
        "before: True); next NCCL generation's first all-reduce 1.50 s",
        "pipeline, 2 stages of 0.52B parameters (stage 0) sharing the GPU, fp32, AdamW: step off 101.2 ms, lazy "
        "123.5 ms, eager 140.0 ms (lazy 1.220x, eager 1.383x); peak memory of a process off 10.50 GiB, lazy 19.25 GiB, "
        "eager 20.00 GiB",
        "snapshot of stage 0 to host memory (the asynchronous checkpoint's pause): 0.875 s (2.500 s the first, which "
        "allocates its buffers)",
        "node1 SIGKILLed at step 12: exit codes {'node0': 0, 'node1': -9}, failovers [(12, ['node1'])], that step "
        "0.75 s, final weights and AdamW state equal to the clean lazy run: True",
        "node1 frozen (SIGSTOP; detection timeout 3 s) at step 12: exit codes {'node0': 0, 'node1': -9}, failovers "
        "[(12, ['node1'])], that step 3.50 s, final weights and AdamW state equal to the clean lazy run: True",
    ]
    assert gpu_check.passed(MEASURED, skip_pipeline=False)


def test_the_report_says_what_a_replica_in_host_memory_costs_the_gpu_when_it_was_measured():
    lines = gpu_check.report({**MEASURED, "peak_lazy_host_gib": 10.75, "lazy_host_over_off_peak": 10.75 / 10.5}, 12,
                       skip_pipeline=False)
    assert lines[6] == ("lazy with the replica in pinned host memory (replica_placement='host'): peak memory of a "
                        "process 10.75 GiB, 1.024x of off's (issue 64's target: at most 1.05x)")


def test_a_number_not_measured_reads_nan_and_fails_the_check():
    partial = {k: v for k, v in MEASURED.items() if k not in ("nccl_abort_s", "exact_after_freeze")}
    lines = gpu_check.report(partial, 12, skip_pipeline=True)
    assert len(lines) == 5 and "NCCL all-reduce without its peer nan s" in lines[4]
    assert not gpu_check.passed(partial, skip_pipeline=True)  # an abort that was not timed did not pass
    assert not gpu_check.passed({**MEASURED, "exact_after_freeze": False}, skip_pipeline=False)
    assert gpu_check.passed({**MEASURED, "exact_after_freeze": False}, skip_pipeline=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_the_script_and_make_gpu_check_say_so_and_fail():
    refused = _script("gpu", "--skip-pipeline")
    assert refused.returncode == 1 and "needs a CUDA GPU" in refused.stderr, refused.stderr
    # the target's first command stops make before any test or benchmark runs (nothing is installed: no prerequisite)
    # a make of its own, also under `make test` (whose MAKEFLAGS/MAKELEVEL would make it print its directory)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    env["PYTHONPATH"] = str(REPO)
    planned = subprocess.run(["make", "--no-print-directory", "-n", "gpu-check", f"PY={sys.executable}"], cwd=REPO,
                             capture_output=True, text=True, timeout=60, env=env)
    assert planned.returncode == 0 and planned.stdout.splitlines()[0].startswith(f"{sys.executable} -c"), planned
    assert "pip" not in planned.stdout
    done = subprocess.run(["make", "--no-print-directory", "gpu-check", f"PY={sys.executable}"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0, done.stdout
    assert "make gpu-check needs a CUDA GPU (torch sees none)" in done.stderr, done.stderr
    assert "record.py" not in done.stdout.split("\n", 1)[1]  # nothing after the check ran


def test_states_are_compared_bit_for_bit_by_digest():
    """The pipeline part compares runs by a digest of every tensor's bytes: one bit of one optimizer moment tells."""
    def states(moment: torch.Tensor) -> dict:
        return {3: {"weights": {"w": torch.arange(6.0).view(2, 3)},
                    "optimizer": {"w": {"state": {"step": torch.tensor(4.0), "exp_avg": moment}}}}}

    moment = torch.linspace(-1, 1, 6).view(2, 3)
    flipped = moment.clone()
    flipped.view(-1).view(torch.int32)[2] ^= 1  # the last bit of one element
    assert gpu_check.same_states(gpu_check.digests(states(moment)), gpu_check.digests(states(moment.clone())))
    assert not gpu_check.same_states(gpu_check.digests(states(moment)), gpu_check.digests(states(flipped)))
    assert not gpu_check.same_states(gpu_check.digests(states(moment)), gpu_check.digests(states(moment.view(3, 2))))  # the shape
    assert not gpu_check.same_states({}, {})  # nothing measured is not equal


def test_the_largest_model_on_one_gpu_is_estimated_from_what_two_processes_hold_and_reported():
    """Issue 38's GPU item (``--largest``): the first try for an 80 GiB and a 141 GiB GPU, by 36 bytes a parameter
    (both processes: stage and replica at 16, autocast's bf16 copies at 2) and a fifth kept back; then its line."""
    for total in (80 * 2**30, 141 * 2**30):
        layers = gpu_check.largest_layers(total, 4096)
        fits = gpu_check.gpt_parameters(4096, layers) * gpu_check.LARGEST_BYTES_PER_PARAMETER
        assert fits <= total * (1 - gpu_check.LARGEST_RESERVE) < fits + 36 * 12 * 4096**2 * 1.01  # the most blocks that fit
        assert 0.3e9 <= gpu_check.gpt_parameters(4096, layers) <= 7e9  # the sizes
    line = gpu_check.report({**MEASURED, "largest_tried": [[16, False], [14, True]], "largest_layers": 14,
                       "largest_width": 4096, "largest_parameters": 2_887_000_000, "largest_step_ms": 912.5,
                       "largest_peak_gib": 51.25}, 12, skip_pipeline=True)[-1]
    assert line == ("largest GPT on the GPU in 2 stages sharing it, bf16, lazy, AdamW: 2.89B parameters (14 blocks x "
                    "4096), step 912.5 ms, peak memory of a process 51.25 GiB (tried: 16 blocks did not fit, 14 blocks "
                    "fit)")


def _record(tmp_path, results: dict, failed: bool = False):
    """A record as ``benchmarks/record.py`` writes it for ``make gpu-check``: header, the tests' output, gpu.py's
    JSON lines (the comm part's, then all) and its report."""
    lines = ["# command: sh -c 'pytest ...; python benchmarks/gpu.py'", "# commit: 0123456789abcdef0123456789abcdef01234567",
             "# date: 2026-12-02T10:00:00Z", "# machine: x86_64, 16 cores", "........ [100%]", "12 passed in 30.0s",
             json.dumps({"gpu": results["gpu"], "host_abort_s": 0.01}), json.dumps(results),
             *gpu_check.report(results, 5, skip_pipeline=False)]
    if failed:
        lines.append("# exit status: 1 (kept with --keep-failed: the benchmark reported a failed target)")
    path = tmp_path / "gpu_check.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_simulators_gpu_inputs_come_from_the_check_each_cited(tmp_path):
    from lightning_bamboo.sim.params import DEFAULT_PATH, describe_inputs, load_params

    params = tmp_path / "sim_params.json"
    shutil.copy(DEFAULT_PATH, params)
    before = load_params(params)
    measured = {**MEASURED, "step_off_ms": 500.0, "step_lazy_ms": 600.0, "kill_step_s": 2.1}
    written = _script("sim_gpu_inputs", "--record", str(_record(tmp_path, measured)), "--params", str(params), "--write")
    assert written.returncode == 0, written.stderr
    after = load_params(params)
    # by hand: the off run trained (6 x 1e9 + 6 x 20 x 256 x 2048) FLOPs x 8192 tokens in 0.5 s; a GPT-2 XL block's
    # micro-batch of 8 x 1024 tokens is (6 x 12 x 1600^2 + 6 x 1024 x 1600) FLOPs a token; the defaults' step is
    # (12 micro-batches + 12 stages - 1) x 4 blocks of them
    rate = (6e9 + 6 * 20 * 256 * 2048) * 8192 / 0.5
    assert after.step_seconds == pytest.approx(92 * 8 * 1024 * (6 * 12 * 1600**2 + 6 * 1024 * 1600) / rate, abs=1e-4)
    assert 1.0 < after.step_seconds < 2.0
    assert after.snapshot_seconds == pytest.approx(0.875 * 4 * 12 * 1600**2 / 523e6, abs=1e-4)
    assert after.failover_seconds == pytest.approx(1.5)
    assert after.redundancy_overhead == before.redundancy_overhead  # a shared GPU hides no redundant forward
    described = describe_inputs(after, path=params)
    for name in ("step_seconds", "snapshot_seconds", "failover_seconds"):
        assert described[name]["kind"] == "measured"
        assert f"{tmp_path / 'gpu_check.txt'} (commit 0123456, 2026-12-02T10:00:00Z, NVIDIA H100 80GB HBM3)" in \
            described[name]["source"]
    assert "step_seconds = 1.4" in written.stdout


def test_a_failed_check_or_one_without_its_pipeline_part_gives_the_simulator_nothing(tmp_path):
    from lightning_bamboo.sim.params import DEFAULT_PATH

    params = tmp_path / "sim_params.json"
    shutil.copy(DEFAULT_PATH, params)
    failed = _script("sim_gpu_inputs", "--record", str(_record(tmp_path, MEASURED, failed=True)), "--params",
                     str(params), "--write")
    assert failed.returncode == 2 and "records a failed check (1 (kept with --keep-failed" in failed.stderr
    comm_only = {k: v for k, v in MEASURED.items() if k not in ("snapshot_s", "kill_step_s")}
    partial = _script("sim_gpu_inputs", "--record", str(_record(tmp_path, comm_only)), "--params", str(params),
                      "--write")
    assert partial.returncode == 2 and "missing: snapshot_s, kill_step_s" in partial.stderr
    none = _script("sim_gpu_inputs", "--record", str(tmp_path / "none.txt"), "--params", str(params))
    assert none.returncode == 2 and "make gpu-check` on a machine with a CUDA GPU writes it" in none.stderr
    assert params.read_bytes() == DEFAULT_PATH.read_bytes()  # nothing written
