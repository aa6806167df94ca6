"""One global sample order per epoch, cut into global steps, resumable at a sample cursor."""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch
from torch.utils.data import Sampler


class StepSampler(Sampler[list[int]]):
    """Batch sampler of a pipeline-parallel job: yields each global step's sample indices.

    Each epoch has one global order (a seeded permutation when shuffling). Global step ``k``
    takes the next ``global_batch`` samples of it, and every node loads the whole step: which
    micro-batches a pipeline trains on is decided per step by the strategy, from the layout
    of that step. So the number of data-parallel pipelines can change between two steps
    (a pipeline dropped after a loss, one added when nodes join) with the global batch and
    the sample order unchanged, and a run can resume at any sample ``cursor`` (also in
    another layout) and see exactly the samples an uninterrupted run would have seen.

    A short last step is kept unless ``drop_last``; it is padded from the start of the order
    to a multiple of ``multiple`` samples (as ``DistributedSampler`` pads per replica).
    """

    def __init__(
        self,
        dataset: Sized,
        global_batch: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        multiple: int = 1,
    ) -> None:
        if global_batch < 1 or multiple < 1:
            raise ValueError(f"global_batch and multiple must be >= 1 (got {global_batch}, {multiple})")
        self.dataset, self.global_batch, self.shuffle, self.seed = dataset, global_batch, shuffle, seed
        self.drop_last, self.multiple = drop_last, multiple
        self.epoch = 0
        self.cursor = 0  # samples of the current epoch's global order already consumed
        self._cursor_epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def sampler(self) -> StepSampler:
        """Itself: Lightning sets the epoch of ``dataloader.batch_sampler.sampler``."""
        return self

    def resume_at(self, epoch: int, cursor: int) -> None:
        """Start epoch ``epoch`` at global sample ``cursor`` (later epochs start at 0)."""
        self._cursor_epoch, self.cursor = epoch, cursor

    def global_order(self) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=generator).tolist()

    def global_steps(self) -> list[list[int]]:
        """The global batches of this epoch, in order (each ``global_batch`` long but maybe the last)."""
        order = self.global_order()
        step = self.global_batch
        steps = [order[i : i + step] for i in range(0, len(order) - len(order) % step, step)]
        rest = order[len(order) - len(order) % step :]
        if rest and not self.drop_last:
            size = -(-len(rest) // self.multiple) * self.multiple
            padded = rest + (order * (size // max(1, len(order)) + 1))[: size - len(rest)]
            steps.append(padded)
        return steps

    def __iter__(self) -> Iterator[list[int]]:
        start = self.cursor if self.epoch == self._cursor_epoch else 0
        consumed = 0
        for batch in self.global_steps():
            if consumed >= start:
                yield batch
            consumed += len(batch)

    def __len__(self) -> int:
        # The whole epoch, also when resuming: Lightning counts the batches already done.
        return len(self.global_steps())
