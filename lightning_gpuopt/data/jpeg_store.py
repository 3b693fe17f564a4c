"""The compact JPEG store: each image's JPEG bytes in one contiguous blob, read with one ``pread`` an image.

Layout written by ``convert_folder_to_hdf5(..., format="jpeg")`` (``lightning_gpuopt.data.convert``),
format ``lightning-gpuopt/jpeg-images`` version 1::

    /jpeg            uint8 (total bytes,), contiguous and unfiltered: every image's JPEG file, one after
                     another
    /jpeg_offsets    int64 (N + 1,): image i is jpeg[offsets[i]:offsets[i + 1]]
    /meta            int32 (N, 3): h, w, transposed of each image on the canvas (as the raw store's)
    /labels, /classes, /files, /skipped_files   as the raw store's
    attrs: format, format_version=1, layout_version, storage_size (S), max_aspect, resize, uuid,
           num_skipped, source, jpeg_quality, jpeg_data_offset (byte offset of /jpeg in the file),
           num_kept (source files stored as they are), complete (set last)

What an image's bytes are (``encode_for_store``): a JPEG source in RGB or grey whose size is no larger than
the store needs (``layout.resized_size`` at ``S`` would not shrink it) is kept byte for byte. Any other
image (a larger JPEG, CMYK, PNG and the other formats) is decoded and resized exactly as the raw store does
(``folder.load_canvas``'s routine: the DCT-scaled draft of ``layout.draft_size``, 8-bit RGB, PIL bilinear
to ``layout.resized_size``, then cut to the canvas by ``layout.cut_to_canvas``: the part the raw store
keeps) and encoded at ``JPEG_QUALITY`` as an RGB JPEG (a grey source as a grey one); a JPEG source whose
re-encoding would be larger than the file is kept as it is. Every image therefore decodes with the one
routine of the folder backend, onto the same canvas the raw store holds.

Reading (``JPEGStoreDataset``): one positional read an image, decoded onto its canvas row of the caller's
batch; ``OptimizedDataModule`` has DataLoader worker processes read it, a whole batch each into shared
memory (``readers.WholeBatches``).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lightning_gpuopt._checks import check_batch_array
from lightning_gpuopt._common import FeedInfo
from lightning_gpuopt.data import layout
from lightning_gpuopt.data._hdf5_writes import HDF5Writes
from lightning_gpuopt.data.convert import COMPLETE_ATTR, LAYOUT_VERSION, RESIZE_DOC
from lightning_gpuopt.data.folder import CorruptImageError
from lightning_gpuopt.data.hdf5 import LAYOUT_1, HDF5ImageDataset, _convert_fix
from lightning_gpuopt.data.readers import DecodesInWorkers

JPEG_FORMAT = "lightning-gpuopt/jpeg-images"
#: 1: the first JPEG store layout (a contiguous blob with offsets), with the completeness mark.
JPEG_FORMAT_VERSION = 1
#: quality of images the converter encodes (sources kept as they are keep theirs).
JPEG_QUALITY = 90
#: the converter's formats: ``raw`` (uint8 canvases, ``HDF5ImageDataset``) and ``jpeg`` (this module).
FORMATS = ("raw", "jpeg")
_GREY_MODES = ("1", "L", "LA", "I", "F")

_Block = tuple[np.ndarray, np.ndarray, list[tuple[int, str, str]]]


def _meta_of(width: int, height: int, storage_size: int) -> np.ndarray:
    """``(h, w, transposed)`` of a ``width x height`` image on the canvas (``layout.stored_meta``)."""
    return layout.stored_meta(width, height, storage_size)


def encode_for_store(path: str, storage_size: int, quality: int = JPEG_QUALITY) -> tuple[bytes, np.ndarray, bool]:
    """The bytes the JPEG store keeps for the image at ``path``: ``(jpeg bytes, meta, kept as it is)``.

    A JPEG in RGB or grey no larger than ``layout.resized_size(w, h, storage_size)`` is kept byte for byte;
    any other image is resized as ``folder.load_canvas`` resizes it and encoded at ``quality`` (4:2:0, RGB,
    or grey for a grey source). A JPEG source whose re-encoding would be larger than its file is kept.

    Raises:
        ValueError: the file cannot be read or decoded (the path is named).
    """
    from PIL import Image

    try:
        with open(path, "rb") as fh:
            source = fh.read()
        with Image.open(io.BytesIO(source)) as img:
            width, height = img.size
            meta = _meta_of(width, height, storage_size)
            target = layout.resized_size(width, height, storage_size)
            jpeg_ok = img.format == "JPEG" and img.mode in ("RGB", "L")
            if jpeg_ok and width <= target[0] and height <= target[1]:
                return source, meta, True
            grey = img.mode in _GREY_MODES or img.mode.startswith("I;16")
            box = None
            draft = layout.draft_size(width, height, target) if img.format == "JPEG" else None
            if draft is not None:
                drafted = img.draft("RGB", draft)
                box = drafted[1] if drafted is not None else None
            rgb = layout.to_rgb8(img)
            resized = rgb.resize(target, Image.Resampling.BILINEAR, box=box)  # type: ignore[attr-defined]
            # the part the canvas keeps (an image longer than the canvas is cut to its centre)
            resized = Image.fromarray(layout.cut_to_canvas(np.asarray(resized), storage_size))
            if grey:
                resized = resized.getchannel(0)
            out = io.BytesIO()
            resized.save(out, format="JPEG", quality=quality)
            data = out.getvalue()
            if jpeg_ok and len(data) >= len(source):
                return source, meta, True
            return data, meta, False
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise CorruptImageError.of(os.fspath(path), f"{type(err).__name__}: {err}") from err


def encode_block(paths: Sequence[str], storage_size: int, keep_going: bool) -> _Block:
    """``encode_for_store`` over a block (in a worker): ``(items, metas, errors)``, ``items`` an object array
    of ``(jpeg bytes, kept as it is)``; failures come back as ``(index, path, reason)``."""
    items = np.empty(len(paths), dtype=object)
    items[:] = [(b"", False)] * len(paths)
    metas = np.zeros((len(paths), 3), dtype=np.int32)
    errors: list[tuple[int, str, str]] = []
    for j, path in enumerate(paths):
        try:
            data, metas[j], as_is = encode_for_store(path, storage_size)
        except ValueError as err:
            cause = err.__cause__ or err
            errors.append((j, path, f"{type(cause).__name__}: {cause}"))
            if not keep_going:
                break
            continue
        items[j] = (data, as_is)
    return items, metas, errors


def decode_into(data: bytes, storage_size: int, out: np.ndarray, name: str) -> np.ndarray:
    """Decode one stored image onto its canvas ``out`` with the folder backend's routine; return meta."""
    from lightning_gpuopt.data import folder

    decode = getattr(folder, "decode_canvas", None)
    if decode is not None:
        return decode(io.BytesIO(data), storage_size, out, name=name)[1]
    try:
        return folder.load_canvas(io.BytesIO(data), storage_size, out=out)[1]  # type: ignore[arg-type]
    except ValueError as err:
        raise ValueError(f"cannot decode {name} ({err.__cause__ or err})") from err


class _Spill:
    """The JPEG bytes of a conversion as they arrive, appended to ``path`` (copied into the store last)."""

    def __init__(self, path: os.PathLike[str] | str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        self.size = 0
        self.offsets: list[int] = [0]

    def append(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            done = os.pwrite(self.fd, view, self.size)
            view, self.size = view[done:], self.size + done
        self.offsets.append(self.size)

    def copy_to(self, fd: int, offset: int) -> None:
        """Copy every byte into ``fd`` at ``offset`` (in the kernel where it can)."""
        done = 0
        while done < self.size:
            try:
                n = os.copy_file_range(self.fd, fd, self.size - done, done, offset + done)
            except OSError:
                n = os.pwrite(fd, os.pread(self.fd, min(self.size - done, 8 << 20), done), offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"copying the JPEG bytes into the store stopped at byte {done}")
            done += n

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class JPEGStoreWriter:
    """Writes a JPEG store into ``tmp``: bytes appended to ``spill`` as they arrive, then, once every image is
    in, the HDF5 file laid out with ``/jpeg`` allocated at its exact size, the bytes copied in, flushed, and
    the ``complete`` mark set last (the raw store's ``_StoreWriter`` contract: a failed write is an
    ``OSError`` naming the file)."""

    def __init__(self, h5py: Any, tmp: Path, spill: Path, classes: list[str], rel: list[str],
                 labels: np.ndarray, storage_size: int, source: str) -> None:  # fmt: skip
        self.h5py, self.tmp, self.rel, self.labels = h5py, tmp, rel, labels
        self.classes, self.storage_size, self.source = classes, storage_size, source
        self.meta = np.zeros((len(rel), 3), dtype=np.int32)
        self.written = self.kept = self.bytes_written = 0
        try:
            self.spill: _Spill | None = _Spill(spill)
        except OSError as err:
            raise self._failed(err) from err

    def _failed(self, err: OSError) -> OSError:
        return OSError(
            err.errno,
            f"writing {str(self.tmp)!r} failed ({err.strerror or err}); the output was not written "
            "(check free space and quotas)",
        )

    def add(self, items: np.ndarray, metas: np.ndarray) -> None:
        """Append encoded images (``(bytes, kept as it is)`` items, in order)."""
        assert self.spill is not None
        for (data, as_is), meta in zip(items, metas, strict=True):
            try:
                self.spill.append(data)
            except OSError as err:
                raise self._failed(err) from err
            self.meta[self.written] = meta
            self.bytes_written += len(data)
            self.kept += int(as_is)
            self.written += 1

    def _hdf5(self, mode: str, work: Callable[[Any], None]) -> None:
        fh = HDF5Writes(self.tmp)
        try:
            with self.h5py.File(fh, mode) as f:
                work(f)
        except RuntimeError as err:
            failed = fh.error or OSError(errno.EIO, f"{type(err).__name__}: {err}")
            raise self._failed(failed) from err
        finally:
            fh.close()
        if fh.error is not None:
            raise self._failed(fh.error)

    def finish(self, keep: np.ndarray, skipped: list[str]) -> None:
        """Lay the store out, copy the bytes in, flush, then set the completeness mark and flush again."""
        assert self.spill is not None
        w, h5py = self.written, self.h5py
        str_dt = h5py.string_dtype("utf-8")
        kept_names = np.array([r for r, k in zip(self.rel, keep, strict=True) if k], dtype=object)
        where: dict[str, int] = {}

        def lay_out(f: Any) -> None:
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
            dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
            dcpl.set_layout(h5py.h5d.CONTIGUOUS)
            blob = f.create_dataset("jpeg", shape=(max(1, self.spill.size),), dtype=np.uint8, dcpl=dcpl)
            where["offset"] = int(blob.id.get_offset())
            f.create_dataset("jpeg_offsets", data=np.asarray(self.spill.offsets, dtype=np.int64))
            f.create_dataset("meta", data=self.meta[:w])
            f.create_dataset("labels", data=self.labels[keep])
            f.create_dataset("classes", data=np.array(self.classes, dtype=object), dtype=str_dt)
            f.create_dataset("files", data=kept_names, dtype=str_dt)
            f.create_dataset("skipped_files", data=np.array(skipped, dtype=object), dtype=str_dt)
            f.attrs.update({
                "format": JPEG_FORMAT, "format_version": JPEG_FORMAT_VERSION, "layout_version": LAYOUT_VERSION,
                "storage_size": self.storage_size, "max_aspect": layout.MAX_ASPECT, "resize": RESIZE_DOC,
                "uuid": uuid.uuid4().hex, "num_skipped": len(skipped), "source": self.source,
                "jpeg_quality": JPEG_QUALITY, "jpeg_data_offset": where["offset"], "num_kept": self.kept,
            })  # fmt: skip

        self._hdf5("w", lay_out)
        try:
            fd = os.open(self.tmp, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                self.spill.copy_to(fd, where["offset"])
                os.fsync(fd)  # the images are on disk before the mark that says they are
            finally:
                os.close(fd)
        except OSError as err:
            raise self._failed(err) from err
        self.close()
        self._hdf5("r+", lambda f: f.attrs.__setitem__(COMPLETE_ATTR, True))
        try:
            with open(self.tmp, "rb") as fh:
                os.fsync(fh.fileno())
        except OSError as err:
            raise self._failed(err) from err

    def close(self) -> None:
        """Close and remove the spill file."""
        if self.spill is not None:
            self.spill.close()
            with contextlib.suppress(OSError):
                os.unlink(self.spill.path)
            self.spill = None


class JPEGStoreDataset(DecodesInWorkers, HDF5ImageDataset):
    """Map-style dataset over a JPEG store (``convert_folder_to_hdf5(..., format="jpeg")``):
    ``(canvas, label, meta)`` exactly as ``HDF5ImageDataset`` gives them.

    ``HDF5ImageDataset(path)`` returns one of these for a JPEG store, so every reader of the raw store
    (``OptimizedDataModule``, ``HDF5Backend``, ``tune``) reads it unchanged. ``read_into(indices, images)``
    reads each image's bytes with one ``pread`` and decodes them onto its row of ``images`` (the folder
    backend's routine: whole image, resized like ``Resize(S)``, on the canvas); threads calling it at once
    decode in parallel. Like an image folder it is read by DataLoader worker processes, a whole batch a call
    (``read_in_workers``; ``readers.WholeBatches``), one a CPU with ``num_workers="auto"``
    (``auto_readers``).

    Args:
        path: the ``.h5`` file (``lightning-gpuopt convert SRC OUT.h5 --format jpeg`` makes one).

    Example:
        >>> ds = HDF5ImageDataset("train_jpeg.h5")  # doctest: +SKIP
        >>> type(ds).__name__, ds[0][0].shape  # doctest: +SKIP
        ('JPEGStoreDataset', (256, 384, 3))
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self.feed_info = FeedInfo(backend="hdf5")

    def _read_header(self, f: Any) -> None:
        h5py = self._h5py()
        fix = _convert_fix(self.path)
        attrs = f.attrs
        version = int(attrs.get("format_version", 0))
        layout_version = int(attrs.get("layout_version", 0))
        if version == JPEG_FORMAT_VERSION and layout_version == 1:
            raise ValueError(f"{self.path!r} {LAYOUT_1}: {fix} --format jpeg")
        if version != JPEG_FORMAT_VERSION or layout_version != LAYOUT_VERSION:
            raise ValueError(
                f"{self.path!r} is a JPEG store of format version {version}, layout version "
                f"{layout_version}; this lightning-gpuopt reads {JPEG_FORMAT_VERSION}/"
                f"{LAYOUT_VERSION}: {fix} --format jpeg (or upgrade lightning-gpuopt)"
            )
        if not attrs.get(COMPLETE_ATTR, False):
            raise ValueError(
                f"HDF5 file {self.path!r} is incomplete: the conversion did not finish (no {COMPLETE_ATTR!r} "
                f"mark); convert again: {fix} --format jpeg"
            )
        for name in ("jpeg", "jpeg_offsets", "meta", "labels", "classes"):
            if not isinstance(f.get(name), h5py.Dataset):
                raise ValueError(f"HDF5 file {self.path!r} has no {name!r} dataset; it is incomplete: {fix}")
        blob, offsets, meta, labels = f["jpeg"], f["jpeg_offsets"], f["meta"], f["labels"]
        n = int(labels.shape[0])
        self.storage_size = int(attrs["storage_size"])
        self.uuid = str(attrs["uuid"])
        self._offsets = offsets[()].astype(np.int64)
        base = int(attrs.get("jpeg_data_offset", -1))
        consistent = (
            blob.dtype == np.uint8 and blob.chunks is None and blob.id.get_offset() == base
            and self._offsets.shape == (n + 1,) and n > 0 and meta.shape == (n, 3)
            and labels.dtype.kind in "iu" and float(attrs.get("max_aspect", 0)) == layout.MAX_ASPECT
            and bool(np.all(np.diff(self._offsets) > 0)) and int(self._offsets[-1]) <= blob.shape[0]
        )  # fmt: skip
        if not consistent:
            raise ValueError(f"HDF5 file {self.path!r} is inconsistent (offsets or layout differ from the "
                             f"format); {fix} --format jpeg")  # fmt: skip
        self._base = base
        self.image_shape = (*layout.canvas_shape(self.storage_size), 3)
        self._image_bytes = int(np.prod(self.image_shape))
        self.labels = labels[()].astype(np.int64, copy=False)
        self.meta = meta[()].astype(np.int32, copy=False)
        self.classes = [c.decode() if isinstance(c, bytes) else str(c) for c in f["classes"][()]]
        self.jpeg_quality = int(attrs.get("jpeg_quality", JPEG_QUALITY))

    @staticmethod
    def _h5py() -> Any:
        from lightning_gpuopt._imports import require

        return require("h5py")

    def _raw_end(self) -> int:
        return self._base + int(self._offsets[-1])

    @property
    def bytes_per_image(self) -> float:
        """Mean JPEG bytes an image of this store."""
        return float(self._offsets[-1]) / len(self)

    def byte_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """``(first byte in the file, byte count)`` of every image's JPEG, int64 each (one ``pread`` an image
        reads it: ``os.pread(fd, count, first)``)."""
        return self._base + self._offsets[:-1], np.diff(self._offsets)

    def _bytes(self, fd: int, i: int) -> bytes:
        start, end = int(self._offsets[i]), int(self._offsets[i + 1])
        data = os.pread(fd, end - start, self._base + start)
        if len(data) != end - start:
            raise RuntimeError(
                f"HDF5 store {self.path!r} ended inside image {i} (the file was truncated while open); "
                f"{_convert_fix(self.path)} --format jpeg"
            )
        return data

    def _decode(self, fd: int, i: int, out: np.ndarray) -> np.ndarray:
        return decode_into(self._bytes(fd, i), self.storage_size, out, name=f"image {i} of {self.path!r}")

    def read_into(
        self, indices: Sequence[int] | np.ndarray, images: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Read and decode the images at ``indices`` into ``images``; return their ``(labels, meta)``.

        ``images`` must be a writable C-contiguous uint8 ``(len(indices), *image_shape)`` array (a pinned
        tensor's ``.numpy()``). One positional read an image, decoded onto its row (the GIL released while
        PIL decodes), so several threads reading batches run in parallel.
        """
        idx = self._indices(indices)
        shape = (int(idx.size), *self.image_shape)
        check_batch_array(images, shape, "JPEGStoreDataset.read_into's images")
        fd = self._reader().fileno()
        meta = np.empty((shape[0], 3), dtype=np.int32)
        for j, i in enumerate(idx.tolist()):
            meta[j] = self._decode(fd, i, images[j])
        return self.labels[idx], meta

    def __getitem__(self, index: int) -> tuple[np.ndarray, int, np.ndarray]:
        i = self._index(index)
        canvas = np.empty(self.image_shape, dtype=np.uint8)
        meta = self._decode(self._reader().fileno(), i, canvas)
        return canvas, int(self.labels[i]), meta

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[np.ndarray, int, np.ndarray]]:
        """A batch as a list of ``(canvas, label, meta)`` in request order (canvases rows of one array)."""
        idx = self._indices(indices)
        batch = np.empty((int(idx.size), *self.image_shape), dtype=np.uint8)
        labels, meta = self.read_into(idx, batch)
        return list(zip(batch, labels.tolist(), meta, strict=True))

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this dataset for caches: the raw store's keys and the format."""
        return {**super().fingerprint(), "format": JPEG_FORMAT}

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(path={self.path!r}, images={len(self)}, storage_size={self.storage_size}, "
            f"bytes_per_image={self.bytes_per_image:,.0f}, classes={len(self.classes)})"
        )
