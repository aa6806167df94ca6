"""HydrozoaTuner: profile on rank 0 before fit, plan every world size, apply the plan to BambooStrategy."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
from torch import nn

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.planner.costmodel import Hardware, ModelProfile
from lightning_bamboo.planner.memory import fixed_bytes
from lightning_bamboo.planner.plan import Plan, PlanTable, plan_table
from lightning_bamboo.topology.layout import machine_of

log = logging.getLogger(__name__)
_lightning_log = logging.getLogger("lightning.pytorch.callbacks.hydrozoa_tuner")

_STRATEGY_OPTIONS = ("stages", "micro_batch_size", "partition", "update_options")


def _holds_replica(strategy: Any) -> bool:
    """Whether each worker also holds its successor's stage in the memory the plan fills: under ``redundancy`` lazy,
    eager or auto (which may keep it: counted, an upper bound), unless the replica is placed in host memory while the
    stages run on a GPU."""
    options = getattr(strategy, "options", None)
    if options is None or getattr(options, "redundancy", "off") == "off":
        return False
    device = getattr(strategy, "root_device", torch.device("cpu"))
    return not (device.type == "cuda" and getattr(options, "replica_placement", "auto") == "host")


def apply_plan(strategy: Any, plan: Plan) -> None:
    """Set the layout options of a BambooStrategy (before ``strategy.setup()`` builds the engine)."""
    missing = [name for name in _STRATEGY_OPTIONS if not hasattr(strategy, name)]
    if missing:
        raise BambooConfigError(
            f"HydrozoaTuner drives a strategy with the options {list(_STRATEGY_OPTIONS)}, but "
            f"{type(strategy).__name__} lacks {missing}; use Trainer(strategy='bamboo') or "
            f"lightning_bamboo.BambooStrategy(...)"
        )
    world_size = getattr(strategy, "world_size", plan.world_size)
    if plan.stages * plan.pipelines != world_size:
        raise BambooConfigError(
            f"the plan's layout {plan.pipelines} pipeline(s) x {plan.stages} stage(s) = "
            f"{plan.stages * plan.pipelines} workers does not match the world size {world_size}; "
            f"look up the plan for {world_size} workers (HydrozoaTuner.plan_for({world_size}))"
        )
    # checked together: a partition fits its stage count
    strategy.update_options(stages=plan.stages, micro_batch_size=plan.micro_batch_size, partition=list(plan.partition))


def describe(plan: Plan) -> str:
    """The one line the tuner logs for the plan it applies (tests parse it: keep the fields)."""
    return (
        f"HydrozoaTuner: {plan.layout}, micro-batch {plan.micro_batch_size} x {plan.micro_batches}, "
        f"batch {plan.batch_per_pipeline} per pipeline ({plan.global_batch} per step), "
        f"partition {list(plan.partition)}, predicted {plan.predicted_step_seconds:.4f} s/step "
        f"({plan.samples_per_second:.1f} samples/s)"
    )


def _build_layers(pl_module: Any, seed: int) -> list[nn.Module]:
    """The module's pipeline layers, built as the strategy builds them (LayerSpecs too), RNG untouched."""
    if not hasattr(pl_module, "configure_pipeline"):
        raise BambooConfigError(
            f"HydrozoaTuner profiles configure_pipeline(), which {type(pl_module).__name__} does not define; "
            f"add `def configure_pipeline(self)` returning the layers in order"
        )
    from lightning_bamboo.engine.module import build_layers

    return list(build_layers(pl_module.configure_pipeline, seed).layers)


def _strategy_seed(strategy: Any) -> int:
    """The seed BambooStrategy builds the layers under (its ``seed``, else the ``seed_everything`` seed, else 0)."""
    runner = getattr(strategy, "runner", None)
    if runner is not None:
        return int(runner.seed)
    seed = getattr(strategy, "seed", None)
    return int(seed) if seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))


def _default_memory_bytes(device: torch.device, local_workers: int) -> int:
    """90% of the device's memory (a GPU's, or this host's RAM shared by its local workers, less what each worker
    holds besides its layers: ``planner.memory.fixed_bytes``)."""
    if device.type == "cuda":
        return int(0.9 * torch.cuda.get_device_properties(device).total_memory)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, int(0.9 * total / max(1, local_workers)) - fixed_bytes())


class HydrozoaTuner(Callback):
    """Choose depth, data-parallel degree, micro-batch size and layer split before fit; re-plan by lookup.

    On ``setup`` (after the process group exists, before the strategy builds its engine) global
    rank 0 profiles ``configure_pipeline()`` on a deep copy, plans every world size from 1 to
    ``max_world_size`` and broadcasts the table; every rank applies the plan for the current
    world size to the strategy (``stages``, ``micro_batch_size``, ``partition``) and, when the
    module or datamodule exposes ``batch_arg_name``, sets the per-pipeline batch.

    The global batch is fixed by default (``global_batch``, else the current per-pipeline batch
    times the current number of pipelines). With ``scale_batch=True`` (Hydrozoa) the
    per-pipeline batch stays and the step's batch grows with the pipelines.
    After a node joins or leaves, the reconfiguration asks :meth:`plan_for` for the new size.
    """

    sets_bamboo_layout = True  # BambooStrategy's pre-launch check leaves stages and partition to us

    def __init__(
        self,
        sample_input: torch.Tensor | None = None,
        global_batch: int | None = None,
        scale_batch: bool = False,
        micro_batch_sizes: Sequence[int] = (1, 2, 4, 8),
        max_world_size: int | None = None,
        memory_bytes: int | None = None,
        bandwidth_bytes_per_second: float | None = 1.0e9,
        latency_seconds: float = 5.0e-5,
        micro_batch_overhead_seconds: float = 0.0,
        step_overhead_seconds: float = 0.0,
        batch_arg_name: str = "batch_size",
        repeats: int = 3,
        warmup: int = 1,
        threads: int | None = None,
    ) -> None:
        if global_batch is not None and global_batch < 1:
            raise BambooConfigError(f"global_batch must be >= 1 or None (global_batch: {global_batch})")
        if max_world_size is not None and max_world_size < 1:
            raise BambooConfigError(f"max_world_size must be >= 1 or None (max_world_size: {max_world_size})")
        self.sample_input = sample_input
        self.global_batch = global_batch
        self.scale_batch = scale_batch
        self.micro_batch_sizes = tuple(micro_batch_sizes)
        self.max_world_size = max_world_size
        self.memory_bytes = memory_bytes
        self.bandwidth_bytes_per_second = bandwidth_bytes_per_second  # None: measure ranks 0 <-> 1 in setup
        self.latency_seconds = latency_seconds
        self.micro_batch_overhead_seconds = micro_batch_overhead_seconds
        self.step_overhead_seconds = step_overhead_seconds
        self.link: tuple[float, float] | None = None  # (bytes/s, s) used by the last plan
        self.batch_arg_name = batch_arg_name
        self.repeats = repeats
        self.warmup = warmup
        self.threads = threads  # torch threads while profiling; None: what this worker already uses
        self.table: PlanTable | None = None
        self.plan: Plan | None = None
        self.profile: ModelProfile | None = None  # what the table was planned from (for split_for)
        self.replica = False  # whether the plans count each worker's replica of its successor (``_holds_replica``)
        self.checkpoint_every = 0  # the strategy's activation checkpointing, which the plans count
        self.hardware: Hardware | None = None

    # ------------------------------------------------------------------ planning (rank 0)
    def _batch_target(self, pl_module: Any, pipelines_now: int) -> int:
        """The batch the planner keeps: global (fixed mode) or per pipeline (scale mode)."""
        per_pipeline = None
        if lightning_hasattr(pl_module, self.batch_arg_name):
            per_pipeline = int(lightning_getattr(pl_module, self.batch_arg_name))  # type: ignore[arg-type]
        if self.scale_batch:
            if self.global_batch is not None:
                return self.global_batch  # read as the batch of one pipeline
            if per_pipeline is None:
                raise BambooConfigError(
                    f"HydrozoaTuner(scale_batch=True) keeps the batch per pipeline, but neither global_batch nor "
                    f"`{self.batch_arg_name}` on the module/datamodule gives it; pass global_batch=N"
                )
            return per_pipeline
        if self.global_batch is not None:
            return self.global_batch
        if per_pipeline is None:
            raise BambooConfigError(
                f"HydrozoaTuner keeps the global batch fixed but cannot find it: pass global_batch=N or expose "
                f"`{self.batch_arg_name}` (the DataLoader's batch size per pipeline) on the module or datamodule"
            )
        return per_pipeline * pipelines_now

    def _sample(self, pl_module: Any) -> torch.Tensor:
        sample = self.sample_input if self.sample_input is not None else getattr(pl_module, "example_input_array", None)
        if not isinstance(sample, torch.Tensor):
            raise BambooConfigError(
                "HydrozoaTuner needs one input batch for the first layer to profile the model: pass "
                "HydrozoaTuner(sample_input=tensor) or set `self.example_input_array` in the LightningModule"
            )
        return sample

    def build_table(self, trainer: Any, pl_module: Any) -> PlanTable:
        """Profile and plan (call on one process only: timings differ between processes)."""
        from lightning_bamboo.planner.profile import profile_layers

        strategy = trainer.strategy
        world_size = int(getattr(strategy, "world_size", 1))
        stages_now = getattr(strategy, "stages", None) or world_size
        pipelines_now = max(1, world_size // stages_now)
        batch = self._batch_target(pl_module, pipelines_now)
        device = getattr(strategy, "root_device", torch.device("cpu"))
        layers = _build_layers(pl_module, _strategy_seed(strategy))
        profile = profile_layers(
            layers, self._sample(pl_module), self.micro_batch_sizes, device=device,
            repeats=self.repeats, warmup=self.warmup, threads=self.threads,
        )
        local = int(getattr(trainer, "num_devices", 1) or 1)
        bandwidth, latency = self.link or (self.bandwidth_bytes_per_second or 1.0e9, self.latency_seconds)
        hw = Hardware(
            memory_bytes=self.memory_bytes or _default_memory_bytes(torch.device(device), local),
            bandwidth_bytes_per_second=bandwidth,
            latency_seconds=latency,
            micro_batch_overhead_seconds=self.micro_batch_overhead_seconds,
            step_overhead_seconds=self.step_overhead_seconds,
        )
        self.profile, self.hardware = profile, hw
        self.replica = _holds_replica(strategy)
        options = getattr(strategy, "options", None)
        redundancy = getattr(options, "redundancy", "off") if options is not None else "off"
        runner = getattr(strategy, "runner", None)
        if redundancy == "auto" and getattr(runner, "session", None) is None:
            redundancy = "off"  # no Bamboo launcher: no process outlives a lost one (``BambooConfig.redundancy_with``)
        # "auto" keeps lazy's replicas of a layout of one pipeline, and of several where every copy of a stage runs on
        # one machine: the job's machines say which (``topology.layout.machine_of``)
        machines = ({machine_of(node) for node in [*runner.nodes, *runner.standby]}
                    if redundancy == "auto" and runner is not None else set())
        self.checkpoint_every = int(getattr(options, "activation_checkpointing", 0) or 0) if options is not None else 0
        return plan_table(profile, hw, max(self.max_world_size or 0, world_size), batch, scale_batch=self.scale_batch,
                          replica=self.replica, redundancy=redundancy, activation_checkpointing=self.checkpoint_every,
                          copies_apart=len(machines) != 1)

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        world_size = int(getattr(strategy, "world_size", 1))
        if self.bandwidth_bytes_per_second is None and world_size >= 2:
            from lightning_bamboo.planner.network import measure_link

            # a collective: every rank takes part, before rank 0 goes off to profile alone
            self.link = measure_link(device=getattr(strategy, "root_device", "cpu"))
        message: dict[str, Any] = {}
        failure: Exception | None = None
        if getattr(strategy, "global_rank", 0) == 0:
            table = self.table
            try:
                if table is None or table.max_world_size < world_size:
                    table = self.build_table(trainer, pl_module)
                message = {"table": table.to_dict(), **self._model_state()}
            except Exception as err:  # every rank must fail, not wait for a table that never comes
                failure = err
                message = {"error": f"{type(err).__name__}: {err}"}
        message = strategy.broadcast(message, src=0)
        if failure is not None:
            raise failure
        if "error" in message:
            raise BambooConfigError(f"HydrozoaTuner (planned on rank 0): {message['error']}")
        table_dict = message["table"]
        self.table = PlanTable.from_dict(table_dict)
        self._load_model_state(message)
        self.plan = self.plan_for(int(getattr(strategy, "world_size", 1)))
        self.apply(trainer, pl_module, self.plan)

    def plan_for(self, world_size: int) -> Plan:
        """The plan for ``world_size`` workers: a lookup (raises NoFeasiblePlanError, with why, if none)."""
        if self.table is None:
            raise BambooConfigError(
                "HydrozoaTuner has no plan table yet: it is built in setup() before fit, or restored by "
                "load_state_dict(); run trainer.fit first"
            )
        return self.table.lookup(world_size)

    def split_for(self, stages: int, micro_batch_size: int, micro_batches: int, pipelines: int = 1) -> tuple[int, ...] | None:
        """The planner's layer split for a layout chosen by the reconfiguration after the world size
        changed (``RebalanceCallback`` asks: one pipeline of ``stages`` nodes, the running
        micro-batch size and count). ``None`` without a profile, or when no split fits the memory limit."""
        from lightning_bamboo.planner.solver import NoSplit, SegmentTables, solve_split

        if self.profile is None or self.hardware is None or micro_batch_size not in self.profile.micro_batch_sizes:
            return None
        tables = SegmentTables(self.profile, self.hardware, micro_batch_size, self.checkpoint_every)
        result = solve_split(self.profile, self.hardware, stages, micro_batch_size, micro_batches, pipelines,
                             tables=tables, replica=self.replica)
        if isinstance(result, NoSplit):
            log.warning("HydrozoaTuner: no split of %d stages fits (%s); the reconfiguration keeps its own", stages, result.reason)
            return None
        return tuple(result.partition)

    def _model_state(self) -> dict[str, Any]:
        if self.profile is None or self.hardware is None:
            return {}
        return {"profile": self.profile.to_dict(), "hardware": dataclasses.asdict(self.hardware)}

    def _load_model_state(self, state: dict[str, Any]) -> None:
        if state.get("profile") is not None and state.get("hardware") is not None:
            self.profile = ModelProfile.from_dict(state["profile"])
            self.hardware = Hardware(**state["hardware"])

    def apply(self, trainer: Any, pl_module: Any, plan: Plan) -> None:
        """Apply ``plan`` to the strategy and, where the batch size is exposed, to the data."""
        apply_plan(trainer.strategy, plan)
        if self.scale_batch:  # a resume in another layout scales the global batch with the pipelines
            trainer.strategy.keep_global_batch = False
        if lightning_hasattr(pl_module, self.batch_arg_name):
            lightning_setattr(pl_module, self.batch_arg_name, plan.batch_per_pipeline)
        else:
            log.warning(
                "HydrozoaTuner: the plan expects DataLoader batches of %d samples per pipeline; expose `%s` on the "
                "module or datamodule to have it set",
                plan.batch_per_pipeline,
                self.batch_arg_name,
            )
        if getattr(trainer, "global_rank", 0) == 0:
            # through Lightning's own logger, so it shows on the console like Lightning's setup messages
            _lightning_log.info(describe(plan))

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {
            "table": self.table.to_dict() if self.table is not None else None,
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "scale_batch": self.scale_batch,
            **self._model_state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("scale_batch", self.scale_batch) != self.scale_batch:
            log.warning("HydrozoaTuner: the checkpoint was planned with scale_batch=%s; re-planning on next setup",
                        state_dict.get("scale_batch"))
            return
        table = state_dict.get("table")
        self.table = PlanTable.from_dict(table) if table is not None else None
        plan = state_dict.get("plan")
        self.plan = Plan.from_dict(plan) if plan is not None else None
        self._load_model_state(state_dict)
