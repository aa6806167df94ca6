"""Bamboo's redundant-computation pipeline schedule as pure data: actions, builders, validate, simulate, format."""

from __future__ import annotations

from lightning_bamboo.schedule.action import REDUNDANCY_MODES, Action, Kind, ScheduleError
from lightning_bamboo.schedule.build import build_failover, build_schedule
from lightning_bamboo.schedule.costs import Costs
from lightning_bamboo.schedule.dryrun import Simulation, simulate, validate
from lightning_bamboo.schedule.engine_steps import deepspeed_steps
from lightning_bamboo.schedule.placement import buffer_id, num_pipe_buffers, replica_stage
from lightning_bamboo.schedule.program import Schedule, format_table
from lightning_bamboo.topology.layout import replica_holder

__all__ = [
    "Action",
    "Costs",
    "Kind",
    "REDUNDANCY_MODES",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "build_failover",
    "build_schedule",
    "buffer_id",
    "deepspeed_steps",
    "format_table",
    "num_pipe_buffers",
    "replica_holder",
    "replica_stage",
    "simulate",
    "validate",
]
