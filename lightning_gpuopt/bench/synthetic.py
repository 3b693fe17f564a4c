"""Generated JPEG folders for the demo, the benchmarks and the tests: files that cost a decoder what
ImageNet's do (``imagenet_like``), each class its own hue so that a model can learn the labels."""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from lightning_gpuopt._common import available_cpus

_MANIFEST = "lightning_gpuopt_synthetic.json"
#: ``image_size`` value that draws each image's size and mode from ``imagenet_like``
IMAGENET = "imagenet"
#: shares of grey and CMYK images among ``imagenet_like``'s (ImageNet holds a few of each)
GREY_SHARE, CMYK_SHARE = 0.02, 0.02
#: the long side of most ImageNet images (Flickr's 500 px download size) and the share of images at it
_CAPPED_LONG, _CAPPED_SHARE = 500, 0.55
#: aspect ratios (long / short) and their weights; the last entry stands for a continuous spread
_ASPECTS = ((4 / 3, 0.6), (3 / 2, 0.2), (1.0, 0.06), (16 / 9, 0.04), (None, 0.1))
_PORTRAIT_SHARE = 0.25
#: the sides ``imagenet_like`` draws from: widths (and heights) 200 to 1,000 px, aspect ratios 0.5 to 2
SIDE_RANGE = (200, 1000)


class ImageSpec(NamedTuple):
    """One generated image's ``width``, ``height`` and PIL ``mode`` (``"RGB"``, ``"L"`` or ``"CMYK"``)."""

    width: int
    height: int
    mode: str


def imagenet_like(seed: int, index: int) -> ImageSpec:
    """The size and mode of image ``index`` of a folder generated with ``seed`` (``image_size="imagenet"``):
    most 500 px on the long side, the rest with a shorter side around 400 px, aspects as ``_ASPECTS``, a
    quarter portrait, ``GREY_SHARE`` grey and ``CMYK_SHARE`` CMYK; the same arguments give the same spec."""
    rng = np.random.default_rng((seed, index, 0x1A6E))
    weights = np.array([w for _, w in _ASPECTS])
    pick = int(rng.choice(len(_ASPECTS), p=weights / weights.sum()))
    aspect = _ASPECTS[pick][0] or float(rng.uniform(1.1, 2.0))
    if rng.random() < _CAPPED_SHARE:
        long_side = _CAPPED_LONG
        short = round(long_side / aspect)
    else:
        short = int(np.clip(round(400 * np.exp(rng.normal(0.0, 0.25))), SIDE_RANGE[0], 800))
        long_side = round(short * aspect)
        if long_side > SIDE_RANGE[1]:
            long_side, short = SIDE_RANGE[1], round(SIDE_RANGE[1] / aspect)
    portrait = rng.random() < _PORTRAIT_SHARE
    width, height = (short, long_side) if portrait else (long_side, short)
    u = rng.random()
    mode = "L" if u < GREY_SHARE else "CMYK" if u < GREY_SHARE + CMYK_SHARE else "RGB"
    return ImageSpec(int(width), int(height), mode)


def _class_color(label: int, num_classes: int) -> np.ndarray:
    import colorsys

    r, g, b = colorsys.hsv_to_rgb(label / max(num_classes, 1), 0.7, 0.85)
    return np.array([r, g, b], dtype=np.float32) * 255.0


def _make_image(
    seed: int, label: int, num_classes: int, width: int, height: int, texture: float, photo: bool = False
) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = _class_color(label, num_classes)
    # low-frequency field: a coarse random grid upsampled bilinearly
    field = _bilinear(rng.normal(0.0, 40.0, size=(6, 8, 3)).astype(np.float32), height, width)
    img = base[None, None, :] + field
    if photo:
        _add_shapes(img, rng)
        # texture strength varies across the image, as detail does in a photo (smooth sky, busy grass)
        amp = _bilinear(rng.uniform(0.35, 1.65, size=(4, 5, 1)).astype(np.float32), height, width)
        noise = rng.standard_normal(size=(height, width, 3), dtype=np.float32)
        noise *= amp * np.float32(texture)
        img += noise
    else:
        img += rng.normal(0.0, texture, size=(height, width, 3)).astype(np.float32)
    return img.clip(0, 255).astype(np.uint8)


def _bilinear(coarse: np.ndarray, height: int, width: int) -> np.ndarray:
    """``coarse`` (``(rows, cols, channels)``) upsampled bilinearly to ``(height, width, channels)``."""
    ys = np.linspace(0, coarse.shape[0] - 1, height, dtype=np.float32)
    xs = np.linspace(0, coarse.shape[1] - 1, width, dtype=np.float32)
    y0 = np.floor(ys).astype(int).clip(0, coarse.shape[0] - 2)
    x0 = np.floor(xs).astype(int).clip(0, coarse.shape[1] - 2)
    wy = (ys - y0)[:, None, None]
    wx = (xs - x0)[None, :, None]
    rows = coarse[:, x0] * (1 - wx) + coarse[:, x0 + 1] * wx  # (rows, width, channels): along x first
    top = rows[y0]
    return top + (rows[y0 + 1] - top) * wy


def _add_shapes(img: np.ndarray, rng: np.random.Generator) -> None:
    """A few sharp-edged discs and boxes of random colours (the edges a photo's objects give)."""
    height, width = img.shape[:2]
    for _ in range(int(rng.integers(2, 6))):
        cy, cx = rng.uniform(0, height), rng.uniform(0, width)
        ry, rx = rng.uniform(0.05, 0.3) * height, rng.uniform(0.05, 0.3) * width
        colour = rng.normal(0.0, 60.0, size=3).astype(np.float32)
        disc = rng.random() < 0.5
        y0, y1 = max(0, int(cy - ry)), min(height, int(cy + ry) + 1)
        x0, x1 = max(0, int(cx - rx)), min(width, int(cx + rx) + 1)
        if y0 >= y1 or x0 >= x1:
            continue
        region = img[y0:y1, x0:x1]
        if disc:
            yy, xx = np.ogrid[y0:y1, x0:x1]
            region[((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1.0] += colour
        else:
            region += colour


def _write_one(job: tuple[str, int, int, int, int, str, dict[str, Any]]) -> int:
    from PIL import Image

    path, seed, label, width, height, mode, spec = job
    photo = spec["image_size"] == IMAGENET
    arr = _make_image(seed, label, spec["num_classes"], width, height, spec["texture"], photo)
    Image.fromarray(arr).convert(mode).save(path, format="JPEG", quality=spec["quality"])
    return os.path.getsize(path)


def make_jpeg_folder(
    root: str | os.PathLike[str],
    num_images: int = 1024,
    num_classes: int = 10,
    image_size: Sequence[int] | str = IMAGENET,
    seed: int = 0,
    workers: int | None = None,
) -> Path:
    """Write a class-per-subfolder JPEG folder (``root/class_XX/img_XXXXXX.jpg``) and return ``root``.

    A folder already made with the same arguments is reused (a manifest records them); one with other
    contents raises. The same arguments always give the same files.

    Args:
        root: output folder (created).
        num_images: images in total, spread evenly over the classes.
        num_classes: subfolders.
        image_size: ``"imagenet"``: each image's size and mode from ``imagenet_like``, with photo-like
            content; or ``(width, height)`` in pixels for every image, in RGB.
        seed: base seed; image ``i`` uses ``seed + i``.
        workers: processes used to encode (default: the CPUs this process may use).

    Raises:
        ValueError: a bad count or size, or a ``root`` that holds other files.
    """
    if num_images < 1 or num_classes < 1:
        raise ValueError(f"num_images ({num_images}) and num_classes ({num_classes}) must be >= 1")
    if isinstance(image_size, str) and image_size != IMAGENET:
        raise ValueError(f"image_size must be {IMAGENET!r} or (width, height), got {image_size!r}")
    if not isinstance(image_size, str) and (len(image_size) != 2 or min(image_size) < 8):
        raise ValueError(
            f"image_size must be {IMAGENET!r} or (width, height) with both >= 8, got {tuple(image_size)}"
        )
    root = Path(root)
    spec = {
        "num_images": num_images,
        "num_classes": num_classes,
        "image_size": image_size if isinstance(image_size, str) else list(image_size),
        "quality": 90,
        # the per-pixel noise: about ImageNet's mean file for "imagenet", about 110 kB a 500x375 image else
        "texture": 22.0 if image_size == IMAGENET else 28.0,
        "seed": seed,
        "format": "JPEG",
        **({"sides": list(SIDE_RANGE)} if image_size == IMAGENET else {}),  # ``imagenet_like``'s sizes
    }
    manifest = root / _MANIFEST
    if manifest.is_file():
        if json.loads(manifest.read_text()).get("spec") == spec:
            return root
        raise ValueError(
            f"{root} holds a generated folder with other settings; delete it or pick another root"
        )
    if root.exists() and any(root.iterdir()):
        raise ValueError(f"{root} exists and is not empty; pick an empty or new folder")
    # written beside root and renamed into place when complete: an interrupted run leaves no half folder
    tmp = root.with_name(f"{root.name}.tmp-{os.getpid()}")
    try:
        sizes = _write_all(tmp, spec, workers)
        (tmp / _MANIFEST).write_text(
            json.dumps({"spec": spec, "mean_bytes": float(np.mean(sizes))}, indent=1)
        )
        if root.exists():
            root.rmdir()
        tmp.rename(root)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        same = manifest.is_file() and json.loads(manifest.read_text()).get("spec") == spec
        if isinstance(err, OSError) and same:
            return root  # another process made the same folder at the same time
        raise
    return root


def _write_all(folder: Path, spec: dict[str, Any], workers: int | None) -> list[int]:
    mixed = spec["image_size"] == IMAGENET
    jobs = []
    for i in range(spec["num_images"]):
        label = i % spec["num_classes"]
        sub = folder / f"class_{label:02d}"
        sub.mkdir(parents=True, exist_ok=True)
        width, height, mode = imagenet_like(spec["seed"], i) if mixed else (*spec["image_size"], "RGB")
        path = str(sub / f"img_{i:06d}.jpg")
        jobs.append((path, spec["seed"] + i, label, int(width), int(height), mode, spec))
    workers = workers or available_cpus()
    if workers > 1 and len(jobs) >= 64:
        # Ctrl-C reaches the whole process group: the parent reports it, the encoders stop quietly
        with ProcessPoolExecutor(
            max_workers=workers, initializer=signal.signal, initargs=(signal.SIGINT, signal.SIG_IGN)
        ) as pool:
            return list(pool.map(_write_one, jobs, chunksize=16))
    return [_write_one(job) for job in jobs]


def cached_jpeg_folder(
    parent: str | os.PathLike[str],
    num_images: int,
    num_classes: int,
    image_size: Sequence[int] | str,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """``make_jpeg_folder`` under ``parent`` (``jpeg_<N>_<C>c_<W>x<H>`` or ``..._imagenet``), made on first
    use; ``progress`` gets one line saying which."""
    import time

    say = progress or (lambda _msg: None)
    size = image_size if isinstance(image_size, str) else (int(image_size[0]), int(image_size[1]))
    shape = size if isinstance(size, str) else f"{size[0]}x{size[1]}"
    classes = min(num_classes, num_images)
    root = Path(parent).expanduser() / f"jpeg_{num_images}_{classes}c_{shape}"
    cached = (root / _MANIFEST).is_file()
    if cached:
        say(f"using cached generated images {root}")
    else:
        say(f"generating {num_images} {shape} JPEGs in {classes} classes under {root} (once, cached)...")
    t0 = time.perf_counter()
    make_jpeg_folder(root, num_images=num_images, num_classes=classes, image_size=size)
    if not cached:
        say(f"  -> generated in {time.perf_counter() - t0:.1f} s")
    return root
