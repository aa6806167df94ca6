"""``BambooStrategy``: Lightning training on DeepSpeed's pipeline engine.

Lightning has two namespaces (``lightning.pytorch`` and ``pytorch_lightning``) with separate
class hierarchies, so the logic lives in a mixin and each namespace gets its own subclass of
its ``DDPStrategy`` (see :func:`make_strategy_class`).
"""

from __future__ import annotations

import atexit
import base64
import faulthandler
import gc
import importlib
import io
import logging
import os
import sys
import threading
import time
import types
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as torch_dist

from lightning_bamboo import checkpoint as ckpt
from lightning_bamboo.data import StepSampler
from lightning_bamboo.engine.partition import compute_parts
from lightning_bamboo.errors import BambooConfigError, BambooError
from lightning_bamboo.topology.layout import (
    REDUNDANCY_MODES,
    Layout,
    check_partition_option,
    check_replica_memory,
    micro_batches,
    partition_weights,
    pipeline_share,
    resolve_stages,
)

if TYPE_CHECKING:
    from lightning_bamboo.engine.replica import StageContainer

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_SECONDS = 300.0


class _BambooStrategyMixin:
    """Train a LightningModule as a DeepSpeed pipeline: ``stages`` deep, ``devices // stages`` pipelines wide.

    The module defines ``configure_pipeline()`` (the layers, in order), ``pipeline_loss(outputs,
    targets)`` and ``configure_optimizers()``; each batch ``(inputs, targets)`` is split into
    micro-batches of ``micro_batch_size`` and run by the engine's 1F1B schedule.
    """

    strategy_name = "bamboo"
    _pl_name = "lightning.pytorch"  # set per namespace by make_strategy_class

    def __init__(
        self,
        stages: int | None = None,
        micro_batch_size: int = 1,
        partition: str | list[int] = "parameters",
        seed: int | None = None,
        redundancy: str = "off",
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        detection_timeout: float = 10.0,
        config: dict[str, Any] | None = None,
        process_group_backend: str | None = None,
        rf_costs: str | dict[str, float] = "measured",
        audit_replicas: bool = False,
        **kwargs: Any,
    ) -> None:
        """
        Args:
            stages: pipeline depth; ``None`` puts all processes in one pipeline. The number of
                processes must be a multiple of it: ``devices x num_nodes = stages x pipelines``.
            micro_batch_size: samples per micro-batch; a batch is split into micro-batches.
            partition: how layers are cut into stages: DeepSpeed's ``"parameters"`` (balance
                trainable parameters), ``"uniform"`` (balance layer counts), ``"type:REGEX"``
                (balance layers whose class matches), or ``stages + 1`` explicit boundaries
                such as ``[0, 3, 6]``.
            seed: seed the layers are built under (default: the ``seed_everything`` seed, else 0).
            redundancy: ``"off"``: a plain pipeline. ``"lazy"``: every node keeps an exact replica of
                its successor's stage (host memory) and takes over when the successor is lost.
                ``"eager"``: lazy, plus the successor's forward run redundantly in the pipeline
                bubbles, its graph kept (host memory) until the step commits; a failover then skips
                the dead stage's forward for those micro-batches and runs only its backward.
            timeout: seconds any communication may block before the run fails (never 30 minutes).
            detection_timeout: under the Bamboo launcher, the most seconds a survivor needs to learn
                that a node is gone (the node lease's TTL is a bit below it).
            config: extra DeepSpeed config merged into the generated one (e.g. ``{"bf16": {"enabled": True}}``).
            rf_costs: where ``"eager"`` puts its redundant forwards: ``"measured"`` places them in the waits
                that this stage's own measured backward/forward time ratio predicts (timed over steps
                1-3; the schedule model's F = 1, B = 2 until then), or fixed action costs such as
                ``{"forward": 1, "backward": 2}`` (``lightning_bamboo.schedule.Costs`` fields).
            audit_replicas: after every step and every membership change (failover, reconfiguration,
                admission), compare each replica with its owner's live stage (weights and every optimizer
                state tensor, bit for bit, through digests) and stop the run with ``ReplicaAuditError``
                naming the layer, step and node at the first difference. Off by default: it costs a
                hash of every stage and replica and a collective per check.
        """
        if stages is not None and (not isinstance(stages, int) or stages < 1):
            raise BambooConfigError(f"stages must be a positive integer or None (stages: {stages!r})")
        if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise BambooConfigError(f"micro_batch_size must be a positive integer (micro_batch_size: {micro_batch_size!r})")
        check_partition_option(partition, stages)
        if redundancy not in REDUNDANCY_MODES:
            raise BambooConfigError(f"redundancy must be one of {REDUNDANCY_MODES} (redundancy: {redundancy!r})")
        if redundancy != "off" and stages == 1:
            raise BambooConfigError(
                f"redundancy={redundancy!r} needs at least 2 stages: a node holds a replica of its successor's "
                f"stage (stages: 1); use stages >= 2 or redundancy='off'"
            )
        if not timeout or timeout <= 0:
            raise BambooConfigError(f"timeout must be a positive number of seconds (timeout: {timeout!r})")
        self.rf_costs = check_rf_costs(rf_costs)
        if not isinstance(audit_replicas, bool):
            raise BambooConfigError(f"audit_replicas must be True or False (audit_replicas: {audit_replicas!r})")
        self.audit_replicas = audit_replicas
        self.audits = 0  # replica audits passed by this process
        super().__init__(  # type: ignore[call-arg]
            process_group_backend=process_group_backend, timeout=timedelta(seconds=timeout), **kwargs
        )
        self.stages = stages
        self.micro_batch_size = micro_batch_size
        self.partition = partition if isinstance(partition, str) else list(partition)
        self.seed = seed
        self.redundancy = redundancy
        self.timeout_seconds = float(timeout)
        if not detection_timeout or detection_timeout <= 0:
            raise BambooConfigError(f"detection_timeout must be a positive number of seconds (got {detection_timeout!r})")
        self.detection_timeout = float(detection_timeout)
        self.resilience: Any = None  # membership, commits and failover, under the Bamboo launcher
        self.deepspeed_extra_config = dict(config or {})
        self.engine: Any = None  # the BambooPipelineEngine, after setup()
        self.layout: Layout | None = None
        self._loaded_path: Path | None = None
        self._loaded_meta: dict[str, Any] | None = None
        self._saved_reads: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}  # layer files read for the resume
        self._admitted_checkpoint: dict[str, Any] | None = None  # a joining node's state, from a running node
        self._cursor = (0, 0)  # (epoch, global samples consumed in it)
        self._global_batch: int | None = None  # samples per step over all pipelines (fixed by the first start)
        self._global_batches = False  # whether every node loads the global batch (see process_dataloader)
        self._resume_cursor: tuple[int, int] | None = None
        self._resume_rng: dict[str, Any] | None = None  # this process's RNG states from the checkpoint, until on_train_start
        self._gradient_clipping = 0.0  # the Trainer's gradient_clip_val, from setup()
        self._param_counts: list[int] = []  # trainable parameters per layer, from setup()
        self._layer_names: list[str] = []  # each layer's class name, from setup()
        self._inject_sampler: bool | None = None  # the Trainer's use_distributed_sampler, before we take it over

    # ------------------------------------------------------------------ namespace helpers
    def _pl(self, module: str) -> types.ModuleType:
        return importlib.import_module(f"{self._pl_name}.{module}")

    # ------------------------------------------------------------------ launching
    def _configure_launcher(self) -> None:
        super()._configure_launcher()  # type: ignore[misc]
        launcher = self._launcher  # type: ignore[attr-defined,has-type]
        script_launcher = self._pl("strategies.launchers.subprocess_script")._SubprocessScriptLauncher
        if type(launcher) is script_launcher:
            self._launcher = make_launcher_class(script_launcher)(
                self.cluster_environment, self.num_processes, self.num_nodes  # type: ignore[attr-defined]
            )
            self._launcher._bamboo_strategy = self

    def check_before_launch(self, model: Any, trainer: Any = None) -> None:
        """Checks that need no process group: run once in the launching process, before any child exists.

        A callback with ``sets_bamboo_layout = True`` (HydrozoaTuner) chooses stages and partition in
        its ``setup``, inside the processes: then only the model's hooks are checked here.
        """
        from lightning_bamboo.strategy.resilience import joining

        if joining() or any(getattr(cb, "sets_bamboo_layout", False) for cb in getattr(trainer, "callbacks", None) or ()):
            if model is not None:
                self._check_model(model)
            return
        resolve_stages(self.world_size, self.stages)  # type: ignore[attr-defined]
        if model is not None:
            self._check_model(model)
            layers = self._build(model, keep=lambda i: False)
            stages, _ = resolve_stages(self.world_size, self.stages)  # type: ignore[attr-defined]
            compute_parts(self.partition, stages, layers.param_counts, layers.names)

    def _check_model(self, model: Any) -> None:
        for hook in ("configure_pipeline", "pipeline_loss"):
            if not callable(getattr(model, hook, None)):
                raise BambooConfigError(
                    f"strategy='bamboo' builds the model from LightningModule.{hook}(), which "
                    f"{type(model).__name__} does not define; add `def configure_pipeline(self)` returning the "
                    f"layers in order and `def pipeline_loss(self, outputs, targets)` returning the loss"
                )

    def _seed(self) -> int:
        if self.seed is not None:
            return int(self.seed)
        return int(os.environ.get("PL_GLOBAL_SEED", 0))

    def _build(self, model: Any, keep: Callable[[int], bool]) -> Any:
        from lightning_bamboo.engine.module import build_layers

        return build_layers(model.configure_pipeline, self._seed(), keep)

    # ------------------------------------------------------------------ environment
    def setup_environment(self) -> None:
        from lightning_bamboo.membership.node import leave_idle_priority
        from lightning_bamboo.strategy.resilience import Resilience, joining, launched_by_bamboo

        if joining() and self.resilience is None:
            # A node joining a running job: standby until a reconfiguration admits it, then its
            # process group is the job's (Lightning finds it initialised and keeps it).
            self.resilience = Resilience(self.detection_timeout, rendezvous_timeout=self.timeout_seconds)
            record = self.resilience.wait_admission()
            if record is None:
                log.warning("%s: the job finished before this standby node was needed", self.resilience.node)
                self.resilience.stop()
                raise SystemExit(0)
            self._admission = record
            leave_idle_priority()  # a local standby process waited at idle priority (Cluster.spawn_joiner)
            self._assigned = self.resilience.enter(record)
            world = self._assigned[1]
            self.stages = world // int(record.get("pipelines", 1))
            self.set_world_ranks()
            self._catching_up = True  # until its first step (see barrier)
            log.warning("%s: admitted as rank %d of %d at step %d", self.resilience.node, self._assigned[0], world, record["step"])
        resolve_stages(self.world_size, self.stages)  # type: ignore[attr-defined]  # fail before joining a group
        if launched_by_bamboo() and self.resilience is None:
            # before the process group: its TCPStore rendezvous cannot tell a dead node from a slow one
            self.resilience = Resilience(self.detection_timeout, rendezvous_timeout=self.timeout_seconds)
            if self.resilience.start_lost:
                self._start_without_lost()
        super().setup_environment()  # type: ignore[misc]

    def _start_without_lost(self) -> None:
        """Nodes died before the job's process group formed: start one pipeline of the nodes that are up.

        No step has run, so this is a smaller launch, not a failover: the job's process group is
        formed of the survivors, and the stage count follows them (the checkpoint it resumes from,
        if any, loads into any layout). A data-parallel job, or too few nodes left, stops with
        ``FatalLoss`` as before: the launcher starts it again with the nodes that are up.
        """
        from lightning_bamboo.errors import FatalLoss

        res = self.resilience
        if self.stages is not None and self.stages != len(res.nodes):
            raise FatalLoss(f"{sorted(res.start_lost)} died while the job started; a job of {len(res.nodes)} nodes in "
                            f"{self.stages}-stage pipelines starts again with the nodes that are up")
        self._assigned = res.start_without(min_nodes=1 if self.redundancy == "off" else 2)
        self.stages = self._assigned[1]
        self.set_world_ranks()

    #: a run resumed (or a node admitted) in another layout keeps the global batch of the checkpoint; False
    #: (``HydrozoaTuner(scale_batch=True)``): the DataLoader's batch per pipeline stays, the global batch scales
    keep_global_batch = True
    #: called at the start of every step under membership (``RebalanceCallback.at_step_start``)
    rebalancer: Callable[[Any, int], None] | None = None
    _admission: dict[str, Any] | None = None  # the reconfiguration record that admitted this (joining) node
    #: (rank, world size) of a process group formed by lightning_bamboo before Lightning's setup (an
    #: admission, or a start without nodes that died), not the launch environment's
    _assigned: tuple[int, int] | None = None

    def setup_distributed(self) -> None:
        """Lightning's process group; under the Bamboo launcher its forming is bounded by a short timeout.

        Every node passed the start rendezvous, so all are up; one that dies now leaves the others in
        gloo's connect, which no loss detector can interrupt, for the whole strategy timeout. The
        connect gets a few detection timeouts instead (``FatalLoss``: start again with the nodes that
        are up), and the group gets the strategy's timeout back once formed.
        """
        if self.resilience is None or self._assigned is not None or torch_dist.is_initialized():
            super().setup_distributed()  # type: ignore[misc]
            return
        from lightning_bamboo.errors import FATAL_EXIT_CODE, FatalLoss

        full: timedelta = self._timeout  # type: ignore[has-type]
        connect = min(full, timedelta(seconds=max(3 * self.detection_timeout, 15.0)))
        res, formed = self.resilience, threading.Event()

        def watchdog() -> None:
            # gloo's connect does not always honour its timeout (seen: minutes, waiting for a dead
            # peer's key): a process that is still not connected well after it exits for a restart.
            if not formed.wait(connect.total_seconds() + 5.0):
                log.error("%s: the job's process group did not form within %g s (lost: %s); exiting with %d: start "
                          "again with the nodes that are up", res.node, connect.total_seconds() + 5.0,
                          sorted(res.detector.lost), FATAL_EXIT_CODE)
                os._exit(FATAL_EXIT_CODE)

        threading.Thread(target=watchdog, name="bamboo-connect-watchdog", daemon=True).start()
        self._timeout = connect
        try:
            super().setup_distributed()  # type: ignore[misc]
        except (RuntimeError, torch_dist.DistError) as err:
            raise FatalLoss(f"the job's process group did not form within {connect.total_seconds():g} s ({err}); a "
                            "node died after the start rendezvous: start again with the nodes that are up") from err
        finally:
            formed.set()
            self._timeout = full
        torch_dist.distributed_c10d._set_pg_timeout(full)

    def set_world_ranks(self) -> None:
        super().set_world_ranks()  # type: ignore[misc]
        if self._assigned is not None:
            rank, world = self._assigned
            self.cluster_environment.set_global_rank(rank)  # type: ignore[attr-defined]
            self.cluster_environment.set_world_size(world)  # type: ignore[attr-defined]
            self._pl("utilities.rank_zero").rank_zero_only.rank = rank

    @property
    def pipelines(self) -> int:
        return resolve_stages(self.world_size, self.stages)[1]  # type: ignore[attr-defined]

    @property
    def pipeline_rank(self) -> int:
        """Which data-parallel pipeline this process belongs to."""
        return self.global_rank % self.pipelines  # type: ignore[attr-defined]

    @property
    def elastic_pipelines(self) -> bool:
        """Whether the number of pipelines may change between steps (every node loads the global batches)."""
        return self._global_batches

    @property
    def global_micro_batches(self) -> int | None:
        """Micro-batches per step over all pipelines, once the training data is set up with global batches."""
        if not self._global_batches or self._global_batch is None:
            return None
        return self._global_batch // self.micro_batch_size

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every stage of a pipeline must see the same batch: shard by pipeline, not by process
        return {"num_replicas": self.pipelines, "rank": self.pipeline_rank}

    def connect(self, model: Any) -> None:
        self._check_model(model)
        super().connect(model)  # type: ignore[misc]
        utils = self._pl("utilities.model_helpers")
        for hook in ("training_step", "validation_step", "test_step"):
            if utils.is_overridden(hook, model):
                if hook == "training_step":
                    log.warning(
                        "%s.training_step is not called with strategy='bamboo': the pipeline runs "
                        "configure_pipeline() layers and pipeline_loss(); log from on_train_batch_end instead",
                        type(model).__name__,
                    )
                continue
            if hook == "validation_step" and _fit_without_val_data(model):
                continue  # no validation runs: a placeholder would only make Lightning warn that it has no data
            # Lightning requires these hooks to exist; the strategy runs the pipeline in their place.
            setattr(model, hook, types.MethodType(_pipeline_step_placeholder, model))

    # ------------------------------------------------------------------ model and engine
    def setup(self, trainer: Any) -> None:
        from lightning_bamboo.callbacks.failover_metrics import add_failover_metrics
        from lightning_bamboo.engine.build import ensure_deepspeed_comm

        self._check_trainer(trainer)
        self._take_over_sampler_injection(trainer)
        self._no_sigterm_broadcast_under_membership(trainer)
        add_failover_metrics(trainer)  # failovers, recovery seconds and live nodes in the trainer's loggers
        self.accelerator.setup(trainer)  # type: ignore[attr-defined]
        model = self.lightning_module  # type: ignore[attr-defined]
        if self._admission is not None:
            self._setup_admitted(trainer)
            return
        stages, pipelines = resolve_stages(self.world_size, self.stages)  # type: ignore[attr-defined]
        stage = self.global_rank // pipelines  # type: ignore[attr-defined]
        probe = self._build(model, keep=lambda i: False)
        self._param_counts, self._layer_names = probe.param_counts, probe.names
        parts = compute_parts(self.partition, stages, probe.param_counts, probe.names)
        self.layout = Layout(stages, pipelines, parts)
        ensure_deepspeed_comm(self._get_process_group_backend())  # type: ignore[attr-defined]
        module = self._stage_module(self.layout, stage)

        fitting = trainer.state.fn == self._pl("trainer.states").TrainerFn.FITTING
        optimizer = None
        if fitting:
            self.setup_optimizers(trainer)  # type: ignore[attr-defined]
            if len(self.optimizers) != 1:  # type: ignore[attr-defined]
                raise BambooConfigError(
                    f"strategy='bamboo' trains with exactly one optimizer (configure_optimizers returned "
                    f"{len(self.optimizers)}); put parameter groups into one optimizer"  # type: ignore[attr-defined]
                )
            optimizer = self.optimizers[0]  # type: ignore[attr-defined]
        self._gradient_clipping = float(trainer.gradient_clip_val or 0.0)
        self.engine = self._new_engine(module, optimizer, self.layout)
        self._arm(self.engine, fitting)
        self.model = model  # type: ignore[attr-defined]  # no DDP wrapper: the engine reduces gradients
        self.setup_precision_plugin()  # type: ignore[attr-defined]

    def _setup_admitted(self, trainer: Any) -> None:
        """A joining node's setup: its layers and Lightning's training state come from the running nodes."""
        from lightning_bamboo.engine.build import ensure_deepspeed_comm
        from lightning_bamboo.engine.reconfigure import move_layers
        from lightning_bamboo.engine.replica import exchange_objects
        from lightning_bamboo.topology.transfer import transfer_plan

        record, res = self._admission, self.resilience
        assert record is not None and res is not None and self._assigned is not None
        if trainer.state.fn != self._pl("trainer.states").TrainerFn.FITTING:
            raise BambooConfigError("a node joins a running job only to train (trainer.fit)")
        probe = self._build(self.lightning_module, keep=lambda i: False)  # type: ignore[attr-defined]
        self._param_counts, self._layer_names = probe.param_counts, probe.names
        ensure_deepspeed_comm(self._get_process_group_backend())  # type: ignore[attr-defined]
        order, rank = list(record["order"]), self._assigned[0]
        self._gradient_clipping = float(trainer.gradient_clip_val or 0.0)

        def receive() -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
            moves = transfer_plan(record["old_order"], record["old_parts"], order, record["parts"],
                                  record.get("old_pipelines", 1), record.get("pipelines", 1))
            held = move_layers(moves, res.node, order, {})
            return held, exchange_objects(None, send_to=None, recv_from=order.index(record["sender"]))

        held, meta = res.guard().run(receive)
        pipelines = int(record.get("pipelines", 1))
        layout = Layout(len(order) // pipelines, pipelines, tuple(record["parts"]))
        self._rebuild_stage(layout, rank, held, meta["bamboo"]["param_groups"], trainer)
        self.model = self.lightning_module  # type: ignore[attr-defined]
        self.setup_precision_plugin()  # type: ignore[attr-defined]
        # Lightning restores loops, schedulers and callbacks from this as from a checkpoint file
        # (weights and optimizer state are in the stage already).
        self._admitted_checkpoint = {**meta, "state_dict": {}}
        trainer._checkpoint_connector._loaded_checkpoint = self._admitted_checkpoint
        self._restore_cursor(meta["bamboo"])

    def reconfigure(self, order: list[str], parts: tuple[int, ...], reason: str = "", pipelines: int = 1) -> float:
        """Change the layout between two steps, with no loss: standby nodes join, layers move point to point.

        ``order`` (the nodes in rank order: rank ``r`` runs stage ``r // pipelines`` of pipeline
        ``r % pipelines``) may add standby nodes to the current ones, never drop one; ``parts`` is
        the new layer split, ``pipelines`` the new number of data-parallel pipelines (the global
        batch stays: each pipeline's share of micro-batches follows). Every layer a node must run and does not run
        now comes from the node that runs it (weights and optimizer state; no disk); joining
        nodes also get Lightning's training state; replicas are rebuilt by the ring exchange.
        Call at a step boundary on every node of the pipeline (``RebalanceCallback`` does).
        Returns the seconds it took. A node lost meanwhile ends in ``FatalLoss`` (restart from the
        last checkpoint): the reconfiguration is not retried.
        """
        from lightning_bamboo.engine.pipe import PeerLost, _maybe_fail
        from lightning_bamboo.engine.reconfigure import move_layers
        from lightning_bamboo.engine.replica import exchange_objects
        from lightning_bamboo.errors import FatalLoss
        from lightning_bamboo.membership.registry import BarrierTimeoutError
        from lightning_bamboo.topology.transfer import transfer_plan

        res, layout, engine = self.resilience, self.layout, self.engine
        if res is None or layout is None or engine is None:
            raise BambooConfigError("reconfigure() needs a job started by the Bamboo launcher and setup() done")
        started = time.monotonic()
        old_order, old_parts, order, parts = list(res.nodes), tuple(layout.parts), list(order), tuple(parts)
        if (order, parts, pipelines) == (old_order, old_parts, layout.pipelines):
            return 0.0
        if pipelines != layout.pipelines and not self._global_batches:
            raise BambooConfigError(
                f"changing the number of pipelines ({layout.pipelines} -> {pipelines}) needs the training data loaded "
                "by global steps (a DataLoader with a sequential or random sampler, which the strategy shards); this "
                "job's sampler is sharded per pipeline"
            )
        # validates the new layout first
        moves = transfer_plan(old_order, old_parts, order, parts, layout.pipelines, pipelines)
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        step = trainer.global_step
        joiners = [n for n in order if n not in old_order]
        sender = next(n for n in order if n in old_order)
        record = {"generation": res.generation + 1, "order": order, "parts": list(parts), "old_order": old_order,
                  "old_parts": list(old_parts), "sender": sender, "tag": "reconf", "step": step, "reason": reason,
                  "pipelines": pipelines, "old_pipelines": layout.pipelines}
        if joiners and res.node == old_order[0]:
            res.admit(record)
        meta = None
        if joiners and res.node == sender:
            meta = self._checkpoint_meta(trainer._checkpoint_connector.dump_checkpoint(weights_only=False))
        if engine.replica is not None:
            engine.replica.settle()
        held, hyper = engine.own_states(), engine.optimizer
        log.warning("%s: reconfiguring at step %d: %s parts %s -> %s parts %s (%s)", res.node, step, old_order,
                    list(old_parts), order, list(parts), reason)
        try:
            rank, world = res.reform(order, tag="reconf")
            self._enter_group(rank, world)

            def move() -> dict[int, dict[str, Any]]:
                received = move_layers(moves, res.node, order, held)
                for joiner in joiners if meta is not None else ():
                    exchange_objects(meta, send_to=order.index(joiner), recv_from=None)
                return received

            held = {**held, **res.guard().run(move)}
            _maybe_fail(res.node, "reconfigure", None)  # fault injection (BAMBOO_FAIL_AT=node@reconfigure)
            self._rebuild_stage(Layout(world // pipelines, pipelines, parts), rank, held, hyper)
        except (PeerLost, BarrierTimeoutError) as err:
            raise FatalLoss(f"a node was lost while the pipeline was reconfigured at step {step} ({err}); "
                            "the run must restore its last checkpoint") from err
        seconds = time.monotonic() - started
        res.record_reconfiguration({**record, "seconds": seconds})
        log.warning("%s: reconfigured in %.2f s (rank %d of %d)", res.node, seconds, rank, world)
        return seconds

    def _stage_module(
        self, layout: Layout, stage: int, states: dict[int, dict[str, Any]] | None = None,
        prebuilt: dict[int, torch.nn.Module] | None = None,
    ) -> Any:
        """This process's ``PipelineModule`` for ``stage`` of ``layout`` (weights from ``states`` if given).

        ``prebuilt`` layers are used as they are (the replica's own layer objects, whose kept
        graphs a failover reuses): their weights are not loaded again.
        It is attached to the LightningModule, so configure_optimizers() sees this stage's
        parameters as ``self.parameters()``.
        """
        from lightning_bamboo.engine.build import build_pipeline_module

        prebuilt = prebuilt or {}
        model = self.lightning_module  # type: ignore[attr-defined]
        mine = layout.layers_of_stage(stage)
        built = self._build(model, keep=lambda i: i in mine and i not in prebuilt)
        layers = [prebuilt.get(i, layer) for i, layer in enumerate(built.layers)]
        timeout = timedelta(seconds=self.timeout_seconds)
        module = build_pipeline_module(layers, layout, model.pipeline_loss, timeout)
        module.to(self.root_device)  # type: ignore[attr-defined]
        if states is not None:
            ckpt.load_weights(module, {i: s for i, s in states.items() if i not in prebuilt}, strict=not prebuilt)
        model._bamboo_stage = module
        return module

    def _new_engine(self, module: Any, optimizer: Any, layout: Layout) -> Any:
        from lightning_bamboo.engine.build import build_engine, deepspeed_config

        config = deepspeed_config(
            self.micro_batch_size, 1, layout.pipelines, self._gradient_clipping, self.deepspeed_extra_config
        )
        return build_engine(
            module, optimizer, config, timedelta(seconds=self.timeout_seconds),
            bamboo_options={"redundancy": self.redundancy, "layout": layout, "rf_costs": self.rf_costs},
        )

    def _watch(self, engine: Any) -> None:
        """Under the Bamboo launcher: name the engine's node, commit its steps through the store, guard them."""
        res = self.resilience
        engine.node_id = res.node
        engine.commit = lambda _step: res.commit(self.lightning_module.trainer.global_step)  # type: ignore[attr-defined]
        engine.guard = res.guard()

    # ------------------------------------------------------------------ redundancy and failover
    def _rank_of(self, stage: int, pipeline: int) -> int:
        return stage * self.layout.pipelines + pipeline  # type: ignore[union-attr]

    def _make_optimizer(self, stage_module: torch.nn.Module) -> torch.optim.Optimizer:
        """The optimizer configure_optimizers() makes for ``stage_module``'s parameters."""
        model = self.lightning_module  # type: ignore[attr-defined]
        init = self._pl("core.optimizer")._init_optimizers_and_lr_schedulers
        previous = model._bamboo_stage
        model._bamboo_stage = stage_module
        try:
            optimizers, _ = init(model)
        finally:
            model._bamboo_stage = previous
        return optimizers[0]

    def _replica_container(self, layers: range, states: dict[int, dict[str, Any]] | None = None) -> StageContainer:
        """``layers`` built under the seed (and given ``states``' weights) in one stage container."""
        from lightning_bamboo.engine.replica import StageContainer

        built = self._build(self.lightning_module, keep=lambda i: i in layers)  # type: ignore[attr-defined]
        container = StageContainer(
            {i: layer for i, layer in enumerate(built.layers) if layer is not None}
        ).to(self.root_device)  # type: ignore[attr-defined]
        if states is not None:
            ckpt.load_weights(container, states)
        return container

    def layer_costs(self) -> tuple[float, ...] | None:
        """Relative cost per layer as ``partition`` weighs them, for splits made later (``RebalanceCallback``).

        ``"parameters"``: the layers' parameter counts; ``"type:REGEX"``: 1 per matching layer; ``"uniform"``
        or explicit boundaries: None (every layer the same). A split by the same weights as the
        first one keeps a rebuilt pipeline as balanced as the one the job started with.
        """
        if not self._param_counts:
            return None
        weights = partition_weights(self.partition, self._param_counts, self._layer_names)
        # the policy needs a positive cost per layer: a layer the partition does not weigh costs little
        if weights is None or max(weights) <= 0:
            return None
        return tuple(float(w) if w > 0 else 1e-3 * max(weights) for w in weights)

    def _check_host_memory(self, layers: range) -> None:
        import psutil

        counts = self._param_counts  # measured by setup() when it cut the model into stages
        check_replica_memory(layers, sum(counts[i] for i in layers), psutil.virtual_memory().available)

    def _arm(self, engine: Any, fitting: bool) -> None:
        """Give the engine its replica, its commit hook and its watchdog."""
        layout = self.layout
        assert layout is not None
        stage, pipeline = layout.stage_of_rank(self.global_rank), layout.pipeline_of_rank(self.global_rank)  # type: ignore[attr-defined]
        if not fitting:
            return
        if self.redundancy != "off" and layout.stages > 1:
            successor = (stage + 1) % layout.stages
            self._check_host_memory(layout.layers_of_stage(successor))
            peers = (self._rank_of((stage - 1) % layout.stages, pipeline), self._rank_of(successor, pipeline))
            self._attach_replica(engine, layout, successor, peers)
        if self.resilience is not None:
            self._watch(engine)

    def _fail_over(self, err: Exception, step: int, in_flight: bool = True) -> bool:
        """Rebuild the pipeline from the survivors' own stages and replicas; True if the step had committed.

        Every attempt starts from the same captured state (the layers this node held before the
        loss) with the union of the losses seen so far, so a node lost *during* a failover only
        makes the survivors agree on a larger set and try again; no wait is unbounded.
        """
        from lightning_bamboo.engine.pipe import PeerLost
        from lightning_bamboo.membership.registry import BarrierTimeoutError

        res = self.resilience
        started = time.monotonic()
        if self.redundancy == "off":
            from lightning_bamboo.errors import FatalLoss

            raise FatalLoss(f"lost {list(getattr(err, 'lost', ()))} with redundancy='off': no replica to take over")
        old_engine, layout = self.engine, self.layout
        assert layout is not None
        log.info("%s: failover starts (%.2f s)", res.node, time.monotonic() - started)
        committed = res.committed(step)
        if committed and old_engine.phase != "idle":
            old_engine.apply_step()  # every node had its gradients in: the step counts
        elif not committed:
            old_engine.discard_step()
        base = {
            "nodes": list(res.nodes),
            "pipelines": layout.pipelines,
            "parts": tuple(layout.parts),
            "states": {**old_engine.own_states(), **(old_engine.replica.states() if old_engine.replica else {})},
            "optimizer": old_engine.optimizer,
            "last_loss": old_engine.last_loss,
            # eager: the successor's forwards of the failed step, reused when this node takes its stage over
            "reuse": None if committed or old_engine.redundant is None or not old_engine.redundant.kept
            else (old_engine.replica.module, dict(old_engine.redundant.kept)),
        }
        log.info("%s: state captured (%.2f s)", res.node, time.monotonic() - started)
        suspected = set(getattr(err, "lost", ()))
        # A failover should take well under a detection timeout; if one does not, every thread's stack
        # goes to stderr (the node's log) so the wait can be named.
        faulthandler.dump_traceback_later(max(4 * self.detection_timeout, 10.0), repeat=True)
        try:
            for _attempt in range(len(base["nodes"])):
                try:
                    plan, rank, world = self._fail_over_once(base, suspected, step)
                    break
                except (PeerLost, BarrierTimeoutError) as again:
                    suspected |= set(getattr(again, "lost", ())) | res.detector.lost
                    log.warning("%s: another loss during the failover (%s); trying again with %s", res.node, again, sorted(suspected))
            else:
                raise BambooError(f"failover at step {step} did not converge after {len(base['nodes'])} attempts")
        finally:
            faulthandler.cancel_dump_traceback_later()
        res.leavers &= set(res.nodes)  # a leaver this failover already served needs no second one
        seconds = time.monotonic() - started
        # a released node may have left before another survivor decided: the lost set then names it too
        released = set(plan.released) | res.released() if base["pipelines"] > 1 else set()
        res.record_failover({"step": step, "lost": sorted(set(base["nodes"]) - set(plan.order) - released),
                             "committed": committed, "seconds": seconds, "redone": in_flight and not committed,
                             "order": list(plan.order), "parts": list(plan.parts), "pipelines": plan.pipelines,
                             "released": sorted(released), "rows": [list(r) for r in plan.rows],
                             "old_parts": list(base["parts"]), "old_pipelines": base["pipelines"]})
        log.warning("%s: failover done in %.2f s (rank %d of %d)", res.node, seconds, rank, world)
        if committed:
            self.engine.last_loss = base["last_loss"]
        return committed

    def _fail_over_once(self, base: dict[str, Any], suspected: set[str], step: int) -> tuple[Any, int, int]:
        from lightning_bamboo.engine.pipe import _maybe_fail
        from lightning_bamboo.topology.failover import layout_tag, plan_loss

        res = self.resilience
        lost = res.decide_lost(tuple(suspected), base["nodes"])
        plan = plan_loss(base["nodes"], base["pipelines"], base["parts"], lost, replicas=self.redundancy != "off")
        log.warning("%s: lost %s at step %d; new layout %s (%d pipeline(s)) parts %s%s", res.node, sorted(lost), step,
                    plan.order, plan.pipelines, plan.parts, f"; released {list(plan.released)}" if plan.released else "")
        if res.node in plan.released:
            self._release(step)
        # The group's tag names its members: survivors that saw a released node's lease end (it left)
        # and those that did not agree on the same layout, so they must meet in the same group.
        rank, world = res.reform(list(plan.order), tag=layout_tag(plan.order))
        log.info("%s: process group re-formed", res.node)
        _maybe_fail(res.node, "failover", None)  # fault injection (BAMBOO_FAIL_AT=node@failover)
        self._enter_group(rank, world)
        # This node's layers in the new layout, each from its own copy or its replica (no disk, no transfer).
        layout = Layout(world // plan.pipelines, plan.pipelines, plan.parts)
        self._rebuild_stage(layout, rank, base["states"], base["optimizer"], reuse=base["reuse"])
        return plan, rank, world

    def _release(self, step: int) -> NoReturn:
        """Leave the layout (this node's pipeline was dropped) and come back as a standby node, in a fresh process."""
        from lightning_bamboo.membership.node import rejoin_as_standby

        res = self.resilience
        log.warning("%s: released at step %d (its pipeline lost a node; the whole pipelines train on); joining again "
                    "as a standby node", res.node, step)
        try:
            res.release()
            res.registry.leave(timeout=2.0)  # its id is free at once for the standby incarnation
        finally:
            res.stop()
        rejoin_as_standby()

    def _enter_group(self, rank: int, world: int) -> None:
        """This process is ``rank`` of ``world`` in the process group just formed (Lightning and DeepSpeed too)."""
        from lightning_bamboo.engine.build import ensure_deepspeed_comm

        self.cluster_environment.set_global_rank(rank)  # type: ignore[attr-defined]
        self.cluster_environment.set_world_size(world)  # type: ignore[attr-defined]
        self._pl("utilities.rank_zero").rank_zero_only.rank = rank
        import deepspeed.comm.comm as ds_comm_module

        ds_comm_module.cdb = None
        ensure_deepspeed_comm(self._get_process_group_backend())  # type: ignore[attr-defined]

    def _rebuild_stage(
        self, layout: Layout, rank: int, held: dict[int, dict[str, Any]], hyper: torch.optim.Optimizer | list[dict[str, Any]],
        trainer: Any = None, reuse: tuple[StageContainer, dict[int, Any]] | None = None,
    ) -> None:
        """Build this node's stage of ``layout`` from ``held`` layer states, its engine, and the replica ring.

        ``hyper`` gives the optimizer's current hyperparameters (the old optimizer, or saved param
        groups). With ``trainer`` (a node joining), the optimizer and schedulers come from
        Lightning's ``configure_optimizers``; otherwise the old optimizer is swapped for the new one.
        ``reuse`` (eager failover): the old replica's container and its kept redundant forwards; when
        the new stage ends with the replica's layers, it takes those layer objects over and the next
        step reuses the kept forwards (``engine.module.Splice``).
        """
        from lightning_bamboo.engine.module import Splice
        from lightning_bamboo.engine.replica import copy_hyperparameters

        res = self.resilience
        stage = layout.stage_of_rank(rank)
        mine = layout.layers_of_stage(stage)
        missing = [i for i in mine if i not in held]
        if missing:
            raise BambooError(f"the new layout gives {res.node} layers {missing} it does not hold")
        stage_states = {i: held[i] for i in mine}
        self.stages, self.layout = layout.stages, layout
        prebuilt: dict[int, torch.nn.Module] = {}
        splice = None
        if reuse is not None:
            container, kept = reuse
            first, stop = container.indices[0], container.indices[-1] + 1
            if mine.stop == stop and mine.start <= first:  # the new stage ends with the replica's layers
                prebuilt = {int(n): layer for n, layer in container.named_children()}
                splice = Splice(first, kept)
        # DeepSpeed's PipelineModule forms its process groups (gloo connects to every peer): a peer lost
        # meanwhile would hold that connect for the whole group timeout, so it is bounded like a step.
        module = res.guard().run(lambda: self._stage_module(layout, stage, stage_states, prebuilt))
        module.splice = splice
        if trainer is not None:
            self.setup_optimizers(trainer)  # type: ignore[attr-defined]
            optimizer = self.optimizers[0]  # type: ignore[attr-defined]
        else:
            optimizer = self._make_optimizer(module)
        groups = hyper if isinstance(hyper, list) else ckpt.param_group_hyperparameters(hyper)
        ckpt.load_optimizer(module, optimizer, stage_states, groups)
        if isinstance(hyper, torch.optim.Optimizer):
            copy_hyperparameters(hyper, optimizer)

        def build_and_arm() -> Any:
            # Collectives with the new peers: bounded by the new membership watch like a step.
            engine = self._new_engine(module, optimizer, layout)
            self._arm_replica_from_successor(engine, layout, rank)
            return engine

        self.engine = res.guard().run(build_and_arm)
        if isinstance(hyper, torch.optim.Optimizer):
            self._rebind_optimizer(hyper, optimizer)
        self._watch(self.engine)
        self._audit("membership change before", self.lightning_module.trainer.global_step)  # type: ignore[attr-defined]

    def _arm_replica_from_successor(self, engine: Any, layout: Layout, rank: int) -> None:
        """Rebuild redundancy: every node sends its stage to its predecessor in its pipeline, which keeps it as the replica."""
        from lightning_bamboo.engine.replica import exchange_objects

        if self.redundancy == "off" or layout.stages < 2:
            return
        stage, pipeline = layout.stage_of_rank(rank), layout.pipeline_of_rank(rank)
        successor = (stage + 1) % layout.stages
        peers = (self._rank_of((stage - 1) % layout.stages, pipeline), self._rank_of(successor, pipeline))
        received = exchange_objects(engine.own_states(), send_to=peers[0], recv_from=peers[1])
        self._attach_replica(engine, layout, successor, peers, received)

    def _attach_replica(
        self, engine: Any, layout: Layout, stage: int, peers: tuple[int, int], states: dict[int, dict[str, Any]] | None = None
    ) -> None:
        """Give ``engine`` a replica of ``stage`` (built under the seed, or from ``states``) and its exchange peers."""
        from lightning_bamboo.engine.replica import Replica

        container = self._replica_container(layout.layers_of_stage(stage), states)
        optimizer = self._make_optimizer(container)
        if states is not None:
            ckpt.load_optimizer(container, optimizer, states, ckpt.param_group_hyperparameters(engine.optimizer))
        engine.replica = Replica(stage, container, optimizer)
        engine.replica_peers = peers

    def _audit(self, when: str, step: int) -> None:
        """With ``audit_replicas``: every replica against its owner's live stage, on every node (``engine.audit``).

        Every node gathers every node's digests and finds the same differences, so all stop together.
        Under the Bamboo launcher the digests go through the membership store, so a node lost meanwhile
        fails the audit like any collective: callers between steps run it through ``_resilient`` (fail
        over, audit again); inside a failover, the failover is retried with the larger lost set.
        """
        if not self.audit_replicas or self.engine is None or self.layout is None:
            return
        from dataclasses import asdict

        from lightning_bamboo.engine import audit

        engine, layout, rank = self.engine, self.layout, self.global_rank  # type: ignore[attr-defined]
        replica = engine.replica
        report = asdict(audit.NodeDigest(
            node=self.resilience.node if self.resilience is not None else f"rank {rank}",
            stage=layout.stage_of_rank(rank), pipeline=layout.pipeline_of_rank(rank),
            own=audit.digest(engine.own_states()),
            replica_stage=replica.stage if replica is not None else None,
            replica=audit.digest(replica.states()) if replica is not None else {},
        ))
        if self._between_steps():
            reports = self._gather(report)
        elif torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
            reports = [None] * torch_dist.get_world_size()
            torch_dist.all_gather_object(reports, report)
        else:
            reports = [report]
        audit.check([audit.NodeDigest(**r) for r in reports], step, when)
        self.audits += 1

    def _rebind_optimizer(self, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
        """Point Lightning (its optimizer list and LR schedulers) at the rebuilt stage's optimizer."""
        self.optimizers = [new]  # type: ignore[attr-defined]
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        for config in trainer.lr_scheduler_configs:
            if config.scheduler.optimizer is old:
                config.scheduler.optimizer = new

    def _check_trainer(self, trainer: Any) -> None:
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
        precision = str(getattr(self.precision_plugin, "precision", "32-true"))  # type: ignore[attr-defined]
        if precision not in ("32-true", "32"):
            raise BambooConfigError(
                f"strategy='bamboo' runs the Lightning precision '32-true' and takes reduced precision from "
                f"DeepSpeed's config (precision: {precision!r}); use precision='32-true' and "
                f"BambooStrategy(config={{'bf16': {{'enabled': True}}}})"
            )

    def model_to_device(self) -> None:
        pass  # the engine places the stage; the LightningModule holds no other weights

    # ------------------------------------------------------------------ steps
    def _split(self, batch: Any, global_batch: bool = False) -> tuple[list[tuple[Any, Any]], tuple[int, int] | None]:
        """This pipeline's micro-batches of ``batch``, and of a global batch its share (``(count, total)``
        micro-batches, see ``pipeline_share``; None for a batch of this pipeline's own)."""
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            kind = f"a {type(batch).__name__}" + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
            raise BambooConfigError(
                f"strategy='bamboo' needs batches of the form (inputs, targets), got {kind}; make the "
                f"Dataset return (inputs, targets) pairs or add a collate_fn that does"
            )
        inputs, targets = batch
        size = len(inputs)
        b = self.micro_batch_size
        share: tuple[int, int] | None = None
        if global_batch:
            first, m, total = pipeline_share(size, b, self.pipelines, self.pipeline_rank)
            share = (m, total)
        else:
            first, m = 0, micro_batches(size, b, self.pipelines)
        return [(inputs[i * b : (i + 1) * b], targets[i * b : (i + 1) * b]) for i in range(first, first + m)], share

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        batch = args[0] if args else kwargs["batch"]
        step = self.lightning_module.trainer.global_step  # type: ignore[attr-defined]
        loss = self._train_batch_surviving(batch)
        # a node lost (or gone after a notice) meanwhile fails the audit's collective: fail over, audit again
        self._resilient(lambda: self._audit("after", step))
        epoch = self.lightning_module.trainer.current_epoch  # type: ignore[attr-defined]
        done = self._cursor[1] if self._cursor[0] == epoch else 0
        self._cursor = (epoch, done + len(batch[0]) * (1 if self._global_batches else self.pipelines))
        self.lightning_module.log("train_loss", loss, prog_bar=True, on_step=True, sync_dist=False)  # type: ignore[attr-defined]
        return loss

    def _train_batch_surviving(self, batch: Any) -> torch.Tensor:
        """Run the batch; if a peer is lost, fail over and redo it (unless it had committed).

        The batch is cut into this pipeline's micro-batches at every attempt: a failover or a
        reconfiguration may have changed the number of pipelines (the global batch stays).
        """
        from lightning_bamboo.engine.pipe import PeerLost

        step = self.lightning_module.trainer.global_step  # type: ignore[attr-defined]
        res = self.resilience
        joined_now, self._catching_up = self._catching_up, False
        if res is not None and res.leavers:
            # A peer announced at the last commit that it leaves: switch now, between steps, losing nothing.
            self._fail_over(PeerLost(f"{sorted(res.leavers)} left after a notice", res.leavers), step, in_flight=False)
            res.leavers = set()
        if res is not None and self.rebalancer is not None and not joined_now:  # (a new node: decided already)
            # Every node of the pipeline is here in the same generation at the same step (a failover
            # that raced with the last commit has been joined by all): the place to reconfigure.
            self.rebalancer(self, step)
        for _ in range(len(res.nodes) if res is not None else 1):
            chunks, self.engine.share = self._split(batch, global_batch=self._global_batches)
            self.engine.set_micro_batches(len(chunks))
            self.engine.batches_run = step
            if res is not None:
                # A step that takes a commit timeout is stuck somewhere: every thread's stack goes to the
                # node's log then, so that the node the others wait for shows where it waits.
                faulthandler.dump_traceback_later(res.rendezvous_timeout * 0.75, repeat=False)
            try:
                loss = self.engine.train_batch(data_iter=iter(chunks))
                if res is not None and res.leaving:
                    res.depart()
                return loss
            except PeerLost as err:
                if self.resilience is None:
                    raise
                if self._fail_over(err, step):
                    return self.engine.last_loss
            finally:
                if res is not None:
                    faulthandler.cancel_dump_traceback_later()
        raise BambooConfigError(f"step {step} failed over {len(self.resilience.nodes)} times; giving up")

    def _eval_step(self, name: str, batch: Any) -> torch.Tensor:
        chunks, _ = self._split(batch)
        self.engine.set_micro_batches(len(chunks))
        loss = self.engine.eval_batch(data_iter=iter(chunks), num_micro_batches=len(chunks))
        # equal on every stage of a pipeline; averaging over all processes averages the pipelines
        self.lightning_module.log(name, loss, prog_bar=True, sync_dist=True)  # type: ignore[attr-defined]
        return loss

    def validation_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._eval_step("val_loss", args[0] if args else kwargs["batch"])

    def test_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._eval_step("test_loss", args[0] if args else kwargs["batch"])

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        raise BambooConfigError(
            "strategy='bamboo' does not support trainer.predict (only the last stage holds outputs); "
            "consolidate_checkpoint() the weights and predict with nn.Sequential(*model.configure_pipeline())"
        )

    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return closure_loss  # train_batch already ran every backward pass of the pipeline

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        return closure()  # the closure runs train_batch, which ends with the optimizer step

    def _no_sigterm_broadcast_under_membership(self, trainer: Any) -> None:
        """Under the Bamboo launcher, Lightning's per-step SIGTERM broadcast is replaced by the membership protocol.

        Lightning broadcasts a "rank 0 got SIGTERM" flag with a raw ``torch.distributed.broadcast``
        before every batch. With a node just lost that call blocks until the process-group
        timeout (it bypasses the strategy, so no failover can rescue it), and its meaning, stop
        every rank, is the opposite of Bamboo's: a node with a notice leaves alone and its
        neighbours take over (``Resilience.commit``). The epoch loop gets a subclass that skips
        the broadcast when membership is on and keeps Lightning's behaviour otherwise.
        """
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        if loop is not None and hasattr(loop, "_broadcast_sigterm_tensor") and not getattr(loop, "_bamboo", False):
            loop.__class__ = _without_raw_broadcast(type(loop), "_broadcast_sigterm_tensor")
        # Lightning's SIGTERM handler broadcasts too (inside the handler); under membership SIGTERM is
        # a preemption notice: flag only, and the node leaves after its next commit.
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None and hasattr(connector, "_sigterm_notifier_fn") and not getattr(connector, "_bamboo", False):
            connector.__class__ = _without_raw_broadcast(type(connector), "_sigterm_notifier_fn")

    def _take_over_sampler_injection(self, trainer: Any) -> None:
        """Shard data by pipeline ourselves: Lightning would always shuffle training data."""
        connector = trainer._accelerator_connector
        if self._inject_sampler is None:
            self._inject_sampler = bool(connector.use_distributed_sampler)
        connector.use_distributed_sampler = False

    def process_dataloader(self, dataloader: Any) -> Any:
        """Give each pipeline its share of the data: one global order, cut per step (see ``StepSampler``).

        Training: every node loads each step's global batch (``batch_size`` of the DataLoader times
        the pipelines the job started with) and trains on its pipeline's micro-batches of it, so the
        number of pipelines may change between steps. Evaluation: each pipeline loads its shard.
        """
        sampler = getattr(dataloader, "sampler", None)
        if not self._inject_sampler or not isinstance(dataloader, torch.utils.data.DataLoader) or sampler is None:
            return dataloader
        if isinstance(sampler, torch.utils.data.DistributedSampler):
            return dataloader  # the user sharded it already
        running = self._pl("trainer.states").RunningStage
        training = self.lightning_module.trainer.state.stage == running.TRAINING  # type: ignore[attr-defined]
        data = self._pl("utilities.data")
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        ours: torch.utils.data.Sampler
        if type(sampler) in (torch.utils.data.SequentialSampler, torch.utils.data.RandomSampler):
            shuffle = isinstance(sampler, torch.utils.data.RandomSampler)
            if training and dataloader.batch_size is not None:
                return self._global_step_loader(dataloader, shuffle, seed)
            ours = torch.utils.data.DistributedSampler(
                dataloader.dataset, self.pipelines, self.pipeline_rank, shuffle=shuffle, seed=seed
            )
        else:
            from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

            log.warning("custom sampler %s: a run resumed mid-epoch restarts the epoch, and the number of pipelines "
                        "stays fixed", type(sampler).__name__)
            ours = DistributedSamplerWrapper(sampler, num_replicas=self.pipelines, rank=self.pipeline_rank, shuffle=False)
        return data._update_dataloader(dataloader, ours, mode=running.TRAINING if training else None)

    def _global_step_loader(self, dataloader: Any, shuffle: bool, seed: int) -> Any:
        """``dataloader``'s dataset and worker settings, loading each step's global batch (``StepSampler``)."""
        if self._global_batch is None:  # a resumed or admitted run keeps the global batch it was started with
            self._global_batch = int(dataloader.batch_size) * self.pipelines
        steps = StepSampler(dataloader.dataset, self._global_batch, shuffle=shuffle, seed=seed,
                            drop_last=bool(dataloader.drop_last), multiple=self.pipelines)
        if self._resume_cursor is not None:
            steps.resume_at(*self._resume_cursor)
        if type(dataloader) is not torch.utils.data.DataLoader:
            log.warning("%s: the training data is loaded by a torch DataLoader with its dataset and settings",
                        type(dataloader).__name__)
        self._global_batches = True
        return torch.utils.data.DataLoader(
            dataloader.dataset, batch_sampler=steps, num_workers=dataloader.num_workers,
            collate_fn=dataloader.collate_fn, pin_memory=dataloader.pin_memory, timeout=dataloader.timeout,
            worker_init_fn=dataloader.worker_init_fn, multiprocessing_context=dataloader.multiprocessing_context,
            generator=dataloader.generator, prefetch_factor=dataloader.prefetch_factor,
            persistent_workers=dataloader.persistent_workers, pin_memory_device=dataloader.pin_memory_device,
            in_order=getattr(dataloader, "in_order", True),
        )

    # ------------------------------------------------------------------ checkpoints
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # weights are loaded into the engine's stage, which exists only after setup()

    @property
    def lightning_restore_optimizer(self) -> bool:
        return True

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # weights are saved per layer by save_checkpoint

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # saved per layer by save_checkpoint

    # ------------------------------------------------------------------ collectives that survive a loss
    _inside_resilient = False

    def _resilient(self, fn: Callable[[], Any]) -> Any:
        """Run a collective; if a node is lost meanwhile, fail over (between steps) and run it again.

        Collectives outside the training step (checkpoint saves, metric syncs, Lightning's own
        barriers) meet a lost node as much as the step does. Nested calls run plainly: the
        outermost call retries the whole operation in the new layout.
        """
        from lightning_bamboo.engine.pipe import PeerLost

        res = self.resilience
        if res is None or self.engine is None or self._inside_resilient:
            return fn()
        step = self.lightning_module.trainer.global_step  # type: ignore[attr-defined]
        for _ in range(len(res.nodes)):
            self._inside_resilient = True
            try:
                return res.guard().run(fn)
            except PeerLost as err:
                self._inside_resilient = False
                self._fail_over(err, step, in_flight=False)
            finally:
                self._inside_resilient = False
        raise BambooError(f"a collective failed over {len(res.nodes)} times at step {step}; giving up")

    #: a joining node between its admission and its first step: the running nodes are past the
    #: barriers and broadcasts of Lightning's start-up (they are training), so it meets them alone
    _catching_up = False

    def _between_steps(self) -> bool:
        """Under the Bamboo launcher, once the engine exists, collectives go through the membership store.

        A gloo collective cut by a loss can leave some survivors past it and others still in it;
        after the failover they would retry different collectives and wait on each other until
        the process group's timeout (seen: a checkpoint save's barrier against a reduction, 60 s,
        then a restart). ``Resilience.gather`` fails the same collective on every survivor.
        """
        return self.resilience is not None and self.resilience.active and self.engine is not None

    def _gather(self, obj: Any, send: bool = True) -> list[Any]:
        """Every node's ``obj`` (None for a node that does not ``send``), in rank order, through the store."""
        assert self.resilience is not None
        return [None if not part else _decode(part) for part in self.resilience.gather(_encode(obj) if send else "")]

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self._catching_up:
            return
        if self._between_steps():
            self._resilient(lambda: self.resilience.gather(""))  # type: ignore[union-attr]
            return
        self._resilient(lambda: super(_BambooStrategyMixin, self).barrier(*args, **kwargs))  # type: ignore[misc]

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self._catching_up:
            return obj  # same program, same arguments: what rank ``src`` had at start-up
        if self._between_steps():
            # the rank is read at each attempt: after a failover ``src`` names a rank of the new group
            return self._resilient(lambda: self._gather(obj, send=self.global_rank == src)[src])  # type: ignore[attr-defined]
        return self._resilient(lambda: super(_BambooStrategyMixin, self).broadcast(obj, src))  # type: ignore[misc]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if self._catching_up:  # start-up checks (e.g. "every rank's dataloader has a length"): the local value
            return tensor
        if self._between_steps():
            if not isinstance(tensor, torch.Tensor):
                return tensor  # as Lightning's DDP strategy: only tensors are reduced
            kind = _reduce_kind(reduce_op)
            return self._resilient(lambda: _reduced(self._gather(tensor.detach().cpu()), kind).to(tensor.device))
        return self._resilient(lambda: super(_BambooStrategyMixin, self).reduce(tensor, group, reduce_op))  # type: ignore[misc]

    def all_gather(self, tensor: Any, group: Any = None, sync_grads: bool = False) -> Any:
        if self._between_steps():
            if sync_grads:
                raise BambooConfigError(
                    "strategy='bamboo' gathers between steps through the membership store, without gradients "
                    "(all_gather(sync_grads=True)); gather detached values"
                )
            return self._resilient(lambda: torch.stack(self._gather(tensor.detach().cpu())).to(tensor.device))
        return self._resilient(lambda: super(_BambooStrategyMixin, self).all_gather(tensor, group, sync_grads))  # type: ignore[misc]

    def _checkpoint_meta(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """``meta.pt``: Lightning's checkpoint dict without weights, plus what a reader of any layout needs."""
        layout = self.layout
        assert layout is not None and self.engine is not None, "saving a checkpoint needs setup() first"
        optimizer = self.engine.optimizer if self.optimizers else None  # type: ignore[attr-defined]
        out = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        out["optimizer_states"] = []
        out["bamboo"] = ckpt.bamboo_meta(
            layout.num_layers, layout.parts, layout.pipelines, optimizer,
            cursor={"epoch": self._cursor[0], "samples": self._cursor[1], "global_batch": self._global_batch},
            seed=self._seed(),
            redundancy=self.redundancy, world_size=self.world_size,  # type: ignore[attr-defined]
            step=checkpoint.get("global_step"),
        )
        return out

    def checkpoint_shard(self, checkpoint: dict[str, Any], reuse: ckpt.Shard | None = None) -> ckpt.Shard:
        """This process's part of a checkpoint, copied to host memory (no collective; see ``AsyncCheckpoint``).

        Its layers (one pipeline per stage writes them), its RNG states and, on rank 0, the manifest;
        ``reuse`` is an earlier shard, already written, whose buffers the copy overwrites.
        """
        assert self.engine is not None, "saving a checkpoint needs setup() first"
        optimizer = self.engine.optimizer if self.optimizers else None  # type: ignore[attr-defined]
        return ckpt.take_shard(
            self.global_rank, self.engine.module, optimizer, self.engine.layer_range,  # type: ignore[attr-defined]
            writes_layers=self.pipeline_rank == 0,
            meta=(lambda: self._checkpoint_meta(checkpoint)) if self.is_global_zero else None,  # type: ignore[attr-defined]
            reuse=reuse,
        )

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Every process writes its layers (one pipeline per stage) and RNG states, rank 0 the manifest; then swap in.

        A loss during the save fails over and saves again from the start in the new layout.
        """
        self._resilient(lambda: self._save_checkpoint_once(checkpoint, filepath, storage_options))

    def _save_checkpoint_once(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise BambooConfigError("strategy='bamboo' does not take storage_options in save_checkpoint")
        optimizer = self.engine.optimizer if self.optimizers else None  # type: ignore[attr-defined]
        assert self.layout is not None and self.engine is not None, "save_checkpoint() needs setup() first"

        def barrier(name: str) -> None:
            if self.resilience is not None and name == "bamboo_checkpoint_layers":
                from lightning_bamboo.engine.pipe import _maybe_fail

                # tests: a node that dies in the middle of a save (BAMBOO_FAIL_AT=node@save<step>)
                _maybe_fail(self.resilience.node, f"save{checkpoint.get('global_step')}", None)
            self.barrier(name)

        ckpt.save_sharded(
            filepath, self.engine.module, optimizer, self.engine.layer_range, lambda: self._checkpoint_meta(checkpoint),
            is_global_zero=self.is_global_zero, writes_layers=self.pipeline_rank == 0,  # type: ignore[attr-defined]
            barrier=barrier, rank=self.global_rank,  # type: ignore[attr-defined]
        )

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if self._admitted_checkpoint is not None:
            # A node admitted into a running job has its layers, optimizer state, loops and cursor from a
            # running node (``_setup_admitted``), not from the file the job last started from: a restarted
            # job starts the nodes that join it later with the same ``ckpt_path``.
            return self._admitted_checkpoint
        # a directory of step checkpoints (AsyncCheckpoint's dirpath) resumes from the latest complete one,
        # as rank 0 sees it (all processes call load_checkpoint; a writer may still be committing)
        checkpoint_path = Path(self.broadcast(str(ckpt.resolve_checkpoint(checkpoint_path))))  # type: ignore[attr-defined]
        meta = ckpt.read_meta(checkpoint_path)
        self._loaded_path, self._loaded_meta = Path(checkpoint_path), meta
        self._saved_reads = {}
        self._restore_cursor(meta["bamboo"])
        self._resume_rng = None
        saved_world = meta["bamboo"].get("world_size")
        if saved_world == self.world_size:  # type: ignore[attr-defined]
            self._resume_rng = ckpt.read_rng(checkpoint_path, self.global_rank)  # type: ignore[attr-defined]
        elif saved_world is not None:
            log.warning(
                "checkpoint %s was saved by %s processes, this run has %s: random number generators are not "
                "restored (their streams belong to processes); weights, optimizer state and data order are",
                checkpoint_path, saved_world, self.world_size,  # type: ignore[attr-defined]
            )
        return {**meta, "state_dict": {}}

    def _restore_cursor(self, bamboo: dict[str, Any]) -> None:
        """The data cursor (and the global batch, which a run keeps in every later layout) of a checkpoint's meta."""
        cursor = bamboo.get("cursor", {"epoch": 0, "samples": 0})
        self._cursor = self._resume_cursor = (int(cursor["epoch"]), int(cursor["samples"]))
        if cursor.get("global_batch") and self.keep_global_batch:
            self._global_batch = int(cursor["global_batch"])

    def on_train_start(self) -> None:
        # Restored as late as possible: after Lightning created the data iterator, which draws a
        # seed from torch's generator exactly as the uninterrupted run did before its first step.
        super().on_train_start()  # type: ignore[misc]
        admitted, self._admitted_checkpoint = self._admitted_checkpoint, None  # a later fit() reads its own ckpt_path
        self._saved_reads = {}  # restored: the layer files read for it are not needed any more
        if self._resume_rng is not None:
            ckpt.restore_rng(self._resume_rng)
            self._resume_rng = None
        if admitted is None and self._loaded_path is not None:
            # a resume (also a restart from a checkpoint): replicas must be the loaded stages before a failover
            # can take one over (an admitted node was audited with the nodes that admitted it)
            step = self.lightning_module.trainer.global_step  # type: ignore[attr-defined]
            self._resilient(lambda: self._audit("resumed before", step))

    def _saved_states(self, layers: range) -> dict[int, dict[str, Any]]:
        """``layers``' weights and optimizer state from the checkpoint being loaded (any saved layout)."""
        assert self._loaded_path is not None and self._loaded_meta is not None
        saved_layers = self._loaded_meta["bamboo"]["num_layers"]
        if saved_layers != self.layout.num_layers:  # type: ignore[union-attr]
            raise ckpt.CheckpointError(
                f"checkpoint {self._loaded_path} holds {saved_layers} layers but configure_pipeline() builds "
                f"{self.layout.num_layers}"  # type: ignore[union-attr]
            )
        # weights and optimizer state are loaded by two hooks: each layer file is read once per resume
        key = (layers.start, layers.stop)
        if key not in self._saved_reads:
            self._saved_reads[key] = ckpt.read_layers(self._loaded_path, layers)
        return self._saved_reads[key]

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """The stage's weights from the checkpoint, and the replica's too: a replica is the successor's state
        as saved, never the seed's (a failover after a resume trains on it)."""
        if self._loaded_path is None:
            return
        ckpt.load_weights(self.engine.module, self._saved_states(self.engine.layer_range), strict=strict)
        replica = self.engine.replica
        if replica is not None:
            ckpt.load_weights(replica.module, self._saved_states(replica.layers), strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """The stage's optimizer state (moments, step counts, hyperparameters) from the checkpoint, and the replica's."""
        if self._loaded_path is None or not self.optimizers:  # type: ignore[attr-defined]
            return
        groups = (self._loaded_meta or {})["bamboo"]["param_groups"]
        ckpt.load_optimizer(self.engine.module, self.engine.optimizer, self._saved_states(self.engine.layer_range), groups)
        replica = self.engine.replica
        if replica is not None:
            ckpt.load_optimizer(replica.module, replica.optimizer, self._saved_states(replica.layers), groups)

    # ------------------------------------------------------------------ teardown
    def teardown(self) -> None:
        if self.resilience is not None:
            trainer = getattr(self.lightning_module, "_trainer", None)  # type: ignore[attr-defined]
            if trainer is not None and not trainer.interrupted:
                self.resilience.finish()  # standby nodes never admitted stop waiting
            self.resilience.stop()
        # The engine and the process group outlive fit(): trainer.save_checkpoint() after fit is
        # common and needs both. They are released at interpreter exit (see _release_at_exit).
        super().teardown()  # type: ignore[misc]
        _release_at_exit(self)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Pipeline-parallel training on DeepSpeed with Bamboo redundant computation",
            override=True,
        )


_TO_RELEASE: list[Any] = []


def _release_at_exit(strategy: Any) -> None:
    if not _TO_RELEASE:
        atexit.register(_release)
        _record_failures()
    if strategy not in _TO_RELEASE:
        _TO_RELEASE.append(strategy)


def _drop_all() -> None:
    """Drop engines and membership watchers of every strategy that ran, and destroy the process group."""
    stores = []
    for strategy in _TO_RELEASE:
        if strategy.resilience is not None:
            strategy.resilience.stop()
            stores.append(getattr(strategy.resilience, "_tcp_store", None))
            strategy.resilience = None
        model = strategy.lightning_module
        if model is not None and hasattr(model, "_bamboo_stage"):
            del model._bamboo_stage
        strategy.engine = None
    _TO_RELEASE.clear()
    gc.collect()
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.destroy_process_group()
    del stores  # a TCPStore we host goes after the group that used it
    gc.collect()


def _release() -> None:
    """Drop engines and destroy the process group before the interpreter tears modules down.

    Without this a gloo run aborts at interpreter exit about one time in four.
    """
    _drop_all()
    from lightning_bamboo.engine.pipe import ABANDONED

    if any(thread.is_alive() for thread in ABANDONED):
        # A step thread abandoned at a failover may still be blocked inside gloo on the old
        # process group; C++ teardown with it there aborts the process ("terminate called").
        # Everything of ours is flushed and closed: leave without that teardown.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1 if _FAILED else 0)


def release_for_restart() -> None:
    """Free what a failed ``fit()`` left (engines, membership watcher, process group), so that this
    process can run ``fit()`` again in a new job: a restart from a checkpoint without a new process.

    A step thread abandoned at a failover may still be blocked in the old process group, waiting on
    a peer that gave up its own step. It is left as a failover leaves it: it holds the old group
    (whose teardown under it could abort the process) until the peer's connection closes or the
    group's timeout ends its wait, and raises ``AbandonedStep`` at its next Python call.
    """
    from lightning_bamboo.engine.pipe import ABANDONED

    ABANDONED[:] = [thread for thread in ABANDONED if thread.is_alive()]  # the exit still skips teardown for them
    _drop_all()


_FAILED = False


def _record_failures() -> None:
    """Remember an uncaught exception, so the exit above keeps a failing run's exit status."""
    previous = sys.excepthook

    def hook(*args: Any) -> None:
        global _FAILED
        _FAILED = True
        previous(*args)

    sys.excepthook = hook


_PATCHED: dict[tuple[type, str], type] = {}


def _under_membership(obj: Any) -> bool:
    return getattr(obj.trainer.strategy, "resilience", None) is not None


def _encode(obj: Any) -> str:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _decode(text: str) -> Any:
    return torch.load(io.BytesIO(base64.b64decode(text)), map_location="cpu", weights_only=False)


_REDUCE_KINDS = ("sum", "avg", "max", "min", "product")


def _reduce_kind(reduce_op: Any) -> str:
    """Lightning's ``reduce_op`` (None for a sum, a name, or a ``ReduceOp``) as one of ``_REDUCE_KINDS``."""
    if reduce_op is None:
        return "sum"
    if isinstance(reduce_op, str):
        kind = "avg" if reduce_op.lower() == "mean" else reduce_op.lower()
        if kind in _REDUCE_KINDS:
            return kind
    else:
        from torch.distributed import ReduceOp

        for kind in _REDUCE_KINDS:
            if reduce_op == getattr(ReduceOp, kind.upper()):
                return kind
    raise BambooConfigError(
        f"strategy='bamboo' reduces with one of {', '.join(_REDUCE_KINDS)} (also 'mean' or a ReduceOp of those); "
        f"got reduce_op={reduce_op!r}"
    )


def _reduced(parts: list[torch.Tensor], kind: str) -> torch.Tensor:
    """Every rank's tensor reduced in rank order (the same result on every rank)."""
    stacked = torch.stack(parts)
    if kind == "sum":
        return stacked.sum(0, dtype=stacked.dtype)
    if kind == "avg":  # as Lightning on gloo: the sum divided by the world size, in the tensor's dtype
        return (stacked.sum(0, dtype=stacked.dtype) / len(parts)).to(stacked.dtype)
    if kind == "product":
        return stacked.prod(0, dtype=stacked.dtype)
    return stacked.amax(0) if kind == "max" else stacked.amin(0)


def _fit_without_val_data(model: Any) -> bool:
    """True when ``model`` is being fit with no validation data (no ``val_dataloader`` anywhere)."""
    trainer = getattr(model, "_trainer", None)
    if trainer is None or str(getattr(trainer.state.fn, "value", trainer.state.fn)) != "fit":
        return False
    return not trainer.fit_loop.epoch_loop.val_loop._data_source.is_defined()


def _skip_sigterm_broadcast(self: Any) -> None:
    """The epoch loop's per-batch "did rank 0 get SIGTERM" broadcast; skipped under membership."""
    if not _under_membership(self):
        base: Any = type(self).__mro__[1]  # Lightning's class (ours is the subclass made below)
        base._broadcast_sigterm_tensor(self)


def _sigterm_is_a_notice(self: Any, signum: Any, frame: Any) -> None:
    """Lightning's SIGTERM handler; under membership a flag only (never a collective in a handler)."""
    if not _under_membership(self):
        base: Any = type(self).__mro__[1]
        base._sigterm_notifier_fn(self, signum, frame)
        return
    from lightning_bamboo.strategy.resilience import request_leave

    # Not ``received_sigterm``: Lightning would raise SIGTERMException after the batch, and a notice
    # that arrives between a commit and the end of the batch would stop the node before it
    # announced that it leaves (its neighbours would lose the step in flight to a failover).
    request_leave()


_REPLACEMENTS = {"_broadcast_sigterm_tensor": _skip_sigterm_broadcast, "_sigterm_notifier_fn": _sigterm_is_a_notice}


def _without_raw_broadcast(base: type, method: str) -> type:
    """A subclass of Lightning's ``base`` whose ``method`` makes no raw collective under membership."""
    if (base, method) not in _PATCHED:
        _PATCHED[base, method] = type(f"Bamboo{base.__name__}", (base,), {"_bamboo": True, method: _REPLACEMENTS[method]})
    return _PATCHED[base, method]


def _pipeline_step_placeholder(self: Any, *args: Any, **kwargs: Any) -> Any:
    """Stands in for a step hook the model does not define: strategy='bamboo' runs the pipeline instead."""
    raise RuntimeError("this step is run by BambooStrategy; it is not meant to be called directly")


class _PreflightLauncherMixin:
    """Runs the strategy's model checks in the launching process before any child process starts."""

    _bamboo_strategy: Any

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        model = args[0] if args and hasattr(args[0], "configure_optimizers") else None
        if not self.cluster_environment.creates_processes_externally and int(os.environ.get("LOCAL_RANK", 0)) == 0:  # type: ignore[attr-defined]
            self._bamboo_strategy.check_before_launch(model, trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]


_LAUNCHERS: dict[type, type] = {}


def make_launcher_class(base: type) -> type:
    if base not in _LAUNCHERS:
        _LAUNCHERS[base] = type(f"Bamboo{base.__name__.lstrip('_')}", (_PreflightLauncherMixin, base), {})
    return _LAUNCHERS[base]


def make_strategy_class(namespace: str) -> type:
    """``BambooStrategy`` for one Lightning namespace (``lightning.pytorch`` or ``pytorch_lightning``)."""
    ddp = importlib.import_module(f"{namespace}.strategies").DDPStrategy
    return type(
        "BambooStrategy",
        (_BambooStrategyMixin, ddp),
        {"_pl_name": namespace, "__module__": __name__, "__doc__": _BambooStrategyMixin.__doc__},
    )


def check_rf_costs(rf_costs: Any) -> Any:
    """``"measured"``, or the ``lightning_bamboo.schedule.Costs`` a dict of its fields gives (checked now,
    not at the first step)."""
    from lightning_bamboo.schedule import Costs, ScheduleError

    if rf_costs == "measured":
        return rf_costs
    if not isinstance(rf_costs, dict):
        raise BambooConfigError(f"rf_costs must be 'measured' or a dict such as {{'forward': 1, 'backward': 2}} "
                                f"(rf_costs: {rf_costs!r})")
    try:
        return Costs(**rf_costs)
    except TypeError as err:
        raise BambooConfigError(f"rf_costs {rf_costs!r}: {err}; the fields are forward, backward, load, send, sync, "
                                "reduce, optimizer") from None
    except ScheduleError as err:
        raise BambooConfigError(f"rf_costs {rf_costs!r}: {err}") from None
