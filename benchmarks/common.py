"""Pieces the benchmarks share: the GPT LightningModule they train and its synthetic data, a job under the launcher,
a process's memory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_bamboo.models.gpt import GPTConfig, gpt_layers, gpt_loss

REPO = str(Path(__file__).resolve().parents[1])


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


def run_under_launcher(nodes: int, worker: list[str], kills: list[str] = (), timeout: float = 3000,  # type: ignore[assignment]
                       tree: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m lightning_bamboo.launcher --nodes N -- WORKER...`` as a user runs it, its output captured; ``kills``:
    ``BAMBOO_FAIL_AT`` items (``lightning_bamboo.testing.faults``); ``tree``: the source tree whose
    ``lightning_bamboo`` the launcher and its workers import (default: this repository's); ``env``: added to theirs."""
    from lightning_bamboo.testing import faults

    repo = tree or REPO
    full = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH", "")])), **(env or {})}
    full.pop("LOCAL_RANK", None)
    if kills:
        full.update(faults.environment(list(kills)))
    command = [sys.executable, "-m", "lightning_bamboo.launcher", "--nodes", str(nodes), "--", *worker]
    return subprocess.run(command, cwd=repo, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
