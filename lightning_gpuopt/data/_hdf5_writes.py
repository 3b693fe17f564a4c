"""Writing a store file: every failed write (full disk, quota, file size limit) an ``OSError`` naming the file,
never a half-flushed HDF5 file the library cannot close."""

from __future__ import annotations

import errno
import io
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lightning_gpuopt.data import layout
from lightning_gpuopt.data.hdf5 import COMPLETE_ATTR


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


class HDF5Writes(io.FileIO):
    """The file HDF5 writes through, the first failed write kept in ``error`` and later ones only pretended:
    HDF5 left with a file it could not flush fails to close it, then crashes the interpreter at exit."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, "r+")
        self.error: OSError | None = None

    def _unless_failed(self, op: Callable[..., Any], *args: Any) -> None:
        if self.error is None:
            try:
                op(*args)
            except OSError as err:
                self.error = err

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        self._unless_failed(pwrite_all, self.fileno(), data, self.tell())
        self.seek(size, os.SEEK_CUR)
        return size

    def truncate(self, size: int | None = None) -> int:
        size = self.tell() if size is None else size
        self._unless_failed(super().truncate, size)
        return size


@dataclass(eq=False)
class StoreFile:
    """A store being written into ``tmp``: the images (by the subclass), then, once they are flushed, the
    tables, root attributes and completeness mark in one last HDF5 pass (``complete``)."""

    h5py: Any
    tmp: Path
    classes: list[str]
    rel: list[str]
    labels: np.ndarray
    storage_size: int
    source: str

    def __post_init__(self) -> None:
        self.meta = np.zeros((len(self.rel), 3), dtype=np.int32)
        self.written = 0

    def failed(self, err: OSError) -> OSError:
        return OSError(
            err.errno,
            f"writing {str(self.tmp)!r} failed ({err.strerror or err}); the output was not written "
            "(check free space and quotas)",
        )

    def hdf5(self, mode: str, work: Callable[[Any], None]) -> None:
        """Open ``tmp`` with HDF5 in ``mode``, run ``work(file)``, close; a failed write raises ``OSError``."""
        fh = HDF5Writes(self.tmp)
        try:
            # HDF5 1.10's fixed-array chunk index keeps a fixed-size dataset's chunks back to back: the
            # images are one run of equal strides, which a reader gathers a batch from in one copy
            with self.h5py.File(fh, mode, libver=("v110", "latest")) as f:
                work(f)
        except RuntimeError as err:  # HDF5's own failure, e.g. a metadata write refused
            raise self.failed(fh.error or OSError(errno.EIO, f"{type(err).__name__}: {err}")) from err
        finally:
            fh.close()
        if fh.error is not None:
            raise self.failed(fh.error)

    def allocated(self, contiguous: bool = False) -> Any:
        """Dataset creation properties: space allocated when created, never filled (written by us)."""
        h5p, h5d = self.h5py.h5p, self.h5py.h5d
        dcpl = h5p.create(h5p.DATASET_CREATE)
        dcpl.set_alloc_time(h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(h5d.FILL_TIME_NEVER)
        if contiguous:
            dcpl.set_layout(h5d.CONTIGUOUS)
        return dcpl

    @staticmethod
    def identify(f: Any, fmt: str, version: int) -> None:
        """Mark the open file ``f`` as a store of ``fmt`` (incomplete until ``complete`` adds its mark)."""
        f.attrs.update({"format": fmt, "format_version": version, "layout_version": layout.LAYOUT_VERSION})

    def fsync(self) -> None:
        try:
            with open(self.tmp, "rb") as fh:
                os.fsync(fh.fileno())
        except OSError as err:
            raise self.failed(err) from err

    def complete(
        self, keep: np.ndarray, skipped: list[str], tables: dict[str, Any], attrs: dict[str, Any]
    ) -> None:
        """Write ``meta``, the kept images' tables, ``tables`` and ``attrs`` with the completeness mark."""
        self.fsync()  # the images are on disk before the mark that says they are
        str_dt = self.h5py.string_dtype("utf-8")
        kept = [r for r, k in zip(self.rel, keep, strict=True) if k]
        strings = {"classes": self.classes, "files": kept, "skipped_files": skipped}
        arrays = {"meta": self.meta[: self.written], "labels": self.labels[keep], **tables}

        def write(f: Any) -> None:
            for name, data in arrays.items():
                f.create_dataset(name, data=data)
            for name, values in strings.items():
                f.create_dataset(name, data=np.array(values, dtype=object), dtype=str_dt)
            f.attrs.update(
                {
                    **attrs,
                    "storage_size": self.storage_size,
                    "max_aspect": layout.MAX_ASPECT,
                    "resize": layout.RESIZE_DOC,
                    "uuid": uuid.uuid4().hex,
                    "num_skipped": len(skipped),
                    "source": self.source,
                    COMPLETE_ATTR: True,
                }
            )

        self.hdf5("r+", write)
        self.fsync()  # durable before it becomes visible under its final name
