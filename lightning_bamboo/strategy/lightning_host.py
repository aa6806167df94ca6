"""``LightningHost``: what the runner asks of Lightning, answered from the strategy and its trainer."""

from __future__ import annotations

from typing import Any

import torch


class LightningHost:
    """The :class:`~lightning_bamboo.runtime.host.RunnerHost` of ``BambooStrategy``."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    @property
    def _trainer(self) -> Any:
        return self.strategy.lightning_module.trainer

    def global_step(self) -> int:
        return int(self._trainer.global_step)

    def adopt_stage(self, module: torch.nn.Module) -> None:
        # attached to the LightningModule, so configure_optimizers() sees this stage's parameters as self.parameters()
        self.strategy.lightning_module._bamboo_stage = module

    def optimizer_for(self, module: torch.nn.Module) -> torch.optim.Optimizer:
        model = self.strategy.lightning_module
        init = self.strategy.pl_package("core.optimizer")._init_optimizers_and_lr_schedulers
        previous = model._bamboo_stage
        model._bamboo_stage = module
        try:
            optimizers, _ = init(model)
        finally:
            model._bamboo_stage = previous
        return optimizers[0]

    def setup_optimizers(self, module: torch.nn.Module) -> torch.optim.Optimizer:
        from lightning_bamboo.errors import BambooConfigError

        strategy = self.strategy
        strategy.setup_optimizers(self._trainer)
        if len(strategy.optimizers) != 1:
            raise BambooConfigError(
                f"strategy='bamboo' trains with exactly one optimizer (configure_optimizers returned "
                f"{len(strategy.optimizers)}); put parameter groups into one optimizer"
            )
        return strategy.optimizers[0]

    def rebind_optimizer(self, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
        self.strategy.optimizers = [new]
        for config in self._trainer.lr_scheduler_configs:
            if config.scheduler.optimizer is old:
                config.scheduler.optimizer = new

    def enter_group(self, rank: int, world: int) -> None:
        self.strategy.enter_group(rank, world)

    def global_micro_batches(self) -> int | None:
        return self.strategy.global_micro_batches  # known once the training data is set up

    def training_state(self) -> dict[str, Any]:
        return self.strategy.checkpoint_meta(self._trainer._checkpoint_connector.dump_checkpoint(weights_only=False))  # trusted: a save, no load
