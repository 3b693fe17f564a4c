"""Datasets that fill a batch array themselves (``BatchReader``): a raw store read by threads of the training
process, an image folder or a JPEG store by DataLoader workers a whole batch a call (``WholeBatches``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from lightning_gpuopt import _compat
from lightning_gpuopt._common import available_cpus


class DecodesInWorkers:
    """Mixin of a ``BatchReader`` whose decoding holds the GIL (an image folder, a JPEG store): read by worker
    processes."""

    read_in_workers = True

    @property
    def auto_readers(self) -> int:
        """Worker processes ``num_workers="auto"`` gives this dataset: one a CPU this process may use."""
        return available_cpus()


def _empty_uint8(shape: tuple[int, ...]) -> torch.Tensor:
    numel = int(np.prod(shape))
    if get_worker_info() is not None:
        # inside a worker: in shared memory (as default_collate allocates), so it reaches the main process
        # without another copy
        return _compat.shared_uint8(numel).view(shape)
    return torch.empty(shape, dtype=torch.uint8)


@runtime_checkable
class BatchReader(Protocol):
    """A dataset whose ``read_into`` fills a uint8 ``(len(indices), *image_shape)`` array and returns int64
    labels and int32 meta, safely from several threads at once."""

    image_shape: tuple[int, int, int]

    def read_into(self, indices: Any, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


class ReadBatch(tuple):
    """``(uint8 NHWC images, int64 labels, int32 meta)`` tensors read as one batch (``read_batch``)."""

    __slots__ = ()


def read_batch(dataset: BatchReader, indices: Sequence[int]) -> ReadBatch:
    """Read the batch ``indices`` of ``dataset`` with ``read_into`` (in a DataLoader worker: shared memory).

    Example:
        >>> images, labels, meta = read_batch(store, [3, 1, 2])  # doctest: +SKIP
    """
    images = _empty_uint8((len(indices), *tuple(dataset.image_shape)))
    labels, meta = dataset.read_into(indices, images.numpy())
    labels_t = torch.as_tensor(np.asarray(labels), dtype=torch.int64)
    return ReadBatch((images, labels_t, torch.as_tensor(np.asarray(meta), dtype=torch.int32)))


class WholeBatches(Dataset):
    """``dataset`` as DataLoader workers read it: ``__getitems__`` is ``read_batch``, all else the dataset's.

    Example:
        >>> loader = HostDataLoader(WholeBatches(folder), batch_size=256, num_workers=8,
        ...                         collate_fn=UInt8Collate())  # doctest: +SKIP
    """

    def __init__(self, dataset: BatchReader) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]  # type: ignore[index]

    def __getitems__(self, indices: Sequence[int]) -> ReadBatch:
        return read_batch(self.dataset, indices)

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # unpickling looks attributes up before __dict__ holds it
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __repr__(self) -> str:
        return f"WholeBatches({self.dataset!r})"


def reads_in_workers(dataset: Any) -> bool:
    """Whether ``dataset`` is a ``BatchReader`` read by worker processes a whole batch at a time."""
    return isinstance(dataset, BatchReader) and bool(getattr(dataset, "read_in_workers", False))


def read_by_threads(dataset: Any) -> bool:
    """Whether ``dataset`` is a ``BatchReader`` read by threads of the training process (a raw HDF5 store)."""
    return isinstance(dataset, BatchReader) and not reads_in_workers(dataset)
