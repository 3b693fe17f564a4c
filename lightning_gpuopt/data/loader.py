"""``ContinuousDataLoader``: DataLoader workers that keep prefetching across epoch boundaries.

A plain DataLoader stops handing out work at the end of an epoch and restarts at the next ``iter()``: the
first batch of every epoch waits for one worker to build a whole batch from scratch while the GPU idles.
On ImageNet that is one stall in thousands of steps; on a small dataset fed to a fast GPU (8,192 images
are 32 steps of 256 on an H200, 1.4 s) it costs a large share of the run. This loader iterates its batch
sampler endlessly behind one long-lived iterator and yields exactly ``len(self)`` batches per ``iter()``,
so workers are already building the next epoch's first batches while this epoch's last ones train
(the idea of timm's ``MultiEpochsDataLoader``).

It is a ``DataLoader`` subclass with DataLoader's own ``__init__``, so Lightning can still re-create it
with a ``DistributedSampler`` under DDP. Each pass over the sampler sets the sampler's epoch itself
(``set_epoch``), because the next pass starts before Lightning calls ``set_epoch`` for that epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader


class _RepeatSampler:
    """Iterate ``batch_sampler`` forever; each pass sets the underlying sampler's epoch."""

    def __init__(self, batch_sampler: Any) -> None:
        self.batch_sampler = batch_sampler

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[Any]:
        sampler = getattr(self.batch_sampler, "sampler", None)
        set_epoch = getattr(sampler, "set_epoch", None)
        epoch = int(getattr(sampler, "epoch", 0))
        while True:
            if callable(set_epoch):
                set_epoch(epoch)  # a DistributedSampler reshuffles per epoch from seed + epoch
            yield from self.batch_sampler
            epoch += 1


class ContinuousDataLoader(DataLoader):
    """A map-style ``DataLoader`` whose workers prefetch across epoch boundaries.

    Use it exactly like ``DataLoader`` (same arguments); it needs automatic batching (``batch_size`` or
    ``batch_sampler``). Every ``iter()`` yields ``len(self)`` batches, one pass over the sampler, so each
    sample is still seen once per epoch. Batches an unfinished run had prefetched are dropped at shutdown.

    Note:
        An epoch cut short (``limit_train_batches``, an exception) leaves its remaining batches in the pipe;
        the next epoch starts with them, so epochs then no longer line up with passes over the sampler.
    """

    @property
    def _index_sampler(self) -> Any:  # read by DataLoader's iterators and __len__
        sampler = super()._index_sampler
        if self._auto_collation and sampler is self.batch_sampler:
            return _RepeatSampler(sampler)
        return sampler

    def __len__(self) -> int:
        if self.batch_sampler is None:
            return super().__len__()
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if self.batch_sampler is None:
            raise TypeError("ContinuousDataLoader needs automatic batching: pass batch_size (not None)")
        if getattr(self, "_continuous_iter", None) is None:
            self._continuous_iter = super().__iter__()
        source = self._continuous_iter
        return _take(source, len(self))

    def __del__(self) -> None:
        self._continuous_iter = None


def _take(source: Iterator[Any], n: int) -> Iterator[Any]:
    for _ in range(n):
        yield next(source)
