"""``BambooConfig``: every option of the strategy and the runner, validated in one place."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lightning_bamboo.engine.precision import resolve
from lightning_bamboo.engine.replica_location import check_placement
from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.topology.layout import DEFAULT_REDUNDANCY, REDUNDANCY_MODES, check_partition_option
from lightning_bamboo.topology.policy import rebalance_arguments

DEFAULT_TIMEOUT_SECONDS = 300.0
DEFAULT_DETECTION_SECONDS = 10.0
DEFAULT_NOTICE_INTERVAL_SECONDS = 3.0  # AWS gives two minutes of notice; a poll every 3 s is enough

#: the options a DeepSpeed config's ``"bamboo"`` section may set (``BambooConfig.from_deepspeed``); the others come
#: from the ``PipelineModule`` and the rest of the DeepSpeed config
DEEPSPEED_SECTION = ("redundancy", "timeout", "detection_timeout", "audit_replicas", "notices", "notice_interval",
                     "rebalance", "replica_placement", "replica_memory_budget", "rf_costs", "restart_on_fatal_loss")


@dataclass(frozen=True)
class BambooConfig:
    """Every option of both doors: what ``BambooStrategy(...)`` takes (see its docstring for each option) and what a
    DeepSpeed config's ``"bamboo"`` section sets (:meth:`from_deepspeed`), checked on construction.

    Frozen: a change is a new config, checked again (:meth:`replace`; the strategy's option setters,
    which ``HydrozoaTuner`` uses, go through it before the engine is built). ``stages`` is the depth
    asked for (``None``: the launcher's node count); the depth a running job has is its layout's.
    """

    stages: int | None = None
    micro_batch_size: int = 1
    partition: str | list[int] = "parameters"
    seed: int | None = None
    redundancy: str = DEFAULT_REDUNDANCY
    timeout: float = DEFAULT_TIMEOUT_SECONDS
    detection_timeout: float = DEFAULT_DETECTION_SECONDS
    deepspeed: dict[str, Any] = field(default_factory=dict)
    rf_costs: Any = "measured"
    audit_replicas: bool = False
    replica_placement: str = "auto"
    replica_memory_budget: int | None = None
    #: "32", "bf16" or "16" (``engine.precision``); the DeepSpeed config's bf16/fp16 sections give it too
    precision: str = "32"
    #: layers per activation-checkpointed segment (0: none; ``BambooPipelineModule.checkpoint_every``)
    activation_checkpointing: int = 0
    #: after a fatal loss under the launcher, the survivors restart the job from the last complete checkpoint in
    #: their processes (True); False: ``FatalLoss`` ends the node's fit, for an orchestrator that restarts jobs
    #: itself (the demo's controller)
    restart_on_fatal_loss: bool = True
    #: spot-notice sources polled while training (``["aws"]``, ``{"aws": endpoint}``: ``runtime.notices``); a notice
    #: is taken as SIGTERM is. The DeepSpeed door polls them itself; with Lightning, ``PreemptionCallback`` does
    notices: Any = ()
    notice_interval: float = DEFAULT_NOTICE_INTERVAL_SECONDS
    #: rebalance at step boundaries (``runtime.rebalance.from_config``: False, True or the ``Rebalancer``'s arguments);
    #: the DeepSpeed door runs it itself; with Lightning, ``RebalanceCallback`` does
    rebalance: Any = False

    def __post_init__(self) -> None:
        stages, micro = self.stages, self.micro_batch_size
        if stages is not None and (not isinstance(stages, int) or stages < 1):
            raise BambooConfigError(f"stages must be a positive integer or None (stages: {stages!r})")
        if not isinstance(micro, int) or micro < 1:
            raise BambooConfigError(f"micro_batch_size must be a positive integer (micro_batch_size: {micro!r})")
        check_partition_option(self.partition, stages)
        if not isinstance(self.partition, str):
            object.__setattr__(self, "partition", list(self.partition))
        if self.redundancy not in REDUNDANCY_MODES:
            raise BambooConfigError(f"redundancy must be one of {REDUNDANCY_MODES} (redundancy: {self.redundancy!r})")
        if self.redundancy in ("lazy", "eager") and stages == 1:
            raise BambooConfigError(
                f"redundancy={self.redundancy!r} needs at least 2 stages: a node holds a replica of its successor's "
                f"stage (stages: 1); use stages >= 2 or redundancy='off'"
            )
        if not self.timeout or self.timeout <= 0:
            raise BambooConfigError(f"timeout must be a positive number of seconds (timeout: {self.timeout!r})")
        object.__setattr__(self, "timeout", float(self.timeout))
        object.__setattr__(self, "rf_costs", check_rf_costs(self.rf_costs))
        if not isinstance(self.audit_replicas, bool):
            raise BambooConfigError(f"audit_replicas must be True or False (audit_replicas: {self.audit_replicas!r})")
        check_placement(self.replica_placement, self.replica_memory_budget)
        if not self.detection_timeout or self.detection_timeout <= 0:
            raise BambooConfigError(
                f"detection_timeout must be a positive number of seconds (got {self.detection_timeout!r})"
            )
        object.__setattr__(self, "detection_timeout", float(self.detection_timeout))
        object.__setattr__(self, "deepspeed", dict(self.deepspeed or {}))
        resolve(self.precision, self.deepspeed, None)  # refuses what cannot run exactly, before anything starts
        if not isinstance(self.restart_on_fatal_loss, bool):
            raise BambooConfigError(f"restart_on_fatal_loss must be True or False (restart_on_fatal_loss: "
                                    f"{self.restart_on_fatal_loss!r})")
        from lightning_bamboo.runtime.notices import pollers_from_config

        if isinstance(self.notice_interval, bool) or not isinstance(self.notice_interval, (int, float)) \
                or self.notice_interval <= 0:
            raise BambooConfigError(f"notice_interval must be a positive number of seconds between polls (notice_interval: "
                                    f"{self.notice_interval!r}); AWS gives two minutes of notice, 3 s is enough")
        pollers_from_config(self.notices, "notices")  # the sources are checked now, polled under the launcher
        object.__setattr__(self, "notices", dict(self.notices) if isinstance(self.notices, dict) else
                           ((self.notices,) if isinstance(self.notices, str) else tuple(self.notices)))
        rebalance_arguments(self.rebalance, "rebalance")
        every = self.activation_checkpointing
        if not isinstance(every, int) or isinstance(every, bool) or every < 0:
            raise BambooConfigError(f"activation_checkpointing is the layers per checkpointed segment, an integer >= 0 "
                                    f"(activation_checkpointing: {every!r}); 0 turns it off, 1 checkpoints every layer")

    @classmethod
    def from_deepspeed(cls, section: Any, **derived: Any) -> BambooConfig:
        """The config of a DeepSpeed config's ``"bamboo"`` section (its keys: ``DEEPSPEED_SECTION``, each a field of
        the same name) with ``derived`` (what the ``PipelineModule`` and the rest of the DeepSpeed config give)."""
        if section is None:
            section = {}
        if not isinstance(section, dict):
            raise BambooConfigError(f'the DeepSpeed config\'s "bamboo" entry must be a dict (got {type(section).__name__})')
        unknown = sorted(set(section) - set(DEEPSPEED_SECTION))
        if unknown:
            given = sorted(set(unknown) & {f.name for f in dataclasses.fields(cls)})
            raise BambooConfigError(
                f'unknown keys in the "bamboo" config entry: {unknown}; known keys: {sorted(DEEPSPEED_SECTION)}'
                + (f" ({given} come from the PipelineModule and the DeepSpeed config)" if given else ""))
        try:
            return cls(**{**derived, **section})
        except BambooConfigError as err:
            raise BambooConfigError(f'the DeepSpeed config\'s "bamboo" section: {err}') from None

    def replace(self, **changes: Any) -> BambooConfig:
        """This config with ``changes``, checked again as on construction (``BambooConfigError`` names the rule)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise BambooConfigError(f"BambooConfig has no option {unknown}; the options are "
                                    f"{[f.name for f in dataclasses.fields(self)]}")
        return dataclasses.replace(self, **changes)

    @property
    def redundant(self) -> bool:
        """Whether a loss is served without a restart: nodes keep replicas of their successors' stages (every one
        under lazy and eager; under auto those of stages with no data-parallel copy on another machine:
        ``topology.replicas``), and a pipeline that lost a node is dropped while whole ones train on."""
        return self.redundancy != "off"

    def redundancy_with(self, membership: bool) -> str:
        """The redundancy a node runs: the option, except ``auto`` without the Bamboo launcher's membership
        (``membership`` False: Lightning's own launcher, torchrun, one process), where no process outlives a lost
        one and a replica could save nothing: ``off`` there."""
        return "off" if self.redundancy == "auto" and not membership else self.redundancy


def check_rf_costs(rf_costs: Any) -> Any:
    """``"measured"``, or the ``lightning_bamboo.schedule.Costs`` a dict of its fields gives (checked now,
    not at the first step)."""
    from lightning_bamboo.schedule import Costs, ScheduleError

    if rf_costs == "measured" or isinstance(rf_costs, Costs):
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
