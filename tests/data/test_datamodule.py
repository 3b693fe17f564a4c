import json
import pickle

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import Dataset, RandomSampler, SequentialSampler

from lightning_gpuopt.data.datamodule import OptimizedDataModule, UInt8Collate
from tests._ddp import CloseProcessGroup


def _trainer(**kw):
    args = dict(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    args.update(kw)
    return pl.Trainer(**args)


class IndexDataset(Dataset):
    """uint8 images whose label is the sample's index (to check who saw what)."""

    def __init__(self, n=32, size=12, channels_first=False, dtype=np.uint8):
        self.n, self.size, self.channels_first, self.dtype = n, size, channels_first, dtype

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        img = np.full((self.size, self.size, 3), i % 256, dtype=self.dtype)
        if self.channels_first:
            img = img.transpose(2, 0, 1)
        return img, i


class IndexData(OptimizedDataModule):
    def __init__(self, n=32, **kwargs):
        super().__init__(**kwargs)
        self.n = n

    def train_dataset(self):
        return IndexDataset(self.n)

    def val_dataset(self):
        return IndexDataset(self.n)


class Recorder(pl.LightningModule):
    """Records the labels and the batch layout it receives; writes them to ``out`` per rank."""

    def __init__(self, out=None):
        super().__init__()
        self.layer = torch.nn.Conv2d(3, 2, 1)
        self.out = out
        self.train_labels, self.val_labels, self.layouts = [], [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.layouts.append((tuple(x.shape), x.dtype, x.is_contiguous(memory_format=torch.channels_last)))
        self.train_labels += y.tolist()
        return self.layer(x).mean()

    def validation_step(self, batch, batch_idx):
        self.val_labels += batch[1].tolist()

    def on_fit_end(self):
        if self.out is not None:
            path = f"{self.out}/rank{self.global_rank}.json"
            with open(path, "w") as fh:
                json.dump({"train": self.train_labels, "val": self.val_labels}, fh)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_argument_errors(tmp_path, jpeg_folder):
    with pytest.raises(FileNotFoundError, match=r"train_dir='.*nope'"):
        OptimizedDataModule(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="val_dir"):
        OptimizedDataModule(jpeg_folder, tmp_path / "missing")
    with pytest.raises(ValueError, match="num_workers"):
        OptimizedDataModule(jpeg_folder, num_workers=-1)
    with pytest.raises(ValueError, match="backend"):
        OptimizedDataModule(jpeg_folder, backend="lmdb")
    with pytest.raises(ValueError, match="storage_size"):
        OptimizedDataModule(jpeg_folder, image_size=64, storage_size=32)
    with pytest.raises(ValueError, match=r"\[0, 1\] units"):
        OptimizedDataModule(jpeg_folder, mean=(124, 116, 104), std=(58, 57, 57))
    h5 = tmp_path / "train.h5"
    h5.write_bytes(b"")
    assert OptimizedDataModule(h5).backend == "hdf5"
    assert OptimizedDataModule(jpeg_folder).backend == "folder"
    with pytest.raises(ValueError, match="both HDF5 files and folders"):
        OptimizedDataModule(h5, jpeg_folder)
    with pytest.raises(ValueError, match="is a file"):
        OptimizedDataModule(h5, backend="folder")


def test_folder_errors_surface_in_setup(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no class subfolders"):
        OptimizedDataModule(tmp_path / "empty", num_workers=0).setup("fit")
    cls = tmp_path / "data" / "cat"
    cls.mkdir(parents=True)
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(cls / "a.png")
    (cls / "labels.txt").write_text("cat")
    with pytest.raises(ValueError, match=r"labels\.txt"):
        OptimizedDataModule(tmp_path / "data", num_workers=0).setup("fit")
    (cls / "labels.txt").unlink()
    with pytest.raises(ValueError, match="fewer than batch_size"):
        OptimizedDataModule(tmp_path / "data", batch_size=4, num_workers=0).setup("fit")


def test_no_train_data_errors():
    with pytest.raises(ValueError, match="train_dir= or override train_dataset"):
        OptimizedDataModule(num_workers=0).setup("fit")


def test_loaders_per_stage(jpeg_folder):
    dm = OptimizedDataModule(
        jpeg_folder,
        jpeg_folder,
        jpeg_folder,
        jpeg_folder,
        batch_size=8,
        num_workers=2,
        image_size=16,
        prefetch_factor=3,
    )
    dm.trainer = _trainer()
    dm.setup("fit")
    dm.setup("test")
    dm.setup("predict")
    train = dm.train_dataloader()
    assert isinstance(train.sampler, RandomSampler) and train.drop_last
    for loader in (train, dm.val_dataloader(), dm.test_dataloader(), dm.predict_dataloader()):
        assert loader.num_workers == 2 and loader.persistent_workers and loader.prefetch_factor == 3
        assert loader.pin_memory is False  # CPU trainer
        assert loader.batch_size == 8
        assert isinstance(loader.collate_fn, UInt8Collate)
    for loader in (dm.val_dataloader(), dm.test_dataloader(), dm.predict_dataloader()):
        assert isinstance(loader.sampler, SequentialSampler) and not loader.drop_last
    x, y = next(iter(dm.val_dataloader()))
    assert (
        x.shape == (8, 18, 18, 3) and x.dtype == torch.uint8 and y.dtype == torch.int64
    )  # storage 16*256/224

    forced = OptimizedDataModule(jpeg_folder, batch_size=8, num_workers=0, pin_memory=True)
    forced.setup("fit")
    loader = forced.train_dataloader()
    assert loader.pin_memory is True
    assert loader.persistent_workers is False and loader.prefetch_factor is None
    assert forced.val_dataloader() == []  # no validation data: Lightning skips validation


def test_collate_fast_path_and_errors():
    collate = UInt8Collate("train_dataset()")
    batch = [(np.full((4, 5, 3), i, np.uint8), i) for i in range(3)]
    x, y = collate(batch)
    assert x.shape == (3, 4, 5, 3) and x.dtype == torch.uint8 and (x[2] == 2).all()
    assert y.tolist() == [0, 1, 2] and y.dtype == torch.int64
    xt, _ = collate([(torch.from_numpy(a), torch.tensor(lab)) for a, lab in batch])
    assert torch.equal(xt, x)
    with pytest.raises(TypeError, match=r"train_dataset\(\).*float32"):
        collate([(np.zeros((4, 4, 3), np.float32), 0)])
    with pytest.raises(TypeError, match="looks like CHW"):
        collate([(np.zeros((3, 8, 8), np.uint8), 0)])
    with pytest.raises(TypeError, match="fixed size"):
        collate([(np.zeros((4, 4, 3), np.uint8), 0), (np.zeros((5, 4, 3), np.uint8), 1)])


def test_fit_delivers_normalized_channels_last(jpeg_folder):
    dm = OptimizedDataModule(jpeg_folder, jpeg_folder, batch_size=8, num_workers=0, image_size=16)
    model = Recorder()
    _trainer(max_epochs=1, limit_train_batches=3, limit_val_batches=2, num_sanity_val_steps=0).fit(
        model, datamodule=dm
    )
    assert model.layouts[0] == ((8, 3, 16, 16), torch.float32, True)
    assert len(model.train_labels) == 24 and len(model.val_labels) == 16


def test_subclass_float_dataset_fails_naming_hook():
    class FloatData(OptimizedDataModule):
        def train_dataset(self):
            return IndexDataset(16, dtype=np.float32)

    with pytest.raises(TypeError, match=r"train_dataset\(\)"):
        _trainer(max_epochs=1).fit(
            Recorder(), datamodule=FloatData(batch_size=4, num_workers=0, image_size=8)
        )


def test_ddp_two_processes_see_each_sample_once(tmp_path):
    dm = IndexData(n=32, batch_size=4, num_workers=0, image_size=8, storage_size=12)
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


def test_auto_workers_tuned_and_cached(jpeg_folder, tmp_path):
    kw = dict(batch_size=8, num_workers="auto", image_size=16, tune_budget_s=2.0, tune_cache_dir=tmp_path)
    dm = OptimizedDataModule(jpeg_folder, **kw)
    dm.setup("fit")
    assert dm.num_workers in (1, 2)
    assert dm.tuning_result.table and not dm.tuning_result.cached
    assert (tmp_path / "workers.json").is_file()
    dm2 = OptimizedDataModule(jpeg_folder, **kw)
    dm2.setup("fit")
    assert dm2.tuning_result.cached and dm2.num_workers == dm.num_workers
    assert dm2.train_dataloader().num_workers == dm.num_workers


def test_corrupt_images_raise_or_skip(tmp_path):
    root = tmp_path / "data"
    for c in ("a", "b"):
        for i in range(8):
            (root / c).mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((10, 10, 3), 20 * i, np.uint8)).save(root / c / f"{i}.png")
    (root / "b" / "5.png").write_bytes(b"not an image")
    with pytest.raises(ValueError, match=r"5\.png"):
        _trainer(max_epochs=1).fit(
            Recorder(), datamodule=OptimizedDataModule(root, batch_size=4, num_workers=0, image_size=8)
        )

    dm = OptimizedDataModule(
        root,
        batch_size=4,
        num_workers=1,
        image_size=8,
        on_corrupt="skip",
        persistent_workers=False,
        continuous_epochs=False,  # exact count: no batches prefetched into a third epoch
    )
    model = Recorder()
    with pytest.warns(UserWarning, match=r"skipped 2 unreadable image\(s\).*5\.png"):
        _trainer(max_epochs=2).fit(model, datamodule=dm)
    assert len(model.train_labels) == 32  # batches kept their size
    assert dm.num_skipped == 2 and all(p.endswith("5.png") for p in dm.skipped_images)


@pytest.mark.gpu
def test_cuda_fit_pins_and_transforms_on_device(jpeg_folder):
    dm = OptimizedDataModule(
        jpeg_folder, batch_size=8, num_workers=2, image_size=16, output_dtype=torch.float16
    )
    model = Recorder()
    trainer = _trainer(accelerator="cuda", devices=1, max_steps=3, precision="16-mixed")
    trainer.fit(model, datamodule=dm)
    assert trainer.train_dataloader.pin_memory is True
    assert model.layouts[0] == ((8, 3, 16, 16), torch.float16, True)


def test_dali_kwargs_are_checked_when_the_datamodule_is_made(jpeg_folder):
    # no DALI import needed: the keys and values are refused before any pipeline (or Trainer) exists
    def make(kw):
        return OptimizedDataModule(train_dir=jpeg_folder, backend="dali", dali_kwargs=kw)

    with pytest.raises(TypeError, match=r"unknown dali_kwargs key\(s\) \['decodr'\]"):
        make({"decodr": "cpu"})
    with pytest.raises(ValueError, match="dali_kwargs: decoder must be one of"):
        make({"decoder": "nvjpeg"})
    with pytest.raises(ValueError, match="dali_kwargs: hw_decoder_load"):
        make({"hw_decoder_load": 2})
    with pytest.raises(ValueError, match="dali_kwargs: worker_nice"):
        make({"worker_nice": -3})
    dm = make({"decoder": "cpu", "num_threads": 4, "worker_nice": 5, "last_batch_policy": "fill"})
    assert dm.dali_kwargs["decoder"] == "cpu"
