import json
import os
import pickle
import re
import time
from unittest import mock

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import Dataset, RandomSampler, SequentialSampler

from lightning_gpuopt._common import available_cpus
from lightning_gpuopt.data import datamodule as datamodule_module
from lightning_gpuopt.data import tuning as tuning_module
from lightning_gpuopt.data.datamodule import MAX_WORKERS_PER_CPU, OptimizedDataModule
from lightning_gpuopt.data.folder import CorruptImageError, UInt8ImageFolder, UnreadableImagesError
from lightning_gpuopt.data.loader import (
    ContinuousDataLoader,
    HostDataLoader,
    WholeBatches,
)
from lightning_gpuopt.data.transforms import AugmentConfig
from lightning_gpuopt.data.tuning import TuningConfig
from tests._ddp import CloseProcessGroup
from tests._lightning import quiet_trainer


def _trainer(**kw):
    return quiet_trainer(**{"accelerator": "cpu", **kw})


class IndexDataset(Dataset):
    """uint8 images whose label is the sample's index (to check who saw what)."""

    def __init__(self, n=32, size=12, channels_first=False, dtype=np.uint8):
        self.n, self.size, self.channels_first, self.dtype = n, size, channels_first, dtype
        self.closed = 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        img = np.full((self.size, self.size, 3), i % 256, dtype=self.dtype)
        if self.channels_first:
            img = img.transpose(2, 0, 1)
        return img, i

    def close(self):
        self.closed += 1


class IndexData(OptimizedDataModule):
    def __init__(self, n=32, **kwargs):
        super().__init__(**kwargs)
        self.n = n

    def train_dataset(self):
        return IndexDataset(self.n)

    def val_dataset(self):
        return IndexDataset(self.n)


class PerImage(Dataset):
    """An image folder seen through ``__getitem__`` only (a user's map-style dataset: worker processes)."""

    def __init__(self, folder):
        self.folder = folder

    def __len__(self):
        return len(self.folder)

    def __getitem__(self, i):
        return self.folder[i]

    def fingerprint(self):
        return {**self.folder.fingerprint(), "class": type(self).__name__}


class PerImageData(OptimizedDataModule):
    """Each split's folder as a ``PerImage`` dataset, so ``num_workers="auto"`` measures worker processes."""

    def _default_dataset(self, split):
        folder = super()._default_dataset(split)
        return None if folder is None else PerImage(folder)


class IndexReader(IndexDataset):
    """The same samples, read a batch at a time by threads (a ``BatchReader``, as the HDF5 store is)."""

    image_shape = (12, 12, 3)

    def __getitem__(self, i):
        raise AssertionError("a BatchReader is read with read_into")

    def read_into(self, indices, images):
        idx = np.asarray(indices, dtype=np.int64)
        images[...] = (idx % 256).astype(np.uint8).reshape(-1, 1, 1, 1)
        return idx, np.tile(np.array([12, 12, 0], np.int32), (len(idx), 1))


class ReaderData(IndexData):
    def train_dataset(self):
        return IndexReader(self.n)

    def val_dataset(self):
        return IndexReader(self.n)


class Recorder(pl.LightningModule):
    """Records the labels and the batch layout it receives; writes them to ``out`` per rank."""

    def __init__(self, out=None, fail_at_step=None):
        super().__init__()
        self.layer = torch.nn.Conv2d(3, 2, 1)
        self.out, self.fail_at_step = out, fail_at_step
        self.train_labels, self.val_labels, self.layouts, self.skip_dirs = [], [], [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.skip_dirs.append(self.trainer.datamodule._skip_dir)
        if batch_idx == self.fail_at_step:
            raise RuntimeError("boom")
        self.layouts.append((tuple(x.shape), x.dtype, x.is_contiguous(memory_format=torch.channels_last)))
        self.train_labels += y.tolist()
        return self.layer(x).mean()

    def validation_step(self, batch, batch_idx):
        self.val_labels += batch[1].tolist()

    def test_step(self, batch, batch_idx):
        self.val_labels += batch[1].tolist()

    def on_fit_end(self):
        if self.out is not None:
            info = self.trainer.train_dataloader.feed_info
            path = f"{self.out}/rank{self.global_rank}.json"
            with open(path, "w") as fh:
                json.dump({"train": self.train_labels, "val": self.val_labels, "feed": info.to_dict()}, fh)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _folder(root, n, size=(10, 10)):
    for i in range(n):
        path = root / ("a" if i % 2 else "b") / f"{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((size[1], size[0], 3), i % 256, np.uint8)).save(path)
    return root


def test_argument_errors(tmp_path, jpeg_folder):
    with pytest.raises(FileNotFoundError, match=r"train_dir='.*nope'"):
        OptimizedDataModule(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="val_dir"):
        OptimizedDataModule(jpeg_folder, tmp_path / "missing")
    with pytest.raises(ValueError, match=r"^num_workers must be 'auto' or an int >= 0, got -1"):
        OptimizedDataModule(jpeg_folder, num_workers=-1)
    with pytest.raises(ValueError, match=r"^num_workers must be 'auto' or an int >= 0, got 'eight'"):
        OptimizedDataModule(jpeg_folder, num_workers="eight")
    with pytest.raises(ValueError, match=r"^backend must be one of"):
        OptimizedDataModule(jpeg_folder, backend="lmdb")
    with pytest.raises(ValueError, match=r"^storage_size must be an int >= image_size"):
        OptimizedDataModule(jpeg_folder, image_size=64, storage_size=32)
    with pytest.raises(ValueError, match=r"\[0, 1\] units"):
        OptimizedDataModule(jpeg_folder, mean=(124, 116, 104), std=(58, 57, 57))
    with pytest.raises(TypeError, match=r"^augment must be an AugmentConfig"):
        OptimizedDataModule(jpeg_folder, augment={"scale": (0.1, 1.0)})
    with pytest.raises(TypeError, match=r"^tuning must be None or TuningConfig"):
        OptimizedDataModule(jpeg_folder, tuning={"budget_s": 3})
    with pytest.raises(ValueError, match=r"^dali must be None unless backend='dali'"):
        OptimizedDataModule(jpeg_folder, dali=object())
    h5 = tmp_path / "train.h5"
    h5.write_bytes(b"")
    assert OptimizedDataModule(h5).backend == "hdf5"
    assert OptimizedDataModule(jpeg_folder).backend == "folder"
    assert OptimizedDataModule(h5, jpeg_folder).backend == "hdf5+folder"  # each split read by its kind
    with pytest.raises(ValueError, match=r"^train_dir must be a folder"):
        OptimizedDataModule(h5, backend="folder")
    dm = OptimizedDataModule(jpeg_folder, augment=False, tuning=TuningConfig(budget_s=3.0))
    assert dm.augment is None and dm.tuning.budget_s == 3.0
    assert OptimizedDataModule(jpeg_folder).augment == AugmentConfig()  # torchvision's defaults


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("image_size", "big"),
        ("image_size", 224.0),
        ("batch_size", "16"),
        ("batch_size", True),
        ("num_workers", 2.5),
        ("num_workers", False),
        ("storage_size", "256"),
        ("backend", 1),
        ("on_corrupt", None),
        ("check_images", "yes"),
    ],
)
def test_a_wrong_type_is_a_type_error(jpeg_folder, name, value):
    with pytest.raises(TypeError, match=rf"^{name} must be .*, got {re.escape(repr(value))}"):
        OptimizedDataModule(jpeg_folder, **{name: value})


def test_too_many_workers_are_refused_with_the_fix(jpeg_folder):
    cap = MAX_WORKERS_PER_CPU * available_cpus()
    with pytest.raises(
        ValueError, match=rf"^num_workers must be at most {MAX_WORKERS_PER_CPU} per CPU \({cap} .*'auto'"
    ):
        OptimizedDataModule(jpeg_folder, num_workers=10_000)
    assert OptimizedDataModule(jpeg_folder, num_workers=cap).num_workers == cap


def test_mean_given_by_name_is_a_type_error(jpeg_folder):
    with pytest.raises(TypeError, match=r"^mean must be a sequence of numbers.*mean=\(0\.485"):
        OptimizedDataModule(jpeg_folder, mean="imagenet")
    with pytest.raises(TypeError, match=r"^std must be a sequence of numbers"):
        OptimizedDataModule(jpeg_folder, std=0.5)


def test_dali_cannot_skip_corrupt_images(jpeg_folder):
    with pytest.raises(
        ValueError, match=r"^on_corrupt must be 'raise' with backend='dali'.*backend='folder'"
    ):
        OptimizedDataModule(jpeg_folder, backend="dali", on_corrupt="skip")


def test_dali_takes_dali_options(jpeg_folder):
    # no DALI import needed: the options are checked before any pipeline (or Trainer) exists
    from lightning_gpuopt.data.dali import DALIOptions

    with pytest.raises(TypeError, match=r"^dali must be None or a DALIOptions.*DALIOptions\(decoder='cpu'\)"):
        OptimizedDataModule(jpeg_folder, backend="dali", dali={"decoder": "cpu"})
    dm = OptimizedDataModule(jpeg_folder, backend="dali", dali=DALIOptions(decoder="cpu", threads=4))
    assert dm.dali == DALIOptions(decoder="cpu", threads=4)


def test_folder_errors_surface_in_setup(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no class subfolders"):
        OptimizedDataModule(tmp_path / "empty", num_workers=0).setup("fit")
    cls = tmp_path / "data" / "cat"
    cls.mkdir(parents=True)
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(cls / "a.png")
    (cls / "labels.txt").write_text("cat")  # skipped, as torchvision's ImageFolder skips it, with a warning
    with (
        pytest.warns(UserWarning, match=r"skipped 1 file\(s\) that are not images: 'cat/labels\.txt'"),
        pytest.raises(
            ValueError, match=r"^batch_size must be at most the 1 training samples.*lower batch_size"
        ),
    ):
        OptimizedDataModule(tmp_path / "data", batch_size=4, num_workers=0).setup("fit")
    (cls / "labels.txt").unlink()
    with pytest.raises(
        ValueError, match=r"^batch_size must be at most the 1 training samples.*lower batch_size"
    ):
        OptimizedDataModule(tmp_path / "data", batch_size=4, num_workers=0).setup("fit")


def test_no_train_data_errors():
    with pytest.raises(ValueError, match="train_dir= or override train_dataset"):
        OptimizedDataModule(num_workers=0).setup("fit")


def test_loaders_per_stage_describe_their_feed(jpeg_folder):
    dm = OptimizedDataModule(
        jpeg_folder, jpeg_folder, jpeg_folder, jpeg_folder, batch_size=8, num_workers=2, image_size=16
    )
    dm.trainer = _trainer()
    for stage in ("fit", "test", "predict"):
        dm.setup(stage)
    train = dm.train_dataloader()
    assert (
        isinstance(train, ContinuousDataLoader)
        and isinstance(train.sampler, RandomSampler)
        and train.drop_last
    )
    evaluation = (dm.val_dataloader(), dm.test_dataloader(), dm.predict_dataloader())
    for loader in (train, *evaluation):
        assert isinstance(loader, HostDataLoader)
        # the folder is read by two worker processes, a whole batch a call
        assert loader.read_threads == 0 and loader.num_workers == 2
        assert isinstance(loader.dataset, WholeBatches)
        assert isinstance(loader.dataset.dataset, UInt8ImageFolder)
        assert loader.pin_memory is False  # CPU trainer
        assert loader.batch_size == 8
        info = loader.feed_info
        assert (info.backend, info.num_workers, info.pin_memory, info.batch_size) == ("folder", 2, False, 8)
        assert info.threads is None and info.host_batches is True and info.decoder == "cpu"
        assert loader.fetch_seconds == 0.0
    for loader in evaluation:
        assert not isinstance(loader, ContinuousDataLoader)
        assert isinstance(loader.sampler, SequentialSampler) and not loader.drop_last
    x, y, meta = next(iter(dm.val_dataloader()))
    # storage size eval_resize_size(16) = 18: the 64x48 JPEGs are kept whole as 24x18 on an 18x27 canvas
    assert x.shape == (8, 18, 27, 3) and x.dtype == torch.uint8 and y.dtype == torch.int64
    assert meta.tolist() == [[18, 24, 0]] * 8

    forced = OptimizedDataModule(jpeg_folder, batch_size=8, num_workers=0, pin_memory=True)
    forced.setup("fit")
    loader = forced.train_dataloader()
    assert loader.pin_memory is True and loader.feed_info.pin_memory is True
    assert loader.persistent_workers is False and loader.prefetch_factor is None
    assert forced.val_dataloader() == []  # no validation data: Lightning skips validation


def test_fit_delivers_normalized_channels_last_pairs(jpeg_folder):
    dm = OptimizedDataModule(jpeg_folder, jpeg_folder, batch_size=8, num_workers=0, image_size=16)
    model = Recorder()
    trainer = _trainer(max_epochs=1, limit_train_batches=3, limit_val_batches=2, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm)
    assert model.layouts[0] == ((8, 3, 16, 16), torch.float32, True)
    assert len(model.train_labels) == 24 and len(model.val_labels) == 16
    assert trainer.train_dataloader.fetch_seconds > 0


def test_subclass_float_dataset_fails_naming_hook():
    class FloatData(OptimizedDataModule):
        def train_dataset(self):
            return IndexDataset(16, dtype=np.float32)

    with pytest.raises(TypeError, match=r"train_dataset\(\)"):
        _trainer(max_epochs=1).fit(
            Recorder(), datamodule=FloatData(batch_size=4, num_workers=0, image_size=8)
        )


@pytest.mark.parametrize(("data", "threads"), [(IndexData, None), (ReaderData, 2)])
def test_ddp_two_processes_see_each_sample_once(tmp_path, data, threads):
    """A dataset read by threads takes its thread count from ``HDF5Options``: ``num_workers`` counts
    DataLoader worker processes, which it has none of."""
    from lightning_gpuopt.data.hdf5 import HDF5Options

    hdf5 = HDF5Options(threads=threads) if threads else None
    dm = data(n=32, batch_size=4, num_workers=0, image_size=8, storage_size=12, hdf5=hdf5)
    assert pickle.loads(pickle.dumps(dm)).batch_size == 4  # what ddp_spawn / spawn workers need
    # spawn, not fork: a child forked from this pytest process deadlocks in libgomp once earlier tests have
    # run OpenMP-parallel convolutions here (seen: both ranks stuck in Conv2d.forward)
    trainer = _trainer(
        devices=2, strategy="ddp_spawn", max_epochs=1, num_sanity_val_steps=0, callbacks=[CloseProcessGroup()]
    )
    trainer.fit(Recorder(out=str(tmp_path)), datamodule=dm)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    train = ranks[0]["train"] + ranks[1]["train"]
    assert sorted(train) == list(range(32))  # each sample exactly once per epoch across both ranks
    assert len(ranks[0]["train"]) == len(ranks[1]["train"]) == 16
    assert sorted(ranks[0]["val"] + ranks[1]["val"]) == list(range(32))
    # the loader Lightning rebuilt with its DistributedSampler still describes its feed
    assert ranks[0]["feed"]["batch_size"] == 4 and ranks[0]["feed"]["host_batches"] is True
    if data is ReaderData:  # and still reads on its threads
        assert ranks[0]["feed"]["threads"] == 2 and ranks[0]["feed"]["num_workers"] is None


def test_an_hdf5_store_is_read_by_threads_of_the_training_process(jpeg_folder, tmp_path):
    import warnings

    from lightning_gpuopt.data.convert import convert_folder_to_hdf5
    from lightning_gpuopt.data.hdf5 import READ_THREADS

    store = tmp_path / "train.h5"
    convert_folder_to_hdf5(jpeg_folder, store, 18, workers=1, progress=False)
    dm = OptimizedDataModule(store, store, batch_size=8, num_workers="auto", image_size=16)
    model = Recorder()
    trainer = _trainer(max_epochs=2, num_sanity_val_steps=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=dm)
    assert not [str(w.message) for w in caught if "does not have many workers" in str(w.message)]
    threads = min(READ_THREADS, available_cpus())
    for loader in (trainer.train_dataloader, trainer.val_dataloaders):
        assert loader.read_threads == threads and loader.num_workers == 0
        info = loader.feed_info
        assert (info.backend, info.threads, info.num_workers) == ("hdf5", threads, None)
    assert isinstance(trainer.train_dataloader, ContinuousDataLoader)
    assert model.layouts[0] == ((8, 3, 16, 16), torch.float32, True)
    labels = sorted(dm._datasets["train"].labels.tolist()) if "train" in dm._datasets else None
    assert len(model.train_labels) == 2 * 48 and len(model.val_labels) == 2 * 48
    for epoch in range(2):  # every image once an epoch: the label counts of the store, each epoch
        got = model.train_labels[epoch * 48 : (epoch + 1) * 48]
        assert sorted(got) == sorted(model.val_labels[:48])
    assert labels is None  # teardown closed and dropped the datasets


def test_auto_num_workers_holds_the_resolved_count_after_setup(tmp_path):
    """``num_workers`` holds DataLoader worker processes: 0 for a dataset read by threads, whose threads
    are the loader's ``read_threads`` (``HDF5Options``), not ``num_workers``."""
    from lightning_gpuopt.data.hdf5 import READ_THREADS

    store = ReaderData(batch_size=4, num_workers="auto", image_size=12)  # a BatchReader, as an HDF5 store is
    store.setup("fit")
    assert store.num_workers == 0  # no worker processes
    assert store.train_dataloader().read_threads == min(READ_THREADS, available_cpus())  # its reading threads
    small = IndexData(n=8, batch_size=4, num_workers="auto", image_size=12)  # 2 batches: not measured
    small.setup("fit")
    assert small.num_workers == min(available_cpus(), 2)
    assert small.train_dataloader().num_workers == small.num_workers


def test_auto_workers_tuned_and_cached(jpeg_folder, tmp_path):
    kw = dict(
        batch_size=4, num_workers="auto", image_size=16, tuning=TuningConfig(budget_s=2.0, cache_dir=tmp_path)
    )
    dm = PerImageData(jpeg_folder, **kw)  # 48 images = 12 batches: measured
    dm.setup("fit")
    assert dm.num_workers in (1, 2)
    assert dm.tuning_result.table and not dm.tuning_result.cached
    assert (tmp_path / "workers.json").is_file()
    dm2 = PerImageData(jpeg_folder, **kw)
    dm2.setup("fit")
    assert dm2.tuning_result.cached and dm2.num_workers == dm.num_workers
    assert dm2.train_dataloader().num_workers == dm.num_workers


def test_auto_workers_skip_measuring_a_small_evaluation(tmp_path):
    root = _folder(tmp_path / "val", 75)
    dm = OptimizedDataModule(val_dir=root, batch_size=256, num_workers="auto", image_size=8)
    start = time.perf_counter()
    _trainer().validate(Recorder(), datamodule=dm)
    # a hang guard: measuring would take the whole 30 s budget (tuning_result None: nothing was measured)
    assert time.perf_counter() - start < 25
    assert dm.tuning_result is None
    assert dm.val_dataloader().num_workers == 0 and dm.val_dataloader().read_threads == 0  # one batch
    assert dm.num_workers == "auto"  # a later fit still measures its training data

    small = OptimizedDataModule(
        _folder(tmp_path / "small", 24), batch_size=4, num_workers="auto", image_size=8
    )
    small.setup("fit")  # 6 batches < MIN_TUNE_BATCHES
    assert small.tuning_result is None and small.num_workers == min(available_cpus(), 6)


def test_auto_workers_measured_once_per_dataset(jpeg_folder, tmp_path, monkeypatch):
    calls = []
    real = tuning_module.tune_num_workers

    def counting(*args, **kwargs):
        calls.append(kwargs.get("budget_s"))
        return real(*args, **kwargs)

    monkeypatch.setattr(tuning_module, "tune_num_workers", counting)
    tuning = TuningConfig(budget_s=1.0, cache_dir=tmp_path)
    dm = PerImageData(
        jpeg_folder, jpeg_folder, jpeg_folder, batch_size=4, num_workers="auto", image_size=8, tuning=tuning
    )
    trainer = _trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0)
    trainer.fit(Recorder(), datamodule=dm)
    trainer.validate(Recorder(), datamodule=dm)
    trainer.test(Recorder(), datamodule=dm)
    assert calls == [1.0]  # fit measured the training data; validation and test reuse its answer
    assert dm.test_dataloader().num_workers == dm.num_workers


class _Store(Dataset):
    """A store kept at ``storage_size`` (as HDF5ImageDataset exposes it), returning canvases."""

    def __init__(self, storage_size, n=8):
        self.storage_size, self.n = storage_size, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        canvas = np.zeros((self.storage_size, self.storage_size * 3 // 2, 3), np.uint8)
        return canvas, i, np.array([self.storage_size, self.storage_size, 0], np.int32)


def test_store_at_another_size_warns_or_refuses():
    class StoreData(OptimizedDataModule):
        def __init__(self, size, **kw):
            super().__init__(**kw)
            self.size = size

        def train_dataset(self):
            return _Store(self.size)

    dm = StoreData(64, batch_size=4, num_workers=0, image_size=48)  # eval_resize_size(48) = 55
    with pytest.warns(
        UserWarning, match=r"stored with its shorter side at 64 px.*Resize\(55\) \+ CenterCrop\(48\)"
    ):
        dm.setup("fit")
    images, _ = dm.on_after_batch_transfer(next(iter(dm.train_dataloader())), 0)
    assert images.shape == (4, 3, 48, 48)
    with pytest.raises(ValueError, match=r"storage size must be >= image_size \(48\).*--size 55"):
        StoreData(32, batch_size=4, num_workers=0, image_size=48).setup("fit")


def _jpegs_with_bad(root, n, bad):
    """``n`` JPEGs in two classes; those at the indices ``bad`` cut to half their bytes (truncated)."""
    for i in range(n):
        path = root / ("a" if i % 2 else "b") / f"{i}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((12, 16, 3), 10 * i % 256, np.uint8)).save(path, quality=90)
        if i in bad:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return root


def test_a_corrupt_jpeg_met_by_a_worker_ends_the_fit_with_one_line(tmp_path):
    """The worker's traceback stays out of the message: one line naming the file and the fix."""
    root = _jpegs_with_bad(tmp_path / "data", 16, bad={5})
    dm = OptimizedDataModule(root, batch_size=4, num_workers=2, image_size=8)
    with pytest.raises(CorruptImageError) as raised:
        _trainer(max_epochs=1).fit(Recorder(), datamodule=dm)
    message, bad = str(raised.value), str(root / "a" / "5.jpg")
    assert "\n" not in message and "Traceback" not in message, message
    assert message.startswith(f"cannot decode image {bad!r} (")
    assert f"`lightning-gpuopt check {root}` lists every unreadable image" in message
    assert "on_corrupt='skip'" in message
    assert raised.value.path == bad and raised.value.reason.startswith("OSError")


def test_check_images_lists_every_unreadable_image_in_setup(tmp_path):
    root = _jpegs_with_bad(tmp_path / "data", 16, bad={5, 10})
    dm = OptimizedDataModule(root, root, batch_size=4, num_workers=0, image_size=8, check_images=True)
    model = Recorder()
    with pytest.raises(UnreadableImagesError) as raised:
        _trainer(max_epochs=1).fit(model, datamodule=dm)
    assert model.train_labels == []  # before any training step
    message = str(raised.value)
    assert message.startswith(f"2 of 16 image(s) in {str(root)!r} cannot be decoded: 'a/5.jpg' (OSError: ")
    assert "'b/10.jpg' (OSError: " in message and "\n" not in message
    assert [e.path for e in raised.value.errors] == [str(root / "a" / "5.jpg"), str(root / "b" / "10.jpg")]
    skip = OptimizedDataModule(
        root, batch_size=4, num_workers=0, image_size=8, check_images=True, on_corrupt="skip"
    )
    with pytest.warns(UserWarning, match=r"check_images=True\): 2 of 16 image\(s\).*next readable image"):
        skip.setup("fit")
    skip.teardown("fit")


def test_corrupt_images_raise_or_skip(tmp_path):
    root = _folder(tmp_path / "data", 16)
    (root / "b" / "4.png").write_bytes(b"not an image")
    with pytest.raises(ValueError, match=r"4\.png"):
        _trainer(max_epochs=1).fit(
            Recorder(), datamodule=OptimizedDataModule(root, batch_size=4, num_workers=0, image_size=8)
        )

    dm = OptimizedDataModule(root, batch_size=4, num_workers=0, image_size=8, on_corrupt="skip")
    model = Recorder()
    with pytest.warns(UserWarning, match=r"skipped 2 unreadable image\(s\).*4\.png") as said:
        _trainer(max_epochs=2).fit(model, datamodule=dm)
    assert [w.filename for w in said if "unreadable" in str(w.message)] == [__file__]  # the user's fit line
    assert len(model.train_labels) == 32  # batches kept their size
    assert dm.num_skipped == 2 and all(p.endswith("4.png") for p in dm.skipped_images)
    assert model.skip_dirs[0] is not None and not os.path.exists(model.skip_dirs[0])  # removed at teardown


def test_skip_folder_removed_when_fit_raises(tmp_path):
    root = _folder(tmp_path / "data", 16)
    dm = OptimizedDataModule(root, batch_size=4, num_workers=0, image_size=8, on_corrupt="skip")
    model = Recorder(fail_at_step=1)
    with pytest.raises(RuntimeError, match="boom"):
        _trainer(max_epochs=1).fit(model, datamodule=dm)
    assert model.skip_dirs[0] is not None and not os.path.exists(model.skip_dirs[0])
    assert dm._skip_dir is None

    few = OptimizedDataModule(root, batch_size=64, num_workers=0, image_size=8, on_corrupt="skip")
    before = set(os.listdir(os.path.dirname(model.skip_dirs[0])))
    with pytest.raises(ValueError, match="batch_size"):
        few.setup("fit")  # fails after the skip folder was made
    assert few._skip_dir is None
    assert (
        not {
            n
            for n in os.listdir(os.path.dirname(model.skip_dirs[0]))
            if n.startswith("lightning_gpuopt_skipped_")
        }
        - before
    )


def test_teardown_closes_datasets_with_a_close_method():
    dm = IndexData(n=16, batch_size=4, num_workers=0, image_size=8, storage_size=12)
    trainer = _trainer(max_epochs=1, limit_val_batches=1, num_sanity_val_steps=0)
    datasets = []
    original = dm.train_dataset

    def recording():
        datasets.append(original())
        return datasets[-1]

    dm.train_dataset = recording
    trainer.fit(Recorder(), datamodule=dm)
    assert datasets and datasets[0].closed == 1  # e.g. the .h5 file the main process opened
    dm.setup("fit")  # a closed dataset is built afresh
    assert len(datasets) == 2


@pytest.mark.gpu
def test_cuda_fit_pins_stages_and_transforms_on_device(jpeg_folder):
    dm = OptimizedDataModule(jpeg_folder, batch_size=8, num_workers=2, image_size=16)
    model = Recorder()
    trainer = _trainer(accelerator="cuda", devices=1, max_steps=3, precision="16-mixed")
    trainer.fit(model, datamodule=dm)
    assert trainer.train_dataloader.pin_memory is True
    assert model.layouts[0] == ((8, 3, 16, 16), torch.float32, True)


def test_num_workers_for_a_store_read_by_threads_is_refused_with_the_option_to_use():
    """A raw store has no DataLoader worker processes: a count above 0 names ``HDF5Options`` instead of
    turning into reading threads; ``HDF5Options(threads=...)`` sets them, and the setup line says so."""
    from lightning_gpuopt.data.hdf5 import HDF5Options

    dm = ReaderData(batch_size=4, num_workers=3, image_size=12)
    with pytest.raises(
        ValueError, match=r"num_workers must be 'auto' or 0 for a raw HDF5 store.*HDF5Options\(threads=3\)"
    ):
        dm.setup("fit")
    lines = []
    dm = ReaderData(batch_size=4, num_workers=0, image_size=12, hdf5=HDF5Options(threads=3))
    dm.setup("fit")
    with mock.patch.object(datamodule_module, "rank_zero_info", lines.append):
        loader = dm.train_dataloader()
    assert loader.read_threads == 3 and loader.num_workers == 0
    assert len(lines) == 1 and lines[0].startswith(
        "OptimizedDataModule: train: IndexReader (a dataset of yours);"
    )
    assert "num_workers=0 (a raw store has none" in lines[0]
    assert "reading threads=3 (set by you: HDF5Options(threads=3))" in lines[0]
    assert "not staged: no CUDA device" in lines[0]
    with pytest.raises(TypeError, match="hdf5 must be None or an HDF5Options"):
        ReaderData(batch_size=4, hdf5=3)


def test_hdf5_options_with_folders_only_are_refused(jpeg_folder):
    from lightning_gpuopt.data.hdf5 import HDF5Options

    with pytest.raises(ValueError, match="hdf5 must be None where no split is a store"):
        OptimizedDataModule(jpeg_folder, backend="folder", hdf5=HDF5Options(threads=2))
