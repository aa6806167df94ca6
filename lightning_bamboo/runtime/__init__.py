"""The pipeline runtime: a node's stage, engine, replica and membership behind one door, ``PipelineRunner``."""

from __future__ import annotations

from lightning_bamboo.runtime.config import BambooConfig
from lightning_bamboo.runtime.host import PipelineModel, RunnerHost
from lightning_bamboo.runtime.leave import request_leave
from lightning_bamboo.runtime.runner import PipelineRunner
from lightning_bamboo.runtime.session import Session

__all__ = ["BambooConfig", "PipelineModel", "PipelineRunner", "RunnerHost", "Session", "request_leave"]
