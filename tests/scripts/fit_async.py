"""Train the small GPT with ``AsyncCheckpoint`` (and resume from one); used by tests/test_async_checkpoint.py.

Writes OUT/final.ckpt (per-layer, with optimizer state), OUT/final.pt (consolidated weights),
OUT/draws-RANK.json (random numbers drawn at each step's start, per process: they show
whether the RNG states were restored) and, with --dump-loaded, OUT/loaded.ckpt right after
the checkpoint was loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lightning.pytorch as pl  # noqa: E402
from helpers import TokenData, make_config  # noqa: E402

import lightning_bamboo  # noqa: E402
from lightning_bamboo.callbacks import AsyncCheckpoint  # noqa: E402
from lightning_bamboo.models.gpt import gpt_layers, gpt_loss  # noqa: E402


class Draws(pl.Callback):
    """Draw one number from each generator at every step's start; dump them per process at the end."""

    def __init__(self, out: str, dump_loaded: bool) -> None:
        self.out, self.dump_loaded, self.draws = out, dump_loaded, {}

    def on_train_start(self, trainer, pl_module):
        if self.dump_loaded:  # the state just loaded from the checkpoint, saved in the new layout
            trainer.save_checkpoint(os.path.join(self.out, "loaded.ckpt"))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.draws[trainer.global_step] = [torch.rand(1).item(), float(np.random.rand()), random.random()]

    def on_train_end(self, trainer, pl_module):
        with open(os.path.join(self.out, f"draws-{trainer.global_rank}.json"), "w") as f:
            json.dump(self.draws, f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8, help="per pipeline")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--partition", default="uniform")
    p.add_argument("--resume", default=None)
    p.add_argument("--dump-loaded", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    cfg = make_config()
    pipelines = args.devices // args.stages

    class GPT(pl.LightningModule):
        def configure_pipeline(self):
            return gpt_layers(cfg)

        def pipeline_loss(self, outputs, targets):
            return gpt_loss(outputs, targets)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

        def train_dataloader(self):
            data = TokenData(cfg, args.steps * args.batch_size * pipelines)
            return torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=False)

    partition = args.partition if not args.partition[0].isdigit() else [int(x) for x in args.partition.split(",")]
    strategy = lightning_bamboo.BambooStrategy(
        stages=args.stages, micro_batch_size=args.micro_batch_size, partition=partition, seed=1234, timeout=60
    )
    saver = AsyncCheckpoint(dirpath=os.path.join(args.out, "async"), every_n_train_steps=args.every, keep_last=args.keep_last)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=args.devices, max_steps=args.steps,
        callbacks=[saver, Draws(args.out, args.dump_loaded)], logger=pl.loggers.CSVLogger(args.out),
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(GPT(), ckpt_path=args.resume)
    trainer.save_checkpoint(os.path.join(args.out, "final.ckpt"))
    if trainer.is_global_zero:
        weights = lightning_bamboo.consolidate_checkpoint(os.path.join(args.out, "final.ckpt"))
        torch.save(weights, os.path.join(args.out, "final.pt"))
        print(json.dumps({"global_step": trainer.global_step, "events": saver.events,
                          "stall": float(trainer.callback_metrics.get("async_checkpoint/stall_seconds", -1))}))


if __name__ == "__main__":
    main()
