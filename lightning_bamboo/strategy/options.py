"""The strategy's options: attributes that read its frozen ``BambooConfig``, changed only by a checked replacement."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_bamboo.runtime.config import BambooConfig

if TYPE_CHECKING:
    from lightning_bamboo.runtime.runner import PipelineRunner


class _Option:
    """A strategy attribute that is a field of its ``BambooConfig``: read there; a write makes a new config, checked
    again (``BambooConfig.replace``), which the runner takes (before the engine is built)."""

    def __init__(self, field: str) -> None:
        self.field = field

    def __get__(self, strategy: Any, owner: Any = None) -> Any:
        return self if strategy is None else getattr(strategy.options, self.field)

    def __set__(self, strategy: Any, value: Any) -> None:
        strategy.update_options(**{self.field: value})


class StrategyOptions:
    """``BambooStrategy``'s options (``strategy.stages``, ``strategy.micro_batch_size``, ...) over ``self.options``."""

    options: BambooConfig
    runner: PipelineRunner

    def update_options(self, **changes: Any) -> None:
        """Change options together (``stages=4, partition=[...]``), checked as on construction, before the engine is
        built (``HydrozoaTuner`` sets its plan so); a ``BambooConfigError`` names the rule and leaves them as they were."""
        self._set_options(self.options.replace(**changes))

    def _set_options(self, options: BambooConfig) -> None:
        """Take ``options`` (a checked ``BambooConfig``) here and in the runner; refused once the engine is built."""
        if options is self.options:
            return
        self.runner.configure(options)
        self.options = options

    stages = _Option("stages")
    micro_batch_size = _Option("micro_batch_size")
    partition = _Option("partition")
    seed = _Option("seed")
    redundancy = _Option("redundancy")
    audit_replicas = _Option("audit_replicas")
    rf_costs = _Option("rf_costs")
    timeout_seconds = _Option("timeout")
    detection_timeout = _Option("detection_timeout")
