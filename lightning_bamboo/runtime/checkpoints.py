"""``StageCheckpoints``: a stage's part of the job's checkpoints: its layer files, its shard for an asynchronous save,
and the resume that loads any saved layout into the stage and its replica."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from lightning_bamboo import checkpoint as ckpt
from lightning_bamboo.runtime.stage import NodeStage, States
from lightning_bamboo.testing import faults

log = logging.getLogger(__name__)


class StageCheckpoints:
    """Saves and loads the checkpoints of ``stage`` (a :class:`NodeStage`): a checkpoint holds one file per layer
    (written by the first pipeline) and the manifest (rank 0), so any layout reads it back."""

    def __init__(self, stage: NodeStage) -> None:
        self._stage = stage
        self._resume: tuple[Any, dict[str, Any]] | None = None  # (path, meta) of the checkpoint being loaded
        self._saved_reads: dict[tuple[int, int], States] = {}  # layer files read for that resume

    def bamboo_meta(self, with_optimizer: bool = True, **door: Any) -> dict[str, Any]:
        """The checkpoint manifest's ``"bamboo"`` entry for the running stage (``checkpoint.bamboo_meta``: the layout,
        the optimizer's hyperparameters, ties, seed, redundancy, world size, precision), with what the front door
        adds (``door``: Lightning's data ``cursor`` and ``step``, the DeepSpeed door's ``global_steps``). Both doors
        build their manifests here."""
        stage = self._stage
        engine, layout = stage.require_stage()
        return ckpt.bamboo_meta(layout.num_layers, layout.parts, layout.pipelines,
                                engine.optimizer if with_optimizer else None, ties=getattr(engine.module, "ties", None),
                                seed=stage.seed, redundancy=stage.config.redundancy, world_size=layout.world_size,
                                **stage.precision_meta(), **door)

    def shard(self, meta: Callable[[], dict[str, Any]] | None, with_optimizer: bool,
              reuse: ckpt.Shard | None = None) -> ckpt.Shard:
        """This process's part of a checkpoint, copied to host memory (no collective; see ``AsyncCheckpoint``)."""
        stage = self._stage
        engine, _ = stage.require_stage()
        shard = ckpt.take_shard(stage.rank, engine.module, engine.optimizer if with_optimizer else None,
                                engine.layer_range, writes_layers=stage.pipeline_rank == 0, meta=meta, reuse=reuse)
        if shard.meta is not None and stage.session is not None:
            shard.fence = stage.session.confirm_member  # a node declared lost meanwhile must not commit it
        return shard

    def save(self, path: Any, meta: Callable[[], dict[str, Any]], with_optimizer: bool, is_global_zero: bool,
             barrier: Callable[[str], None], step: int | None = None) -> None:
        """Every process writes its layers (one pipeline per stage), rank 0 the manifest; then swap in. A collective:
        run it through :meth:`PipelineRunner.resilient`."""
        stage = self._stage
        engine, _ = stage.require_stage()
        session = stage.session

        def barrier_between(name: str) -> None:
            if session is not None and name == "bamboo_checkpoint_layers":
                # tests: a node that dies in the middle of a save (BAMBOO_FAIL_AT=node@save<step>)
                faults.reached(session.node, f"save{step}")
            barrier(name)

        ckpt.save_sharded(path, engine.module, engine.optimizer if with_optimizer else None, engine.layer_range, meta,
                          is_global_zero=is_global_zero, writes_layers=stage.pipeline_rank == 0,
                          barrier=barrier_between, rank=stage.rank,
                          fence=session.confirm_member if session is not None else None)

    def saved_rng(self, path: Any, meta: dict[str, Any]) -> dict[str, Any] | None:
        """This process's random number generators as the checkpoint at ``path`` saved them, when it was saved by as
        many processes as run now (a stream belongs to a process); else None, said once in a warning. Both doors
        restore them before the first step they train after the resume."""
        stage = self._stage
        saved, world = meta["bamboo"].get("world_size"), stage.layout.world_size if stage.layout is not None else None
        if saved is not None and saved == world:
            return ckpt.read_rng(path, stage.rank)
        if saved is not None:
            log.warning("checkpoint %s was saved by %s processes, this run has %s: random number generators are not "
                        "restored (their streams belong to processes); weights, optimizer state and data order are",
                        path, saved, world)
        return None

    def resume_from(self, path: Any, meta: dict[str, Any]) -> None:
        """The checkpoint the next :meth:`load_weights` and :meth:`load_optimizer` read (any saved layout)."""
        self._resume, self._saved_reads = (path, meta), {}

    def resumed(self) -> None:
        """The resume is done: the layer files read for it are not needed any more."""
        self._saved_reads = {}

    def _saved_states(self, layers: range) -> States:
        layout = self._stage.layout
        assert self._resume is not None and layout is not None
        path, meta = self._resume
        saved_layers = meta["bamboo"]["num_layers"]
        if saved_layers != layout.num_layers:
            raise ckpt.CheckpointError(f"checkpoint {path} holds {saved_layers} layers but configure_pipeline() "
                                       f"builds {layout.num_layers}")
        # weights and optimizer state are loaded by two calls: each layer file is read once per resume
        key = (layers.start, layers.stop)
        if key not in self._saved_reads:
            self._saved_reads[key] = ckpt.read_layers(path, layers)
        return self._saved_reads[key]

    def load_weights(self, strict: bool = True) -> None:
        """The stage's weights from the checkpoint, and the replica's too: a replica is the successor's state
        as saved, never the seed's (a failover after a resume trains on it)."""
        engine, _ = self._stage.require_stage()
        ckpt.load_weights(engine.module, self._saved_states(engine.layer_range), strict=strict)
        if engine.replica is not None:
            ckpt.load_weights(engine.replica.module, self._saved_states(engine.replica.layers), strict=strict)
            engine.replica.changed()

    def load_optimizer(self) -> None:
        """The stage's optimizer state (moments, step counts, hyperparameters) from the checkpoint, and the replica's."""
        engine, _ = self._stage.require_stage()
        assert self._resume is not None
        groups = self._resume[1]["bamboo"]["param_groups"]
        ckpt.load_optimizer(engine.module, engine.optimizer, self._saved_states(engine.layer_range), groups)
        if engine.replica is not None:
            replica = engine.replica
            ckpt.load_optimizer(replica.module, replica.optimizer, self._saved_states(replica.layers), groups)
