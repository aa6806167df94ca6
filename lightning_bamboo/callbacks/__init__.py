"""Lightning callbacks: asynchronous checkpoints, preemption notices, rebalancing and the Hydrozoa tuner."""

from __future__ import annotations

from lightning_bamboo.callbacks.async_checkpoint import AsyncCheckpoint, AsyncCheckpointError
from lightning_bamboo.callbacks.preemption import PreemptionCallback, preemption_pending
from lightning_bamboo.callbacks.rebalance import RebalanceCallback
from lightning_bamboo.callbacks.tuner import HydrozoaTuner
from lightning_bamboo.runtime.notices import (
    AwsSpotPoller,
    AzureScheduledEventsPoller,
    GcpPreemptionPoller,
    Notice,
)

__all__ = [
    "AsyncCheckpoint",
    "AsyncCheckpointError",
    "AwsSpotPoller",
    "AzureScheduledEventsPoller",
    "GcpPreemptionPoller",
    "HydrozoaTuner",
    "Notice",
    "PreemptionCallback",
    "RebalanceCallback",
    "preemption_pending",
]
