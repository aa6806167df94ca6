"""lightning_bamboo: pipeline-parallel training on preemptible machines (Bamboo + Hydrozoa)."""

from lightning_bamboo.checkpoint import consolidate_checkpoint
from lightning_bamboo.deepspeed_api import initialize
from lightning_bamboo.errors import BambooConfigError, BambooError
from lightning_bamboo.strategy import BambooStrategy, PTLBambooStrategy, register

register()

__all__ = [
    "BambooConfigError",
    "BambooError",
    "BambooStrategy",
    "PTLBambooStrategy",
    "consolidate_checkpoint",
    "initialize",
]
