"""Backends: what ``backend=`` names, what each builds and how it describes its feed, and the DataModule
asking its backend rather than testing the name."""

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from lightning_gpuopt.data.backends import (
    BACKENDS,
    DALIBackend,
    FolderBackend,
    HDF5Backend,
    HostBackend,
    MixedBackend,
    dali_installed,
    host_loader,
    resolve_backend,
)
from lightning_gpuopt.data.choose import choose_backend
from lightning_gpuopt.data.datamodule import OptimizedDataModule
from lightning_gpuopt.data.folder import UInt8ImageFolder
from lightning_gpuopt.data.loader import PREFETCH_FACTOR, ContinuousDataLoader, HostDataLoader, close_workers

_FEED = {"batch_size": 4, "workers": 2, "threads": 0, "pin": False}


class _Images(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return np.full((6, 6, 3), i, np.uint8), i


def test_backend_names_resolve_to_objects(jpeg_folder, tmp_path):
    assert BACKENDS == ("auto", "folder", "hdf5", "dali")
    h5 = tmp_path / "train.h5"
    h5.write_bytes(b"")
    assert isinstance(resolve_backend("auto", {"train": str(jpeg_folder)}), FolderBackend)
    assert isinstance(resolve_backend("auto", {"train": str(h5), "val": None}), HDF5Backend)
    assert isinstance(resolve_backend("auto", {"train": None}), FolderBackend)  # the hooks give the data
    assert isinstance(resolve_backend("dali", {"train": str(jpeg_folder)}), DALIBackend)
    assert isinstance(resolve_backend("auto", {"train": str(h5), "val": str(jpeg_folder)}), MixedBackend)
    for name in ("folder", "dali"):
        dm = OptimizedDataModule(jpeg_folder, backend=name)
        assert dm.backend == name and isinstance(dm.backend, str)  # the documented string
    assert OptimizedDataModule(h5).backend == "hdf5"


@pytest.fixture
def machine(monkeypatch):
    """Say whether this machine has a CUDA GPU and DALI, for ``backend="auto"``."""
    import lightning_gpuopt.data.backends as backends

    def set_machine(cuda: bool, dali: bool) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(backends, "dali_installed", lambda: dali)

    return set_machine


def test_auto_reads_folders_with_dali_on_a_cuda_machine_that_has_it(jpeg_folder, machine, caplog):
    import logging

    machine(cuda=True, dali=True)
    with caplog.at_level(logging.INFO):
        dm = OptimizedDataModule(jpeg_folder)
    assert dm.backend == "dali" and "DALI installed" in dm.backend_reason
    said = [r.getMessage() for r in caplog.records if "backend='auto'" in r.getMessage()]
    assert said == ["OptimizedDataModule: backend='auto' -> 'dali' (image folders, a CUDA GPU and DALI "
                    "installed: DALI decodes them)"]
    # what DALI cannot do, or data the user's hooks give, keeps the folder backend
    assert OptimizedDataModule(jpeg_folder, on_corrupt="skip").backend == "folder"

    class Mine(OptimizedDataModule):
        def train_dataset(self):  # type: ignore[no-untyped-def]
            return _Images()

    mine = Mine(jpeg_folder)
    assert mine.backend == "folder" and "hook of yours" in mine.backend_reason
    assert OptimizedDataModule(jpeg_folder, backend="folder").backend_reason is None  # asked for: no reason


def test_auto_keeps_the_folder_backend_without_a_gpu_or_without_dali(jpeg_folder, machine, tmp_path):
    machine(cuda=True, dali=False)
    backend, why = choose_backend("auto", {"train": str(jpeg_folder)})
    assert isinstance(backend, FolderBackend) and "pip install 'lightning-gpuopt[dali]'" in why
    machine(cuda=False, dali=True)
    backend, why = choose_backend("auto", {"train": str(jpeg_folder)})
    assert isinstance(backend, FolderBackend) and "no CUDA GPU" in why
    h5 = tmp_path / "train.h5"
    h5.write_bytes(b"")
    machine(cuda=True, dali=True)
    assert isinstance(choose_backend("auto", {"train": str(h5)})[0], HDF5Backend)
    # a store and a folder: each split by its kind, the folder by worker processes (DALI reads folders only)
    mixed, why = choose_backend("auto", {"train": str(h5), "val": str(jpeg_folder)})
    assert isinstance(mixed, MixedBackend) and "each split is read by its kind" in why
    assert isinstance(dali_installed(), bool)


def test_each_backend_builds_and_describes_its_own_data(jpeg_folder):
    folder = FolderBackend().dataset(str(jpeg_folder), storage_size=18, on_corrupt="raise", skip_log=None)
    assert isinstance(folder, UInt8ImageFolder) and folder.size == 18
    info = FolderBackend().feed(folder, **_FEED)
    assert (info.backend, info.decoder, info.num_workers, info.threads) == ("folder", "cpu", 2, None)
    assert info.host_batches is True and info.batch_size == 4 and info.pin_memory is False
    # a dataset of the user's own: described by the loader alone
    for backend in (FolderBackend(), HDF5Backend()):
        own = backend.feed(_Images(), **{**_FEED, "workers": 0, "threads": 3})
        assert (own.backend, own.decoder, own.num_workers, own.threads) == (None, None, None, 3)
    assert DALIBackend().dataset(str(jpeg_folder), storage_size=18, on_corrupt="raise", skip_log=None) is None
    assert DALIBackend().device_batches and not FolderBackend().device_batches


def test_host_loader_trains_continuously_and_evaluates_in_order():
    kw = {"batch_size": 4, "workers": 1, "threads": 0, "pin": False, "device_transform": lambda b: b}
    train = host_loader(_Images(), "train", feed=FolderBackend().feed(_Images(), **_FEED), **kw)
    assert isinstance(train, ContinuousDataLoader) and train.drop_last
    assert train.persistent_workers and train.prefetch_factor == PREFETCH_FACTOR
    val = host_loader(_Images(), "val", feed=FolderBackend().feed(_Images(), **_FEED), **kw)
    assert type(val) is HostDataLoader and not val.drop_last
    _, labels, meta = next(iter(val))
    assert labels.tolist() == [0, 1, 2, 3] and meta.tolist() == [[6, 6, 0]] * 4  # whole images
    train.close()
    close_workers(val)


class _Recording(HostBackend):
    """A host backend that records what the DataModule asks of it."""

    name = "folder"

    def __init__(self):
        self.asked = []

    def dataset(self, path, *, storage_size, on_corrupt, skip_log):
        self.asked.append(("dataset", path))
        return _Images()

    def setup(self, dm, stage):
        self.asked.append(("setup", stage))
        super().setup(dm, stage)

    def loader(self, dm, split):
        self.asked.append(("loader", split))
        return super().loader(dm, split)


def test_the_datamodule_asks_its_backend(jpeg_folder):
    dm = OptimizedDataModule(jpeg_folder, batch_size=4, num_workers=0, image_size=6, storage_size=6)
    backend = dm._backend = _Recording()
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert backend.asked == [("setup", "fit"), ("dataset", str(jpeg_folder)), ("loader", "train")]
    assert len(list(loader)) == 2 and dm.val_dataloader() == []  # no val_dir: no validation
    batch = (torch.zeros(2, 3, 6, 6), torch.arange(2))
    dm._backend = DALIBackend()  # batches normalized on the device are passed through
    assert dm.on_after_batch_transfer(batch, 0) is batch
