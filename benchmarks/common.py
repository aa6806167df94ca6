"""Pieces the benchmarks share: the GPT LightningModule they train and its synthetic data."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lightning_bamboo.models.gpt import GPTConfig, gpt_layers, gpt_loss


def token_dataset(config: GPTConfig, samples: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    """Random token sequences (fixed seed); the target is the input shifted by one."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (samples, config.block_size + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


class BenchGPT(pl.LightningModule):
    """The GPT of ``config`` as pipeline layers, AdamW, ``samples`` synthetic samples in batches of ``batch_size``."""

    def __init__(self, config: GPTConfig, samples: int, batch_size: int) -> None:
        super().__init__()
        self.config, self.samples, self.batch_size = config, samples, batch_size

    def configure_pipeline(self):
        return gpt_layers(self.config)

    def pipeline_loss(self, outputs, targets):
        return gpt_loss(outputs, targets)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(token_dataset(self.config, self.samples), batch_size=self.batch_size)
