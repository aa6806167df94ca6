"""Train an 11-layer MLP under the Bamboo launcher with slow steps; used by the tests of a job's end.

Each step sleeps ``--sleep`` seconds in a callback (a step as long as a real model's); every process
writes a JSON line to stdout at the end of each step (``last_step``: wall-clock seconds) and when it
leaves ``main`` (``done``), so a test can bound the time between the last step and the processes' end.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time

import lightning.pytorch as pl
import torch

import lightning_bamboo


def report(**fields: object) -> None:
    print(json.dumps({"node": os.environ.get("BAMBOO_NODE"), "pid": os.getpid(), **fields}), flush=True)


class SlowSteps(pl.Callback):
    """Sleeps after every step, and notes when the last one ended."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer, *args):
        time.sleep(self.seconds)
        report(step=trainer.global_step, last_step=time.time())


class MLP(pl.LightningModule):
    def __init__(self, layers: int, width: int, steps: int, batch_size: int) -> None:
        super().__init__()
        self.layers, self.width, self.steps, self.batch_size = layers, width, steps, batch_size

    def configure_pipeline(self):
        torch.manual_seed(0)
        body = [torch.nn.Sequential(torch.nn.Linear(self.width, self.width), torch.nn.ReLU())
                for _ in range(self.layers - 1)]
        return [*body, torch.nn.Linear(self.width, 1)]

    def pipeline_loss(self, outputs, targets):
        return torch.nn.functional.mse_loss(outputs, targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        n = self.steps * self.batch_size
        data = torch.utils.data.TensorDataset(torch.randn(n, self.width, generator=g), torch.randn(n, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--layers", type=int, default=11)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--sleep", type=float, default=0.3)
    p.add_argument("--redundancy", default="lazy")
    p.add_argument("--detection-timeout", type=float, default=10.0,
                   help="BambooStrategy(detection_timeout): longer where a killed machine's peers learn of it by its lease")
    p.add_argument("--hang-dump", type=float, default=0.0, help="dump every thread's stack this many seconds in")
    args = p.parse_args()
    if args.hang_dump:
        faulthandler.dump_traceback_later(args.hang_dump, exit=False)
    strategy = lightning_bamboo.BambooStrategy(stages=args.stages, micro_batch_size=2, redundancy=args.redundancy,
                                               seed=1234, timeout=120,
                                               detection_timeout=args.detection_timeout)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=args.stages, max_steps=args.steps,
                         callbacks=[SlowSteps(args.sleep)], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(MLP(args.layers, 16, args.steps, 8))
    report(done=time.time(), global_step=trainer.global_step)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
