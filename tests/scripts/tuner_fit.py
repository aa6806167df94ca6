"""Train the small GPT through Trainer(strategy=BambooStrategy(), callbacks=[HydrozoaTuner(...)]).

Every rank writes OUT/rank{r}.json ``{"rank": r, "plan": ..., "layout": ..., "batches": [...]}``:
the plan its tuner holds, the layout its strategy built, the DataLoader batch size and the
number of micro-batches of every step. Rank 0 also writes the consolidated weights to OUT/final.pt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import TokenData, make_config  # noqa: E402

import lightning_bamboo  # noqa: E402
from lightning_bamboo.callbacks.tuner import HydrozoaTuner  # noqa: E402
from lightning_bamboo.models.gpt import gpt_layers, gpt_loss  # noqa: E402


class GPT(pl.LightningModule):
    def __init__(self, batch_size: int, samples: int) -> None:
        super().__init__()
        self.cfg = make_config()
        self.batch_size = batch_size  # per pipeline; the tuner overwrites it
        self.samples = samples
        self.example_input_array = torch.zeros(2, self.cfg.block_size, dtype=torch.long)

    def configure_pipeline(self):
        return gpt_layers(self.cfg)

    def pipeline_loss(self, outputs, targets):
        return gpt_loss(outputs, targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(TokenData(self.cfg, self.samples), batch_size=self.batch_size, shuffle=False)


class Record(pl.Callback):
    """What the run really used: the strategy's layout and, per step, the batch and its micro-batches."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        engine = trainer.strategy.engine
        self.batches.append([len(batch[0]), int(engine.micro_batches), int(engine.train_micro_batch_size_per_gpu())])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--memory-bytes", type=int, default=2**19)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    tuner = HydrozoaTuner(global_batch=args.global_batch, micro_batch_sizes=(2, 4), memory_bytes=args.memory_bytes,
                          repeats=1, warmup=1, threads=1, max_world_size=args.devices)
    record = Record()
    # deliberately the wrong batch (1 per pipeline) and strategy defaults: the tuner must replace them
    model = GPT(batch_size=1, samples=args.steps * args.global_batch)
    trainer = pl.Trainer(
        strategy=lightning_bamboo.BambooStrategy(seed=1234, timeout=60), accelerator="cpu", devices=args.devices,
        max_steps=args.steps, callbacks=[tuner, record], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(model)
    layout = trainer.strategy.layout
    with open(os.path.join(args.out, f"rank{trainer.global_rank}.json"), "w") as f:  # stdout lines of 4 processes interleave
        json.dump({
            "rank": trainer.global_rank, "plan": tuner.plan.to_dict(), "batches": record.batches,
            "layout": {"stages": layout.stages, "pipelines": layout.pipelines, "parts": list(layout.parts),
                       "micro_batch_size": trainer.strategy.micro_batch_size},
        }, f)
    trainer.save_checkpoint(os.path.join(args.out, "final.ckpt"))
    if trainer.is_global_zero:
        weights = lightning_bamboo.consolidate_checkpoint(os.path.join(args.out, "final.ckpt"))
        torch.save(weights, os.path.join(args.out, "final.pt"))


if __name__ == "__main__":
    main()
