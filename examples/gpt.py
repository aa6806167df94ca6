"""Train a small GPT with pipeline parallelism through Lightning: ``python examples/gpt.py``.

The model is ``lightning_bamboo.models.gpt`` (embedding, transformer blocks, head) written as
a list of layers; ``strategy=BambooStrategy(stages=2)`` cuts that list into two pipeline
stages, one per process. The same module trains from YAML with
``lightning-bamboo fit --config examples/gpt.yaml``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

import lightning_bamboo
from lightning_bamboo.models.gpt import GPTConfig, gpt_layers, gpt_loss


class ByteText(Dataset):
    """Next-byte prediction over a text: item i is (bytes i..i+T-1, bytes i+1..i+T).

    The default text is this file, so the example needs no download.
    """

    def __init__(self, block_size: int, path: str | None = None, stride: int = 8) -> None:
        text = Path(path or __file__).read_bytes()
        self.data = torch.tensor(list(text), dtype=torch.long)
        self.block_size, self.stride = block_size, stride

    def __len__(self) -> int:
        return (len(self.data) - self.block_size - 1) // self.stride

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.stride
        chunk = self.data[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class GPTModule(pl.LightningModule):
    """The three hooks strategy='bamboo' needs, plus ordinary Lightning data hooks."""

    def __init__(
        self,
        n_layer: int = 4,
        n_embd: int = 64,
        n_head: int = 4,
        block_size: int = 32,
        lr: float = 3e-3,
        batch_size: int = 16,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=n_head, block_size=block_size)

    def configure_pipeline(self) -> list[torch.nn.Module]:
        # Built once per process under the strategy's seed: weights do not depend on the layout.
        return gpt_layers(self.config)

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Runs on the last stage only, once per micro-batch.
        return gpt_loss(outputs, targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # self.parameters() are this process's stage: each stage steps its own layers.
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.0)

    def train_dataloader(self) -> DataLoader:
        data = ByteText(self.config.block_size)
        return DataLoader(data, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        data = ByteText(self.config.block_size, stride=64)
        return DataLoader(data, batch_size=self.hparams.batch_size, drop_last=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2, help="processes; a multiple of --stages")
    parser.add_argument("--micro-batch-size", type=int, default=4)  # 16 / 4 = 4 micro-batches per step
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    pl.seed_everything(0)
    model = GPTModule()
    trainer = pl.Trainer(
        strategy=lightning_bamboo.BambooStrategy(stages=args.stages, micro_batch_size=args.micro_batch_size),
        accelerator="cpu",
        devices=args.devices,
        max_steps=args.steps,
        val_check_interval=args.steps,  # validate once, at the end
        log_every_n_steps=5,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(model)
    seconds = time.perf_counter() - start
    if trainer.is_global_zero:
        samples = trainer.global_step * model.hparams.batch_size * (args.devices // args.stages)
        print(f"\n{'layout':<22}{args.devices // args.stages} pipeline(s) x {args.stages} stages")
        print(f"{'steps':<22}{trainer.global_step}")
        print(f"{'train_loss':<22}{float(trainer.callback_metrics['train_loss']):.4f}")
        print(f"{'val_loss':<22}{float(trainer.callback_metrics['val_loss']):.4f}")
        print(f"{'samples/s (with start-up)':<22} {samples / seconds:.1f}")


if __name__ == "__main__":
    main()
