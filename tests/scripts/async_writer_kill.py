"""Write two checkpoints through AsyncCheckpoint's write phase; pause (or not) in the middle of the second.

Used by tests/test_async_checkpoint.py, which SIGKILLs this process while the second
checkpoint is being written. Prints ``committed 1`` after the first checkpoint is complete
and ``wrote PATH`` after each layer file of the second; with ``--pause`` it then blocks on
stdin after the second layer file, so the kill lands at a known point.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from lightning_bamboo import checkpoint as ckpt

LAYERS, WIDTH = 8, 1024  # 8 x 4 MiB of weights, as much again of momentum: the write takes a while


def make_stage(step: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A stage of LAYERS layers named by global index, after ``step`` SGD-with-momentum steps (deterministic)."""
    torch.manual_seed(0)
    stage = nn.Module()
    for i in range(LAYERS):
        stage.add_module(str(i), nn.Linear(WIDTH, WIDTH))
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
    for k in range(step):
        for i, p in enumerate(stage.parameters()):
            p.grad = torch.full_like(p, 0.01 * (k + 1) + 0.001 * i)
        optimizer.step()
    return stage, optimizer


def shard(step: int) -> ckpt.Shard:
    stage, optimizer = make_stage(step)
    meta = {"global_step": step, "bamboo": ckpt.bamboo_meta(LAYERS, [0, LAYERS], 1, optimizer, world_size=1)}
    return ckpt.take_shard(0, stage, optimizer, range(LAYERS), writes_layers=True, meta=lambda: meta)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--pause", action="store_true")
    args = p.parse_args()
    directory = Path(args.dir)
    worker = ThreadPoolExecutor(max_workers=1)
    worker.submit(ckpt.persist, directory / ckpt.step_name(1), shard(1), world_size=1, token="run1",
                  timeout=60, keep_last=1).result()
    print("committed 1", flush=True)

    def progress(path: Path) -> None:
        print(f"wrote {path}", flush=True)
        if args.pause and path.name == "layer-0001.pt":
            sys.stdin.readline()  # the test kills us here: layer files on disk, no manifest

    worker.submit(ckpt.persist, directory / ckpt.step_name(2), shard(2), world_size=1, token="run1",
                  timeout=60, keep_last=1, progress=progress).result()
    print("committed 2", flush=True)


if __name__ == "__main__":
    main()
