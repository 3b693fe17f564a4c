"""Convert a class-per-subfolder image folder into an HDF5 store (``convert_folder_to_hdf5``; docs/hdf5.md,
"Converting")."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
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
from lightning_gpuopt.data._hdf5_writes import StoreFile, pwrite_all
from lightning_gpuopt.data._lifetime import Janitor, die_with_parent
from lightning_gpuopt.data._upsampling import smaller_sources, source_size, warn_upsampled
from lightning_gpuopt.data.folder import ON_CORRUPT, CorruptImageError
from lightning_gpuopt.data.hdf5 import FORMAT, FORMAT_VERSION
from lightning_gpuopt.data.jpeg_store import JPEGStoreWriter, encode_for_store

_BLOCK_IMAGES = 32  # images a decode task returns: big enough to amortise IPC, small enough to stream
_PER_IMAGE_OVERHEAD = 128  # bytes a stored image costs beyond its canvas: label, meta, chunk index, name
#: what an unreadable image's error advises in a conversion.
CONVERT_FIX = "remove or replace the file, or pass on_corrupt='skip' to leave unreadable images out"


class DecodeWorkerError(RuntimeError):
    """A decode worker process died; ``what`` says which and how, without the message's Python-API advice."""

    def __init__(self, pid: int | None, exitcode: int | None) -> None:
        self.what = (
            f"a decode worker (pid {pid}) died with exit code {exitcode} (killed, out of memory, or crashed "
            "in an image library)"
        )
        super().__init__(f"{self.what}; convert again with workers=1 to find the image")
        self.pid, self.exitcode = pid, exitcode


@dataclass
class ConversionResult:
    """What ``convert_folder_to_hdf5`` wrote (its fields: docs/hdf5.md, "Converting")."""

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


def _decode_block(job: tuple[list[str], int, bool, str]) -> _Block:
    """Decode a block of images onto canvases, or encode them for the JPEG store; failures as ``errors``."""
    from lightning_gpuopt.data.folder import load_canvas

    paths, storage_size, keep_going, fmt = job
    if _parent_pid is not None and os.getppid() != _parent_pid:
        os._exit(1)  # orphaned: nobody will read the result
    sizes = np.array([source_size(p) for p in paths], dtype=np.int32).reshape(-1, 2)
    metas = np.zeros((len(paths), 3), dtype=np.int32)
    shape = (len(paths), *layout.canvas_shape(storage_size), 3)
    images = np.empty(len(paths), dtype=object) if fmt == "jpeg" else np.empty(shape, dtype=np.uint8)
    errors: list[tuple[int, str, str]] = []
    for j, path in enumerate(paths):
        try:
            if fmt == "jpeg":
                data, metas[j], as_is = encode_for_store(path, storage_size)
                images[j] = (data, as_is)
            else:
                _, metas[j] = load_canvas(path, storage_size, out=images[j])
        except ValueError as err:  # an unreadable file is reported as ValueError
            cause = err.__cause__ or err
            errors.append((j, path, f"{type(cause).__name__}: {cause}"))
            if not keep_going:
                break
    return images, metas, errors, sizes


def _remove_stale_temps(dest: Path) -> None:
    """Remove ``DEST.tmp-<pid>`` left by conversions that were killed (their process no longer exists)."""
    for tmp in dest.parent.glob(dest.name + ".tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        with contextlib.suppress(OSError):  # PermissionError: alive, another user's
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                tmp.unlink()


def _worker_loop(tasks: Any, results: Any, parent_pid: int | None) -> None:
    """A decode worker: dies with its parent; Ctrl-C reaches only the converter, which stops the workers."""
    global _parent_pid
    expected = os.getppid() if parent_pid is None else parent_pid
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # terminate() must end a worker at once
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(expected)
    _parent_pid = expected
    while (task := tasks.get()) is not None:
        index, job = task
        results.put((index, _decode_block(job)))


class _Decoder:
    """Decoded blocks in order, ``2 * workers`` in flight; a dead worker raises ``DecodeWorkerError``."""

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
            yield from map(_decode_block, self.jobs)
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
                    arrived[got] = block
                except queue.Empty:
                    for proc in self.procs:
                        if proc.exitcode is not None:
                            raise DecodeWorkerError(proc.pid, proc.exitcode) from None
            yield arrived.pop(index)

    def close(self, abort: bool) -> None:
        if not self.procs:
            return
        if not abort:
            for _ in self.procs:
                self.tasks.put(None)
        for proc in self.procs:
            if abort:
                proc.terminate()
            proc.join(timeout=5 if abort else None)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for q in (self.tasks, self.results):
            q.close()
            q.cancel_join_thread()  # an aborted conversion does not wait for queued blocks to flush
        self.procs = []


class _Terminated(BaseException):
    """SIGTERM arrived during a conversion."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated(signum)


@contextlib.contextmanager
def _sigterm_cleans_up() -> Iterator[None]:
    """SIGTERM (default handler, main thread) cleans up, then still ends the process as killed by SIGTERM."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
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
    """Convert a class-per-subfolder image folder into an HDF5 store of whole images.

    Each image is resized like torchvision's ``Resize(storage_size)`` and kept whole on a canvas; the output
    appears only complete, and no kind of stop leaves anything behind (docs/hdf5.md, "Converting").

    Args:
        src: folder laid out as ``src/<class>/<image>``.
        out: the ``.h5`` file to write; its folder must exist (a symbolic link's target is replaced).
        storage_size: shorter side of the stored images in pixels (256 for 224 training crops).
        workers: decode processes (default: the CPUs this process may use; 0 or 1 decodes in this process).
        progress: show a progress bar on stderr.
        on_corrupt: ``"raise"`` (default) raises ``CorruptImageError`` (a ``ValueError``) naming the first
            unreadable image; ``"skip"`` leaves unreadable images out and lists them in the store and
            the result.
        overwrite: replace an existing ``out``.
        format: ``"raw"`` (default): uint8 canvases; ``"jpeg"``: the compact JPEG store, read by
            ``HDF5ImageDataset(out)`` as a ``JPEGStoreDataset``. docs/hdf5.md says which to choose.

    Returns:
        ``ConversionResult``.

    Raises:
        FileNotFoundError: ``src`` or the folder of ``out`` does not exist.
        ValueError: bad arguments, ``out`` exists without ``overwrite`` (``OutputExistsError``), another
            conversion is writing ``out`` (``OutputInUseError``), an empty or invalid ``src``, a file name
            that is not UTF-8, or an unreadable image with ``on_corrupt="raise"``.
        OSError: the destination is read-only or lacks the space (before decoding), or writing failed.
        DecodeWorkerError: a decode worker process died.
        KeyboardInterrupt: re-raised after the workers are stopped and the temporary file removed.

    Example:
        >>> convert_folder_to_hdf5("data/train", "train_256.h5", storage_size=256)  # doctest: +SKIP
    """
    require("h5py")  # a missing extra is named before any other check
    t_start = time.perf_counter()
    layout.canvas_shape(storage_size)  # validates storage_size
    check_choice(on_corrupt, "on_corrupt", ON_CORRUPT)
    check_choice(format, "format", ("raw", "jpeg"))
    check_int(workers, "workers", low=0, none_ok=True)
    src_path, (out_path, dest) = Path(src).expanduser(), _destination(out, overwrite)
    with _sigterm_cleans_up():
        claim = _Claim(dest, str(out_path))
        try:
            if dest.exists() and not overwrite:  # finished by a conversion that held the claim until now
                raise OutputExistsError(str(out_path))
            result = _convert_claimed(
                src_path, out_path, dest, storage_size, workers, progress, on_corrupt, overwrite, format
            )
        finally:
            claim.release()
    result.seconds = time.perf_counter() - t_start
    if result.smallest_source is not None:
        warn_upsampled(result.upsampled, result.num_images, result.smallest_source, storage_size)
    return result


def _convert_claimed(
    src_path: Path,
    out_path: Path,
    dest: Path,
    storage_size: int,
    workers: int | None,
    progress: bool,
    on_corrupt: str,
    overwrite: bool,
    fmt: str,
) -> ConversionResult:
    """The conversion once ``dest`` is claimed (its ``seconds`` left to the caller)."""
    from tqdm.auto import tqdm

    from lightning_gpuopt.data.folder import scan_image_folder

    h5py = require("h5py")
    classes, samples = scan_image_folder(src_path)  # names the path for a missing/empty/invalid folder
    paths = [p for p, _ in samples]
    rel = [os.path.relpath(p, src_path).replace(os.sep, "/") for p in paths]
    _check_names(classes, "class folder", src_path)
    _check_names(rel, "image file", src_path)
    n, keep_going = len(samples), on_corrupt == "skip"
    labels = np.fromiter((lbl for _, lbl in samples), dtype=np.int64, count=n)
    jobs = [(paths[i : i + _BLOCK_IMAGES], storage_size, keep_going, fmt) for i in range(0, n, _BLOCK_IMAGES)]
    workers = max(1, min(available_cpus() if workers is None else workers, len(jobs)))
    _remove_stale_temps(dest)
    sources = [os.stat(p).st_size for p in paths]
    # the JPEG store's bytes are spilled beside it, then copied in: twice the sources at most, transiently
    jpeg = fmt == "jpeg"
    _check_free_space(
        dest, 2 * sum(sources) + _store_bytes(n, 1, rel) if jpeg else _store_bytes(n, storage_size, rel)
    )
    tmp, spill = (dest.with_name(f"{dest.name}.tmp-{kind}{os.getpid()}") for kind in ("", "jpegs-"))
    store = (h5py, tmp, classes, rel, labels, storage_size, os.path.abspath(src_path))
    decoder, writer, janitors = None, None, []
    bar = tqdm(total=n, unit="img", desc=f"convert {src_path.name}", disable=not progress, file=sys.stderr)
    try:
        for path in (tmp, spill) if jpeg else (tmp,):
            janitors.append(Janitor(path))  # before the file exists: it is removed even after a SIGKILL
        _create_temp(tmp, dest)
        decoder = _Decoder(jobs, workers)  # before HDF5 opens the file: forked workers never inherit it
        writer = JPEGStoreWriter(*store, spill) if jpeg else _StoreWriter(*store)
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
        bar.close()
    source = sum(s for s, k in zip(sources, keep, strict=True) if k)
    small = smaller_sources(map(tuple, source_sizes), storage_size)
    stored = (writer.written, list(classes), skipped, 0.0, storage_size, fmt, int(writer.bytes_written))
    return ConversionResult(out_path, *stored, int(source), *small)


@dataclass(eq=False)
class _StoreWriter(StoreFile):
    """Writes a raw store into ``tmp``: HDF5 lays the file out, then each image is written at its chunk."""

    def __post_init__(self) -> None:
        super().__post_init__()
        ch, cw = layout.canvas_shape(self.storage_size)
        self.image_bytes, self.fd = ch * cw * 3, -1
        shape = (len(self.rel), ch, cw, 3)

        def lay_out(f: Any) -> None:
            images = f.create_dataset(
                "images", shape=shape, dtype=np.uint8, chunks=(1, ch, cw, 3), dcpl=self.allocated()
            )
            ends.extend(
                images.id.get_chunk_info_by_coord((i, 0, 0, 0)).byte_offset for i in (0, shape[0] - 1)
            )
            self.identify(f, FORMAT, FORMAT_VERSION)

        ends: list[int | None] = []
        self.hdf5("w", lay_out)
        self.offsets = (ends[0] or 0) + self.image_bytes * np.arange(shape[0], dtype=np.int64)
        if None in ends or ends[1] != self.offsets[-1]:  # the format's images lie back to back
            raise RuntimeError(
                f"HDF5 did not lay the images of {str(self.tmp)!r} back to back; please report this"
            )
        self.fd = os.open(self.tmp, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))

    @property
    def bytes_written(self) -> int:
        return self.written * self.image_bytes

    def add(self, canvases: np.ndarray, metas: np.ndarray) -> None:
        """Append decoded images (in order)."""
        for canvas, meta in zip(canvases, metas, strict=True):
            try:
                pwrite_all(self.fd, np.ascontiguousarray(canvas), int(self.offsets[self.written]))
            except OSError as err:
                raise self.failed(err) from err
            self.meta[self.written] = meta
            self.written += 1

    def finish(self, keep: np.ndarray, skipped: list[str]) -> None:
        """The tables and the completeness mark (skipped images' rows stay past the first ``written``)."""
        self.close()
        tables = {"chunk_offsets": self.offsets[: self.written]}
        self.complete(keep, skipped, tables, {})

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _write_blocks(
    writer: Any, blocks: Iterator[_Block], keep_going: bool, advance: Callable[[int], Any]
) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Write decoded blocks in order; ``(kept mask, skipped files, source (width, height) of each image)``."""
    keep = np.ones(len(writer.rel), dtype=bool)
    skipped: list[str] = []
    sizes: list[np.ndarray] = []
    for b, (canvases, metas, errors, wh) in enumerate(blocks):
        start = b * _BLOCK_IMAGES
        for j, path, reason in errors:
            if not keep_going:
                raise CorruptImageError.of(path, reason, CONVERT_FIX)
            keep[start + j] = False
            skipped.append(writer.rel[start + j])
        good = [j for j in range(len(canvases)) if keep[start + j]]
        writer.add(canvases[good], metas[good])
        sizes.append(wh[good])
        advance(len(canvases))
    return keep, skipped, np.concatenate(sizes) if sizes else np.zeros((0, 2), np.int32)
