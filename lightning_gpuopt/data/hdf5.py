"""The uint8 HDF5 image store: whole images on a fixed canvas, read with one memory-mapped gather a batch.

Layout written by ``convert_folder_to_hdf5`` (``lightning_gpuopt.data.convert``), format version 3::

    /images          uint8 (N', S, ceil(1.5 S), 3): each image resized like torchvision's Resize(S) and
                     placed on a canvas (lightning_gpuopt.data.layout); one image a chunk, unfiltered, the
                     chunks back to back (HDF5 1.10's fixed-array index); N' = N + num_skipped (the
                     kept images are its first N rows)
    /meta            int32 (N, 3): h, w, transposed -- the valid region of each canvas
    /labels          int64 (N,)
    /classes         UTF-8 strings (C,), index = label
    /files           UTF-8 strings (N,), source paths relative to the source folder
    /skipped_files   UTF-8 strings, unreadable source images left out (on_corrupt="skip")
    /chunk_offsets   int64 (N,), byte offset of each image in the file
    attrs: format, format_version=3, layout_version, storage_size (S), max_aspect, resize, uuid,
           num_skipped, source, complete (set last, once every image is written and flushed)

A store without ``complete`` is a conversion that did not finish (a copy of its temporary file) and is
refused; so is format version 2, the same layout written without that mark.

Every image is plain bytes at a known offset of the file: no HDF5 work and no decompression per image.
``read_into`` reads a batch straight into a caller's array (a pinned host buffer), which threads of the
training process run in parallel (``OptimizedDataModule`` does; no worker processes, no copy between
processes): where the images lie at equal strides (every store this version writes) with one gather out of
a read-only memory map, holding the GIL only to start it, so reading threads never hold up the training
loop's Python; otherwise with one positional read per image. ``__getitems__`` copies a batch out of the
memory map, for ``DataLoader`` workers.
"""

from __future__ import annotations

import mmap
import operator
import os
import sys
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

# the converter and the format it writes (importable from here too)
from lightning_gpuopt.data.convert import (  # noqa: F401
    COMPLETE_ATTR,
    FORMAT,
    FORMAT_VERSION,
    LAYOUT_VERSION,
    ConversionResult,
    convert_folder_to_hdf5,
)

#: threads of a training process reading a raw store when ``HDF5Options.threads`` is ``None`` (at most its
#: CPUs): chosen, not measured; four fed a compiled ResNet-50 on one H200 with room to spare (docs/hdf5.md)
READ_THREADS = 4


@dataclass(frozen=True)
class HDF5Options:
    """What a user decides about reading a raw HDF5 store (``OptimizedDataModule(hdf5=...)``).

    A raw store is read by threads of the training process straight into pinned memory: it has no DataLoader
    worker processes (``num_workers``). A JPEG store is decoded by worker processes (``num_workers``) and
    takes nothing from here.

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


# batches up to this many bytes are gathered with one fancy index into a fresh array; larger ones are
# copied image by image into a recycled batch buffer (a fresh multi-MB array is a new mmap whose page
# faults and zeroing cost about as much as the copy itself)
_FANCY_MAX_BYTES = 4 << 20


def _is_index(value: Any) -> bool:
    """``value`` is an integer index (an ``int``, a numpy integer, a 0-d integer tensor)."""
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _is_jpeg_store(path: str | os.PathLike[str]) -> bool:
    """``path`` is an HDF5 file whose ``format`` attribute names the JPEG store (any error: ``False``)."""
    try:
        h5py = require("h5py")
        with h5py.File(os.path.expanduser(os.fspath(path)), "r") as f:
            return f.attrs.get("format") == "lightning-gpuopt/jpeg-images"
    except Exception:  # noqa: BLE001 -- the raw store's checks report what is wrong with the file
        return False


#: why a store of layout version 1 is refused (its elongated images differ from what is read now).
LAYOUT_1 = (
    "has layout version 1: images more elongated than 3:2 were shrunk to fit the canvas, where they are now "
    "cut to it (their evaluation crop is torchvision's Resize + CenterCrop); convert it again"
)


def _convert_fix(path: str) -> str:
    return f"re-run `lightning-gpuopt convert SRC_FOLDER {path} --overwrite`"


_FADVISE = getattr(os, "posix_fadvise", None)


def _will_need(fd: int, offsets: np.ndarray, size: int) -> None:
    """Ask the kernel to read each image's ``size`` bytes at ``offsets`` now (``POSIX_FADV_WILLNEED``): the
    reads of a batch go to the device together, and only the bytes the batch uses are read. Pages already
    cached cost a lookup; platforms without ``posix_fadvise`` read on demand."""
    if _FADVISE is None:
        return
    for off in offsets.tolist():
        _FADVISE(fd, off, size, os.POSIX_FADV_WILLNEED)  # releases the GIL


class HDF5ImageDataset(Dataset):
    """Map-style dataset over a store written by ``convert_folder_to_hdf5``: ``(canvas, label, meta)``.

    ``canvas`` is a uint8 ``(S, ceil(1.5 S), 3)`` array holding the image resized like torchvision's
    ``Resize(S)`` (``S = storage_size``) at its top-left, transposed when the image is portrait, a long side
    longer than the canvas cut to its centre (``layout.cut_window``); ``meta`` is int32 ``(h, w, transposed)``, the valid region (``lightning_gpuopt.data.layout``).
    ``OptimizedDataModule``'s collate and ``GPUAugment`` crop from that region on the GPU.

    ``read_into(indices, images)`` fills a caller's ``(B, S, W, 3)`` array with a batch (one ``pread`` per
    image; safe to call from several threads at once): ``OptimizedDataModule`` reads the store this way,
    on threads, straight into pinned memory.

    The file is checked in ``__init__`` and closed again. Each process maps it read-only on its first
    read (and again after a fork), so the object pickles cheaply and works with ``fork``, ``spawn`` and
    ``forkserver`` DataLoader workers and DDP. ``__getitems__`` (called by the DataLoader with a whole
    batch of indices) copies the batch out of the mapping into one ``(B, S, W, 3)`` array and returns
    per-image views of its rows (the array is recycled once no view of it is alive).

    The store's identity (its ``uuid`` attribute, size and modification time) is recorded here and
    checked whenever a process opens the file: a store replaced by another conversion raises
    ``RuntimeError`` naming the file rather than being read with the old one's shape.

    Args:
        path: the ``.h5`` file (``lightning-gpuopt convert SRC OUT.h5`` makes one).

    Example:
        >>> ds = HDF5ImageDataset("train_256.h5")  # doctest: +SKIP
        >>> canvas, label, meta = ds[0]  # doctest: +SKIP
        >>> canvas.shape, canvas.dtype, meta.tolist()  # doctest: +SKIP
        ((256, 384, 3), dtype('uint8'), [256, 341, 0])
    """

    def __new__(cls, path: str | os.PathLike[str] | None = None, *args: Any, **kwargs: Any) -> Any:
        # a JPEG store (format="jpeg") is read by its own class, through this one's name too
        if cls is HDF5ImageDataset and path is not None and _is_jpeg_store(path):
            from lightning_gpuopt.data.jpeg_store import JPEGStoreDataset

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
                f"HDF5 file {self.path!r} is truncated (its images end past the file); "
                f"{_convert_fix(self.path)}"
            )
        self.feed_info = FeedInfo(backend="hdf5")
        self._win: np.ndarray | None = None  # (file bytes - image bytes + 1, S, W, 3) window on the map
        self._rows: np.ndarray | None = None  # (N, image bytes) rows of the map (images at equal strides)
        self._buf: np.ndarray | None = None  # recycled batch array (large batches)
        self._pid: int | None = None
        self._file: Any = None  # this process's unbuffered file for read_into
        self._file_pid: int | None = None
        self._file_lock = threading.Lock()

    # -- checks -------------------------------------------------------------------------------------

    def _open_h5(self, fileobj: Any = None) -> Any:
        """The store opened with h5py; a damaged or foreign file raises ``ValueError`` naming it and a fix."""
        h5py = require("h5py")
        fix = _convert_fix(self.path)
        if fileobj is None and (not os.path.isfile(self.path) or not h5py.is_hdf5(self.path)):
            raise ValueError(f"{self.path!r} is not an HDF5 file (or its header is damaged); {fix}")
        try:
            return h5py.File(fileobj if fileobj is not None else self.path, "r")
        except OSError as err:
            raise ValueError(
                f"HDF5 file {self.path!r} cannot be opened ({err}): truncated or damaged; {fix}"
            ) from None

    def _read_header(self, f: Any) -> None:
        h5py = require("h5py")
        fix = _convert_fix(self.path)
        attrs = f.attrs
        if attrs.get("format") != FORMAT:
            raise ValueError(
                f"{self.path!r} is not a lightning-gpuopt image store (no format={FORMAT!r} attribute); make "
                "one with `lightning-gpuopt convert SRC_FOLDER OUT.h5`"
            )
        version = int(attrs.get("format_version", 0))
        if version == 1:
            raise ValueError(
                f"{self.path!r} holds the old layout (a central square per image, format version 1); "
                "training "
                f"now crops from whole images: {fix}"
            )
        if version == 2:
            raise ValueError(
                f"{self.path!r} has format version 2, written without the mark of a finished conversion "
                f"(it cannot be told from one that stopped midway): {fix}"
            )
        layout_version = int(attrs.get("layout_version", 0))
        if version == FORMAT_VERSION and layout_version == 1:
            raise ValueError(f"{self.path!r} {LAYOUT_1}: {fix}")
        if version != FORMAT_VERSION or layout_version != LAYOUT_VERSION:
            raise ValueError(
                f"{self.path!r} has format version {version}, layout version {layout_version}; this "
                f"lightning-gpuopt reads {FORMAT_VERSION}/{LAYOUT_VERSION}: {fix} "
                "(or upgrade lightning-gpuopt)"
            )
        if not attrs.get(COMPLETE_ATTR, False):
            raise ValueError(
                f"HDF5 file {self.path!r} is incomplete: the conversion did not finish (no {COMPLETE_ATTR!r} "
                f"mark); convert again: {fix}"
            )
        for name in ("images", "meta", "labels", "chunk_offsets"):
            if not isinstance(f.get(name), h5py.Dataset):
                raise ValueError(f"HDF5 file {self.path!r} has no {name!r} dataset; it is incomplete: {fix}")
        self.storage_size = int(attrs["storage_size"])
        self.uuid = str(attrs["uuid"])
        images, meta, labels = f["images"], f["meta"], f["labels"]
        n = int(labels.shape[0])
        skipped = int(attrs.get("num_skipped", 0))
        canvas = (*layout.canvas_shape(self.storage_size), 3)
        consistent = (
            images.dtype == np.uint8
            and tuple(images.shape[1:]) == canvas
            and int(images.shape[0]) in (n, n + skipped)  # a skipped image's row is kept, or cut off
            and images.chunks == (1, *canvas)
            and images.id.get_create_plist().get_nfilters() == 0
            and float(attrs.get("max_aspect", 0)) == layout.MAX_ASPECT
            and meta.shape == (n, 3)
            and labels.shape == (n,)
            and labels.dtype.kind in "iu"
            and f["chunk_offsets"].shape == (n,)
            and n > 0
        )
        if not consistent:
            raise ValueError(
                f"HDF5 file {self.path!r} is inconsistent (shapes, chunks or filters differ from the "
                f"format); {fix}"
            )
        self.image_shape: tuple[int, int, int] = canvas
        self._image_bytes = int(np.prod(canvas))
        self.labels: np.ndarray = labels[()].astype(np.int64, copy=False)
        self.meta: np.ndarray = meta[()].astype(np.int32, copy=False)
        self.classes: list[str] = [c.decode() if isinstance(c, bytes) else str(c) for c in f["classes"][()]]
        self._offsets: np.ndarray = f["chunk_offsets"][()].astype(np.int64)
        # images at equal strides are rows of one (N, image bytes) block of the file: a batch is one gather
        regular = np.array_equal(np.diff(self._offsets), np.full(n - 1, self._image_bytes))
        self._block_start: int | None = int(self._offsets[0]) if regular else None
        # the table must agree with HDF5 (a file rewritten in place would not); check a spread of images
        dsid = images.id
        for i in sorted({0, n // 2, n - 1}):
            info = dsid.get_chunk_info_by_coord((i, 0, 0, 0))
            if info.byte_offset != self._offsets[i] or info.size != self._image_bytes:
                raise ValueError(
                    f"HDF5 file {self.path!r}: its image offsets disagree with HDF5 (edited in place?); {fix}"
                )

    def _raw_end(self) -> int:
        return int(self._offsets.max()) + self._image_bytes

    def _changed(self) -> RuntimeError:
        return RuntimeError(
            f"HDF5 store {self.path!r} changed since this HDF5ImageDataset was made (it was converted "
            "again or "
            "replaced: its uuid, size or modification time differ); create the dataset (or DataModule) again"
        )

    # -- per-process mapping ------------------------------------------------------------------------

    def _open_checked(self) -> int:
        """A read-only descriptor of the store, checked to be the file this dataset was made for."""
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            st = os.fstat(fd)
            if (st.st_size, st.st_mtime_ns) != self._identity[:2]:
                raise self._changed()
            # the uuid is read through this same descriptor: it is the file that gets read
            with open(fd, "rb", closefd=False) as fh, self._open_h5(fileobj=fh) as f:
                if str(f.attrs.get("uuid")) != self.uuid:
                    raise self._changed()
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _ensure_open(self) -> np.ndarray:
        pid = os.getpid()
        if self._pid == pid and self._win is not None:
            return self._win
        # a map inherited through fork is the parent's: drop it (unmapped when unused) and map our own
        self._win = self._buf = self._rows = None
        fd = self._open_checked()
        try:
            mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)  # the mapping stays valid without the descriptor
        if hasattr(mmap, "MADV_RANDOM") and _FADVISE is not None:
            # batches gather images at random offsets: a page missing from the cache is read alone (its
            # image's bytes were asked for ahead, ``_will_need``), not with the device's read-around window
            # of up to several MB, which for a store bigger than memory reads many times the bytes it uses
            try:
                mapped.madvise(mmap.MADV_RANDOM)
            except OSError:  # a file system that takes no advice is read as before
                pass
        flat = np.frombuffer(mapped, dtype=np.uint8)
        h, w, c = self.image_shape
        # row k of this window is the image whose bytes start at file offset k: one integer index gives a
        # view, an array of offsets gathers a batch in one fancy-index copy
        self._win = np.lib.stride_tricks.as_strided(
            flat,
            shape=(flat.size - self._image_bytes + 1, h, w, c),
            strides=(1, w * c, c, 1),
            writeable=False,
        )
        if self._block_start is not None:
            start, size = self._block_start, len(self) * self._image_bytes
            self._rows = flat[start : start + size].reshape(len(self), self._image_bytes)
        self._pid = pid
        return self._win

    def _reader(self) -> Any:
        """This process's unbuffered file object for ``read_into`` (opened and checked on first use)."""
        pid = os.getpid()
        with self._file_lock:
            if self._file_pid != pid or self._file is None:
                self._file = open(self._open_checked(), "rb", buffering=0)  # noqa: SIM115 -- kept open
                self._file_pid = pid
            return self._file

    def close(self) -> None:
        """Drop this process's mapping and file (opened again on the next read)."""
        # the map is unmapped when the last array using it goes (closing it under live arrays would fail);
        # the file closes when no read holds it any more (a read in flight keeps its own reference)
        self._win = self._buf = self._rows = self._pid = None
        with self._file_lock:
            self._file = self._file_pid = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_win=None, _buf=None, _rows=None, _pid=None, _file=None, _file_pid=None, _file_lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._file_lock = threading.Lock()

    # -- reads --------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def _index(self, index: Any) -> int:
        check_arg(_is_index(index), "HDF5ImageDataset indices", index, "integers", error=TypeError)
        i, n = operator.index(index), len(self)
        check_arg(
            -n <= i < n,
            "index",
            i,
            f"in range for the {n} images in {self.path!r} (valid: {-n} to {n - 1})",
            error=IndexError,
        )
        return i % n

    def __getitem__(self, index: int) -> tuple[np.ndarray, int, np.ndarray]:
        i = self._index(index)
        win = self._ensure_open()
        return win[self._offsets[i]].copy(), int(self.labels[i]), self.meta[i].copy()

    def _indices(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """``indices`` as a validated int64 array in ``[0, len)`` (negative ones counted from the end)."""
        idx = np.asarray(indices).reshape(-1)
        if idx.size == 0:
            return idx.astype(np.int64)
        check_arg(
            idx.dtype.kind in "iu",
            "HDF5ImageDataset indices",
            f"an array of {idx.dtype}",
            "integers",
            error=TypeError,
        )
        n = len(self)
        bad = (idx < -n) | (idx >= n)
        if bad.any():
            self._index(int(idx[np.argmax(bad)]))  # raises IndexError naming the first bad index
        return idx.astype(np.int64) % n

    def read_into(
        self, indices: Sequence[int] | np.ndarray, images: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Read the images at ``indices`` into ``images``; return their ``(labels, meta)``.

        ``images`` must be a C-contiguous uint8 array of shape ``(len(indices), *image_shape)`` (for example
        the ``.numpy()`` of a pinned tensor). Images at equal strides in the file (every store this version
        writes) are gathered out of the read-only memory map in one copy that runs without the GIL; others
        are read with one positional read each (the GIL released during each). Several threads reading
        batches run in parallel either way.

        Returns:
            int64 ``(B,)`` labels and int32 ``(B, 3)`` meta ``(h, w, transposed)``, new arrays.
        """
        idx = self._indices(indices)
        shape = (int(idx.size), *self.image_shape)
        check_batch_array(images, shape, "HDF5ImageDataset.read_into's images")
        reader = self._reader()  # held for the whole batch: close() cannot release it under these reads
        fd = reader.fileno()
        rows = images.reshape(shape[0], self._image_bytes)
        if self._block_start is not None:
            self._ensure_open()
            block = self._rows
            if block is not None:
                if os.fstat(fd).st_size < self._raw_end():  # a map read past the file's end would crash
                    raise RuntimeError(
                        f"HDF5 store {self.path!r} was truncated while open; {_convert_fix(self.path)}"
                    )
                _will_need(fd, self._block_start + idx * self._image_bytes, self._image_bytes)
                # one gather for the batch, the GIL released inside; "clip" writes straight into ``images``
                # (the indices are checked above), where the default mode copies through a buffer
                np.take(block, idx, axis=0, out=rows, mode="clip")
                return self.labels[idx], self.meta[idx]
        for j, offset in enumerate(self._offsets[idx].tolist()):
            row, done = rows[j], 0
            while done < self._image_bytes:
                n = os.preadv(fd, [row[done:]], offset + done)
                if n <= 0:
                    raise RuntimeError(
                        f"HDF5 store {self.path!r} ended inside image {int(idx[j])} (the file was truncated "
                        f"while open); {_convert_fix(self.path)}"
                    )
                done += n
        return self.labels[idx], self.meta[idx]

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[np.ndarray, int, np.ndarray]]:
        """Read a batch: a list of ``(canvas, label, meta)`` in request order, canvases views of one array.

        The shape the DataLoader's fetcher passes to ``collate_fn``. Batches up to 4 MiB are gathered with
        one fancy index; larger ones are copied image by image into a batch array that is reused once no
        item of the previous batch is referenced any more.
        """
        idx = self._indices(indices)
        if idx.size == 0:
            return []
        win = self._ensure_open()
        offsets = self._offsets[idx]
        count = int(idx.size)
        _will_need(self._reader().fileno(), offsets, self._image_bytes)
        if count * self._image_bytes <= _FANCY_MAX_BYTES:
            batch = win[offsets]  # one gather: a memcpy per image inside numpy, no Python loop
        else:
            batch = self._batch_buffer(count)
            for j, off in enumerate(offsets.tolist()):
                batch[j] = win[off]
        return list(zip(batch, self.labels[idx].tolist(), self.meta[idx], strict=True))

    def _batch_buffer(self, count: int) -> np.ndarray:
        """A (count, S, W, 3) array to fill: the previous batch's array when nothing refers to it any more."""
        buf = self._buf
        # references when free: self.__dict__, ``buf`` here and getrefcount's argument. Every view of it
        # (the items handed out, anything made from them) holds a reference, so a batch still in use is
        # never overwritten.
        if buf is None or buf.shape[0] < count or sys.getrefcount(buf) > 3:
            buf = np.empty((count, *self.image_shape), dtype=np.uint8)
            self._buf = buf
        return buf[:count]

    # -- metadata -----------------------------------------------------------------------------------

    @property
    def targets(self) -> list[int]:
        """Labels as a list (torchvision ``ImageFolder`` naming)."""
        return self.labels.tolist()

    def relabel(self, classes: Sequence[str], indices: Sequence[int]) -> None:
        """Label each image of stored class ``self.classes[i]`` with ``indices[i]``; ``classes`` (whose names
        those labels index, the training split's) becomes ``self.classes`` (``folder.class_indices`` gives
        ``indices``). The file is not changed."""
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
        return {
            "class": type(self).__name__,
            "path": self.path,
            "uuid": self.uuid,
            "len": len(self),
            "storage_size": self.storage_size,
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(path={self.path!r}, images={len(self)}, "
            f"storage_size={self.storage_size}, "
            f"canvas={self.image_shape}, classes={len(self.classes)})"
        )
