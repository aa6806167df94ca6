"""lightning_bamboo: pipeline-parallel training on preemptible machines (Bamboo + Hydrozoa).

``import lightning_bamboo`` registers ``strategy="bamboo"`` in Lightning (both namespaces) and is
cheap: torch, Lightning and DeepSpeed are imported only when something here needs them.
"""

from __future__ import annotations

from typing import Any

from lightning_bamboo import _registration, logs
from lightning_bamboo.errors import BambooConfigError, BambooError, FatalLoss, JobRestarted

_registration.install()
logs.install()

#: the one source of the version: pyproject.toml reads it (``dynamic = ["version"]``)
__version__ = "0.1.0"

_LAZY = {
    "BambooStrategy": "lightning_bamboo.strategy",
    "PTLBambooStrategy": "lightning_bamboo.strategy",
    "consolidate_checkpoint": "lightning_bamboo.checkpoint",
    "initialize": "lightning_bamboo.deepspeed_api",
    "init_distributed": "lightning_bamboo.deepspeed_api",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_bamboo' has no attribute {name!r}")


__all__ = [
    "__version__",
    "BambooConfigError",
    "BambooError",
    "BambooStrategy",
    "FatalLoss",
    "JobRestarted",
    "PTLBambooStrategy",
    "consolidate_checkpoint",
    "init_distributed",
    "initialize",
]
