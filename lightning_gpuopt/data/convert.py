"""Convert a class-per-subfolder image folder into the uint8 HDF5 store ``HDF5ImageDataset`` reads.

Every image is kept whole (``lightning_gpuopt.data.layout``) by ``folder.load_canvas``: decoded to 8-bit
RGB, resized like torchvision's ``Resize(storage_size)`` and placed on a fixed landscape canvas, with its
``meta`` ``(h, w, transposed)``. Decoding runs in worker processes. A conversion holds an exclusive claim
on ``OUT`` (a lock on ``.OUT.lock`` beside it) from its first check to its last step, writes ``OUT.tmp-<pid>``
beside ``OUT``, marks it complete (the ``complete`` attribute) once every image is written and flushed,
and only then publishes it under ``OUT`` (never replacing an existing file without ``overwrite``). The
store's layout is described in ``lightning_gpuopt.data.hdf5``.
"""

from __future__ import annotations

import contextlib
import errno
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lightning_gpuopt._checks import check_choice, check_int
from lightning_gpuopt._common import available_cpus
from lightning_gpuopt._imports import require
from lightning_gpuopt.data import layout
from lightning_gpuopt.data._destination import (
    OutputExistsError,
    OutputInUseError,  # noqa: F401 - raised by _Claim; the convert command catches it from here
    _check_free_space,
    _Claim,
    _create_temp,
    _destination,
    _publish,
)
from lightning_gpuopt.data._hdf5_writes import HDF5Writes
from lightning_gpuopt.data._lifetime import Janitor, die_with_parent
from lightning_gpuopt.data._upsampling import smaller_sources, source_size, warn_upsampled
from lightning_gpuopt.data.folder import CorruptImageError

FORMAT = "lightning-gpuopt/uint8-images"
#: 1: a central square per image (no longer read); 2: whole images on a canvas with ``meta`` (no longer
#: read: it has no completeness mark); 3: as 2, with ``complete`` set once every image is written.
FORMAT_VERSION = 3
#: root attribute set last, after every image and ``meta`` are written and flushed.
COMPLETE_ATTR = "complete"
#: version of ``lightning_gpuopt.data.layout``'s canvas rule the store was written with. 1: an image more
#: elongated than the canvas shrunk until it fits (no longer read); 2: its shorter side kept at
#: storage_size and its long side cut to the canvas (``layout.cut_window``).
LAYOUT_VERSION = 2
RESIZE_DOC = (
    "shorter side resized to storage_size (PIL bilinear, antialiased; torchvision Resize), a long side "
    "longer than the storage_size x ceil(1.5 storage_size) canvas cut to its centre, portrait images "
    "transposed; meta = (h, w, transposed)"
)
_BLOCK_IMAGES = 32  # images a decode task returns: big enough to amortise IPC, small enough to stream
_PER_IMAGE_OVERHEAD = 128  # bytes a stored image costs beyond its canvas: label, meta, chunk index, name
#: what an unreadable image's error advises in a conversion.
CONVERT_FIX = "remove or replace the file, or pass on_corrupt='skip' to leave unreadable images out"


class DecodeWorkerError(RuntimeError):
    """A decode worker process died (killed, out of memory, or crashed inside an image library): ``what``
    says which and how, without the Python-API advice of the message."""

    def __init__(self, pid: int | None, exitcode: int | None) -> None:
        self.what = (
            f"a decode worker (pid {pid}) died with exit code {exitcode} (killed, out of memory, or crashed "
            "in an image library)"
        )
        super().__init__(f"{self.what}; convert again with workers=1 to find the image")
        self.pid, self.exitcode = pid, exitcode


@dataclass
class ConversionResult:
    """What ``convert_folder_to_hdf5`` wrote.

    Attributes:
        path: the HDF5 file (the path given, also when it is a symbolic link).
        num_images: images stored.
        classes: class names (index = label).
        skipped: source files left out as unreadable (``on_corrupt="skip"``), relative to the source.
        seconds: wall time of the conversion.
        storage_size: shorter side of the stored images in pixels.
        format: ``"raw"`` (uint8 canvases) or ``"jpeg"`` (the compact JPEG store).
        bytes_written: image bytes in the store (canvases, or JPEG bytes), without the HDF5 metadata.
        source_bytes: bytes of the source files of the stored images.
        upsampled: stored images whose source's shorter side is below ``storage_size`` (upsampled to it).
        smallest_source: ``(width, height)`` of the upsampled source with the shortest side, else ``None``.
    """

    path: Path
    num_images: int
    classes: list[str]
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0
    storage_size: int = 0
    format: str = "raw"
    bytes_written: int = 0
    source_bytes: int = 0
    upsampled: int = 0
    smallest_source: tuple[int, int] | None = None


# (canvases or JPEG items, metas, failures (index, path, reason), source (width, height) of each image)
_Block = tuple[np.ndarray, np.ndarray, list[tuple[int, str, str]], np.ndarray]
_parent_pid: int | None = None


def _init_worker(parent_pid: int | None) -> None:
    """Decode workers die with their parent: SIGKILL when it dies (Linux), default SIGTERM, no SIGINT.

    ``parent_pid`` is the converter's pid when the worker was forked from it (else ``None``: the parent
    is a fork server or the spawning process, read here).
    """
    global _parent_pid
    expected = os.getppid() if parent_pid is None else parent_pid
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # terminate() must end a worker at once
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the converter, which stops the workers
    die_with_parent(expected)
    _parent_pid = expected


def _decode_block(job: tuple[list[str], int, bool, str]) -> _Block:
    """Decode a block of images onto canvases (in a worker); failures come back as (index, path, reason).

    For the JPEG store (``job[3] == "jpeg"``) the "canvases" are an object array of ``(bytes, kept)``.
    """
    from lightning_gpuopt.data.folder import load_canvas

    paths, storage_size, keep_going, fmt = job
    if _parent_pid is not None and os.getppid() != _parent_pid:
        os._exit(1)  # orphaned: nobody will read the result
    sizes = np.array([source_size(p) for p in paths], dtype=np.int32).reshape(-1, 2)
    if fmt == "jpeg":
        from lightning_gpuopt.data.jpeg_store import encode_block

        return (*encode_block(paths, storage_size, keep_going), sizes)
    canvases = np.empty((len(paths), *layout.canvas_shape(storage_size), 3), dtype=np.uint8)
    metas = np.zeros((len(paths), 3), dtype=np.int32)
    errors: list[tuple[int, str, str]] = []
    for j, path in enumerate(paths):
        try:
            _, metas[j] = load_canvas(path, storage_size, out=canvases[j])
        except ValueError as err:  # load_canvas reports every unreadable file as ValueError
            cause = err.__cause__ or err
            errors.append((j, path, f"{type(cause).__name__}: {cause}"))
            if not keep_going:
                break
    return canvases, metas, errors, sizes


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temps(dest: Path) -> None:
    """Remove ``DEST.tmp-<pid>`` left by conversions that were killed (their process no longer exists)."""
    for tmp in dest.parent.glob(dest.name + ".tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            with contextlib.suppress(OSError):
                tmp.unlink()


def _worker_loop(tasks: Any, results: Any, parent_pid: int | None) -> None:
    """A decode worker: take ``(index, job)`` from ``tasks`` until ``None``, put ``(index, block)``."""
    _init_worker(parent_pid)
    while True:
        task = tasks.get()
        if task is None:
            return
        index, job = task
        results.put((index, _decode_block(job)))


class _Decoder:
    """Decoded blocks in order from worker processes, at most ``2 * workers`` in flight (bounded memory).

    A worker that dies (killed, or crashed inside an image library) is noticed within half a second and
    raises instead of leaving the conversion waiting; ``close(abort=True)`` terminates the workers at once
    (an error, Ctrl-C or SIGTERM in the converter).
    """

    def __init__(self, jobs: list[tuple[list[str], int, bool, str]], workers: int) -> None:
        self.jobs = jobs
        self.window = 2 * workers
        self.procs: list[Any] = []
        if workers > 1:
            ctx = multiprocessing.get_context()
            parent = os.getpid() if ctx.get_start_method() == "fork" else None
            self.tasks, self.results = ctx.Queue(), ctx.Queue()
            for _ in range(workers):
                proc = ctx.Process(target=_worker_loop, args=(self.tasks, self.results, parent), daemon=True)
                proc.start()
                self.procs.append(proc)

    def blocks(self) -> Iterator[_Block]:
        if not self.procs:
            for job in self.jobs:
                yield _decode_block(job)
            return
        submitted = 0
        arrived: dict[int, _Block] = {}
        for index in range(len(self.jobs)):
            while submitted < min(len(self.jobs), index + self.window):
                self.tasks.put((submitted, self.jobs[submitted]))
                submitted += 1
            while index not in arrived:
                try:
                    got, block = self.results.get(timeout=0.5)
                except queue.Empty:
                    got = None
                if got is None:
                    self._check_workers()
                    continue
                arrived[got] = block
            yield arrived.pop(index)

    def _check_workers(self) -> None:
        for proc in self.procs:
            if proc.exitcode is not None:
                raise DecodeWorkerError(proc.pid, proc.exitcode)

    def close(self, abort: bool) -> None:
        if not self.procs:
            return
        if not abort:
            for _ in self.procs:
                self.tasks.put(None)
        for proc in self.procs:
            if abort:
                proc.terminate()
            proc.join(timeout=None if not abort else 5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for q in (self.tasks, self.results):
            q.close()
            q.cancel_join_thread()  # an aborted conversion does not wait for queued blocks to flush
        self.procs = []


class _Terminated(BaseException):
    """SIGTERM arrived during a conversion (raised in the main thread so the temporary file is removed)."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated(signum)


@contextlib.contextmanager
def _sigterm_cleans_up() -> Iterator[None]:
    """Turn SIGTERM into ``_Terminated`` while converting, when SIGTERM would otherwise kill us uncleanly.

    Only from the main thread and only where SIGTERM has its default action (an application's own handler
    is left alone). After the cleanup the signal is delivered again with its default action, so the
    process still ends as killed by SIGTERM.
    """
    install = (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    )
    if not install:
        yield
        return
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _check_names(names: Sequence[str], what: str, root: Path) -> None:
    """Refuse names the store cannot keep as UTF-8 text (file names that are not UTF-8 bytes)."""
    for name in names:
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raw = os.fsencode(name)
            raise ValueError(
                f"{what} {raw!r} under {str(root)!r} is not valid UTF-8 and cannot be stored; rename it "
                "(e.g. `convmv -f latin1 -t utf8 --notest -r SRC`) and convert again"
            ) from None


def _store_bytes(num_images: int, storage_size: int, names: Sequence[str] = ()) -> int:
    """Bytes a store of ``num_images`` images at ``storage_size`` takes on disk (an upper estimate)."""
    ch, cw = layout.canvas_shape(storage_size)
    names_bytes = sum(len(n.encode("utf-8", "surrogateescape")) + 16 for n in names)
    return num_images * (ch * cw * 3 + _PER_IMAGE_OVERHEAD) + names_bytes + (1 << 20)


def convert_folder_to_hdf5(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    storage_size: int = 256,
    *,
    workers: int | None = None,
    progress: bool = True,
    on_corrupt: str = "raise",
    overwrite: bool = False,
    format: str = "raw",
) -> ConversionResult:
    """Convert a class-per-subfolder image folder into a uint8 HDF5 store of whole images.

    Each image is decoded, resized like torchvision's ``Resize(storage_size)`` and kept whole on a
    ``storage_size x ceil(1.5 * storage_size)`` canvas (``folder.load_canvas``, ``data.layout``);
    at 256 that is 294,912 bytes an image. Images are decoded in worker processes and written in order
    as they arrive (at most ``2 * workers`` blocks of 32 in memory).

    Before any decoding the folder is scanned, every file name is checked to be storable (UTF-8), the
    destination is checked to be writable and to have room for the whole store. From the first check to the
    last step the conversion holds an exclusive claim on ``OUT`` (a lock on ``.OUT.lock`` beside it): a
    second conversion to the same file fails at once with ``OutputInUseError``. The file is written as
    ``OUT.tmp-<pid>`` beside ``OUT`` (beside a symbolic link's target, which is replaced and the link
    kept), marked complete once every image is flushed, and only then given its final name: with a hard
    link that fails if ``OUT`` appeared meanwhile (so an existing file is replaced only with
    ``overwrite``). On an error, Ctrl-C or SIGTERM the decode workers are
    stopped and the temporary file removed. After a SIGKILL the decode workers die with the converter
    (Linux) and a janitor process removes the temporary file; one left when both were killed is removed by
    the next conversion to the same ``OUT``.

    Args:
        src: folder laid out as ``src/<class>/<image>``.
        out: the ``.h5`` file to write; its folder must exist.
        storage_size: shorter side of the stored images in pixels (256 for 224 training crops).
        workers: decode processes (default: the CPUs this process may use; 0 or 1 decodes in this process).
        progress: show a progress bar on stderr.
        on_corrupt: ``"raise"`` (default) raises ``CorruptImageError`` (a ``ValueError``) naming the first
            unreadable image; ``"skip"`` leaves unreadable images out and lists them in the store and
            the result.
        overwrite: replace an existing ``out``.
        format: ``"raw"`` (default): uint8 canvases, ``HDF5ImageDataset``; ``"jpeg"``: each image's JPEG
            bytes in one contiguous blob (``lightning_gpuopt.data.jpeg_store``: a source JPEG no larger than
            needed kept as it is, others resized as the raw store does and encoded at quality 90), read by
            ``HDF5ImageDataset(out)`` as a ``JPEGStoreDataset``. docs/hdf5.md says which to choose.

    Returns:
        ``ConversionResult`` (path, number of images, classes, skipped files, seconds, storage size).

    Raises:
        FileNotFoundError: ``src`` or the folder of ``out`` does not exist.
        ValueError: bad arguments, ``out`` exists without ``overwrite`` (``OutputExistsError``), another
            conversion is writing ``out`` (``OutputInUseError``), an empty or invalid ``src``, a file name
            that is not UTF-8, or an unreadable image with ``on_corrupt="raise"``.
        OSError: the destination is read-only or lacks the space (before decoding), or writing failed.
        KeyboardInterrupt: re-raised after the workers are stopped and the temporary file removed.

    Example:
        >>> convert_folder_to_hdf5("data/train", "train_256.h5", storage_size=256)  # doctest: +SKIP
    """
    from lightning_gpuopt.data.folder import ON_CORRUPT

    h5py = require("h5py")
    t_start = time.perf_counter()
    layout.canvas_shape(storage_size)  # validates storage_size
    check_choice(on_corrupt, "on_corrupt", ON_CORRUPT)
    check_choice(format, "format", ("raw", "jpeg"))
    check_int(workers, "workers", low=0, none_ok=True)
    src_path = Path(src).expanduser()
    out_path, dest = _destination(out, overwrite)
    with _sigterm_cleans_up():
        claim = _Claim(dest, str(out_path))
        try:
            if dest.exists() and not overwrite:  # finished by a conversion that held the claim until now
                raise OutputExistsError(str(out_path))
            written, classes, skipped, sizes, small = _convert_claimed(
                h5py, src_path, out_path, dest, storage_size, workers, progress, on_corrupt, overwrite, format
            )
        finally:
            claim.release()
    elapsed = time.perf_counter() - t_start
    if small[1] is not None:
        warn_upsampled(small[0], written, small[1], storage_size)
    return ConversionResult(
        out_path, written, classes, skipped, elapsed, storage_size, format, *sizes, *small
    )


def _convert_claimed(
    h5py: Any,
    src_path: Path,
    out_path: Path,
    dest: Path,
    storage_size: int,
    workers: int | None,
    progress: bool,
    on_corrupt: str,
    overwrite: bool,
    fmt: str = "raw",
) -> tuple[int, list[str], list[str], tuple[int, int], tuple[int, tuple[int, int] | None]]:
    """The conversion once ``dest`` is claimed: ``(images written, classes, skipped files, (bytes written,
    source bytes), (images upsampled, smallest such source))``."""
    from lightning_gpuopt.data.folder import scan_image_folder

    classes, samples = scan_image_folder(src_path)  # names the path for a missing/empty/invalid folder
    paths = [p for p, _ in samples]
    rel = [os.path.relpath(p, src_path).replace(os.sep, "/") for p in paths]
    _check_names(classes, "class folder", src_path)
    _check_names(rel, "image file", src_path)
    n = len(samples)
    labels = np.fromiter((lbl for _, lbl in samples), dtype=np.int64, count=n)
    keep_going = on_corrupt == "skip"
    jobs = [(paths[i : i + _BLOCK_IMAGES], storage_size, keep_going, fmt) for i in range(0, n, _BLOCK_IMAGES)]
    workers = available_cpus() if workers is None else workers
    workers = max(1, min(workers, len(jobs)))

    _remove_stale_temps(dest)
    sources = [os.stat(p).st_size for p in paths]
    # the JPEG store's bytes are spilled beside it, then copied in: twice the sources at most, transiently
    needed = (
        2 * sum(sources) + _store_bytes(n, 1, rel) if fmt == "jpeg" else _store_bytes(n, storage_size, rel)
    )
    _check_free_space(dest, needed)
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    spill = dest.with_name(f"{dest.name}.tmp-jpegs-{os.getpid()}")
    source_dir = os.path.abspath(src_path)
    decoder: _Decoder | None = None
    writer: Any = None
    janitors: list[Janitor] = []
    bar = None
    try:
        for path in (tmp, spill) if fmt == "jpeg" else (tmp,):
            janitors.append(Janitor(path))  # before the file exists: it is removed even after a SIGKILL
        _create_temp(tmp, dest)
        # the workers start before the HDF5 file is opened, so forked ones never inherit its handle
        decoder = _Decoder(jobs, workers)
        if fmt == "jpeg":
            from lightning_gpuopt.data.jpeg_store import JPEGStoreWriter

            writer = JPEGStoreWriter(h5py, tmp, spill, classes, rel, labels, storage_size, source_dir)
        else:
            writer = _StoreWriter(h5py, tmp, classes, rel, labels, storage_size, source_dir)
        from tqdm.auto import tqdm

        bar = tqdm(
            total=n, unit="img", desc=f"convert {src_path.name}", disable=not progress, file=sys.stderr
        )
        keep, skipped, source_sizes = _write_blocks(writer, decoder.blocks(), keep_going, bar.update)
        if writer.written == 0:
            raise ValueError(f"no readable images in {str(src_path)!r} ({len(skipped)} skipped)")
        decoder.close(abort=False)
        writer.finish(keep, skipped)
        _publish(tmp, dest, str(out_path), overwrite)
        for janitor in janitors:
            janitor.release(done=janitor is janitors[0])
    except BaseException:
        if decoder is not None:
            decoder.close(abort=True)
        if writer is not None:
            writer.close()
        with contextlib.suppress(OSError):
            tmp.unlink()
        for janitor in janitors:
            janitor.release(done=False)
        raise
    finally:
        if bar is not None:
            bar.close()
    stored = writer.bytes_written if fmt == "jpeg" else writer.written * writer.image_bytes
    source = sum(s for s, k in zip(sources, keep, strict=True) if k)
    small = smaller_sources(map(tuple, source_sizes), storage_size)
    return writer.written, list(classes), skipped, (int(stored), int(source)), small


class _StoreWriter:
    """Writes a store into ``tmp``.

    HDF5 lays the file out first, with every image chunk and ``meta`` allocated (not filled); pixels and
    ``meta`` are then written with plain ``pwrite`` at their byte offsets, so HDF5 itself writes nothing
    once decoding has started. HDF5 writes through ``HDF5Writes``, and pixels with ``pwrite``: a write that
    fails (full disk, I/O error) is an ``OSError`` naming the file, never a half-flushed HDF5 file the library
    cannot close. A last, small HDF5 pass, once every image is flushed, sets the ``complete`` attribute
    (and shortens the datasets when images were skipped): a copy of ``tmp`` taken before it has no mark.
    """

    def __init__(
        self,
        h5py: Any,
        tmp: Path,
        classes: list[str],
        rel: list[str],
        labels: np.ndarray,
        storage_size: int,
        source: str,
    ) -> None:
        self.h5py, self.tmp, self.rel, self.labels = h5py, tmp, rel, labels
        n = len(rel)
        ch, cw = layout.canvas_shape(storage_size)
        self.image_bytes = ch * cw * 3
        self.meta = np.zeros((n, 3), dtype=np.int32)
        self.written = 0
        self.fd: int | None = None
        str_dt = h5py.string_dtype("utf-8")

        def lay_out(f: Any) -> None:
            images = f.create_dataset(
                "images",
                shape=(n, ch, cw, 3),
                dtype=np.uint8,
                chunks=(1, ch, cw, 3),
                dcpl=self._allocated(),
            )
            meta = f.create_dataset("meta", shape=(n, 3), dtype=np.int32, dcpl=self._allocated())
            self.offsets = chunk_offsets(images)
            self.meta_offset = int(meta.id.get_offset())
            f.create_dataset("labels", data=labels)
            f.create_dataset("classes", data=np.array(classes, dtype=object), dtype=str_dt)
            f.create_dataset("files", data=np.array(rel, dtype=object), dtype=str_dt)
            f.create_dataset("skipped_files", shape=(0,), dtype=str_dt)
            f.create_dataset("chunk_offsets", data=self.offsets)
            f.attrs.update(
                {
                    "format": FORMAT,
                    "format_version": FORMAT_VERSION,
                    "layout_version": LAYOUT_VERSION,
                    "storage_size": storage_size,
                    "max_aspect": layout.MAX_ASPECT,
                    "resize": RESIZE_DOC,
                    "uuid": uuid.uuid4().hex,
                    "num_skipped": 0,
                    "source": source,
                }
            )

        self._hdf5("w", lay_out)
        if int(self.offsets.min()) < 0:
            raise RuntimeError(f"HDF5 did not allocate every image chunk of {str(tmp)!r}; please report this")
        self.fd = os.open(tmp, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))

    def _hdf5(self, mode: str, work: Callable[[Any], None]) -> None:
        """Open ``tmp`` with HDF5 in ``mode``, run ``work(file)``, close; a failed write raises ``OSError``."""
        fh = HDF5Writes(self.tmp)
        try:
            # HDF5 1.10's fixed-array chunk index keeps a fixed-size dataset's chunks back to back: the
            # images are one run of equal strides, which a reader gathers a batch from in one copy
            with self.h5py.File(fh, mode, libver=("v110", "latest")) as f:
                work(f)
        except RuntimeError as err:  # HDF5's own failure, e.g. a metadata write refused
            failed = fh.error or OSError(errno.EIO, f"{type(err).__name__}: {err}")
            raise self._failed(failed) from err
        finally:
            fh.close()
        if fh.error is not None:
            raise self._failed(fh.error)

    def _failed(self, err: OSError) -> OSError:
        return OSError(
            err.errno,
            f"writing {str(self.tmp)!r} failed ({err.strerror or err}); the output was not written "
            "(check free space and quotas)",
        )

    def _allocated(self) -> Any:
        """Dataset creation properties: space allocated when created, never filled (written by us)."""
        dcpl = self.h5py.h5p.create(self.h5py.h5p.DATASET_CREATE)
        dcpl.set_alloc_time(self.h5py.h5d.ALLOC_TIME_EARLY)
        dcpl.set_fill_time(self.h5py.h5d.FILL_TIME_NEVER)
        return dcpl

    def _pwrite(self, data: Any, offset: int) -> None:
        view = memoryview(data).cast("B")
        try:
            while view:
                done = os.pwrite(self.fd, view, offset)  # type: ignore[arg-type]
                view, offset = view[done:], offset + done
        except OSError as err:
            raise self._failed(err) from err

    def add(self, canvases: np.ndarray, metas: np.ndarray) -> None:
        """Append decoded images (in order)."""
        for canvas, meta in zip(canvases, metas, strict=True):
            self._pwrite(np.ascontiguousarray(canvas), int(self.offsets[self.written]))
            self.meta[self.written] = meta
            self.written += 1

    def finish(self, keep: np.ndarray, skipped: list[str]) -> None:
        """Write ``meta`` and flush every image, then set the completeness mark (the per-image tables
        shortened to the kept images when some were skipped) and make the file durable."""
        w = self.written
        if not skipped:
            self._pwrite(self.meta, self.meta_offset)
        self.close()
        self._fsync()  # the images are on disk before the mark that says they are
        str_dt = self.h5py.string_dtype("utf-8")
        kept_names = np.array([r for r, k in zip(self.rel, keep, strict=True) if k], dtype=object)

        def complete(f: Any) -> None:
            if skipped:
                # the images dataset keeps its rows (the kept images are its first w; the rest is never
                # read): a fixed-size dataset keeps its chunks back to back
                for name, data, dtype in (
                    ("meta", self.meta[:w], None),
                    ("labels", self.labels[keep], None),
                    ("files", kept_names, str_dt),
                    ("skipped_files", np.array(skipped, dtype=object), str_dt),
                    ("chunk_offsets", self.offsets[:w], None),
                ):
                    del f[name]
                    f.create_dataset(name, data=data, dtype=dtype)
                f.attrs["num_skipped"] = len(skipped)
            f.attrs[COMPLETE_ATTR] = True

        self._hdf5("r+", complete)
        self._fsync()  # durable before it becomes visible under its final name

    def _fsync(self) -> None:
        try:
            with open(self.tmp, "rb") as fh:
                os.fsync(fh.fileno())
        except OSError as err:
            raise self._failed(err) from err

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _write_blocks(
    writer: Any, blocks: Iterator[_Block], keep_going: bool, advance: Callable[[int], Any]
) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Write decoded blocks in order; returns ``(kept mask, skipped files, source (width, height) of each
    stored image)``."""
    keep = np.ones(len(writer.rel), dtype=bool)
    skipped: list[str] = []
    sizes: list[np.ndarray] = []
    for b, (canvases, metas, errors, wh) in enumerate(blocks):
        start = b * _BLOCK_IMAGES
        bad = set()
        for j, path, reason in errors:
            if not keep_going:
                raise CorruptImageError.of(path, reason, CONVERT_FIX)
            bad.add(j)
            keep[start + j] = False
            skipped.append(writer.rel[start + j])
        good = [j for j in range(len(canvases)) if j not in bad]
        writer.add(canvases[good], metas[good])
        sizes.append(wh[good])
        advance(len(canvases))
    return keep, skipped, np.concatenate(sizes) if sizes else np.zeros((0, 2), np.int32)


def chunk_offsets(dset: Any) -> np.ndarray:
    """Byte offset in the file of every chunk of ``dset`` (one image a chunk: index = image)."""
    offsets = np.full(dset.shape[0], -1, dtype=np.int64)
    dsid = dset.id
    if hasattr(dsid, "chunk_iter"):  # HDF5 >= 1.14 (h5py >= 3.8): one pass over the chunk index

        def visit(info: Any) -> None:
            offsets[info.chunk_offset[0]] = info.byte_offset

        dsid.chunk_iter(visit)
    else:
        for i in range(dsid.get_num_chunks()):
            info = dsid.get_chunk_info(i)
            offsets[info.chunk_offset[0]] = info.byte_offset
    return offsets
