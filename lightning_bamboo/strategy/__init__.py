"""Lightning glue: ``BambooStrategy`` for each installed Lightning namespace."""

from __future__ import annotations

import functools
import importlib.util

from lightning_bamboo import logs
from lightning_bamboo.strategy.bamboo import make_strategy_class

logs.filter_unactionable_warnings()


@functools.cache
def strategy_class(namespace: str) -> type:
    """The ``BambooStrategy`` class of ``namespace`` (``lightning.pytorch`` or ``pytorch_lightning``)."""
    return make_strategy_class(namespace)


def __getattr__(name: str) -> type | None:
    if name == "BambooStrategy":
        return strategy_class("lightning.pytorch")
    if name == "PTLBambooStrategy":
        return strategy_class("pytorch_lightning") if importlib.util.find_spec("pytorch_lightning") else None
    raise AttributeError(name)


__all__ = ["BambooStrategy", "PTLBambooStrategy", "strategy_class"]
