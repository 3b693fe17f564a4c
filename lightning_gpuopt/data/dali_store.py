"""Training batches of a compact JPEG store decoded by DALI (docs/dali.md): ``StoreBatches``, the pipeline's
source, and ``DALIStoreLoader``, a ``DALILoader`` over it."""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from lightning_gpuopt._checks import check_arg
from lightning_gpuopt.data.dali import DALILoader, dm_loader
from lightning_gpuopt.data.dali_pipeline import (
    PREFETCH_QUEUE_DEPTH,
    SHUFFLE_SEED,
    build_dali_pipeline,
)
from lightning_gpuopt.data.loader import StagedBatch

__all__ = ["READ_AHEAD", "DALIStoreLoader", "StoreBatches", "build_dali_store_loader"]

#: batches read ahead of the one DALI asks for, one reading thread each
READ_AHEAD = 4


class StoreBatches:
    """``fn.external_source`` callback: one rank's batches ``(uint8 JPEG arrays, int32 labels (n, 1))`` of the
    store ``path``, permuted per ``(seed, epoch)`` (docs/dali.md), from batch ``skip`` of ``first_epoch``."""

    def __init__(
        self,
        path: str,
        starts: np.ndarray,
        lengths: np.ndarray,
        labels: np.ndarray,
        *,
        batch_size: int,
        shard_id: int = 0,
        num_shards: int = 1,
        seed: int = SHUFFLE_SEED,
        first_epoch: int = 0,
        skip: int = 0,
    ) -> None:
        self.path = str(path)
        self.starts = np.asarray(starts, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.labels = np.asarray(labels, dtype=np.int32)
        self.n = int(self.starts.shape[0])
        check_arg(
            self.lengths.shape == (self.n,) and self.labels.shape == (self.n,),
            "lengths and labels",
            f"{self.lengths.shape} and {self.labels.shape}",
            f"one of each per image ({self.n})",
        )
        self.batch_size, self.shard_id, self.num_shards = int(batch_size), int(shard_id), int(num_shards)
        self.per_rank = self.n // self.num_shards
        self.batches = self.per_rank // self.batch_size
        check_arg(
            self.batches >= 1,
            "batch_size",
            batch_size,
            f"at most the {self.per_rank} images a rank of {self.path!r} has ({self.num_shards} ranks)",
            "lower batch_size",
        )
        self.seed, self.first_epoch, self.skip = int(seed), int(first_epoch), int(skip)
        self._orders: dict[int, np.ndarray] = {}
        self._pending: dict[tuple[int, int], Future[tuple[list[np.ndarray], np.ndarray]]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._fd = -1  # open while the reading threads run
        # DALI reads a batch's arrays in place (no_copy) until PREFETCH_QUEUE_DEPTH batches after it
        self._kept: deque[Any] = deque(maxlen=2 * PREFETCH_QUEUE_DEPTH + 2)

    def order(self, epoch: int) -> np.ndarray:
        """This rank's image indices of ``epoch``: ``batches * batch_size`` of them, in training order."""
        found = self._orders.get(epoch)
        if found is None:
            perm = np.random.default_rng((self.seed, int(epoch))).permutation(self.n)
            first = self.shard_id * self.per_rank
            found = perm[first : first + self.batches * self.batch_size]
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = found
        return found

    def _read(self, indices: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
        images: list[np.ndarray] = []
        for i in indices.tolist():
            length = int(self.lengths[i])
            data = os.pread(self._fd, length, int(self.starts[i]))
            if len(data) != length:
                raise RuntimeError(
                    f"JPEG store {self.path!r} ended inside image {i} (the file was truncated while open); "
                    "convert it again: lightning-gpuopt convert SRC OUT.h5 --format jpeg"
                )
            images.append(np.frombuffer(data, dtype=np.uint8))
        return images, self.labels[indices].reshape(-1, 1)

    def _submit(self, epoch: int, iteration: int) -> None:
        if (epoch, iteration) not in self._pending:
            rows = self.order(epoch)[iteration * self.batch_size : (iteration + 1) * self.batch_size]
            assert self._pool is not None
            self._pending[(epoch, iteration)] = self._pool.submit(self._read, rows)

    def __call__(self, info: Any) -> tuple[list[np.ndarray], np.ndarray]:
        first = int(info.epoch_idx) == 0
        epoch = self.first_epoch + int(info.epoch_idx)
        iteration = int(info.iteration) + (self.skip if first else 0)
        if iteration >= self.batches:
            raise StopIteration
        if self._pool is None:
            self._fd = os.open(self.path, os.O_RDONLY)
            self._pool = ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="lightning-gpuopt-store")
        e, i = epoch, iteration
        for _ in range(READ_AHEAD + 1):  # this batch and the next ones, into the next epoch at the end
            self._submit(e, i)
            e, i = (e, i + 1) if i + 1 < self.batches else (e + 1, 0)
        batch = self._pending.pop((epoch, iteration)).result()
        self._kept.append(batch)
        return batch

    def close(self) -> None:
        """Stop the reading threads and close the file (a later call opens them again)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
            os.close(self._fd)
        self._pending.clear()


class DALIStoreLoader(DALILoader):
    """``DALILoader`` over a JPEG store's training split (``store``), yielding ``StagedBatch((images, labels))``;
    ``kwargs``: ``DALILoader``'s (``train`` is always true).

    Example:
        >>> loader = DALIStoreLoader(HDF5ImageDataset("train_jpeg.h5"), batch_size=256, image_size=224,
        ...                          device="cuda")  # doctest: +SKIP
    """

    def __init__(self, store: Any, **kwargs: Any) -> None:
        starts, lengths = store.byte_ranges()
        self.store_path = str(store.path)
        self._starts, self._lengths = starts, lengths
        # one entry an image: DALILoader counts its batches and shards from its files, and samples the
        # store's own JPEGs (_byte_range) to measure the decoders on
        super().__init__([self.store_path] * len(store), store.labels, **{**kwargs, "train": True})
        self._epoch = 0  # the stream's epoch
        self._position = 0  # batches of it taken before this pipeline was built (a resumed fit)
        self._source: StoreBatches | None = None

    def _byte_range(self, i: int) -> tuple[int, int]:
        return int(self._starts[i]), int(self._lengths[i])

    def _pipeline(self) -> tuple[Any, dict[str, Any]]:
        from nvidia.dali.plugin.pytorch import LastBatchPolicy

        self._source = StoreBatches(
            self.store_path,
            self._starts,
            self._lengths,
            np.asarray(self.labels),
            batch_size=self.batch_size,
            shard_id=self.shard_id,
            num_shards=self.num_shards,
            first_epoch=self._epoch,
            skip=self._position,
        )
        pipe = build_dali_pipeline([], [], source=self._source, **self._pipeline_kwargs())
        return pipe, {"last_batch_policy": LastBatchPolicy.DROP}

    def _built(self) -> None:
        """Nothing to check: the source ends each epoch itself."""

    def _pull(self) -> list[dict[str, torch.Tensor]] | None:
        out = super()._pull()
        if out is None:  # DALI's epoch ended: the stream is in the next one, from its first batch
            self._epoch, self._position = self._epoch + 1, 0
        return out

    def _decode_error(self, err: RuntimeError) -> Exception:
        return RuntimeError(
            f"DALI could not decode a batch of the JPEG store {self.store_path!r} ({err}); read it with "
            "OptimizedDataModule(..., backend='hdf5'), which names the image, or convert it again"
        )

    def _convert(self, out: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        return StagedBatch(super()._convert(out))  # type: ignore[return-value]

    def _reached(self) -> tuple[int, int]:
        return self._epoch, self._position + self._pulled

    def close(self) -> None:
        """Release the pipeline and the reading threads; the next ``__iter__`` continues the stream."""
        if self._iterator is not None:
            self._epoch, self._position = self._reached()
            self._pulled = 0
        self._iterator = None
        if self._source is not None:
            self._source.close()
            self._source = None

    def state_dict(self) -> dict[str, Any]:
        """The stream's epoch and batch, and the batches yielded in the consumer's epoch."""
        epoch, position = self._reached()
        return {"epoch": epoch, "position": position, "yielded": self._yielded, "num_shards": self.num_shards}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict``; the pipeline is rebuilt at that batch on the next ``__iter__``."""
        self._check_shards(state_dict)
        self.close()
        self._epoch, self._position = int(state_dict.get("epoch", 0)), int(state_dict.get("position", 0))
        self._skip_on_resume = int(state_dict.get("yielded", 0))

    @property
    def _what(self) -> str:
        return f"store={self.store_path!r}, images={len(self.files)}"


def build_dali_store_loader(dm: Any, *, device: torch.device | str | None = None) -> DALIStoreLoader:
    """The training ``DALIStoreLoader`` of an ``OptimizedDataModule`` over a JPEG store, after its ``setup``."""
    return dm_loader(DALIStoreLoader, dm, dm._dataset("train"), train=True, device=device)
