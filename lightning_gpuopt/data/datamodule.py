"""``OptimizedDataModule``: whole uint8 images to the GPU, crops and normalization there, tuned pinned loaders."""

from __future__ import annotations

import contextlib
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
from lightning_gpuopt.data._counts import MAX_WORKERS_PER_CPU, MIN_TUNE_BATCHES, SplitCounts
from lightning_gpuopt.data._feed import feed_line, overridden_batch_hooks
from lightning_gpuopt.data._lifetime import Janitor
from lightning_gpuopt.data.backends import BACKENDS, DALIBackend, FolderBackend, choose_backend
from lightning_gpuopt.data.folder import (
    ON_CORRUPT,
    UInt8ImageFolder,
    UnreadableImagesError,
    check_image_folder,
    class_indices,
)
from lightning_gpuopt.data.loader import (
    SPLITS,
    StagedBatch,
    UInt8Collate,
    close_workers,
)
from lightning_gpuopt.data.transforms import AugmentConfig, GPUAugment, check_mean_std
from lightning_gpuopt.data.tuning import TuningConfig

if TYPE_CHECKING:
    from lightning_gpuopt.data.dali import DALIOptions
    from lightning_gpuopt.data.decode import DecodeOptions
    from lightning_gpuopt.data.hdf5 import HDF5Options

__all__ = ["BACKENDS", "MAX_WORKERS_PER_CPU", "MIN_TUNE_BATCHES", "OptimizedDataModule", "UInt8Collate"]

STAGE_SPLITS = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("predict",)}
#: the splits labelled with the training split's class indices (``OptimizedDataModule.class_indices``); a
#: prediction folder's classes (often one placeholder folder) keep their own labels.
LABELLED_SPLITS = ("val", "test")


class OptimizedDataModule(SplitCounts, pl.LightningDataModule):
    """A DataModule that keeps the GPU fed: whole uint8 images, crops on the GPU, tuned pinned loaders.

    Host side, each image is decoded once, resized so its shorter side is ``storage_size`` and kept whole on
    a fixed uint8 canvas (``lightning_gpuopt.data.layout``), a quarter of float32's bytes. Batches are pinned
    when the Trainer runs on CUDA; the training loader keeps prefetching across epochs and stages the next
    batch on the GPU on a side stream (``ContinuousDataLoader``); Lightning injects its
    ``DistributedSampler`` under DDP as usual. A raw HDF5 store is read by threads of the training process
    straight into pinned memory (``HDF5Options``; no worker processes); an image folder and a JPEG store by
    worker processes that each decode a whole batch into shared memory (``readers.WholeBatches``); for other
    datasets ``num_workers="auto"`` is measured in ``setup`` (``tune_num_workers``, cached). Device side,
    ``on_after_batch_transfer`` turns ``(images, labels, meta)``
    into ``(normalized channels_last float NCHW, labels)``: torchvision's random resized crop + flip from the
    whole image for training, ``Resize + CenterCrop`` for evaluation (``GPUAugment``). ``setup`` and the split
    hooks say, one line a split (rank zero), what reads it, each count and how it was chosen, and whether
    training batches are staged.

    Lightning's batch hooks: a subclass (or the LightningModule) that overrides ``on_before_batch_transfer``,
    ``transfer_batch_to_device`` or ``on_after_batch_transfer`` gets what Lightning's docs describe, on every
    host backend: the training loader then does not stage, ``on_before_batch_transfer`` sees the host batch
    ``(uint8 NHWC images, int64 labels, int32 meta)``, ``transfer_batch_to_device`` moves it, and
    ``super().on_after_batch_transfer`` returns ``(normalized float NCHW, labels)`` on the device. DALI makes
    its batches on the device: there every hook sees ``(normalized float NCHW, int64 labels)`` already on it,
    and ``super().on_after_batch_transfer`` returns them unchanged.

    Args:
        train_dir: training folder (``root/<class>/<image>``) or HDF5 file (None: override ``train_dataset``).
        val_dir: validation folder or HDF5 file (None and no override: no validation). Its classes, and
            ``test_dir``'s, are labelled by their index among the training split's classes
            (``class_indices``); a class the training split lacks raises ``ValueError`` in ``setup``.
        test_dir: test folder or HDF5 file.
        predict_dir: prediction folder or HDF5 file.
        backend: ``"auto"`` (a ``.h5``/``.hdf5`` file -> ``"hdf5"``; folders -> ``"dali"`` on a machine with
            a CUDA GPU and DALI installed, else ``"folder"``, JPEG folders and JPEG stores decoded in the training
            process on a CUDA machine without DALI (``decode``): ``backends.choose_backend``, logged with its
            reason), ``"folder"`` (``UInt8ImageFolder``), ``"hdf5"`` (``HDF5ImageDataset``) or ``"dali"``
            (DALI decodes JPEG folders; ``pip install 'lightning-gpuopt[dali]'``). ``dm.backend`` is the
            resolved name, ``dm.backend_reason`` why ``"auto"`` chose it; the object behind it
            (``lightning_gpuopt.data.backends``) builds the datasets and loaders.
        batch_size: samples per batch per device.
        num_workers: DataLoader worker processes per loader (at most ``MAX_WORKERS_PER_CPU`` per CPU), or
            ``"auto"``: for a dataset of yours of at least ``MIN_TUNE_BATCHES`` batches, measured in
            ``setup`` (once per dataset, cached on disk); for an image folder or a JPEG store, whose workers
            each decode whole batches, one a CPU (chosen, not measured); for a smaller split, one a batch
            (not measured). A raw HDF5 store and DALI have no worker processes: their threads are set by
            ``hdf5`` and ``dali``, and a count above 0 is refused for them (``backend="auto"`` reads image
            folders with worker processes, not DALI, when given one). After ``setup("fit")`` the attribute
            holds the training split's resolved count.
        image_size: side of the square images the model receives.
        storage_size: shorter side of the images the folder backend decodes (default
            ``eval_resize_size(image_size)``, 256 at 224, where evaluation crops are exact pixel copies). A
            store's own size is read from the store.
        mean: per-channel mean in [0, 1] units.
        std: per-channel std in [0, 1] units.
        augment: the training crop and flip (``AugmentConfig``); ``True``: torchvision's defaults,
            ``False``: the evaluation view for training too.
        pin_memory: pin host batches (None: when the Trainer's device is CUDA).
        on_corrupt: ``"raise"`` (error naming the file) or ``"skip"`` (folder backend: unreadable images are
            replaced by the next readable one, counted, listed in ``skipped_images`` and warned at teardown).
        check_images: decode every image of the folder splits of a stage in ``setup``, before training
            (``folder.check_image_folder``: seconds for thousands of images), and raise one error listing
            every one that cannot be decoded (``on_corrupt="skip"``: warn listing them). Store files were
            checked when converted.
        tuning: how ``num_workers="auto"`` measures (``TuningConfig``; None: its defaults).
        dali: DALI options for ``backend="dali"`` (``DALIOptions``: decoder, threads); ``build_dali_loader``
            reads them from ``dm.dali``.
        decode: how a JPEG folder or a JPEG store is decoded in the training process without DALI
            (``DecodeOptions``: nvJPEG on the GPU or CPU threads, measured at setup by default); given, it
            asks for that decoding on any machine. ``"auto"`` already decodes so on a CUDA machine without
            DALI (``num_workers="auto"``, torchvision installed).
        hdf5: how a raw HDF5 store is read (``HDF5Options``: reading threads of the training process).

    Example:
        >>> dm = OptimizedDataModule("data/train", "data/val", batch_size=256, num_workers="auto")  # doctest: +SKIP
        >>> trainer.fit(model, datamodule=dm)  # doctest: +SKIP

        Your own datasets: override the hooks and return ``(uint8 HWC image, label)`` of one fixed size, or
        ``(canvas, label, meta)`` as ``lightning_gpuopt.data.layout`` defines them::

            class MyData(OptimizedDataModule):
                def train_dataset(self):
                    return MyUInt8Dataset("/data", split="train", size=self.storage_size)
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
        hooks = [f"{s}_dataset" for s in SPLITS]
        own = any(getattr(type(self), h) is not getattr(OptimizedDataModule, h) for h in hooks)
        self._backend, self.backend_reason = choose_backend(
            backend, paths, on_corrupt=on_corrupt, own_datasets=own, decode=decode, num_workers=num_workers
        )
        self._backend.check(paths, on_corrupt=on_corrupt, dali=dali, hdf5=hdf5)
        check_arg(
            hdf5 is None or own or not isinstance(self._backend, (FolderBackend, DALIBackend)),
            "hdf5",
            hdf5,
            "None where no split is a store: HDF5Options sets the reading threads of a raw store",
            "leave hdf5 out",
        )
        check_arg(
            not (self._backend.device_batches and is_int(num_workers) and int(num_workers) > 0),
            "num_workers",
            num_workers,
            "'auto' or 0 with backend='dali': DALI decodes on its own threads, it has no DataLoader workers",
            f"pass dali=DALIOptions(threads={num_workers}) for DALI's threads, or backend='folder' for "
            "worker processes",
        )
        if self.backend_reason is not None and self._backend.name != "hdf5" and any(paths.values()):
            name, why = self._backend.name, self.backend_reason
            rank_zero_info(f"OptimizedDataModule: backend='auto' -> {name!r} ({why})")
        self.dali: DALIOptions | None = dali
        self.decode: DecodeOptions | None = decode
        self.hdf5: HDF5Options | None = hdf5
        self.train_dir, self.val_dir = paths["train"], paths["val"]
        self.test_dir, self.predict_dir = paths["test"], paths["predict"]
        self.batch_size = batch_size
        self.num_workers: int | str = num_workers
        self.image_size = image_size
        self.storage_size = storage_size
        self.augment: AugmentConfig | None = (
            augment if isinstance(augment, AugmentConfig) else (AugmentConfig() if augment else None)
        )
        self.pin_memory = pin_memory
        self.on_corrupt = on_corrupt
        self.check_images = check_images
        self._checked: set[str] = set()  # folders check_images found readable
        self.tuning = tuning
        self.gpu_augment = GPUAugment(image_size, self.augment, self.mean, self.std)
        self._stage_seed = 0  # drawn for each training loader (train_dataloader)
        self._stage_generator: torch.Generator | None = None
        self.tuning_result: Any = None
        self._auto_workers = num_workers == "auto"
        self._split_workers: dict[str, int] = {}  # DataLoader worker processes of each split's loader
        self._split_threads: dict[str, int] = {}  # reading threads of a split read by threads (a raw store)
        self._how: dict[str, dict[str, str]] = {}  # per split: how each count was chosen, for the setup line
        self._said: set[str] = set()  # setup lines already given
        self._measured: dict[str, tuple[int, str]] = {}
        self._datasets: dict[str, Dataset | None] = {}
        self._skip_dir: str | None = None
        self._skip_janitor: Janitor | None = None
        self._skipped_reported: list[str] = []
        self._handed_out: weakref.WeakSet[Any] = weakref.WeakSet()  # loaders of the split hooks, for teardown

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_skip_janitor"] = None  # a process handle; the original keeps removing the folder
        state["_handed_out"] = None  # the loaders stay with the original; a copy tracks its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._handed_out = weakref.WeakSet()

    @property
    def backend(self) -> str:
        """The backend reading the data: ``"folder"``, ``"hdf5"`` or ``"dali"`` (``"auto"`` resolved)."""
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
        """The training split's class names (label order) and where they are read; ``None``: unknown (a
        ``train_dataset()`` override without ``classes`` or not built in this stage, or no training data)."""
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
        """The labels of ``split``'s classes (its own class names, in its label order): their indices among
        the training split's classes (``folder.class_indices``), so that a class gets the same label in every
        split; ``None`` where they keep their own labels (the training and prediction splits, or training
        classes unknown). Raises ``ValueError`` naming the split, ``path`` and the classes training lacks.

        Example:
            >>> dm = OptimizedDataModule("data/train", "data/val")  # doctest: +SKIP
            >>> dm.class_indices("val", ["cat", "fox"])  # training: cat, dog, fox  # doctest: +SKIP
            [0, 2]
        """
        aligned = self._aligned(split, classes, path)
        return aligned[1] if aligned is not None else None

    def _aligned(self, split: str, classes: Sequence[str], path: Any) -> tuple[list[str], list[int]] | None:
        """``(training classes, class_indices(...))`` of ``split``, or ``None`` (see ``class_indices``)."""
        if split not in LABELLED_SPLITS:
            return None
        train = self._training_classes()
        if train is None:
            return None
        path = path if path is not None else getattr(self, f"{split}_dir", None)
        return train[0], class_indices(train[0], classes, split=split, path=path, train_path=train[1])

    def _align_classes(self, split: str, dataset: Any) -> None:
        """Label ``dataset`` (a split's, with ``classes`` and ``relabel``) by the training split's classes."""
        classes, relabel = getattr(dataset, "classes", None), getattr(dataset, "relabel", None)
        if classes is None or not callable(relabel):
            return  # a user dataset labels its own samples
        path = getattr(dataset, "root", None) or getattr(dataset, "path", None)
        aligned = self._aligned(split, classes, path)
        if aligned is not None:
            relabel(*aligned)

    def _check_storage(self, split: str, dataset: Any) -> None:
        """A store kept at another size than ``image_size`` needs: refuse upsampling, say what else happens."""
        stored = getattr(dataset, "storage_size", None)
        if stored is None or isinstance(dataset, UInt8ImageFolder):
            return  # a user dataset's images are what they are; the folder decodes at storage_size
        resize = eval_resize_size(self.image_size)
        fix = f"convert the source with `lightning-gpuopt convert SRC OUT.h5 --size {resize}`"
        check_arg(
            not upsamples(stored, self.image_size),
            f"{split} data's storage size",
            stored,
            f">= image_size ({self.image_size}), or every crop is upsampled",
            f"{fix} or lower image_size",
        )
        if stored != resize:
            warn_once(
                f"OptimizedDataModule: the {split} data is stored with its shorter side at {stored} px, not at "
                f"eval_resize_size({self.image_size}) = {resize}. Crops are the same boxes of the whole image "
                f"(evaluation: Resize({resize}) + CenterCrop({self.image_size})), resampled from {stored} px "
                f"bilinearly instead of being exact pixel copies; {fix} for torchvision's exact pixels."
            )

    # ----------------------------------------------------------------- Lightning hooks
    @override
    def setup(self, stage: str) -> None:
        """Prepare the stage: build the datasets it needs (errors surface here, before training) and
        resolve their workers; DALI lists and decodes its folders itself when its loaders are built."""
        if self.check_images:
            self._check_images(stage)
        self._backend.setup(self, stage)

    def _check_images(self, stage: str) -> None:
        """``check_images``: decode every image of the stage's folder splits once, listing the unreadable."""
        threads = max(1, 2 * available_cpus() // self._local_world_size())
        fix = (
            "each is replaced by the next readable image (on_corrupt='skip')"
            if self.on_corrupt == "skip"
            else ""
        )
        for split in STAGE_SPLITS.get(stage, SPLITS):
            path = getattr(self, f"{split}_dir")
            if path is None or path in self._checked or not os.path.isdir(path):
                continue
            try:
                check_image_folder(path, threads=threads, fix=fix)
            except UnreadableImagesError as err:
                if self.on_corrupt == "raise":
                    raise
                warn_once(f"OptimizedDataModule(check_images=True): {err}")
            self._checked.add(path)

    def _setup_datasets(self, stage: str) -> None:
        """``setup`` of a backend that reads datasets on the host (``HostBackend``)."""
        try:
            if self.on_corrupt == "skip" and self._skip_dir is None:
                self._make_skip_dir()
            splits = STAGE_SPLITS.get(stage, SPLITS)
            for split in splits:
                self._dataset(split)
            if stage == "fit":
                train = self._datasets.get("train")
                check_arg(
                    train is not None,
                    "train_dir",
                    None,
                    "a folder or HDF5 file to fit (or train_dataset() overridden)",
                    "pass train_dir= or override train_dataset()",
                )
                check_arg(
                    len(train) >= self.batch_size,  # type: ignore[arg-type]
                    "batch_size",
                    self.batch_size,
                    f"at most the {len(train)} training samples (the last partial batch is dropped)",  # type: ignore[arg-type]
                    "lower batch_size",
                )
            built = [split for split in splits if self._datasets.get(split) is not None]
            self._check_worker_count(built)
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
        """What the training loader applies to each batch on the GPU ahead of the step: the training
        transform, or ``None`` where batch hooks of yours are overridden (they then see every batch on
        Lightning's path, as its docs describe)."""
        return None if overridden_batch_hooks(self, OptimizedDataModule) else self._stage_train_batch

    def _say_feed(self, split: str, loader: Any) -> None:
        """One line for ``split`` (rank zero; again only when it changes): what reads it, each count and how
        it was chosen, and for training whether batches are staged on the GPU (``_feed.feed_line``)."""
        hooks = overridden_batch_hooks(self, OptimizedDataModule) if split == "train" else []
        line = feed_line(
            split,
            loader,
            self._how.get(split, {}),
            hooks=hooks,
            dali=self.dali,
            processes=self._local_world_size(),
        )
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
        """On the device: ``(uint8 canvases, labels, meta)`` -> ``(normalized channels_last NCHW, labels)``;
        a batch DALI made on the device, or one the training loader staged, is normalized already and is
        returned as it is."""
        made = self._backend.device_batches or (
            self._backend.train_on_device and self.trainer is not None and self.trainer.training
        )
        if made or isinstance(batch, StagedBatch):
            return batch
        check_arg(
            isinstance(batch, (tuple, list)) and len(batch) in (2, 3),
            "OptimizedDataModule.on_after_batch_transfer's batch",
            type(batch).__name__,
            "(images, labels[, meta])",
            "return (uint8 HWC, label) samples from the dataset hooks",
            error=TypeError,
        )
        training = self.trainer is not None and self.trainer.training and self.augment is not None
        meta = batch[2] if len(batch) == 3 else None
        return (self.gpu_augment(batch[0], meta, train=training), batch[1])

    def _stage_train_batch(self, batch: Any) -> Any:
        """The training transform, applied by ``ContinuousDataLoader`` ahead of time on a side stream."""
        images, labels, meta = batch
        if self.augment is not None and images.is_cuda:
            # the crops are drawn on the staging thread: from a generator of their own, so the draws of the
            # training thread (dropout, ...) and of the staging thread never interleave and a seeded run
            # repeats; seeded from torch's CPU generator (``seed_everything``) when first used
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
        """Release the same resources as ``teardown`` when a Trainer run raised (Lightning skips teardown)."""
        self._release("fit")

    def _release(self, stage: str | None) -> None:
        if self.trainer is not None:
            # persistent workers left running at interpreter exit are terminated and leave their pymp-* folders
            for name in ("train_dataloader", "val_dataloaders", "test_dataloaders", "predict_dataloaders"):
                close_workers(getattr(self.trainer, name, None))
        # and the loaders a loop of the user's own took from the split hooks: their workers and reads ahead
        close_workers(list(self._handed_out))
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
    """Each split's path, expanded; a path that does not exist is a ``FileNotFoundError`` naming it."""
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
    """Refuse a bad batch size, worker count or image size; returns the storage size (its default filled)."""
    check_int(batch_size, "batch_size", low=1)
    cap = MAX_WORKERS_PER_CPU * available_cpus()
    check_int(num_workers, "num_workers", low=0, also=("auto",))
    check_arg(
        not is_int(num_workers) or int(num_workers) <= cap,
        "num_workers",
        num_workers,
        f"at most {MAX_WORKERS_PER_CPU} per CPU ({cap} for the {available_cpus()} CPUs this process may use)",
        "pass num_workers='auto' (see the docstring for how it is chosen)",
    )
    check_int(image_size, "image_size", low=1, what="(pixels)")
    resize = eval_resize_size(image_size)
    storage_size = resize if storage_size is None else storage_size
    fix = f"leave it None for eval_resize_size(image_size) = {resize}"
    check_int(storage_size, "storage_size", what=f">= image_size ({image_size})", fix=fix)
    check_arg(
        storage_size >= image_size, "storage_size", storage_size, f"an int >= image_size ({image_size})", fix
    )
    return int(storage_size)


def _check_kinds(augment: Any, pin_memory: Any, on_corrupt: Any, check_images: Any, tuning: Any) -> None:
    """Refuse an argument of the wrong kind (``TypeError``) or an unknown ``on_corrupt``."""
    check_arg(
        isinstance(augment, (AugmentConfig, bool)),
        "augment",
        augment,
        "an AugmentConfig, True (torchvision's defaults) or False",
        error=TypeError,
    )
    check_arg(
        pin_memory is None or isinstance(pin_memory, bool), "pin_memory", pin_memory, "None or a bool",
        error=TypeError,
    )  # fmt: skip
    check_choice(on_corrupt, "on_corrupt", ON_CORRUPT)
    check_bool(check_images, "check_images")
    check_arg(
        isinstance(tuning, TuningConfig), "tuning", tuning, "None or TuningConfig(...)", error=TypeError
    )
