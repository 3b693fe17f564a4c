"""How many DataLoader worker processes and reading threads each split of an ``OptimizedDataModule`` gets,
and how each count was chosen (``SplitCounts``, a mixin of the DataModule).

``num_workers`` is DataLoader worker processes wherever it appears. ``"auto"`` measures them for a dataset
of the user's (``tune_num_workers``, cached); an image folder or a JPEG store gets one a CPU (each worker
decodes whole batches), a small split one a batch, both chosen, not measured (``unmeasured_workers``). A raw
HDF5 store has no worker processes: threads of the training process read it (``HDF5Options``). Each count
is kept with how it was chosen, for the setup line (``_feed.feed_line``).
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import Dataset

from lightning_gpuopt._checks import check_arg
from lightning_gpuopt._common import available_cpus
from lightning_gpuopt.data.loader import BatchReader, read_by_threads
from lightning_gpuopt.data.tuning import (
    _node_best,
    auto_tuning_arguments,
    dataset_fingerprint,
    tune_num_workers,
    unmeasured_workers,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_gpuopt.data.hdf5 import HDF5Options
    from lightning_gpuopt.data.tuning import TuningConfig

#: ``num_workers`` above this many per available CPU is refused: the extra processes only compete for cores
#: and memory (and each holds a copy of the dataset's Python state).
MAX_WORKERS_PER_CPU = 4
#: ``num_workers="auto"`` measures a split only when it holds at least this many batches; a smaller split
#: (a quick ``trainer.validate``, a toy dataset) gets one worker per batch up to the CPUs, none for one batch.
MIN_TUNE_BATCHES = 8


class SplitCounts:
    """The counts of each split's loader, resolved once per split, with how each was chosen (``_how``)."""

    trainer: pl.Trainer | None
    batch_size: int
    num_workers: int | str
    pin_memory: bool | None
    tuning: TuningConfig
    tuning_result: Any
    hdf5: HDF5Options | None
    _auto_workers: bool
    _datasets: dict[str, Dataset | None]
    _split_workers: dict[str, int]
    _split_threads: dict[str, int]
    _how: dict[str, dict[str, str]]
    _measured: dict[str, tuple[int, str]]

    def _dataset(self, split: str) -> Dataset | None:
        raise NotImplementedError

    def _check_worker_count(self, splits: list[str]) -> None:
        """Refuse a ``num_workers`` above 0 where none of ``splits`` has DataLoader worker processes (each is
        a raw store, read by threads): the count would mean nothing."""
        if self._auto_workers or not splits or int(self.num_workers) == 0:
            return
        if all(read_by_threads(self._datasets[split]) for split in splits):
            n = int(self.num_workers)
            check_arg(
                False,
                "num_workers",
                n,
                "'auto' or 0 for a raw HDF5 store: it is read by threads of the training process, with no "
                "DataLoader worker processes",
                f"pass hdf5=HDF5Options(threads={n}) for {n} reading threads",
            )

    def _local_world_size(self) -> int:
        return max(1, self.trainer.num_devices) if self.trainer is not None else 1

    def _workers(self, split: str) -> int:
        """DataLoader worker processes of ``split``'s loader (none for a dataset read by threads), resolved
        once per split and dataset; how they were chosen is kept for the setup line (``_say_feed``)."""
        if split in self._split_workers:
            return self._split_workers[split]
        dataset = self._dataset(split)
        if dataset is None:
            return 0
        if read_by_threads(dataset):
            return self._resolved(split, 0, "a raw store has none: threads of the training process read it")
        if not self._auto_workers:
            return self._resolved(split, int(self.num_workers), "set by you")
        return self._resolved(split, *self._auto_workers_for(split, dataset))

    def _auto_workers_for(self, split: str, dataset: Dataset) -> tuple[int, str]:
        """``(count, how)`` ``num_workers="auto"`` gives ``split``: ``unmeasured_workers`` where it decides,
        an evaluation split the training split's count (at most a worker a batch), else measured."""
        trained = self._split_workers.get("train")
        if split == "train" or trained is None or isinstance(dataset, BatchReader):
            fixed = unmeasured_workers(
                dataset,
                batch_size=self.batch_size,
                min_batches=MIN_TUNE_BATCHES,
                local_world_size=self._local_world_size(),
            )
            return fixed if fixed is not None else self._measure(dataset, split)
        try:
            batches = math.ceil(len(dataset) / self.batch_size)  # type: ignore[arg-type]
        except TypeError:
            batches = MIN_TUNE_BATCHES
        return min(trained, batches if batches > 1 else 0), "the training split's count, not measured again"

    def _resolved(self, split: str, workers: int, how: str) -> int:
        """Keep ``split``'s worker processes and how they were chosen; the training split's is what
        ``num_workers`` then reads."""
        self._split_workers[split] = workers
        self._how.setdefault(split, {})["num_workers"] = how
        if split == "train":
            self.num_workers = workers
        return workers

    def _read_threads(self, split: str) -> int:
        """Threads of the training process reading ``split``'s raw store (``HDF5Options``), resolved once."""
        if split not in self._split_threads:
            from lightning_gpuopt.data.hdf5 import HDF5Options

            cpus = max(1, available_cpus() // self._local_world_size())
            threads, how = (self.hdf5 or HDF5Options()).resolved_threads(cpus=cpus)
            self._split_threads[split] = threads
            self._how.setdefault(split, {})["threads"] = how
        return self._split_threads[split]

    def _measure(self, dataset: Dataset, split: str) -> tuple[int, str]:
        """Measure ``dataset``'s count with ``tune_num_workers`` (``auto_tuning_arguments``: the arguments
        ``lightning-gpuopt tune`` measures with too), a progress line as each count starts."""
        key = json.dumps(dataset_fingerprint(dataset), sort_keys=True, default=str)
        if key in self._measured:  # the same data under another split or stage
            return self._measured[key]

        def progress(line: str) -> None:
            rank_zero_info(f"OptimizedDataModule: num_workers='auto' for {split}: {line}")

        result = tune_num_workers(
            **auto_tuning_arguments(
                dataset,
                batch_size=self.batch_size,
                pin_memory=self._pin(),
                local_world_size=self._local_world_size(),
                tuning=self.tuning,
                source=f"{split}_dataset()",
                progress=progress,
            )
        )
        result.best = _node_best(self.trainer, result.best)
        self.tuning_result = result
        rank_zero_info(f"OptimizedDataModule: num_workers='auto' -> {result.best}\n{result.format_table()}")
        self._measured[key] = (result.best, result.how())
        return self._measured[key]

    def _pin(self) -> bool:
        """Pin host batches: as ``pin_memory`` says, else where the Trainer's device is CUDA."""
        if self.pin_memory is not None:
            return self.pin_memory
        if self.trainer is not None:
            return self.trainer.strategy.root_device.type == "cuda"
        return torch.cuda.is_available()
