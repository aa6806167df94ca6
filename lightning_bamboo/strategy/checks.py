"""The Lightning door's checks of the Trainer and the training data, and its warnings.

The strategy checks the model and the options when the model is connected (before the membership rendezvous) and
the training data before the engine is built (:func:`check_batches`: the batch form from the dataset's first
sample, the batch size against ``micro_batch_size``), so that neither waits for a pipeline and a first step. How a
refusal ends the program (once, without a traceback, exit status 2) is ``runtime.refusal``'s.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from lightning_bamboo.errors import BambooConfigError, batch_form_error
from lightning_bamboo.runtime.session import launched_by_bamboo
from lightning_bamboo.topology.layout import micro_batches, pipeline_share


def warn_if_replicas_cannot_help(redundancy: str) -> None:
    """Once (the caller's rank 0): replicas outside the Bamboo launcher cost memory and time and save nothing."""
    if redundancy in ("lazy", "eager") and not launched_by_bamboo():
        logging.getLogger("lightning_bamboo.strategy").warning(
            "redundancy=%r keeps replicas, but no process survives a death under Lightning's own launcher, so they "
            "cannot save a step; for failover start the job with `python -m lightning_bamboo.launcher --nodes N -- "
            "python SCRIPT.py` (or `--node NAME --workers K` on each machine), else set redundancy='off'", redundancy)


def launched_ranks(local_rank: int, devices: int) -> tuple[int, int] | None:
    """``(RANK, WORLD_SIZE)`` as the Bamboo launcher set them (None outside it), once this worker's ``local_rank``
    is checked against Lightning's ``devices`` (:func:`check_local_rank`)."""
    if not launched_by_bamboo() or not {"RANK", "WORLD_SIZE"} <= set(os.environ):
        return None
    check_local_rank(local_rank, devices)
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def check_local_rank(local_rank: int, devices: int) -> None:
    """Under the Bamboo launcher a worker's ``LOCAL_RANK`` is its index on its machine; Lightning picks its device as
    ``parallel_devices[LOCAL_RANK]``, so ``devices`` must count the workers of one machine."""
    if not 0 <= local_rank < devices:
        raise BambooConfigError(
            f"this worker is number {local_rank} on its machine (LOCAL_RANK {local_rank}, of LOCAL_WORLD_SIZE "
            f"{os.environ.get('LOCAL_WORLD_SIZE', '?')}) and the Trainer has devices={devices}: devices counts the "
            f"workers (GPUs) of one machine, not the job's; pass devices=int(os.environ['LOCAL_WORLD_SIZE'])")


def warn_if_replicas_share_machines(redundancy: str, stages: int, world: int) -> str | None:
    """Once (the caller's rank 0), under the Bamboo launcher: two nodes whose joint loss is fatal (a stage and its
    replica holder; stage 0 and stage ``S - 2``) on one machine (``--workers K``) are lost together when that machine
    is preempted. A warning, not a refusal: one machine (a test, a workstation) still trains, and the checkpoint
    covers such a loss. Only for a job that starts with all its initial nodes (``world``). Returns the message, if
    any."""
    from lightning_bamboo.membership.node import NODES_ENV
    from lightning_bamboo.topology.machines import fatal_conflicts, replica_placement_report
    from lightning_bamboo.topology.replicas import kept_replicas

    nodes = [n for n in os.environ.get(NODES_ENV, "").split(",") if n]
    if redundancy == "off" or not launched_by_bamboo() or len(nodes) != world or world < 2 or world % stages:
        return None
    kept = kept_replicas(nodes, stages, redundancy)  # "auto": only the pairs of the replicas it keeps
    if not fatal_conflicts(nodes, stages, kept=kept):
        return None
    message = "machines as failure domains: " + replica_placement_report(nodes, stages, kept=kept)
    logging.getLogger("lightning_bamboo.strategy").warning("%s", message)
    return message


def _first_batch(loader: Any) -> Any:
    """What the loader's batches look like, from the dataset's first sample through its collate_fn; None where
    that cannot be told without iterating (an iterable dataset, an empty one, one that fails on index 0)."""
    import torch

    dataset = getattr(loader, "dataset", None)
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
        return None
    try:
        if len(dataset) == 0:
            return None
        sample = dataset[0]
        collate = getattr(loader, "collate_fn", None)
        return collate([sample]) if collate is not None else sample
    except Exception:  # noqa: BLE001 - the first batch of the run checks it then
        return None


def check_trainer(trainer: Any, options: Any, precision_flag: Any) -> Any:
    """The Trainer's options that the pipeline engine takes over: gradient accumulation, clipping and precision.
    Returns ``options`` with the precision of Lightning's flag (which must agree with the DeepSpeed config's)."""
    from lightning_bamboo.engine.precision import from_lightning, resolve

    if trainer.accumulate_grad_batches != 1:
        raise BambooConfigError(
            f"strategy='bamboo' accumulates gradients over micro-batches, not over batches "
            f"(accumulate_grad_batches: {trainer.accumulate_grad_batches}); use accumulate_grad_batches=1 and a "
            f"{trainer.accumulate_grad_batches}x larger batch"
        )
    if trainer.gradient_clip_val and trainer.gradient_clip_algorithm not in (None, "norm"):
        raise BambooConfigError(
            f"strategy='bamboo' clips gradients by norm inside the engine "
            f"(gradient_clip_algorithm: {trainer.gradient_clip_algorithm!r}); use gradient_clip_algorithm='norm'"
        )
    name = from_lightning(precision_flag)
    resolve(name, options.deepspeed, trainer.gradient_clip_val)  # Lightning's flags against the DeepSpeed config
    return options.replace(precision=name) if name != "32" and name != options.precision else options


def check_batches(trainer: Any, micro_batch_size: int, pipelines: int, early: bool = False) -> bool:
    """The training data's batches, when fitting: of the form (inputs, targets), and a batch size that splits
    into whole micro-batches (with a plain sampler each step loads the global batch, the DataLoader's batch size
    times ``pipelines``, as ``PipelineData.loader`` does; with another, each pipeline splits its own batch).

    ``early``: when the model is connected, before the membership rendezvous. A LightningDataModule's loader
    needs its ``setup`` first, and a module's loader may too: those are checked later (False: not checked).
    The loader's hook runs once more for this check."""

    source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)
    if source is None or not source.is_defined() or getattr(trainer.state, "fn", None) != "fit":  # TrainerFn.FITTING
        return True  # nothing to check
    if early and any(c.__name__ == "LightningDataModule" for c in type(source.instance).__mro__):
        return False
    try:
        loader = source.dataloader()
    except Exception:  # noqa: BLE001 - it needs a setup that has not run yet: checked before the engine instead
        if early:
            return False
        raise
    check_loader(loader, micro_batch_size, pipelines)
    return True


def check_loader(loader: Any, micro_batch_size: int, pipelines: int) -> None:
    """:func:`check_batches` for one training DataLoader: the form of its batches and its batch size."""
    import torch

    batch = _first_batch(loader)
    if batch is not None and not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise batch_form_error(batch)
    size = getattr(loader, "batch_size", None)
    plain = type(getattr(loader, "sampler", None)) in (torch.utils.data.SequentialSampler, torch.utils.data.RandomSampler)
    if isinstance(size, int) and size > 0:
        if plain:
            pipeline_share(size * pipelines, micro_batch_size, pipelines, 0)
        else:
            micro_batches(size, micro_batch_size, pipelines)


def check_fit_data_before_launch(fit_args: Sequence[Any], trainer: Any, micro_batch_size: int, pipelines: int) -> None:
    """Under Lightning's own launcher, in the launching process before any child starts: the training data of
    ``trainer.fit(model, train_dataloaders, val_dataloaders, datamodule)`` (``fit_args``), where it is a
    DataLoader given to ``fit`` or the module's ``train_dataloader()``. A LightningDataModule's, or a module's
    loader that needs its ``setup`` first, is checked in the processes (:func:`check_batches`)."""
    import torch

    if getattr(getattr(trainer, "state", None), "fn", None) != "fit":  # TrainerFn.FITTING
        return
    model, loaders, _, datamodule = (list(fit_args) + [None] * 4)[:4]
    if datamodule is not None or any(c.__name__ == "LightningDataModule" for c in type(loaders).__mro__):
        return
    if loaders is None and callable(getattr(model, "train_dataloader", None)):
        try:
            loaders = model.train_dataloader()
        except Exception:  # noqa: BLE001 - it needs a setup that has not run yet: checked in the processes
            return
    if isinstance(loaders, torch.utils.data.DataLoader):
        check_loader(loaders, micro_batch_size, pipelines)
