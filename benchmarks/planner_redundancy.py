"""The planner's price of the redundancy against the measured one, on the same GPT, shape and machine.

Profiles ``rc_overhead``'s GPT layer by layer (one thread per worker, AdamW, the door's micro-batch), prices
the 2-stage pipeline's ``lazy`` and ``eager`` steps with ``costmodel.redundancy_cost`` and compares the
predicted ratios to ``off`` with ``door_overhead.py``'s paired runs of the same shape (the DeepSpeed door
under the Bamboo launcher, modes alternating step by step). The model prices the replica update and the
gradient shipping (shared memory between the two processes: ``--bandwidth-gbps``) beyond the stage's
bubbles, and counts the redundant forwards eager fits in what the bubbles have left (it places them nowhere
else); it knows nothing of the engine's fixed costs per step (the commit, Python), which add to ``off`` as
much as to the others, so the predicted ratio is taken over the measured ``off`` step as well as over the
model's own.

    python benchmarks/planner_redundancy.py [--stages 2] [--micro-batches 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import door_overhead  # noqa: E402
from rc_overhead import CONFIG  # noqa: E402

from lightning_bamboo.models.gpt import gpt_layers  # noqa: E402
from lightning_bamboo.planner import Hardware, estimate_step, redundancy_cost  # noqa: E402
from lightning_bamboo.planner.profile import profile_layers  # noqa: E402


def uniform_parts(num_layers: int, stages: int) -> list[int]:
    """DeepSpeed's ``partition_method="uniform"`` (what the door's ``PipelineModule`` uses)."""
    from deepspeed.runtime.utils import partition_uniform

    return list(partition_uniform(num_layers, stages))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60, help="steps of each mode per measured run")
    parser.add_argument("--repeats", type=int, default=3, help="measured runs (median of their ratios)")
    parser.add_argument("--bandwidth-gbps", type=float, default=5.0,
                        help="GB/s of the gradient shipping (shared memory between processes of one host)")
    args = parser.parse_args()

    torch.manual_seed(0)
    layers = gpt_layers(CONFIG)
    tokens = torch.randint(0, CONFIG.vocab_size, (door_overhead.MICRO, CONFIG.block_size))
    profile = profile_layers(layers, tokens, (door_overhead.MICRO,), repeats=5, warmup=2, threads=1,
                             optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    hw = Hardware(memory_bytes=2**40, bandwidth_bytes_per_second=args.bandwidth_gbps * 1e9, latency_seconds=5e-5)
    parts = uniform_parts(profile.num_layers, args.stages)
    est = estimate_step(profile, hw, parts, door_overhead.MICRO, args.micro_batches)
    priced = {mode: redundancy_cost(profile, hw, est, door_overhead.MICRO, args.micro_batches, mode)
              for mode in door_overhead.MODES}

    runs = door_overhead.paired_runs(args.stages, args.micro_batches, args.steps, 5, args.repeats)
    off = statistics.median(run["off"] for run in runs)

    print(f"GPT {sum(layer.param_bytes for layer in profile.layers) / 4e6:.1f}M params, {args.stages} stages "
          f"{parts} x {args.micro_batches} micro-batches of {door_overhead.MICRO}, AdamW, CPU, one thread per worker; "
          f"gradients shipped at {args.bandwidth_gbps} GB/s")
    print(f"model: off step {est.step_seconds * 1e3:.1f} ms (profiled layers only; measured {off * 1e3:.1f} ms)")
    for mode in ("lazy", "eager"):
        cost = priced[mode]
        work = " ".join(f"{w * 1e3:.1f}/{i * 1e3:.1f}" for w, i in zip(cost.work_seconds, cost.idle_seconds,
                                                                         strict=True))
        print(f"  {mode}: work/idle per stage (ms) {work}; ship per stage (ms) "
              + " ".join(f"{s * 1e3:.2f}" for s in cost.ship_seconds) + f"; adds {cost.step_seconds * 1e3:.1f} ms"
              + (f"; forwards in the bubbles {list(cost.forwards)} of {args.micro_batches}" if mode == "eager" else ""))
    print(f"{'mode':>5} {'measured x off':>15} {'predicted (model step)':>23} {'predicted (measured off)':>25}")
    for mode in ("lazy", "eager"):
        measured = statistics.median(run[mode] / run["off"] for run in runs)
        added = priced[mode].step_seconds
        print(f"{mode:>5} {measured:>15.3f} {(est.step_seconds + added) / est.step_seconds:>23.3f} "
              f"{(off + added) / off:>25.3f}")


if __name__ == "__main__":
    main()
