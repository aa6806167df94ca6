"""RebalanceCallback: the runtime's ``Rebalancer`` (``lightning_bamboo.runtime.rebalance``) as a Lightning callback.

At every step boundary it asks the reconfiguration policy what the pipeline should be, and does
it: evens out the layers after a failover, deepens the pipeline again, admits standby nodes, adds
a data-parallel pipeline. The decision and its execution are the ``Rebalancer``'s (the DeepSpeed
door's ``"bamboo": {"rebalance": ...}`` runs the same); here are Lightning's hooks: the strategy's
runner, a ``HydrozoaTuner``'s layer splits, the decisions as metrics, the policy's view in
Lightning checkpoints.

It needs the Bamboo launcher (membership in a store); elsewhere nothing can change and it only
keeps the layout. With ``admit=True`` (the default) standby nodes are reported at every commit.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.runtime.rebalance import Rebalancer, runtime_placement
from lightning_bamboo.topology.policy import Placement


class RebalanceCallback(Rebalancer, Callback):
    """Rebalance, re-deepen or grow the pipeline at step boundaries, as the reconfiguration policy decides:
    :class:`~lightning_bamboo.runtime.rebalance.Rebalancer` (its arguments: ``stages``, ``min_stages``,
    ``max_overloaded_fraction``, ``admit``) driven by the Trainer's hooks.

    With a ``HydrozoaTuner`` among the trainer's callbacks, a new layout's layer split is the
    planner's for that depth (``HydrozoaTuner.split_for``: its profile, cost model and memory
    limit), not an even one.
    """

    def __init__(
        self, stages: int | None = None, min_stages: int = 2, max_overloaded_fraction: float = 0.05, admit: bool = True
    ) -> None:
        super().__init__(stages, min_stages, max_overloaded_fraction, admit)
        self._pl_module: Any = None
        self.on_decision = self._log_decision

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if getattr(trainer.strategy, "runner", None) is None:
            raise BambooConfigError(
                f"RebalanceCallback reconfigures a BambooStrategy; this trainer runs {type(trainer.strategy).__name__}. "
                "Use Trainer(strategy='bamboo')"
            )
        self._pl_module = pl_module
        self.attach(trainer.strategy.runner, int(getattr(trainer.strategy, "micro_batch_size", 1) or 1))
        from lightning_bamboo.callbacks.tuner import HydrozoaTuner

        tuner = next((c for c in trainer.callbacks if isinstance(c, HydrozoaTuner)), None)
        if tuner is not None:
            self.split_for = tuner.split_for

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.begin(self._runtime(trainer), trainer.strategy.runner.layer_costs())

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.detach()

    def _log_decision(self, event: dict[str, Any]) -> None:
        module = self._pl_module
        if module is None:
            return
        module.log("rebalance/seconds", event["seconds"], on_step=True, on_epoch=False, rank_zero_only=True)
        module.log("rebalance/count", float(len(self.decisions)), on_step=True, on_epoch=False, rank_zero_only=True)

    @staticmethod
    def _runtime(trainer: Any) -> Placement:
        """The pipeline the strategy runs now, as the policy's ``Placement`` (its ``layout`` is the runner's)."""
        return runtime_placement(trainer.strategy.runner, trainer.strategy.global_micro_batches)

    # ------------------------------------------------------------------ checkpoint state (the Rebalancer's)
    def state_dict(self) -> dict[str, Any]:
        return Rebalancer.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        Rebalancer.load_state_dict(self, state_dict)
