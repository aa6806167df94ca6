"""``BambooStrategy``: Lightning's hooks over a :class:`~lightning_bamboo.runtime.PipelineRunner`.

Lightning has two namespaces (``lightning.pytorch`` and ``pytorch_lightning``) with separate
class hierarchies, so the hooks live in a mixin and each namespace gets its own subclass of
its ``DDPStrategy`` (see :func:`make_strategy_class`).
"""

from __future__ import annotations

import importlib
import logging
import types
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as torch_dist
from typing_extensions import override

from lightning_bamboo.engine import comm_process, comm_zygote
from lightning_bamboo.engine.comm_process import BACKEND
from lightning_bamboo.engine.guard import STEP_FINISH_SECONDS
from lightning_bamboo.engine.partition import compute_parts
from lightning_bamboo.errors import BambooConfigError, FatalLoss
from lightning_bamboo.runtime.config import (
    DEFAULT_DETECTION_SECONDS,
    DEFAULT_REDUNDANCY,
    DEFAULT_TIMEOUT_SECONDS,
    BambooConfig,
)
from lightning_bamboo.runtime.refusal import refused_quietly, report_config_errors_briefly, stop_if_refused
from lightning_bamboo.runtime.runner import PipelineRunner
from lightning_bamboo.runtime.session import joining, launched_by_bamboo
from lightning_bamboo.strategy import patches
from lightning_bamboo.strategy.checkpoint_hooks import CheckpointHooks
from lightning_bamboo.strategy.checks import (
    check_batches,
    check_fit_data_before_launch,
    check_trainer,
    launched_ranks,
    warn_if_replicas_cannot_help,
    warn_if_replicas_share_machines,
)
from lightning_bamboo.strategy.collectives import ResilientCollectives
from lightning_bamboo.strategy.lightning_host import LightningHost
from lightning_bamboo.strategy.loading import PipelineData
from lightning_bamboo.strategy.options import StrategyOptions
from lightning_bamboo.strategy.restart import FitRestarts
from lightning_bamboo.topology.layout import resolve_stages

if TYPE_CHECKING:
    from lightning.pytorch.strategies import DDPStrategy as _Lightning

    from lightning_bamboo.engine.pipe import BambooPipelineEngine
    from lightning_bamboo.runtime.session import Reconfiguration, Session
    from lightning_bamboo.topology.layout import Layout

else:
    _Lightning = object  # each namespace's DDPStrategy (see make_strategy_class); typed as lightning.pytorch's

log = logging.getLogger(__name__)


class _BambooStrategyMixin(StrategyOptions, CheckpointHooks, ResilientCollectives):
    """Train a LightningModule as a DeepSpeed pipeline: ``stages`` deep, ``devices // stages`` pipelines wide.

    The module defines ``configure_pipeline()`` (the layers, in order), ``pipeline_loss(outputs,
    targets)`` and ``configure_optimizers()``; each batch ``(inputs, targets)`` is split into
    micro-batches of ``micro_batch_size`` and run by the engine's 1F1B schedule.

    Layers returned as DeepSpeed ``LayerSpec``s are built only by the processes that hold them (their stage
    and the replica of it), each under ``seed + index``: a process materialises only its layers, at start and
    at every failover, move and admission. Layers returned already built (``nn.Module``s) are built by
    ``configure_pipeline()`` itself, under ``seed``, on every process (``engine.module.build_layers``).
    """

    strategy_name = "bamboo"
    _pl_name = "lightning.pytorch"  # set per namespace by make_strategy_class

    def __init__(
        self,
        stages: int | None = None,
        micro_batch_size: int = 1,
        partition: str | list[int] = "parameters",
        seed: int | None = None,
        redundancy: str = DEFAULT_REDUNDANCY,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        detection_timeout: float = DEFAULT_DETECTION_SECONDS,
        config: dict[str, Any] | None = None,
        process_group_backend: str | None = None,
        rf_costs: str | dict[str, float] = "measured",
        audit_replicas: bool = False,
        replica_placement: str = "auto",
        replica_memory_budget: int | None = None,
        activation_checkpointing: int = 0,
        restart_on_fatal_loss: bool = True,
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
            seed: seed the layers are built under (default: the ``seed_everything`` seed, else 0): a
                ``LayerSpec`` at index ``i`` under ``seed + i``, ``configure_pipeline()`` itself under ``seed``.
            redundancy: ``"off"``: a plain pipeline. ``"lazy"``: every node keeps an exact replica of
                its successor's stage (host memory) and takes over when the successor is lost.
                ``"eager"``: lazy, plus the successor's forward run redundantly in the pipeline
                bubbles, its graph kept (host memory) until the step commits; a failover then skips
                the dead stage's forward for those micro-batches and runs only its backward.
                ``"auto"`` (the default): lazy's replica only where a loss would otherwise lose work: under the
                Bamboo launcher, of the stages with no data-parallel copy on another machine (a launcher's
                ``--workers`` are one machine): with one pipeline every stage (as lazy); with pipelines whose
                copies of each stage sit on different machines none, and a loss drops the damaged pipeline
                while the whole ones train on (a loss in every pipeline then restarts from the checkpoint).
                Rebuilt with the layout at every failover and reconfiguration. Without the Bamboo launcher no
                process outlives a lost one, so ``auto`` keeps none there (as ``off``), nor with one stage.
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
            replica_placement: on a GPU, where a replica (weights, gradients and optimizer state: about 16
                bytes per parameter with AdamW) lives: ``"auto"`` on the GPU when it fits in
                ``replica_memory_budget``, else in pinned host memory; ``"device"`` or ``"host"`` always
                there. In host memory its redundant forwards run on a copy of its weights on the GPU, and
                its update on the GPU a layer at a time (the owner's arithmetic: exact), at the cost of
                moving its state there and back each step. On CPU the replica is in host memory.
            activation_checkpointing: layers per activation-checkpointed segment (0: off): a segment keeps only its
                input and runs its forward again in its backward, with the same dropout masks (bit-exact).
            restart_on_fatal_loss: under the Bamboo launcher a loss no replica covers restarts ``fit`` in the
                surviving processes from the last complete checkpoint (default); False raises ``FatalLoss`` instead.
            replica_memory_budget: bytes of GPU memory a replica may take under ``"auto"`` (default: what
                is free once the stage is built, less a quarter of the GPU's memory for activations).
            process_group_backend: ``None`` (default) or ``"nccl"``: the abortable backend
                (``lightning_bamboo.engine.comm_process``), with NCCL in its communication process on
                a GPU (one GPU per process) and gloo on CPU. Any other backend (``"gloo"``) is used
                as it is and cannot be aborted: a failover then waits for a blocked step to return.
        """
        report_config_errors_briefly()
        self.options = BambooConfig(
            stages=stages, micro_batch_size=micro_batch_size, partition=partition, seed=seed, redundancy=redundancy,
            timeout=timeout, detection_timeout=detection_timeout, deepspeed=dict(config or {}), rf_costs=rf_costs,
            audit_replicas=audit_replicas, replica_placement=replica_placement,
            replica_memory_budget=replica_memory_budget, activation_checkpointing=activation_checkpointing,
            restart_on_fatal_loss=restart_on_fatal_loss,
        )
        super().__init__(process_group_backend=process_group_backend, timeout=timedelta(seconds=timeout), **kwargs)
        self.runner = PipelineRunner(self.options, LightningHost(self))
        self.data = PipelineData()
        self._loaded_path: Path | None = None
        self._admitted_checkpoint: dict[str, Any] | None = None  # a joining node's state, from a running node
        self._resume_rng: dict[str, Any] | None = None  # this process's RNG states from the checkpoint, until on_train_start
        self._inject_sampler: bool | None = None  # the Trainer's use_distributed_sampler, before we take it over
        self._admission: Reconfiguration | None = None  # the reconfiguration record that admitted this (joining) node
        #: (rank, world size) of a process group formed by lightning_bamboo before Lightning's setup (an
        #: admission, or a start without nodes that died), not the launch environment's
        self._assigned: tuple[int, int] | None = None
        #: what a restart of ``fit`` after a fatal loss needs of this run (``strategy.restart``)
        self.restarts = FitRestarts()

    # ------------------------------------------------------------------ runner state
    @property
    def engine(self) -> BambooPipelineEngine | None:
        """The DeepSpeed pipeline engine running this process's stage (after ``setup``)."""
        return self.runner.engine

    @property
    def resilience(self) -> Session | None:
        """The node's membership session under the Bamboo launcher (None elsewhere)."""
        return self.runner.session

    @property
    def layout(self) -> Layout | None:
        return self.runner.layout

    @property
    def audits(self) -> int:
        return self.runner.audits

    @property
    def keep_global_batch(self) -> bool:
        """False (``HydrozoaTuner(scale_batch=True)``): a resume in another layout scales the global batch."""
        return self.data.keep_global_batch

    @keep_global_batch.setter
    def keep_global_batch(self, value: bool) -> None:
        self.data.keep_global_batch = value

    @property
    def _module(self) -> Any:
        """The LightningModule (after ``connect``)."""
        return self.lightning_module

    def pl_package(self, module: str) -> types.ModuleType:
        """``module`` of the Lightning package this strategy was built for: ``lightning.pytorch.<module>`` or
        ``pytorch_lightning.<module>``."""
        return importlib.import_module(f"{self._pl_name}.{module}")

    # ------------------------------------------------------------------ launching
    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        launcher = self._launcher
        script_launcher = self.pl_package("strategies.launchers.subprocess_script")._SubprocessScriptLauncher
        if type(launcher) is script_launcher:
            self._launcher = patches.make_launcher_class(script_launcher)(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
            self._launcher._bamboo_strategy = self  # type: ignore[union-attr]

    def check_before_launch(self, model: Any, trainer: Any = None, fit_args: Sequence[Any] = ()) -> None:
        """Checks that need no process group: run once in the launching process, before any child exists.
        ``fit_args``: ``trainer.fit``'s arguments under Lightning's own launcher, whose training data is then
        checked here too (under the Bamboo launcher the strategy checks it when the model is connected).

        A callback with ``sets_bamboo_layout = True`` (HydrozoaTuner) chooses stages and partition in
        its ``setup``, inside the processes: then only the model's hooks are checked here.
        """
        if trainer is not None:  # precision, clipping and accumulation: the Trainer's options, known already
            self._set_options(check_trainer(trainer, self.options, getattr(self.precision_plugin, "precision", "32-true")))
        if joining() or any(getattr(cb, "sets_bamboo_layout", False) for cb in getattr(trainer, "callbacks", None) or ()):
            if model is not None:
                self._check_model(model)
            return
        stages, pipelines = resolve_stages(self.world_size, self.stages)
        if model is not None:
            self._check_model(model)
            probe = self.runner.probe(model)
            compute_parts(self.partition, stages, probe.param_counts, probe.names)
        check_fit_data_before_launch(fit_args, trainer, self.micro_batch_size, pipelines)

    def admit(self) -> None:
        """A standby node: wait for an admission and enter the job's process group at the rank it gives
        (``PipelineRunner.join``: an admission a loss interrupts waits for the next); ``setup`` then takes the stage
        and the training state from the running nodes. The job finished first: this node ends with status 0."""
        joined = self.runner.join()
        if joined is None:
            raise SystemExit(0)
        self._admission, rank, world = joined
        self._assigned = (rank, world)
        self.set_world_ranks()

    def forget_start(self) -> None:
        """Drop what the last start of ``fit`` read (an admission, a resume's RNG): a restart reads its own."""
        self._admission = self._admitted_checkpoint = None
        self._resume_rng = self._loaded_path = None

    def _check_model(self, model: Any) -> None:
        for hook in ("configure_pipeline", "pipeline_loss"):
            if not callable(getattr(model, hook, None)):
                raise BambooConfigError(
                    f"strategy='bamboo' builds the model from LightningModule.{hook}(), which "
                    f"{type(model).__name__} does not define; add `def configure_pipeline(self)` returning the "
                    f"layers in order and `def pipeline_loss(self, outputs, targets)` returning the loss"
                )

    # ------------------------------------------------------------------ environment
    @override
    def setup_environment(self) -> None:
        runner = self.runner
        backend = self._get_process_group_backend()
        runner.place(backend=backend)  # before any group forms (an admission forms one here)
        if backend == BACKEND:
            self._use_transport()
            comm_zygote.prepare()  # its torch import overlaps the rendezvous
        if backend != BACKEND and launched_by_bamboo():
            log.warning("process_group_backend=%r cannot be aborted: a failover waits until a step blocked on a lost "
                        "peer returns by that backend's own timeout (and gives up after %g s: a restart from the "
                        "checkpoint). The default, %r, ends such waits at once.", backend,
                        STEP_FINISH_SECONDS, BACKEND)
        if joining() and runner.session is None:
            # A node joining a running job: standby until a reconfiguration admits it, then its
            # process group is the job's (Lightning finds it initialised and keeps it).
            self.admit()
        resolve_stages(self.world_size, self.runner.depth)  # fail before joining a group (an admission set the depth)
        if runner.session is None and runner.open_session() is not None:
            # before the process group: its TCPStore rendezvous cannot tell a dead node from a slow one
            if runner.session is not None and runner.session.start_lost:
                self._assigned = runner.start_without_lost()
                self.set_world_ranks()
        super().setup_environment()

    @override
    def _get_process_group_backend(self) -> str:
        """The abortable backend (``lightning_bamboo.engine.comm_process``) unless another was chosen;
        ``"nccl"`` is the abortable backend with NCCL in its communication process."""
        if self._process_group_backend and self._process_group_backend not in ("nccl", BACKEND):
            return self._process_group_backend
        if self._process_group_backend == "nccl" and self.root_device.type != "cuda":
            raise BambooConfigError(
                f"process_group_backend='nccl' runs on GPUs, and this process's device is {self.root_device}; "
                "use Trainer(accelerator='gpu'), or leave process_group_backend unset (gloo on CPU)")
        return BACKEND

    def _use_transport(self) -> None:
        """NCCL in the communication process on this process's GPU; gloo on CPU (``comm_cuda``)."""
        device = self.root_device
        comm_process.use_transport("nccl" if device.type == "cuda" else "gloo", device)

    def _connect(self) -> None:
        """``DDPStrategy.setup_distributed``; for the abortable backend without ``device_id``: its groups live in
        the communication process (NCCL there is bound to this process's GPU by the transport), and torch
        would look for a backend of the GPU in the group to connect it eagerly."""
        if self._get_process_group_backend() != BACKEND:
            super().setup_distributed()
            return
        ddp = self.pl_package("strategies.ddp")
        ddp.reset_seed()
        self.set_world_ranks()
        self._process_group_backend = BACKEND
        assert self.cluster_environment is not None
        ddp._init_dist_connection(self.cluster_environment, BACKEND, timeout=self._timeout)

    @override
    def setup_distributed(self) -> None:
        """Lightning's process group; under the Bamboo launcher its forming is bounded by a short timeout.

        Every node passed the start rendezvous, so all are up; one that dies now would leave the others
        waiting for it to connect. The connect gets a few detection timeouts instead (``FatalLoss``:
        start again with the nodes that are up), polled against the loss detector, and the group gets
        the strategy's timeout back once formed. (With plain gloo the connect cannot be interrupted:
        the abortable backend forms its groups in a process that can be stopped.)
        """
        session = self.runner.session
        if session is None or self._assigned is not None or torch_dist.is_initialized():
            self._connect()
            return
        full = self._timeout or timedelta(seconds=self.options.timeout)
        connect = min(full, timedelta(seconds=max(3 * self.options.detection_timeout, 15.0)))
        if self._get_process_group_backend() == BACKEND:
            comm_process.watch_while_forming(lambda: bool(session.detector.lost), within=connect.total_seconds())
        else:
            self._timeout = connect  # gloo's own connect: bounded by its timeout only
        try:
            self._connect()
        except (RuntimeError, torch_dist.DistError) as err:
            stop_if_refused(session)  # the node that never connected refused the configuration
            raise FatalLoss(f"the job's process group did not form within {connect.total_seconds():g} s ({err}); a "
                            "node died after the start rendezvous: start again with the nodes that are up") from err
        finally:
            comm_process.watch_while_forming(lambda: False)
            self._timeout = full
        if self._get_process_group_backend() != BACKEND:  # the abortable backend's timeout is its own
            torch_dist.distributed_c10d._set_pg_timeout(full)

    @override
    def set_world_ranks(self) -> None:
        """Under the Bamboo launcher ``RANK``/``WORLD_SIZE`` as it set them (its machine-aware order, not Lightning's
        ``node_rank x devices + local_rank``; a standby node's come with its admission); ``LOCAL_RANK`` is the index
        on the machine, ``devices`` per machine."""
        super().set_world_ranks()
        with refused_quietly():  # (when the Trainer is made: before this worker joins the job)
            ranks = self._assigned or (None if joining() else launched_ranks(self.local_rank, self.num_processes))
        if ranks is not None:
            self.enter_group(*ranks)

    def enter_group(self, rank: int, world: int) -> None:
        """Lightning's view of this process: ``rank`` of ``world`` (the runner formed the group)."""
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(rank)
        self.cluster_environment.set_world_size(world)
        self.pl_package("utilities.rank_zero").rank_zero_only.rank = rank

    @property
    def pipelines(self) -> int:
        return resolve_stages(self.world_size, self.runner.depth)[1]  # the running layout's depth, not the option

    @property
    def pipeline_rank(self) -> int:
        """Which data-parallel pipeline this process belongs to."""
        return self.global_rank % self.pipelines

    @property
    def elastic_pipelines(self) -> bool:
        """Whether the number of pipelines may change between steps (every node loads the global batches)."""
        return self.data.global_batches

    @property
    def global_micro_batches(self) -> int | None:
        """Micro-batches per step over all pipelines, once the training data is set up with global batches."""
        if not self.data.global_batches or self.data.global_batch is None:
            return None
        return self.data.global_batch // self.micro_batch_size

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every stage of a pipeline must see the same batch: shard by pipeline, not by process
        return {"num_replicas": self.pipelines, "rank": self.pipeline_rank}

    @override
    def connect(self, model: Any) -> None:
        with refused_quietly():  # under the Bamboo launcher: before the membership rendezvous
            # a joining node takes the running job's layout and data; a restart the survivors' (checked at the start)
            if launched_by_bamboo() and not joining() and not self.runner.restarting and self._admission is None:
                self.check_before_launch(model, model._trainer)
                self._data_checked = check_batches(model._trainer, self.micro_batch_size, self.pipelines, early=True)
            self._check_model(model)
        super().connect(model)
        utils = self.pl_package("utilities.model_helpers")
        for hook in ("training_step", "validation_step", "test_step"):
            if utils.is_overridden(hook, model):
                if getattr(getattr(model, hook), "__func__", None) is patches.pipeline_step_placeholder:
                    continue  # ours, from an earlier start of fit in this process (a restart, an admission)
                if hook == "training_step":
                    log.warning(
                        "%s.training_step is not called with strategy='bamboo': the pipeline runs "
                        "configure_pipeline() layers and pipeline_loss(); log from on_train_batch_end instead",
                        type(model).__name__,
                    )
                continue
            if hook == "validation_step" and patches.fit_without_val_data(model):
                continue  # no validation runs: a placeholder would only make Lightning warn that it has no data
            # Lightning requires these hooks to exist; the strategy runs the pipeline in their place.
            setattr(model, hook, types.MethodType(patches.pipeline_step_placeholder, model))

    # ------------------------------------------------------------------ model and engine
    @override
    def setup(self, trainer: Any) -> None:
        from lightning_bamboo.callbacks.failover_metrics import add_failover_metrics

        with refused_quietly():
            self._set_options(check_trainer(trainer, self.options, getattr(self.precision_plugin, "precision", "32-true")))
            self._take_over_sampler_injection(trainer)
            if not (getattr(self, "_data_checked", False) or joining()):  # before the engine is built
                check_batches(trainer, self.micro_batch_size, self.pipelines)
        if self.global_rank == 0:
            warn_if_replicas_cannot_help(self.redundancy)
            if not joining():
                warn_if_replicas_share_machines(self.redundancy, resolve_stages(self.world_size, self.runner.depth)[0],
                                                self.world_size)
        patches.no_sigterm_broadcast_under_membership(trainer)
        add_failover_metrics(trainer)  # failovers, recovery seconds and live nodes in the trainer's loggers
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        runner = self.runner
        runner.place(self.root_device, self._get_process_group_backend())
        model: Any = self.lightning_module
        clipping = float(trainer.gradient_clip_val or 0.0)
        fitting = trainer.state.fn == self.pl_package("trainer.states").TrainerFn.FITTING
        if self._admission is not None:
            if not fitting:
                raise BambooConfigError("a node joins a running job only to train (trainer.fit)")
            meta = runner.start_admitted(model, self._admission, clipping)
            # Lightning restores loops, schedulers and callbacks from this as from a checkpoint file
            # (weights and optimizer state are in the stage already).
            self._admitted_checkpoint = {**meta, "state_dict": {}}
            trainer._checkpoint_connector._loaded_checkpoint = self._admitted_checkpoint
            self.data.restore(meta["bamboo"])
        else:
            runner.start(model, self.world_size, self.global_rank, fitting, clipping)
        self.model = model  # no DDP wrapper: the engine reduces gradients
        self.setup_precision_plugin()

    @override
    def model_to_device(self) -> None:
        pass  # the engine places the stage; the LightningModule holds no other weights

    # ------------------------------------------------------------------ steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        batch = args[0] if args else kwargs["batch"]
        with refused_quietly():  # a batch that only the step could check (an iterable dataset's)
            loss = self.runner.train_step(batch)
        trainer = self._module.trainer
        self.data.advance(trainer.current_epoch, len(batch[0]), self.pipelines)
        self._module.log("train_loss", loss, prog_bar=True, on_step=True, sync_dist=False)
        finished = self.engine.finished if self.engine is not None else None
        if finished is not None:  # clipping or fp16: the global norm before clipping (inf: a skipped fp16 step)
            self._module.log("grad_norm", finished.norm, on_step=True, sync_dist=False)
        return loss

    def _eval_step(self, name: str, batch: Any) -> torch.Tensor:
        loss = self.runner.eval_step(batch)
        # equal on every stage of a pipeline; averaging over all processes averages the pipelines
        self._module.log(name, loss, prog_bar=True, sync_dist=True)
        return loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._eval_step("val_loss", args[0] if args else kwargs["batch"])

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._eval_step("test_loss", args[0] if args else kwargs["batch"])

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        raise BambooConfigError(
            "strategy='bamboo' does not support trainer.predict (only the last stage holds outputs); "
            "consolidate_checkpoint() the weights and predict with nn.Sequential(*model.configure_pipeline())"
        )

    @override
    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return closure_loss  # train_batch already ran every backward pass of the pipeline

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        return closure()  # the closure runs train_batch, which ends with the optimizer step

    def _take_over_sampler_injection(self, trainer: Any) -> None:
        """Shard data by pipeline ourselves: Lightning would always shuffle training data."""
        connector = trainer._accelerator_connector
        if self._inject_sampler is None:
            self._inject_sampler = bool(connector.use_distributed_sampler)
        connector.use_distributed_sampler = False

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """Give each pipeline its share of the data: one global order, cut per step (see ``PipelineData``)."""
        sampler = getattr(dataloader, "sampler", None)
        if not self._inject_sampler or not isinstance(dataloader, torch.utils.data.DataLoader) or sampler is None:
            return dataloader
        running = self.pl_package("trainer.states").RunningStage
        training = self._module.trainer.state.stage == running.TRAINING
        update = self.pl_package("utilities.data")._update_dataloader
        return self.data.loader(dataloader, training, self.pipelines, self.pipeline_rank,
                                lambda loader, sampler: update(loader, sampler, mode=running.TRAINING if training else None))

    # ------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        trainer = getattr(self.lightning_module, "_trainer", None)
        self.runner.finish(completed=trainer is not None and not trainer.interrupted)
        # The engine and the process group outlive fit(): trainer.save_checkpoint() after fit is
        # common and needs both. They are released at interpreter exit (see patches.release_at_exit).
        super().teardown()
        patches.release_at_exit(self)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Pipeline-parallel training on DeepSpeed with Bamboo redundant computation",
            override=True,
        )


def make_strategy_class(namespace: str) -> type:
    """``BambooStrategy`` for one Lightning namespace (``lightning.pytorch`` or ``pytorch_lightning``)."""
    ddp = importlib.import_module(f"{namespace}.strategies").DDPStrategy
    return type(
        "BambooStrategy",
        (_BambooStrategyMixin, ddp),
        {"_pl_name": namespace, "__module__": __name__, "__doc__": _BambooStrategyMixin.__doc__},
    )

