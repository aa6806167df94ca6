"""Training-thread stall per checkpoint: synchronous ``trainer.save_checkpoint`` vs ``AsyncCheckpoint``.

One process trains an MLP of 4 x Linear(4096, 4096) (256 MiB of fp32 weights, as much again
of SGD momentum: 512 MiB per checkpoint) through ``Trainer(strategy="bamboo")`` twice: once
saving synchronously every ``--every`` steps, once with ``AsyncCheckpoint`` at the same steps,
each into its own temporary directory on the same disk. Prints the mean stall of each and the
ratio. Target: the asynchronous stall is <= 10% of the synchronous save time.

    python benchmarks/checkpoint.py [--steps 24] [--every 6] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import lightning.pytorch as pl
import torch
from torch import nn

import lightning_bamboo
from lightning_bamboo.callbacks import AsyncCheckpoint

WIDTH, LAYERS, BATCH = 4096, 4, 8  # 4 x 4096 x 4096 fp32 = 256 MiB of weights


class MLP(pl.LightningModule):
    def configure_pipeline(self):
        return [nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]

    def pipeline_loss(self, outputs, targets):
        return nn.functional.mse_loss(outputs, targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.trainer.max_steps * BATCH, WIDTH, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x), batch_size=BATCH)


class SyncSave(pl.Callback):
    """Lightning's usual way: ``trainer.save_checkpoint`` on the training thread every ``every`` steps."""

    def __init__(self, dirpath: str, every: int) -> None:
        self.dirpath, self.every, self.stalls = dirpath, every, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step % self.every == 0:
            start = time.perf_counter()
            trainer.save_checkpoint(os.path.join(self.dirpath, f"step-{trainer.global_step}"))
            self.stalls.append(time.perf_counter() - start)


def fit(steps: int, callback: pl.Callback) -> float:
    trainer = pl.Trainer(
        strategy=lightning_bamboo.BambooStrategy(stages=1, micro_batch_size=BATCH, seed=0), accelerator="cpu",
        devices=1, max_steps=steps, callbacks=[callback], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    start = time.perf_counter()
    trainer.fit(MLP())
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=6)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args()
    state_mib = 2 * LAYERS * (WIDTH * WIDTH + WIDTH) * 4 / 2**20
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        sync = SyncSave(os.path.join(root, "sync"), args.every)
        sync_wall = fit(args.steps, sync)
        asynchronous = AsyncCheckpoint(dirpath=os.path.join(root, "async"), every_n_train_steps=args.every, keep_last=1)
        async_wall = fit(args.steps, asynchronous)
    async_stalls = [e["stall_seconds"] for e in asynchronous.events]
    waited = [e["waited_for_previous_seconds"] for e in asynchronous.events]
    sync_mean, async_mean = statistics.mean(sync.stalls), statistics.mean(async_stalls)
    print(f"checkpoint size: {state_mib:.0f} MiB (weights + momentum), {len(sync.stalls)} checkpoints each")
    print(f"synchronous save stall : {sync_mean:8.3f} s per checkpoint  (fit {sync_wall:.1f} s)")
    print(f"AsyncCheckpoint stall  : {async_mean:8.3f} s per checkpoint  (fit {async_wall:.1f} s; "
          f"background write {asynchronous.write_seconds:.3f} s)")
    print(f"  of which waiting for the previous write: {statistics.mean(waited):.3f} s; first snapshot (allocates "
          f"the host buffers) {async_stalls[0]:.3f} s, later ones {statistics.mean(async_stalls[1:] or [0]):.3f} s")
    print(f"ratio async / sync     : {async_mean / sync_mean:8.3f}  (target <= 0.10)")
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, cuda available: {torch.cuda.is_available()}")
    print(json.dumps({"state_mib": state_mib, "sync_stall_s": sync.stalls, "async_stall_s": async_stalls,
                      "async_waited_s": waited,
                      "async_write_s": asynchronous.write_seconds, "ratio": async_mean / sync_mean}))


if __name__ == "__main__":
    main()
