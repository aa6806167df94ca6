"""The test GPT as a LightningModule that the CLI test names by class_path."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lightning_bamboo.models.gpt import gpt_layers, gpt_loss
from tests.helpers import TokenData, make_config


class TestGPT(pl.LightningModule):
    def __init__(self, steps: int = 10, batch_size: int = 8, pipelines: int = 1) -> None:
        super().__init__()
        self.steps, self.batch_size, self.pipelines = steps, batch_size, pipelines

    def configure_pipeline(self):
        return gpt_layers(make_config())

    def pipeline_loss(self, outputs, targets):
        return gpt_loss(outputs, targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        data = TokenData(make_config(), self.steps * self.batch_size * self.pipelines)
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)
