"""Fit with a bad batch and print the error: ``--case tuple`` (not (inputs, targets)) or ``--case divisible``."""

from __future__ import annotations

import argparse
import json

import lightning.pytorch as pl
import torch

import lightning_bamboo
from lightning_bamboo.models.gpt import GPTConfig, gpt_layers, gpt_loss


class Data(torch.utils.data.Dataset):
    def __init__(self, case: str) -> None:
        self.case = case

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int):
        x = torch.zeros(8, dtype=torch.long)
        return (x, x, x) if self.case == "tuple" else (x, x)


class GPT(pl.LightningModule):
    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case

    def configure_pipeline(self):
        return gpt_layers(GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16))

    def pipeline_loss(self, outputs, targets):
        return gpt_loss(outputs, targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Data(self.case), batch_size=6)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--case", required=True)
    p.add_argument("--devices", type=int, default=2)
    args = p.parse_args()
    trainer = pl.Trainer(
        strategy=lightning_bamboo.BambooStrategy(stages=args.devices, micro_batch_size=4, timeout=30),
        accelerator="cpu", devices=args.devices, max_steps=2, logger=False, enable_progress_bar=False,
        enable_checkpointing=False,
    )
    try:
        trainer.fit(GPT(args.case))
    except lightning_bamboo.BambooConfigError as err:
        if trainer.is_global_zero:  # both ranks fail alike; one line keeps the shared pipe readable
            print(json.dumps({"error": str(err)}), flush=True)


if __name__ == "__main__":
    main()
