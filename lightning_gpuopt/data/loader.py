"""``ContinuousDataLoader``: DataLoader workers that keep prefetching across epoch boundaries.

A plain DataLoader stops handing out work at the end of an epoch and restarts at the next ``iter()``: the
first batch of every epoch waits for one worker to build a whole batch from scratch while the GPU idles.
On ImageNet that is one stall in thousands of steps; on a small dataset fed to a fast GPU (8,192 images
are 32 steps of 256 on an H200, 1.4 s) it costs a large share of the run. This loader iterates its batch
sampler endlessly behind one long-lived iterator and yields exactly ``len(self)`` batches per ``iter()``,
so workers are already building the next epoch's first batches while this epoch's last ones train
(the idea of timm's ``MultiEpochsDataLoader``).

It is a ``DataLoader`` subclass that takes DataLoader's arguments (Lightning re-creates it from them with a
``DistributedSampler`` under DDP). Each pass over the sampler sets the sampler's epoch itself
(``set_epoch``), because the next pass starts before Lightning calls ``set_epoch`` for that epoch.

With ``device_transform`` on a CUDA run, it also stages the next batch on the GPU ahead of time: the
pinned host batch is copied on a side CUDA stream and transformed there (GPU crop/flip/normalize) while
the current step computes, so neither the copy nor the augmentation waits behind the step (apex's
``data_prefetcher`` idea). fp16 training syncs the host every step (GradScaler's inf check); whatever
the host must still do after that sync leaves the GPU idle, so doing it one step early matters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader


class StagedBatch(tuple):
    """A batch a ``device_transform`` already produced on the GPU (the DataModule's hook passes it through).

    The type is the marker: Lightning's collection helpers rebuild a tuple subclass with its own type, so
    the mark survives ``batch_to_device`` and a precision plugin's ``convert_input`` (``"16-true"``), which
    replace the tensors themselves.
    """

    __slots__ = ()


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

    def __init__(
        self, *args: Any, device_transform: Callable[[Any], Any] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.device_transform = device_transform
        self._continuous_iter: Iterator[Any] | None = None

    @property
    def _index_sampler(self) -> Any:  # read by DataLoader's iterators and __len__
        sampler = super()._index_sampler
        if self._auto_collation and sampler is self.batch_sampler:
            return _RepeatSampler(sampler)
        return sampler

    def __len__(self) -> int:
        if self.batch_sampler is None:
            return super().__len__()
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if self.batch_sampler is None:
            raise TypeError("ContinuousDataLoader needs automatic batching: pass batch_size (not None)")
        source = self._continuous_iter
        if source is None:
            source = super().__iter__()
            if self.device_transform is not None and self.pin_memory and torch.cuda.is_available():
                # under DDP Lightning has set each rank's current device before the first iter()
                source = _staged(
                    source, torch.device("cuda", torch.cuda.current_device()), self.device_transform
                )
            self._continuous_iter = source
        return _take(source, len(self))

    def close(self) -> None:
        """Stop the workers (and drop the batches they prefetched); the next ``iter()`` starts afresh."""
        source, self._continuous_iter = self._continuous_iter, None
        close = getattr(source, "close", None)
        if callable(close):
            close()  # a staging generator: releases the DataLoader iterator it wraps
        # DataLoader keeps its persistent iterator too; dropping the last reference shuts the workers down
        self._iterator = None  # type: ignore[assignment]

    def __del__(self) -> None:
        self._continuous_iter = None


def _take(source: Iterator[Any], n: int) -> Iterator[Any]:
    for _ in range(n):
        yield next(source)


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(b, device) for b in batch)
    return batch


def _record(batch: Any, stream: torch.cuda.Stream) -> None:
    if isinstance(batch, torch.Tensor) and batch.is_cuda:
        batch.record_stream(stream)  # the caching allocator must not reuse it while `stream` reads it
    elif isinstance(batch, (list, tuple)):
        for b in batch:
            _record(b, stream)


def _staged(source: Iterator[Any], device: torch.device, transform: Callable[[Any], Any]) -> Iterator[Any]:
    """Yield ``transform(batch on device)`` one batch ahead, copied and transformed on a side stream."""
    side = torch.cuda.Stream(device)

    def stage(batch: Any) -> Any:
        with torch.cuda.stream(side):
            out = transform(_to_device(batch, device))
        return StagedBatch(out) if isinstance(out, (list, tuple)) else out

    ready = stage(next(source))
    while True:
        current = torch.cuda.current_stream(device)
        current.wait_stream(side)  # the step's stream waits for this batch's copy and transform only
        _record(ready, current)
        batch = ready
        try:
            ready = stage(next(source))  # the next batch's copy runs while this one trains
        except StopIteration:
            yield batch
            return
        yield batch
