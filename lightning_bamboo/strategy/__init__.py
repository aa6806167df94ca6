"""Lightning glue: ``BambooStrategy`` in each installed Lightning namespace, and its registration."""

from __future__ import annotations

import importlib.util

from lightning_bamboo.strategy.bamboo import make_strategy_class

#: ``BambooStrategy`` for ``lightning.pytorch``.
BambooStrategy = make_strategy_class("lightning.pytorch")

#: ``BambooStrategy`` for ``pytorch_lightning`` (``None`` when that package is not installed).
PTLBambooStrategy = (
    make_strategy_class("pytorch_lightning") if importlib.util.find_spec("pytorch_lightning") is not None else None
)


def register() -> None:
    """Register ``"bamboo"`` in the strategy registry of every installed Lightning namespace."""
    from lightning.pytorch.strategies import StrategyRegistry

    BambooStrategy.register_strategies(StrategyRegistry)
    if PTLBambooStrategy is not None:
        from pytorch_lightning.strategies import StrategyRegistry as PTLStrategyRegistry

        PTLBambooStrategy.register_strategies(PTLStrategyRegistry)


__all__ = ["BambooStrategy", "PTLBambooStrategy", "register"]
