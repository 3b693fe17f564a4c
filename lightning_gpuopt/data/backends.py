"""Where an ``OptimizedDataModule`` reads its data: one ``Backend`` object per kind of source.

``backend="folder" | "hdf5" | "dali" | "auto"`` names one (``resolve_backend``; ``"auto"`` picks HDF5 for
store files and, for image folders, DALI where it can decode them on a CUDA machine, else the folder backend:
``choose_backend``). The DataModule asks it, instead of testing the name, to check the paths it was given,
to build a split's default dataset, to name a split's classes (``classes``: the DataModule labels every
split by the training split's class indices), to prepare a stage, to build a split's loader and to
describe the feed (``FeedInfo``):

- ``FolderBackend``: ``UInt8ImageFolder`` decoded by worker processes, a whole batch each (``num_workers``).
- ``HDF5Backend``: ``HDF5ImageDataset``: a raw store read by threads of the training process, a JPEG store
  decoded by worker processes.
- ``DALIBackend``: DALI lists and decodes the folders itself and delivers normalized batches on the device
  (``build_dali_loader``); no dataset, no host batches.

The two host backends share ``host_loader``: the training loader keeps prefetching across epochs and stages
its batches on the GPU (``ContinuousDataLoader``); the others are ``HostDataLoader``. Datasets a user's
``<split>_dataset()`` hook returns are fed the same way.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol

from torch.utils.data import Dataset

from lightning_gpuopt._checks import check_arg, is_int
from lightning_gpuopt._common import FeedInfo
from lightning_gpuopt.data.folder import UInt8ImageFolder, folder_classes
from lightning_gpuopt.data.loader import (
    PREFETCH_FACTOR,
    ContinuousDataLoader,
    HostDataLoader,
    UInt8Collate,
    WholeBatches,
    read_by_threads,
    reads_in_workers,
)

__all__ = [
    "BACKENDS",
    "Backend",
    "DALIBackend",
    "FolderBackend",
    "HDF5Backend",
    "HostBackend",
    "MixedBackend",
    "Owner",
    "choose_backend",
    "dali_installed",
    "host_loader",
    "resolve_backend",
    "torchvision_installed",
]

_HDF5_SUFFIXES = (".h5", ".hdf5")


class Owner(Protocol):
    """What a backend asks of its ``OptimizedDataModule`` (which owns datasets, worker counts and pinning)."""

    batch_size: int

    def _setup_datasets(self, stage: str) -> None: ...  # build the stage's datasets, resolve their workers

    def _dataset(self, split: str) -> Dataset | None: ...  # the split's dataset, built once

    def class_indices(self, split: str, classes: Any, path: Any = None) -> list[int] | None: ...  # labels

    def _workers(self, split: str) -> int: ...  # its DataLoader worker processes (0: none)

    def _read_threads(self, split: str) -> int: ...  # threads reading a raw store (HDF5Options)

    def _pin(self) -> bool: ...  # pin host batches

    def _device_transform(self) -> Callable[[Any], Any] | None: ...  # the training loader's staging, or None


class Backend:
    """What an ``OptimizedDataModule`` asks of the kind of data it reads.

    Attributes:
        name: what ``backend=`` and ``dm.backend`` call it.
        device_batches: its loaders deliver ``(normalized images, labels)`` on the device, so the
            DataModule's ``on_after_batch_transfer`` passes their batches through.
        train_on_device: its training loader does (a JPEG store's, through DALI), its others not.

    Example:
        >>> FolderBackend().name, DALIBackend().device_batches
        ('folder', True)
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
        """Prepare ``stage`` (Lightning's ``setup``): nothing to prepare by default."""

    def loader(self, dm: Owner, split: str) -> Any:
        """``split``'s loader (``[]``: no data for an evaluation split, which Lightning skips)."""
        raise NotImplementedError(f"{type(self).__name__} builds no loaders")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class HostBackend(Backend):
    """Datasets read on the host into uint8 batches, transformed on the device by the DataModule.

    ``setup`` builds the stage's datasets (errors surface there, before training) and resolves their
    workers; ``loader`` feeds a split's dataset through ``host_loader``.
    """

    def setup(self, dm: Owner, stage: str) -> None:
        dm._setup_datasets(stage)

    def loader(self, dm: Owner, split: str) -> Any:
        dataset = dm._dataset(split)
        if dataset is None:
            check_arg(
                split != "train",
                "train_dir",
                None,
                "a folder or HDF5 file to fit (or train_dataset() overridden)",
                "pass train_dir= or override train_dataset()",
            )
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
        """How a loader over ``dataset`` feeds the GPU; a dataset this backend did not build has no
        ``backend`` or ``decoder`` in it."""
        return FeedInfo(
            num_workers=None if threads else workers,
            pin_memory=pin,
            batch_size=batch_size,
            host_batches=True,
            threads=threads or None,
        )


class FolderBackend(HostBackend):
    """Class-per-subfolder image folders (``UInt8ImageFolder``) decoded by worker processes, a whole batch
    each into shared memory.

    Example:
        >>> FolderBackend().dataset("data/train", storage_size=256, on_corrupt="raise", skip_log=None)  # doctest: +SKIP
        UInt8ImageFolder(root='data/train', size=256, images=..., classes=...)
    """

    name = "folder"

    def check(self, paths: dict[str, str | None], *, on_corrupt: str, dali: Any, hdf5: Any = None) -> None:
        for split, path in paths.items():
            check_arg(
                path is None or Path(path).is_dir(),
                f"{split}_dir",
                path,
                "a folder laid out as <root>/<class>/<image> for the folder backend",
                "pass backend='auto', which reads a store file as a store and a folder as a folder",
            )
        super().check(paths, on_corrupt=on_corrupt, dali=dali, hdf5=hdf5)

    def dataset(
        self, path: str, *, storage_size: int, on_corrupt: str, skip_log: str | None
    ) -> Dataset | None:
        return UInt8ImageFolder(path, size=storage_size, on_corrupt=on_corrupt, skip_log=skip_log)

    def classes(self, path: str) -> list[str] | None:
        return folder_classes(path)

    def feed(self, dataset: Any, *, batch_size: int, workers: int, threads: int, pin: bool) -> FeedInfo:
        info = super().feed(dataset, batch_size=batch_size, workers=workers, threads=threads, pin=pin)
        if isinstance(dataset, UInt8ImageFolder):
            info.backend, info.decoder = "folder", "cpu"
        return info


class HDF5Backend(HostBackend):
    """A store (``HDF5ImageDataset``): a raw uint8 store read by threads of the training process into pinned
    memory, a JPEG store decoded by worker processes a whole batch each.

    Example:
        >>> HDF5Backend().dataset("train.h5", storage_size=256, on_corrupt="raise", skip_log=None)  # doctest: +SKIP
        HDF5ImageDataset(path='train.h5', images=..., storage_size=256, canvas=(256, 384, 3), classes=...)
    """

    name = "hdf5"

    def check(self, paths: dict[str, str | None], *, on_corrupt: str, dali: Any, hdf5: Any = None) -> None:
        _check_stores(paths, "an HDF5 store file for the hdf5 backend")
        super().check(paths, on_corrupt=on_corrupt, dali=dali, hdf5=hdf5)

    def dataset(
        self, path: str, *, storage_size: int, on_corrupt: str, skip_log: str | None
    ) -> Dataset | None:
        from lightning_gpuopt.data.hdf5 import HDF5ImageDataset

        return HDF5ImageDataset(path)  # the store keeps its own storage size; it holds no unreadable images

    def classes(self, path: str) -> list[str] | None:
        from lightning_gpuopt.data.hdf5 import HDF5ImageDataset

        return HDF5ImageDataset(path).classes  # the class names stored with the images

    def feed(self, dataset: Any, *, batch_size: int, workers: int, threads: int, pin: bool) -> FeedInfo:
        from lightning_gpuopt.data.hdf5 import HDF5ImageDataset

        info = super().feed(dataset, batch_size=batch_size, workers=workers, threads=threads, pin=pin)
        if isinstance(dataset, HDF5ImageDataset):
            info.backend = "hdf5"
        return info


class MixedBackend(HostBackend):
    """Store files and image folders in one DataModule (``backend="auto"``): each split is read by the
    backend of its kind, a store file as ``HDF5Backend`` reads it and a folder as ``FolderBackend`` does, so a
    store for training and a folder for validation work together. DALI is left out: it reads folders only
    where every split is one.

    Example:
        >>> MixedBackend().dataset("data/val", storage_size=256, on_corrupt="raise", skip_log=None)  # doctest: +SKIP
        UInt8ImageFolder(root='data/val', size=256, images=..., classes=...)
    """

    name = "hdf5+folder"

    @staticmethod
    def _of(path: str) -> HostBackend:
        return HDF5Backend() if _store_file(path) else FolderBackend()

    def dataset(
        self, path: str, *, storage_size: int, on_corrupt: str, skip_log: str | None
    ) -> Dataset | None:
        return self._of(path).dataset(
            path, storage_size=storage_size, on_corrupt=on_corrupt, skip_log=skip_log
        )

    def classes(self, path: str) -> list[str] | None:
        return self._of(path).classes(path)

    def feed(self, dataset: Any, *, batch_size: int, workers: int, threads: int, pin: bool) -> FeedInfo:
        kind = FolderBackend() if isinstance(dataset, UInt8ImageFolder) else HDF5Backend()
        return kind.feed(dataset, batch_size=batch_size, workers=workers, threads=threads, pin=pin)


def _check_dali_options(dali: Any) -> None:
    from lightning_gpuopt.data.dali import DALIOptions  # DALI itself is imported only by its loaders

    check_arg(
        dali is None or isinstance(dali, DALIOptions),
        "dali",
        dali,
        "None or a DALIOptions",
        "e.g. dali=DALIOptions(decoder='cpu')",
        error=TypeError,
    )


def _check_hdf5_options(hdf5: Any) -> None:
    from lightning_gpuopt.data.hdf5 import HDF5Options  # h5py itself is imported by the stores only

    check_arg(
        hdf5 is None or isinstance(hdf5, HDF5Options),
        "hdf5",
        hdf5,
        "None or an HDF5Options",
        "e.g. hdf5=HDF5Options(threads=8)",
        error=TypeError,
    )


def _check_stores(paths: dict[str, str | None], must: str) -> None:
    """Refuse a folder where a store file belongs, naming the command that converts it."""
    for split, path in paths.items():
        check_arg(
            path is None or not Path(path).is_dir(),
            f"{split}_dir",
            path,
            must,
            f"pass backend='auto' to read the folder as a folder, or convert it first: "
            f"`lightning-gpuopt convert {path} {path}.h5`",
        )


class DALIBackend(Backend):
    """DALI reads and decodes JPEG folders itself and delivers normalized batches on the device
    (``build_dali_loader``, with the DataModule's ``dali`` options); DALI is imported when a loader is built.

    Example:
        >>> DALIBackend().loader(dm, "train")  # doctest: +SKIP
        DALILoader(files=..., batch_size=256, train=True, ...)
    """

    name = "dali"
    device_batches = True

    def check(self, paths: dict[str, str | None], *, on_corrupt: str, dali: Any, hdf5: Any = None) -> None:
        _check_hdf5_options(hdf5)
        check_arg(
            any(v is not None for v in paths.values()),
            "train_dir",
            None,
            "a JPEG folder with backend='dali' (DALI reads image folders itself)",
        )
        for split, path in paths.items():
            check_arg(
                path is None or Path(path).is_dir(),
                f"{split}_dir",
                path,
                "a JPEG folder, as train_dir is, with backend='dali' (DALI reads image folders itself)",
                "pass backend='auto', which reads a store file as a store and a folder as a folder",
            )
        check_arg(
            on_corrupt == "raise",
            "on_corrupt",
            on_corrupt,
            "'raise' with backend='dali' (DALI cannot skip unreadable files)",
            "use backend='folder' to skip them, or remove them",
        )
        _check_dali_options(dali)

    def classes(self, path: str) -> list[str] | None:
        return folder_classes(path)

    def setup(self, dm: Owner, stage: str) -> None:
        """Check the stage's class folders against training's (``dm.class_indices``: a class training
        lacks raises here); DALI lists and decodes the folders itself when its loaders are built."""
        from lightning_gpuopt.data.datamodule import STAGE_SPLITS

        for split in STAGE_SPLITS.get(stage, ()):
            path = getattr(dm, f"{split}_dir", None)
            if path is not None:
                dm.class_indices(split, folder_classes(path), path)

    def loader(self, dm: Owner, split: str) -> Any:
        from lightning_gpuopt.data.dali import DALILoader, build_dali_loader

        loader = build_dali_loader(dm, split)
        path = getattr(dm, f"{split}_dir", None)
        if isinstance(loader, DALILoader) and path is not None:
            # the file list is labelled by the split's own class folders (scan_image_folder); its labels
            # become the training split's indices of those classes before the pipeline is built
            indices = dm.class_indices(split, folder_classes(path), path)
            if indices is not None:
                loader.labels = [indices[label] for label in loader.labels]
        return loader


class DALIStoreBackend(HDF5Backend):
    """A compact JPEG store whose training batches DALI decodes on the device (``dali_store.DALIStoreLoader``,
    with the DataModule's ``dali`` options); its evaluation splits are read as ``HDF5Backend`` reads them.

    Example:
        >>> DALIStoreBackend().name, DALIStoreBackend().device_batches
        ('dali', False)
    """

    name = "dali"
    train_on_device = True

    def check(self, paths: dict[str, str | None], *, on_corrupt: str, dali: Any, hdf5: Any = None) -> None:
        from lightning_gpuopt.data.hdf5 import _is_jpeg_store

        _check_hdf5_options(hdf5)

        train = paths.get("train")
        check_arg(
            train is None or _is_jpeg_store(train),
            "train_dir",
            train,
            "a JPEG folder or a JPEG store (lightning-gpuopt convert --format jpeg) with backend='dali'",
            "read a raw store with backend='hdf5' (or 'auto'), or convert the JPEGs with --format jpeg",
        )
        _check_stores(
            paths,
            "a store file with backend='dali' on a JPEG store (its evaluation splits are read as stores)",
        )
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
    HDF5, folders -> the folder backend, splits of both kinds -> ``MixedBackend`` (each read by its kind).

    Example:
        >>> resolve_backend("auto", {"train": None}), resolve_backend("dali", {})
        (FolderBackend(), DALIBackend())
    """
    if backend == "dali" and _store_file(paths.get("train")):
        return DALIStoreBackend()
    if backend != "auto":
        return _BACKENDS[backend]()
    kinds = {k: ("hdf5" if _store_file(v) else "folder") for k, v in paths.items() if v is not None}
    if len(set(kinds.values())) > 1:
        return MixedBackend()
    return _BACKENDS[next(iter(kinds.values()), "folder")]()


def _store_file(path: str | None) -> bool:
    return path is not None and Path(path).is_file() and Path(path).suffix.lower() in _HDF5_SUFFIXES


def dali_installed() -> bool:
    """Whether ``nvidia.dali`` can be imported (looked up, not imported)."""
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except (ImportError, ValueError):  # no ``nvidia`` namespace package at all
        return False


def torchvision_installed() -> bool:
    """Whether ``torchvision`` can be imported (looked up, not imported)."""
    try:
        return importlib.util.find_spec("torchvision") is not None
    except (ImportError, ValueError):
        return False


def choose_backend(
    backend: str,
    paths: dict[str, str | None],
    *,
    on_corrupt: str = "raise",
    own_datasets: bool = False,
    decode: Any = None,
    num_workers: int | str = "auto",
) -> tuple[Backend, str | None]:
    """The backend ``OptimizedDataModule(backend=...)`` reads with, and why when ``"auto"`` chose it.

    ``"auto"`` on image folders chooses ``DALIBackend`` when this machine has a CUDA GPU and DALI is
    installed: DALI decodes the JPEGs on its CPU threads or with nvJPEG, whichever ``choose_decoder`` picks
    from rates measured on the run's files, straight into batches on the GPU, and crops from the original image as
    torchvision's ``RandomResizedCrop`` does. Else (no GPU, no DALI, ``on_corrupt="skip"``, which DALI cannot
    do, a ``<split>_dataset`` hook of the user's: ``own_datasets``, or a ``num_workers`` count above 0, which
    asks for DataLoader worker processes and DALI has none) the folder backend's worker processes.
    A store file is read by the HDF5 backend, except a JPEG store's training split on such a machine, which
    DALI decodes (``DALIStoreBackend``; ``backend="dali"`` asks for it on a JPEG store anywhere). On a CUDA
    machine without DALI, JPEG folders and JPEG stores with ``num_workers="auto"`` are decoded in the
    training process (``decode_backend``: nvJPEG or its CPU threads, settled at setup) where torchvision is
    installed. ``decode`` (a ``DecodeOptions``) asks for that decoding on any machine, with ``"auto"``,
    ``"folder"`` or ``"hdf5"``. An explicit name is taken as given (reason ``None``).

    Example:
        >>> choose_backend("auto", {"train": "data/train"})  # doctest: +SKIP
        (DALIBackend(), 'image folders, a CUDA GPU and DALI installed: DALI decodes them')
    """
    chosen = resolve_backend(backend, paths)
    if decode is not None:
        return _decoded(chosen, backend, paths.get("train"), decode, num_workers)
    if backend != "auto":
        return chosen, None
    if own_datasets:
        return chosen, "a <split>_dataset hook of yours gives the data"
    if isinstance(chosen, MixedBackend):
        return (
            chosen,
            "store files and image folders: each split is read by its kind, the folders by worker processes",
        )
    if not isinstance(chosen, FolderBackend):
        return _store_backend(chosen, paths.get("train"), num_workers)
    if on_corrupt != "raise":
        return chosen, f"on_corrupt={on_corrupt!r}: DALI cannot skip unreadable files"
    import torch

    if not torch.cuda.is_available():
        return chosen, "image folders, no CUDA GPU: worker processes decode them"
    if not dali_installed():
        return _without_dali(chosen, "image folders", "them", num_workers)
    if is_int(num_workers) and int(num_workers) > 0:
        return chosen, (
            f"num_workers={num_workers} asks for DataLoader worker processes, which decode the image folders; "
            "DALI has none (leave num_workers='auto' for DALI, whose threads DALIOptions(threads=...) sets)"
        )
    return DALIBackend(), "image folders, a CUDA GPU and DALI installed: DALI decodes them"


def _without_dali(chosen: Backend, what: str, them: str, num_workers: Any) -> tuple[Backend, str]:
    """``what`` on a CUDA machine without DALI: decoded in the training process where torchvision is
    installed and ``num_workers`` is ``"auto"``, else by worker processes."""
    dali = f"pip install 'lightning-gpuopt[dali]' decodes {them} with DALI instead"
    if num_workers != "auto":
        return chosen, f"{what}, num_workers={num_workers!r}: worker processes decode {them} ({dali})"
    if not torchvision_installed():
        return chosen, (
            f"{what}, worker processes decode {them}; neither DALI nor torchvision is installed (pip "
            f"install 'lightning-gpuopt[vision]' decodes {them} in the training process, with nvJPEG on the "
            f"GPU; {dali})"
        )
    from lightning_gpuopt.data.decode_backend import DecodedFolderBackend, DecodedStoreBackend

    decoded = DecodedFolderBackend() if isinstance(chosen, FolderBackend) else DecodedStoreBackend()
    return decoded, (
        f"{what}, a CUDA GPU, no DALI: the training process decodes {them}, with nvJPEG or on its CPU "
        f"threads as measured at setup ({dali})"
    )


def _decoded(
    chosen: Backend, backend: str, train: str | None, decode: Any, num_workers: Any
) -> tuple[Backend, str | None]:
    """The in-process decoding ``decode=DecodeOptions(...)`` asks for, on a folder or a JPEG store."""
    from lightning_gpuopt.data.decode_backend import (
        DecodedFolderBackend,
        DecodedStoreBackend,
        check_decode_options,
    )
    from lightning_gpuopt.data.hdf5 import _is_jpeg_store

    check_decode_options(decode)
    check_arg(
        num_workers == "auto", "num_workers", num_workers, "'auto' with decode=DecodeOptions(...): the training "
        "process decodes with threads, not worker processes", "set the threads with DecodeOptions(threads=...)",
    )  # fmt: skip
    why = None if backend != "auto" else "decode=DecodeOptions(...): the training process decodes the JPEGs"
    if isinstance(chosen, FolderBackend):
        return DecodedFolderBackend(decode), why
    check_arg(
        isinstance(chosen, HDF5Backend) and not isinstance(chosen, DALIStoreBackend)
        and (train is None or _is_jpeg_store(train)),
        "decode", decode, f"None with backend={backend!r} (it decodes JPEG folders and JPEG stores in the "
        "training process)", "use dali=DALIOptions(...) for DALI, or leave decode out",
    )  # fmt: skip
    return DecodedStoreBackend(decode), why


def _store_backend(chosen: Backend, train: str | None, num_workers: Any = "auto") -> tuple[Backend, str]:
    """A JPEG store's training split goes to DALI where a CUDA GPU and DALI are there; any other store (and
    a JPEG store elsewhere) to the HDF5 backend."""
    from lightning_gpuopt.data.hdf5 import _is_jpeg_store

    if train is None or not _is_jpeg_store(train):
        return chosen, "a store file"
    import torch

    if not torch.cuda.is_available():
        return chosen, "a JPEG store, no CUDA GPU: worker processes decode it"
    if not dali_installed():
        return _without_dali(chosen, "a JPEG store", "it", num_workers)
    return DALIStoreBackend(), (
        "a JPEG store, a CUDA GPU and DALI installed: DALI decodes its training batches, worker processes "
        "its evaluation splits"
    )


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
    """The DataModule's loader over a host dataset: shuffled whole batches that keep prefetching across
    epochs (``ContinuousDataLoader``, ``device_transform`` staging each batch on the GPU; ``None``: batch
    hooks of the user's see every batch, so nothing is staged) for training, one
    ordered pass (``HostDataLoader``) otherwise; persistent workers prefetching ``PREFETCH_FACTOR`` batches
    each, or ``threads`` reading a ``BatchReader`` dataset (then ``workers`` is 0)."""
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
