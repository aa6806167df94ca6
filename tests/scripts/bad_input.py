"""A job with one bad input, under the Bamboo launcher: ``form`` (batches of inputs only), ``divisibility``
(a batch size of 7 with micro-batches of 2) or ``precision`` (``precision="64-true"``, which the pipeline engine
does not run); ``devices`` (a Trainer's ``devices`` smaller than the workers the launcher starts on a machine, which
only those workers refuse); or ``bug``, a script that fails before it starts its job. Every step that trains prints
``trained step N``. Used by tests/test_refusal.py."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

import lightning_bamboo

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slow_mlp import MLP  # noqa: E402


class SaysWhatTrained(pl.Callback):
    def on_train_batch_end(self, trainer, *args):
        print(f"trained step {trainer.global_step}", flush=True)


class InputsOnly(MLP):
    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(self.steps * self.batch_size, self.width))
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mistake", choices=("form", "divisibility", "precision", "bug", "devices"))
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--devices", type=int, default=None,
                   help="the Trainer's devices (default: $BAD_INPUT_DEVICES, else --stages)")
    args = p.parse_args()
    args.devices = args.devices or int(os.environ.get("BAD_INPUT_DEVICES", 0))
    model = InputsOnly(4, 8, 4, 8) if args.mistake == "form" else MLP(4, 8, 4, 8 if args.mistake == "devices" else 7)
    strategy = lightning_bamboo.BambooStrategy(stages=args.stages, micro_batch_size=2, redundancy="lazy", seed=1)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=args.devices or args.stages, max_steps=4,
                         logger=False, callbacks=[SaysWhatTrained()],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, precision="64-true" if args.mistake == "precision" else "32-true")
    if args.mistake == "bug":
        raise ValueError("a bug in the user's script, before trainer.fit")
    trainer.fit(model)
    print("trained", flush=True)  # never reached


if __name__ == "__main__":
    main()
