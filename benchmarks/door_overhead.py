"""Cost of redundant computation on the DeepSpeed door: a plain DeepSpeed loop through ``lightning_bamboo.initialize``.

The same GPT, shape and pairing as ``rc_overhead.py``'s paired runs, driven the way a DeepSpeed user drives it:
``lightning_bamboo.init_distributed()``, a ``PipelineModule``, ``lightning_bamboo.initialize(config=...)`` and
``engine.train_batch()`` in a loop, under the Bamboo launcher. The engine is built with ``"eager"``; after a
warm-up, "off", "lazy" and "eager" alternate step by step in the same processes (an "off" step runs without the
replica and the gradient exchange, a "lazy" step without the redundant forwards), so a drift of the machine's
speed hits the three alike. Prints the median step per mode and the ratios to "off" (target: lazy <= 1.03x, as on
the Lightning path).

    python benchmarks/door_overhead.py [--stages 2] [--micro-batches 8] [--steps 60] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MODES = ("off", "lazy", "eager")
MICRO = 2


def worker(args: argparse.Namespace) -> None:
    from common import token_dataset
    from deepspeed.pipe import PipelineModule
    from rc_overhead import CONFIG, keep_exchange

    import lightning_bamboo
    from lightning_bamboo.models.gpt import gpt_layers, gpt_loss

    lightning_bamboo.init_distributed()
    model = PipelineModule(layers=gpt_layers(CONFIG), loss_fn=gpt_loss, num_stages=args.stages,
                           partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": args.micro_batches,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "bamboo": {"redundancy": "eager"}}
    total = args.warmup + len(MODES) * args.steps
    data = token_dataset(CONFIG, total * MICRO * args.micro_batches)
    engine, _, _, _ = lightning_bamboo.initialize(model=model, training_data=data, config=config)
    stage = engine.runner.engine
    replica, peers, options = stage.replica, stage.replica_peers, stage.options
    times, modes = [], []
    for step in range(total):
        mode = "eager" if step < args.warmup else MODES[(step - args.warmup) % len(MODES)]
        # as rc_overhead.Rotate: an off step without replica and exchange, a lazy step without redundant forwards
        stage.replica, stage.replica_peers = (None, (None, None)) if mode == "off" else (replica, peers)
        keep_exchange(stage, args, mode)
        stage.options = dataclasses.replace(options, redundancy="lazy" if mode == "off" else mode)
        started = time.perf_counter()
        engine.train_batch()
        times.append(time.perf_counter() - started)
        modes.append(mode)
    if torch.distributed.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"times": times, "modes": modes}))


def paired_runs(stages: int, micro_batches: int, steps: int, warmup: int, repeats: int) -> list[dict[str, float]]:
    """``repeats`` runs of the paired worker under the Bamboo launcher: per run, the median step of each mode."""
    from common import launcher_command, launcher_env, self_command

    env = launcher_env(extra={"PYTHONWARNINGS": "ignore"})
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            out = Path(tmp, f"run{repeat}.json")
            command = self_command(__file__, "worker", "--stages", stages, "--micro-batches", micro_batches,
                                   "--steps", steps, "--warmup", warmup, "--out", out)
            subprocess.run(launcher_command(command, nodes=stages), env=env, check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=900)
            r = json.loads(out.read_text())
            pairs = list(zip(r["times"], r["modes"], strict=True))[warmup:]
            runs.append({mode: statistics.median(t for t, m in pairs if m == mode) for mode in MODES})
    return runs


def main() -> None:
    from common import add_worker_flag

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_worker_flag(parser)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60, help="steps of each mode per run")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "worker":
        return worker(args)
    runs = paired_runs(args.stages, args.micro_batches, args.steps, args.warmup, args.repeats)
    print(f"DeepSpeed door (lightning_bamboo.initialize + train_batch under the Bamboo launcher): GPT "
          f"{sum(p.numel() for layer in _layers() for p in layer.parameters()) / 1e6:.1f}M params, {args.stages} stages x "
          f"{args.micro_batches} micro-batches of {MICRO}, AdamW, CPU; off, lazy and eager alternating step by step, "
          f"{args.steps} steps of each per run, median step per mode; ratio to off per run (median of {args.repeats})")
    print(f"{'mode':>5} {'step ms':>9} {'x off':>6}  per run")
    for mode in MODES:
        ratios = [run[mode] / run["off"] for run in runs]
        print(f"{mode:>5} {statistics.median(run[mode] for run in runs) * 1e3:>9.1f} {statistics.median(ratios):>6.3f}  "
              + " ".join(f"{r:.3f}" for r in ratios))
    lazy = statistics.median(run["lazy"] / run["off"] for run in runs)
    eager = statistics.median(run["eager"] / run["off"] for run in runs)
    print(f"targets at {args.stages} stages x {args.micro_batches} micro-batches: lazy {lazy:.3f}x (<= 1.03x), "
          f"eager {eager:.3f}x (<= 1.10x)")


def _layers():
    from rc_overhead import CONFIG

    from lightning_bamboo.models.gpt import gpt_layers

    return gpt_layers(CONFIG)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
