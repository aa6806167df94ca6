"""The simulator's GPU inputs from ``make gpu-check``'s record, each cited (issue 39).

    python benchmarks/sim_gpu_inputs.py            # what benchmarks/results/gpu_check.txt gives the simulator
    python benchmarks/sim_gpu_inputs.py --write    # and record it in lightning_bamboo/data/sim_params.json

The check measures a 2-stage GPT (``benchmarks/gpu.py``: about 0.52B parameters a stage, fp32, AdamW) whose two
processes share one GPU; the simulated job has GPT-2 XL's blocks (width 1600, 1024 positions), ``layers`` of them
over ``stages`` nodes of a GPU each. Taken from the check:

- ``step_seconds``: the ``off`` run's training rate on the GPU in FLOP/s (``6N + 6 n_layer n_ctx d`` a token,
  Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section 2.1; both stages' work in one step)
  carried over to the simulated step: its layer-slots (``sim.model.reference_slots``) of one GPT-2 XL block's
  forward and backward of one micro-batch;
- ``snapshot_seconds``: the second snapshot of stage 0 to host memory (the asynchronous checkpoint's pause, its
  buffers reused), scaled by the simulated stage's parameters over the check's (a copy's time follows its bytes);
- ``failover_seconds``: the step in which node1 was SIGKILLed less a ``lazy`` step (the loss seen, the pipeline
  rebuilt, that step's work redone), on the check's model.

Not taken: ``redundancy_overhead``. Two stages share the check's GPU, so its pipeline has no idle bubbles to hide
the redundant forward in (``benchmarks/gpu.py`` says so); the CPU measurement stays. Prices are not measured: they
stay the defaults' (p3), and ``step_seconds``' source names the GPU it comes from.

A record of a failed check (its last line ``# exit status: N``) or one without the pipeline part is refused.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lightning_bamboo.sim.model import reference_slots  # noqa: E402
from lightning_bamboo.sim.params import DEFAULT_PATH, SimParams, load_params, record_measurement  # noqa: E402

RECORD = REPO / "benchmarks" / "results" / "gpu_check.txt"
#: GPT-2 XL's width and positions (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners",
#: Table 2 and section 2.3)
GPT2_XL_WIDTH, GPT2_CONTEXT = 1600, 1024
#: what the check's last JSON line must hold for these inputs (``benchmarks/gpu.py``'s pipeline part)
NEEDED = ("gpu", "step_off_ms", "step_lazy_ms", "model_parameters", "model_shape", "context", "tokens_per_step",
          "stage_parameters", "snapshot_s", "kill_step_s")


class RecordError(ValueError):
    """The record cannot give the simulator its inputs (missing, failed, or without the pipeline part)."""


def read_record(path: Path) -> tuple[dict[str, str], dict]:
    """The record's ``# key: value`` header (``benchmarks/record.py``'s) and ``benchmarks/gpu.py``'s last JSON line."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise RecordError(f"cannot read {path}: {exc}; `make gpu-check` on a machine with a CUDA GPU writes it") from None
    header, results = {}, None
    for line in text.splitlines():
        if line.startswith("# ") and ": " in line:
            key, _, value = line[2:].partition(": ")
            header[key] = value
        elif line.startswith("{"):
            try:
                found = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(found, dict) and "gpu" in found:
                results = found
    if "exit status" in header:
        raise RecordError(f"{path} records a failed check ({header['exit status']}): a failover was not exact or an "
                          "abort was slow; its numbers do not feed the simulator until the check passes")
    if results is None or (missing := [k for k in NEEDED if k not in results]):
        raise RecordError(f"{path} holds no pipeline measurements of benchmarks/gpu.py (missing: "
                          f"{'all' if results is None else ', '.join(missing)}); run `make gpu-check`, which runs "
                          "its pipeline part")
    if "commit" not in header:
        raise RecordError(f"{path} has no '# commit:' line: it was not written by benchmarks/record.py")
    return header, results


def flops_per_token(parameters: float, n_layer: int, context: int, width: int) -> float:
    """Training FLOPs a token (forward and backward): ``6N + 6 n_layer n_ctx d`` (Kaplan et al. 2020)."""
    return 6 * parameters + 6 * n_layer * context * width


def inputs(header: dict[str, str], results: dict, params: SimParams,
           record: Path = RECORD) -> dict[str, tuple[float, str]]:
    """``name -> (value, source)`` for the simulator's inputs that the check measures (``record``: where the check's
    output is kept, named in each source)."""
    name = record.resolve().relative_to(REPO) if record.resolve().is_relative_to(REPO) else record
    where = f"{name} (commit {header['commit'][:7]}, {header.get('date', 'undated')}, {results['gpu']})"
    width, n_layer = results["model_shape"]
    rate = (flops_per_token(results["model_parameters"], n_layer, results["context"], width)
            * results["tokens_per_step"] / (results["step_off_ms"] / 1e3))
    block = 12 * GPT2_XL_WIDTH**2  # a block's weights: attention 4 d^2, the MLP 8 d^2
    slot = params.micro_batch_size * GPT2_CONTEXT * flops_per_token(block, 1, GPT2_CONTEXT, GPT2_XL_WIDTH) / rate
    slots = reference_slots(params)
    stage = math.ceil(params.layers / params.stages) * block
    lazy_s = results["step_lazy_ms"] / 1e3
    return {
        "step_seconds": (slots * slot, (
            f"derived from {where}: the off run trained {rate / 1e12:.1f} TFLOP/s (6N + 6 n_layer n_ctx d a token, "
            f"Kaplan et al. 2020; a GPT of {results['model_parameters'] / 1e9:.2f}B parameters, 2 stages sharing the "
            f"GPU, fp32), here {slots:g} layer-slots of a GPT-2 XL block (width {GPT2_XL_WIDTH}, {GPT2_CONTEXT} "
            f"positions) at micro-batch {params.micro_batch_size}, {slot * 1e3:.1f} ms each; on that GPU, not on "
            "the defaults' p3 (their prices stay)")),
        "snapshot_seconds": (results["snapshot_s"] * stage / results["stage_parameters"], (
            f"derived from {where}: a stage of {results['stage_parameters'] / 1e9:.2f}B parameters snapshotted to "
            f"host memory in {results['snapshot_s']:.3f} s (buffers reused), scaled to a stage of "
            f"{stage / 1e9:.3f}B (its bytes)")),
        "failover_seconds": (max(0.0, results["kill_step_s"] - lazy_s), (
            f"measured in {where}: the step in which node1 was SIGKILLed ({results['kill_step_s']:.2f} s) less a lazy "
            f"step ({lazy_s:.3f} s), a 2-stage GPT of {results['stage_parameters'] / 1e9:.2f}B parameters a stage")),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--record", type=Path, default=RECORD, help="the check's record (default: %(default)s)")
    parser.add_argument("--params", type=Path, default=DEFAULT_PATH, help="the parameter file (default: %(default)s)")
    parser.add_argument("--write", action="store_true", help="record the inputs in the parameter file")
    args = parser.parse_args(argv)
    try:
        header, results = read_record(args.record)
    except RecordError as exc:
        print(f"sim_gpu_inputs.py: {exc}", file=sys.stderr)
        return 2
    found = inputs(header, results, load_params(args.params), args.record)
    for name, (value, source) in found.items():
        print(f"{name} = {value:.4g}  ({source})")
        if args.write:
            record_measurement(name, round(value, 4), source, args.params)
    if args.write:
        print(f"recorded in {args.params}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
