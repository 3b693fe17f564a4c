"""The JPEG store through DALI (``dali_store``): the source's epochs and shards, the bytes it reads, the
training crops against torchvision's ``RandomResizedCrop`` over the stored image, resuming, and the
DataModule choosing and using it. DALI runs CPU pipelines here."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

pytest.importorskip("h5py")

from lightning_gpuopt.data import backends
from lightning_gpuopt.data.choose import choose_backend
from lightning_gpuopt.data.convert import convert_folder_to_hdf5
from lightning_gpuopt.data.dali import DALIOptions
from lightning_gpuopt.data.dali_store import DALIStoreLoader, StoreBatches
from lightning_gpuopt.data.datamodule import OptimizedDataModule
from lightning_gpuopt.data.hdf5 import HDF5ImageDataset
from lightning_gpuopt.data.loader import StagedBatch
from tests._lightning import quiet_trainer
from tests.data._images import coordinate_rgb, natural, save, tv_rrc_params


class _Info:
    def __init__(self, iteration: int, epoch_idx: int) -> None:
        self.iteration, self.epoch_idx = iteration, epoch_idx


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("dali_store")
    for i in range(36):
        w, h = (64, 48) if i % 3 else (48, 64)
        path = root / "src" / f"c{i % 4}" / f"{i}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        natural(w, h, seed=i).save(path, quality=90)
    out = root / "train_jpeg.h5"
    convert_folder_to_hdf5(root / "src", out, 48, workers=1, progress=False, format="jpeg")
    return HDF5ImageDataset(out)


def _batches(store, **kw) -> StoreBatches:
    starts, lengths = store.byte_ranges()
    return StoreBatches(store.path, starts, lengths, store.labels, **kw)


def test_byte_ranges_are_each_images_jpeg(store):
    starts, lengths = store.byte_ranges()
    with open(store.path, "rb") as fh:
        blob = fh.read()
    for i in (0, 7, len(store) - 1):
        data = blob[starts[i] : starts[i] + lengths[i]]
        assert data[:2] == b"\xff\xd8" and data[-2:] == b"\xff\xd9"  # a whole JPEG
        assert data == store._bytes(store._reader().fileno(), i)


def test_an_epoch_is_shared_by_the_ranks_in_disjoint_whole_batches(store):
    ranks = [_batches(store, batch_size=4, shard_id=r, num_shards=2) for r in range(2)]
    assert [r.batches for r in ranks] == [4, 4]  # 36 images, 18 a rank: 4 whole batches of 4
    orders = [r.order(0) for r in ranks]
    assert all(o.size == 16 for o in orders)
    assert not set(orders[0]) & set(orders[1])
    assert set(ranks[0].order(1)) != set(orders[0]) or not np.array_equal(ranks[0].order(1), orders[0])
    try:
        got = [ranks[0](_Info(i, 0)) for i in range(4)]
        labels = np.concatenate([y[:, 0] for _, y in got])
        np.testing.assert_array_equal(labels, store.labels[orders[0]])
        images, _ = got[1]
        starts, lengths = store.byte_ranges()
        with open(store.path, "rb") as fh:
            blob = fh.read()
        for k, i in enumerate(orders[0][4:8]):
            assert images[k].tobytes() == blob[starts[i] : starts[i] + lengths[i]]
        with pytest.raises(StopIteration):
            ranks[0](_Info(4, 0))
        # the next epoch starts at its own first batch, already read ahead
        np.testing.assert_array_equal(ranks[0](_Info(0, 1))[1][:, 0], store.labels[ranks[0].order(1)[:4]])
    finally:
        for r in ranks:
            r.close()


def test_a_resumed_source_continues_the_same_stream(store):
    whole = _batches(store, batch_size=4)
    resumed = _batches(store, batch_size=4, first_epoch=2, skip=3)
    try:
        expected = [whole(_Info(i, 2))[1] for i in range(3, whole.batches)] + [whole(_Info(0, 3))[1]]
        got = [resumed(_Info(i, 0))[1] for i in range(whole.batches - 3)] + [resumed(_Info(0, 1))[1]]
        for a, b in zip(got, expected, strict=True):
            np.testing.assert_array_equal(a, b)
        with pytest.raises(StopIteration):
            resumed(_Info(whole.batches - 3, 0))
    finally:
        whole.close()
        resumed.close()


def test_too_large_a_batch_is_named(store):
    with pytest.raises(ValueError, match="batch_size"):
        _batches(store, batch_size=64)


pytest.importorskip("nvidia.dali")


def _loader(store, **kw) -> DALIStoreLoader:
    kw.setdefault("options", DALIOptions(threads=2))
    return DALIStoreLoader(store, batch_size=4, image_size=32, device="cpu", **kw)


def test_epochs_yield_each_ranks_order_as_staged_channels_last_batches(store):
    loader = _loader(store)
    assert len(loader) == 9
    # the decoders are measured on the store's own JPEGs: what the rule and the advisor weigh
    _, lengths = store.byte_ranges()
    sample = loader._sample_jpegs()
    assert len(sample) == len(store) and sample[0][:2] == b"\xff\xd8" and len(sample[0]) == lengths[0]
    order = StoreBatches(store.path, *store.byte_ranges(), store.labels, batch_size=4, seed=42)
    for epoch in range(2):
        batches = list(loader)
        assert len(batches) == 9 and all(isinstance(b, StagedBatch) for b in batches)
        labels = torch.cat([y for _, y in batches]).numpy()
        np.testing.assert_array_equal(labels, store.labels[order.order(epoch)])
        x = batches[0][0]
        assert x.shape == (4, 3, 32, 32) and x.dtype == torch.float32
        assert x.is_contiguous(memory_format=torch.channels_last)
        assert -3 < float(x.mean()) < 3  # normalized
    loader.close()


def test_state_dict_resumes_the_sample_order(store):
    first = _loader(store)
    seen = [y for _, y in first]  # an epoch of 9
    it = iter(first)
    seen += [next(it)[1] for _ in range(2)]  # and two batches of the next
    state = first.state_dict()
    assert state == {"epoch": 1, "position": 2, "yielded": 2, "num_shards": 1}
    rest = [next(it)[1] for _ in range(3)]
    first.close()
    second = _loader(store)
    second.load_state_dict(state)
    again = list(second)  # the rest of the consumer's epoch
    assert len(again) == 7
    for a, b in zip(again[:3], rest, strict=True):
        torch.testing.assert_close(a[1], b)
    second.close()
    assert len(seen) == 11


def test_training_crops_follow_torchvision_over_the_stored_image(tmp_path):
    from tests.data._images import crop_boxes, crop_coverage, ks_statistic
    from tests.data.test_dali_pixels import OUT

    height, width = 192, 256
    for i in range(64):
        save(coordinate_rgb(height, width), tmp_path / "src" / "a" / f"{i}.png")
    out = tmp_path / "coords.h5"
    convert_folder_to_hdf5(tmp_path / "src", out, height, workers=1, progress=False, format="jpeg")
    store = HDF5ImageDataset(out)
    torch.manual_seed(0)
    loader = DALIStoreLoader(
        store, batch_size=64, image_size=OUT, device="cpu", mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0),
        options=DALIOptions(threads=2),
    )  # fmt: skip
    got = [crop_boxes(images) for _ in range(8) for images, _ in loader]  # one batch an epoch
    loader.close()
    boxes, flips = np.concatenate([b for b, _ in got]), np.concatenate([f for _, f in got])
    rng = random.Random(0)
    ref = np.array([tv_rrc_params(rng, height, width) for _ in range(8000)], dtype=np.float64)
    area, ref_area = boxes[:, 2] * boxes[:, 3] / (height * width), ref[:, 2] * ref[:, 3] / (height * width)
    assert ks_statistic(area, ref_area) < 0.1
    assert ks_statistic(np.log(boxes[:, 3] / boxes[:, 2]), np.log(ref[:, 3] / ref[:, 2])) < 0.1
    bottom, right = boxes[:, 0] + boxes[:, 2], boxes[:, 1] + boxes[:, 3]
    assert abs(boxes[:, 0].min()) < 2 and abs(boxes[:, 1].min()) < 2  # the whole stored image is reached
    assert abs(bottom.max() - height) < 2 and abs(right.max() - width) < 2
    points = [(y, x) for y in (0.5, height / 2, height - 0.5) for x in (0.5, width / 3, width - 0.5)]
    assert np.abs(crop_coverage(boxes, points) - crop_coverage(ref, points)).max() < 0.08
    assert 0.35 < flips.mean() < 0.65


def test_the_datamodule_trains_on_dali_and_validates_on_the_host(store):
    import lightning.pytorch as pl

    class Recorder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Conv2d(3, 2, 1)
            self.train_kinds: list[bool] = []
            self.val_shapes: list[tuple[int, ...]] = []

        def training_step(self, batch, batch_idx):
            self.train_kinds.append(batch[0].is_contiguous(memory_format=torch.channels_last))
            return self.layer(batch[0]).mean()

        def validation_step(self, batch, batch_idx):
            self.val_shapes.append(tuple(batch[0].shape))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dm = OptimizedDataModule(store.path, val_dir=store.path, backend="dali", batch_size=4, image_size=32,
                             num_workers=0, dali=DALIOptions(threads=2))  # fmt: skip
    assert dm.backend == "dali"
    model = Recorder()
    trainer = quiet_trainer(accelerator="cpu", devices=1, max_steps=3, limit_val_batches=2)
    trainer.fit(model, datamodule=dm)
    assert isinstance(trainer.train_dataloader, DALIStoreLoader)
    assert model.train_kinds == [True] * 3 and model.val_shapes and model.val_shapes[0] == (4, 3, 32, 32)


def test_auto_takes_dali_for_a_jpeg_store_only_where_it_runs(store, tmp_path, monkeypatch):
    paths = {"train": str(store.path), "val": None, "test": None, "predict": None}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    chosen, why = choose_backend("auto", paths)
    assert chosen.name == "hdf5" and "no CUDA GPU" in why
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backends, "dali_installed", lambda: False)
    chosen, why = choose_backend("auto", paths)
    assert chosen.name == "hdf5" and "lightning-gpuopt[dali]" in why
    monkeypatch.setattr(backends, "dali_installed", lambda: True)
    chosen, why = choose_backend("auto", paths)
    assert isinstance(chosen, backends.DALIStoreBackend) and "DALI decodes its training batches" in why
    assert choose_backend("auto", paths, own_datasets=True)[0].name == "hdf5"


def test_dali_on_a_raw_store_names_the_fix(tmp_path):
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    for i in range(4):
        natural(40, 30, seed=i).save(src / f"{i}.jpg")
    raw = tmp_path / "raw.h5"
    convert_folder_to_hdf5(tmp_path / "src", raw, 32, workers=1, progress=False)
    with pytest.raises(ValueError, match="backend='hdf5'"):
        OptimizedDataModule(str(raw), backend="dali", batch_size=2)


@pytest.mark.gpu
@pytest.mark.parametrize("decoder", ["cpu", "gpu"])
def test_gpu_store_batches_decode_on_the_device_in_the_sources_order(store, decoder):
    loader = DALIStoreLoader(store, batch_size=4, image_size=32, device="cuda",
                             options=DALIOptions(decoder=decoder, threads=2))  # fmt: skip
    order = StoreBatches(store.path, *store.byte_ranges(), store.labels, batch_size=4)
    try:
        batches = list(loader)
        assert len(batches) == 9 and all(x.is_cuda and y.is_cuda for x, y in batches)
        labels = torch.cat([y for _, y in batches]).cpu().numpy()
        np.testing.assert_array_equal(labels, store.labels[order.order(0)])
        assert batches[0][0].is_contiguous(memory_format=torch.channels_last)
    finally:
        loader.close()
        order.close()


@pytest.mark.gpu
def test_gpu_auto_reads_a_jpeg_store_with_dali(store):
    dm = OptimizedDataModule(store.path, batch_size=4, image_size=32)
    assert dm.backend == "dali" and "DALI decodes its training batches" in (dm.backend_reason or "")


def test_teardown_releases_the_pipeline_and_the_reading_threads(store):
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Conv2d(3, 2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dm = OptimizedDataModule(store.path, backend="dali", batch_size=4, image_size=32, num_workers=0,
                             dali=DALIOptions(threads=2))  # fmt: skip
    trainer = quiet_trainer(accelerator="cpu", devices=1, max_steps=3)
    trainer.fit(Tiny(), datamodule=dm)
    loader = trainer.train_dataloader
    assert isinstance(loader, DALIStoreLoader) and loader._iterator is None and loader._source is None
    assert loader.state_dict()["position"] == 3  # its place in the stream is kept
