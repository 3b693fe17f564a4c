"""The folder and JPEG-store backends that decode in the training process (``data.decode``, docs/datamodule.md):
``setup("fit")`` settles the decoder; nvJPEG's training split gets an ``NVJPEGLoader``, the rest the host's."""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from lightning_gpuopt._checks import check_arg
from lightning_gpuopt._common import FeedInfo
from lightning_gpuopt.data.backends import FolderBackend, HDF5Backend, HostBackend, Owner
from lightning_gpuopt.data.decode import (
    DecodeOptions,
    ThreadDecodedFolder,
    ThreadDecodedStore,
    default_decode_threads,
    root_device,
)
from lightning_gpuopt.data.decode_choice import DecodeChoice, resolve_decoder

__all__ = ["DecodedFolderBackend", "DecodedHostBackend", "DecodedStoreBackend", "check_decode_options"]


def check_decode_options(decode: Any) -> None:
    """``TypeError`` unless ``decode`` is ``None`` or a ``DecodeOptions``."""
    check_arg(
        decode is None or isinstance(decode, DecodeOptions), "decode", decode, "None or a DecodeOptions",
        "e.g. decode=DecodeOptions(decoder='cpu')", error=TypeError,
    )  # fmt: skip


class DecodedHostBackend(HostBackend):
    """What both in-process backends share: ``decode``, the ``choice`` settled at ``setup("fit")`` and an
    ``NVJPEGLoader`` for nvJPEG's training split (else the host backends' loader).

    Example:
        >>> DecodedFolderBackend(DecodeOptions(decoder="cpu")).decode
        DecodeOptions(decoder='cpu', threads=None)
    """

    def __init__(self, decode: DecodeOptions | None = None) -> None:
        check_decode_options(decode)
        self.decode = decode or DecodeOptions()
        self.choice: DecodeChoice | None = None

    def _threads(self) -> int:
        return self.decode.threads or default_decode_threads("cpu")

    def setup(self, dm: Owner, stage: str) -> None:
        super().setup(dm, stage)
        train = dm._dataset("train") if stage == "fit" else None
        if self.choice is None and isinstance(train, (ThreadDecodedFolder, ThreadDecodedStore)):
            self.choice = _settled(dm, self.decode, train)
        resolved = getattr(dm, "_resolved", None)
        if self.choice is not None and self.choice.decoder == "gpu" and callable(resolved):
            resolved("train", self.choice.threads)  # dm.num_workers: the nvJPEG loader's reading threads

    def loader(self, dm: Owner, split: str) -> Any:
        dataset = dm._dataset(split) if split == "train" else None
        if self.choice is None or self.choice.decoder != "gpu" or not hasattr(dataset, "jpeg_bytes"):
            return super().loader(dm, split)
        import warnings

        from lightning_gpuopt.data.decode_gpu import NVJPEGCrops, NVJPEGLoader

        # Lightning's "does not have many workers": threads of this process read this loader
        warnings.filterwarnings("ignore", message="The 'train_dataloader' does not have many workers")
        owner: Any = dm  # the DataModule: its crop settings, and the seed it drew for this training loader
        crops = NVJPEGCrops(owner.image_size, owner.augment, owner.mean, owner.std, seed=owner._stage_seed)
        return NVJPEGLoader(
            dataset, batch_size=dm.batch_size, shuffle=True, drop_last=True, pin_memory=True,
            reader_threads=self.choice.threads, device_transform=crops,
            feed_info=FeedInfo(backend=self.name, pin_memory=True, batch_size=dm.batch_size,
                               host_batches=False, decoder="gpu", threads=self.choice.threads),
        )  # fmt: skip

    def feed(self, dataset: Any, *, batch_size: int, workers: int, threads: int, pin: bool) -> FeedInfo:
        info = super().feed(dataset, batch_size=batch_size, workers=workers, threads=threads, pin=pin)
        if isinstance(dataset, (ThreadDecodedFolder, ThreadDecodedStore)):
            info.backend, info.decoder = self.name, "cpu"
        return info

    def __repr__(self) -> str:
        return f"{type(self).__name__}(decode={self.decode})"


def _settled(dm: Any, options: DecodeOptions, train: Any) -> DecodeChoice:
    """``resolve_decoder`` for ``dm``'s training split; under DDP the choice of the node's local rank zero."""
    from lightning_gpuopt.data.tuning import _node_best

    trainer = dm.trainer
    tuning = getattr(dm, "tuning", None)
    local = dm._local_world_size()
    if getattr(dm, "on_corrupt", "raise") == "skip":  # nvJPEG's batches cannot skip an image
        threads = options.threads or default_decode_threads("cpu", local)
        return DecodeChoice("cpu", threads, "on_corrupt='skip': the CPU threads skip unreadable images")
    choice = resolve_decoder(
        options, train, device=root_device(trainer), image_size=dm.image_size, batch_size=dm.batch_size,
        local_world_size=local, model_rate=getattr(tuning, "target_samples_per_sec", None),
    )  # fmt: skip
    agreed = "gpu" if _node_best(trainer, int(choice.decoder == "gpu")) else "cpu"
    if agreed != choice.decoder:
        choice = DecodeChoice(agreed, options.threads or default_decode_threads(agreed, local),
                              "the choice of this node's local rank zero", choice.measured)  # fmt: skip
    return choice


class DecodedFolderBackend(DecodedHostBackend, FolderBackend):
    """Class-per-subfolder image folders decoded in the training process (``ThreadDecodedFolder``).

    Example:
        >>> DecodedFolderBackend().name
        'folder'
    """

    def dataset(
        self, path: str, *, storage_size: int, on_corrupt: str, skip_log: str | None
    ) -> Dataset | None:
        return ThreadDecodedFolder(path, storage_size, on_corrupt, skip_log, threads=self._threads())


class DecodedStoreBackend(DecodedHostBackend, HDF5Backend):
    """A compact JPEG store decoded in the training process (``ThreadDecodedStore``); raw stores as usual.

    Example:
        >>> DecodedStoreBackend().name
        'hdf5'
    """

    def dataset(
        self, path: str, *, storage_size: int, on_corrupt: str, skip_log: str | None
    ) -> Dataset | None:
        from lightning_gpuopt.data.hdf5 import _is_jpeg_store

        if not _is_jpeg_store(path):
            return super().dataset(path, storage_size=storage_size, on_corrupt=on_corrupt, skip_log=skip_log)
        return ThreadDecodedStore(path, threads=self._threads())
