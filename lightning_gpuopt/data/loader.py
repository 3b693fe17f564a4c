"""Host loaders for uint8 batches: collate, read-ahead threads, prefetching across epochs, GPU staging."""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, TypeVar

import numpy as np
import torch
from lightning.fabric.utilities import move_data_to_device
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from lightning_gpuopt import _compat
from lightning_gpuopt._checks import check_arg, check_int
from lightning_gpuopt._common import FETCH_SECONDS_ATTR, FeedInfo, warn_once
from lightning_gpuopt.data._lifetime import worker_folder
from lightning_gpuopt.data.readers import (  # noqa: F401 - BatchReader and the whole-batch reads live there
    BatchReader,
    ReadBatch,
    WholeBatches,
    _empty_uint8,
    read_batch,
    read_by_threads,
    reads_in_workers,
)
from lightning_gpuopt.data.transforms import full_image_meta

#: the splits a DataModule builds loaders for (Lightning's ``<split>_dataloader`` hooks).
SPLITS = ("train", "val", "test", "predict")
#: the splits each stage of Lightning's ``setup`` reads.
STAGE_SPLITS = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}
#: batches each DataLoader worker prepares ahead, wherever this package builds or measures a loader.
PREFETCH_FACTOR = 4
T = TypeVar("T")


def timed_batches(owner: Any, batches: Iterator[Any], limit: int | None = None) -> Iterator[Any]:
    """``batches`` (at most ``limit``), adding the seconds each ``next()`` took to ``owner.fetch_seconds``."""
    count = 0
    while limit is None or count < limit:
        start = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            return
        finally:
            seconds = getattr(owner, FETCH_SECONDS_ATTR) + time.perf_counter() - start
            setattr(owner, FETCH_SECONDS_ATTR, seconds)
        count += 1
        yield batch


class UInt8Collate:
    """Collate ``[(uint8 HWC image, label[, meta]), ...]`` into ``(uint8 NHWC, int64 labels, int32 meta)``.

    ``meta = (h, w, transposed)`` as ``lightning_gpuopt.data.layout`` defines it; an ``(image, label)``
    sample is valid as a whole. Raises ``TypeError`` naming ``source`` for samples of another form.

    Args:
        source: where samples come from, for error messages (e.g. ``"train_dataset()"``).

    Example:
        >>> collate = UInt8Collate("my_dataset")
        >>> images, labels, meta = collate([(np.zeros((4, 6, 3), np.uint8), 1)] * 2)
        >>> images.shape, meta.tolist()
        (torch.Size([2, 4, 6, 3]), [[4, 6, 0], [4, 6, 0]])
    """

    def __init__(self, source: str = "dataset") -> None:
        self.source = source

    def _fail(self, what: str) -> TypeError:
        return TypeError(
            f"{self.source} must return (image, label) or (canvas, label, meta) with image a uint8 HWC "
            f"array/tensor (H, W, C), C in (1, 3, 4); {what}. Return e.g. `(np.asarray(pil_image), int(label))`; "
            "convert float images with `(img * 255).round().clamp(0, 255).to(torch.uint8)` and CHW with "
            "`img.permute(1, 2, 0)`. Normalization happens on the GPU."
        )

    def __call__(self, batch: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if isinstance(batch, ReadBatch):  # WholeBatches read it in one read_into: nothing to stack
            return tuple(batch)  # type: ignore[return-value]
        check_arg(bool(batch), "batch", batch, f"a non-empty list of samples from {self.source}")
        first = batch[0]
        if not isinstance(first, (tuple, list)) or len(first) not in (2, 3):
            raise self._fail(f"got a sample of type {type(first).__name__}")
        img = first[0]
        if not isinstance(img, (np.ndarray, torch.Tensor)):
            raise self._fail(f"got an image of type {type(img).__name__}")
        if img.dtype not in (np.uint8, torch.uint8):
            raise self._fail(f"got dtype {img.dtype}")
        shape = tuple(img.shape)
        if len(shape) != 3 or shape[-1] not in (1, 3, 4):
            hint = " (this looks like CHW)" if len(shape) == 3 and shape[0] in (1, 3, 4) else ""
            raise self._fail(f"got shape {shape}{hint}")
        if any(len(s) != len(first) for s in batch):
            raise self._fail("samples mix 2-tuples and 3-tuples")
        n = len(batch)
        out = _empty_uint8((n, *shape))
        try:
            if isinstance(img, np.ndarray):
                np.stack([s[0] for s in batch], out=out.numpy())
            else:
                torch.stack([s[0] for s in batch], out=out)
        except (ValueError, RuntimeError, TypeError) as err:
            raise TypeError(
                f"{self.source}: images in one batch must all be uint8 of shape {shape} ({err}); resize to "
                "a fixed size on the CPU, or keep the whole image on a canvas (lightning_gpuopt.data.layout)"
            ) from err
        labels = torch.tensor([int(s[1]) for s in batch], dtype=torch.int64)
        return out, labels, self._meta(batch, out)

    def _meta(self, batch: Sequence[Any], images: torch.Tensor) -> torch.Tensor:
        n, shape = len(batch), tuple(images.shape[1:])
        if len(batch[0]) == 2:
            return full_image_meta(images)
        try:
            meta = np.stack([np.asarray(s[2]) for s in batch]).astype(np.int32, casting="same_kind")
        except (ValueError, TypeError) as err:
            raise self._fail(f"meta must be int (h, w, transposed) per sample ({err})") from err
        valid = meta.shape == (n, 3)
        if valid:
            h, w = meta[:, 0], meta[:, 1]
            valid = bool(((h >= 1) & (h <= shape[0]) & (w >= 1) & (w <= shape[1])).all())
        if not valid:
            raise self._fail(
                f"meta must be (h, w, transposed) with 1 <= h <= {shape[0]} and 1 <= w <= {shape[1]} "
                f"(the valid region of the canvas), got {meta.tolist()[:2]}..."
            )
        flags = meta[:, 2]
        if not np.isin(flags, (0, 1)).all():
            raise self._fail(f"meta's transposed flag must be 0 or 1, got {sorted(set(flags.tolist()))}")
        return torch.from_numpy(meta)


#: batches a reading thread has in flight (read or waiting to be consumed).
READS_PER_THREAD = 2
#: seconds closing an epoch waits for the reads in flight (a store's memory map goes with the last of them);
#: bounded, as the garbage collector may close an epoch inside a lock such a read waits for (h5py's)
CLOSE_WAIT_S = 2.0


class HostDataLoader(DataLoader):
    """A ``DataLoader`` that describes its feed, times its consumer (``fetch_seconds``), can read a
    ``BatchReader`` on threads, and leaves no temporary folder behind (``_lifetime.worker_folder``).

    Args:
        *args: ``DataLoader``'s arguments.
        feed_info: how this loader feeds the GPU (read by ``BottleneckAdvisor`` and ``GPUStatsMonitor``).
        read_threads: threads reading a ``BatchReader`` dataset (0: DataLoader's own loading).
        **kwargs: ``DataLoader``'s keyword arguments.

    Example:
        >>> loader = HostDataLoader(range(8), batch_size=4, feed_info=FeedInfo(backend="folder"))
        >>> [batch.tolist() for batch in loader]
        [[0, 1, 2, 3], [4, 5, 6, 7]]
        >>> loader.fetch_seconds > 0
        True
    """

    def __init__(
        self, *args: Any, feed_info: FeedInfo | None = None, read_threads: int = 0, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._remove_worker_folder: Callable[[], Any] | None = None
        self.feed_info = feed_info
        check_int(read_threads, "read_threads", low=0)
        if read_threads:
            given = f"the dataset of read_threads={read_threads}"
            must = (
                "one with image_shape and read_into(indices, images) (a BatchReader, e.g. HDF5ImageDataset)"
            )
            fix = "pass read_threads=0 and num_workers=N for DataLoader worker processes"
            ok = isinstance(self.dataset, BatchReader)
            check_arg(ok, given, type(self.dataset).__name__, must, fix, error=TypeError)
            must = f"0 with read_threads={read_threads} (batches are read on threads of this process)"
            check_arg(not self.num_workers, "num_workers", self.num_workers, must, "pass num_workers=0")
            must = f"an int (or a batch_sampler given) with read_threads={read_threads}: threads read whole batches"
            check_arg(self.batch_sampler is not None, "batch_size", None, must)
        self.read_threads = read_threads
        setattr(self, FETCH_SECONDS_ATTR, 0.0)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return timed_batches(self, self._batches())

    def _index_batches(self) -> Any:
        return self.batch_sampler  # what the reading threads read: one pass

    def _batches(self) -> Iterator[Any]:
        if self.read_threads:
            return _read_batches(self)
        if not self.num_workers or _compat.persistent_iterator(self) is not None:
            return DataLoader.__iter__(self)  # no workers, or the persistent ones already running
        iterator, self._remove_worker_folder = worker_folder(self, lambda: DataLoader.__iter__(self))
        return iterator


def read_ahead(jobs: Iterator[Callable[[], T]], threads: int) -> Iterator[T]:
    """The results of ``jobs`` in order, run by ``threads`` threads ``READS_PER_THREAD`` a thread ahead; the
    next job is taken from ``jobs`` on the consuming thread. Closing it drops the jobs not begun.

    Example:
        >>> list(read_ahead((lambda i=i: i * i for i in range(5)), threads=2))
        [0, 1, 4, 9, 16]
    """
    # one intra-op thread a reader: a reader's torch work (an image folder's resizes) stays on its own core
    pool = ThreadPoolExecutor(
        threads, thread_name_prefix="lightning_gpuopt-read", initializer=torch.set_num_threads, initargs=(1,)
    )
    pending: collections.deque[Future[T]] = collections.deque()
    try:
        pending.extend(pool.submit(job) for job in itertools.islice(jobs, threads * READS_PER_THREAD))
        while pending:
            done = pending.popleft().result()
            job = next(jobs, None)
            if job is not None:
                pending.append(pool.submit(job))
            yield done
    finally:
        in_flight = [future for future in pending if not future.cancel()]
        pool.shutdown(wait=False, cancel_futures=True)
        wait_futures(in_flight, timeout=CLOSE_WAIT_S)


def _read_batches(loader: HostDataLoader) -> Iterator[tuple[torch.Tensor, ...]]:
    """Batches of ``loader``'s ``BatchReader`` dataset, read ahead by ``loader.read_threads`` threads."""
    dataset: Any = loader.dataset
    shape = tuple(dataset.image_shape)
    pin = bool(loader.pin_memory) and torch.cuda.is_available()

    def read(batch: list[int], out: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        got_labels, got_meta = dataset.read_into(batch, out[0].numpy())
        out[1].numpy()[...] = got_labels
        out[2].numpy()[...] = got_meta
        return out

    def jobs() -> Iterator[Callable[[], tuple[torch.Tensor, ...]]]:
        for indices in loader._index_batches():
            n = len(indices)
            # allocated here (pinned memory from PyTorch's cache), filled by a reading thread
            out = (
                torch.empty((n, *shape), dtype=torch.uint8, pin_memory=pin),
                torch.empty(n, dtype=torch.int64, pin_memory=pin),
                torch.empty((n, 3), dtype=torch.int32, pin_memory=pin),
            )
            yield functools.partial(read, list(indices), out)

    return read_ahead(jobs(), loader.read_threads)


class StagedBatch(tuple):
    """A batch a ``device_transform`` already produced on the GPU (the DataModule's hook passes it through).

    Example:
        >>> batch = StagedBatch((torch.zeros(2, 3, 4, 4), torch.arange(2)))
        >>> isinstance(batch, tuple), len(batch)
        (True, 2)
    """

    __slots__ = ()


class _RepeatSampler:
    """``batch_sampler`` forever from pass ``start``, less ``skip`` batches; a pass ordered by its number."""

    def __init__(self, batch_sampler: Any, start: int = 0, skip: int = 0, seed: int | None = None) -> None:
        self.batch_sampler = batch_sampler
        self.start, self.skip, self.seed = start, skip, seed

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[Any]:
        sampler = getattr(self.batch_sampler, "sampler", None)
        set_epoch = getattr(sampler, "set_epoch", None)
        epoch, skip = self.start, self.skip
        while True:
            if callable(set_epoch):
                set_epoch(epoch)  # a DistributedSampler reshuffles per epoch from seed + epoch
            if self.seed is not None:
                sampler.generator.manual_seed(self.seed + epoch)  # type: ignore[union-attr]
            batches = iter(self.batch_sampler)
            for _ in range(skip):
                next(batches, None)
            skip = 0
            yield from batches
            epoch += 1


class ContinuousDataLoader(HostDataLoader):
    """A map-style ``DataLoader`` whose workers prefetch across epoch boundaries; each ``iter()`` is one pass
    over the sampler, and ``state_dict`` holds its position for a resumed fit (docs/datamodule.md).

    Args:
        *args: ``DataLoader``'s arguments.
        device_transform: on a CUDA run with ``pin_memory=True``, applied to each batch on the GPU one step
            ahead, on a side stream; its batches arrive as ``StagedBatch``.
        feed_info: see ``HostDataLoader``.
        read_threads: see ``HostDataLoader`` (the threads keep reading across epoch boundaries too).
        **kwargs: ``DataLoader``'s keyword arguments.

    Example:
        >>> loader = ContinuousDataLoader(range(10), batch_size=4, shuffle=True, drop_last=True)
        >>> [len(list(loader)) for _ in range(3)]  # each epoch: one pass over the sampler
        [2, 2, 2]
    """

    def __init__(
        self,
        *args: Any,
        device_transform: Callable[[Any], Any] | None = None,
        feed_info: FeedInfo | None = None,
        read_threads: int = 0,
        **kwargs: Any,
    ) -> None:
        # every argument is named here: Lightning re-creates the loader (under DDP) from this signature
        super().__init__(*args, feed_info=feed_info, read_threads=read_threads, **kwargs)
        self.device_transform = device_transform
        self._continuous_iter: Iterator[Any] | None = None
        # the position of the batches handed out: pass (None: the sampler's epoch when a source starts) and
        # batches of it; a source starts there
        self._pass: int | None = None
        self._batch = 0
        self._seed: int | None = None
        sampler = self.sampler
        if isinstance(sampler, RandomSampler):
            if sampler.generator is None:
                sampler.generator = torch.Generator()
                # drawn from torch's global generator, as RandomSampler draws each pass's seed
                self._seed = int(torch.randint(0, 2**62, ()).item())
            else:
                self._seed = int(sampler.generator.initial_seed())

    def _repeat(self, batch_sampler: Any) -> _RepeatSampler:
        return _RepeatSampler(batch_sampler, self._start_pass(), self._batch, self._seed)

    def _start_pass(self) -> int:
        if self._pass is None:
            self._pass = int(getattr(getattr(self.batch_sampler, "sampler", None), "epoch", 0))
        return self._pass

    @property
    def _index_sampler(self) -> Any:  # read by DataLoader's iterators and __len__
        return _compat.repeat_index_sampler(self, self._repeat)

    def _index_batches(self) -> Any:
        return self._repeat(self.batch_sampler)  # endless: each iter() takes one pass of it

    def state_dict(self) -> dict[str, Any]:
        """Where the batches handed out so far stand: ``pass``, ``batch``, ``batches_per_pass``, ``seed``."""
        start = self._start_pass()
        return {"pass": start, "batch": self._batch, "batches_per_pass": len(self), "seed": self._seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue at ``state_dict``'s position: the next ``iter()`` yields the rest of that pass."""
        self.close()
        per_pass = int(state_dict.get("batches_per_pass", len(self)))
        self._pass = int(state_dict.get("pass", 0))
        self._batch = int(state_dict.get("batch", 0))
        if state_dict.get("seed") is not None and self._seed is not None:
            self._seed = int(state_dict["seed"])
        if per_pass != len(self) or not 0 <= self._batch < len(self):
            warn_once(
                f"ContinuousDataLoader: the saved training loader had {per_pass} batches a pass, this one "
                f"has {len(self)} (another dataset, batch size or number of devices); training resumes at "
                f"the start of pass {self._pass} instead of batch {self._batch} of it"
            )
            self._batch = 0
        sampler = getattr(self.batch_sampler, "sampler", None)
        reproducible = self._seed is not None or isinstance(sampler, SequentialSampler)
        if self._batch and not (reproducible or callable(getattr(sampler, "set_epoch", None))):
            warn_once(
                f"ContinuousDataLoader: the training sampler ({type(sampler).__name__}) has no set_epoch "
                "and is not a RandomSampler, so the interrupted pass cannot be replayed; the rest of that "
                f"epoch ({len(self) - self._batch} batches) comes from a fresh order, and later epochs are "
                "whole passes"
            )

    def _advance(self, batches: Iterator[Any]) -> Iterator[Any]:
        n = len(self)
        for batch in batches:
            self._batch += 1
            if self._batch >= n:
                self._pass, self._batch = self._start_pass() + 1, 0
            yield batch

    def __len__(self) -> int:
        if self.batch_sampler is None:
            return super().__len__()
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        must = "an int: ContinuousDataLoader needs automatic batching"
        check_arg(self.batch_sampler is not None, "batch_size", None, must, error=TypeError)
        source = self._continuous_iter
        if source is not None and inspect.isgenerator(source) and source.gi_frame is None:
            # a reading or staging generator that an error ended: start afresh rather than yield nothing
            self.close()
            source = None
        limit = len(self)
        if source is None:
            limit -= self._batch  # a source starts at the position: this epoch is the rest of its pass
            source = self._batches()
            if self.device_transform is not None and self.pin_memory and torch.cuda.is_available():
                # under DDP Lightning has set each rank's current device before the first iter()
                source = _staged(
                    source, torch.device("cuda", torch.cuda.current_device()), self.device_transform
                )
            self._continuous_iter = source
        return self._advance(timed_batches(self, source, limit))

    def close(self) -> None:
        """Stop the workers (dropping what they prefetched); the next ``iter()`` starts the next pass."""
        source, self._continuous_iter = self._continuous_iter, None
        if self._batch:
            self._pass, self._batch = self._start_pass() + 1, 0
        close = getattr(source, "close", None)
        if callable(close):
            close()  # a staging generator: releases the DataLoader iterator it wraps
        close_workers(self)


def close_workers(loader: Any) -> None:
    """Stop the persistent workers of ``loader`` (a loader, or a list or dict of them) now, or ``close()`` a
    ``DALILoader``; the next ``iter()`` starts afresh.

    Example:
        >>> close_workers(trainer.val_dataloaders)  # doctest: +SKIP
    """
    if isinstance(loader, (list, tuple, dict)):
        for item in loader.values() if isinstance(loader, dict) else loader:
            close_workers(item)
    elif isinstance(loader, ContinuousDataLoader) and loader._continuous_iter is not None:
        loader.close()
    elif isinstance(loader, DataLoader):
        iterator = _compat.persistent_iterator(loader)
        _compat.drop_persistent_iterator(loader)
        _compat.shutdown_workers(iterator)
        remove = getattr(loader, "_remove_worker_folder", None)
        if iterator is not None and callable(remove):
            remove()  # what a worker that did not exit through Python left there
    elif callable(getattr(loader, "close", None)):
        loader.close()  # a DALILoader: its pipeline's threads and memory now; the next iter() builds it again


#: batches the staging thread keeps copied and transformed ahead of the training step.
STAGED_AHEAD = 2


_END = object()


def _staged(source: Iterator[Any], device: torch.device, transform: Callable[[Any], Any]) -> Iterator[Any]:
    """``transform(batch on device)``, made ``STAGED_AHEAD`` batches ahead on a side stream by a thread."""
    side = torch.cuda.Stream(device)
    ready: queue.Queue[Any] = queue.Queue(maxsize=STAGED_AHEAD)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def stage() -> None:
        try:
            torch.cuda.set_device(device)  # the current device is per thread
            for batch in source:
                if stop.is_set():
                    return
                with torch.cuda.stream(side):
                    out = transform(move_data_to_device(batch, device))
                    done = torch.cuda.Event()
                    done.record(side)
                del batch  # the pinned host batch goes back to PyTorch's cache once its copy has run
                if not put((StagedBatch(out) if isinstance(out, (list, tuple)) else out, done)):
                    return
            put(_END)
        except BaseException as err:  # re-raised on the training thread
            put(err)

    thread = threading.Thread(target=stage, name="lightning_gpuopt-stage", daemon=True)
    thread.start()
    try:
        while True:
            item = ready.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            batch, done = item
            current = torch.cuda.current_stream(device)
            current.wait_event(done)  # the step's stream waits for this batch's copy and transform only
            # the caching allocator must not reuse a tensor while the step's stream reads it
            apply_to_collection(batch, torch.Tensor, torch.Tensor.record_stream, current)
            yield batch
    finally:
        stop.set()
        while thread.is_alive():
            with contextlib.suppress(queue.Empty):
                ready.get(timeout=0.05)  # unblock a thread waiting to queue a batch
            thread.join(timeout=0.05)
        close = getattr(source, "close", None)
        if callable(close):
            close()
