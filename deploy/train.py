"""The training script the deploy recipes run on every worker: the example GPT, ready for spot machines.

Started by ``python -m lightning_bamboo.launcher`` (one supervisor per machine), which gives every
worker its node name, rank, world size and store in the environment; this script only chooses the
layout and the callbacks:

- ``redundancy="lazy"``: every stage's successor is replicated, so a lost machine costs no rollback;
- ``AsyncCheckpoint``: the fallback when a stage and its replica are lost together;
- ``PreemptionCallback``: a spot notice (SIGTERM, the cloud's metadata endpoint) lets a machine leave
  at a step boundary;
- ``RebalanceCallback``: evens the layout out after a failover and admits machines started with ``--join``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import lightning.pytorch as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPTModule  # noqa: E402  (examples/gpt.py, next to this directory)

import lightning_bamboo  # noqa: E402
from lightning_bamboo.callbacks import AsyncCheckpoint, PreemptionCallback, RebalanceCallback  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # the launcher sets WORLD_SIZE to the number of nodes of the job (machines x --workers) and LOCAL_WORLD_SIZE to
    # the workers of this machine (--workers K: one per GPU); pass the same --stages to the launcher, which orders
    # the nodes so that every stage's replica holder is on another machine at that depth
    parser.add_argument("--stages", type=int, default=None, help="pipeline depth; default: every node one stage")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--checkpoints", default="checkpoints", help="a directory every machine can write (shared)")
    parser.add_argument("--accelerator", default="cpu", help="cpu, or gpu: worker NAME.i on GPU i (LOCAL_RANK)")
    parser.add_argument("--poll", default="", help="a cloud's spot notice to poll: aws, gcp or azure")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    stages = args.stages or world
    # Lightning's devices: the workers (GPUs) of this machine; worker i runs on parallel_devices[LOCAL_RANK = i]
    per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = pl.Trainer(
        strategy=lightning_bamboo.BambooStrategy(stages=stages, micro_batch_size=args.micro_batch_size,
                                                 redundancy="lazy"),
        accelerator=args.accelerator,
        devices=per_machine,
        max_steps=args.steps,
        callbacks=[
            AsyncCheckpoint(dirpath=args.checkpoints),
            PreemptionCallback(signals=["SIGTERM"], pollers=[args.poll] if args.poll else []),
            RebalanceCallback(stages=stages),
        ],
        enable_model_summary=False,
    )
    trainer.fit(GPTModule())


if __name__ == "__main__":
    main()
