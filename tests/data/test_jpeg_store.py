"""The raw store's whole-image crop semantics and torchvision parity, on both stores (``convert --format raw``
and ``--format jpeg``): each image's meta covers the whole resized image, training crops follow torchvision's
``RandomResizedCrop`` distribution over it, and the validation pixels of ``OptimizedDataModule(store)`` are
torchvision's ``Resize + CenterCrop`` of the source file (for the JPEG store, up to what its encoding of a
source it re-encodes costs). The JPEG store's canvases are the folder backend's where it keeps a source's
bytes, and the raw store's up to its own encoding where it re-encodes."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("h5py")

from lightning_gpuopt._common import eval_resize_size  # noqa: E402
from lightning_gpuopt.data import layout  # noqa: E402
from lightning_gpuopt.data.convert import convert_folder_to_hdf5  # noqa: E402
from lightning_gpuopt.data.datamodule import OptimizedDataModule  # noqa: E402
from lightning_gpuopt.data.folder import UInt8ImageFolder, scan_image_folder  # noqa: E402
from lightning_gpuopt.data.hdf5 import HDF5ImageDataset  # noqa: E402
from lightning_gpuopt.data.jpeg_store import JPEG_QUALITY, JPEGStoreDataset  # noqa: E402
from lightning_gpuopt.data.transforms import AugmentConfig, GPUAugment  # noqa: E402
from tests.data._images import mad, tv_center_crop, tv_resize  # noqa: E402
from tests.data._images import natural as _natural  # noqa: E402
from tests.data.test_transforms import _coverage, _ks, tv_random_resized_crop  # noqa: E402

FORMATS = ["raw", "jpeg"]
#: (width, height) of the sources: 4:3, 3:4, square, 3:2, and a JPEG four times the store's size
SHAPES = [(500, 375), (375, 500), (300, 300), (450, 300), (1280, 960)]




@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("jpeg_store") / "src"
    for i, (w, h) in enumerate(SHAPES):
        path = root / "a" / f"{i}_{w}x{h}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        _natural(w, h, seed=i).save(path, quality=92)
    return root


def _store(sources, tmp_path, fmt: str, size: int):
    out = tmp_path / f"{fmt}_{size}.h5"
    convert_folder_to_hdf5(sources, out, size, workers=1, progress=False, format=fmt)
    store = HDF5ImageDataset(out)
    assert isinstance(store, JPEGStoreDataset) == (fmt == "jpeg")
    return store


@pytest.mark.parametrize("fmt", FORMATS)
def test_training_crops_cover_the_whole_image_as_torchvision_does(sources, tmp_path, fmt):
    size, n = 256, 10_000
    store = _store(sources, tmp_path, fmt, size)
    config = AugmentConfig()
    rng = np.random.default_rng(0)
    for i, (width, height) in enumerate(SHAPES):
        _, _, meta = store[i]
        # the whole image, resized to `size` on its shorter side, portrait transposed: nothing cut off
        sw, sh = layout.resized_size(width, height, size)
        assert meta.tolist() == [min(sw, sh), max(sw, sh), int(sh > sw)], (width, height, meta)
        np.testing.assert_array_equal(meta, store.meta[i])
        boxes, _ = GPUAugment(224).boxes(
            torch.from_numpy(np.stack([meta] * n)), True, torch.Generator().manual_seed(i)
        )
        boxes = boxes.double().numpy()
        assert (boxes[:, :2] >= 0).all() and (boxes[:, 0] + boxes[:, 2] <= sw + 1e-3).all()
        assert (boxes[:, 1] + boxes[:, 3] <= sh + 1e-3).all()
        ref = np.array(
            [tv_random_resized_crop(height, width, config.scale, config.ratio, rng) for _ in range(n)]
        )
        ref_xywh = np.stack([ref[:, 1], ref[:, 0], ref[:, 3], ref[:, 2]], axis=1).astype(np.float64)
        area = boxes[:, 2] * boxes[:, 3] / (sw * sh)
        assert _ks(area, ref_xywh[:, 2] * ref_xywh[:, 3] / (width * height), shift=0.005) < 0.03
        log_ratio = np.log(boxes[:, 2] / boxes[:, 3])
        assert _ks(log_ratio, np.log(ref_xywh[:, 2] / ref_xywh[:, 3]), shift=0.01) < 0.03
        ours, theirs = _coverage(boxes, sw, sh), _coverage(ref_xywh, width, height)
        assert np.abs(ours - theirs).max() < 0.04, (width, height)


def _jpeg_round_trip(array: np.ndarray) -> np.ndarray:
    """``array`` encoded as the JPEG store encodes a source it re-encodes, and decoded back."""
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="JPEG", quality=JPEG_QUALITY)
    return np.asarray(Image.open(buf).convert("RGB"))


def _torchvision_eval(path, image_size: int, encoded: bool = False) -> np.ndarray:
    """torchvision's ``Resize(eval_resize_size) + CenterCrop`` of the file (``encoded``: with the resized
    image passed through the JPEG store's encoding, the store being kept at ``eval_resize_size``)."""
    with Image.open(path) as img:
        resized = np.asarray(tv_resize(img.convert("RGB"), eval_resize_size(image_size)))
    return tv_center_crop(_jpeg_round_trip(resized) if encoded else resized, image_size)


@pytest.mark.parametrize("fmt", FORMATS)
def test_validation_pixels_match_torchvision_end_to_end(sources, tmp_path, fmt):
    image_size = 112
    store = _store(sources, tmp_path, fmt, eval_resize_size(image_size))
    dm = OptimizedDataModule(val_dir=store.path, batch_size=len(SHAPES), num_workers=0, image_size=image_size)
    dm.setup("validate")
    batch = next(iter(dm.val_dataloader()))
    images, labels = dm.on_after_batch_transfer(batch, 0)  # no trainer: the evaluation transform
    assert images.shape == (len(SHAPES), 3, image_size, image_size) and labels.tolist() == [0] * len(SHAPES)
    mean, std = torch.tensor(dm.mean).view(1, 3, 1, 1), torch.tensor(dm.std).view(1, 3, 1, 1)
    pixels = ((images * std + mean) * 255).permute(0, 2, 3, 1).numpy()
    _, samples = scan_image_folder(sources)
    for (path, _), got in zip(samples, pixels, strict=True):
        ref = _torchvision_eval(path, image_size)
        if fmt == "raw":
            assert mad(got, ref) <= 2.0, (path, mad(got, ref))
        else:  # every source here is larger than the store: re-encoded, torchvision's pixels through it
            encoded = _torchvision_eval(path, image_size, encoded=True)
            assert mad(got, encoded) <= 1.5, (path, mad(got, encoded))  # 1280x960: DCT-scaled first
            assert mad(got, ref) <= 2.0 + mad(encoded, ref) and mad(encoded, ref) < 6.0, (path, mad(got, ref))


def test_jpeg_store_canvases_are_the_folders_or_the_raw_stores_up_to_their_encoding(sources, tmp_path):
    size = 300  # the 300x300 and 450x300 sources are kept byte for byte; the others are re-encoded
    raw, jpeg = _store(sources, tmp_path, "raw", size), _store(sources, tmp_path, "jpeg", size)
    folder = UInt8ImageFolder(sources, size=size)
    assert jpeg.attrs()["num_kept"] == 2
    for i, (width, height) in enumerate(SHAPES):
        canvas, _, meta = jpeg[i]
        raw_canvas, _, raw_meta = raw[i]
        np.testing.assert_array_equal(meta, raw_meta)
        if min(width, height) == size:  # kept: decoded by the folder backend's routine from the same bytes
            np.testing.assert_array_equal(canvas, folder[i][0])
            continue
        h, w = meta[:2]
        region, raw_region = canvas[:h, :w], raw_canvas[:h, :w]
        buf = io.BytesIO()
        Image.fromarray(raw_region).save(buf, format="JPEG", quality=JPEG_QUALITY)
        encoding = mad(np.asarray(Image.open(buf).convert("RGB")), raw_region)
        assert mad(region, raw_region) <= encoding + 0.5, (width, height)
        assert not canvas[h:].any() and not canvas[:, w:].any()  # nothing outside the image's region
