"""One global sample order per epoch, cut into per-pipeline batches, resumable at a sample cursor."""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch
from torch.utils.data import DistributedSampler


class PipelineSampler(DistributedSampler):
    """Sampler of one data-parallel pipeline.

    Each epoch has one global order (a seeded permutation when shuffling). Global step ``k``
    takes the next ``batch_size x num_replicas`` samples; pipeline ``p`` gets the contiguous
    slice ``[p * batch_size, (p + 1) * batch_size)`` of them. Because a step is defined by the
    global order alone, a run can resume at any sample ``cursor`` (also with another number
    of pipelines) and see exactly the samples an uninterrupted run would have seen.

    A short last step is kept unless ``drop_last``; it is padded from the start of the order
    so every pipeline gets as many samples (as ``DistributedSampler`` pads).
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int,
        rank: int,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)  # type: ignore[arg-type]
        self.batch_size = batch_size
        self.cursor = 0  # samples of the current epoch's global order already consumed
        self._cursor_epoch = 0

    def resume_at(self, epoch: int, cursor: int) -> None:
        """Start epoch ``epoch`` at global sample ``cursor`` (later epochs start at 0)."""
        self._cursor_epoch, self.cursor = epoch, cursor

    def global_order(self) -> list[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return list(range(n))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=generator).tolist()

    def global_steps(self) -> list[list[int]]:
        """The global batches of this epoch, in order (each ``batch_size x num_replicas`` long)."""
        order = self.global_order()
        step = self.batch_size * self.num_replicas
        steps = [order[i : i + step] for i in range(0, len(order) - len(order) % step, step)]
        rest = order[len(order) - len(order) % step :]
        if rest and not self.drop_last:
            per = -(-len(rest) // self.num_replicas)
            padded = rest + (order * (per * self.num_replicas // max(1, len(order)) + 1))[: per * self.num_replicas - len(rest)]
            steps.append(padded)
        return steps

    def __iter__(self) -> Iterator[int]:
        start = self.cursor if self.epoch == self._cursor_epoch else 0
        consumed = 0
        for batch in self.global_steps():
            if consumed >= start:
                per = len(batch) // self.num_replicas
                yield from batch[self.rank * per : (self.rank + 1) * per]
            consumed += len(batch)

    def __len__(self) -> int:
        # The whole epoch, also when resuming: Lightning counts the batches already done.
        return sum(len(batch) // self.num_replicas for batch in self.global_steps())
