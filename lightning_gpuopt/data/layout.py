"""How a decoded image is kept on the host: the whole image, resized, on a fixed-size uint8 canvas.

Training crops are drawn from the whole image (torchvision's ``RandomResizedCrop``) and validation is
``Resize(eval_resize_size(image_size)) + CenterCrop(image_size)`` of the whole image, so the host must not
cut anything off. Batches still need one shape, so each image is resized like torchvision's
``Resize(storage_size)`` (shorter side to ``storage_size``) and placed at the top-left of a landscape canvas
of ``storage_size x ceil(storage_size * MAX_ASPECT)``; a portrait image is stored transposed so its long side
lies along the canvas width. An image more elongated than ``MAX_ASPECT`` is shrunk until its long side fits.
Each sample carries ``meta = (h, w, transposed)``: the valid region of the canvas and whether it holds the
image transposed. The GPU side (``GPUAugment``) samples crops inside that region, in the image's own
orientation, so the result is what torchvision would produce from the original image.

A canvas costs ``3 * storage_size * ceil(storage_size * 1.5)`` bytes (294,912 at 256), read at a fixed cost.
"""

from __future__ import annotations

import math
from typing import cast

import numpy as np

from lightning_gpuopt._checks import check_arg, is_int

#: long side / short side the canvas holds at full resolution (covers 4:3 and 3:2 photos).
MAX_ASPECT = 1.5


def canvas_shape(storage_size: int) -> tuple[int, int]:
    """``(height, width)`` of the canvas for ``storage_size`` (the shorter side of a stored image)."""
    check_arg(
        is_int(storage_size) and storage_size >= 1, "storage_size", storage_size, "a positive int (pixels)"
    )
    return storage_size, math.ceil(storage_size * MAX_ASPECT)


def resized_size(width: int, height: int, storage_size: int) -> tuple[int, int]:
    """``(width, height)`` an image of ``width x height`` is resized to before it is placed on the canvas.

    The shorter side becomes ``storage_size`` and the longer ``int(storage_size * long / short)`` exactly as
    torchvision's ``Resize(storage_size)`` computes it; when that exceeds the canvas's long side, the image
    is scaled down further so it fits (aspect kept).
    """
    short, long = min(width, height), max(width, height)
    cap = canvas_shape(storage_size)[1]
    new_short, new_long = storage_size, int(storage_size * long / short)
    if new_long > cap:
        new_short, new_long = max(1, int(cap * short / long)), cap
    return (new_long, new_short) if width >= height else (new_short, new_long)


def to_rgb8(img: object) -> object:
    """A PIL image as 8-bit RGB, scaling high-bit-depth modes instead of clipping them.

    16-bit grey (``I;16*``, and ``I`` holding values above 255) is divided by 257 (65535 -> 255); float
    images (``F``) in ``[0, 1]`` are multiplied by 255, others clipped to ``[0, 255]``; palette, grey, CMYK
    and alpha modes go through PIL's own conversion (alpha is dropped).
    """
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
    """Put an already resized ``(h, w, 3)`` uint8 image on a canvas; return ``(canvas, meta)``.

    A portrait image (``h > w``) is transposed first. ``out`` (canvas-shaped, uint8) is filled in place
    when given; the area outside the image is zero.
    """
    ch, cw = canvas_shape(storage_size)
    transposed = rgb.shape[0] > rgb.shape[1]
    if transposed:
        rgb = rgb.transpose(1, 0, 2)
    h, w = rgb.shape[:2]
    check_arg(
        h <= ch and w <= cw,
        "rgb",
        f"{h}x{w}",
        f"an image that fits a {ch}x{cw} canvas",
        "resize it with resized_size()",
    )
    canvas = np.zeros((ch, cw, 3), dtype=np.uint8) if out is None else out
    canvas[:h, :w] = rgb
    if out is not None:
        canvas[h:, :] = 0
        canvas[:h, w:] = 0
    return canvas, np.array([h, w, int(transposed)], dtype=np.int32)


def draft_size(width: int, height: int, target: tuple[int, int]) -> tuple[int, int] | None:
    """The size to ask a JPEG's reduced-scale decode (``Image.draft``) for, or ``None`` to decode in full.

    The DCT-scaled decode is kept at least twice ``target`` (``(width, height)`` after the resize) on both
    sides, so the bilinear resize that follows still averages over several source pixels; an image whose
    resized shorter side is under 8 pixels (a very elongated one) is decoded in full, where a reduced
    decode would change its few output pixels visibly.
    """
    tw, th = target
    if min(tw, th) < 8 or width < 4 * tw or height < 4 * th:
        return None
    return 2 * tw, 2 * th
