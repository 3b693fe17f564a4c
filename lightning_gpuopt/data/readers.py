"""Datasets that fill a batch array themselves (``BatchReader``) and reading them a whole batch at a time.

A ``BatchReader`` (the HDF5 stores, an image folder) has ``image_shape`` and ``read_into(indices, images)``.
``HostDataLoader`` reads a raw store on threads of the training process; an image folder and a JPEG store
(``read_in_workers``) are read by DataLoader worker processes through ``WholeBatches``, whose
``__getitems__`` is ``read_batch``: one ``read_into`` a batch, into shared memory inside a worker, handed
over as a ``ReadBatch`` that ``loader.UInt8Collate`` passes through.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from lightning_gpuopt import _compat
from lightning_gpuopt._common import available_cpus

__all__ = [
    "BatchReader",
    "DecodesInWorkers",
    "ReadBatch",
    "WholeBatches",
    "read_batch",
    "read_by_threads",
    "reads_in_workers",
]


class DecodesInWorkers:
    """Mixin of a ``BatchReader`` whose decoding holds the GIL for part of each image (an image folder, a
    JPEG store): read by DataLoader worker processes a whole batch a call (``read_in_workers``;
    ``WholeBatches``), one a CPU under ``num_workers="auto"`` (``auto_readers``)."""

    #: read by DataLoader worker processes, a whole batch a call (``reads_in_workers``)
    read_in_workers = True

    @property
    def auto_readers(self) -> int:
        """Worker processes ``num_workers="auto"`` gives this dataset: one a CPU this process may use (each
        decodes; the DataModule divides the CPUs among the processes of a node)."""
        return available_cpus()


def _empty_uint8(shape: tuple[int, ...]) -> torch.Tensor:
    numel = int(np.prod(shape))
    if get_worker_info() is not None:
        # inside a worker: allocate in shared memory (as default_collate does) so the batch reaches the
        # main process without being copied again
        return _compat.shared_uint8(numel).view(shape)
    return torch.empty(shape, dtype=torch.uint8)


@runtime_checkable
class BatchReader(Protocol):
    """A dataset that fills a batch array itself (``HDF5ImageDataset``, ``UInt8ImageFolder``), so a batch is
    read in one call, by a thread of the training process or a DataLoader worker.

    ``image_shape`` is every sample's ``(H, W, C)``; ``read_into(indices, images)`` fills the C-contiguous
    uint8 ``(len(indices), H, W, C)`` array ``images`` and returns int64 labels ``(B,)`` and int32 meta
    ``(B, 3)`` (``lightning_gpuopt.data.layout``). It must be safe to call from several threads at once and
    should release the GIL while it copies. A reader whose ``read_in_workers`` is true (an image folder, a
    JPEG store: decoding holds the GIL for part of each image) is read by DataLoader worker processes, a
    whole batch a call (``WholeBatches``), rather than by threads.
    """

    image_shape: tuple[int, int, int]

    def read_into(self, indices: Any, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


class ReadBatch(tuple):
    """``(uint8 NHWC images, int64 labels, int32 meta)`` tensors a ``BatchReader`` read as one batch
    (``read_batch``); ``UInt8Collate`` passes it through unchanged."""

    __slots__ = ()


def read_batch(dataset: BatchReader, indices: Sequence[int]) -> ReadBatch:
    """Read the batch ``indices`` of ``dataset`` whole, with ``read_into`` (``WholeBatches.__getitems__``): in
    a DataLoader worker into shared memory, so there are no per-image samples to stack and no copy on the
    way to the main process.

    Example:
        >>> images, labels, meta = read_batch(store, [3, 1, 2])  # doctest: +SKIP
    """
    images = _empty_uint8((len(indices), *tuple(dataset.image_shape)))
    labels, meta = dataset.read_into(indices, images.numpy())
    return ReadBatch(
        (images, torch.as_tensor(np.asarray(labels), dtype=torch.int64),
         torch.as_tensor(np.asarray(meta), dtype=torch.int32))
    )  # fmt: skip


class WholeBatches(Dataset):
    """``dataset`` (a ``BatchReader``) as DataLoader workers read it a whole batch a call: its
    ``__getitems__`` is ``read_batch`` (one ``read_into`` into shared memory, a ``ReadBatch`` that
    ``UInt8Collate`` passes through); items, length and every other attribute are the dataset's.

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
    """Whether ``dataset`` is a ``BatchReader`` read by worker processes a whole batch at a time (its
    ``read_in_workers``) rather than by threads of the training process."""
    return isinstance(dataset, BatchReader) and bool(getattr(dataset, "read_in_workers", False))


def read_by_threads(dataset: Any) -> bool:
    """Whether ``dataset`` is a ``BatchReader`` read by threads of the training process (a raw HDF5 store):
    its loader has no DataLoader worker processes."""
    return isinstance(dataset, BatchReader) and not reads_in_workers(dataset)
