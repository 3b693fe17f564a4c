"""How a decoded image is kept on the host: resized as torchvision's ``Resize`` does, at the top-left of a
uint8 canvas, with ``meta = (h, w, transposed)`` (docs/datamodule.md, "Whole images on a canvas")."""

from __future__ import annotations

import math
from typing import cast

import numpy as np

from lightning_gpuopt._checks import check_arg, check_int, is_int

#: long side / short side the canvas holds at full resolution (covers 4:3 and 3:2 photos).
MAX_ASPECT = 1.5
#: version of this canvas rule a store records. 1: an image more elongated than the canvas shrunk to fit (no
#: longer read); 2: its shorter side kept at storage_size and its long side cut to the canvas (``cut_window``).
LAYOUT_VERSION = 2
#: the rule in words, as the stores record it (their ``resize`` attribute).
RESIZE_DOC = (
    "shorter side resized to storage_size (PIL bilinear, antialiased; torchvision Resize), a long side "
    "longer than the storage_size x ceil(1.5 storage_size) canvas cut to its centre, portrait images "
    "transposed; meta = (h, w, transposed)"
)


def canvas_shape(storage_size: int) -> tuple[int, int]:
    """``(height, width)`` of the canvas for ``storage_size`` (the shorter side of a stored image)."""
    check_int(storage_size, "storage_size", low=1, what="(pixels)")
    return storage_size, math.ceil(storage_size * MAX_ASPECT)


def resized_size(width: int, height: int, storage_size: int) -> tuple[int, int]:
    """``(width, height)`` of a ``width x height`` image after torchvision's ``Resize(storage_size)``."""
    check_arg(
        is_int(width) and is_int(height) and width >= 1 and height >= 1,
        "width/height",
        (width, height),
        "positive ints (pixels)",
    )
    canvas_shape(storage_size)  # checks storage_size
    short, long = min(width, height), max(width, height)
    new_short, new_long = storage_size, int(storage_size * long / short)
    return (new_long, new_short) if width >= height else (new_short, new_long)


def cut_window(long: int, storage_size: int) -> tuple[int, int]:
    """``(start, length)`` of the part of a resized image's long side (``long`` pixels) the canvas keeps: all
    of it where it fits, else its centre, up to 3 pixels under the canvas width so that ``long - length`` is
    a multiple of 4 (torchvision's ``CenterCrop`` offsets, rounding halves to even, then match the cut's)."""
    ch, cw = canvas_shape(storage_size)
    check_int(long, "long", low=1, what="(pixels)")
    if long <= cw:
        return 0, long
    length = cw - (cw - long) % 4
    if length < ch:
        length = cw
    return (long - length) // 2, length


def stored_meta(width: int, height: int, storage_size: int) -> np.ndarray:
    """int32 ``(h, w, transposed)`` a ``width x height`` image gets on the canvas, without decoding it."""
    rw, rh = resized_size(width, height, storage_size)
    transposed = rh > rw
    short, long = (rw, rh) if transposed else (rh, rw)
    return np.array([short, cut_window(long, storage_size)[1], int(transposed)], dtype=np.int32)


def cut_to_canvas(rgb: np.ndarray, storage_size: int) -> np.ndarray:
    """The part of a resized ``(h, w, C)`` image the canvas keeps (a view), cut by ``cut_window``."""
    h, w = rgb.shape[:2]
    start, length = cut_window(max(h, w), storage_size)
    return rgb[start : start + length] if h > w else rgb[:, start : start + length]


def to_rgb8(img: object) -> object:
    """A PIL image as 8-bit RGB, high-bit-depth modes scaled (16-bit by 1/257, floats in ``[0, 1]`` x 255)."""
    from PIL import Image

    check_arg(isinstance(img, Image.Image), "img", type(img).__name__, "a PIL image", error=TypeError)
    pil = cast("Image.Image", img)
    mode = pil.mode
    if mode == "RGB":
        return pil
    if mode.startswith("I;16") or mode == "I" or mode == "F":
        arr = np.asarray(pil)
        if mode == "F":
            arr = arr.astype(np.float64)
            finite = arr[np.isfinite(arr)]
            scale = 255.0 if finite.size and finite.max() <= 1.0 else 1.0
            grey = np.clip(np.nan_to_num(arr) * scale, 0, 255)
        else:
            arr = arr.astype(np.int64)
            sixteen = mode.startswith("I;16") or (arr.size and int(arr.max()) > 255)
            grey = np.clip(arr, 0, 65535) / 257.0 if sixteen else np.clip(arr, 0, 255)
        grey8 = np.round(grey).astype(np.uint8)
        return Image.fromarray(np.stack([grey8] * 3, axis=-1), mode="RGB")
    return pil.convert("RGB")


def place_on_canvas(
    rgb: np.ndarray, storage_size: int, out: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(canvas, meta)``: a ``resized_size`` uint8 image on a canvas (``out`` if given), zero outside it."""
    ch, cw = canvas_shape(storage_size)
    rgb = cut_to_canvas(rgb, storage_size)
    transposed = rgb.shape[0] > rgb.shape[1]
    if transposed:
        rgb = rgb.transpose(1, 0, 2)
    h, w = rgb.shape[:2]
    check_arg(
        h <= ch and w <= cw,
        "rgb",
        f"{h}x{w}",
        f"an image whose shorter side fits a {ch}x{cw} canvas",
        "resize it with resized_size()",
    )
    canvas = np.empty((ch, cw, 3), dtype=np.uint8) if out is None else out
    canvas[:h, :w] = rgb
    canvas[h:, :] = 0
    canvas[:h, w:] = 0
    return canvas, np.array([h, w, int(transposed)], dtype=np.int32)


def draft_size(width: int, height: int, target: tuple[int, int]) -> tuple[int, int] | None:
    """The size to ask a JPEG's reduced-scale decode (``Image.draft``) for: twice ``target`` for a JPEG at
    least four times it (the resize then stays within 2/255 mean absolute of a full decode's), else None."""
    tw, th = target
    if min(tw, th) < 8 or width < 4 * tw or height < 4 * th:
        return None
    return 2 * tw, 2 * th
