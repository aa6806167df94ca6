"""Lightning callbacks: asynchronous checkpoints (and, later, preemption notices and rebalancing)."""

from __future__ import annotations

from lightning_bamboo.callbacks.async_checkpoint import AsyncCheckpoint, AsyncCheckpointError

__all__ = ["AsyncCheckpoint", "AsyncCheckpointError"]
