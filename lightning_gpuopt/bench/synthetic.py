"""Generated image folders for demos, benchmarks and tests.

The images are shaped like ImageNet's (default 500x375 JPEG, about 110 kB at quality 90) so that decoding
costs what it costs on real data: smooth colour fields (which JPEG compresses well) plus per-pixel texture
(which it does not). Each class has its own hue, so a model can actually learn the labels.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from lightning_gpuopt._common import available_cpus

_MANIFEST = "lightning_gpuopt_synthetic.json"


def _class_color(label: int, num_classes: int) -> np.ndarray:
    import colorsys

    r, g, b = colorsys.hsv_to_rgb(label / max(num_classes, 1), 0.7, 0.85)
    return np.array([r, g, b], dtype=np.float32) * 255.0


def _make_image(
    seed: int, label: int, num_classes: int, width: int, height: int, texture: float
) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = _class_color(label, num_classes)
    # low-frequency field: a coarse random grid upsampled bilinearly
    coarse = rng.normal(0.0, 40.0, size=(6, 8, 3)).astype(np.float32)
    ys = np.linspace(0, coarse.shape[0] - 1, height, dtype=np.float32)
    xs = np.linspace(0, coarse.shape[1] - 1, width, dtype=np.float32)
    y0 = np.floor(ys).astype(int).clip(0, coarse.shape[0] - 2)
    x0 = np.floor(xs).astype(int).clip(0, coarse.shape[1] - 2)
    wy = (ys - y0)[:, None, None]
    wx = (xs - x0)[None, :, None]
    c00 = coarse[y0][:, x0]
    c01 = coarse[y0][:, x0 + 1]
    c10 = coarse[y0 + 1][:, x0]
    c11 = coarse[y0 + 1][:, x0 + 1]
    field = (c00 * (1 - wx) + c01 * wx) * (1 - wy) + (c10 * (1 - wx) + c11 * wx) * wy
    noise = rng.normal(0.0, texture, size=(height, width, 3)).astype(np.float32)
    img = base[None, None, :] + field + noise
    return img.clip(0, 255).astype(np.uint8)


def _write_one(job: tuple[str, int, int, int, int, int, float, int, str]) -> int:
    from PIL import Image

    path, seed, label, num_classes, width, height, texture, quality, fmt = job
    arr = _make_image(seed, label, num_classes, width, height, texture)
    img = Image.fromarray(arr)
    if fmt == "JPEG":
        img.save(path, format="JPEG", quality=quality)
    else:
        img.save(path, format=fmt)
    return os.path.getsize(path)


def make_jpeg_folder(
    root: str | os.PathLike[str],
    num_images: int = 1024,
    num_classes: int = 10,
    image_size: Sequence[int] = (500, 375),
    quality: int = 90,
    texture: float = 28.0,
    seed: int = 0,
    workers: int | None = None,
    image_format: str = "JPEG",
) -> Path:
    """Write a class-per-subfolder image folder (``root/class_XX/img_XXXXXX.jpg``) and return ``root``.

    A manifest makes the call idempotent: a folder already made with the same arguments is reused, so
    benchmarks pay the generation once. A folder with other contents raises instead of being mixed into.

    Args:
        root: output folder (created).
        num_images: images in total, spread evenly over the classes.
        num_classes: subfolders.
        image_size: ``(width, height)`` in pixels; ImageNet's median is about 500x375.
        quality: JPEG quality.
        texture: standard deviation of per-pixel noise; 28 gives about 110 kB per 500x375 image.
        seed: base seed; image ``i`` uses ``seed + i``.
        workers: processes used to encode (default: the CPUs this process may use).
        image_format: ``"JPEG"`` or ``"PNG"``.
    """
    if num_images < 1 or num_classes < 1:
        raise ValueError(f"num_images ({num_images}) and num_classes ({num_classes}) must be >= 1")
    if len(image_size) != 2 or min(image_size) < 8:
        raise ValueError(f"image_size must be (width, height) with both >= 8, got {tuple(image_size)}")
    image_format = image_format.upper()
    if image_format not in ("JPEG", "PNG"):
        raise ValueError(f"image_format must be 'JPEG' or 'PNG', got {image_format!r}")
    root = Path(root)
    spec = {
        "num_images": num_images,
        "num_classes": num_classes,
        "image_size": list(image_size),
        "quality": quality,
        "texture": texture,
        "seed": seed,
        "format": image_format,
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
        sizes = _write_all(tmp, spec, num_images, num_classes, workers)
        manifest_tmp = tmp / _MANIFEST
        manifest_tmp.write_text(json.dumps({"spec": spec, "mean_bytes": float(np.mean(sizes))}, indent=1))
        if root.exists():
            root.rmdir()
        tmp.rename(root)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if manifest.is_file() and json.loads(manifest.read_text()).get("spec") == spec:
            return root  # another process made the same folder at the same time
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root


def _write_all(
    folder: Path, spec: dict[str, Any], num_images: int, num_classes: int, workers: int | None
) -> list[int]:
    width, height = spec["image_size"]
    image_format = spec["format"]
    ext = ".jpg" if image_format == "JPEG" else ".png"
    jobs = []
    for i in range(num_images):
        label = i % num_classes
        sub = folder / f"class_{label:02d}"
        sub.mkdir(parents=True, exist_ok=True)
        jobs.append(
            (
                str(sub / f"img_{i:06d}{ext}"),
                spec["seed"] + i,
                label,
                num_classes,
                int(width),
                int(height),
                spec["texture"],
                spec["quality"],
                image_format,
            )
        )
    workers = workers or available_cpus()
    if workers > 1 and num_images >= 64:
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
    image_size: Sequence[int],
    progress: Callable[[str], None] | None = None,
) -> Path:
    """The generated folder for these settings under ``parent`` (``jpeg_<N>_<C>c_<W>x<H>``), made on first use.

    Args:
        parent: cache folder (``_common.cache_dir()`` in the commands).
        num_images: images in total.
        num_classes: classes (at most ``num_images``).
        image_size: ``(width, height)`` in pixels.
        progress: called with one line when the folder is generated or reused.
    """
    import time

    say = progress or (lambda _msg: None)
    w, h = int(image_size[0]), int(image_size[1])
    classes = min(num_classes, num_images)
    root = Path(parent).expanduser() / f"jpeg_{num_images}_{classes}c_{w}x{h}"
    if (root / _MANIFEST).is_file():
        say(f"using cached generated images {root}")
        return make_jpeg_folder(root, num_images=num_images, num_classes=classes, image_size=(w, h))
    say(f"generating {num_images} {w}x{h} JPEGs in {classes} classes under {root} (once, cached)...")
    t0 = time.perf_counter()
    make_jpeg_folder(root, num_images=num_images, num_classes=classes, image_size=(w, h))
    say(f"  -> generated in {time.perf_counter() - t0:.1f} s")
    return root
