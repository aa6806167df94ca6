"""``ResilientPipelineEngine``: a DeepSpeed training loop's engine with replicas and failover.

``lightning_bamboo.initialize`` returns one under the Bamboo launcher when the config's ``"bamboo"`` section asks
for ``"redundancy": "lazy"`` or ``"eager"``. It speaks DeepSpeed's pipeline engine's language
(``train_batch(data_iter)``, ``save_checkpoint``, ``load_checkpoint``, ``global_steps``, ...) and runs the same
``PipelineRunner`` as ``BambooStrategy``: every node builds its stage of the model from the ``PipelineModule``'s
layer list, keeps a replica of its successor's stage, and redoes a step a lost node was in, from the step's
micro-batches that it kept. A ``LayerSpec`` is built only by the nodes that hold it, under ``base_seed + index``
(DeepSpeed's ``seed_layers=True`` rule, whatever the module's ``seed_layers``; a ``seed_fn`` is not called), so
its weights equal DeepSpeed's own ``PipelineModule(seed_layers=True)`` build in any layout and through failovers.

The data contract is the Lightning path's: every node draws the same **global** batch, ``gradient_accumulation_steps``
micro-batches per pipeline of the job's start, from its own iterator (the same sequence on every node), so a lost
pipeline's share of a step is never skipped. Each micro-batch is ``(inputs, targets)`` of tensors.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_bamboo import checkpoint as ckpt
from lightning_bamboo.errors import BambooConfigError, FatalLoss, JobRestarted, Released
from lightning_bamboo.runtime.config import BambooConfig
from lightning_bamboo.runtime.leave import LEAVE
from lightning_bamboo.runtime.notices import pollers_from_config
from lightning_bamboo.runtime.rebalance import from_config, runtime_placement

log = logging.getLogger(__name__)

#: DeepSpeed's optimizer ``type`` names (lower case) -> a torch optimizer; "adam" is AdamW unless adam_w_mode is false
_OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad}

#: keys of the DeepSpeed config the engine takes over (the rest goes to DeepSpeed's engine as it is)
_TAKEN = ("optimizer", "scheduler", "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class PipelineModuleModel:
    """The ``PipelineModule``'s layers and loss, as the runner reads a model (``runtime.host.PipelineModel``): its
    ``LayerSpec``s as specs (each built only where held, ``engine.module.build_layers``)."""

    def __init__(self, module: Any) -> None:
        self.specs, self.loss_fn = list(module._layer_specs), module.loss_fn

    def configure_pipeline(self) -> list[Any]:
        return list(self.specs)

    def pipeline_loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        return self.loss_fn(outputs, targets)


class _Host:
    """What the loop tells the runner: its step counter, and the optimizer and scheduler the config describes."""

    def __init__(self, make_optimizer: Any, make_scheduler: Any, micro_batches_per_step: int) -> None:
        self.make_optimizer, self.make_scheduler = make_optimizer, make_scheduler
        #: micro-batches per step over all pipelines: every node draws the global batch
        self.micro_batches_per_step = micro_batches_per_step
        self.step = 0
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.meta: Any = None  # () -> the training state a joining node gets (set by the engine)

    def global_step(self) -> int:
        return self.step

    def adopt_stage(self, module: torch.nn.Module) -> None:
        self.stage = module

    def optimizer_for(self, module: torch.nn.Module) -> torch.optim.Optimizer:
        return self.make_optimizer([p for p in module.parameters() if p.requires_grad])

    def setup_optimizers(self, module: torch.nn.Module) -> torch.optim.Optimizer:
        self.optimizer = self.optimizer_for(module)
        self.scheduler = self.make_scheduler(self.optimizer) if self.make_scheduler is not None else None
        return self.optimizer

    def rebind_optimizer(self, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
        self.optimizer = new
        if self.scheduler is not None:
            self.scheduler.optimizer = new

    def enter_group(self, rank: int, world: int) -> None:
        pass

    def training_state(self) -> dict[str, Any]:
        return self.meta() if self.meta is not None else {}

    def global_micro_batches(self) -> int:
        return self.micro_batches_per_step


def optimizer_factory(config: dict[str, Any], optimizer: Any) -> Any:
    """``params -> optimizer``: the ``optimizer`` argument if it is a callable, else the config's section."""
    if optimizer is not None:
        if isinstance(optimizer, torch.optim.Optimizer):
            raise BambooConfigError(
                "with replicas, lightning_bamboo.initialize builds each stage's optimizer itself (a failover rebuilds "
                f"it for other layers), so it takes a callable, not an optimizer built on the whole model (got "
                f"{type(optimizer).__name__}); pass optimizer=lambda params: torch.optim.{type(optimizer).__name__}"
                "(params, ...) or an \"optimizer\" section in the config"
            )
        if not callable(optimizer):
            raise BambooConfigError(f"optimizer must be a callable params -> optimizer (got {type(optimizer).__name__})")
        return optimizer
    section = config.get("optimizer")
    if not isinstance(section, dict) or "type" not in section:
        raise BambooConfigError('no optimizer: pass optimizer=lambda params: ... or an "optimizer" section '
                                '{"type": "AdamW", "params": {"lr": ...}} in the config')
    name = str(section["type"]).lower()
    params = dict(section.get("params", {}))
    params.pop("torch_adam", None)
    if name == "adam":
        name = "adamw" if params.pop("adam_w_mode", True) else "adam"
    cls = _OPTIMIZERS.get(name) or (torch.optim.Adam if name == "adam" else None)
    if cls is None:
        raise BambooConfigError(f"optimizer type {section['type']!r} is not supported with replicas; use one of "
                                f"Adam, AdamW, SGD, Adagrad, or pass optimizer=lambda params: ...")
    return lambda model_params: cls(model_params, **params)


def scheduler_factory(config: dict[str, Any], lr_scheduler: Any) -> Any:
    """``optimizer -> scheduler`` (stepped after each committed step): the argument if callable, else the config's
    ``"scheduler"`` section (DeepSpeed's ``lr_schedules``), else None."""
    if lr_scheduler is not None:
        if not callable(lr_scheduler) or hasattr(lr_scheduler, "step"):
            raise BambooConfigError("with replicas, lr_scheduler must be a callable optimizer -> scheduler (each "
                                    "stage's optimizer is built by lightning_bamboo); or use a \"scheduler\" section")
        return lr_scheduler
    section = config.get("scheduler")
    if not isinstance(section, dict):
        return None
    from deepspeed.runtime import lr_schedules

    cls = getattr(lr_schedules, str(section.get("type")), None)
    if cls is None:
        raise BambooConfigError(f"unknown scheduler type {section.get('type')!r}; use one of DeepSpeed's lr_schedules")
    params = dict(section.get("params", {}))
    return lambda optimizer: cls(optimizer, **params)


class ResilientPipelineEngine:
    """DeepSpeed's pipeline engine, as a loop uses it, with replicas and failover (see the module's docstring).

    Other attributes (``module``, ``optimizer``, ``is_last_stage()``, ...) are the current stage engine's: after a
    failover that is another engine, with other layers.
    """

    def __init__(self, module: Any, config: dict[str, Any], options: BambooConfig, optimizer: Any = None,
                 lr_scheduler: Any = None, training_data: Any = None, collate_fn: Any = None) -> None:
        from lightning_bamboo.runtime import PipelineRunner
        from lightning_bamboo.runtime.session import launched_by_bamboo

        if not launched_by_bamboo():
            raise BambooConfigError(
                f'"bamboo.redundancy" = {options.redundancy!r} needs the Bamboo launcher (its membership store '
                "finds a lost node); start the script with python -m lightning_bamboo.launcher --nodes N -- python "
                'SCRIPT, or use "redundancy": "off"'
            )
        micro = int(config.get("train_micro_batch_size_per_gpu") or 0)
        accumulation = int(config.get("gradient_accumulation_steps") or 1)
        if micro < 1:
            raise BambooConfigError("the config needs train_micro_batch_size_per_gpu (the samples of a micro-batch)")
        world = dist.get_world_size()
        stages = int(module.num_stages)
        if world % stages:
            raise BambooConfigError(f"{world} processes do not form pipelines of {stages} stages; start a multiple of "
                                    f"{stages} nodes or build the PipelineModule with num_stages dividing {world}")
        self.pipelines_at_start = world // stages
        self.micro_batches = accumulation  # per pipeline of the job's start, as DeepSpeed counts them
        rest = {k: v for k, v in config.items() if k not in _TAKEN}
        # the section's options, with what the module and the rest of the DeepSpeed config give
        self.config = options.replace(
            stages=stages, micro_batch_size=micro, partition=getattr(module, "partition_method", "parameters"),
            seed=int(getattr(module, "base_seed", 1234)), deepspeed=rest,
            # DeepSpeed's activation_checkpoint_interval, run by the stage itself (exact with the per-layer streams)
            activation_checkpointing=int(getattr(module, "activation_checkpoint_interval", 0) or 0),
        )
        self.host = _Host(optimizer_factory(config, optimizer), scheduler_factory(config, lr_scheduler),
                          accumulation * self.pipelines_at_start)
        self.host.meta = self._meta
        device = torch.device("cpu")
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        self.runner = runner = PipelineRunner(self.config, self.host, device=device)
        opened = OPENED.take()  # the job init_distributed opened (None: a test's or a caller's own session)
        runner.open_session(session=opened.session if opened is not None else None)
        self.rebalancer = from_config(self.config.rebalance)
        self.training_dataloader = self._loader(training_data, collate_fn, micro) if training_data is not None else None
        self._data: Iterator[Any] | None = None
        self.drawn = 0  # micro-batches drawn from the data so far (a checkpoint keeps it: ``data_position``)
        self._failed = False
        #: restarts from the last checkpoint after fatal losses, oldest first (see ``train_batch``)
        self.restarts: list[dict[str, Any]] = []
        self._checkpoints: Path | None = None  # the directory of the last save or load: a restart loads its latest
        self._model = PipelineModuleModel(module)
        if opened is not None and opened.admission is not None:
            self._join(opened.admission)
        elif opened is not None and opened.start_lost:  # the survivors of a start: their group, not the launch's world
            from lightning_bamboo.engine.construct import ensure_deepspeed_comm

            dist.destroy_process_group()
            rank, world = runner.start_without_lost()
            ensure_deepspeed_comm(runner.backend)
            runner.start(self._model, world, rank, fitting=True)
        else:
            runner.start(self._model, world, dist.get_rank(), fitting=True)
            if dist.get_rank() == 0 and runner.session is not None:
                runner.publish(_START_WORLD, str(world))  # a node admitted later builds its PipelineModule at this size
        if self.rebalancer is not None and runner.session is not None:
            self.rebalancer.attach(runner, micro)
            self.rebalancer.begin(runtime_placement(runner, self.host.global_micro_batches()), runner.layer_costs())
        _watch_exit(self)
        # SIGTERM (a spot notice, a scheduler's stop) and the section's notice sources: this node leaves after the
        # step in flight commits, its stage served from its replica by the others, and exits 0 from train_batch
        LEAVE.on_sigterm()
        self.notices = LEAVE.watch(pollers_from_config(self.config.notices, '"bamboo.notices"'),
                                   self.config.notice_interval)

    def _join(self, record: Any | None) -> None:
        """A standby node admitted by ``record`` (None: not yet; wait for an admission): leave the standby world
        (``open_job``) or the old layout's, enter the job's process group (an admission a loss interrupts waits for
        the next: ``PipelineRunner.join``), take the layers the record gives this node and the training state (step,
        data position, scheduler) from the running nodes, as a resume from a checkpoint would; an admission a loss
        interrupts while the layers come stands this node by again, and it waits for the next. ``SystemExit(0)``
        when the job finishes first."""
        from lightning_bamboo.engine.construct import ensure_deepspeed_comm

        runner = self.runner
        while True:
            if dist.is_initialized():
                dist.destroy_process_group()
            joined = runner.join(record)
            if joined is None:
                raise SystemExit(0)
            record = joined[0]
            ensure_deepspeed_comm(runner.backend)
            try:
                meta = runner.start_admitted(self._model, record)
                break
            except Released:  # it stands by again (``start_admitted``)
                record = None
        self.host.step = int(meta["bamboo"].get("global_steps", 0))
        self.drawn = int(meta.get("data_position", 0))
        if self.host.scheduler is not None and meta.get("lr_scheduler") is not None:
            self.host.scheduler.load_state_dict(meta["lr_scheduler"])
        if self.rebalancer is not None and meta.get("rebalance") is not None:
            self.rebalancer.load_state_dict(meta["rebalance"])  # the running nodes' view and preferred depth
        log.warning("%s: joined the running job at step %d (%d micro-batches drawn before it)", runner.node,
                    self.host.step, self.drawn)

    # ------------------------------------------------------------------ DeepSpeed's surface
    def __getattr__(self, name: str) -> Any:
        engine = self.__dict__.get("runner") and self.__dict__["runner"].engine
        if engine is None:
            raise AttributeError(name)
        return getattr(engine, name)

    @property
    def global_steps(self) -> int:
        return self.host.step

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.host.optimizer

    @property
    def lr_scheduler(self) -> Any:
        return self.host.scheduler

    def train_batch_size(self) -> int:
        return self.config.micro_batch_size * self.micro_batches * self.pipelines_at_start

    def _loader(self, data: Any, collate_fn: Any, micro: int) -> torch.utils.data.DataLoader:
        # One order for every node, not a shard per data-parallel rank: each node draws the global batch. It is the
        # order DeepSpeed's loader gives a single pipeline (a DistributedSampler of one replica, seed 0, no set_epoch).
        sampler: torch.utils.data.Sampler[int] = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0,
                                                                                      shuffle=True, seed=0)
        # Its iterators' seeds come from a generator of its own, not torch's: a resume that skips the micro-batches
        # drawn before the checkpoint then leaves the process's random state as the checkpoint restored it.
        return torch.utils.data.DataLoader(data, batch_size=micro, sampler=sampler, collate_fn=collate_fn,
                                           drop_last=True, generator=torch.Generator().manual_seed(0))

    def _default_iterator(self) -> Iterator[Any]:
        if self.training_dataloader is None:
            raise BambooConfigError("train_batch() needs data_iter=... (no training_data was given to initialize)")
        if self._data is None:
            self._data = _repeat(self.training_dataloader, skip=self.drawn)
        return self._data

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One step on the next global batch of ``data_iter`` (default: the training data's loader); on a loss, fail
        over and redo it from the micro-batches drawn for it. Returns the step's loss, as DeepSpeed does.

        A fatal loss (a node lost with its replica holder) restarts the job in the running processes from the last
        checkpoint this engine saved or loaded (``save_dir/latest``; the job's start if none): ``global_steps`` goes
        back to its step, and ``restarts`` records it. With the training data's loader the step at that position is
        then trained and its loss returned, so a ``while engine.global_steps < N`` loop goes on by itself. With a
        ``data_iter`` of the caller's, ``JobRestarted`` (a ``FatalLoss``) is raised once the job has restarted: rewind
        the iterator to its ``data_position`` micro-batches and go on.

        A node released from the layout (its pipeline dropped after a loss) stands by in its process until a
        reconfiguration admits it again, and goes on the same way from the running nodes' step (``JobRestarted``
        for a ``data_iter`` of the caller's); the job's end while it stands by ends it with ``SystemExit(0)``."""
        released = False
        try:
            return self._train_batch(data_iter)
        except FatalLoss as err:
            if isinstance(err, JobRestarted) or not self.runner.can_restart(err):
                self._failed = True
                raise
            try:
                self._restart(err)
            except Released:  # the survivors restarted without this node (it was late): it stands by
                released = True
        except Released:
            released = True
        if released:
            self._stand_by()
            what = f"this node was admitted again into the running job at step {self.host.step}"
        else:
            what = f"the job restarted from step {self.host.step} after a fatal loss"
        if data_iter is not None:
            raise JobRestarted(f"{what}; rewind data_iter to micro-batch {self.drawn} (engine.drawn) and call "
                               "train_batch again", self.host.step, self.drawn)
        return self.train_batch()

    def _stand_by(self) -> None:
        """Out of the layout (``Released``): wait in this process for an admission, then take the stage and the
        training state from the running nodes (``_join``); ``SystemExit(0)`` when the job finishes first."""
        self._join(None)

    def _restart(self, err: FatalLoss) -> None:
        """The survivors' layout and fresh stages (``PipelineRunner.restart``), then the last complete checkpoint this
        engine saved or loaded loaded into them (the job's start without one)."""
        runner = self.runner
        rank, world = runner.restart(err)
        runner.start(self._model, world, rank, fitting=True, gradient_clipping=runner.gradient_clipping)
        if self.rebalancer is not None:
            self.rebalancer.layout = None  # a new layout: no node in it is overloaded
            self.rebalancer.begin(runtime_placement(runner, self.host.global_micro_batches()), runner.layer_costs())
        agreed = runner.restart_checkpoint(self._restart_candidates)
        loaded = None
        if agreed is not None:
            loaded, _ = self.load_checkpoint(Path(agreed[1]).parent, tag=Path(agreed[1]).name)
        else:  # no checkpoint yet: the job's start (the seed's weights), as a fresh run
            self.host.step, self.drawn, self._data = 0, 0, None
        record = runner.restarted(loaded, self.host.step)
        assert record is not None
        self.restarts.append(record.as_dict())

    def _restart_candidates(self) -> list[tuple[int, str]]:
        """The complete checkpoint a restart may resume from: the one ``latest`` names in the directory of the last
        save or load (``(global steps, path)``), if any."""
        latest = self._checkpoints / "latest" if self._checkpoints is not None else None
        if latest is None or not latest.exists():
            return []
        path = latest.parent / latest.read_text().strip()
        return [(int(ckpt.read_meta(path)["bamboo"].get("global_steps", 0)), str(path))]

    def _train_batch(self, data_iter: Iterator[Any] | None) -> torch.Tensor:
        it = data_iter if data_iter is not None else self._default_iterator()
        count = self.host.global_micro_batches() or self.micro_batches
        micro = [next(it) for _ in range(count)]
        batch = _concatenate(micro)
        if self.runner.engine is not None:  # DeepSpeed's own counter (its prints), in the engine of now
            self.runner.engine.global_steps = self.host.step
        try:
            loss = self.runner.train_step(batch)
        except FatalLoss:
            raise  # train_batch restarts the job (or marks it failed)
        except Exception:
            self._failed = True
            raise  # (a node leaving after a notice ends with SystemExit(0), after its last step committed)
        # counted once the step is done: a node admitted at this step's start was told the position before it
        self.drawn += count
        engine = self.runner.engine
        finished = engine.finished if engine is not None else None
        if self.host.scheduler is not None and not (finished is not None and finished.overflow):
            self.host.scheduler.step()  # DeepSpeed steps its scheduler after each applied step
        self.host.step += 1
        return loss

    def eval_batch(self, data_iter: Iterator[Any]) -> torch.Tensor:
        micro = [next(data_iter) for _ in range(self.host.global_micro_batches() or self.micro_batches)]
        return self.runner.eval_step(_concatenate(micro))

    # ------------------------------------------------------------------ checkpoints
    def _meta(self, client_state: dict[str, Any] | None = None) -> dict[str, Any]:
        scheduler = self.host.scheduler
        return {
            "client_state": dict(client_state or {}), "data_position": self.drawn,
            "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rebalance": self.rebalancer.state_dict() if self.rebalancer is not None else None,
            "bamboo": self.runner.checkpoints.bamboo_meta(global_steps=self.host.step),
        }

    def save_checkpoint(self, save_dir: str | os.PathLike[str], tag: Any = None, client_state: dict[str, Any] | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's signature: ``save_dir/tag`` (default ``global_step<N>``) in the per-layer format (loads into any
        layout), ``save_dir/latest`` names it. A loss during the save fails over and saves again; a fatal loss
        restarts the job from the last checkpoint (see ``train_batch``) and returns False, nothing saved."""
        if exclude_frozen_parameters:
            raise BambooConfigError("exclude_frozen_parameters is not supported: every layer file holds its weights")
        tag = str(tag) if tag is not None else f"global_step{self.host.step}"
        path = Path(save_dir) / tag
        rank0 = dist.get_rank() == 0
        if rank0:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
        try:
            self.runner.resilient(lambda: self.runner.checkpoints.save(
                path, lambda: self._meta(client_state), with_optimizer=True, is_global_zero=dist.get_rank() == 0,
                barrier=lambda _name: dist.barrier(), step=self.host.step))
        except FatalLoss as err:
            if not self.runner.can_restart(err):
                self._failed = True
                raise
            self._restart(err)  # nothing of this save was committed; the job is back at the last checkpoint
            return False
        except Released:  # out of the layout: the others save without this node
            self._stand_by()
            return False
        if save_latest and dist.get_rank() == 0:
            ckpt.atomic_save(tag.encode(), Path(save_dir) / "latest")
        if save_latest:
            self._checkpoints = Path(save_dir)
        return True

    def load_checkpoint(self, load_dir: str | os.PathLike[str], tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str | None, dict[str, Any] | None]:
        """DeepSpeed's signature and return value ``(path, client_state)``; ``(None, None)`` when there is nothing
        to load. Any saved layout loads. ``client_state["data_position"]`` is the micro-batches drawn before the save
        (the training data's loader continues after them by itself)."""
        if tag is None:
            latest = Path(load_dir) / "latest"
            if not latest.exists():
                log.warning("no checkpoint to load in %s (no 'latest' file); starting from scratch", load_dir)
                return None, None
            tag = latest.read_text().strip()
        path = Path(load_dir) / str(tag)
        meta = ckpt.read_meta(path)
        self._checkpoints = Path(load_dir)
        runner = self.runner
        runner.checkpoints.resume_from(path, meta)
        runner.resolve_precision(meta["bamboo"].get("loss_scale"))
        runner.checkpoints.load_weights(strict=load_module_strict)
        if load_optimizer_states and not load_module_only:
            runner.checkpoints.load_optimizer()
        rng = runner.checkpoints.saved_rng(path, meta)
        runner.checkpoints.resumed()
        if rng is not None and not load_module_only:
            ckpt.restore_rng(rng)  # the loop draws on from where the saved run was, as the Lightning door does
        if not load_module_only:
            self.host.step = int(meta["bamboo"].get("global_steps", 0))
            self.drawn, self._data = int(meta.get("data_position", 0)), None
            if load_lr_scheduler_states and self.host.scheduler is not None and meta.get("lr_scheduler") is not None:
                self.host.scheduler.load_state_dict(meta["lr_scheduler"])
            if self.rebalancer is not None and meta.get("rebalance") is not None:
                self.rebalancer.load_state_dict(meta["rebalance"])
                self.rebalancer.begin(runtime_placement(runner, self.host.global_micro_batches()), runner.layer_costs())
        runner.resilient(lambda: runner.audit("resumed before"))
        return str(path), {**meta.get("client_state", {}), "data_position": int(meta.get("data_position", 0))}

    def finish(self, completed: bool = True) -> None:
        """End this node's part in the job (called at exit: completed unless an exception left the script)."""
        notices = self.__dict__.get("notices")
        if notices is not None:
            notices.stop()
        runner = self.__dict__.get("runner")
        if runner is None or runner.session is None:
            return
        departed = not runner.session.active  # left after a notice: the others go on
        runner.finish(completed=completed and not self._failed and not departed)
        runner.close()
        if dist.is_initialized() and not departed:
            dist.destroy_process_group()  # its communication process ends with it, not with a reset connection


@dataclass(frozen=True)
class OpenedJob:
    """What ``init_distributed`` opened under the launcher, for the engine ``initialize`` builds next: the node's
    membership ``session``; the ``admission`` of a standby that waited for one; ``start_lost`` when nodes died
    before the job's process group formed (the engine starts without them)."""

    session: Any
    admission: Any = None
    start_lost: bool = False


class Handover:
    """The one thing a DeepSpeed script's two calls, ``init_distributed`` and ``initialize``, have in common: this
    process. ``put`` keeps the job the first opened; ``take`` gives it to the engine once."""

    def __init__(self) -> None:
        self._job: OpenedJob | None = None

    def put(self, job: OpenedJob) -> None:
        self._job = job

    def take(self) -> OpenedJob | None:
        job, self._job = self._job, None
        return job


#: the job ``init_distributed`` opened in this process, until ``initialize`` builds its engine on it
OPENED = Handover()


def open_job(timeout: float, detection_timeout: float) -> None:
    """Under the Bamboo launcher: join the job's membership and form its process group on the abortable backend.

    A standby node (one released when its pipeline lost a node, or started to join) waits here until a rebalancing
    node admits it (``"bamboo": {"rebalance": ...}``), or exits 0 when the job finishes first. Admitted, it returns
    in a world of its own: the script builds its ``PipelineModule`` next, and DeepSpeed forms the module's process
    groups there, collectives of the whole world that the running nodes, who are training, take no part in. That
    world is torch's ``fake`` backend (no peer, nothing sent) at the job's start size, so the module's topology is
    the one the script was written for; ``initialize`` leaves it for the job's process group.
    """
    from lightning_bamboo.engine import comm_process, comm_zygote
    from lightning_bamboo.engine.construct import ensure_deepspeed_comm
    from lightning_bamboo.membership.node import leave_idle_priority
    from lightning_bamboo.runtime.session import joining, start_session

    comm_process.use_transport("gloo", torch.device("cpu"))
    comm_zygote.prepare()
    session = start_session(detection_timeout, timeout, comm_process.BACKEND)
    if joining():
        record = session.wait_as_standby()
        if record is None:
            raise SystemExit(0)
        leave_idle_priority()  # a local standby process waited at idle priority (Cluster.spawn_joiner)
        OPENED.put(OpenedJob(session, admission=record))
        world = _start_world(session)
        dist.init_process_group("fake", rank=world - 1, world_size=world)  # (rank 0 prints DeepSpeed's banners)
        ensure_deepspeed_comm("fake")
        return
    OPENED.put(OpenedJob(session, start_lost=bool(session.start_lost)))
    if session.start_lost:
        # Nodes died before the process group formed: the job starts without them, as the Lightning door does
        # (``PipelineRunner.start_without_lost``, in ``initialize``: the survivors' group). The script builds its
        # module meanwhile in a world of the launch's size, so its topology is the one it was written for.
        from lightning_bamboo.runtime.refusal import stop_if_refused

        stop_if_refused(session)
        dist.init_process_group("fake", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        ensure_deepspeed_comm("fake")
        return
    dist.init_process_group(comm_process.BACKEND, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    ensure_deepspeed_comm(comm_process.BACKEND)


#: the store topic where the job's first node puts the number of processes the job started with
_START_WORLD = "door-start-world"


def _start_world(session: Any) -> int:
    """The number of processes the job started with (its first node put it in the store when it started)."""
    snapshot = session.store.get_prefix(session.keys.topic(_START_WORLD))
    if not snapshot.kvs:
        raise BambooConfigError(f"{session.node} was admitted into a job that lightning_bamboo.initialize did not start "
                                "(no start size in its store); a job's nodes must all run the same door")
    return int(snapshot.kvs[0].value)


def _repeat(loader: Any, skip: int) -> Iterator[Any]:
    """The loader's micro-batches over and over (DeepSpeed's ``RepeatingLoader``), after ``skip`` of them."""
    drawn = 0
    while True:
        for item in loader:
            if drawn >= skip:
                yield item
            drawn += 1


def _concatenate(micro: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """One global batch ``(inputs, targets)`` of the step's micro-batches (kept until the step commits)."""
    for item in micro:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and all(torch.is_tensor(t) for t in item)):
            raise BambooConfigError(
                "with replicas, each micro-batch from data_iter must be (inputs, targets), two tensors (got "
                f"{type(item).__name__}); return them from the dataset or collate_fn"
            )
    return torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])


def _watch_exit(engine: ResilientPipelineEngine) -> None:
    """At interpreter exit, finish the node's part: completed unless an exception is leaving the script."""
    previous = sys.excepthook

    def hook(kind: Any, value: Any, tb: Any) -> None:
        engine._failed = True
        previous(kind, value, tb)

    sys.excepthook = hook
    atexit.register(lambda: engine.finish(completed=True))
