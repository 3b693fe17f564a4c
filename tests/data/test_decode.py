"""JPEGs decoded in the training process without DALI (``data.decode``, ``decode_gpu``, ``decode_backend``):
the CPU threads against the folder backend's canvases and PIL's RGB, the nvJPEG path's crops (on the CPU,
torchvision's or PIL's decoder standing in for nvJPEG), the choice rule, the backend choice, errors; the
GPU tests (``gpu`` marker) compare nvJPEG's pixels with PIL's and check the training stream never waits."""

from __future__ import annotations

import io
import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import lightning_gpuopt.data.backends as backends
import lightning_gpuopt.data.decode as decode
import lightning_gpuopt.data.decode_choice as decode_choice
from lightning_gpuopt import OptimizedDataModule
from lightning_gpuopt._common import eval_resize_size
from lightning_gpuopt.data.choose import choose_backend
from lightning_gpuopt.data.decode import (
    DecodeOptions,
    ThreadDecodedFolder,
    ThreadDecodedStore,
    decode_canvas_fast,
    decode_rgb,
    jpeg_info,
    nvjpeg_decodable,
)
from lightning_gpuopt.data.decode_backend import DecodedFolderBackend, DecodedStoreBackend
from lightning_gpuopt.data.decode_choice import choose_decoder, resolve_decoder
from lightning_gpuopt.data.decode_gpu import JPEGBatch, NVJPEGCrops, read_jpeg_batch
from lightning_gpuopt.data.folder import UInt8ImageFolder
from lightning_gpuopt.data.transforms import AugmentConfig
from tests._lightning import quiet_trainer
from tests.data._images import (
    coordinate_rgb,
    crop_boxes,
    crop_coverage,
    ks_statistic,
    mad,
    natural,
    tv_center_crop,
    tv_resize,
    tv_rrc_params,
)

TORCHVISION = decode._torchvision_io() is not None
needs_torchvision = pytest.mark.skipif(not TORCHVISION, reason="torchvision is not installed here")
ZERO, ONE = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)  # no normalization: outputs are pixel / 255


def _jpeg(image: Image.Image, **kwargs: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90, **kwargs)
    return buf.getvalue()


def _mixed_folder(root, n: int = 12):  # type: ignore[no-untyped-def]
    """RGB, grey, CMYK and progressive JPEGs of mixed shapes, a PNG and a tall strip, in two classes."""
    shapes = [(120, 90), (90, 130), (200, 100), (64, 64), (160, 120), (75, 150)]
    for i in range(n):
        w, h = shapes[i % len(shapes)]
        img = natural(w, h, seed=i)
        cls = root / f"c{i % 2}"
        cls.mkdir(parents=True, exist_ok=True)
        if i % 6 == 1:
            img.convert("L").save(cls / f"{i}.jpg", quality=90)
        elif i % 6 == 2:
            img.convert("CMYK").save(cls / f"{i}.jpg", quality=90)
        elif i % 6 == 3:
            img.save(cls / f"{i}.jpg", quality=90, progressive=True)
        elif i % 6 == 4:
            img.save(cls / f"{i}.png")
        else:
            img.save(cls / f"{i}.jpg", quality=90)
    return root


# ------------------------------------------------------------------------------------------ headers, pixels
def test_the_frame_header_says_what_nvjpeg_takes():
    img = natural(120, 80, seed=0)
    rgb = jpeg_info(_jpeg(img))
    assert rgb is not None and (rgb.width, rgb.height, rgb.components, rgb.baseline) == (120, 80, 3, True)
    assert nvjpeg_decodable(rgb)
    grey, cmyk = jpeg_info(_jpeg(img.convert("L"))), jpeg_info(_jpeg(img.convert("CMYK")))
    progressive = jpeg_info(_jpeg(img, progressive=True))
    assert grey is not None and grey.components == 1 and not nvjpeg_decodable(grey)
    assert cmyk is not None and cmyk.components == 4 and cmyk.adobe_transform is not None
    assert not nvjpeg_decodable(cmyk)
    assert progressive is not None and not progressive.baseline and not nvjpeg_decodable(progressive)
    png = io.BytesIO()
    img.save(png, format="PNG")
    assert jpeg_info(png.getvalue()) is None and not nvjpeg_decodable(None)
    assert jpeg_info(_jpeg(img)[:20]) is None and jpeg_info(b"\xff\xd8\xff\xda\x00\x02") is None


@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK"])
def test_grey_and_cmyk_decode_to_pils_rgb(mode):
    img = natural(96, 72, seed=3).convert(mode)
    for progressive in (False, True):
        data = _jpeg(img, progressive=progressive)
        want = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        got = decode_rgb(data, "x.jpg")
        assert got.dtype == torch.uint8 and got.shape == (3, 72, 96)
        np.testing.assert_array_equal(got.permute(1, 2, 0).numpy(), want)


def test_the_threads_decode_the_folder_backends_canvases(tmp_path):
    root = _mixed_folder(tmp_path / "f")
    reference = UInt8ImageFolder(root, size=40)
    threads = ThreadDecodedFolder(root, size=40, threads=2)
    assert threads.read_in_workers is False and threads.auto_readers == 2
    n = len(reference)
    want, got = np.zeros((n, *reference.image_shape), np.uint8), np.ones((n, *threads.image_shape), np.uint8)
    labels, meta = reference.read_into(range(n), want)
    got_labels, got_meta = threads.read_into(range(n), got)
    np.testing.assert_array_equal(got, want)  # torchvision and PIL decode to the same pixels
    np.testing.assert_array_equal(got_meta, meta)
    np.testing.assert_array_equal(got_labels, labels)
    assert [threads.label(i) for i in range(n)] == labels.tolist()


def test_a_decompression_bomb_is_refused_by_name_on_every_path(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # the test image, 80x60, is over twice it
    data = _jpeg(natural(80, 60, seed=1))

    class One:
        def jpeg_bytes(self, i):  # type: ignore[no-untyped-def]
            return bytearray(data), "bomb.jpg"

        def label(self, i):  # type: ignore[no-untyped-def]
            return 0

    with pytest.raises(ValueError, match=r"^image 'bomb\.jpg' is 80x60 = 4,800 pixels, more than twice"):
        read_jpeg_batch(One(), [0])  # on its way to nvJPEG
    with pytest.raises(ValueError, match=r"bomb"):
        decode_rgb(data, "bomb.jpg")  # torchvision's CPU decoder, or PIL's own check


def test_decode_canvas_fast_names_a_broken_file(tmp_path):
    data = _jpeg(natural(80, 60, seed=1))
    canvas = np.empty((40, 60, 3), np.uint8)
    with pytest.raises(
        ValueError,
        match=r"^cannot decode image 'bad\.jpg' \(.*\); remove or replace the file, or pass on_corrupt='skip'",
    ):
        decode_canvas_fast(data[: len(data) // 2], 40, canvas, "bad.jpg")


# ------------------------------------------------------------------------------------ the DataModule, on CPU
def _module():  # type: ignore[no-untyped-def]
    import lightning.pytorch as pl

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3 * 16 * 16, 2)
            self.shapes: list[tuple[int, ...]] = []

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            self.shapes.append(tuple(x.shape))
            return torch.nn.functional.cross_entropy(self.layer(x.flatten(1)), y)

        def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            self.shapes.append(tuple(batch[0].shape))

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Model()


def test_a_short_cpu_fit_decodes_on_threads_of_the_training_process(tmp_path, caplog):
    root = _mixed_folder(tmp_path / "f", n=24)
    dm = OptimizedDataModule(
        root, root, batch_size=4, image_size=16, decode=DecodeOptions(decoder="cpu", threads=2)
    )
    assert isinstance(dm._backend, DecodedFolderBackend) and dm.backend == "folder"
    assert "the training process decodes" in dm.backend_reason
    model = _module()
    trainer = quiet_trainer(accelerator="cpu", devices=1, max_epochs=2, limit_val_batches=2)
    with caplog.at_level(logging.INFO):
        trainer.fit(model, datamodule=dm)
    loader = trainer.train_dataloader
    assert loader.read_threads == 2 and loader.num_workers == 0  # threads, no worker processes
    assert (loader.feed_info.decoder, loader.feed_info.threads, loader.feed_info.backend) == (
        "cpu",
        2,
        "folder",
    )
    assert dm._backend.choice.decoder == "cpu" and not dm._backend.choice.measured
    said = [r.getMessage() for r in caplog.records if "JPEGs decoded" in r.getMessage()]
    assert said == [
        "OptimizedDataModule: JPEGs decoded on 2 CPU threads (decoder='cpu', chosen): "
        "DecodeOptions(decoder='cpu'); DecodeOptions(decoder='cpu' or 'gpu') overrides"
    ]
    assert set(model.shapes) == {(4, 3, 16, 16)} and len(model.shapes) >= 12  # 6 training batches an epoch


def test_a_jpeg_store_is_decoded_on_threads_too(tmp_path):
    from lightning_gpuopt.data.convert import convert_folder_to_hdf5

    pytest.importorskip("h5py")
    root = _mixed_folder(tmp_path / "f", n=16)
    store = tmp_path / "s.h5"
    convert_folder_to_hdf5(root, store, storage_size=20, progress=False, format="jpeg", workers=0)
    dm = OptimizedDataModule(
        store, batch_size=4, image_size=16, decode=DecodeOptions(decoder="cpu", threads=2)
    )
    assert isinstance(dm._backend, DecodedStoreBackend) and dm.backend == "hdf5"
    dm.setup("fit")
    dataset = dm._dataset("train")
    assert isinstance(dataset, ThreadDecodedStore)
    raw = decode.JPEGStoreDataset(store)
    want, got = np.zeros((16, *raw.image_shape), np.uint8), np.ones((16, *raw.image_shape), np.uint8)
    raw.read_into(range(16), want)
    dataset.read_into(range(16), got)
    np.testing.assert_array_equal(got, want)
    batch = read_jpeg_batch(dataset, [0, 5])
    assert batch.labels.tolist() == [dataset.label(0), dataset.label(5)] and len(batch) == 2
    loader = dm.train_dataloader()
    assert loader.read_threads == 2 and next(iter(loader))[0].shape == (4, *raw.image_shape)
    dm.teardown("fit")


def test_a_broken_jpeg_stops_the_fit_naming_the_file(tmp_path):
    root = _mixed_folder(tmp_path / "f", n=8)
    bad = root / "c0" / "0.jpg"
    bad.write_bytes(bad.read_bytes()[:300])
    dm = OptimizedDataModule(
        root, batch_size=8, image_size=16, decode=DecodeOptions(decoder="cpu", threads=1)
    )
    trainer = quiet_trainer(accelerator="cpu", devices=1, max_steps=1)
    with pytest.raises(ValueError, match="cannot decode image") as err:
        trainer.fit(_module(), datamodule=dm)
    assert str(bad) in str(err.value) and "\n" not in str(err.value)


def test_decode_options_are_checked_when_made():
    with pytest.raises(ValueError, match=r"^decode\.decoder must be one of 'gpu', 'cpu', got 'nvjpeg'"):
        DecodeOptions(decoder="nvjpeg")
    with pytest.raises(TypeError, match=r"^decode\.threads must be an int >= 1"):
        DecodeOptions(threads=2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^decode must be None or a DecodeOptions"):
        OptimizedDataModule(None, decode={"decoder": "cpu"})  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------- the rule
def test_the_rule_weighs_the_measured_rates():
    assert choose_decoder(14, 4200, 9000)[0] == "gpu"
    decoder, why = choose_decoder(14, 11_200, 9000)
    assert (
        decoder == "cpu"
        and why == "14 CPU threads 11,200 img/s >= nvJPEG 9,000 img/s: the GPU is left to the model"
    )
    decoder, why = choose_decoder(14, 4200, 9000, model_rate=4000)
    assert decoder == "cpu" and "the model's 4,000 img/s" in why  # CPU threads keep up: GPU left alone
    decoder, why = choose_decoder(6, 1800, 9000, model_rate=4000)
    assert decoder == "gpu" and why.endswith("< 4,000 img/s the model trains at")


def test_resolve_measures_on_a_cuda_device_and_says_so(tmp_path, monkeypatch, caplog):
    folder = ThreadDecodedFolder(_mixed_folder(tmp_path / "f"), size=40, threads=2)
    cuda = torch.device("cuda", 0)
    seen = []

    def rates(dataset, indices, device, image_size, threads):  # type: ignore[no-untyped-def]
        seen.append((len(indices), device, image_size, threads))
        return 1500.0, 20_000.0

    monkeypatch.setattr(decode_choice, "measure_rates", rates)
    monkeypatch.setattr(decode, "_torchvision_io", lambda: object())
    with caplog.at_level(logging.INFO):
        choice = resolve_decoder(
            DecodeOptions(threads=3), folder, device=cuda, image_size=224, batch_size=256
        )
    assert (choice.decoder, choice.threads, choice.measured, choice.gpu_rate) == ("gpu", 3, True, 20_000.0)
    assert seen == [(len(folder), cuda, 224, 3)]  # every image of a small folder is the sample
    assert any(
        "(decoder='gpu', measured): nvJPEG 20,000 img/s > 3 CPU threads 1,500 img/s" in r.getMessage()
        for r in caplog.records
    )
    slow = resolve_decoder(DecodeOptions(threads=3), folder, device=cuda, image_size=224, batch_size=256,
                           model_rate=1000.0)  # fmt: skip
    assert slow.decoder == "cpu" and slow.measured
    monkeypatch.setattr(decode, "_torchvision_io", lambda: None)
    missing = resolve_decoder(None, folder, device=cuda, image_size=224, batch_size=256)
    assert missing.decoder == "cpu" and "lightning-gpuopt[vision]" in missing.reason and not missing.measured


def test_a_gpu_decoder_on_a_cpu_run_says_so_once_and_steps_aside(tmp_path):
    folder = ThreadDecodedFolder(_mixed_folder(tmp_path / "f"), size=40, threads=2)
    with pytest.warns(UserWarning, match=r"DecodeOptions\(decoder='gpu'\): no CUDA device; decoding on CPU"):
        choice = resolve_decoder(DecodeOptions(decoder="gpu", threads=2), folder, device=torch.device("cpu"),
                                 image_size=32, batch_size=4)  # fmt: skip
    assert choice.decoder == "cpu" and choice.reason == "no CUDA device"


def test_auto_decodes_in_the_training_process_on_a_cuda_machine_without_dali(jpeg_folder, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backends, "dali_installed", lambda: False)
    monkeypatch.setattr(backends, "torchvision_installed", lambda: True)
    chosen, why = choose_backend("auto", {"train": str(jpeg_folder)})
    assert isinstance(chosen, DecodedFolderBackend) and "the training process decodes them" in why
    chosen, why = choose_backend("auto", {"train": str(jpeg_folder)}, num_workers=8)
    assert type(chosen) is backends.FolderBackend and "num_workers=8: worker processes" in why
    monkeypatch.setattr(backends, "torchvision_installed", lambda: False)
    chosen, why = choose_backend("auto", {"train": str(jpeg_folder)})
    assert type(chosen) is backends.FolderBackend and "pip install 'lightning-gpuopt[vision]'" in why
    monkeypatch.setattr(backends, "dali_installed", lambda: True)  # DALI stays the choice where installed
    assert choose_backend("auto", {"train": str(jpeg_folder)})[0].name == "dali"
    asked, why = choose_backend("auto", {"train": str(jpeg_folder)}, decode=DecodeOptions())
    assert isinstance(asked, DecodedFolderBackend)  # unless the user asks for this decoding
    with pytest.raises(ValueError, match=r"^decode must be None with backend='dali'"):
        OptimizedDataModule(jpeg_folder, backend="dali", decode=DecodeOptions())


# ---------------------------------------------------------------------------------- the nvJPEG path's crops
def _cpu_batch(images: list[np.ndarray]) -> JPEGBatch:
    decoded = [torch.from_numpy(a).permute(2, 0, 1).contiguous() for a in images]
    n = len(images)
    return JPEGBatch([None] * n, decoded, torch.arange(n), [f"{i}.png" for i in range(n)])  # type: ignore[arg-type]


@pytest.mark.parametrize(("height", "width"), [(192, 256), (224, 168)])
def test_training_crops_follow_torchvision_random_resized_crop(height, width):
    crops = NVJPEGCrops(64, AugmentConfig(), ZERO, ONE, seed=0, device="cpu")
    image = coordinate_rgb(height, width)
    got = [crop_boxes(crops(_cpu_batch([image] * 64))[0]) for _ in range(8)]
    boxes, flips = np.concatenate([b for b, _ in got]), np.concatenate([f for _, f in got])
    rng = random.Random(0)
    ref = np.array([tv_rrc_params(rng, height, width) for _ in range(8000)], dtype=np.float64)
    area, ref_area = boxes[:, 2] * boxes[:, 3] / (height * width), ref[:, 2] * ref[:, 3] / (height * width)
    assert ks_statistic(area, ref_area) < 0.1
    assert ks_statistic(np.log(boxes[:, 3] / boxes[:, 2]), np.log(ref[:, 3] / ref[:, 2])) < 0.1
    assert area.min() > 0.07 and area.max() < 1.02
    bottom, right = boxes[:, 0] + boxes[:, 2], boxes[:, 1] + boxes[:, 3]
    assert abs(boxes[:, 0].min()) < 1.5 and abs(boxes[:, 1].min()) < 1.5
    assert abs(bottom.max() - height) < 1.5 and abs(right.max() - width) < 1.5
    points = [
        (y, x) for y in (0.5, height / 4, height / 2, height - 0.5) for x in (0.5, width / 3, width - 0.5)
    ]
    assert np.abs(crop_coverage(boxes, points) - crop_coverage(ref, points)).max() < 0.07
    assert 0.4 < flips.mean() < 0.6


def test_images_of_many_sizes_keep_their_labels_through_the_groups():
    """Images of 12 shapes (portrait ones stored transposed) in groups of unequal canvases: each output is
    its own image's crop, with its own label."""
    shapes = [(h, w) for h in (40, 90, 200, 250) for w in (50, 120, 256)]
    images = [coordinate_rgb(h, w) for h, w in shapes] * 12  # 144 images: three groups
    crops = NVJPEGCrops(32, AugmentConfig(scale=(1.0, 1.0), ratio=(0.1, 10.0), flip_p=0.0), ZERO, ONE,
                        device="cpu")  # fmt: skip
    out, labels = crops(_cpu_batch(images))
    boxes, flips = crop_boxes(out)
    assert not flips.any() and sorted(labels.tolist()) == list(range(len(images)))
    for box, label in zip(boxes, labels.tolist(), strict=True):
        h, w = shapes[label % len(shapes)]
        np.testing.assert_allclose(box, (0, 0, h, w), atol=1.0)  # the whole image of that label


def test_the_evaluation_crop_is_pils_resize_and_center_crop():
    shapes = [(120, 160), (160, 120), (75, 100), (97, 131), (64, 64), (60, 150), (300, 201)]
    images = [np.asarray(natural(w, h, seed=k)) for k, (h, w) in enumerate(shapes)]
    crops = NVJPEGCrops(48, None, ZERO, ONE, device="cpu")
    out, labels = crops(_cpu_batch(images))
    got = (out.float() * 255.0).permute(0, 2, 3, 1).numpy()
    for row, label in zip(got, labels.tolist(), strict=True):
        want = tv_center_crop(np.asarray(tv_resize(Image.fromarray(images[label]), eval_resize_size(48))), 48)
        assert mad(row, want) <= 1.0, shapes[label]


def test_the_loader_reads_whole_batches_on_its_threads(tmp_path):
    """``NVJPEGLoader`` without a GPU to stage on hands out its ``JPEGBatch`` objects: shuffled whole batches,
    every image once a pass, the ones nvJPEG does not take already decoded."""
    from lightning_gpuopt.data.decode_gpu import NVJPEGLoader

    folder = ThreadDecodedFolder(_mixed_folder(tmp_path / "f", n=12), size=40, threads=2)
    loader = NVJPEGLoader(folder, batch_size=4, shuffle=True, drop_last=True, reader_threads=2)
    seen = []
    for _ in range(2):
        batches = list(loader)
        assert len(batches) == 3 and all(isinstance(b, JPEGBatch) and len(b) == 4 for b in batches)
        names = [name for b in batches for name in b.names]
        assert sorted(names) == sorted(p for p, _ in folder.samples)
        seen.append(names)
        for b in batches:
            for name, data, image, label in zip(b.names, b.data, b.decoded, b.labels.tolist(), strict=True):
                assert label == folder.label([p for p, _ in folder.samples].index(name))
                assert (data is None) != (image is None)  # bytes for nvJPEG, or decoded here
                assert (data is not None) == nvjpeg_decodable(jpeg_info(Path(name).read_bytes()))
    assert seen[0] != seen[1]  # reshuffled every pass
    loader.close()


@needs_torchvision
def test_a_batch_through_the_nvjpeg_path_with_torchvisions_cpu_decoder(tmp_path):
    """The whole path of a training batch, torchvision's CPU decoder standing in for nvJPEG: every image's
    evaluation crop is PIL's ``Resize + CenterCrop`` of its RGB pixels."""
    folder = ThreadDecodedFolder(_mixed_folder(tmp_path / "f", n=12), size=40, threads=2)
    batch = read_jpeg_batch(folder, range(12))
    assert sum(d is not None for d in batch.data) == 4  # the baseline RGB JPEGs; the rest decoded already
    out, labels = NVJPEGCrops(24, None, ZERO, ONE, device="cpu")(batch)
    got = (out.float() * 255.0).permute(0, 2, 3, 1).numpy()
    by_label = {0: [], 1: []}  # type: dict[int, list[float]]
    paths = [p for p, _ in folder.samples]
    for row, label in zip(got, labels.tolist(), strict=True):
        # each output is the evaluation crop of one of its label's images, each image once
        dists = [mad(row, tv_center_crop(np.asarray(tv_resize(Image.open(p).convert("RGB"), eval_resize_size(24))), 24))
                 for p in paths if folder.label(paths.index(p)) == label]  # fmt: skip
        by_label[label].append(min(dists))
    assert max(max(v) for v in by_label.values()) <= 1.0 and len(by_label[0]) == len(by_label[1]) == 6


@needs_torchvision
def test_both_rates_are_measured_on_the_runs_own_files(tmp_path):
    folder = ThreadDecodedFolder(_mixed_folder(tmp_path / "f", n=12), size=40, threads=2)
    cpu, gpu = decode_choice.measure_rates(folder, list(range(12)), torch.device("cpu"), 24, threads=2)
    assert cpu > 0 and gpu > 0  # on a CPU, torchvision's CPU decoder stands in for nvJPEG


def test_an_image_nvjpeg_refuses_is_decoded_on_the_cpu_and_a_broken_one_named(monkeypatch):
    import lightning_gpuopt.data.decode_gpu as decode_gpu

    good = [_jpeg(natural(64, 48, seed=i)) for i in range(3)]
    calls = []

    def nvjpeg(data, device):  # type: ignore[no-untyped-def]
        calls.append(len(data))
        if len(data) > 1 or bytes(data[0].numpy()) == good[1]:
            raise RuntimeError("Error while decoding JPEG images: nvJPEG refuses one of them")
        try:
            return [torch.from_numpy(np.asarray(Image.open(io.BytesIO(bytes(d.numpy()))))).permute(2, 0, 1)
                    for d in data]  # fmt: skip
        except OSError as err:  # nvJPEG's errors are RuntimeErrors
            raise RuntimeError(f"Error while decoding JPEG images: {err}") from err

    monkeypatch.setattr(decode_gpu, "_nvjpeg", nvjpeg)
    batch = JPEGBatch([torch.frombuffer(bytearray(g), dtype=torch.uint8) for g in good], [None] * 3,
                      torch.arange(3), ["a.jpg", "b.jpg", "c.jpg"])  # fmt: skip
    images = NVJPEGCrops(32, None, device="cpu").decode(batch, torch.device("cpu"))
    assert calls == [3, 1, 1, 1]  # the batch, then one by one; b.jpg on the CPU
    for data, image in zip(good, images, strict=True):
        np.testing.assert_array_equal(
            image.permute(1, 2, 0).numpy(), np.asarray(Image.open(io.BytesIO(data)))
        )
    batch.data[2] = torch.frombuffer(bytearray(good[2][:200]), dtype=torch.uint8)
    batch.names[2] = "broken.jpg"
    with pytest.raises(ValueError, match=r"^cannot decode image 'broken\.jpg'"):
        NVJPEGCrops(32, None, device="cpu").decode(batch, torch.device("cpu"))


# --------------------------------------------------------------------------------------------- on the GPU
@pytest.mark.gpu
def test_nvjpeg_pixels_are_pils_within_a_tolerance(tmp_path):
    pytest.importorskip("torchvision")
    root = _mixed_folder(tmp_path / "f", n=24)
    folder = ThreadDecodedFolder(root, size=256, threads=2)
    batch = read_jpeg_batch(folder, range(len(folder)))
    assert sum(d is not None for d in batch.data) == 8  # the baseline RGB JPEGs go to nvJPEG
    images = NVJPEGCrops(224, None).decode(batch, torch.device("cuda", 0))
    for (path, _), image in zip(folder.samples, images, strict=True):
        want = np.asarray(Image.open(path).convert("RGB"))
        got = image.permute(1, 2, 0).cpu().numpy()
        assert got.shape == want.shape and image.is_cuda
        assert mad(got, want) <= 2.0, path  # nvJPEG's IDCT and chroma upsampling differ from libjpeg's


@pytest.mark.gpu
def test_decoding_never_makes_the_training_stream_wait(tmp_path):
    """A long kernel queued on the training stream is still running when batches read, decoded, cropped and
    handed over after it was queued have arrived: nothing on the way synchronized that stream (or the
    device)."""
    pytest.importorskip("torchvision")
    from lightning_gpuopt.bench.synthetic import make_jpeg_folder

    root = make_jpeg_folder(tmp_path / "f", num_images=64, num_classes=2, image_size="imagenet")
    dm = OptimizedDataModule(
        root, batch_size=32, image_size=224, decode=DecodeOptions(decoder="gpu", threads=2)
    )
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert type(loader).__name__ == "NVJPEGLoader" and loader.reader_threads == dm.num_workers == 2
    batches = iter(loader)  # two batches a pass; the loader goes on into the next passes
    next(batches)  # nvJPEG made its handle: the first batch is not the one checked
    training = torch.cuda.current_stream()
    torch.cuda._sleep(int(1e10))  # seconds of GPU time on the training stream
    for _ in range(4):  # more than the staging thread keeps ready: decoded after the sleep was queued
        images, labels = next(batches)
    assert not training.query(), "decoding or handing over a batch waited for the training stream"
    assert images.shape == (32, 3, 224, 224) and images.is_contiguous(memory_format=torch.channels_last)
    assert labels.is_cuda and images.dtype == torch.float32
    torch.cuda.synchronize()
    dm.teardown("fit")


@pytest.mark.gpu
def test_a_gpu_fit_through_nvjpeg_measures_and_trains(tmp_path, caplog):
    pytest.importorskip("torchvision")
    from lightning_gpuopt.bench.synthetic import make_jpeg_folder

    root = make_jpeg_folder(tmp_path / "f", num_images=128, num_classes=2, image_size="imagenet")
    dm = OptimizedDataModule(root, root, batch_size=16, image_size=16, decode=DecodeOptions())
    trainer = quiet_trainer(accelerator="gpu", devices=1, max_steps=6, limit_val_batches=2)
    with caplog.at_level(logging.INFO):
        trainer.fit(_module(), datamodule=dm)
    assert dm._backend.choice.measured and dm._backend.choice.gpu_rate > 0
    assert any("(decoder=" in r.getMessage() and "measured" in r.getMessage() for r in caplog.records)
    if dm._backend.choice.decoder == "gpu":
        from lightning_gpuopt.data.decode_gpu import NVJPEGLoader

        assert isinstance(trainer.train_dataloader, NVJPEGLoader)
