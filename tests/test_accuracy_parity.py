"""Accuracy parity (``benchmarks/accuracy_parity.py``): the reference transforms, the data sets, and the
CPU-sized parity run on the border data set."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import _parity_data as pdata
import accuracy_parity as parity


# ------------------------------------------------------------------ RandomResizedCrop, as documented
def _documented_rrc(rng: np.random.Generator, width: int, height: int, scale, ratio):
    """torchvision's RandomResizedCrop.get_params written from its documentation, with numpy's generator."""
    area = width * height
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(lo, hi))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        w, h = round(height * max(ratio)), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _ks(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic."""
    grid = np.sort(np.concatenate([a, b]))
    cdf_a = np.searchsorted(np.sort(a), grid, side="right") / len(a)
    cdf_b = np.searchsorted(np.sort(b), grid, side="right") / len(b)
    return float(np.abs(cdf_a - cdf_b).max())


def _features(boxes: list[tuple[int, int, int, int]], width: int, height: int) -> dict[str, np.ndarray]:
    arr = np.array(boxes, dtype=np.float64)
    top, left, h, w = arr.T
    return {
        "area": h * w / (width * height),
        "log_aspect": np.log(w / h),
        "centre_x": (left + w / 2) / width,
        "centre_y": (top + h / 2) / height,
    }


@pytest.mark.parametrize(("width", "height"), [(64, 48), (48, 64), (500, 375), (40, 40)])
def test_rrc_params_distribution_matches_the_documented_algorithm(width, height):
    n = 4000
    gen = torch.Generator().manual_seed(1)
    ours = [pdata.rrc_params(width, height, generator=gen) for _ in range(n)]
    rng = np.random.default_rng(2)
    documented = [_documented_rrc(rng, width, height, (0.08, 1.0), (3 / 4, 4 / 3)) for _ in range(n)]
    for top, left, h, w in ours:
        assert top >= 0 and left >= 0 and top + h <= height and left + w <= width and h > 0 and w > 0
    a, b = _features(ours, width, height), _features(documented, width, height)
    critical = 1.95 * math.sqrt(2 / n)  # two-sample KS at alpha = 0.001
    for name in a:
        assert _ks(a[name], b[name]) < critical, name


def test_rrc_params_stay_in_scale_and_ratio_when_a_box_fits():
    gen = torch.Generator().manual_seed(0)
    width, height = 400, 300
    for _ in range(2000):
        _, _, h, w = pdata.rrc_params(width, height, generator=gen)
        # rounding to whole pixels moves the area and aspect by at most a pixel's share
        assert 0.08 - 2 / 300 <= h * w / (width * height) <= 1.0
        assert 3 / 4 - 0.02 <= w / h <= 4 / 3 + 0.02


def test_rrc_params_fallback_is_the_centred_ratio_clamped_image():
    gen = torch.Generator().manual_seed(0)
    # no box of >= 90 % of a 100x10 image has an aspect ratio <= 4/3: the fallback applies
    assert pdata.rrc_params(100, 10, scale=(0.9, 1.0), generator=gen) == (0, 43, 10, 13)
    assert pdata.rrc_params(10, 100, scale=(0.9, 1.0), generator=gen) == (43, 0, 13, 10)
    assert pdata.rrc_params(30, 30, scale=(1.0, 1.0), ratio=(2.0, 3.0), generator=gen) == (7, 0, 15, 30)


@pytest.mark.skipif(not pdata.torchvision_available(), reason="torchvision does not import here")
def test_rrc_params_equal_torchvision_draw_for_draw():
    from PIL import Image
    from torchvision.transforms import RandomResizedCrop

    img = Image.new("RGB", (123, 77))
    for seed in range(50):
        torch.manual_seed(seed)
        expected = RandomResizedCrop.get_params(img, [0.08, 1.0], [3 / 4, 4 / 3])
        torch.manual_seed(seed)
        assert pdata.rrc_params(123, 77) == tuple(expected)


def test_resize_and_center_crop_geometry_follow_torchvision():
    assert pdata.resize_shorter_size(640, 480, 256) == (341, 256)
    assert pdata.resize_shorter_size(480, 640, 256) == (256, 341)
    assert pdata.resize_shorter_size(64, 48, 37) == (49, 37)
    # Python's round (half to even), as torchvision's center_crop uses: (341 - 224) / 2 = 58.5 -> 58
    assert pdata.center_crop_box(341, 256, 224) == (16, 58)
    assert pdata.center_crop_box(49, 37, 32) == (2, 8)


def test_reference_validation_transform_pixels():
    from PIL import Image

    rng = np.random.default_rng(0)
    arr = rng.integers(0, 256, size=(48, 64, 3), dtype=np.uint8)
    img = Image.fromarray(arr)
    out = pdata.reference_transform(32, train=False, use_torchvision=False)(img)
    assert out.shape == (3, 32, 32)
    resized = np.asarray(img.resize((49, 37), Image.Resampling.BILINEAR))[2:34, 8:40]
    mean = torch.tensor(pdata.IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(pdata.IMAGENET_STD).view(3, 1, 1)
    expected = (torch.from_numpy(resized.copy()).permute(2, 0, 1).float() / 255 - mean) / std
    torch.testing.assert_close(out, expected)


def test_reference_training_transform_crops_flips_and_normalizes():
    from PIL import Image

    torch.manual_seed(0)
    transform = pdata.reference_transform(16, train=True, use_torchvision=False)
    colour = np.array([200, 100, 50], dtype=np.uint8)
    img = Image.fromarray(np.broadcast_to(colour, (30, 40, 3)).copy())
    out = transform(img)
    expected = (torch.tensor(colour / 255.0) - torch.tensor(pdata.IMAGENET_MEAN)) / torch.tensor(
        pdata.IMAGENET_STD
    )
    assert out.shape == (3, 16, 16)
    torch.testing.assert_close(out.mean((1, 2)), expected.float(), atol=1e-5, rtol=0)
    # the flip: a left-half-white image ends white on the right about half the time
    half = np.zeros((16, 16, 3), dtype=np.uint8)
    half[:, :8] = 255
    flip = pdata.RandomHorizontalFlip()
    flipped = sum(np.asarray(flip(Image.fromarray(half)))[0, -1, 0] == 255 for _ in range(1000))
    assert 440 <= flipped <= 560


def test_reference_image_folder_labels_follow_sorted_class_folders(tmp_path):
    from PIL import Image

    for cls in ("b", "a", "c"):
        (tmp_path / cls).mkdir()
        Image.new("RGB", (8, 6)).save(tmp_path / cls / "x.png")
    ds = pdata.ReferenceImageFolder(tmp_path, pdata.Compose([pdata.ToNormalizedTensor()]))
    assert ds.classes == ["a", "b", "c"]
    assert [label for _, label in ds.samples] == [0, 1, 2]
    assert ds[1][0].shape == (3, 6, 8)


# ------------------------------------------------------------------ the border data set
def _coloured_pixels(path: Path) -> tuple[tuple[int, int], np.ndarray, np.ndarray]:
    """``((w, h), xs, ys)``: the size of a border image and where its coloured (square) pixels are."""
    from PIL import Image

    arr = np.asarray(Image.open(path).convert("RGB")).astype(int)
    ys, xs = np.nonzero(arr.max(-1) - arr.min(-1) > 80)  # the clutter is grey: only squares are saturated
    return (arr.shape[1], arr.shape[0]), xs, ys


def test_border_set_puts_training_evidence_outside_the_centre_square(tmp_path):
    train, val = pdata.make_dataset(
        "border", tmp_path, train_per_class=6, val_per_class=6, image_long_side=64
    )
    portrait = 0
    for path in sorted(train.rglob("*.jpg")):
        (w, h), xs, ys = _coloured_pixels(path)
        long, short = max(w, h), min(w, h)
        assert (long, short) == (64, 48)
        portrait += h > w
        along = xs if w > h else ys
        assert (along < long // 8).any() and (along >= long - long // 8).any(), path  # a square at each end
        # none inside the centre square, whose sides lie (long - short) / 2 = 8 pixels from the ends
        assert ((along < long // 8) | (along >= long - long // 8)).all(), path
    assert 0 < portrait < 24
    for path in sorted(val.rglob("*.jpg")):
        (w, h), xs, ys = _coloured_pixels(path)
        assert len(xs) > 0
        size = 32  # the evaluation crop at image_size 32: Resize(37) + CenterCrop(32)
        rw, rh = pdata.resize_shorter_size(w, h, 37)
        top, left = pdata.center_crop_box(rw, rh, size)
        sx, sy = rw / w, rh / h
        assert left <= xs.min() * sx and (xs.max() + 1) * sx <= left + size, path
        assert top <= ys.min() * sy and (ys.max() + 1) * sy <= top + size, path


def test_make_dataset_reuses_a_matching_set(tmp_path):
    kw = {"train_per_class": 2, "val_per_class": 1, "image_long_side": 48}
    train, _ = pdata.make_dataset("border", tmp_path, **kw)
    first = sorted(p.stat().st_mtime_ns for p in train.rglob("*.jpg"))
    pdata.make_dataset("border", tmp_path, **kw)
    assert sorted(p.stat().st_mtime_ns for p in train.rglob("*.jpg")) == first
    pdata.make_dataset("border", tmp_path, **{**kw, "train_per_class": 3})
    assert len(list(train.rglob("*.jpg"))) == 3 * len(pdata.BORDER_COLOURS)
    with pytest.raises(ValueError, match="dataset must be one of"):
        pdata.make_dataset("faces", tmp_path, **kw)


# ------------------------------------------------------------------ the criterion
def test_within_compares_median_seeds_by_twice_the_reference_std_or_one_point():
    def row(name, seeds, std):
        mean = sum(seeds) / len(seeds) if seeds else None
        return {"name": name, "top1_mean": mean, "top1_std": std, "top1": seeds}

    rows = [
        row("reference", [77.0, 80.0, 83.0], 3.0),
        row("folder", [73.5, 74.5, 75.5], 1.0),
        row("hdf5", [73.0, 73.9, 74.8], 0.0),
        row("dali", [], None),
    ]
    assert parity.within(rows) == {"folder": True, "hdf5": False, "dali": None}
    rows = [row("reference", [80.0] * 3, 0.1), row("folder", [79.1] * 3, 0.0), row("hdf5", [78.9] * 3, 0.0)]
    assert parity.within(rows) == {"folder": True, "hdf5": False}
    # one seed that did not converge moves the median of neither; two do
    rows = [row("reference", [100.0] * 3, 0.0), row("folder", [100.0, 100.0, 75.0], 14.4),
            row("hdf5", [100.0, 75.0, 75.0], 14.4)]  # fmt: skip
    assert parity.within(rows) == {"folder": True, "hdf5": False}


# ------------------------------------------------------------------ the CPU-sized parity run
@pytest.mark.slow
def test_border_parity_on_cpu(tmp_path):
    """The whole-image pipelines learn border evidence as torchvision's transforms do (3 seeds each), and a
    pipeline that trains on the centre square only does not (so the parity is not parity at chance). The
    training process's decoding threads are left out here: their canvases equal the folder backend's pixel
    for pixel (``tests/data/test_decode.py``), and a fourth pipeline would add minutes to the suite;
    ``benchmarks/accuracy_parity.py --rows reference,threads`` runs them."""
    cfg = parity.SIZES["cpu"]
    result = parity.run_parity("border", cfg, "cpu", ["reference", "folder", "hdf5"], tmp_path)
    rows = {r["name"]: r for r in result["rows"]}
    summary = {k: (round(r["top1_mean"], 1), round(r["top1_std"], 1)) for k, r in rows.items()}
    assert rows["reference"]["seeds"] == [0, 1, 2]
    assert result["within"] == {"folder": True, "hdf5": True}, summary
    assert rows["reference"]["top1_mean"] >= 80.0, summary  # chance is 25 %
    data = parity.prepare_data("border", cfg, "cpu", tmp_path, [])
    control = parity.train_once(parity.CONTROL, 0, data, len(pdata.BORDER_COLOURS), cfg)
    assert control["top1"] <= 45.0, (control, summary)


def test_parallel_fits_give_the_serial_figures(tmp_path):
    """``jobs`` runs fits in spawned processes; each seed's figure is the one a serial run gives."""
    from dataclasses import replace

    cfg = replace(
        parity.SIZES["cpu"],
        epochs=1,
        seeds=(0, 1),
        train_per_class={"border": 8},
        val_per_class={"border": 4},
        batch_size=8,
    )
    serial = parity.run_parity("border", cfg, "cpu", ["folder"], tmp_path)
    parallel = parity.run_parity("border", replace(cfg, jobs=2), "cpu", ["folder"], tmp_path)
    assert [r["top1"] for r in parallel["rows"]] == [r["top1"] for r in serial["rows"]]
    assert parallel["rows"][0]["seeds"] == [0, 1] and len(parallel["rows"][0]["top1"]) == 2
