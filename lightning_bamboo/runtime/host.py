"""What a ``PipelineRunner`` asks of the framework around it (Lightning's strategy, or a plain loop)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch


class PipelineModel(Protocol):
    """The model the runner cuts into stages (a LightningModule of ``strategy="bamboo"`` is one)."""

    def configure_pipeline(self) -> Sequence[Any]:
        """The layers, in order: ``LayerSpec``s (built only where held), modules or callables."""

    def pipeline_loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        """The loss of the last stage's outputs."""


class RunnerHost(Protocol):
    """The few things only the framework knows; everything else the runner does itself.

    Each call happens on the training thread, between steps or inside a failover or reconfiguration.
    """

    def global_step(self) -> int:
        """The number of steps trained so far: the index of the step that runs next (one truth for it)."""

    def adopt_stage(self, module: torch.nn.Module) -> None:
        """``module`` is this process's stage now: the model's ``configure_optimizers`` must see its parameters."""

    def optimizer_for(self, module: torch.nn.Module) -> torch.optim.Optimizer:
        """A new optimizer, as the model configures it, for ``module``'s parameters (nothing else changes)."""

    def setup_optimizers(self, module: torch.nn.Module) -> torch.optim.Optimizer:
        """The framework's optimizer and schedulers for the adopted stage ``module``; returns the optimizer."""

    def rebind_optimizer(self, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
        """The stage was rebuilt: point the framework (its optimizer list, LR schedulers) at ``new``."""

    def enter_group(self, rank: int, world: int) -> None:
        """This process is ``rank`` of ``world`` in the process group just formed."""

    def training_state(self) -> dict[str, Any]:
        """The training state a joining node needs besides weights (loops, schedulers, data cursor)."""

    def global_micro_batches(self) -> int | None:
        """Micro-batches per step over all pipelines when every node loads each step's whole global batch (the
        number of pipelines may then change between steps: a reconfiguration splits them anew); None when each
        pipeline loads its own batches (the number of pipelines is fixed)."""
