"""Where an ``OptimizedDataModule`` reads its data: one ``Backend`` object per kind of source
(docs/datamodule.md)."""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from torch.utils.data import Dataset

from lightning_gpuopt._checks import check_arg
from lightning_gpuopt._common import FeedInfo
from lightning_gpuopt.data.folder import UInt8ImageFolder, folder_classes
from lightning_gpuopt.data.loader import (
    PREFETCH_FACTOR,
    STAGE_SPLITS,
    ContinuousDataLoader,
    HostDataLoader,
    UInt8Collate,
    WholeBatches,
    read_by_threads,
    reads_in_workers,
)

_HDF5_SUFFIXES = (".h5", ".hdf5")
_NO_TRAIN = ("train_dir", None, "a folder or HDF5 file to fit (or train_dataset() overridden)")
_NO_TRAIN_FIX = "pass train_dir= or override train_dataset()"


#: the ``OptimizedDataModule`` a backend reads for (typed loosely: the DataModule imports the backends)
Owner = Any


class Backend:
    """What an ``OptimizedDataModule`` asks of the kind of data it reads.

    Attributes:
        name: what ``backend=`` and ``dm.backend`` call it.
        device_batches: its loaders deliver ``(normalized images, labels)`` on the device.
        train_on_device: its training loader does, its others not.
    """

    name: ClassVar[str] = ""
    device_batches: ClassVar[bool] = False
    train_on_device: ClassVar[bool] = False

    def check(self, paths: dict[str, str | None], *, on_corrupt: str, dali: Any, hdf5: Any = None) -> None:
        """Refuse constructor arguments this backend cannot read, naming the argument and the fix."""
        check_arg(dali is None, "dali", dali, "None unless backend='dali'")
        _check_hdf5_options(hdf5)

    def dataset(
        self, path: str, *, storage_size: int, on_corrupt: str, skip_log: str | None
    ) -> Dataset | None:
        """The default dataset of a split read from ``path``; ``None``: this backend reads no datasets."""
        return None

    def classes(self, path: str) -> list[str] | None:
        """The class names (label order) of the split at ``path``; ``None``: this backend reads none."""
        return None

    def setup(self, dm: Owner, stage: str) -> None:
        """Prepare ``stage`` (Lightning's ``setup``)."""

    def loader(self, dm: Owner, split: str) -> Any:
        """``split``'s loader (``[]``: no data for an evaluation split, which Lightning skips)."""
        raise NotImplementedError(f"{type(self).__name__} builds no loaders")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class HostBackend(Backend):
    """Datasets read on the host into uint8 batches, transformed on the device by the DataModule."""

    def setup(self, dm: Owner, stage: str) -> None:
        dm._setup_datasets(stage)

    def loader(self, dm: Owner, split: str) -> Any:
        dataset = dm._dataset(split)
        if dataset is None:
            check_arg(split != "train", *_NO_TRAIN, _NO_TRAIN_FIX)
            return []  # Lightning skips a stage whose loader list is empty
        workers, pin = dm._workers(split), dm._pin()
        threads = dm._read_threads(split) if read_by_threads(dataset) else 0
        return host_loader(
            dataset,
            split,
            batch_size=dm.batch_size,
            workers=workers,
            threads=threads,
            pin=pin,
            feed=self.feed(dataset, batch_size=dm.batch_size, workers=workers, threads=threads, pin=pin),
            device_transform=dm._device_transform() if split == "train" else None,
        )

    def feed(self, dataset: Any, *, batch_size: int, workers: int, threads: int, pin: bool) -> FeedInfo:
        """How a loader over ``dataset`` feeds the GPU; a dataset of the user's names no backend."""
        from lightning_gpuopt.data.hdf5 import HDF5ImageDataset

        folder = isinstance(dataset, UInt8ImageFolder)
        return FeedInfo(
            backend="folder" if folder else "hdf5" if isinstance(dataset, HDF5ImageDataset) else None,
            num_workers=None if threads else workers,
            pin_memory=pin,
            batch_size=batch_size,
            host_batches=True,
            decoder="cpu" if folder else None,
            threads=threads or None,
        )


class FolderBackend(HostBackend):
    """Class-per-subfolder image folders (``UInt8ImageFolder``) decoded by worker processes."""

    name = "folder"

    def check(self, paths: dict[str, str | None], *, on_corrupt: str, dali: Any, hdf5: Any = None) -> None:
        _check_paths(
            paths, "a folder laid out as <root>/<class>/<image> for the folder backend", folders=True
        )
        super().check(paths, on_corrupt=on_corrupt, dali=dali, hdf5=hdf5)

    def dataset(
        self, path: str, *, storage_size: int, on_corrupt: str, skip_log: str | None
    ) -> Dataset | None:
        return UInt8ImageFolder(path, size=storage_size, on_corrupt=on_corrupt, skip_log=skip_log)

    def classes(self, path: str) -> list[str] | None:
        return folder_classes(path)


class HDF5Backend(HostBackend):
    """A store (``HDF5ImageDataset``): a raw store read by threads, a JPEG store by worker processes."""

    name = "hdf5"

    def check(self, paths: dict[str, str | None], *, on_corrupt: str, dali: Any, hdf5: Any = None) -> None:
        _check_paths(paths, "an HDF5 store file for the hdf5 backend", folders=False)
        super().check(paths, on_corrupt=on_corrupt, dali=dali, hdf5=hdf5)

    def dataset(
        self, path: str, *, storage_size: int, on_corrupt: str, skip_log: str | None
    ) -> Dataset | None:
        from lightning_gpuopt.data.hdf5 import HDF5ImageDataset

        return HDF5ImageDataset(path)  # the store keeps its own storage size; it holds no unreadable images

    def classes(self, path: str) -> list[str] | None:
        from lightning_gpuopt.data.hdf5 import HDF5ImageDataset

        return HDF5ImageDataset(path).classes


class MixedBackend(HostBackend):
    """Store files and image folders in one DataModule (``backend="auto"``), each split read by its kind."""

    name = "hdf5+folder"

    def dataset(self, path: str, **how: Any) -> Dataset | None:
        return (HDF5Backend() if _store_file(path) else FolderBackend()).dataset(path, **how)

    def classes(self, path: str) -> list[str] | None:
        return (HDF5Backend() if _store_file(path) else FolderBackend()).classes(path)


def _check_dali_options(dali: Any) -> None:
    from lightning_gpuopt.data.dali import DALIOptions  # DALI itself is imported only by its loaders

    ok = dali is None or isinstance(dali, DALIOptions)
    check_arg(ok, "dali", dali, "None or a DALIOptions", "e.g. dali=DALIOptions(decoder='cpu')", TypeError)


def _check_hdf5_options(hdf5: Any) -> None:
    from lightning_gpuopt.data.hdf5 import HDF5Options  # h5py itself is imported by the stores only

    ok = hdf5 is None or isinstance(hdf5, HDF5Options)
    check_arg(ok, "hdf5", hdf5, "None or an HDF5Options", "e.g. hdf5=HDF5Options(threads=8)", TypeError)


def _check_paths(paths: dict[str, str | None], must: str, *, folders: bool) -> None:
    """Refuse a file where a folder belongs (``folders``) or a folder where a store file belongs."""
    for split, path in paths.items():
        fix = "pass backend='auto', which reads a store file as a store and a folder as a folder"
        if not folders:
            fix = "pass backend='auto' to read the folder as a folder, or convert it first: "
            fix += f"`lightning-gpuopt convert {path} {path}.h5`"
        check_arg(path is None or Path(path).is_dir() == folders, f"{split}_dir", path, must, fix)


class DALIBackend(Backend):
    """DALI reads and decodes JPEG folders itself and delivers normalized batches on the device."""

    name = "dali"
    device_batches = True

    def check(self, paths: dict[str, str | None], *, on_corrupt: str, dali: Any, hdf5: Any = None) -> None:
        _check_hdf5_options(hdf5)
        itself = "with backend='dali' (DALI reads image folders itself)"
        check_arg(any(v is not None for v in paths.values()), "train_dir", None, f"a JPEG folder {itself}")
        _check_paths(paths, f"a JPEG folder, as train_dir is, {itself}", folders=True)
        must = "'raise' with backend='dali' (DALI cannot skip unreadable files)"
        fix = "use backend='folder' to skip them, or remove them"
        check_arg(on_corrupt == "raise", "on_corrupt", on_corrupt, must, fix)
        _check_dali_options(dali)

    def classes(self, path: str) -> list[str] | None:
        return folder_classes(path)

    def setup(self, dm: Owner, stage: str) -> None:
        """Check the stage's class folders against training's (a class training lacks raises here)."""
        for split in STAGE_SPLITS.get(stage, ()):
            path = getattr(dm, f"{split}_dir", None)
            if path is not None:
                dm.class_indices(split, folder_classes(path), path)

    def loader(self, dm: Owner, split: str) -> Any:
        from lightning_gpuopt.data.dali import DALILoader, build_dali_loader

        loader = build_dali_loader(dm, split)
        path = getattr(dm, f"{split}_dir", None)
        if isinstance(loader, DALILoader) and path is not None:
            # the file list is labelled by the split's own class folders: relabelled by training's
            indices = dm.class_indices(split, folder_classes(path), path)
            if indices is not None:
                loader.labels = [indices[label] for label in loader.labels]
        return loader


class DALIStoreBackend(HDF5Backend):
    """A JPEG store whose training batches DALI decodes; ``HDF5Backend`` reads its evaluation splits."""

    name = "dali"
    train_on_device = True

    def check(self, paths: dict[str, str | None], *, on_corrupt: str, dali: Any, hdf5: Any = None) -> None:
        from lightning_gpuopt.data.hdf5 import _is_jpeg_store

        _check_hdf5_options(hdf5)
        train = paths.get("train")
        must = "a JPEG folder or a JPEG store (lightning-gpuopt convert --format jpeg) with backend='dali'"
        fix = "read a raw store with backend='hdf5' (or 'auto'), or convert the JPEGs with --format jpeg"
        check_arg(train is None or _is_jpeg_store(train), "train_dir", train, must, fix)
        must = "a store file with backend='dali' on a JPEG store (its evaluation splits are read as stores)"
        _check_paths(paths, must, folders=False)
        _check_dali_options(dali)

    def loader(self, dm: Owner, split: str) -> Any:
        if split != "train" or dm._dataset("train") is None:
            return super().loader(dm, split)
        from lightning_gpuopt.data.dali_store import build_dali_store_loader

        return build_dali_store_loader(dm)


_BACKENDS: dict[str, type[Backend]] = {b.name: b for b in (FolderBackend, HDF5Backend, DALIBackend)}
#: what ``OptimizedDataModule(backend=...)`` accepts.
BACKENDS = ("auto", *_BACKENDS)


def resolve_backend(backend: str, paths: dict[str, str | None]) -> Backend:
    """The ``Backend`` that ``backend`` (one of ``BACKENDS``) names; ``"auto"``: ``.h5``/``.hdf5`` files ->
    HDF5, folders -> the folder backend, splits of both kinds -> ``MixedBackend``.

    Example:
        >>> resolve_backend("auto", {"train": None}), resolve_backend("dali", {})
        (FolderBackend(), DALIBackend())
    """
    if backend == "dali" and _store_file(paths.get("train")):
        return DALIStoreBackend()
    if backend != "auto":
        return _BACKENDS[backend]()
    kinds = {"hdf5" if _store_file(v) else "folder" for v in paths.values() if v is not None}
    if len(kinds) > 1:
        return MixedBackend()
    return _BACKENDS[next(iter(kinds), "folder")]()


def _store_file(path: str | None) -> bool:
    return path is not None and Path(path).is_file() and Path(path).suffix.lower() in _HDF5_SUFFIXES


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # no parent package at all
        return False


def dali_installed() -> bool:
    """Whether ``nvidia.dali`` can be imported (looked up, not imported)."""
    return _installed("nvidia.dali")


def torchvision_installed() -> bool:
    """Whether ``torchvision`` can be imported (looked up, not imported)."""
    return _installed("torchvision")


def host_loader(
    dataset: Dataset,
    split: str,
    *,
    batch_size: int,
    workers: int,
    threads: int,
    pin: bool,
    feed: FeedInfo,
    device_transform: Callable[[Any], Any] | None,
) -> HostDataLoader:
    """The DataModule's loader over a host dataset: a ``ContinuousDataLoader`` for training, else one ordered
    pass (``HostDataLoader``); ``workers`` persistent worker processes, or ``threads`` reading a
    ``BatchReader``."""
    train = split == "train"
    if workers and reads_in_workers(dataset):
        dataset = WholeBatches(dataset)  # each worker decodes a whole batch into shared memory
    if threads:
        # Lightning's "does not have many workers": this loader reads on threads instead
        warnings.filterwarnings(
            "ignore", message=f"The '{split}_dataloader' does not have many workers", category=Warning
        )
    kwargs: dict[str, Any] = {
        "batch_size": batch_size,
        "shuffle": train,
        "drop_last": train,
        "num_workers": workers,
        "pin_memory": pin,
        "persistent_workers": workers > 0,
        "prefetch_factor": PREFETCH_FACTOR if workers > 0 else None,
        "collate_fn": UInt8Collate(f"{split}_dataset()"),
        "feed_info": feed,
        "read_threads": threads,
    }
    if train:
        return ContinuousDataLoader(dataset, device_transform=device_transform, **kwargs)
    return HostDataLoader(dataset, **kwargs)
