"""What the Lightning layer costs: raw DeepSpeed pipeline loop vs Trainer(strategy="bamboo").

Both runs train the same GPT (2 stages, 2 processes, same batch and micro-batching, same
DataLoader) and time the same steady-state steps (after warm-up). Prints samples/s of each and
the ratio. Target: the Lightning layer costs <= 3% on a model whose step takes >= 50 ms.

    python benchmarks/strategy_overhead.py [--steps 30] [--warmup 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import BenchGPT, add_worker_flag, self_command, token_dataset

from lightning_bamboo.models.gpt import GPTConfig, gpt_layers, gpt_loss

# Big enough that one step takes well over 50 ms on a 2-core CPU.
CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=192)
BATCH, MICRO = 16, 4


def raw(args: argparse.Namespace) -> None:
    """Plain DeepSpeed: lightning_bamboo.initialize + engine.train_batch (run under torchrun)."""
    from deepspeed.pipe import PipelineModule

    import lightning_bamboo
    from lightning_bamboo.deepspeed_api import init_distributed

    init_distributed(timeout=300)
    torch.manual_seed(0)
    module = PipelineModule(layers=gpt_layers(CONFIG), num_stages=2, loss_fn=gpt_loss)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": BATCH // MICRO,
              "steps_per_print": 10**9}
    engine, *_ = lightning_bamboo.initialize(model=module, optimizer=optimizer, config=config)
    loader = torch.utils.data.DataLoader(token_dataset(CONFIG, args.steps * BATCH), batch_size=BATCH)
    times = []
    for x, y in loader:
        start = time.perf_counter()
        chunks = [(x[i : i + MICRO], y[i : i + MICRO]) for i in range(0, BATCH, MICRO)]
        engine.train_batch(data_iter=iter(chunks))
        times.append(time.perf_counter() - start)
    _report(args, times, "raw")
    torch.distributed.destroy_process_group()


def lightning(args: argparse.Namespace) -> None:
    """The same through Trainer(strategy=BambooStrategy(...)) with Lightning's defaults on."""
    import lightning.pytorch as pl

    import lightning_bamboo

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *_):
            self.start = time.perf_counter()

        def on_train_batch_end(self, *_):
            self.times.append(time.perf_counter() - self.start)

    timer = StepTimer()
    trainer = pl.Trainer(
        strategy=lightning_bamboo.BambooStrategy(stages=2, micro_batch_size=MICRO, seed=0), accelerator="cpu",
        devices=2, max_steps=args.steps, callbacks=[timer], logger=pl.loggers.CSVLogger(args.out),
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
    )
    trainer.fit(BenchGPT(CONFIG, args.steps * BATCH, BATCH))
    _report(args, timer.times, "lightning")


def _report(args: argparse.Namespace, times: list[float], name: str) -> None:
    if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0))) == 0:
        Path(args.out, f"{name}.json").write_text(json.dumps(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="alternate raw/lightning runs this many times")
    add_worker_flag(parser, choices=["raw", "lightning"])  # one loop's run, in a child
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.role == "raw":
        return raw(args)
    if args.role == "lightning":
        return lightning(args)

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    env.pop("LOCAL_RANK", None)
    # Alternate the two loops (raw, lightning, raw, ...) so slow phases of a shared machine hit both.
    results: dict[str, list[float]] = {"raw": [], "lightning": []}
    with tempfile.TemporaryDirectory() as out:
        both = ["--steps", args.steps, "--out", out]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29733"]
        for _ in range(args.rounds):
            for cmd in (self_command(__file__, "raw", *both, interpreter=torchrun),
                        self_command(__file__, "lightning", *both)):
                subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
            for name in results:
                results[name] += json.loads(Path(out, f"{name}.json").read_text())[args.warmup :]

    print(f"GPT {sum(p.numel() for layer in gpt_layers(CONFIG) for p in layer.parameters()) / 1e6:.1f}M params, 2 stages x 1 "
          f"pipeline, batch {BATCH} = {BATCH // MICRO} micro-batches of {MICRO}; "
          f"{args.rounds} x {args.steps - args.warmup} timed steps per loop")
    print(f"{'loop':<28}{'median step (ms)':>18}{'samples/s':>12}")
    rates = {}
    for name, times in results.items():
        med = sorted(times)[len(times) // 2]
        rates[name] = BATCH / med
        label = "raw DeepSpeed train_batch" if name == "raw" else 'Trainer(strategy="bamboo")'
        print(f"{label:<28}{med * 1e3:>18.1f}{rates[name]:>12.1f}")
    ratio = rates["lightning"] / rates["raw"]
    print(f"lightning / raw throughput: {ratio:.3f}  (Lightning layer cost {100 * (1 - ratio):+.1f}%; target <= 3%)")


if __name__ == "__main__":
    main()
