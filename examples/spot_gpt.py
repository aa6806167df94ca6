"""Train a small GPT on spot machines that may vanish: the example to copy.

Run it under the Bamboo launcher (one process per node; a dead node does not take the others down)::

    python -m lightning_bamboo.launcher --nodes 4 -- python examples/spot_gpt.py --steps 300

and preempt a node from another terminal while it trains::

    kill -9 $(cat runs/spot_gpt/node2.pid)       # a vanished machine: node1 takes over node2's stage
    kill -TERM $(cat runs/spot_gpt/node3.pid)    # a preemption notice: node3 leaves at the next step boundary

Training goes on with the same weights a run without the kill would have. Every node keeps a replica
of its successor's stage (``redundancy="lazy"``); ``RebalanceCallback`` evens the layers out over the
survivors; ``AsyncCheckpoint`` writes checkpoints in the background for the case replicas cannot
cover (a node and its predecessor lost together); ``PreemptionCallback`` turns SIGTERM (and, on a
cloud, its spot-notice endpoint) into a handover at a step boundary. The failover metrics
(``bamboo/failovers``, ``bamboo/recovery_seconds``, ``bamboo/live_nodes``) go to the CSV log in
``runs/spot_gpt/csv/version_0/metrics.csv``. The same run from YAML::

    python -m lightning_bamboo.launcher --nodes 4 -- lightning-bamboo fit --config examples/spot_gpt.yaml
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

import lightning_bamboo
from lightning_bamboo.callbacks import AsyncCheckpoint, PreemptionCallback, RebalanceCallback
from lightning_bamboo.models.gpt import GPTConfig, gpt_layers, gpt_loss


class ByteText(Dataset):
    """Next-byte prediction over a text (this file by default, so nothing is downloaded)."""

    def __init__(self, block_size: int, path: str | None = None, stride: int = 4) -> None:
        self.data = torch.tensor(list(Path(path or __file__).read_bytes()), dtype=torch.long)
        self.block_size, self.stride = block_size, stride

    def __len__(self) -> int:
        return (len(self.data) - self.block_size - 1) // self.stride

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.stride : i * self.stride + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class SpotGPT(pl.LightningModule):
    """The three hooks strategy="bamboo" needs, and a data loader."""

    def __init__(self, n_layer: int = 6, n_embd: int = 64, n_head: int = 4, block_size: int = 32,
                 lr: float = 3e-3, batch_size: int = 16, text: str | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        # n_layer blocks + embedding + head = 8 pipeline layers: enough for 4 stages and for 3 after a loss
        self.config = GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=n_head, block_size=block_size)

    def configure_pipeline(self) -> list[torch.nn.Module]:
        return gpt_layers(self.config)  # built under the strategy's seed: the same weights in any layout

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return gpt_loss(outputs, targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # a replica steps its own copy of this optimizer: AdamW's moments move with a failed-over stage
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.0)

    def train_dataloader(self) -> DataLoader:
        # the strategy replaces the sampler with a resumable one that keeps the sample order across failovers
        return DataLoader(ByteText(self.config.block_size, self.hparams.text), batch_size=self.hparams.batch_size,
                          shuffle=True, drop_last=True)


class NodeStatus(pl.Callback):
    """Writes ``OUT/<node>.pid`` (what to kill) and prints the job's progress from the first node."""

    def __init__(self, out: Path, every: int) -> None:
        self.out, self.every = out, every

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        node = os.environ.get("BAMBOO_NODE", f"node{trainer.global_rank}")
        (self.out / f"{node}.pid").write_text(f"{os.getpid()}\n")
        print(f"{node}: pid {os.getpid()}, rank {trainer.global_rank} of {trainer.world_size}", flush=True)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        if trainer.is_global_zero and trainer.global_step % self.every == 0:
            res = trainer.strategy.resilience  # type: ignore[attr-defined]  # None without the Bamboo launcher
            nodes = res.nodes if res is not None else []
            print(f"step {trainer.global_step}: loss {float(trainer.callback_metrics['train_loss']):.3f}, "
                  f"nodes {' '.join(nodes) or trainer.world_size}, failovers {len(res.failovers) if res else 0}",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=None, help="pipeline depth (default: all nodes)")
    parser.add_argument("--micro-batch-size", type=int, default=4)  # 16 / 4 = 4 micro-batches per step
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--out", default="runs/spot_gpt")
    parser.add_argument("--print-every", type=int, default=10)
    args = parser.parse_args()

    nodes = int(os.environ.get("WORLD_SIZE", args.stages or 2))  # the Bamboo launcher sets WORLD_SIZE
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0)
    trainer = pl.Trainer(
        strategy=lightning_bamboo.BambooStrategy(
            stages=args.stages or nodes, micro_batch_size=args.micro_batch_size, redundancy="lazy",
            timeout=60,  # seconds any communication may block (a dead peer is found through the store sooner)
        ),
        accelerator="cpu",
        devices=nodes,
        max_steps=args.steps,
        callbacks=[
            AsyncCheckpoint(dirpath=str(out / "checkpoints"), every_n_train_steps=args.checkpoint_every, keep_last=2),
            PreemptionCallback(signals=["SIGTERM"]),  # add pollers=["aws"] (or "gcp", "azure") on a cloud
            RebalanceCallback(stages=args.stages or nodes),  # even out after a loss; take joining nodes back in
            NodeStatus(out, args.print_every),
        ],
        logger=CSVLogger(out, name="csv", version=0),
        enable_checkpointing=False,  # AsyncCheckpoint writes the checkpoints (no second, synchronous one at the end)
        log_every_n_steps=5,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(SpotGPT())


if __name__ == "__main__":
    main()
