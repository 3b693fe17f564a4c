"""Source images smaller than the size a conversion stores them at (``_common.upsamples``): ``convert`` warns."""

from __future__ import annotations

import os
from collections.abc import Iterable

from lightning_gpuopt._common import upsamples, warn_at_user


def source_size(path: str | os.PathLike[str]) -> tuple[int, int]:
    """``(width, height)`` of the image file at ``path`` from its header, ``(0, 0)`` where it cannot be read."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            return img.size
    except Exception:  # the decode that follows names the file and the reason
        return 0, 0


def smaller_sources(
    sizes: Iterable[tuple[int, int]], storage_size: int
) -> tuple[int, tuple[int, int] | None]:
    """How many of ``sizes`` (``(width, height)``, ``(0, 0)``: unknown) have a shorter side that
    ``storage_size`` upsamples, and the size of the one with the shortest side (``None`` when none)."""
    small = [wh for wh in sizes if min(wh) > 0 and upsamples(min(wh), storage_size)]
    return len(small), min(small, key=min, default=None)


def warn_upsampled(count: int, total: int, smallest: tuple[int, int], storage_size: int) -> None:
    """Warn that ``count`` of ``total`` sources are smaller than ``storage_size``, and which size upsamples none."""
    short = min(smallest)
    warn_at_user(
        f"{count} of {total} source images have a shorter side below storage_size={storage_size} (the smallest "
        f"{smallest[0]}x{smallest[1]}): they are upsampled to it, which adds no detail; storage_size={short} "
        f"keeps every image at most at its own size (OptimizedDataModule then takes image_size <= {short})"
    )
