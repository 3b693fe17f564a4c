"""Reading the HDF5 image stores ``convert_folder_to_hdf5`` writes: uint8 canvases (``HDF5ImageDataset``) and
the compact JPEG store (``JPEGStoreDataset``). Their layouts and read paths are in docs/hdf5.md.
"""

from __future__ import annotations

import contextlib
import mmap
import operator
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from lightning_gpuopt._checks import check_arg, check_batch_array, check_int
from lightning_gpuopt._common import FeedInfo
from lightning_gpuopt._imports import require
from lightning_gpuopt.data import layout
from lightning_gpuopt.data.folder import decode_canvas
from lightning_gpuopt.data.readers import DecodesInWorkers

FORMAT = "lightning-gpuopt/uint8-images"
#: 3: whole images on a canvas with ``meta``, marked ``complete`` once written (1 and 2 are refused).
FORMAT_VERSION = 3
JPEG_FORMAT = "lightning-gpuopt/jpeg-images"
JPEG_FORMAT_VERSION = 1
#: root attribute set last, after every image and table is written and flushed.
COMPLETE_ATTR = "complete"
#: threads of a training process reading a raw store when ``HDF5Options.threads`` is ``None`` (at most its
#: CPUs): chosen, not measured; four fed a compiled ResNet-50 on one H200 with room to spare (docs/hdf5.md)
READ_THREADS = 4
_FADVISE = getattr(os, "posix_fadvise", None)


@dataclass(frozen=True)
class HDF5Options:
    """How threads of the training process read a raw HDF5 store (``OptimizedDataModule(hdf5=...)``); a JPEG
    store is decoded by worker processes (``num_workers``) and takes nothing here.

    Attributes:
        threads: reading threads per training process; ``None`` (default): ``READ_THREADS``, at most the CPUs
            of the process (chosen, not measured); 0: batches are read in the training loop.

    Example:
        >>> HDF5Options(threads=8).resolved_threads(cpus=16)
        (8, 'set by you: HDF5Options(threads=8)')
        >>> HDF5Options().resolved_threads(cpus=2)
        (2, 'chosen from 2 cores a process, not measured')
    """

    threads: int | None = None

    def __post_init__(self) -> None:
        check_int(
            self.threads, "hdf5.threads", low=0, none_ok=True,
            fix="reading threads per training process (HDF5Options(threads=...)); None picks them from the CPUs",
        )  # fmt: skip

    def resolved_threads(self, *, cpus: int) -> tuple[int, str]:
        """``(threads, how they were chosen)`` for a training process that may use ``cpus`` CPUs."""
        if self.threads is not None:
            return self.threads, f"set by you: HDF5Options(threads={self.threads})"
        return min(READ_THREADS, max(1, cpus)), f"chosen from {cpus} cores a process, not measured"


def _is_jpeg_store(path: str | os.PathLike[str]) -> bool:
    """``path`` is an HDF5 file whose ``format`` attribute names the JPEG store (any error: ``False``)."""
    try:
        h5py = require("h5py")
        with h5py.File(os.path.expanduser(os.fspath(path)), "r") as f:
            return f.attrs.get("format") == JPEG_FORMAT
    except Exception:  # the raw store's checks report what is wrong with the file
        return False


def _will_need(fd: int, offsets: np.ndarray, size: int) -> None:
    """Ask the kernel for each image's bytes now: a batch's reads reach the device together, and no more."""
    if _FADVISE is None:
        return
    for off in offsets.tolist():
        _FADVISE(fd, off, size, os.POSIX_FADV_WILLNEED)  # releases the GIL


class HDF5ImageDataset(Dataset):
    """Map-style dataset over a store written by ``convert_folder_to_hdf5``: ``(canvas, label, meta)``.

    ``canvas`` is uint8 ``(S, ceil(1.5 S), 3)``, ``meta`` int32 ``(h, w, transposed)`` (``data.layout``).
    ``read_into`` fills a caller's batch array, from several threads at once. A store converted again under
    the same path since raises ``RuntimeError`` naming it. A JPEG store's path gives a ``JPEGStoreDataset``.

    Args:
        path: the ``.h5`` file (``lightning-gpuopt convert SRC OUT.h5`` makes one).

    Example:
        >>> ds = HDF5ImageDataset("train_256.h5")  # doctest: +SKIP
        >>> canvas, label, meta = ds[0]  # doctest: +SKIP
        >>> canvas.shape, canvas.dtype, meta.tolist()  # doctest: +SKIP
        ((256, 384, 3), dtype('uint8'), [256, 341, 0])
    """

    _FORMAT, _VERSION, _TABLES, _FIX = FORMAT, FORMAT_VERSION, ("images", "chunk_offsets"), ""
    _block_start: int | None = None  # file offset of a raw store's images (a JPEG store: None)

    def __new__(cls, path: str | os.PathLike[str] | None = None, *args: Any, **kwargs: Any) -> Any:
        if cls is HDF5ImageDataset and path is not None and _is_jpeg_store(path):
            return super().__new__(JPEGStoreDataset)
        return super().__new__(cls)

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.path.abspath(os.path.expanduser(os.fspath(path)))
        if not os.path.exists(self.path):
            raise FileNotFoundError(
                f"HDF5 file {self.path!r} does not exist; check the path or make one with "
                "`lightning-gpuopt convert SRC_FOLDER OUT.h5`"
            )
        if os.path.isdir(self.path):
            raise ValueError(
                f"{self.path!r} is a folder, not an HDF5 store; read it with UInt8ImageFolder (or "
                f"OptimizedDataModule's backend='auto'), or convert it first: "
                f"`lightning-gpuopt convert {self.path} {self.path}.h5`"
            )
        st = os.stat(self.path)
        with self._open_h5() as f:
            self._read_header(f)
        self._identity = (st.st_size, st.st_mtime_ns, self.uuid)
        if self._raw_end() > st.st_size:
            raise ValueError(
                f"HDF5 file {self.path!r} is truncated (its images end past the file); {self._fix()}"
            )
        self.feed_info = FeedInfo(backend="hdf5")
        self._file: Any = None  # this process's unbuffered file
        self._file_pid: int | None = None
        self._rows: np.ndarray | None = None  # (N, image bytes) rows of its read-only map
        self._file_lock = threading.Lock()

    def _fix(self) -> str:
        return f"re-run `lightning-gpuopt convert SRC_FOLDER {self.path} --overwrite{self._FIX}`"

    def _open_h5(self, fileobj: Any = None) -> Any:
        """The store opened with h5py; a damaged or foreign file raises ``ValueError`` naming it and a fix."""
        h5py = require("h5py")
        if fileobj is None and (not os.path.isfile(self.path) or not h5py.is_hdf5(self.path)):
            raise ValueError(f"{self.path!r} is not an HDF5 file (or its header is damaged); {self._fix()}")
        try:
            return h5py.File(fileobj if fileobj is not None else self.path, "r")
        except OSError as err:
            raise ValueError(
                f"HDF5 file {self.path!r} cannot be opened ({err}): truncated or damaged; {self._fix()}"
            ) from None

    def _read_header(self, f: Any) -> None:
        attrs = f.attrs
        if attrs.get("format") != self._FORMAT:
            raise ValueError(
                f"{self.path!r} is not a lightning-gpuopt image store (no format={self._FORMAT!r} attribute); "
                "make one with `lightning-gpuopt convert SRC_FOLDER OUT.h5`"
            )
        version, layout_version = int(attrs.get("format_version", 0)), int(attrs.get("layout_version", 0))
        h5py = require("h5py")
        if (version, layout_version) != (self._VERSION, layout.LAYOUT_VERSION):
            why: str | None = (
                f"was written by another lightning-gpuopt (format version {version}, layout version "
                f"{layout_version}; this one reads {self._VERSION}/{layout.LAYOUT_VERSION}, a newer one by "
                "upgrading)"
            )
        elif not attrs.get(COMPLETE_ATTR, False):
            why = f"is incomplete: the conversion did not finish (no {COMPLETE_ATTR!r} mark)"
        else:
            tables = ("meta", "labels", "classes", *self._TABLES)
            missing = [name for name in tables if not isinstance(f.get(name), h5py.Dataset)]
            why = f"has no {missing[0]!r} dataset; it is incomplete" if missing else None
        if why is not None:
            raise ValueError(f"HDF5 file {self.path!r} {why}: {self._fix()}")
        self.storage_size, self.uuid = int(attrs["storage_size"]), str(attrs["uuid"])
        self.image_shape: tuple[int, int, int] = (*layout.canvas_shape(self.storage_size), 3)
        self._image_bytes = int(np.prod(self.image_shape))
        meta, labels = f["meta"], f["labels"]
        n = int(labels.shape[0])
        tables_ok = n > 0 and meta.shape == (n, 3) and labels.shape == (n,) and labels.dtype.kind in "iu"
        aspect_ok = float(attrs.get("max_aspect", 0)) == layout.MAX_ASPECT
        if not (tables_ok and aspect_ok and self._read_offsets(f, n)):
            raise ValueError(
                f"HDF5 file {self.path!r} is inconsistent (shapes, chunks, filters or offsets differ from the "
                f"format, or disagree with HDF5); {self._fix()}"
            )
        self.labels: np.ndarray = labels[()].astype(np.int64, copy=False)
        self.meta: np.ndarray = meta[()].astype(np.int32, copy=False)
        self.classes: list[str] = [c.decode() if isinstance(c, bytes) else str(c) for c in f["classes"][()]]

    def _read_offsets(self, f: Any, n: int) -> bool:
        """Read the image offsets; whether the image datasets are as the format has them."""
        images, canvas = f["images"], self.image_shape
        rows = (n, n + int(f.attrs.get("num_skipped", 0)))  # a skipped image's row is kept, or cut off
        shape_ok = images.dtype == np.uint8 and images.shape[1:] == canvas and images.shape[0] in rows
        plain = images.chunks == (1, *canvas) and images.id.get_create_plist().get_nfilters() == 0
        if not (shape_ok and plain and f["chunk_offsets"].shape == (n,)):
            return False
        self._offsets: np.ndarray = f["chunk_offsets"][()].astype(np.int64)
        # the images are rows of one (N, image bytes) block of the file: a batch is one gather
        if not np.array_equal(np.diff(self._offsets), np.full(n - 1, self._image_bytes)):
            raise ValueError(
                f"HDF5 file {self.path!r} was converted by an earlier lightning-gpuopt (its images do not "
                f"lie back to back); {self._fix()}"
            )
        self._block_start = int(self._offsets[0])
        # the table must agree with HDF5 (a file rewritten in place would not); check a spread of images
        for i in sorted({0, n // 2, n - 1}):
            info = images.id.get_chunk_info_by_coord((i, 0, 0, 0))
            if info.byte_offset != self._offsets[i] or info.size != self._image_bytes:
                return False
        return True

    def _raw_end(self) -> int:
        return int(self._offsets.max()) + self._image_bytes

    def _truncated(self) -> RuntimeError:
        return RuntimeError(f"HDF5 store {self.path!r} was truncated while open; {self._fix()}")

    def _open_checked(self) -> int:
        """A read-only descriptor of the store, checked to be the file this dataset was made for."""
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)
            same = (st.st_size, st.st_mtime_ns) == self._identity[:2]
            if same:  # the uuid is read through this same descriptor: it is the file that gets read
                with open(fd, "rb", closefd=False) as fh, self._open_h5(fileobj=fh) as f:
                    same = str(f.attrs.get("uuid")) == self.uuid
            if not same:
                raise RuntimeError(
                    f"HDF5 store {self.path!r} changed since this HDF5ImageDataset was made (it was "
                    "converted again or replaced: its uuid, size or modification time differ); create the "
                    "dataset (or DataModule) again"
                )
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _opened(self) -> tuple[Any, np.ndarray | None]:
        """This process's checked file and map, opened on its first read; a read keeps them from ``close``."""
        with self._file_lock:
            if self._file_pid != os.getpid() or self._file is None:
                self._file = open(self._open_checked(), "rb", buffering=0)  # noqa: SIM115 -- kept open
                self._rows = self._map(self._file.fileno())
                self._file_pid = os.getpid()
            return self._file, self._rows

    def _reader(self) -> Any:
        return self._opened()[0]

    def _map(self, fd: int) -> np.ndarray | None:
        if self._block_start is None:  # a JPEG store: one pread an image
            return None
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        if hasattr(mmap, "MADV_RANDOM") and _FADVISE is not None:
            # batches gather images at random offsets: a page missing from the cache is read alone (its
            # image was asked for, ``_will_need``), not with the device's read-around window of several MB
            with contextlib.suppress(OSError):  # a file system that takes no advice is read as before
                mapped.madvise(mmap.MADV_RANDOM)
        rows = np.frombuffer(mapped, np.uint8, len(self) * self._image_bytes, self._block_start)
        return rows.reshape(len(self), self._image_bytes)

    def close(self) -> None:
        """Drop this process's file and map (opened again on the next read; a read in flight keeps them)."""
        with self._file_lock:
            self._file = self._file_pid = self._rows = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_file": None, "_file_pid": None, "_rows": None, "_file_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._file_lock = threading.Lock()

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def _index(self, index: Any) -> int:
        check_arg(hasattr(index, "__index__"), "HDF5ImageDataset indices", index, "integers", error=TypeError)
        i, n = operator.index(index), len(self)
        valid = f"in range for the {n} images in {self.path!r} (valid: {-n} to {n - 1})"
        check_arg(-n <= i < n, "index", i, valid, error=IndexError)
        return i % n

    def _indices(self, indices: Sequence[int] | np.ndarray, images: np.ndarray | None = None) -> np.ndarray:
        """``indices`` as a validated int64 array in ``[0, len)``; ``images`` checked to be their batch array."""
        idx = np.asarray(indices).reshape(-1)
        if images is not None:
            shape = (int(idx.size), *self.image_shape)
            check_batch_array(images, shape, f"{type(self).__name__}.read_into's images")
        if idx.size == 0:
            return idx.astype(np.int64)
        what = f"an array of {idx.dtype}"
        check_arg(idx.dtype.kind in "iu", "HDF5ImageDataset indices", what, "integers", error=TypeError)
        bad = (idx < -len(self)) | (idx >= len(self))
        if bad.any():
            self._index(int(idx[np.argmax(bad)]))  # raises IndexError naming the first bad index
        return idx.astype(np.int64) % len(self)

    def read_into(
        self, indices: Sequence[int] | np.ndarray, images: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Read the images at ``indices`` into ``images``; return their ``(labels, meta)``.

        Args:
            indices: image indices (negative ones count from the end).
            images: a writable C-contiguous uint8 ``(len(indices), *image_shape)`` array (a pinned tensor's
                ``.numpy()``).

        Returns:
            int64 ``(B,)`` labels and int32 ``(B, 3)`` meta ``(h, w, transposed)``, new arrays.
        """
        idx = self._indices(indices, images)
        file, block = self._opened()
        fd = file.fileno()
        if os.fstat(fd).st_size < self._raw_end():  # a map read past the file's end would crash
            raise self._truncated()
        _will_need(fd, self._offsets[idx], self._image_bytes)
        # one gather, the GIL released inside; "clip" writes straight into ``images`` (the indices are
        # checked above), where the default mode copies through a buffer
        np.take(block, idx, axis=0, out=images.reshape(idx.size, self._image_bytes), mode="clip")
        return self.labels[idx], self.meta[idx]

    def __getitem__(self, index: int) -> tuple[np.ndarray, int, np.ndarray]:
        return self.__getitems__([self._index(index)])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[np.ndarray, int, np.ndarray]]:
        """A batch as a list of ``(canvas, label, meta)`` in request order, canvases rows of one new array."""
        idx = self._indices(indices)
        batch = np.empty((int(idx.size), *self.image_shape), dtype=np.uint8)
        labels, meta = self.read_into(idx, batch)
        return list(zip(batch, labels.tolist(), meta, strict=True))

    def relabel(self, classes: Sequence[str], indices: Sequence[int]) -> None:
        """Label stored class ``self.classes[i]`` as ``indices[i]`` of ``classes`` (the file is not changed)."""
        n = len(self.classes)
        check_arg(len(indices) == n, "indices", len(indices), f"{n}: one a stored class")
        self.labels = np.asarray(indices, dtype=np.int64)[self.labels]
        self.classes = list(classes)

    def files(self) -> list[str]:
        """Source file of every image, relative to the converted folder."""
        with self._open_h5() as f:
            return [s.decode() if isinstance(s, bytes) else str(s) for s in f["files"][()]]

    def attrs(self) -> dict[str, Any]:
        """The file's root attributes (format, storage_size, uuid, ...)."""
        with self._open_h5() as f:
            return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in f.attrs.items()}

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this dataset for caches (worker tuning): path, uuid, length and storage size."""
        keys = {"class": type(self).__name__, "path": self.path, "uuid": self.uuid, "len": len(self)}
        return {**keys, "storage_size": self.storage_size}

    def __repr__(self) -> str:
        shown = f"images={len(self)}, storage_size={self.storage_size}, canvas={self.image_shape}"
        return f"{type(self).__name__}(path={self.path!r}, {shown}, classes={len(self.classes)})"


class JPEGStoreDataset(DecodesInWorkers, HDF5ImageDataset):
    """Map-style dataset over a JPEG store (``convert_folder_to_hdf5(..., format="jpeg")``): the raw store's
    ``(canvas, label, meta)``, each image read with one ``pread`` and decoded by DataLoader worker processes.

    Args:
        path: the ``.h5`` file (``lightning-gpuopt convert SRC OUT.h5 --format jpeg`` makes one).

    Example:
        >>> ds = HDF5ImageDataset("train_jpeg.h5")  # doctest: +SKIP
        >>> type(ds).__name__, ds[0][0].shape  # doctest: +SKIP
        ('JPEGStoreDataset', (256, 384, 3))
    """

    _FORMAT, _VERSION = JPEG_FORMAT, JPEG_FORMAT_VERSION
    _TABLES, _FIX = ("jpeg", "jpeg_offsets"), " --format jpeg"

    def _read_offsets(self, f: Any, n: int) -> bool:
        blob = f["jpeg"]
        self._offsets = f["jpeg_offsets"][()].astype(np.int64)
        self._base = int(f.attrs.get("jpeg_data_offset", -1))
        blob_ok = blob.dtype == np.uint8 and blob.chunks is None and blob.id.get_offset() == self._base
        offsets_ok = self._offsets.shape == (n + 1,) and bool(np.all(np.diff(self._offsets) > 0))
        return blob_ok and offsets_ok and int(self._offsets[-1]) <= blob.shape[0]

    def _raw_end(self) -> int:
        return self._base + int(self._offsets[-1])

    def byte_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """``(first byte in the file, byte count)`` of every image's JPEG, int64 each."""
        return self._base + self._offsets[:-1], np.diff(self._offsets)

    def _bytes(self, fd: int, i: int) -> bytes:
        start, end = int(self._offsets[i]), int(self._offsets[i + 1])
        data = os.pread(fd, end - start, self._base + start)
        if len(data) != end - start:
            raise self._truncated()
        return data

    def read_into(
        self, indices: Sequence[int] | np.ndarray, images: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``HDF5ImageDataset.read_into``: each image read with one ``pread`` and decoded onto its row."""
        idx = self._indices(indices, images)
        fd = self._reader().fileno()
        meta = np.empty((int(idx.size), 3), dtype=np.int32)
        for j, i in enumerate(idx.tolist()):
            name = f"image {i} of {self.path!r}"
            meta[j] = decode_canvas(self._bytes(fd, i), self.storage_size, images[j], name=name)[1]
        return self.labels[idx], meta
