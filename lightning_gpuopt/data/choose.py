"""The backend an ``OptimizedDataModule`` reads with (``choose_backend``), its setup lines (``feed_line``)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from lightning_gpuopt._checks import check_arg, is_int
from lightning_gpuopt._common import available_cpus
from lightning_gpuopt.data import backends
from lightning_gpuopt.data.backends import (
    Backend,
    DALIBackend,
    DALIStoreBackend,
    FolderBackend,
    HDF5Backend,
    MixedBackend,
)
from lightning_gpuopt.data.loader import ContinuousDataLoader

#: Lightning's batch hooks a DataModule shares with the LightningModule: overridden, training does not stage.
TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


def choose_backend(
    backend: str,
    paths: dict[str, str | None],
    *,
    on_corrupt: str = "raise",
    own_datasets: bool = False,
    decode: Any = None,
    num_workers: int | str = "auto",
) -> tuple[Backend, str | None]:
    """The backend ``OptimizedDataModule(backend=...)`` reads with, and why ``"auto"`` chose it (None: a
    name given; docs/datamodule.md).

    Example:
        >>> choose_backend("auto", {"train": "data/train"})  # doctest: +SKIP
        (DALIBackend(), 'image folders, a CUDA GPU and DALI installed: DALI decodes them')
    """
    chosen = backends.resolve_backend(backend, paths)
    if decode is not None:
        return _decoded(chosen, backend, paths.get("train"), decode, num_workers)
    if backend != "auto":
        return chosen, None
    if own_datasets:
        return chosen, "a <split>_dataset hook of yours gives the data"
    if isinstance(chosen, MixedBackend):
        why = "store files and image folders: each split is read by its kind, the folders by worker processes"
        return chosen, why
    if not isinstance(chosen, FolderBackend):
        return _store_backend(chosen, paths.get("train"), num_workers)
    if on_corrupt != "raise":
        return chosen, f"on_corrupt={on_corrupt!r}: DALI cannot skip unreadable files"
    return _decoder(chosen, "image folders", "them", num_workers, DALIBackend(), "DALI decodes them")


def _decoder(
    chosen: Backend, what: str, them: str, num_workers: Any, dali: Backend, how: str
) -> tuple[Backend, str]:
    """JPEGs (``what``): DALI's ``dali`` on a CUDA machine with DALI installed, else who decodes ``them``."""
    if not torch.cuda.is_available():
        return chosen, f"{what}, no CUDA GPU: worker processes decode {them}"
    if backends.dali_installed():
        if is_int(num_workers) and num_workers and isinstance(chosen, FolderBackend):
            return chosen, (
                f"num_workers={num_workers} asks for DataLoader worker processes, which decode the image "
                "folders; DALI has none (leave num_workers='auto' for DALI, whose threads "
                "DALIOptions(threads=...) sets)"
            )
        return dali, f"{what}, a CUDA GPU and DALI installed: {how}"
    dali_fix = f"pip install 'lightning-gpuopt[dali]' decodes {them} with DALI instead"
    if num_workers != "auto":
        return chosen, f"{what}, num_workers={num_workers!r}: worker processes decode {them} ({dali_fix})"
    if not backends.torchvision_installed():
        return chosen, (
            f"{what}, worker processes decode {them}; neither DALI nor torchvision is installed (pip "
            f"install 'lightning-gpuopt[vision]' decodes {them} in the training process, with nvJPEG on the "
            f"GPU; {dali_fix})"
        )
    from lightning_gpuopt.data.decode_backend import DecodedFolderBackend, DecodedStoreBackend

    decoded = DecodedFolderBackend() if isinstance(chosen, FolderBackend) else DecodedStoreBackend()
    return decoded, (
        f"{what}, a CUDA GPU, no DALI: the training process decodes {them}, with nvJPEG or on its CPU "
        f"threads as measured at setup ({dali_fix})"
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
    must = "'auto' with decode=DecodeOptions(...): the training process decodes with threads, not worker "
    must += "processes"
    fix = "set the threads with DecodeOptions(threads=...)"
    check_arg(num_workers == "auto", "num_workers", num_workers, must, fix)
    why = None if backend != "auto" else "decode=DecodeOptions(...): the training process decodes the JPEGs"
    if isinstance(chosen, FolderBackend):
        return DecodedFolderBackend(decode), why
    store = isinstance(chosen, HDF5Backend) and not isinstance(chosen, DALIStoreBackend)
    must = f"None with backend={backend!r} (it decodes JPEG folders and JPEG stores in the training process)"
    fix = "use dali=DALIOptions(...) for DALI, or leave decode out"
    check_arg(store and (train is None or _is_jpeg_store(train)), "decode", decode, must, fix)
    return DecodedStoreBackend(decode), why


def _store_backend(chosen: Backend, train: str | None, num_workers: Any = "auto") -> tuple[Backend, str]:
    """DALI for a JPEG store's training split on a CUDA machine with DALI, else the HDF5 backend."""
    from lightning_gpuopt.data.hdf5 import _is_jpeg_store

    if train is None or not _is_jpeg_store(train):
        return chosen, "a store file"
    how = "DALI decodes its training batches, worker processes its evaluation splits"
    return _decoder(chosen, "a JPEG store", "it", num_workers, DALIStoreBackend(), how)


def overridden_batch_hooks(dm: pl.LightningDataModule, base: type) -> list[str]:
    """The ``TRANSFER_HOOKS`` of ``dm`` (or its LightningModule) not ``base``'s, as ``"Class.hook"``."""
    found = [
        f"{type(dm).__name__}.{h}" for h in TRANSFER_HOOKS if getattr(type(dm), h) is not getattr(base, h)
    ]
    model = dm.trainer.lightning_module if dm.trainer is not None else None
    if model is None:
        return found
    for hook in TRANSFER_HOOKS:
        left = getattr(type(dm), hook) is getattr(pl.LightningDataModule, hook)
        if left and getattr(type(model), hook) is not getattr(pl.LightningModule, hook):
            found.append(f"{type(model).__name__}.{hook}")
    return found


def _staging(loader: Any, hooks: list[str]) -> str:
    """Whether the training ``loader`` stages its batches on the GPU, and why not where it does not."""
    if not isinstance(loader, ContinuousDataLoader):
        return "not staged (not this package's training loader)"
    if loader.device_transform is None:
        return f"not staged: {', '.join(hooks)} overridden, so Lightning's batch hooks see each host batch"
    if not (loader.pin_memory and torch.cuda.is_available()):
        return "not staged: no CUDA device (Lightning's batch hooks see each host batch)"
    return "staged on the GPU ahead of each step (copied and augmented on a side stream)"


def feed_line(
    split: str, loader: Any, how: dict[str, str], *, hooks: list[str], dali: Any, processes: int
) -> str | None:
    """The setup line of ``split``'s ``loader`` (what reads it, each count and ``how`` it was chosen, whether
    training batches are staged); ``None`` for a loader without ``feed_info``."""
    info = getattr(loader, "feed_info", None)
    if info is None:
        return None
    if info.host_batches is False:  # DALI: decoded on its threads or by nvJPEG, made on the device
        cpus = max(1, available_cpus() // max(1, processes))
        threads = f"chosen from {cpus} cores a process, not measured"
        if dali is not None and dali.threads:
            threads = "set by you: DALIOptions(threads=...)"
        parts = [
            f"DALI, decoder={info.decoder!r} ({getattr(info, 'decoder_reason', None) or 'set'})",
            f"threads={info.threads} ({threads})",
            "no DataLoader worker processes; batches made on the device",
        ]
    else:
        dataset = getattr(loader, "dataset", None)
        source = {"folder": "image folder", "hdf5": "HDF5 store"}.get(info.backend or "", "")
        parts = [
            source or f"{type(dataset).__name__} (a dataset of yours)",
            f"num_workers={getattr(loader, 'num_workers', 0)} ({how.get('num_workers', 'set')})",
        ]
        if getattr(loader, "read_threads", 0):
            parts.append(f"reading threads={loader.read_threads} ({how.get('threads', 'set')})")
        if split == "train":
            parts.append(_staging(loader, hooks))
    return f"OptimizedDataModule: {split}: " + "; ".join(parts)
