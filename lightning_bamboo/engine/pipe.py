"""``BambooPipelineEngine``: DeepSpeed's pipeline engine with per-layer state and a variable micro-batch count."""

from __future__ import annotations

from typing import Any

import torch
from deepspeed.runtime.pipe.engine import PipelineEngine


class BambooPipelineEngine(PipelineEngine):
    """A ``PipelineEngine`` that lightning_bamboo builds directly (``deepspeed.initialize`` cannot).

    Redundant computation extends it with new instructions (subclasses of DeepSpeed's
    ``PipeInstruction`` plus ``_INSTRUCTION_MAP`` entries).
    """

    bamboo_options: dict[str, Any]

    def set_micro_batches(self, micro_batches: int) -> None:
        """Run the next batch as ``micro_batches`` micro-batches (the micro-batch size is fixed)."""
        if micro_batches != self.micro_batches:
            self.set_train_batch_size(self.micro_batch_size * micro_batches * self.grid.data_parallel_size)

    @property
    def layer_range(self) -> range:
        """Indices of the layers this process owns."""
        return range(self.module._local_start, self.module._local_stop)

    def named_layer_modules(self) -> dict[int, torch.nn.Module]:
        """This stage's layers that are modules, by global layer index."""
        return {int(name): layer for name, layer in self.module.named_children() if name.isdigit()}

    def save_layer_checkpoint(self, path: str, client_state: dict[str, Any] | None = None) -> None:
        """Save in lightning_bamboo's per-layer format (every process calls it).

        ``lightning_bamboo.consolidate_checkpoint(path)`` turns it into one state_dict, and a
        run with another number of stages or pipelines can load it.
        """
        import torch.distributed as dist

        from lightning_bamboo import checkpoint as ckpt

        def meta() -> dict[str, Any]:
            extra = {"global_steps": self.global_steps}
            return {**(client_state or {}), "bamboo": ckpt.bamboo_meta(
                self.module._num_layers, self.module.parts, self.grid.data_parallel_size, self.optimizer, **extra)}

        ckpt.save_sharded(
            path, self.module, self.optimizer, self.layer_range, meta,
            is_global_zero=dist.get_rank() == 0, writes_layers=self.grid.data_parallel_id == 0,
            barrier=lambda name: dist.barrier(),
        )
