"""uint8 HDF5 image store: a parallel, atomic converter and a fast, spawn-safe map-style dataset.

Layout written by ``convert_folder_to_hdf5`` (format version 1)::

    /images          uint8 (N, H, W, 3), chunks (chunk_images, H, W, 3), optional gzip/lzf
    /labels          int64 (N,)
    /classes         variable-length UTF-8 strings (C,), index = label
    /files           variable-length UTF-8 strings (N,), source paths relative to the source folder
    /skipped_files   variable-length UTF-8 strings, unreadable source images left out (on_corrupt="skip")
    /chunk_offsets   int64 (ceil(N / chunk_images),), byte offset of each image chunk in the file
    attrs: format="lightning-gpuopt/uint8-images", format_version=1, image_size, resize, chunk_images,
           compression, num_skipped, source

Reading: images of an *unfiltered* store (no compression, the default) are plain bytes at the byte
offsets HDF5 reports for each chunk (``H5Dchunk_iter``, stored in ``/chunk_offsets`` at conversion and
checked against HDF5 on open). Each process maps the file read-only once (``mmap``) and ``__getitems__``
copies a whole batch out of the mapping into one ``(B, H, W, 3)`` array, returning per-image views of
it: no system call and no HDF5 selection work per image. ``mmap_reads=False`` reads with one
``os.preadv`` per run of neighbouring images instead. Compressed stores are read through h5py with a
chunk cache sized to the chunk (see ``HDF5ImageDataset``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from lightning_gpuopt._imports import require

FORMAT = "lightning-gpuopt/uint8-images"
FORMAT_VERSION = 1
RESIZE_DOC = "short side resized to image_size (PIL bilinear, antialiased), then center crop image_size^2"
COMPRESSIONS = (None, "gzip", "lzf")
_IOV_MAX = 1024  # POSIX minimum of IOV_MAX on Linux
_BLOCK_IMAGES = 32  # images a decode task returns: big enough to amortise IPC, small enough to stream
# batches up to this many bytes are gathered with one fancy index into a fresh array; larger ones are
# copied image by image into a recycled batch buffer (a fresh multi-MB array is a new mmap whose page
# faults and zeroing cost about as much as the copy itself: 2-core CPU, 256 px, measured)
_FANCY_MAX_BYTES = 4 << 20


# --------------------------------------------------------------------------------------------------
# conversion
# --------------------------------------------------------------------------------------------------


@dataclass
class ConversionResult:
    """What ``convert_folder_to_hdf5`` wrote.

    Attributes:
        path: the HDF5 file.
        num_images: images stored.
        classes: class names (index = label).
        skipped: source files left out as unreadable (``on_corrupt="skip"``), relative to the source.
        seconds: wall time of the conversion.
    """

    path: Path
    num_images: int
    classes: list[str]
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _decode_block(job: tuple[list[str], int, bool]) -> tuple[np.ndarray, list[tuple[int, str]]]:
    """Decode a block of images (runs in a worker process); failures come back as ``(position, message)``."""
    from lightning_gpuopt.data.folder import load_uint8_image

    paths, size, keep_going = job
    out = np.empty((len(paths), size, size, 3), dtype=np.uint8)
    errors: list[tuple[int, str]] = []
    for j, path in enumerate(paths):
        try:
            out[j] = load_uint8_image(path, size)
        except ValueError as err:  # load_uint8_image reports every unreadable file as ValueError
            errors.append((j, str(err)))
            if not keep_going:
                break
    return out, errors


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temps(out: Path) -> None:
    """Remove ``OUT.tmp-<pid>`` left by conversions that were killed (their process no longer exists)."""
    for tmp in out.parent.glob(out.name + ".tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            with contextlib.suppress(OSError):
                tmp.unlink()


def _decoded_blocks(
    jobs: list[tuple[list[str], int, bool]], workers: int
) -> Iterator[tuple[np.ndarray, list[tuple[int, str]]]]:
    """Yield decoded blocks in order, keeping at most ``2 * workers`` blocks in flight (bounded memory)."""
    if workers <= 1:
        for job in jobs:
            yield _decode_block(job)
        return
    with ProcessPoolExecutor(max_workers=workers) as pool:
        pending: deque[Future[tuple[np.ndarray, list[tuple[int, str]]]]] = deque()
        it = iter(jobs)
        try:
            for job in it:
                pending.append(pool.submit(_decode_block, job))
                if len(pending) >= 2 * workers:
                    break
            while pending:
                result = pending.popleft().result()
                nxt = next(it, None)
                if nxt is not None:
                    pending.append(pool.submit(_decode_block, nxt))
                yield result
        finally:
            for fut in pending:  # on an error or early exit, do not decode the rest
                fut.cancel()


def _chunk_offsets(dset: Any, chunk_images: int) -> np.ndarray:
    """Byte offset in the file of every chunk of ``dset`` (index = first image // chunk_images)."""
    n_chunks = -(-dset.shape[0] // chunk_images)
    offsets = np.full(n_chunks, -1, dtype=np.int64)
    dsid = dset.id
    if hasattr(dsid, "chunk_iter"):  # HDF5 >= 1.14 (h5py >= 3.8): one pass over the chunk index

        def visit(info: Any) -> None:
            offsets[info.chunk_offset[0] // chunk_images] = info.byte_offset

        dsid.chunk_iter(visit)
    else:
        for i in range(dsid.get_num_chunks()):
            info = dsid.get_chunk_info(i)
            offsets[info.chunk_offset[0] // chunk_images] = info.byte_offset
    return offsets


def convert_folder_to_hdf5(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    size: int = 256,
    chunk_images: int = 1,
    compression: str | None = None,
    compression_level: int = 4,
    workers: int | None = None,
    progress: bool = True,
    on_corrupt: str = "raise",
    overwrite: bool = False,
) -> ConversionResult:
    """Convert a class-per-subfolder image folder into a chunked uint8 HDF5 file.

    Every image is decoded and resized with ``lightning_gpuopt.data.folder.load_uint8_image``: short side
    to ``size`` (PIL bilinear, antialiased), then center crop to ``size x size`` -- the same pixels
    ``UInt8ImageFolder(size=size)`` gives. Images are decoded in parallel worker processes and written in
    order as they arrive (at most ``2 * workers`` blocks of 32 images held in memory). The file is written
    as ``OUT.tmp-<pid>`` beside ``out`` and renamed over ``out`` only when complete, so an interrupted
    conversion never leaves a partial ``out``; on an exception the temporary file is removed, and temporary
    files of killed conversions are removed by the next conversion to the same ``out``.

    Args:
        src: folder laid out as ``src/<class>/<image>``.
        out: the ``.h5`` file to write; its folder must exist.
        size: side of the stored square in pixels (256 for 224 training crops).
        chunk_images: images per HDF5 chunk. 1 (default) makes a random read touch exactly its image;
            larger chunks only help sequential reading and compression ratio.
        compression: ``None`` (default, fastest reads), ``"gzip"`` (smallest, slow to read) or ``"lzf"``.
            With compression a random read decompresses its whole chunk, so keep ``chunk_images`` small.
        compression_level: gzip level 0-9 (ignored otherwise).
        workers: decode processes (default: all CPUs; 0 or 1 decodes in this process).
        progress: show a progress bar on stderr.
        on_corrupt: ``"raise"`` (default) raises ``ValueError`` naming the first unreadable image;
            ``"skip"`` leaves unreadable images out and lists them in ``/skipped_files`` and the result.
        overwrite: replace an existing ``out``.

    Returns:
        ``ConversionResult`` (path, number of images, classes, skipped files, seconds).

    Raises:
        FileNotFoundError: ``src`` or the folder of ``out`` does not exist.
        ValueError: bad arguments, ``out`` exists without ``overwrite``, an empty/invalid ``src``, or an
            unreadable image with ``on_corrupt="raise"`` (the file is named).
    """
    from lightning_gpuopt.data.folder import ON_CORRUPT, scan_image_folder

    h5py = require("h5py")
    t_start = time.perf_counter()
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int (pixels), got {size!r}")
    if not isinstance(chunk_images, int) or chunk_images < 1:
        raise ValueError(f"chunk_images must be a positive int, got {chunk_images!r}")
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    if compression == "gzip" and not (isinstance(compression_level, int) and 0 <= compression_level <= 9):
        raise ValueError(f"compression_level must be an int in 0..9 for gzip, got {compression_level!r}")
    if on_corrupt not in ON_CORRUPT:
        raise ValueError(f"on_corrupt must be one of {ON_CORRUPT}, got {on_corrupt!r}")
    if workers is not None and (not isinstance(workers, int) or workers < 0):
        raise ValueError(f"workers must be None or an int >= 0, got {workers!r}")
    src_path = Path(src).expanduser()
    out_path = Path(out).expanduser()
    if not out_path.parent.is_dir():
        raise FileNotFoundError(
            f"output folder {str(out_path.parent)!r} does not exist; create it first (mkdir -p)"
        )
    if out_path.is_dir():
        raise ValueError(f"output {str(out_path)!r} is a folder; give a file name such as train.h5")
    if out_path.exists() and not overwrite:
        raise ValueError(
            f"output {str(out_path)!r} already exists; pass overwrite=True (--overwrite) or another name"
        )
    classes, samples = scan_image_folder(src_path)  # names the path for a missing/empty/invalid folder
    n = len(samples)
    workers = (os.cpu_count() or 1) if workers is None else workers
    workers = max(1, min(workers, -(-n // _BLOCK_IMAGES)))
    paths = [p for p, _ in samples]
    labels = np.fromiter((lbl for _, lbl in samples), dtype=np.int64, count=n)
    rel = [os.path.relpath(p, src_path).replace(os.sep, "/") for p in paths]
    keep_going = on_corrupt == "skip"
    jobs = [(paths[i : i + _BLOCK_IMAGES], size, keep_going) for i in range(0, n, _BLOCK_IMAGES)]

    _remove_stale_temps(out_path)
    tmp = out_path.with_name(f"{out_path.name}.tmp-{os.getpid()}")
    str_dt = h5py.string_dtype("utf-8")
    filters: dict[str, Any] = {}
    if compression == "gzip":
        filters = {"compression": "gzip", "compression_opts": compression_level}
    elif compression == "lzf":
        filters = {"compression": "lzf"}
    skipped: list[str] = []
    bar = None
    try:
        # the decode pool starts on the first ``next`` below, before the HDF5 file is opened, so forked
        # workers never inherit an open HDF5 handle
        blocks = _decoded_blocks(jobs, workers)
        first = next(blocks)
        from tqdm.auto import tqdm

        bar = tqdm(
            total=n, unit="img", desc=f"convert {src_path.name}", disable=not progress, file=sys.stderr
        )
        with h5py.File(tmp, "w") as f:
            images = f.create_dataset(
                "images",
                shape=(n, size, size, 3),
                maxshape=(None, size, size, 3),
                dtype=np.uint8,
                chunks=(min(chunk_images, n), size, size, 3),
                **filters,
            )
            keep = np.ones(n, dtype=bool)
            written = 0
            for b, (block, errors) in enumerate(_chain(first, blocks)):
                start = b * _BLOCK_IMAGES
                bad = set()
                for j, message in errors:
                    if not keep_going:
                        raise ValueError(message)
                    bad.add(j)
                    keep[start + j] = False
                    skipped.append(rel[start + j])
                good = block if not bad else block[[j for j in range(len(block)) if j not in bad]]
                if len(good):
                    images[written : written + len(good)] = good
                    written += len(good)
                bar.update(len(block))
            if written == 0:
                raise ValueError(f"no readable images in {str(src_path)!r} ({len(skipped)} skipped)")
            if written < n:
                images.resize(written, axis=0)
            f.create_dataset("labels", data=labels[keep])
            f.create_dataset("classes", data=np.array(classes, dtype=object), dtype=str_dt)
            f.create_dataset(
                "files",
                data=np.array([r for r, k in zip(rel, keep, strict=True) if k], dtype=object),
                dtype=str_dt,
            )
            f.create_dataset(
                "skipped_files", data=np.array(skipped, dtype=object), dtype=str_dt, shape=(len(skipped),)
            )
            f.create_dataset("chunk_offsets", data=_chunk_offsets(images, images.chunks[0]))
            f.attrs.update(
                {
                    "format": FORMAT,
                    "format_version": FORMAT_VERSION,
                    "image_size": size,
                    "resize": RESIZE_DOC,
                    "chunk_images": images.chunks[0],
                    "compression": compression or "none",
                    "num_skipped": len(skipped),
                    "source": os.path.abspath(src_path),
                }
            )
        with open(tmp, "rb") as fh:  # durable before it becomes visible under its final name
            os.fsync(fh.fileno())
        os.replace(tmp, out_path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    finally:
        if bar is not None:
            bar.close()
    return ConversionResult(out_path, written, list(classes), skipped, time.perf_counter() - t_start)


def _chain(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest


# --------------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------------


def _next_prime(n: int) -> int:
    def is_prime(k: int) -> bool:
        return k >= 2 and all(k % d for d in range(2, int(k**0.5) + 1))

    while not is_prime(n):
        n += 1
    return n


class HDF5ImageDataset(Dataset):
    """Map-style dataset over a uint8 HDF5 image store, returning ``(uint8 HWC array, label)``.

    The file is checked in ``__init__`` and closed again; each process opens it on first use (and again
    after a fork), so the object pickles cheaply and is safe with ``fork``, ``spawn`` and ``forkserver``
    DataLoader workers and DDP. ``__getitems__`` (called by the DataLoader with the whole batch of
    indices, torch >= 2.1) reads a batch into one array in one pass over the sorted indices.

    Two read paths:

    * unfiltered stores (the converter's default): the images are plain bytes at the chunk byte offsets
      HDF5 reports (``/chunk_offsets``, verified on open), or at the dataset offset for contiguous
      (unchunked) files. Each process maps the file read-only (``mmap``, on first read); ``__getitems__``
      copies the batch out of the mapping into one ``(B, H, W, 3)`` array and returns per-image views of
      its rows (writable, owned by that array; the array is recycled for the next batch once no view of
      it is alive). ``mmap_reads=False`` uses one ``os.preadv`` per run of neighbouring images instead.
      No chunk cache is involved.
    * compressed stores (and ``raw_reads=False``): h5py reads. A random read of a compressed chunk must
      decompress the whole chunk, so the chunk cache is sized to hold ``cache_chunks`` chunks
      (``rdcc_nbytes``), with ``rdcc_nslots`` a prime about 100x that many chunks (HDF5's advice) and
      ``rdcc_w0=1`` (fully read chunks are evicted first: an epoch reads each chunk once). Neighbouring
      images of a sorted batch that share a chunk then cost one decompression. For unfiltered stores
      read through h5py the cache is 0 bytes: a chunk that cannot be cached is read straight into the
      output buffer instead of being copied through the cache.

    Args:
        path: the ``.h5`` file (``lightning-gpuopt convert`` makes one).
        raw_reads: read unfiltered stores at their byte offsets (default); ``False`` always uses h5py.
        mmap_reads: with ``raw_reads``, read through a per-process read-only memory map (default);
            ``False``: ``os.preadv`` system calls (one per run of neighbouring images).
        rdcc_nbytes: chunk cache bytes per dataset per process (default: see above).
        rdcc_nslots: chunk cache hash slots (default: a prime ~100x the chunks that fit).
        rdcc_w0: chunk cache eviction preference for fully read chunks (0..1).
        cache_chunks: chunks the default cache holds for compressed stores.

    Example:
        >>> ds = HDF5ImageDataset("train_256.h5")  # doctest: +SKIP
        >>> image, label = ds[0]  # (256, 256, 3) uint8, int
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        raw_reads: bool = True,
        mmap_reads: bool = True,
        rdcc_nbytes: int | None = None,
        rdcc_nslots: int | None = None,
        rdcc_w0: float = 1.0,
        cache_chunks: int = 4,
    ) -> None:
        h5py = require("h5py")
        if not 0.0 <= rdcc_w0 <= 1.0:
            raise ValueError(f"rdcc_w0 must be in [0, 1], got {rdcc_w0!r}")
        if cache_chunks < 1:
            raise ValueError(f"cache_chunks must be >= 1, got {cache_chunks!r}")
        if rdcc_nbytes is not None and rdcc_nbytes < 0:
            raise ValueError(f"rdcc_nbytes must be >= 0, got {rdcc_nbytes!r}")
        self.path = os.path.abspath(os.path.expanduser(os.fspath(path)))
        fix = "make one with `lightning-gpuopt convert SRC_FOLDER OUT.h5 --size 256`"
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"HDF5 file {self.path!r} does not exist; check the path or {fix}")
        if not os.path.isfile(self.path) or not h5py.is_hdf5(self.path):
            raise ValueError(f"{self.path!r} is not an HDF5 file; {fix}")
        with h5py.File(self.path, "r") as f:
            missing = [k for k in ("images", "labels") if not isinstance(f.get(k), h5py.Dataset)]
            if missing:
                raise ValueError(
                    f"HDF5 file {self.path!r} has no dataset(s) {missing} (found {sorted(f.keys())}); it needs "
                    f"'images' uint8 (N, H, W, 3) and 'labels' int (N,): {fix}"
                )
            images, labels = f["images"], f["labels"]
            if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
                raise ValueError(
                    f"HDF5 file {self.path!r}: 'images' must be uint8 (N, H, W, 3), got {images.dtype} "
                    f"{images.shape}; {fix}"
                )
            if labels.ndim != 1 or labels.dtype.kind not in "iu":
                raise ValueError(
                    f"HDF5 file {self.path!r}: 'labels' must be integers of shape (N,), got {labels.dtype} "
                    f"{labels.shape}; {fix}"
                )
            if labels.shape[0] != images.shape[0]:
                raise ValueError(
                    f"HDF5 file {self.path!r}: {images.shape[0]} images but {labels.shape[0]} labels; the file "
                    f"is inconsistent (an interrupted or hand-made write?): {fix}"
                )
            self.labels: np.ndarray = labels[()].astype(np.int64, copy=False)
            if len(self.labels) and int(self.labels.min()) < 0:
                raise ValueError(f"HDF5 file {self.path!r}: 'labels' holds negative values; {fix}")
            if isinstance(f.get("classes"), h5py.Dataset):
                self.classes: list[str] = [
                    c.decode() if isinstance(c, bytes) else str(c) for c in f["classes"][()]
                ]
            else:
                self.classes = [str(i) for i in range(int(self.labels.max()) + 1 if len(self.labels) else 0)]
            self.image_shape: tuple[int, int, int] = tuple(images.shape[1:])  # type: ignore[assignment]
            self._len = int(images.shape[0])
            self._image_bytes = int(np.prod(self.image_shape))
            filtered = images.id.get_create_plist().get_nfilters() > 0
            self.compression: str | None = images.compression
            self.chunks: tuple[int, ...] | None = images.chunks
            chunk_bytes = int(np.prod(images.chunks)) if images.chunks else self._image_bytes
            self._chunk_images = images.chunks[0] if images.chunks else 0
            self._raw_base: int | None = None
            self._raw_offsets: np.ndarray | None = None
            if raw_reads and not filtered:
                self._setup_raw(f, images)
        # map only when every image lies inside the file (a truncated file would fault, not short-read)
        self.mmap_reads = bool(
            mmap_reads and self.raw_reads and self._len > 0 and self._raw_end() <= os.path.getsize(self.path)
        )
        if rdcc_nbytes is None:
            rdcc_nbytes = cache_chunks * chunk_bytes if filtered else 0
        fitting = max(1, rdcc_nbytes // max(chunk_bytes, 1))
        self.rdcc_nbytes = int(rdcc_nbytes)
        self.rdcc_nslots = (
            int(rdcc_nslots) if rdcc_nslots is not None else _next_prime(max(521, 100 * fitting))
        )
        self.rdcc_w0 = float(rdcc_w0)
        self._file: Any = None
        self._images: Any = None
        self._fd: int | None = None
        self._win: np.ndarray | None = None  # (file bytes - image bytes + 1, H, W, 3) window on the map
        self._buf: np.ndarray | None = None  # recycled batch array (large batches)
        self._pid: int | None = None

    def _setup_raw(self, f: Any, images: Any) -> None:
        """Find byte offsets for direct reads; leave them unset (h5py path) when they cannot be trusted."""
        if images.chunks is None:
            offset = images.id.get_offset()
            if offset is not None:  # None: contiguous storage never written
                self._raw_base = int(offset)
            return
        if images.chunks[1:] != images.shape[1:]:
            return  # chunks that split an image: its bytes are not contiguous in the file
        n_chunks = -(-self._len // self._chunk_images)
        stored = f.get("chunk_offsets")
        if stored is not None and stored.shape == (n_chunks,):
            offsets = stored[()].astype(np.int64)
        elif n_chunks <= 100_000:  # files from other tools: ask HDF5 (about 10 us a chunk)
            offsets = _chunk_offsets(images, self._chunk_images)
        else:
            return
        if n_chunks == 0 or int(offsets.min()) < 0:
            return  # unallocated chunks (never written)
        # the table must agree with HDF5 (a file rewritten in place would not); check a spread of chunks
        dsid = images.id
        for c in {0, n_chunks // 2, n_chunks - 1}:
            info = dsid.get_chunk_info_by_coord((c * self._chunk_images, 0, 0, 0))
            if info.byte_offset != offsets[c] or info.size != int(np.prod(images.chunks)):
                return
        self._raw_offsets = offsets

    def _raw_end(self) -> int:
        """One past the last byte of image data in the file (raw reads only)."""
        if self._raw_offsets is not None:
            return int(self._raw_offsets.max()) + self._chunk_images * self._image_bytes
        return int(self._raw_base) + self._len * self._image_bytes  # type: ignore[arg-type]

    @property
    def raw_reads(self) -> bool:
        """Whether images are read at known byte offsets (memory map or ``preadv``; else through h5py)."""
        return self._raw_base is not None or self._raw_offsets is not None

    def __len__(self) -> int:
        return self._len

    # -- per-process handles --------------------------------------------------------------------------

    def _ensure_open(self) -> None:
        pid = os.getpid()
        if self._pid == pid:
            return
        # a handle inherited through fork belongs to the parent: drop it without closing (closing could
        # disturb the parent's HDF5 state) and open our own
        self._file = self._images = self._fd = self._win = self._buf = None
        if self.mmap_reads:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)  # the mapping stays valid without the descriptor
            flat = np.frombuffer(mapped, dtype=np.uint8)
            h, w, c = self.image_shape
            # row k of this window is the image whose bytes start at file offset k: one integer index
            # gives a view, an array of offsets gathers a batch in one fancy-index copy
            self._win = np.lib.stride_tricks.as_strided(
                flat,
                shape=(flat.size - self._image_bytes + 1, h, w, c),
                strides=(1, w * c, c, 1),
                writeable=False,
            )
        elif self.raw_reads:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        else:
            h5py = require("h5py")
            self._file = h5py.File(
                self.path,
                "r",
                rdcc_nbytes=self.rdcc_nbytes,
                rdcc_nslots=self.rdcc_nslots,
                rdcc_w0=self.rdcc_w0,
            )
            self._images = self._file["images"]
        self._pid = pid

    def close(self) -> None:
        """Close this process's handle (reopened on the next read)."""
        if self._pid == os.getpid():
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
            if self._file is not None:
                with contextlib.suppress(Exception):  # h5py may already be shutting down at exit
                    self._file.close()
        # the map is unmapped when the last array using it goes (closing it under live arrays would fail)
        self._file = self._images = self._fd = self._win = self._buf = self._pid = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_file=None, _images=None, _fd=None, _win=None, _buf=None, _pid=None)
        return state

    # -- reads ----------------------------------------------------------------------------------------

    def _offsets_of(self, idx: np.ndarray) -> np.ndarray:
        if self._raw_offsets is not None:
            chunk, within = np.divmod(idx, self._chunk_images)
            return self._raw_offsets[chunk] + within * self._image_bytes
        return int(self._raw_base) + idx * self._image_bytes  # type: ignore[arg-type]

    def _offset(self, index: int) -> int:
        if self._raw_offsets is not None:
            chunk, within = divmod(index, self._chunk_images)
            return int(self._raw_offsets[chunk]) + within * self._image_bytes
        return int(self._raw_base) + index * self._image_bytes  # type: ignore[arg-type]

    def _pread_into(self, dest: np.ndarray, index: int) -> None:
        got = os.preadv(self._fd, [dest], self._offset(index))  # type: ignore[arg-type,list-item]
        if got != self._image_bytes:
            raise OSError(
                f"short read of image {index} from {self.path!r} ({got} of {self._image_bytes} bytes)"
            )

    def _check_index(self, index: int) -> int:
        index = int(index)
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"index {index} out of range for {self._len} images in {self.path!r}")
        return index

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        index = self._check_index(index)
        self._ensure_open()
        if self._win is not None:
            out = self._win[self._offset(index)].copy()
        elif self.raw_reads:
            out = np.empty(self.image_shape, dtype=np.uint8)
            self._pread_into(out.reshape(-1), index)
        else:
            out = self._images[index]
        return out, int(self.labels[index])

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[np.ndarray, int]]:
        """Read a batch in ascending file order and return it in request order.

        Returns a list of ``(uint8 HWC array, label)``, the shape the DataLoader's fetcher passes to
        ``collate_fn``.
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size == 0:
            return []
        idx = np.where(idx < 0, idx + self._len, idx)
        if int(idx.min()) < 0 or int(idx.max()) >= self._len:
            bad = next(
                int(i) for i in np.asarray(indices).reshape(-1) if not -self._len <= int(i) < self._len
            )
            raise IndexError(f"index {bad} out of range for {self._len} images in {self.path!r}")
        self._ensure_open()
        if self._win is not None:
            return self._gather(idx)
        if self.raw_reads:
            # read each image straight into its own array, in file order (read-ahead friendly on cold
            # files): images adjacent in the file go in one preadv call, so the batch comes out in
            # request order with no un-permuting copy. One array per image, not one (B, H, W, 3) block:
            # a block of tens of MB is a fresh mmap (page faults + zeroing) on every call, while
            # image-sized buffers are recycled by the allocator (about 1.5x faster at 256 px, 2-core CPU).
            images = [np.empty(self.image_shape, dtype=np.uint8) for _ in range(idx.size)]
            flat = [img.reshape(-1) for img in images]
            order = np.argsort(idx, kind="stable")
            offsets = self._offsets_of(idx[order])
            breaks = np.flatnonzero(np.diff(offsets) != self._image_bytes) + 1
            starts = [0, *breaks.tolist()]
            ends = [*breaks.tolist(), int(idx.size)]
            rows_in_order = order.tolist()
            for a, b in zip(starts, ends, strict=True):
                for c in range(a, b, _IOV_MAX):  # preadv takes at most IOV_MAX buffers
                    d = min(b, c + _IOV_MAX)
                    got = os.preadv(self._fd, [flat[j] for j in rows_in_order[c:d]], int(offsets[c]))  # type: ignore[arg-type]
                    if got != (d - c) * self._image_bytes:
                        raise OSError(
                            f"short read from {self.path!r} at byte {int(offsets[c])} ({got} bytes); "
                            "the file was truncated or changed while open"
                        )
            labels = self.labels[idx].tolist()
            return list(zip(images, labels, strict=True))
        rows, where = self._read_h5py(idx)  # duplicates share a row: views, no un-permuting copy
        labels = self.labels[idx].tolist()
        return [(rows[where[j]], labels[j]) for j in range(idx.size)]

    def _gather(self, idx: np.ndarray) -> list[tuple[np.ndarray, int]]:
        """Copy a batch out of the memory map into one (B, H, W, 3) array; items are views of its rows.

        Request order (no sort: the file is mapped, so order only matters to a cold page cache, and
        request-order rows let a collate recognise one contiguous batch). Duplicates are simply copied
        twice.
        """
        win = self._win
        if win is None:  # _gather is only called once the map is open; say so rather than fail obscurely
            raise RuntimeError(f"HDF5ImageDataset({self.path!r}): memory map not open")
        offsets = self._offsets_of(idx)
        n = int(idx.size)
        if n * self._image_bytes <= _FANCY_MAX_BYTES:
            batch = win[offsets]  # one gather: a memcpy per image inside numpy, no Python loop
        else:
            batch = self._batch_buffer(n)
            for j, off in enumerate(offsets.tolist()):
                batch[j] = win[off]
        return list(zip(batch, self.labels[idx].tolist(), strict=True))

    def _batch_buffer(self, n: int) -> np.ndarray:
        """A (n, H, W, 3) array to fill: the previous batch's array when nothing refers to it any more."""
        buf = self._buf
        # references when free: self.__dict__, ``buf`` here and getrefcount's argument. Every view of it
        # (the items handed out, anything made from them) holds a reference, so a batch still in use is
        # never overwritten.
        if buf is None or buf.shape[0] < n or sys.getrefcount(buf) > 3:
            buf = np.empty((n, *self.image_shape), dtype=np.uint8)
            self._buf = buf
        return buf[:n]

    def _read_h5py(self, idx: np.ndarray) -> tuple[list[np.ndarray], list[int]]:
        """Read sorted unique runs as slices; returns ``(image per unique index, its row per request)``.

        A slice goes through h5py's compiled fast reader. Not ``dset[sorted_indices]``: h5py's fancy
        selection over a chunked 4-D dataset costs milliseconds *per index* (measured), and hand-built
        low-level hyperslab reads measured slower than the fast reader.
        """
        uniq, inverse = np.unique(idx, return_inverse=True)
        breaks = np.flatnonzero(np.diff(uniq) != 1) + 1
        starts = [0, *breaks.tolist()]
        ends = [*breaks.tolist(), int(uniq.size)]
        rows: list[np.ndarray] = []
        for a, b in zip(starts, ends, strict=True):
            first = int(uniq[a])
            if b - a == 1:
                rows.append(self._images[first])
            else:
                rows.extend(self._images[first : first + (b - a)])  # one read, split into views
        return rows, inverse.reshape(-1).tolist()

    # -- metadata -------------------------------------------------------------------------------------

    @property
    def targets(self) -> list[int]:
        """Labels as a list (torchvision ``ImageFolder`` naming)."""
        return self.labels.tolist()

    def files(self) -> list[str]:
        """Source file of every image (relative to the converted folder), if the file records them."""
        h5py = require("h5py")
        with h5py.File(self.path, "r") as f:
            if "files" not in f:
                return []
            return [s.decode() if isinstance(s, bytes) else str(s) for s in f["files"][()]]

    def attrs(self) -> dict[str, Any]:
        """The file's root attributes (format, image_size, resize, compression, ...)."""
        h5py = require("h5py")
        with h5py.File(self.path, "r") as f:
            return {k: (v.item() if isinstance(v, np.generic) else v) for k, v in f.attrs.items()}

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this dataset for caches (worker tuning): path, length, shape and mtime."""
        return {
            "class": type(self).__name__,
            "path": self.path,
            "len": self._len,
            "shape": list(self.image_shape),
            "mtime": os.path.getmtime(self.path),
            "raw_reads": self.raw_reads,
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(path={self.path!r}, images={self._len}, shape={self.image_shape}, "
            f"classes={len(self.classes)}, compression={self.compression}, raw_reads={self.raw_reads})"
        )
