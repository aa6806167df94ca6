"""A fatal loss under the Bamboo launcher restarts ``trainer.fit`` in the running processes, from the last complete
checkpoint, without the user's script knowing.

``trainer.fit`` runs through the strategy's launcher (``patches._RestartingLauncherMixin``); when a fatal loss ends
it, the survivors re-form (``PipelineRunner.restart``), agree on the newest complete checkpoint any of them knows
(a synchronous save of this run, an ``AsyncCheckpoint`` directory's, the checkpoint the run started from), put away
what the failed attempt left (its data iterators, an asynchronous write waiting for shards the lost nodes will never
write, the callbacks' and the module's set-up), and run Lightning's fit again with that checkpoint: Lightning
restores the loops, callbacks and schedulers from it as for ``fit(ckpt_path=...)``, the strategy the layers and the
data cursor. Without a complete checkpoint the job starts again from its start (step 0, the seed's weights), with
a warning: what a checkpoint-restart launcher does for a script that saved nothing.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning_bamboo import checkpoint as ckpt
from lightning_bamboo.errors import FatalLoss, Released

log = logging.getLogger(__name__)

#: the position of ``ckpt_path`` in the arguments Lightning's ``trainer.fit`` passes to ``Trainer._fit_impl``
#: (model, train_dataloaders, val_dataloaders, datamodule, ckpt_path, weights_only)
CKPT_PATH_ARG = 4


class FitRestarts:
    """What a restart of ``trainer.fit`` needs to know of the run: the checkpoints it completed, and its loops' state
    at its start (for a restart without any checkpoint)."""

    def __init__(self) -> None:
        self.saved: dict[str, int] = {}  # a complete synchronous save's path -> its global step
        self.started_from: tuple[int, str] | None = None  # the checkpoint the run first resumed from
        self.start_loops: dict[str, Any] | None = None  # trainer.fit_loop.state_dict() as the first fit started

    def saved_checkpoint(self, path: Any, step: int | None) -> None:
        """A synchronous save of every process's part of ``path`` returned: it is complete."""
        self.saved[str(path)] = int(step or 0)

    def loaded_checkpoint(self, path: Path, meta: dict[str, Any]) -> None:
        if self.started_from is None:
            self.started_from = (int(meta["bamboo"].get("step") or meta.get("global_step") or 0), str(path))

    def training_started(self, trainer: Any) -> None:
        if self.start_loops is None:
            self.start_loops = copy.deepcopy(trainer.fit_loop.state_dict())

    def candidates(self, trainer: Any) -> Iterator[tuple[int, str]]:
        """``(step, path)`` of every complete checkpoint this run knows of."""
        for path, step in self.saved.items():
            if (Path(path) / ckpt.META).exists():  # (ModelCheckpoint may have deleted it since)
                yield step, path
        if self.started_from is not None and (Path(self.started_from[1]) / ckpt.META).exists():
            yield self.started_from
        for callback in trainer.callbacks:
            checkpoints = getattr(callback, "complete_checkpoints", None)
            if callable(checkpoints):
                yield from checkpoints()


def put_away(strategy: Any, trainer: Any) -> None:
    """What an attempt of ``fit`` that a fatal loss or a release ended leaves: an asynchronous write waiting for
    shards that will never come, its data iterators, the callbacks' and the module's set-up (their ``teardown``:
    the next attempt's ``setup`` calls them again), the strategy's start (an admission, a resume's RNG)."""
    call = strategy.pl_package("trainer.call")
    for callback in trainer.callbacks:  # before the teardown hooks, which wait for what is in flight
        before = getattr(callback, "before_restart", None)
        if callable(before):
            before()
    fn = trainer.state.fn
    call._call_callback_hooks(trainer, "teardown", stage=fn)
    call._call_lightning_module_hook(trainer, "teardown", stage=fn)
    trainer.fit_loop.teardown()
    trainer.fit_loop._combined_loader = None  # the data again, cut for the pipelines of the new layout
    trainer._logger_connector.teardown()
    strategy.forget_start()
    model = strategy.lightning_module
    if model is not None and hasattr(model, "_bamboo_stage"):
        del model._bamboo_stage  # the old stage's layers: not held while this node stands by, or builds its next
    strategy.optimizers = []  # (their parameters too)


def stand_by_fit(strategy: Any, trainer: Any, fit_args: tuple[Any, ...]) -> tuple[Any, ...]:
    """This node left the layout (``Released``) and stands by in its process: its attempt put away, it waits for an
    admission (then ``fit`` runs again from the running nodes' state) or the job's end (``SystemExit(0)``)."""
    put_away(strategy, trainer)
    return _await_admission(strategy, fit_args)


def _await_admission(strategy: Any, fit_args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Wait, standing by, for an admission or the job's end (the attempt already put away)."""
    # no rank while it stands by: Lightning's rank-zero work (a logger's last save when the job's end ends this wait)
    # belongs to the running layout's rank 0, which may write the same files (it was this node's rank before)
    strategy.pl_package("utilities.rank_zero").rank_zero_only.rank = -1
    strategy.admit()
    return fit_args


def restart_fit(strategy: Any, trainer: Any, err: FatalLoss, fit_args: tuple[Any, ...]) -> tuple[Any, ...]:
    """After ``err`` ended ``trainer.fit``: re-form the survivors and put the failed attempt away; returns the
    arguments to run Lightning's fit again with (``ckpt_path``: the agreed checkpoint, or None). A node the survivors
    restart without stands by instead, as :func:`stand_by_fit`."""
    runner, restarts = strategy.runner, strategy.restarts
    put_away(strategy, trainer)
    try:
        strategy._assigned = runner.restart(err)
    except Released:  # the survivors restarted without this node (it was late): it stands by, as a released node
        return _await_admission(strategy, fit_args)
    agreed = runner.restart_checkpoint(lambda: restarts.candidates(trainer))
    if agreed is None:
        log.warning("%s: no complete checkpoint to restart from; the job starts again from step 0",
                    runner.session.node if runner.session is not None else "this node")
        if restarts.start_loops is not None:
            trainer.fit_loop.load_state_dict(copy.deepcopy(restarts.start_loops))
        strategy.data.restore({})
    args = list(fit_args) + [None] * max(0, CKPT_PATH_ARG + 1 - len(fit_args))
    args[CKPT_PATH_ARG] = agreed[1] if agreed is not None else None
    return tuple(args)
