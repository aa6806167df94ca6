"""``BambooStrategy``'s collectives: Lightning's barrier, broadcast, reduce and all_gather, surviving a lost node.

Between steps they go through the membership store (a loss fails the same collective on every survivor, which
fails over and runs it again in the new layout); inside a step through the process group, under the runner's
guard. A node joining a running job (``runner.catching_up``) meets the others in none of them until its first step:
the running nodes are past the framework's start-up collectives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from lightning_bamboo.errors import BambooConfigError
from lightning_bamboo.runtime import collectives

if TYPE_CHECKING:
    from lightning.pytorch.strategies import DDPStrategy as _Lightning

    from lightning_bamboo.runtime.runner import PipelineRunner
else:
    _Lightning = object


class ResilientCollectives(_Lightning):
    """Lightning's collectives of ``BambooStrategy`` (a mixin before Lightning's ``DDPStrategy``)."""

    runner: PipelineRunner

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        runner = self.runner
        if runner.catching_up:
            return
        if runner.between_steps:
            runner.resilient(lambda: runner.gather(None, send=False))
            return
        runner.resilient(lambda: super(ResilientCollectives, self).barrier(*args, **kwargs))

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        runner = self.runner
        if runner.catching_up:
            return obj  # same program, same arguments: what rank ``src`` had at start-up
        if runner.between_steps:
            # the rank is read at each attempt: after a failover ``src`` names a rank of the new group
            return runner.resilient(lambda: runner.gather(obj, send=self.global_rank == src)[src])
        return runner.resilient(lambda: super(ResilientCollectives, self).broadcast(obj, src))

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        runner = self.runner
        if runner.catching_up:  # start-up checks (e.g. "every rank's dataloader has a length"): the local value
            return tensor
        if runner.between_steps:
            if not isinstance(tensor, torch.Tensor):
                return tensor  # as Lightning's DDP strategy: only tensors are reduced
            kind = collectives.reduce_kind(reduce_op)
            return runner.resilient(
                lambda: collectives.reduced(runner.gather(tensor.detach().cpu()), kind).to(tensor.device)
            )
        return runner.resilient(lambda: super(ResilientCollectives, self).reduce(tensor, group, reduce_op))

    @override
    def all_gather(self, tensor: Any, group: Any = None, sync_grads: bool = False) -> Any:
        runner = self.runner
        if runner.between_steps:
            if sync_grads:
                raise BambooConfigError(
                    "strategy='bamboo' gathers between steps through the membership store, without gradients "
                    "(all_gather(sync_grads=True)); gather detached values"
                )
            return runner.resilient(lambda: torch.stack(runner.gather(tensor.detach().cpu())).to(tensor.device))
        return runner.resilient(lambda: super(ResilientCollectives, self).all_gather(tensor, group, sync_grads))

