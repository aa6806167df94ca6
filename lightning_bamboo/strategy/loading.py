"""Training data for a pipeline job: one global order cut per step, and the cursor a checkpoint keeps."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from lightning_bamboo.data import StepSampler

log = logging.getLogger(__name__)


class PipelineData:
    """Where the job is in its data (epoch, samples consumed) and how each pipeline gets its share.

    Training: every node loads each step's global batch (``batch_size`` of the DataLoader times
    the pipelines the job started with) and trains on its pipeline's micro-batches of it, so the
    number of pipelines may change between steps. Evaluation: each pipeline loads its shard.
    """

    def __init__(self) -> None:
        self.cursor = (0, 0)  # (epoch, global samples consumed in it)
        self.global_batch: int | None = None  # samples per step over all pipelines (fixed by the first start)
        self.global_batches = False  # whether every node loads the global batch (see loader)
        self.resume_cursor: tuple[int, int] | None = None
        #: a run resumed (or a node admitted) in another layout keeps the global batch of the checkpoint; False
        #: (``HydrozoaTuner(scale_batch=True)``): the DataLoader's batch per pipeline stays, the global batch scales
        self.keep_global_batch = True

    def advance(self, epoch: int, batch_size: int, pipelines: int) -> None:
        """A step of ``batch_size`` samples (per pipeline, unless global batches) ran in ``epoch``."""
        done = self.cursor[1] if self.cursor[0] == epoch else 0
        self.cursor = (epoch, done + batch_size * (1 if self.global_batches else pipelines))

    def state(self) -> dict[str, Any]:
        return {"epoch": self.cursor[0], "samples": self.cursor[1], "global_batch": self.global_batch}

    def restore(self, bamboo: dict[str, Any]) -> None:
        """The data cursor (and the global batch, which a run keeps in every later layout) of a checkpoint's meta."""
        cursor = bamboo.get("cursor", {"epoch": 0, "samples": 0})
        self.cursor = self.resume_cursor = (int(cursor["epoch"]), int(cursor["samples"]))
        if cursor.get("global_batch") and self.keep_global_batch:
            self.global_batch = int(cursor["global_batch"])

    def loader(self, dataloader: Any, training: bool, pipelines: int, pipeline: int, update: Any) -> Any:
        """``dataloader`` with a sampler giving each pipeline its share (``update`` is Lightning's
        ``_update_dataloader``, applied to a sampler that is not the global step loader's)."""
        sampler = getattr(dataloader, "sampler", None)
        if isinstance(sampler, torch.utils.data.DistributedSampler):
            if training:
                log.warning("the DataLoader brings its own DistributedSampler: its shards are the pipelines' shares, "
                            "their number stays fixed, and a run resumed mid-epoch (a restart after a fatal loss "
                            "too) starts the epoch again; pass shuffle=True or False instead, and the strategy draws "
                            "each step's global batch and resumes at the sample it stopped")
            return dataloader  # the user sharded it already
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        ours: torch.utils.data.Sampler
        if type(sampler) in (torch.utils.data.SequentialSampler, torch.utils.data.RandomSampler):
            shuffle = isinstance(sampler, torch.utils.data.RandomSampler)
            if training and dataloader.batch_size is not None:
                return self._global_step_loader(dataloader, shuffle, seed, pipelines)
            ours = torch.utils.data.DistributedSampler(dataloader.dataset, pipelines, pipeline, shuffle=shuffle, seed=seed)
        else:
            from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

            log.warning("custom sampler %s: a run resumed mid-epoch restarts the epoch, and the number of pipelines "
                        "stays fixed", type(sampler).__name__)
            assert sampler is not None
            ours = DistributedSamplerWrapper(sampler, num_replicas=pipelines, rank=pipeline, shuffle=False)
        return update(dataloader, ours)

    def _global_step_loader(self, dataloader: Any, shuffle: bool, seed: int, pipelines: int) -> Any:
        """``dataloader``'s dataset and worker settings, loading each step's global batch (``StepSampler``)."""
        if self.global_batch is None:  # a resumed or admitted run keeps the global batch it was started with
            self.global_batch = int(dataloader.batch_size) * pipelines
        steps = StepSampler(dataloader.dataset, self.global_batch, shuffle=shuffle, seed=seed,
                            drop_last=bool(dataloader.drop_last), multiple=pipelines)
        if self.resume_cursor is not None:
            steps.resume_at(*self.resume_cursor)
        if type(dataloader) is not torch.utils.data.DataLoader:
            log.warning("%s: the training data is loaded by a torch DataLoader with its dataset and settings",
                        type(dataloader).__name__)
        self.global_batches = True
        return torch.utils.data.DataLoader(
            dataloader.dataset, batch_sampler=steps, num_workers=dataloader.num_workers,
            collate_fn=dataloader.collate_fn, pin_memory=dataloader.pin_memory, timeout=dataloader.timeout,
            worker_init_fn=dataloader.worker_init_fn, multiprocessing_context=dataloader.multiprocessing_context,
            generator=dataloader.generator, prefetch_factor=dataloader.prefetch_factor,
            persistent_workers=dataloader.persistent_workers, pin_memory_device=dataloader.pin_memory_device,
            in_order=getattr(dataloader, "in_order", True),
        )
