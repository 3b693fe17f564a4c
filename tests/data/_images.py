"""Test images and small reimplementations of the torchvision references (torchvision is not importable).

``tv_resize``, ``tv_center_crop`` and ``tv_rrc_params`` follow torchvision's ``transforms.Resize`` (PIL
path), ``CenterCrop`` and ``RandomResizedCrop.get_params``.
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw


def natural(width: int, height: int, seed: int) -> Image.Image:
    """A photo-like test image: smooth multi-scale texture with a few hard-edged shapes."""
    rng = np.random.default_rng(seed)
    out = np.zeros((height, width, 3), np.float64)
    for cells, weight in ((3, 0.5), (12, 0.3), (48, 0.2)):
        small = Image.fromarray(rng.integers(0, 256, (cells, cells, 3), dtype=np.uint8))
        out += weight * np.asarray(small.resize((width, height), Image.Resampling.BICUBIC), np.float64)
    image = Image.fromarray(np.clip(out, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x0, y0 = int(rng.integers(0, width - 10)), int(rng.integers(0, height - 10))
        box = (x0, y0, x0 + int(rng.integers(8, width // 3)), y0 + int(rng.integers(8, height // 3)))
        draw.ellipse(box, fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    return image


def smooth_rgb(height: int, width: int, seed: int) -> np.ndarray:
    """A photo-like smooth uint8 image: a few sinusoids a channel (resampling filters agree closely on it)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    rng = np.random.default_rng(seed)
    img = np.zeros((height, width, 3))
    for c in range(3):
        for _ in range(3):
            fx, fy, phase = rng.uniform(0.3, 3.0), rng.uniform(0.3, 3.0), rng.uniform(0, 2 * math.pi)
            img[..., c] += np.sin(2 * math.pi * (fx * x / width + fy * y / height) + phase)
    img = (img - img.min()) / (img.max() - img.min()) * 255
    return img.round().astype(np.uint8)


def coordinate_rgb(height: int, width: int) -> np.ndarray:
    """R = column, G = row, B = 128: a crop's position can be read back from its pixels (sides <= 256)."""
    if height > 256 or width > 256:
        raise ValueError("coordinates are stored in uint8: at most 256 x 256")
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x, y, np.full_like(x, 128)], axis=-1).astype(np.uint8)


def save(array: np.ndarray, path: str | os.PathLike[str], **kwargs: object) -> str:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, **kwargs)
    return os.fspath(path)


def image_folder(
    root: str | os.PathLike[str], num_images: int, num_classes: int, size: tuple[int, int]
) -> Path:
    """A class-per-subfolder folder of smooth JPEGs, ``size = (width, height)``, round-robin over classes."""
    root = Path(root)
    width, height = size
    for i in range(num_images):
        save(
            smooth_rgb(height, width, i),
            root / f"class_{i % num_classes:02d}" / f"img_{i:06d}.jpg",
            quality=90,
        )
    return root


def save_grey16(height: int, width: int, path: str | os.PathLike[str]) -> str:
    """A 16-bit greyscale PNG with a ramp over the whole 0..65535 range."""
    ramp = np.linspace(0, 65535, height * width).reshape(height, width)
    ramp = (ramp + 300 * np.sin(np.arange(width) / 7.0)[None, :]).clip(0, 65535)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(ramp.astype(np.uint16)).save(path)
    return os.fspath(path)


def grey16_as_rgb8(path: str | os.PathLike[str]) -> Image.Image:
    """The reference 8-bit version of a 16-bit PNG: value / 257, rounded, as RGB."""
    arr = np.asarray(Image.open(path)).astype(np.float64)
    grey = np.round(arr / 257.0).astype(np.uint8)
    return Image.fromarray(np.stack([grey] * 3, axis=-1))


def tv_resize(img: Image.Image, size: int) -> Image.Image:
    """torchvision ``Resize(size)`` of a PIL image: shorter side to ``size``, longer ``int(size*long/short)``."""
    w, h = img.size
    short, long = min(w, h), max(w, h)
    new_short, new_long = size, int(size * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    return img.resize((new_w, new_h), Image.Resampling.BILINEAR)


def tv_center_crop(array: np.ndarray, size: int) -> np.ndarray:
    """torchvision ``CenterCrop(size)`` of an HWC array (``int(round(...))`` offsets)."""
    h, w = array.shape[:2]
    top, left = round((h - size) / 2.0), round((w - size) / 2.0)
    return array[top : top + size, left : left + size]


def tv_rrc_params(
    rng: random.Random,
    height: int,
    width: int,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
) -> tuple[int, int, int, int]:
    """torchvision ``RandomResizedCrop.get_params``: ``(top, left, crop_h, crop_w)``."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        h, w = height, round(height * max(ratio))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def mad(a: np.ndarray, b: np.ndarray) -> float:
    """Mean absolute difference in levels of 255."""
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).mean())


def crop_boxes(images: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(top, left, height, width)`` of each output's crop in an original ``coordinate_rgb`` image, and
    whether it is flipped, read back from normalized outputs (mean 0, std 1: pixel / 255) ``(N, 3, S, S)``:
    a linear fit of each output row and column (linear interpolation of a linear ramp stays linear)."""
    pixels = images.float().cpu().numpy() * 255.0
    out = pixels.shape[-1]
    j = np.arange(out, dtype=np.float64)
    inner = slice(2, out - 2)  # border pixels see the image edge through the resampling filter
    boxes, flips = [], []
    for img in pixels:
        row = img[0].mean(axis=0)  # R = column: depends on the output column only
        col = img[1].mean(axis=1)  # G = row
        flipped = np.polyfit(j[inner], row[inner], 1)[0] < 0
        if flipped:
            row = row[::-1]
        box = []
        for profile in (col, row):
            slope, intercept = np.polyfit(j[inner], profile[inner], 1)
            # output pixel j samples the original at start + (j + 0.5) * size / out, where value = coord - 0.5
            box.append((intercept - 0.5 * slope + 0.5, slope * out))
        (top, h), (left, w) = box
        boxes.append((top, left, h, w))
        flips.append(flipped)
    return np.array(boxes), np.array(flips)


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic."""
    grid = np.sort(np.concatenate([a, b]))
    cdf_a = np.searchsorted(np.sort(a), grid, side="right") / a.size
    cdf_b = np.searchsorted(np.sort(b), grid, side="right") / b.size
    return float(np.abs(cdf_a - cdf_b).max())


def crop_coverage(boxes: np.ndarray, points: list[tuple[float, float]]) -> np.ndarray:
    """How often each ``(y, x)`` point lies inside a ``(top, left, height, width)`` box."""
    top, left, h, w = boxes.T
    return np.array([np.mean((top <= y) & (y <= top + h) & (left <= x) & (x <= left + w)) for y, x in points])
