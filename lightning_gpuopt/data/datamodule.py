"""``OptimizedDataModule``: uint8 batches to the GPU, augmentation there, tuned and pinned loaders."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from lightning_gpuopt.data.folder import UInt8ImageFolder
from lightning_gpuopt.data.loader import ContinuousDataLoader, StagedBatch
from lightning_gpuopt.data.transforms import IMAGENET_MEAN, IMAGENET_STD, GPUAugment
from lightning_gpuopt.data.tuning import (
    MEASURE_BATCH_SIZE,
    _broadcast_best,
    available_cpus,
    endless_sampler,
    tune_num_workers,
)

BACKENDS = ("auto", "folder", "hdf5", "dali")
SPLITS = ("train", "val", "test", "predict")
_HDF5_SUFFIXES = (".h5", ".hdf5")


class UInt8Collate:
    """Collate ``[(uint8 HWC image, label), ...]`` into ``(uint8 NHWC tensor, int64 labels)``.

    One ``np.stack``/``torch.stack`` straight into a preallocated tensor (in shared memory inside a
    worker, so handing it to the main process costs no extra copy). Raises ``TypeError`` naming ``source``
    (the dataset hook) when samples are not uint8 HWC.

    Args:
        source: where samples come from, for error messages (e.g. ``"train_dataset()"``).
    """

    def __init__(self, source: str = "dataset") -> None:
        self.source = source

    def _fail(self, what: str) -> TypeError:
        return TypeError(
            f"{self.source} must return (image, label) with image a uint8 HWC array/tensor (H, W, C), "
            f"C in (1, 3, 4); {what}. Return e.g. `(np.asarray(pil_image), int(label))`; convert float "
            "images with `(img * 255).round().clamp(0, 255).to(torch.uint8)` and CHW with "
            "`img.permute(1, 2, 0)`. Normalization happens on the GPU."
        )

    def __call__(self, batch: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if not batch:
            raise ValueError(f"{self.source}: empty batch")
        first = batch[0]
        if not isinstance(first, (tuple, list)) or len(first) != 2:
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
        n = len(batch)
        out = _empty_uint8((n, *shape))
        images = [s[0] for s in batch]
        try:
            if isinstance(img, np.ndarray):
                np.stack(images, out=out.numpy())
            else:
                torch.stack(images, out=out)
        except (ValueError, RuntimeError, TypeError) as err:
            raise TypeError(
                f"{self.source}: images in one batch must all be uint8 of shape {shape} ({err}); resize to "
                "a fixed size on the CPU (UInt8ImageFolder(size=...) does)"
            ) from err
        labels = torch.tensor([int(s[1]) for s in batch], dtype=torch.int64)
        return out, labels


def _empty_uint8(shape: tuple[int, ...]) -> torch.Tensor:
    numel = int(np.prod(shape))
    if get_worker_info() is not None:
        # inside a worker: allocate in shared memory (as default_collate does) so the batch reaches the
        # main process without being copied again
        new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
        if new_shared is not None:
            storage = new_shared(numel)
            return torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)
    return torch.empty(shape, dtype=torch.uint8)


def _resolve_backend(backend: str, paths: dict[str, str | None]) -> str:
    given = {k: v for k, v in paths.items() if v is not None}
    if backend != "auto":
        return backend
    kinds = {
        k: ("hdf5" if Path(v).is_file() and Path(v).suffix.lower() in _HDF5_SUFFIXES else "folder")
        for k, v in given.items()
    }
    if len(set(kinds.values())) > 1:
        raise ValueError(
            f"backend='auto' found both HDF5 files and folders ({kinds}); give all splits in one format "
            "or pass backend= explicitly"
        )
    return next(iter(kinds.values()), "folder")


class OptimizedDataModule(pl.LightningDataModule):
    """A DataModule that keeps the GPU fed: uint8 batches, augmentation on the GPU, tuned pinned loaders.

    Host side, datasets return ``(uint8 HWC image, int label)`` (a quarter of float32's bytes) and are
    batched by a fast collate into ``(uint8 NHWC, int64)``. Loaders pin memory when the Trainer runs on
    CUDA, keep workers alive between epochs, prefetch, shuffle and drop the last partial batch for
    training; Lightning injects its ``DistributedSampler`` under DDP as usual. ``num_workers="auto"`` is
    measured in ``setup`` (``tune_num_workers``, cached). Device side, ``on_after_batch_transfer`` turns
    the batch into normalized channels_last NCHW floats with a random resized crop + flip (training) or
    a center crop (evaluation), batched (``GPUAugment``).

    Use it with folders (``root/<class>/<image>``) or HDF5 files and no subclass::

        dm = OptimizedDataModule("data/train", "data/val", batch_size=256, num_workers="auto")
        trainer.fit(model, datamodule=dm)

    or subclass it and return your own map-style datasets of ``(uint8 HWC, int)``::

        class MyData(OptimizedDataModule):
            def __init__(self, root: str, **kwargs):
                super().__init__(**kwargs)
                self.root = root

            def train_dataset(self):
                return MyUInt8Dataset(self.root, split="train")  # -> (np.uint8 array HxWx3, int)

            def val_dataset(self):
                return MyUInt8Dataset(self.root, split="val")

        trainer.fit(model, datamodule=MyData("/data", batch_size=128, image_size=224))

    Args:
        train_dir: training folder or HDF5 file (None: ``train_dataset()`` must be overridden for fit).
        val_dir: validation folder or HDF5 file (None and no override: no validation).
        test_dir: test folder or HDF5 file.
        predict_dir: prediction folder or HDF5 file.
        backend: ``"auto"`` (a ``.h5``/``.hdf5`` file -> ``"hdf5"``, a folder -> ``"folder"``),
            ``"folder"`` (``UInt8ImageFolder``), ``"hdf5"`` (``HDF5ImageDataset``) or ``"dali"`` (DALI
            pipelines decode on the GPU, or on DALI's CPU threads with ``dali_kwargs={"decoder": "cpu"}``;
            ``pip install 'lightning-gpuopt[dali]'``).
        batch_size: samples per batch per device.
        num_workers: DataLoader worker processes per loader, or ``"auto"`` to measure (in ``setup``); with
            ``backend="dali"`` DALI's CPU threads per rank (``"auto"``: ``default_num_threads``).
        image_size: side of the square images the model receives.
        storage_size: side of the uint8 squares decoded on the CPU (default ``round(image_size*256/224)``).
        mean: per-channel mean in [0, 1] units.
        std: per-channel std in [0, 1] units.
        augment: random resized crop + flip for training (False: the evaluation center crop everywhere).
        pin_memory: pin host batches (None: on when the Trainer's device is CUDA).
        prefetch_factor: batches each worker prepares ahead.
        persistent_workers: keep workers alive between epochs.
        output_dtype: dtype of the batches the model receives (``torch.float32``/``float16``/``bfloat16``).
        on_corrupt: ``"raise"`` (error naming the file) or ``"skip"`` (skip unreadable images, count them and
            warn at teardown; ``skipped_images`` lists them). Applies to the built-in folder backend.
        tune_budget_s: seconds ``num_workers="auto"`` may spend measuring.
        tune_target_samples_per_sec: your model's speed (samples/s); tuning stops once the loader, measured
            alone, delivers twice that (``tune_num_workers``'s ``headroom``).
        tune_cache_dir: folder of the tuning cache (default ``$LIGHTNING_GPUOPT_CACHE_DIR`` or
            ``~/.cache/lightning_gpuopt``); results are keyed by dataset, batch size and CPU count.
        crop_scale: random-resized-crop area range.
        crop_ratio: random-resized-crop aspect-ratio range.
        flip_p: horizontal flip probability.
        continuous_epochs: the training loader's workers keep prefetching across epoch boundaries
            (``ContinuousDataLoader``), so an epoch does not start with the GPU waiting for a worker to build
            a batch from scratch. Each epoch is still one pass over the (distributed) sampler.
        prefetch_to_device: with ``continuous_epochs`` on a CUDA run, copy the next training batch to the GPU
            and augment it on a side stream while the current step computes (nothing of it is left on the
            critical path after fp16's per-step host sync).
        dali_kwargs: extra keyword arguments for the DALI loader (``backend="dali"``), e.g.
            ``{"decoder": "cpu"}`` (0.95-0.99 of the ceiling instead of nvJPEG's 0.90-0.91 on an H200 with
            16 cores, docs/dali.md) or ``{"prefetch_queue_depth": 3}``; see ``DALILoader``.
    """

    def __init__(
        self,
        train_dir: str | os.PathLike[str] | None = None,
        val_dir: str | os.PathLike[str] | None = None,
        test_dir: str | os.PathLike[str] | None = None,
        predict_dir: str | os.PathLike[str] | None = None,
        *,
        backend: str = "auto",
        batch_size: int = 256,
        num_workers: int | str = "auto",
        image_size: int = 224,
        storage_size: int | None = None,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        augment: bool = True,
        pin_memory: bool | None = None,
        prefetch_factor: int = 4,
        persistent_workers: bool = True,
        output_dtype: torch.dtype = torch.float32,
        on_corrupt: str = "raise",
        tune_budget_s: float = 30.0,
        tune_target_samples_per_sec: float | None = None,
        tune_cache_dir: str | os.PathLike[str] | None = None,
        crop_scale: tuple[float, float] = (0.25, 1.0),
        crop_ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip_p: float = 0.5,
        continuous_epochs: bool = True,
        prefetch_to_device: bool = True,
        dali_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        paths: dict[str, str | None] = {}
        for split, value in zip(SPLITS, (train_dir, val_dir, test_dir, predict_dir), strict=True):
            if value is None:
                paths[split] = None
                continue
            p = Path(value).expanduser()
            if not p.exists():
                raise FileNotFoundError(f"{split}_dir={os.fspath(value)!r} does not exist; check the path")
            paths[split] = os.fspath(p)
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if num_workers != "auto" and (
            not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 0
        ):
            raise ValueError(f"num_workers must be 'auto' or an int >= 0, got {num_workers!r}")
        if not isinstance(image_size, int) or image_size < 1:
            raise ValueError(f"image_size must be a positive int (pixels), got {image_size!r}")
        if storage_size is None:
            storage_size = round(image_size * 256 / 224)
        if not isinstance(storage_size, int) or storage_size < image_size:
            raise ValueError(
                f"storage_size ({storage_size!r}) must be an int >= image_size ({image_size}); the GPU crops "
                "image_size squares out of storage_size squares"
            )
        if not isinstance(prefetch_factor, int) or prefetch_factor < 1:
            raise ValueError(f"prefetch_factor must be an int >= 1, got {prefetch_factor!r}")
        if on_corrupt not in ("raise", "skip"):
            raise ValueError(f"on_corrupt must be 'raise' or 'skip', got {on_corrupt!r}")
        if tune_budget_s <= 0:
            raise ValueError(f"tune_budget_s must be > 0 seconds, got {tune_budget_s}")
        self.backend = _resolve_backend(backend, paths)
        if self.backend == "folder":
            for split, path in paths.items():
                if path is not None and not Path(path).is_dir():
                    raise ValueError(
                        f"{split}_dir={path!r} is a file; the folder backend needs a folder laid out as "
                        "<root>/<class>/<image> (use backend='hdf5' for HDF5 files)"
                    )
        if self.backend == "dali" and all(v is None for v in paths.values()):
            raise ValueError("backend='dali' reads image folders itself: pass train_dir/val_dir")
        self.train_dir, self.val_dir = paths["train"], paths["val"]
        self.test_dir, self.predict_dir = paths["test"], paths["predict"]
        self.batch_size = batch_size
        self.num_workers: int | str = num_workers
        self.image_size = image_size
        self.storage_size = storage_size
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self.augment = bool(augment)
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self.persistent_workers = persistent_workers
        self.output_dtype = output_dtype
        self.on_corrupt = on_corrupt
        self.tune_budget_s = float(tune_budget_s)
        self.tune_target_samples_per_sec = tune_target_samples_per_sec
        self.tune_cache_dir = tune_cache_dir
        # validates mean/std/crop arguments now, before any training starts
        self.gpu_augment = GPUAugment(
            image_size=image_size,
            mean=self.mean,
            std=self.std,
            scale=crop_scale,
            ratio=crop_ratio,
            flip_p=flip_p,
            eval_crop_fraction=image_size / storage_size,
            output_dtype=output_dtype,
        )
        self.continuous_epochs = bool(continuous_epochs)
        self.prefetch_to_device = bool(prefetch_to_device)
        self.dali_kwargs: dict[str, Any] = dict(dali_kwargs or {})
        if self.dali_kwargs:  # checked before any Trainer; dali.py imports DALI only when a loader is built
            from lightning_gpuopt.data.dali import check_dali_kwargs

            check_dali_kwargs(self.dali_kwargs)
        self.tuning_result: Any = None
        self._datasets: dict[str, Dataset | None] = {}
        self._skip_dir: str | None = None
        self._skipped_reported: list[str] = []

    # ----------------------------------------------------------------- dataset hooks (override these)
    def _default_dataset(self, split: str) -> Dataset | None:
        path = {
            "train": self.train_dir,
            "val": self.val_dir,
            "test": self.test_dir,
            "predict": self.predict_dir,
        }[split]
        if path is None:
            return None
        if self.backend == "hdf5":
            try:
                from lightning_gpuopt.data.hdf5 import HDF5ImageDataset
            except ImportError as err:
                raise ModuleNotFoundError(
                    f"backend='hdf5' needs lightning_gpuopt.data.hdf5 and h5py ({err}); "
                    "`pip install 'lightning-gpuopt[hdf5]'`"
                ) from err
            dataset = HDF5ImageDataset(path)
            stored = int(dataset.image_shape[0])
            if stored < self.image_size:
                raise ValueError(
                    f"{path!r} stores {stored}px images but image_size={self.image_size}; convert with "
                    f"`lightning-gpuopt convert SRC OUT.h5 --size {self.storage_size}` or lower image_size"
                )
            if stored != self.storage_size:
                # the GPU crops image_size out of whatever is stored; the eval crop follows the file's size
                self.storage_size = stored
                self.gpu_augment.eval_crop_fraction = self.image_size / stored
            return dataset
        skip_log = os.path.join(self._skip_dir, split) if self._skip_dir is not None else None
        return UInt8ImageFolder(path, size=self.storage_size, on_corrupt=self.on_corrupt, skip_log=skip_log)

    def train_dataset(self) -> Dataset | None:
        """The training dataset of ``(uint8 HWC, int)``; default: built from ``train_dir``."""
        return self._default_dataset("train")

    def val_dataset(self) -> Dataset | None:
        """The validation dataset; default: built from ``val_dir`` (None: no validation)."""
        return self._default_dataset("val")

    def test_dataset(self) -> Dataset | None:
        """The test dataset; default: built from ``test_dir``."""
        return self._default_dataset("test")

    def predict_dataset(self) -> Dataset | None:
        """The prediction dataset; default: built from ``predict_dir``."""
        return self._default_dataset("predict")

    # ----------------------------------------------------------------- Lightning hooks
    def setup(self, stage: str) -> None:
        """Build the datasets the stage needs (errors surface here, before training) and resolve workers."""
        if self.on_corrupt == "skip" and self._skip_dir is None:
            self._skip_dir = tempfile.mkdtemp(prefix="lightning_gpuopt_skipped_")
        splits = {
            "fit": ("train", "val"),
            "validate": ("val",),
            "test": ("test",),
            "predict": ("predict",),
        }.get(stage, SPLITS)
        if self.backend != "dali":
            for split in splits:
                if split not in self._datasets:
                    self._datasets[split] = getattr(self, f"{split}_dataset")()
            if stage == "fit":
                train = self._datasets.get("train")
                if train is None:
                    raise ValueError(
                        "OptimizedDataModule has no training data: pass train_dir= or override train_dataset()"
                    )
                if len(train) < self.batch_size:  # type: ignore[arg-type]
                    raise ValueError(
                        f"the training set has {len(train)} samples, fewer than batch_size={self.batch_size}, "  # type: ignore[arg-type]
                        "and the last partial batch is dropped; lower batch_size"
                    )
        if self.num_workers == "auto":
            self.num_workers = self._resolve_auto_workers(splits)

    def _local_world_size(self) -> int:
        return max(1, self.trainer.num_devices) if self.trainer is not None else 1

    def _resolve_auto_workers(self, splits: Sequence[str]) -> int:
        cpus = max(1, available_cpus() // self._local_world_size())
        if self.backend == "dali":
            return cpus  # DALI's CPU threads; nothing to measure with a torch DataLoader
        dataset = next((self._datasets[s] for s in splits if self._datasets.get(s) is not None), None)
        if dataset is None:
            return 0
        measure_bs = min(self.batch_size, MEASURE_BATCH_SIZE)  # see MEASURE_BATCH_SIZE: steadier figures
        result = tune_num_workers(
            lambda n: self._loader(
                dataset,
                n,
                train=False,
                persistent=False,
                sampler=endless_sampler(dataset, measure_bs),
                batch_size=measure_bs,
            ),
            budget_s=self.tune_budget_s,
            target_samples_per_sec=self.tune_target_samples_per_sec,
            max_workers=cpus,
            cache_dir=self.tune_cache_dir,
            cache_key={
                "local_world_size": self._local_world_size(),
                "pin_memory": self._pin(),
                "train_batch_size": self.batch_size,
            },
        )
        best = _broadcast_best(self.trainer, result.best)
        result.best = best
        self.tuning_result = result
        rank_zero_info(f"OptimizedDataModule: num_workers='auto' -> {best}\n{result.format_table()}")
        return best

    def _pin(self) -> bool:
        if self.pin_memory is not None:
            return bool(self.pin_memory)
        if self.trainer is not None:
            return self.trainer.strategy.root_device.type == "cuda"
        return torch.cuda.is_available()

    def _workers(self) -> int:
        if self.num_workers == "auto":
            raise RuntimeError(
                "num_workers='auto' is resolved in setup(); call setup(stage) before the loaders"
            )
        return int(self.num_workers)

    def _loader(
        self,
        dataset: Dataset,
        workers: int,
        train: bool,
        persistent: bool,
        source: str = "",
        sampler: Sampler | None = None,
        batch_size: int | None = None,
    ) -> DataLoader:
        # the training loader keeps its workers busy across epoch boundaries (see ContinuousDataLoader)
        extra: dict[str, Any] = {}
        cls: type[DataLoader] = DataLoader
        if train and self.continuous_epochs and sampler is None:
            cls = ContinuousDataLoader
            extra["device_transform"] = self._stage_train_batch if self.prefetch_to_device else None
        return cls(
            dataset,
            batch_size=batch_size or self.batch_size,
            shuffle=train,
            sampler=sampler,
            drop_last=train,
            num_workers=workers,
            pin_memory=self._pin(),
            persistent_workers=persistent and workers > 0,
            prefetch_factor=self.prefetch_factor if workers > 0 else None,
            collate_fn=UInt8Collate(source or "the dataset"),
            **extra,
        )

    def _split_loader(self, split: str) -> Any:
        if self.backend == "dali":
            from lightning_gpuopt.data.dali import build_dali_loader

            return build_dali_loader(self, split)
        if split not in self._datasets:
            self._datasets[split] = getattr(self, f"{split}_dataset")()
        dataset = self._datasets[split]
        if dataset is None:
            if split == "train":
                raise ValueError("no training data: pass train_dir= or override train_dataset()")
            return []  # Lightning skips a stage whose loader list is empty
        return self._loader(
            dataset,
            self._workers(),
            train=split == "train",
            persistent=self.persistent_workers,
            source=f"{split}_dataset()",
        )

    def train_dataloader(self) -> Any:
        return self._split_loader("train")

    def val_dataloader(self) -> Any:
        return self._split_loader("val")

    def test_dataloader(self) -> Any:
        return self._split_loader("test")

    def predict_dataloader(self) -> Any:
        return self._split_loader("predict")

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """On the device: uint8 NHWC -> normalized channels_last NCHW (+ crop/flip when training)."""
        if self.backend == "dali":
            return batch  # DALI batches arrive normalized and channels_last already
        if not isinstance(batch, (tuple, list)) or not batch:
            raise TypeError(
                f"OptimizedDataModule.on_after_batch_transfer expects (images, labels, ...), got "
                f"{type(batch).__name__}; return (uint8 HWC, label) samples from the dataset hooks"
            )
        if isinstance(batch, StagedBatch):
            return batch  # staged by the training loader: already augmented on a side stream
        training = self.trainer is not None and self.trainer.training
        images = self.gpu_augment(batch[0], train=training and self.augment)
        return (images, *batch[1:])

    def _stage_train_batch(self, batch: Any) -> Any:
        """The training transform, applied by ``ContinuousDataLoader`` ahead of time on a side stream."""
        return (self.gpu_augment(batch[0], train=self.augment), *batch[1:])

    def teardown(self, stage: str) -> None:
        """Stop the training loader's workers; report images skipped as unreadable (``on_corrupt="skip"``)."""
        loader = self.trainer.train_dataloader if self.trainer is not None and stage == "fit" else None
        if isinstance(loader, ContinuousDataLoader):
            loader.close()  # its workers run ahead into the next epoch: do not leave them running after fit
        if self._skip_dir is None:
            return
        new = self._current_skips()
        if new:
            shown = ", ".join(repr(p) for p in sorted(set(new))[:5])
            rank_zero_warn(
                f"OptimizedDataModule skipped {len(new)} unreadable image(s) during {stage} "
                f"({len(set(new))} distinct), e.g. {shown}; each was replaced by the next readable image"
            )
        self._skipped_reported.extend(new)
        shutil.rmtree(self._skip_dir, ignore_errors=True)
        self._skip_dir = None
        self._datasets = {}  # they log into the removed folder; setup() builds them afresh

    def _current_skips(self) -> list[str]:
        paths: list[str] = []
        for ds in self._datasets.values():
            skipped = getattr(ds, "skipped", None)
            if callable(skipped):
                paths.extend(skipped())
        return paths

    @property
    def skipped_images(self) -> list[str]:
        """Paths skipped as unreadable so far (``on_corrupt="skip"``), including in worker processes."""
        return self._skipped_reported + self._current_skips()

    @property
    def num_skipped(self) -> int:
        """How many images were skipped as unreadable (a path skipped in two epochs counts twice)."""
        return len(self.skipped_images)
