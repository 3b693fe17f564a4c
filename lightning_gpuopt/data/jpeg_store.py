"""The compact JPEG store's writing side (read by ``hdf5.JPEGStoreDataset``; its layout is in docs/hdf5.md)."""

from __future__ import annotations

import contextlib
import errno
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lightning_gpuopt.data import layout
from lightning_gpuopt.data._hdf5_writes import StoreFile, pwrite_all
from lightning_gpuopt.data.folder import CorruptImageError, decode_canvas
from lightning_gpuopt.data.hdf5 import (  # noqa: F401 - the store's reader and format, importable from here
    JPEG_FORMAT,
    JPEG_FORMAT_VERSION,
    JPEGStoreDataset,
)

#: quality of images the converter encodes (sources kept as they are keep theirs).
JPEG_QUALITY = 90
_GREY_MODES = ("1", "L", "LA", "I", "F")


def encode_for_store(
    path: str, storage_size: int, quality: int = JPEG_QUALITY
) -> tuple[bytes, np.ndarray, bool]:
    """The bytes the JPEG store keeps for the image at ``path``: ``(jpeg bytes, meta, kept as it is)``.

    A JPEG in RGB or grey no larger than the store needs, or whose re-encoding would be larger, is kept byte
    for byte; any other image is decoded as the raw store's and the part its canvas holds encoded at ``quality``.

    Raises:
        ValueError: the file cannot be read or decoded (the path is named).
    """
    from PIL import Image

    try:
        with open(path, "rb") as fh:
            source = fh.read()
        with Image.open(io.BytesIO(source)) as img:
            (width, height), mode = img.size, img.mode
            keep = img.format == "JPEG" and mode in ("RGB", "L")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise CorruptImageError.of(os.fspath(path), f"{type(err).__name__}: {err}") from err
    target = layout.resized_size(width, height, storage_size)
    if keep and width <= target[0] and height <= target[1]:
        return source, layout.stored_meta(width, height, storage_size), True
    canvas, meta = decode_canvas(source, storage_size, name=os.fspath(path))
    h, w, transposed = meta.tolist()
    region = canvas[:h, :w].transpose(1, 0, 2) if transposed else canvas[:h, :w]
    if mode in _GREY_MODES or mode.startswith("I;16"):
        region = region[..., 0]
    out = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(region)).save(out, format="JPEG", quality=quality)
    if keep and out.tell() >= len(source):
        return source, meta, True
    return out.getvalue(), meta, False


@dataclass(eq=False)
class JPEGStoreWriter(StoreFile):
    """Writes a JPEG store into ``tmp``: the bytes spilled to ``spill_path`` as they arrive, then copied into
    ``/jpeg`` laid out at its exact size."""

    spill_path: Path

    def __post_init__(self) -> None:
        super().__post_init__()
        self.offsets, self.kept = [0], 0
        try:
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
            self.spill = os.open(self.spill_path, flags, 0o600)
        except OSError as err:
            raise self.failed(err) from err

    @property
    def bytes_written(self) -> int:
        return self.offsets[-1]

    def add(self, items: np.ndarray, metas: np.ndarray) -> None:
        """Append encoded images (``(bytes, kept as it is)`` items, in order)."""
        for (data, as_is), meta in zip(items, metas, strict=True):
            try:
                pwrite_all(self.spill, data, self.offsets[-1])
            except OSError as err:
                raise self.failed(err) from err
            self.offsets.append(self.offsets[-1] + len(data))
            self.meta[self.written] = meta
            self.kept += int(as_is)
            self.written += 1

    def _copy_spill(self, fd: int, offset: int) -> None:
        """Copy the spilled bytes into ``fd`` at ``offset`` (in the kernel where it can)."""
        done, size, spill = 0, self.bytes_written, self.spill
        while done < size:
            try:
                n = os.copy_file_range(spill, fd, size - done, done, offset + done)
            except OSError:
                n = os.pwrite(fd, os.pread(spill, min(size - done, 8 << 20), done), offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"copying the JPEG bytes into the store stopped at byte {done}")
            done += n

    def finish(self, keep: np.ndarray, skipped: list[str]) -> None:
        """Lay ``/jpeg`` out, copy the bytes in, then write the tables and the completeness mark."""
        where: list[int] = []
        dcpl = self.allocated(contiguous=True)

        def lay_out(f: Any) -> None:
            blob = f.create_dataset("jpeg", shape=(max(1, self.bytes_written),), dtype=np.uint8, dcpl=dcpl)
            where.append(int(blob.id.get_offset()))
            self.identify(f, JPEG_FORMAT, JPEG_FORMAT_VERSION)

        self.hdf5("w", lay_out)
        try:
            with open(self.tmp, "r+b", buffering=0) as fh:
                self._copy_spill(fh.fileno(), where[0])
        except OSError as err:
            raise self.failed(err) from err
        self.close()
        tables = {"jpeg_offsets": np.asarray(self.offsets, dtype=np.int64)}
        attrs = {"jpeg_quality": JPEG_QUALITY, "jpeg_data_offset": where[0], "num_kept": self.kept}
        self.complete(keep, skipped, tables, attrs)

    def close(self) -> None:
        """Close and remove the spill file."""
        if self.spill >= 0:
            os.close(self.spill)
            with contextlib.suppress(OSError):
                os.unlink(self.spill_path)
            self.spill = -1
