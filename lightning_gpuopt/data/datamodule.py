"""``OptimizedDataModule``: whole uint8 images to the GPU, crops and normalization there, tuned pinned loaders."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import Dataset
from typing_extensions import override

from lightning_gpuopt._checks import check_arg, check_bool, check_choice, check_int, is_int
from lightning_gpuopt._common import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    available_cpus,
    eval_resize_size,
    upsamples,
    warn_at_user,
    warn_once,
)
from lightning_gpuopt.data import backends
from lightning_gpuopt.data._lifetime import Janitor
from lightning_gpuopt.data.backends import BACKENDS, Backend, DALIBackend, FolderBackend
from lightning_gpuopt.data.choose import choose_backend, feed_line, overridden_batch_hooks
from lightning_gpuopt.data.folder import (
    ON_CORRUPT,
    UInt8ImageFolder,
    UnreadableImagesError,
    check_image_folder,
    class_indices,
)
from lightning_gpuopt.data.loader import (
    SPLITS,
    STAGE_SPLITS,
    BatchReader,
    StagedBatch,
    UInt8Collate,
    close_workers,
    read_by_threads,
)
from lightning_gpuopt.data.transforms import AugmentConfig, GPUAugment, check_mean_std
from lightning_gpuopt.data.tuning import TuningConfig, TuningResult, _measure_workers, unmeasured_workers

if TYPE_CHECKING:
    from lightning_gpuopt.data.dali import DALIOptions
    from lightning_gpuopt.data.decode import DecodeOptions
    from lightning_gpuopt.data.hdf5 import HDF5Options

__all__ = ["BACKENDS", "MAX_WORKERS_PER_CPU", "MIN_TUNE_BATCHES", "OptimizedDataModule", "UInt8Collate"]

#: ``num_workers`` above this many per available CPU is refused: the extra processes only compete for cores.
MAX_WORKERS_PER_CPU = 4
#: ``num_workers="auto"`` measures a split of at least this many batches; a smaller one gets a worker a batch.
MIN_TUNE_BATCHES = 8
#: the splits labelled with the training split's class indices; a prediction folder keeps its own labels.
LABELLED_SPLITS = ("val", "test")


class OptimizedDataModule(pl.LightningDataModule):
    """A DataModule that keeps the GPU fed: whole uint8 images, crops on the GPU, tuned pinned loaders.

    Each argument in full: docs/datamodule.md.

    Args:
        train_dir: training folder (``root/<class>/<image>``) or HDF5 file (None: override ``train_dataset``).
        val_dir: validation folder or HDF5 file, labelled by the training split's class indices.
        test_dir: test folder or HDF5 file, labelled as ``val_dir`` is.
        predict_dir: prediction folder or HDF5 file.
        backend: ``"auto"``, ``"folder"``, ``"hdf5"`` or ``"dali"`` (``choose_backend``).
        batch_size: samples per batch per device.
        num_workers: worker processes per loader (at most ``MAX_WORKERS_PER_CPU`` per CPU), or ``"auto"``.
        image_size: side of the square images the model receives.
        storage_size: shorter side the folder backend decodes to (default ``eval_resize_size(image_size)``).
        mean: per-channel mean in [0, 1] units.
        std: per-channel std in [0, 1] units.
        augment: the training crop and flip (``AugmentConfig``; True: torchvision's, False: none).
        pin_memory: pin host batches (None: when the Trainer's device is CUDA).
        on_corrupt: ``"raise"`` (an error naming the file) or ``"skip"`` (listed in ``skipped_images``).
        check_images: decode every image of the stage's folder splits in ``setup``, listing the unreadable.
        tuning: how ``num_workers="auto"`` measures (``TuningConfig``; None: its defaults).
        dali: DALI options for ``backend="dali"`` (``DALIOptions``).
        decode: JPEGs decoded in the training process without DALI (``DecodeOptions``).
        hdf5: how a raw HDF5 store is read (``HDF5Options``).

    Example:
        >>> dm = OptimizedDataModule("data/train", "data/val", batch_size=256, num_workers="auto")  # doctest: +SKIP
        >>> trainer.fit(model, datamodule=dm)  # doctest: +SKIP
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
        augment: AugmentConfig | bool = True,
        pin_memory: bool | None = None,
        on_corrupt: str = "raise",
        check_images: bool = False,
        tuning: TuningConfig | None = None,
        dali: DALIOptions | None = None,
        decode: DecodeOptions | None = None,
        hdf5: HDF5Options | None = None,
    ) -> None:
        super().__init__()
        check_choice(backend, "backend", BACKENDS)
        paths = _check_paths(dict(zip(SPLITS, (train_dir, val_dir, test_dir, predict_dir), strict=True)))
        storage_size = _check_sizes(batch_size, num_workers, image_size, storage_size)
        self.mean, self.std = check_mean_std(mean, std)
        tuning = TuningConfig() if tuning is None else tuning
        _check_kinds(augment, pin_memory, on_corrupt, check_images, tuning)
        own = any(
            getattr(type(self), f"{s}_dataset") is not getattr(OptimizedDataModule, f"{s}_dataset")
            for s in SPLITS
        )
        self._backend, self.backend_reason = choose_backend(
            backend, paths, on_corrupt=on_corrupt, own_datasets=own, decode=decode, num_workers=num_workers
        )
        _check_backend_args(self._backend, paths, on_corrupt, num_workers, dali, hdf5, own)
        if self.backend_reason is not None and self._backend.name != "hdf5" and any(paths.values()):
            rank_zero_info(f"OptimizedDataModule: backend='auto' -> {self.backend!r} ({self.backend_reason})")
        self.dali: DALIOptions | None = dali
        self.decode: DecodeOptions | None = decode
        self.hdf5: HDF5Options | None = hdf5
        self.train_dir, self.val_dir = paths["train"], paths["val"]
        self.test_dir, self.predict_dir = paths["test"], paths["predict"]
        self.batch_size = batch_size
        self.num_workers: int | str = num_workers
        self.image_size = image_size
        self.storage_size = storage_size
        self.augment = AugmentConfig() if augment is True else (augment or None)
        self.pin_memory = pin_memory
        self.on_corrupt = on_corrupt
        self.check_images = check_images
        self.tuning = tuning
        self.tuning_result: TuningResult | None = None
        self.gpu_augment = GPUAugment(image_size, self.augment, self.mean, self.std)
        self._stage_seed = 0  # drawn for each training loader (train_dataloader)
        self._stage_generator: torch.Generator | None = None
        self._auto_workers = num_workers == "auto"
        self._checked: set[str] = set()  # folders check_images found readable
        # per split: {"num_workers" or "threads": (count, how it was chosen, for the setup line)}
        self._counts: dict[str, dict[str, tuple[int, str]]] = {}
        self._said: set[str] = set()  # setup lines already given
        self._datasets: dict[str, Dataset | None] = {}
        self._skip_dir: str | None = None
        self._skip_janitor: Janitor | None = None
        self._skipped_reported: list[str] = []
        self._handed_out: weakref.WeakSet[Any] = weakref.WeakSet()  # loaders of the split hooks, for teardown

    def __getstate__(self) -> dict[str, Any]:
        # a copy holds no process handle (the original removes the folder) and tracks its own loaders
        return {**self.__dict__, "_skip_janitor": None, "_handed_out": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _handed_out=weakref.WeakSet())

    @property
    def backend(self) -> str:
        """The backend reading the data: ``"folder"``, ``"hdf5"``, ``"dali"`` or ``"hdf5+folder"``."""
        return self._backend.name

    # ----------------------------------------------------------------- dataset hooks (override these)
    def _default_dataset(self, split: str) -> Dataset | None:
        path = getattr(self, f"{split}_dir")
        if path is None:
            return None
        skip_log = os.path.join(self._skip_dir, split) if self._skip_dir is not None else None
        return self._backend.dataset(
            path, storage_size=self.storage_size, on_corrupt=self.on_corrupt, skip_log=skip_log
        )

    def train_dataset(self) -> Dataset | None:
        """The training dataset; default: built from ``train_dir``."""
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

    def _dataset(self, split: str) -> Dataset | None:
        if split not in self._datasets:
            dataset = getattr(self, f"{split}_dataset")()
            if dataset is not None:
                self._check_storage(split, dataset)
                self._align_classes(split, dataset)
            self._datasets[split] = dataset
        return self._datasets[split]

    def _training_classes(self) -> tuple[list[str], Any] | None:
        """The training split's class names and where they are read (None: unknown)."""
        train = self._datasets.get("train")
        if train is not None:
            classes = getattr(train, "classes", None)
            where = getattr(train, "root", None) or getattr(train, "path", None) or self.train_dir
            return (list(classes), where) if classes is not None else None
        if self.train_dir is not None and type(self).train_dataset is OptimizedDataModule.train_dataset:
            classes = self._backend.classes(self.train_dir)
            return (classes, self.train_dir) if classes is not None else None
        return None

    def class_indices(self, split: str, classes: Sequence[str], path: Any = None) -> list[int] | None:
        """The labels of ``split``'s ``classes`` (its names in label order): their indices among the training
        split's classes; None where the split keeps its own labels. ``path`` is where it is read.

        Raises:
            ValueError: naming the split, ``path`` and the classes training lacks.
        """
        train = self._training_classes() if split in LABELLED_SPLITS else None
        if train is None:
            return None
        path = path if path is not None else getattr(self, f"{split}_dir", None)
        return class_indices(train[0], classes, split=split, path=path, train_path=train[1])

    def _align_classes(self, split: str, dataset: Any) -> None:
        """Label ``dataset`` (one with ``classes`` and ``relabel``) by the training split's classes."""
        classes, relabel = getattr(dataset, "classes", None), getattr(dataset, "relabel", None)
        if classes is None or not callable(relabel):
            return  # a user dataset labels its own samples
        indices = self.class_indices(
            split, classes, getattr(dataset, "root", None) or getattr(dataset, "path", None)
        )
        if indices is not None:
            relabel(self._training_classes()[0], indices)  # type: ignore[index]

    def _check_storage(self, split: str, dataset: Any) -> None:
        """Refuse a store that upsamples every crop; warn where its size is not what ``image_size`` needs."""
        stored = getattr(dataset, "storage_size", None)
        if stored is None or isinstance(dataset, UInt8ImageFolder):
            return  # a user dataset's images are what they are; the folder decodes at storage_size
        resize = eval_resize_size(self.image_size)
        fix = f"convert the source with `lightning-gpuopt convert SRC OUT.h5 --size {resize}`"
        must = f">= image_size ({self.image_size}), or every crop is upsampled"
        ok = not upsamples(stored, self.image_size)
        check_arg(ok, f"{split} data's storage size", stored, must, f"{fix} or lower image_size")
        if stored != resize:
            warn_once(
                f"OptimizedDataModule: the {split} data is stored with its shorter side at {stored} px, not at "
                f"eval_resize_size({self.image_size}) = {resize}. Crops are the same boxes of the whole image "
                f"(evaluation: Resize({resize}) + CenterCrop({self.image_size})), resampled from {stored} px "
                f"bilinearly instead of being exact pixel copies; {fix} for torchvision's exact pixels."
            )

    # ----------------------------------------------------------------- worker and thread counts
    def _local_world_size(self) -> int:
        return max(1, self.trainer.num_devices) if self.trainer is not None else 1

    def _workers(self, split: str) -> int:
        counts = self._counts.setdefault(split, {})
        if "num_workers" not in counts:
            dataset = self._dataset(split)
            if dataset is None:
                return 0
            if self._auto_workers or read_by_threads(dataset):  # a raw store has none: threads read it
                counts["num_workers"] = self._auto_workers_for(split, dataset)
            else:
                counts["num_workers"] = (int(self.num_workers), "set by you")
            if split == "train":
                self.num_workers = counts["num_workers"][0]
        return counts["num_workers"][0]

    def _auto_workers_for(self, split: str, dataset: Dataset) -> tuple[int, str]:
        """``(count, how)`` of ``num_workers="auto"``: unmeasured, the training split's, or measured."""
        trained = self._counts.get("train", {}).get("num_workers")
        if split == "train" or trained is None or isinstance(dataset, BatchReader):
            local = self._local_world_size()
            fixed = unmeasured_workers(
                dataset, batch_size=self.batch_size, min_batches=MIN_TUNE_BATCHES, local_world_size=local
            )
            return fixed if fixed is not None else self._measure(dataset, split)
        try:
            batches = math.ceil(len(dataset) / self.batch_size)  # type: ignore[arg-type]
        except TypeError:
            batches = MIN_TUNE_BATCHES
        count = min(trained[0], batches if batches > 1 else 0)
        return count, "the training split's count, not measured again"

    def _read_threads(self, split: str) -> int:
        """Threads of the training process reading ``split``'s raw store (``HDF5Options``), resolved once."""
        counts = self._counts.setdefault(split, {})
        if "threads" not in counts:
            from lightning_gpuopt.data.hdf5 import HDF5Options

            cpus = max(1, available_cpus() // self._local_world_size())
            counts["threads"] = (self.hdf5 or HDF5Options()).resolved_threads(cpus=cpus)
        return counts["threads"][0]

    def _measure(self, dataset: Dataset, split: str) -> tuple[int, str]:
        batches = math.ceil(len(dataset) / self.batch_size)  # type: ignore[arg-type]
        pin, tuning, say = self._pin(), self.tuning, f"OptimizedDataModule: num_workers='auto' for {split}: "
        self.tuning_result = result = _measure_workers(
            dataset,
            self.batch_size,
            trainer=self.trainer,
            loader_kwargs={"pin_memory": pin, "collate_fn": UInt8Collate(f"{split}_dataset()")},
            budget_s=tuning.budget_s,
            target_samples_per_sec=tuning.target_samples_per_sec,
            max_workers=max(1, min(available_cpus() // self._local_world_size(), batches)),
            cache_dir=tuning.cache_dir,
            cache_key={"pin_memory": pin},
            progress=lambda line: rank_zero_info(say + line),
        )
        rank_zero_info(f"OptimizedDataModule: num_workers='auto' -> {result.best}\n{result.format_table()}")
        return result.best, result.how()

    def _pin(self) -> bool:
        """Pin host batches: as ``pin_memory`` says, else where the Trainer's device is CUDA."""
        if self.pin_memory is not None:
            return self.pin_memory
        if self.trainer is not None:
            return self.trainer.strategy.root_device.type == "cuda"
        return torch.cuda.is_available()

    # ----------------------------------------------------------------- Lightning hooks
    @override
    def setup(self, stage: str) -> None:
        """Build the stage's datasets (errors surface here, before training) and resolve their workers."""
        if self.check_images:
            self._check_images(stage)
        self._backend.setup(self, stage)

    def _check_images(self, stage: str) -> None:
        """``check_images``: decode every image of the stage's folder splits once, listing the unreadable."""
        threads = max(1, 2 * available_cpus() // self._local_world_size())
        skip = self.on_corrupt == "skip"
        fix = "each is replaced by the next readable image (on_corrupt='skip')" if skip else ""
        for split in STAGE_SPLITS.get(stage, SPLITS):
            path = getattr(self, f"{split}_dir")
            if path is None or path in self._checked or not os.path.isdir(path):
                continue
            try:
                check_image_folder(path, threads=threads, fix=fix)
            except UnreadableImagesError as err:
                if not skip:
                    raise
                warn_once(f"OptimizedDataModule(check_images=True): {err}")
            self._checked.add(path)

    def _setup_datasets(self, stage: str) -> None:
        try:
            if self.on_corrupt == "skip" and self._skip_dir is None:
                self._make_skip_dir()
            splits = STAGE_SPLITS.get(stage, SPLITS)
            for split in splits:
                self._dataset(split)
            if stage == "fit":
                train = self._datasets.get("train")
                check_arg(train is not None, *backends._NO_TRAIN, backends._NO_TRAIN_FIX)
                n = len(train)  # type: ignore[arg-type]
                must = f"at most the {n} training samples (the last partial batch is dropped)"
                check_arg(n >= self.batch_size, "batch_size", self.batch_size, must, "lower batch_size")
            built = [split for split in splits if self._datasets.get(split) is not None]
            n = 0 if self._auto_workers else int(self.num_workers)
            must = "'auto' or 0 for a raw HDF5 store: it is read by threads of the training process, with no "
            must += "DataLoader worker processes"
            ok = not (n and built and all(read_by_threads(self._datasets[split]) for split in built))
            fix = f"pass hdf5=HDF5Options(threads={n}) for {n} reading threads"
            check_arg(ok, "num_workers", n, must, fix)
            for split in built:
                self._workers(split)
        except BaseException:
            self._remove_skip_dir()
            raise

    def _split_loader(self, split: str) -> Any:
        loader = self._backend.loader(self, split)
        with contextlib.suppress(TypeError):  # a split without data gives []: nothing to close
            self._handed_out.add(loader)
        self._say_feed(split, loader)
        return loader

    def _device_transform(self) -> Any:
        """The training loader's staging transform; ``None`` where batch hooks of the user's see each batch."""
        return None if overridden_batch_hooks(self, OptimizedDataModule) else self._stage_train_batch

    def _say_feed(self, split: str, loader: Any) -> None:
        hooks = overridden_batch_hooks(self, OptimizedDataModule) if split == "train" else []
        how = {kind: chosen[1] for kind, chosen in self._counts.get(split, {}).items()}
        line = feed_line(split, loader, how, hooks=hooks, dali=self.dali, processes=self._local_world_size())
        if line is not None and line not in self._said:
            self._said.add(line)
            rank_zero_info(line)

    @override
    def train_dataloader(self) -> Any:
        self._stage_seed = int(torch.randint(0, 2**62, ()).item())  # the staged crops' seed (CPU generator)
        if self._stage_generator is not None and self.gpu_augment.generator is self._stage_generator:
            self.gpu_augment.generator = self._stage_generator = None  # a fresh one from the new seed
        return self._split_loader("train")

    @override
    def val_dataloader(self) -> Any:
        return self._split_loader("val")

    @override
    def test_dataloader(self) -> Any:
        return self._split_loader("test")

    @override
    def predict_dataloader(self) -> Any:
        return self._split_loader("predict")

    @override
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """On the device: ``(uint8 canvases, labels, meta)`` -> ``(normalized channels_last NCHW, labels)``."""
        made = self._backend.device_batches or (
            self._backend.train_on_device and self.trainer is not None and self.trainer.training
        )
        if made or isinstance(batch, StagedBatch):
            return batch
        name = "OptimizedDataModule.on_after_batch_transfer's batch"
        ok = isinstance(batch, (tuple, list)) and len(batch) in (2, 3)
        fix = "return (uint8 HWC, label) samples from the dataset hooks"
        check_arg(ok, name, type(batch).__name__, "(images, labels[, meta])", fix, error=TypeError)
        training = self.trainer is not None and self.trainer.training and self.augment is not None
        meta = batch[2] if len(batch) == 3 else None
        return (self.gpu_augment(batch[0], meta, train=training), batch[1])

    def _stage_train_batch(self, batch: Any) -> Any:
        """The training transform, applied by ``ContinuousDataLoader`` ahead of time on a side stream."""
        images, labels, meta = batch
        if self.augment is not None and images.is_cuda:
            # the staging thread draws its crops from a generator of its own, so its draws and the training
            # thread's never interleave and a seeded run repeats
            gen = self.gpu_augment.generator
            if gen is None or gen.device != images.device:
                gen = torch.Generator(images.device)
                gen.manual_seed(self._stage_seed)
                self.gpu_augment.generator = self._stage_generator = gen
        return (self.gpu_augment(images, meta, train=self.augment is not None), labels)

    @override
    def teardown(self, stage: str) -> None:
        """Stop the loaders' persistent workers, close the datasets' files, report skipped images."""
        self._release(stage if stage == "fit" else None)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Release what ``teardown`` releases when a Trainer run raised (Lightning skips teardown)."""
        self._release("fit")

    def _release(self, stage: str | None) -> None:
        if self.trainer is not None:
            # persistent workers left running at interpreter exit are terminated, leaving their pymp-* folders
            for name in ("train_dataloader", "val_dataloaders", "test_dataloaders", "predict_dataloaders"):
                close_workers(getattr(self.trainer, name, None))
        close_workers(list(self._handed_out))  # and the loaders a loop of the user's own took from the hooks
        for split, dataset in list(self._datasets.items()):
            close = getattr(dataset, "close", None)
            if callable(close):
                close()  # e.g. an HDF5 file the main process opened (num_workers=0)
                del self._datasets[split]  # built afresh by the next setup
        if self._skip_dir is None:
            return
        new = self._current_skips()
        if new:
            shown = ", ".join(repr(p) for p in sorted(set(new))[:5])
            warn_at_user(
                f"OptimizedDataModule skipped {len(new)} unreadable image(s) during {stage or 'the run'} "
                f"({len(set(new))} distinct), e.g. {shown}; each was replaced by the next readable image"
            )
        self._skipped_reported.extend(new)
        self._remove_skip_dir()

    def _make_skip_dir(self) -> None:
        """The folder workers report skipped images in, with a ``Janitor`` that removes it after a SIGKILL."""
        path = os.path.join(tempfile.gettempdir(), f"lightning_gpuopt_skipped_{uuid.uuid4().hex[:12]}")
        self._skip_janitor = Janitor(path)  # before the folder exists: no moment in which a kill strands it
        try:
            os.mkdir(path, 0o700)
        except BaseException:
            self._skip_janitor.release(done=False)
            self._skip_janitor = None
            raise
        self._skip_dir = path

    def _remove_skip_dir(self) -> None:
        if self._skip_dir is not None:
            shutil.rmtree(self._skip_dir, ignore_errors=True)
            self._skip_dir = None
            if self._skip_janitor is not None:
                self._skip_janitor.release(done=True)
                self._skip_janitor = None
            # the folder datasets log into the removed folder: setup() builds them afresh
            for split in [s for s, d in self._datasets.items() if isinstance(d, UInt8ImageFolder)]:
                del self._datasets[split]

    def _current_skips(self) -> list[str]:
        paths: list[str] = []
        for ds in self._datasets.values():
            skipped = getattr(ds, "skipped", None)
            if callable(skipped):
                with contextlib.suppress(OSError):
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


def _check_paths(given: dict[str, Any]) -> dict[str, str | None]:
    paths: dict[str, str | None] = {}
    for split, value in given.items():
        if value is not None:
            check_arg(isinstance(value, (str, os.PathLike)), f"{split}_dir", value, "a path", error=TypeError)
            p = Path(value).expanduser()
            if not p.exists():
                raise FileNotFoundError(f"{split}_dir={os.fspath(value)!r} does not exist; check the path")
            value = os.fspath(p)
        paths[split] = value
    return paths


def _check_sizes(batch_size: Any, num_workers: Any, image_size: Any, storage_size: Any) -> int:
    check_int(batch_size, "batch_size", low=1)
    cpus = available_cpus()
    cap = MAX_WORKERS_PER_CPU * cpus
    check_int(num_workers, "num_workers", low=0, also=("auto",))
    must = f"at most {MAX_WORKERS_PER_CPU} per CPU ({cap} for the {cpus} CPUs this process may use)"
    fix = "pass num_workers='auto' (see the docstring for how it is chosen)"
    check_arg(not is_int(num_workers) or int(num_workers) <= cap, "num_workers", num_workers, must, fix)
    check_int(image_size, "image_size", low=1, what="(pixels)")
    resize = eval_resize_size(image_size)
    storage_size = resize if storage_size is None else storage_size
    fix = f"leave it None for eval_resize_size(image_size) = {resize}"
    check_int(storage_size, "storage_size", what=f">= image_size ({image_size})", fix=fix)
    must = f"an int >= image_size ({image_size})"
    check_arg(storage_size >= image_size, "storage_size", storage_size, must, fix)
    return int(storage_size)


def _check_kinds(augment: Any, pin_memory: Any, on_corrupt: Any, check_images: Any, tuning: Any) -> None:
    must = "an AugmentConfig, True (torchvision's defaults) or False"
    check_arg(isinstance(augment, (AugmentConfig, bool)), "augment", augment, must, error=TypeError)
    check_bool(pin_memory, "pin_memory", none_ok=True)
    check_choice(on_corrupt, "on_corrupt", ON_CORRUPT)
    check_bool(check_images, "check_images")
    must = "None or TuningConfig(...)"
    check_arg(isinstance(tuning, TuningConfig), "tuning", tuning, must, error=TypeError)


def _check_backend_args(
    backend: Backend,
    paths: dict[str, str | None],
    on_corrupt: str,
    workers: Any,
    dali: Any,
    hdf5: Any,
    own: bool,
) -> None:
    """Refuse what the chosen backend cannot read: its checks, ``hdf5`` without a store, workers for DALI."""
    backend.check(paths, on_corrupt=on_corrupt, dali=dali, hdf5=hdf5)
    ok = hdf5 is None or own or not isinstance(backend, (FolderBackend, DALIBackend))
    must = "None where no split is a store: HDF5Options sets the reading threads of a raw store"
    check_arg(ok, "hdf5", hdf5, must, "leave hdf5 out")
    ok = not (backend.device_batches and is_int(workers) and int(workers) > 0)
    must = "'auto' or 0 with backend='dali': DALI decodes on its own threads, it has no DataLoader workers"
    fix = f"pass dali=DALIOptions(threads={workers}) for DALI's threads, or backend='folder' for worker "
    fix += "processes"
    check_arg(ok, "num_workers", workers, must, fix)
