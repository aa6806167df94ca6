"""Print, as one JSON line, what a worker started by the Bamboo launcher is to Lightning: its ranks and its device.

No training: a ``Trainer`` with ``BambooStrategy`` and ``devices`` = the workers of this machine
(``LOCAL_WORLD_SIZE``) is built, and the strategy's view is printed. ``device_index`` is the
index into Lightning's ``parallel_devices`` that the strategy's ``root_device`` takes, which the
engine places the stage on (``cuda:device_index`` on a GPU machine; all ``cpu`` here).
"""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl

import lightning_bamboo

trainer = pl.Trainer(strategy=lightning_bamboo.BambooStrategy(stages=2), accelerator="cpu",
                     devices=int(os.environ["LOCAL_WORLD_SIZE"]), logger=False, enable_progress_bar=False)
strategy = trainer.strategy
print(json.dumps({
    "node": os.environ["BAMBOO_NODE"], "machine": os.environ.get("BAMBOO_MACHINE"),
    "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")},
    "global_rank": strategy.global_rank, "world_size": strategy.world_size, "device_index": strategy.local_rank,
    "root_device": str(strategy.root_device),
}), flush=True)
