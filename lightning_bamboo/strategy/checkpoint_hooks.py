"""``BambooStrategy``'s checkpoint hooks: per-layer files any layout can read, and the resume into the runner."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from lightning_bamboo import checkpoint as ckpt
from lightning_bamboo.errors import BambooConfigError

if TYPE_CHECKING:
    from lightning.pytorch.strategies import DDPStrategy as _Lightning

    from lightning_bamboo.runtime.runner import PipelineRunner
    from lightning_bamboo.strategy.loading import PipelineData
    from lightning_bamboo.strategy.restart import FitRestarts
else:
    _Lightning = object

log = logging.getLogger(__name__)


class CheckpointHooks(_Lightning):
    """Lightning's checkpoint hooks of ``BambooStrategy``: weights and optimizer state never pass through
    Lightning's state dicts; each process writes and reads its layers (``lightning_bamboo.checkpoint``)."""

    runner: PipelineRunner
    data: PipelineData
    redundancy: str
    _loaded_path: Path | None
    _admitted_checkpoint: dict[str, Any] | None
    _resume_rng: dict[str, Any] | None
    restarts: FitRestarts

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # weights are loaded into the engine's stage, which exists only after setup()

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # weights are saved per layer by save_checkpoint

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # saved per layer by save_checkpoint

    def checkpoint_meta(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """``meta.pt``: Lightning's checkpoint dict without weights, plus what a reader of any layout needs."""
        out = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        out["optimizer_states"] = []
        out["bamboo"] = self.runner.checkpoints.bamboo_meta(bool(self.optimizers), cursor=self.data.state(),
                                                            step=checkpoint.get("global_step"))
        return out

    def checkpoint_shard(self, checkpoint: dict[str, Any], reuse: ckpt.Shard | None = None) -> ckpt.Shard:
        """This process's part of a checkpoint, copied to host memory (no collective; see ``AsyncCheckpoint``).

        Its layers (one pipeline per stage writes them), its RNG states and, on rank 0, the manifest;
        ``reuse`` is an earlier shard, already written, whose buffers the copy overwrites.
        """
        meta = (lambda: self.checkpoint_meta(checkpoint)) if self.is_global_zero else None
        return self.runner.checkpoints.shard(meta, with_optimizer=bool(self.optimizers), reuse=reuse)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Every process writes its layers (one pipeline per stage) and RNG states, rank 0 the manifest; then swap in.

        A loss during the save fails over and saves again from the start in the new layout.
        """
        if storage_options is not None:
            raise BambooConfigError("strategy='bamboo' does not take storage_options in save_checkpoint")
        self.runner.resilient(lambda: self.runner.checkpoints.save(
            filepath, lambda: self.checkpoint_meta(checkpoint), with_optimizer=bool(self.optimizers),
            is_global_zero=self.is_global_zero, barrier=self.barrier, step=checkpoint.get("global_step"),
        ))
        self.restarts.saved_checkpoint(filepath, checkpoint.get("global_step"))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if self._admitted_checkpoint is not None:
            # A node admitted into a running job has its layers, optimizer state, loops and cursor from a
            # running node (``start_admitted``), not from the file the job last started from: a restarted
            # job starts the nodes that join it later with the same ``ckpt_path``.
            return self._admitted_checkpoint
        # a directory of step checkpoints (AsyncCheckpoint's dirpath) resumes from the latest complete one,
        # as rank 0 sees it (all processes call load_checkpoint; a writer may still be committing)
        checkpoint_path = Path(self.broadcast(str(ckpt.resolve_checkpoint(checkpoint_path))))
        meta = ckpt.read_meta(checkpoint_path)
        self._loaded_path = checkpoint_path
        self.restarts.loaded_checkpoint(checkpoint_path, meta)
        self.runner.checkpoints.resume_from(checkpoint_path, meta)
        precision = self.runner.resolve_precision(meta["bamboo"].get("loss_scale"))  # fp16: the saved loss scale goes on
        saved_precision = meta["bamboo"].get("precision", "32")
        if saved_precision != precision.name:
            log.warning(
                "checkpoint %s was trained in %s and this run computes in %s: it continues from the saved fp32 master "
                "weights and optimizer state (every precision keeps them in fp32)%s", checkpoint_path,
                {"32": "fp32", "16": "fp16"}.get(saved_precision, saved_precision), precision.describe(),
                "; fp16's loss scale starts afresh" if precision.state is not None and "loss_scale" not in meta["bamboo"]
                else "",
            )
        self.data.restore(meta["bamboo"])
        self._resume_rng = self.runner.checkpoints.saved_rng(checkpoint_path, meta)
        return {**meta, "state_dict": {}}

    @override
    def on_train_start(self) -> None:
        # Restored as late as possible: after Lightning created the data iterator, which draws a
        # seed from torch's generator exactly as the uninterrupted run did before its first step.
        super().on_train_start()
        admitted, self._admitted_checkpoint = self._admitted_checkpoint, None  # a later fit() reads its own ckpt_path
        self.runner.checkpoints.resumed()
        if self._resume_rng is not None:
            ckpt.restore_rng(self._resume_rng)
            self._resume_rng = None
        if admitted is None and self._loaded_path is not None:
            # a resume (also a restart from a checkpoint): replicas must be the loaded stages before a failover
            # can take one over (an admitted node was audited with the nodes that admitted it)
            self.runner.resilient(lambda: self.runner.audit("resumed before"))
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]  # (set: training starts)
        self.restarts.training_started(trainer)
        if self.runner.restarting:  # after a fatal loss: its one record, now that the checkpoint is loaded
            self.runner.restarted(str(self._loaded_path) if self._loaded_path is not None else None,
                                  int(trainer.global_step))

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if self._loaded_path is not None:
            self.runner.checkpoints.load_weights(strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if self._loaded_path is not None and self.optimizers:
            self.runner.checkpoints.load_optimizer()

