"""Failover metrics in the Trainer's loggers: how many failovers, how long the last one took, how many nodes are live.

``BambooStrategy`` adds a ``FailoverMetrics`` to every Trainer it runs under the Bamboo launcher (see
``add_failover_metrics``), so a TensorBoard or CSV logger of a run with preemptions shows:

- ``bamboo/failovers``: failovers so far (each served from the replicas, or by dropping a damaged pipeline);
- ``bamboo/recovery_seconds``: the last failover's duration, from the loss found to the pipeline re-formed;
- ``bamboo/live_nodes``: nodes in the running layout.

A row is written at the first step and whenever one of them changes (not every step).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl


class FailoverMetrics(pl.Callback):
    def __init__(self) -> None:
        self._last: tuple[int, int] | None = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        runner = getattr(trainer.strategy, "runner", None)
        if runner is None or runner.session is None or not trainer.loggers:
            return  # not under the Bamboo launcher: no node can be lost and replaced
        failovers = list(runner.failovers)
        live = len(runner.nodes) or trainer.world_size
        if (len(failovers), live) == self._last:
            return
        self._last = (len(failovers), live)
        metrics = {"bamboo/failovers": float(len(failovers)), "bamboo/live_nodes": float(live)}
        if failovers:
            metrics["bamboo/recovery_seconds"] = float(failovers[-1].seconds)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)


def add_failover_metrics(trainer: Any) -> None:
    """Add a ``FailoverMetrics`` to ``trainer`` unless it has one (the strategy calls this in its ``setup``).

    Lightning's callbacks of either namespace (``lightning.pytorch``, ``pytorch_lightning``) call the same hooks.
    """
    if not any(isinstance(cb, FailoverMetrics) for cb in trainer.callbacks):
        trainer.callbacks.append(FailoverMetrics())
