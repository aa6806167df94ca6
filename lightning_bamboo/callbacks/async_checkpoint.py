"""``AsyncCheckpoint``: snapshot to host memory on the training thread, write on one background thread."""

from __future__ import annotations

import logging
import math
import os
import random
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as torch_dist

from lightning_bamboo import checkpoint as ckpt
from lightning_bamboo.errors import BambooConfigError, BambooError
from lightning_bamboo.membership.node import NODE_ENV
from lightning_bamboo.testing import faults

log = logging.getLogger(__name__)

DEFAULT_OVERHEAD_BUDGET = 0.035  # CheckFreq's target: checkpointing costs <= 3.5% of training time
ON_EXCEPTION_GRACE_SECONDS = 60.0  # how long a failing run lets the checkpoint in flight finish


class AsyncCheckpointError(BambooError, RuntimeError):
    """Writing an asynchronous checkpoint failed (raised at the next save or at the end of training)."""


class AsyncCheckpoint(pl.Callback):
    """Checkpoint every ``every_n_train_steps`` steps, or as often as ``overhead_budget`` allows, without waiting for the disk.

    At a checkpoint step each process copies its layers (weights and optimizer state), its
    RNG states and, on rank 0, Lightning's checkpoint dict (loops, callbacks, data cursor) to
    host memory; that is all the training thread waits for. One worker thread per process
    then writes the copy into ``DIRPATH/step-NNNNNNNN`` with the per-layer format of
    ``lightning_bamboo.checkpoint``: every file goes to a temporary name, is fsynced and
    renamed; each process leaves a done marker; rank 0's worker writes ``meta.pt`` only when
    every marker is there and renames the directory into place. So a crash at any moment
    leaves the previous checkpoints loadable, and ``trainer.fit(ckpt_path=...)`` resumes from
    any of them in any layout (stages x pipelines).

    A failed write is raised at the next checkpoint step on every process (they agree through
    one small all-reduce on the training thread, never on the worker) and at the end of training.

    With ``every_n_train_steps=None`` the interval is chosen CheckFreq-style: after each
    checkpoint the measured cost (training-thread stall plus the slow-down of the steps that ran
    while the worker wrote) is divided by ``overhead_budget`` x the step time, and the interval
    is also at least the write time, so the worker is idle when the next snapshot comes.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        every_n_train_steps: int | None = None,
        keep_last: int = 2,
        overhead_budget: float = DEFAULT_OVERHEAD_BUDGET,
        first_auto_step: int = 3,
        commit_timeout: float = 600.0,
    ) -> None:
        """
        Args:
            dirpath: directory of the checkpoints (shared by all nodes); default
                ``<trainer.default_root_dir>/async_checkpoints``.
            every_n_train_steps: checkpoint when the global step is a multiple of it; ``None``:
                choose the interval automatically within ``overhead_budget``.
            keep_last: how many complete checkpoints to keep (older ones are deleted after a commit).
            overhead_budget: automatic interval: the fraction of training time checkpointing may cost.
            first_auto_step: automatic interval: the step of the first checkpoint, which measures the cost.
            commit_timeout: seconds rank 0's worker waits for the other processes' files before it
                reports the checkpoint as failed.
        """
        super().__init__()
        if every_n_train_steps is not None and (not isinstance(every_n_train_steps, int) or every_n_train_steps < 1):
            raise BambooConfigError(
                f"every_n_train_steps must be a positive integer, or None for an automatic interval "
                f"(every_n_train_steps: {every_n_train_steps!r})"
            )
        if not isinstance(keep_last, int) or keep_last < 1:
            raise BambooConfigError(f"keep_last must be a positive integer (keep_last: {keep_last!r})")
        if not 0 < overhead_budget < 1:
            raise BambooConfigError(
                f"overhead_budget is a fraction of training time, between 0 and 1 exclusive "
                f"(overhead_budget: {overhead_budget!r}); the default is {DEFAULT_OVERHEAD_BUDGET}"
            )
        if not isinstance(first_auto_step, int) or first_auto_step < 1:
            raise BambooConfigError(f"first_auto_step must be a positive integer (first_auto_step: {first_auto_step!r})")
        if not commit_timeout or commit_timeout <= 0:
            raise BambooConfigError(f"commit_timeout must be a positive number of seconds (commit_timeout: {commit_timeout!r})")
        self.dirpath = dirpath
        self.every_n_train_steps = every_n_train_steps
        self.keep_last = keep_last
        self.overhead_budget = float(overhead_budget)
        self.first_auto_step = first_auto_step
        self.commit_timeout = float(commit_timeout)
        # measurements (automatic interval) and schedule; saved with the checkpoint
        self.interval: int | None = every_n_train_steps
        self.step_seconds: float | None = None  # moving average of a step without a write in flight
        self.stall_seconds: float | None = None  # training-thread time of the last snapshot
        self.write_seconds: float | None = None  # worker time of the last write
        self.interference_seconds = 0.0  # extra step time while the last write was in flight
        self.events: list[dict[str, Any]] = []  # one entry per checkpoint: step, path, stall, interval
        self._next_step: int | None = None
        self._last_saved_step: int | None = None
        self._token = ""
        self._dir: Path | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._pending_shard: ckpt.Shard | None = None  # being written
        self._pending_world: tuple[int, Any, tuple[str, ...] | None] | None = None  # who writes it (``_world``)
        self._cancel = threading.Event()
        self._written: ckpt.Shard | None = None  # on disk: its buffers are reused by the next snapshot
        self._pending_path: Path | None = None
        self._error: BaseException | None = None
        self._last_batch_end: float | None = None

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not callable(getattr(trainer.strategy, "checkpoint_shard", None)):
            raise BambooConfigError(
                f"AsyncCheckpoint saves per-layer checkpoints through strategy='bamboo' (strategy: "
                f"{type(trainer.strategy).__name__}); use Trainer(strategy='bamboo') or Lightning's ModelCheckpoint"
            )
        dirpath = self.dirpath or os.path.join(trainer.default_root_dir, "async_checkpoints")
        self._dir = Path(trainer.strategy.broadcast(str(dirpath)))
        # a token names each checkpoint's staging directory, so that files left by a killed run (or by an attempt
        # a fatal loss ended) never count: agreed by every process in each save's ``_agree``
        self._token = uuid.uuid4().hex[:12]
        self._dir.mkdir(parents=True, exist_ok=True)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bamboo-async-checkpoint")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.every_n_train_steps is None:
            self._next_step = trainer.global_step + (self.interval or self.first_auto_step)
        self._last_batch_end = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._measure_step(time.perf_counter())
        step = trainer.global_step
        if self._due(step):
            stall = self._save(trainer, step)
            pl_module.log("async_checkpoint/stall_seconds", stall, on_step=True, on_epoch=False, rank_zero_only=True)
            pl_module.log("async_checkpoint/interval", float(self.interval or 0), on_step=True, on_epoch=False, rank_zero_only=True)
            if self.write_seconds is not None:
                pl_module.log("async_checkpoint/write_seconds", self.write_seconds, on_step=True, on_epoch=False, rank_zero_only=True)
        self._last_batch_end = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending is not None and self._pending_world != self._world(trainer):
            self.abandon_pending()
        self._wait()
        self._raise_stored()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Let the write in flight finish (it may be the newest state to restart from), but do not
        # wait out commit_timeout for processes that the same failure may have taken down.
        pending = self._pending
        if pending is not None:
            try:
                pending.exception(timeout=min(self.commit_timeout, ON_EXCEPTION_GRACE_SECONDS))
            except FutureTimeout:
                self.abandon_pending()
        self._wait()
        if self._error is not None:
            log.error("asynchronous checkpoint %s failed as well: %r", self._pending_path, self._error)
            self._error = None

    def before_restart(self) -> None:
        """A fatal loss restarts the job (``BambooStrategy.restart_fit``): the write in flight waits for shards that
        lost nodes will never write, so it is given up unless it committed already; a failed write is reported,
        and the restart goes on from the checkpoints committed before it."""
        self.abandon_pending()
        self._wait()
        if self._error is not None:
            log.error("asynchronous checkpoint %s failed before the restart: %r", self._pending_path, self._error)
            self._error = None

    def complete_checkpoints(self) -> list[tuple[int, str]]:
        """``(step, path)`` of every complete checkpoint in this callback's directory (a restart's candidates)."""
        found = ckpt.complete_checkpoints(self._dir or self.dirpath or ".")
        return [(int(p.name.split("-", 1)[1]), str(p)) for p in found]

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._executor is not None:
            self._wait()
            self._executor.shutdown(wait=True)
            self._executor = None
        self._written = None  # give the host buffers back
        self._raise_stored()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "interval": self.interval,
            "step_seconds": self.step_seconds,
            "stall_seconds": self.stall_seconds,
            "write_seconds": self.write_seconds,
            "interference_seconds": self.interference_seconds,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.every_n_train_steps is None:
            self.interval = state_dict.get("interval")
        self.step_seconds = state_dict.get("step_seconds")
        self.stall_seconds = state_dict.get("stall_seconds")
        self.write_seconds = state_dict.get("write_seconds")
        self.interference_seconds = float(state_dict.get("interference_seconds") or 0.0)

    @property
    def latest(self) -> Path | None:
        """The most recently committed checkpoint of this callback's directory (pass it to ``fit(ckpt_path=...)``)."""
        return ckpt.latest_checkpoint(self._dir or self.dirpath or ".")

    # ------------------------------------------------------------------ the interval
    def _due(self, step: int) -> bool:
        if step == self._last_saved_step:
            return False
        if self.every_n_train_steps is not None:
            return step % self.every_n_train_steps == 0
        return self._next_step is not None and step >= self._next_step

    def _measure_step(self, now: float) -> None:
        if self._last_batch_end is None:
            return
        seconds = now - self._last_batch_end
        if self._pending is not None and not self._pending.done() and self.step_seconds is not None:
            self.interference_seconds += max(0.0, seconds - self.step_seconds)
        elif self.step_seconds is None:
            self.step_seconds = seconds
        else:
            self.step_seconds = 0.8 * self.step_seconds + 0.2 * seconds

    def proposed_interval(self) -> int:
        """CheckFreq's rule: steps between checkpoints so that their cost stays within the budget."""
        if self.every_n_train_steps is not None:
            return self.every_n_train_steps
        if not self.step_seconds or self.stall_seconds is None:
            return self.first_auto_step
        cost = self.stall_seconds + self.interference_seconds
        by_budget = math.ceil(cost / (self.overhead_budget * self.step_seconds))
        by_writer = math.ceil((self.write_seconds or 0.0) / self.step_seconds)
        return max(1, by_budget, by_writer)

    # ------------------------------------------------------------------ saving
    def _save(self, trainer: pl.Trainer, step: int) -> float:
        start = time.perf_counter()
        if self._pending is not None and self._pending_world != self._world(trainer):
            self.abandon_pending()  # a failover or reconfiguration: some writers of it are gone
        self._wait()  # at most one snapshot in flight per process; counted as stall
        waited = time.perf_counter() - start
        self._agree(trainer)
        self.interference_seconds = 0.0
        assert self._dir is not None and self._executor is not None
        path = self._dir / ckpt.step_name(step)
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)  # trusted: a save (with the optimizer), no load
        # the previous shard is on disk (waited for above): its host buffers take this copy
        shard = trainer.strategy.checkpoint_shard(checkpoint, reuse=self._written)  # type: ignore[attr-defined]
        self._written = None
        self._pending_path = path
        self._cancel = threading.Event()
        self._pending = self._executor.submit(self._persist, path, shard, trainer.world_size, self._cancel, step)
        self._pending_world = self._world(trainer)
        self._pending_shard = shard
        self._last_saved_step = step
        stall = time.perf_counter() - start
        self.stall_seconds = stall
        event = {"step": step, "path": str(path), "stall_seconds": stall, "waited_for_previous_seconds": waited,
                 "interval": self.interval}
        self.events.append(event)
        log.info("async checkpoint %s: training thread stalled %.3f s, next in %s steps", path, stall, self.interval)
        return stall

    @staticmethod
    def _world(trainer: pl.Trainer) -> tuple[int, Any, tuple[str, ...] | None]:
        """Who writes a snapshot taken now: the world size, the layout and, under the Bamboo launcher, the nodes in
        rank order (a node lost and another admitted in its place give an equal layout of other writers: the
        snapshot's shard of the lost one will never come)."""
        runner = getattr(trainer.strategy, "runner", None)
        nodes = tuple(runner.nodes) if runner is not None and getattr(runner, "session", None) is not None else None
        return trainer.world_size, getattr(trainer.strategy, "layout", None), nodes

    def abandon_pending(self) -> None:
        """Give up the checkpoint in flight if it is not committed yet (its writers changed); not an error.

        Called by the next save when the world size or the layout differs from the snapshot's;
        a failover may call it at once. The checkpoints committed before stay.
        """
        if self._pending is not None and not self._pending.done():
            log.warning("abandoning asynchronous checkpoint %s: the processes that write it changed", self._pending_path)
            self._cancel.set()

    def _persist(self, path: Path, shard: ckpt.Shard, world_size: int, cancelled: threading.Event, step: int) -> float:
        start = time.perf_counter()
        node = os.environ.get(NODE_ENV)
        # tests: a node that dies while its writer thread writes (BAMBOO_FAIL_AT=node@asyncwrite<step>)
        progress = (lambda _file: faults.reached(node, f"asyncwrite{step}")) if node else None
        ckpt.persist(
            path, shard, world_size=world_size, token=self._token, timeout=self.commit_timeout,
            keep_last=self.keep_last, cancelled=cancelled, progress=progress,
        )
        self.write_seconds = time.perf_counter() - start
        return self.write_seconds

    def _wait(self) -> None:
        """Wait for the write in flight; keep its error for the next save or the end of training."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        error = pending.exception()
        if isinstance(error, ckpt.CheckpointAbandoned):
            log.warning("%s", error)
        elif error is not None and self._error is None:
            self._error = error
        self._written, self._pending_shard = (self._pending_shard if error is None else None), None

    def _agree(self, trainer: pl.Trainer) -> None:
        """One all-reduce on the training thread: did any process's last write fail, the next interval, and the token
        of this checkpoint's staging directory."""
        world = trainer.world_size
        flags = torch.zeros(world + 2, dtype=torch.float64)
        flags[trainer.global_rank] = 1.0 if self._error is not None else 0.0
        flags[world] = float(self.proposed_interval())
        # the checkpoint's token: the largest of every process's random proposal (exact in float64 below 2**53), so
        # that a node admitted into the running job, whose set-up met no other process, writes where the others do
        flags[world + 1] = float(random.SystemRandom().getrandbits(52))
        if world > 1 and torch_dist.is_available() and torch_dist.is_initialized():
            # through the strategy: under the Bamboo launcher its collectives survive a lost node
            device = trainer.strategy.root_device
            flags = trainer.strategy.reduce(flags.to(device), reduce_op="max").cpu()
        failed = [r for r in range(world) if flags[r] > 0]
        if failed:
            self._raise_stored(failed)
        self._token = f"{int(flags[world + 1]):013x}"
        self.interval = int(flags[world])
        if self.every_n_train_steps is None:
            self._next_step = trainer.global_step + self.interval

    def _raise_stored(self, failed: list[int] | None = None) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise AsyncCheckpointError(
                f"writing asynchronous checkpoint {self._pending_path} failed: {error!r}; the checkpoints "
                f"committed before it are intact (latest: {self.latest}); fix the cause (disk space, "
                f"permissions of {self._dir}) and resume from the latest one"
            ) from error
        if failed:
            raise AsyncCheckpointError(
                f"writing asynchronous checkpoint {self._pending_path} failed on processes {failed}; see their "
                f"logs for the cause; the checkpoints committed before it are intact (latest: {self.latest})"
            )
