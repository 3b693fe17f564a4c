"""make_jpeg_folder's ImageNet-like images: sizes and aspects spread as ImageNet's, grey and CMYK among them,
realistic JPEG sizes, and the same files from the same seed."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from PIL import Image

from lightning_gpuopt.bench.synthetic import (
    CMYK_SHARE,
    GREY_SHARE,
    IMAGENET,
    cached_jpeg_folder,
    imagenet_like,
    make_jpeg_folder,
)

N_FILES = 24


def _seed_with_every_mode() -> int:
    """The first seed whose first ``N_FILES`` images hold a grey and a CMYK one."""
    return next(s for s in range(1000) if {"L", "CMYK"} <= {imagenet_like(s, i).mode for i in range(N_FILES)})


def test_sizes_aspects_and_modes_are_spread_as_imagenets():
    specs = [imagenet_like(3, i) for i in range(4000)]
    w = np.array([s.width for s in specs])
    h = np.array([s.height for s in specs])
    short, long = np.minimum(w, h), np.maximum(w, h)
    # ImageNet's median image is 500x375, landscape; its sizes spread well beyond
    assert np.median(long) == 500 and np.median(short) == 375
    assert short.min() >= 200 and short.max() <= 800 and np.percentile(short, 95) > 480
    # widths 200 to 1,000 px and aspect ratios 0.5 to 2, both ends reached
    assert w.min() >= 200 and w.max() <= 1000 and w.min() < 260 and w.max() > 950
    assert (w / h).min() >= 0.5 - 1e-3 and (w / h).max() <= 2.0 + 1e-3 and (w / h).min() < 0.55
    assert (w / h).max() > 1.9 and h.max() <= 1000
    assert len(np.unique(short)) > 100 and len(np.unique(long)) > 100
    assert 0.15 < (h > w).mean() < 0.35  # portrait images among landscape ones
    assert (long / short < 1.4).mean() > 0.2 and (long / short > 1.7).mean() > 0.03
    modes = np.array([s.mode for s in specs])
    assert (
        abs((modes == "L").mean() - GREY_SHARE) < 0.01 and abs((modes == "CMYK").mean() - CMYK_SHARE) < 0.01
    )
    # a spec depends on (seed, index) alone, and seeds differ
    assert imagenet_like(3, 17) == specs[17] and [imagenet_like(4, i) for i in range(50)] != specs[:50]


def test_generated_files_follow_their_specs_and_repeat_from_the_seed(tmp_path):
    seed = _seed_with_every_mode()
    roots = [make_jpeg_folder(tmp_path / f"r{k}", N_FILES, 4, seed=seed, workers=1) for k in range(2)]
    files = sorted(roots[0].rglob("*.jpg"))
    assert len(files) == N_FILES
    pixels = total = 0
    for path in files:
        index = int(path.stem.split("_")[1])
        spec = imagenet_like(seed, index)
        with Image.open(path) as img:
            assert img.format == "JPEG" and img.size == (spec.width, spec.height) and img.mode == spec.mode
        pixels += spec.width * spec.height
        total += path.stat().st_size
        twin = roots[1] / path.relative_to(roots[0])
        assert hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(twin.read_bytes()).digest()
    # photo-like content at quality 90: a few bits a pixel, as ImageNet's JPEGs (about 110 kB at 500x375)
    assert 3.0 < 8 * total / pixels < 6.0, 8 * total / pixels
    other = make_jpeg_folder(tmp_path / "other", N_FILES, 4, seed=seed + 1, workers=1)
    first = sorted(other.rglob("*.jpg"))[0]
    assert first.read_bytes() != files[0].read_bytes()


def test_bad_sizes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="image_size must be 'imagenet' or"):
        make_jpeg_folder(tmp_path / "bad", 4, 2, image_size="imagenette")


def test_fixed_sizes_stay_rgb_and_the_cache_names_the_imagenet_folder(tmp_path):
    root = make_jpeg_folder(tmp_path / "fixed", 8, 2, image_size=(64, 48), workers=1)
    assert {(Image.open(p).size, Image.open(p).mode) for p in root.rglob("*.jpg")} == {((64, 48), "RGB")}
    lines: list[str] = []
    cached = cached_jpeg_folder(tmp_path / "cache", 6, 2, IMAGENET, progress=lines.append)
    assert cached.name == "jpeg_6_2c_imagenet" and len(list(cached.rglob("*.jpg"))) == 6
    assert cached_jpeg_folder(tmp_path / "cache", 6, 2, IMAGENET, progress=lines.append) == cached
    assert lines[-1].startswith("using cached generated images")
