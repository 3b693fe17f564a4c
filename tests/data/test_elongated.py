"""Images more elongated than the canvas: every backend's evaluation crop is torchvision's.

torchvision's evaluation is ``Resize(eval_resize_size(image_size)) + CenterCrop(image_size)`` of the whole
image (reimplemented in ``tests/data/_images.py``: PIL bilinear resize of the shorter side, then the
centre crop). A 2000x20 strip, an 800x200 panorama and their portrait forms go through the folder backend,
the raw HDF5 store and the JPEG store, and the evaluation view ``GPUAugment`` takes of what each stores is
compared with that reference; DALI's evaluation resize and crop are checked against torchvision's formulas
without DALI and, where DALI is installed, on its pixels.
"""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from lightning_gpuopt._common import eval_resize_size
from lightning_gpuopt.data import layout
from lightning_gpuopt.data.convert import convert_folder_to_hdf5
from lightning_gpuopt.data.folder import UInt8ImageFolder, load_canvas, scan_image_folder
from lightning_gpuopt.data.hdf5 import HDF5ImageDataset
from lightning_gpuopt.data.jpeg_store import JPEG_QUALITY
from lightning_gpuopt.data.transforms import GPUAugment, center_crop_boxes
from tests.data._images import mad, save, tv_center_crop, tv_resize

ZERO, ONE = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)  # no normalization: outputs are pixel / 255
#: (width, height) of the elongated sources: strips, panoramas (landscape and portrait) and a JPEG four
#: times larger than the store needs on both sides (decoded at a reduced DCT scale)
SHAPES = [(2000, 20), (20, 2000), (800, 200), (200, 800), (2048, 512), (641, 200), (643, 200), (645, 200)]


def _textured(height: int, width: int, seed: int) -> np.ndarray:
    """Sinusoids whose periods are a fraction of the shorter side: detail at the scale a crop sees."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    short = min(height, width)
    rng = np.random.default_rng(seed)
    img = np.zeros((height, width, 3))
    for c in range(3):
        for _ in range(3):
            fx, fy, phase = rng.uniform(0.5, 3.0), rng.uniform(0.5, 3.0), rng.uniform(0, 2 * math.pi)
            img[..., c] += np.sin(2 * math.pi * (fx * x / short + fy * y / short) + phase)
    img = (img - img.min()) / (img.max() - img.min()) * 255
    return img.round().astype(np.uint8)


def _reference(path: str, image_size: int) -> np.ndarray:
    img = Image.open(path).convert("RGB")
    return tv_center_crop(np.asarray(tv_resize(img, eval_resize_size(image_size))), image_size)


def _eval(samples: list[tuple[np.ndarray, np.ndarray]], image_size: int) -> np.ndarray:
    canvases = torch.from_numpy(np.stack([c for c, _ in samples]))
    meta = torch.from_numpy(np.stack([m for _, m in samples]))
    out = GPUAugment(image_size, mean=ZERO, std=ONE)(canvases, meta, train=False)
    return (out.float() * 255.0).permute(0, 2, 3, 1).numpy()


@pytest.fixture(scope="module")
def elongated(tmp_path_factory):
    root = tmp_path_factory.mktemp("elongated") / "src"
    for k, (w, h) in enumerate(SHAPES):
        save(_textured(h, w, k), root / f"c{k % 2}" / f"img{k}_{w}x{h}.jpg", quality=95)
    return root


@pytest.mark.parametrize("image_size", [32, 56])  # stored at eval_resize_size: 37 and 64
def test_every_backend_evaluates_elongated_images_as_torchvision(elongated, tmp_path, image_size):
    size = eval_resize_size(image_size)
    _, samples = scan_image_folder(elongated)
    refs = [_reference(p, image_size) for p, _ in samples]
    folder = UInt8ImageFolder(elongated, size=size)
    backends = {"folder": [(c, m) for c, _, m in (folder[i] for i in range(len(folder)))]}
    for fmt in ("raw", "jpeg"):
        out = tmp_path / f"{fmt}.h5"
        convert_folder_to_hdf5(elongated, out, size, workers=1, progress=False, format=fmt)
        store = HDF5ImageDataset(out)
        backends[fmt] = [(c, m) for c, _, m in (store[i] for i in range(len(store)))]
    ch, cw = layout.canvas_shape(size)
    for name in ("folder", "raw"):
        got = _eval(backends[name], image_size)
        for (path, _), (_, meta), out, ref in zip(samples, backends[name], got, refs, strict=True):
            assert meta[0] == ch and cw - 3 <= meta[1] <= cw, (name, path, meta)  # the short side kept
            assert mad(out, ref) <= 2.0, (name, path, mad(out, ref))
    # the JPEG store holds the raw store's pixels, encoded at JPEG_QUALITY where it re-encodes them (that
    # encoding's loss is the JPEG store's own, the same for any image); the meta it records is what they
    # decode to
    jpeg_meta = np.stack([m for _, m in backends["jpeg"]])
    np.testing.assert_array_equal(jpeg_meta, np.stack([m for _, m in backends["raw"]]))
    np.testing.assert_array_equal(HDF5ImageDataset(tmp_path / "jpeg.h5").meta, jpeg_meta)
    for (path, _), (raw, meta), (jpeg, _) in zip(samples, backends["raw"], backends["jpeg"], strict=True):
        region = raw[: meta[0], : meta[1]]
        upright = region.transpose(1, 0, 2) if meta[2] else region  # the store encodes the upright image
        buf = io.BytesIO()
        Image.fromarray(upright).save(buf, format="JPEG", quality=JPEG_QUALITY)
        encoded = np.asarray(Image.open(buf).convert("RGB"))
        encoded = encoded.transpose(1, 0, 2) if meta[2] else encoded
        assert min(mad(jpeg[: meta[0], : meta[1]], r) for r in (region, encoded)) <= 1.0, path


@pytest.mark.parametrize("size", [37, 64])
def test_the_cut_keeps_torchvision_pixel_grid(tmp_path, size):
    """Noise, where a crop one pixel off differs by tens of levels: the stored cut sits on torchvision's
    pixel grid and its centre crop is torchvision's, whatever the resized length modulo 4."""
    image_size = {37: 32, 64: 56}[size]
    rng = np.random.default_rng(0)
    for k, width in enumerate(range(4 * size, 4 * size + 8)):  # every resized length modulo 4, twice
        arr = rng.integers(0, 256, (size, width, 3), dtype=np.uint8)
        for arr_k in (arr, arr.transpose(1, 0, 2).copy()):
            path = save(arr_k, tmp_path / f"n{k}_{arr_k.shape[0]}.png")
            canvas, meta = load_canvas(path, size)
            out = _eval([(canvas, meta)], image_size)[0]
            assert mad(out, _reference(path, image_size)) <= 1.0, (width, arr_k.shape)


def test_center_crop_offsets_of_the_cut_add_up_to_torchvision():
    """For every resized length, the cut's start plus the evaluation box's offset in the stored cut is
    torchvision's ``CenterCrop`` offset in the whole resized image."""
    for size, image_size in ((37, 32), (64, 56), (256, 224)):
        cw = layout.canvas_shape(size)[1]
        for long in range(cw + 1, cw + 400):
            start, length = layout.cut_window(long, size)
            assert start % 2 == 0 and start + length <= long and cw - 3 <= length <= cw
            box = center_crop_boxes(torch.tensor([float(size)]), torch.tensor([float(length)]), image_size)
            assert start + float(box[0, 0]) == round((long - image_size) / 2), (size, long)
            assert float(box[0, 2]) == image_size


def test_shapes_that_fit_are_not_cut():
    for size in (1, 2, 37, 256):
        cw = layout.canvas_shape(size)[1]
        for long in range(size, cw + 1):
            assert layout.cut_window(long, size) == (0, long)


@pytest.mark.parametrize("storage_size", [37, 64])
def test_meta_is_what_the_canvas_holds(storage_size):
    ch, cw = layout.canvas_shape(storage_size)
    for width, height in [*SHAPES, (20000, 20), (4000, 1000), (300, 200), (200, 300), (50, 50)]:
        rw, rh = layout.resized_size(width, height, storage_size)
        assert min(rw, rh) == storage_size
        assert max(rw, rh) == int(storage_size * max(width, height) / min(width, height))
        canvas, meta = layout.place_on_canvas(np.ones((rh, rw, 3), dtype=np.uint8), storage_size)
        np.testing.assert_array_equal(meta, layout.stored_meta(width, height, storage_size))
        assert meta[0] == min(ch, rh, rw) and meta[1] <= cw and meta[2] == int(rh > rw)
        assert canvas[: meta[0], : meta[1]].all() and canvas.sum() == 3 * meta[0] * meta[1]


def test_dali_evaluates_elongated_images_as_torchvision(elongated):
    pytest.importorskip("nvidia.dali")
    from lightning_gpuopt.data.dali import DALILoader, DALIOptions

    image_size = 32
    _, samples = scan_image_folder(elongated)
    files = [p for p, _ in samples]
    loader = DALILoader(
        files, list(range(len(files))), batch_size=len(files), image_size=image_size, train=False,
        mean=ZERO, std=ONE, options=DALIOptions(threads=2),
    )  # fmt: skip
    images, _ = next(iter(loader))
    got = (images.float() * 255.0).permute(0, 2, 3, 1).numpy()
    for path, out in zip(files, got, strict=True):
        assert mad(out, _reference(path, image_size)) <= 2.0, path


def test_dali_evaluation_resize_and_crop_follow_torchvision_on_elongated_images():
    """DALI's evaluation arithmetic (``_torchvision_resize``, ``_center_crop_pos``) evaluated on integers."""
    from types import SimpleNamespace

    from lightning_gpuopt.data.dali_pipeline import _center_crop_pos, _torchvision_resize

    fn = SimpleNamespace(cast=lambda x, dtype: np.asarray(x).astype(dtype))
    types = SimpleNamespace(INT64=np.int64, FLOAT=np.float64)
    image_size = 32
    resize = eval_resize_size(image_size)
    for w, h in [*SHAPES, (20000, 20), (4000, 1000), (1000, 4000), (37, 37)]:
        new_w, new_h = _torchvision_resize(fn, types, np.array([h, w], dtype=np.int64), resize)
        ref_w, ref_h = tv_resize(Image.new("RGB", (w, h)), resize).size
        assert (int(new_w), int(new_h)) == (ref_w, ref_h)
        for length in (ref_w, ref_h):
            pos = float(_center_crop_pos(fn, types, np.int64(length), image_size))
            assert pos * (length - image_size) == pytest.approx(round((length - image_size) / 2))


def test_reduced_scale_decode_stays_within_two_levels(monkeypatch):
    """A JPEG four times the target decodes at a reduced DCT scale; noise, the worst case, stays in bound."""
    from lightning_gpuopt.data.folder import decode_canvas

    rng = np.random.default_rng(0)
    for (w, h), size in (((2048, 512), 64), ((1600, 1200), 37), ((800, 800), 64)):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=95)
        assert layout.draft_size(w, h, layout.resized_size(w, h, size)) is not None
        drafted, meta = decode_canvas(buf.getvalue(), size)
        with monkeypatch.context() as m:
            m.setattr(layout, "draft_size", lambda *args: None)
            full, full_meta = decode_canvas(buf.getvalue(), size)
        np.testing.assert_array_equal(meta, full_meta)
        assert mad(drafted, full) <= 2.0, (w, h, size)


@pytest.mark.parametrize("fmt", ["raw", "jpeg"])
def test_a_store_of_the_earlier_layout_is_refused_with_the_fix(elongated, tmp_path, fmt):
    """A store written when elongated images were shrunk to fit (layout version 1) is not read as this one."""
    h5py = pytest.importorskip("h5py")
    out = tmp_path / f"old_{fmt}.h5"
    convert_folder_to_hdf5(elongated, out, 37, workers=1, progress=False, format=fmt)
    with h5py.File(out, "r+") as f:
        f.attrs["layout_version"] = 1
    older = r"another lightning-gpuopt \(format version \d+, layout version 1;.*--overwrite"
    with pytest.raises(ValueError, match=older):
        HDF5ImageDataset(out)
