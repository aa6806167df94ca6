"""Train a GPT-2-style model on your own text, on spot machines: a tokenized corpus, tied embeddings, replicas.

Tokenize local text files once (here this repository's documentation; any folder of .txt/.md files will do)::

    lightning-bamboo prepare README.md docs --out runs/corpus

then train under the Bamboo launcher, one process per node::

    python -m lightning_bamboo.launcher --nodes 4 -- python examples/corpus_gpt.py --data runs/corpus --steps 200

The model is ``gpt_layer_specs(tie_embeddings=True)``: ``LayerSpec``s, so every process builds only the layers it
holds (its stage and its replica), with GPT-2's token embedding reused as the output head. The data is
``TokenCorpus``: ``train.bin``/``val.bin`` read through a memory map (nanoGPT's format, so files written by other
tools work too; pass ``--dtype uint32`` for a vocabulary over 65536). ``redundancy="lazy"`` keeps a replica of each
successor's stage; ``RebalanceCallback``, ``AsyncCheckpoint`` and ``PreemptionCallback`` are as in
``examples/spot_gpt.py``. The first node prints the training loss every ``--print-every`` steps and the
validation loss at the end.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

import lightning_bamboo
from lightning_bamboo.callbacks import AsyncCheckpoint, PreemptionCallback, RebalanceCallback
from lightning_bamboo.models.corpus import TokenCorpus
from lightning_bamboo.models.gpt import GPTConfig, gpt_layer_specs, gpt_loss
from lightning_bamboo.models.prepare import read_meta


class CorpusGPT(pl.LightningModule):
    def __init__(self, data: str, n_layer: int = 4, n_embd: int = 64, n_head: int = 4, block_size: int = 64,
                 lr: float = 3e-3, batch_size: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.meta = read_meta(data)
        self.config = GPTConfig(vocab_size=self.meta["vocab_size"], n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                                block_size=block_size)

    def configure_pipeline(self) -> list:
        # n_layer blocks between the embedding and the head that reuses its weight: n_layer + 3 pipeline layers
        return gpt_layer_specs(self.config, tie_embeddings=True)

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return gpt_loss(outputs, targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.0)

    def _corpus(self, split: str, stride: int | None = None) -> TokenCorpus:
        return TokenCorpus(Path(self.hparams.data) / f"{split}.bin", self.config.block_size, dtype=self.meta["dtype"],
                           stride=stride)

    def train_dataloader(self) -> DataLoader:
        # overlapping samples (a stride of a quarter block) give a small corpus more of them; the strategy's sampler
        # keeps their order across failovers
        corpus = self._corpus("train", stride=max(1, self.config.block_size // 4))
        return DataLoader(corpus, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._corpus("val"), batch_size=self.hparams.batch_size, drop_last=True)


class Progress(pl.Callback):
    """The first node prints the loss every ``every`` steps, and the validation loss."""

    def __init__(self, every: int) -> None:
        self.every = every

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        if trainer.is_global_zero and (trainer.global_step % self.every == 0 or trainer.global_step == 1):
            res = trainer.strategy.resilience  # type: ignore[attr-defined]  # None without the Bamboo launcher
            print(f"step {trainer.global_step}: train loss {float(trainer.callback_metrics['train_loss']):.3f}, "
                  f"failovers {len(res.failovers) if res else 0}", flush=True)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and "val_loss" in trainer.callback_metrics:
            print(f"step {trainer.global_step}: val loss {float(trainer.callback_metrics['val_loss']):.3f}",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="the directory lightning-bamboo prepare wrote")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--stages", type=int, default=None, help="pipeline depth (default: all nodes)")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--out", default="runs/corpus_gpt")
    parser.add_argument("--print-every", type=int, default=20)
    parser.add_argument("--val-batches", type=int, default=8, help="validation batches at the end (0: none)")
    args = parser.parse_args()

    nodes = int(os.environ.get("WORLD_SIZE", args.stages or 2))  # the Bamboo launcher sets WORLD_SIZE
    out = Path(args.out)
    pl.seed_everything(0)
    trainer = pl.Trainer(
        strategy=lightning_bamboo.BambooStrategy(stages=args.stages or nodes, micro_batch_size=args.micro_batch_size,
                                                 redundancy="lazy", timeout=60),
        accelerator="cpu",
        devices=nodes,
        max_steps=args.steps,
        limit_val_batches=args.val_batches,
        val_check_interval=args.steps,  # once, at the end
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        callbacks=[
            AsyncCheckpoint(dirpath=str(out / "checkpoints"), every_n_train_steps=max(args.steps // 4, 1), keep_last=2),
            PreemptionCallback(signals=["SIGTERM"]),
            RebalanceCallback(stages=args.stages or nodes),
            Progress(args.print_every),
        ],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(CorpusGPT(args.data))


if __name__ == "__main__":
    main()
