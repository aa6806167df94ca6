"""A user's Lightning script, as the launcher's chaos runs it: ``examples/gpt.py``'s ``GPTModule`` under the Bamboo
launcher, written as a user would write it for spot machines (``BambooStrategy(redundancy="lazy")``, or
``--redundancy``,
``RebalanceCallback``, ``AsyncCheckpoint``, ``PreemptionCallback``), plus one callback that records what happened.

    python -m lightning_bamboo.launcher --store etcd://HOST:2379 --node host0 --workers 2 --min-nodes 6 --addr ADDR \\
        -- python benchmarks/spot_user.py --stages 6 --steps 300 --out OUT

Every worker appends the time its script started to ``OUT/started-<node>.txt``, and one JSON line per trained step
to ``OUT/steps-<node>.jsonl``: the step, a digest of the global
batch it trained on (the samples), the job's nodes in rank order, the layout's depth, the stage whose replica the
worker keeps (None: none) and its resident memory. After ``fit`` every worker
takes part in ``trainer.save_checkpoint(OUT/final)`` (per-layer weights and optimizer state, any layout).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning_bamboo  # noqa: E402
from examples.gpt import GPTModule  # noqa: E402
from lightning_bamboo.callbacks import AsyncCheckpoint, PreemptionCallback, RebalanceCallback  # noqa: E402
from lightning_bamboo.runtime.config import DEFAULT_DETECTION_SECONDS  # noqa: E402


class NudgedGPT(GPTModule):
    """The same model with one weight one ulp higher (for a noise floor: how far rounding alone carries a run)."""

    def configure_pipeline(self) -> list[torch.nn.Module]:
        layers = super().configure_pipeline()
        weight = next(layers[0].parameters())
        with torch.no_grad():
            weight.view(-1)[0] = torch.nextafter(weight.view(-1)[0], torch.tensor(float("inf")))
        return layers


class StepRecord(pl.Callback):
    """``OUT/steps-<node>.jsonl``: one line per step this worker trained (a step redone after a restart: again)."""

    def __init__(self, out: Path) -> None:
        self.path = out / f"steps-{os.environ.get('BAMBOO_NODE', 'local')}.jsonl"

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        strategy: Any = trainer.strategy
        layout = strategy.layout
        engine = strategy.engine
        replica = engine.replica if engine is not None else None
        record = {"step": trainer.global_step - 1, "batch": hashlib.sha1(batch[0].numpy().tobytes()).hexdigest()[:16],
                  "nodes": strategy.runner.nodes, "stages": layout.stages if layout is not None else None,
                  # the stage whose replica this worker keeps (None: none), and its resident memory
                  "replica": replica.stage if replica is not None else None,
                  "rss": psutil.Process().memory_info().rss,
                  "t": time.time()}  # when the step ended (a live node's idle spells, chaos_launcher.py)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", required=True)
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--detection-timeout", type=float, default=DEFAULT_DETECTION_SECONDS,
                   help="the strategy's detection_timeout (default: its own, %(default)s)")
    p.add_argument("--n-layer", type=int, default=4, help="transformer blocks (the pipeline has 2 more layers)")
    p.add_argument("--batch-size", type=int, default=16, help="the DataLoader's batch (per pipeline at the start)")
    p.add_argument("--nudge", action="store_true", help="one weight one ulp higher at the start (a noise floor)")
    p.add_argument("--redundancy", default="lazy", choices=("off", "lazy", "eager", "auto"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # when this worker's script started (its interpreter up, its imports done): a live node from here on, which
    # chaos_launcher.py's idle spells count from for a machine that joined
    with open(out / f"started-{os.environ.get('BAMBOO_NODE', 'local')}.txt", "a") as f:
        f.write(f"{time.time()}\n")
    pl.seed_everything(0)
    trainer = pl.Trainer(
        strategy=lightning_bamboo.BambooStrategy(stages=args.stages, micro_batch_size=4, redundancy=args.redundancy, timeout=60,
                                                 detection_timeout=args.detection_timeout),
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),  # the workers of one machine, as Lightning counts them
        max_steps=args.steps,
        callbacks=[RebalanceCallback(), AsyncCheckpoint(dirpath=str(out / "checkpoints"),
                                                        every_n_train_steps=args.checkpoint_every, keep_last=3),
                   PreemptionCallback(signals=["SIGTERM"]), StepRecord(out)],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0,
    )
    trainer.fit((NudgedGPT if args.nudge else GPTModule)(n_layer=args.n_layer, batch_size=args.batch_size))
    trainer.save_checkpoint(out / "final")


if __name__ == "__main__":
    main()
