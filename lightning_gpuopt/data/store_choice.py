"""Raw or JPEG store: the rule ``lightning-gpuopt convert`` states, from the store's size against memory, the
disk's read bandwidth, the cores a GPU has and this host's rates on the user's own images (docs/hdf5.md,
"Raw or JPEG store").

A raw store (uint8 canvases) costs no decoding: while the page cache holds it, a batch is a memory copy
(``measure_rates``: one thread copying canvases, measured on this host); once it does not fit, every epoch
reads it from the disk, at the disk's bandwidth over its bytes an image. A JPEG store holds no more bytes than
the source JPEGs (about a quarter to a third of the raw store's at 256 px) and is decoded by a thread a CPU,
at the rate one core decodes the user's images as the store keeps them (``measure_rates``: a sample of the
source encoded as the store encodes it, then decoded onto its canvas); from the disk its bytes come several
times faster than the raw store's. ``choose_store_format`` takes the store with the higher expected read
rate:

* the raw store fits in ``MEMORY_SHARE`` of the machine's memory: raw at the copy rate against JPEG at the
  decode rate (raw, unless the host decodes faster than it copies);
* else: raw at ``disk GB/s / raw bytes an image`` against JPEG at the smaller of ``cores a GPU x decode
  rate a core`` and its own read rate (the page cache's where it fits, else the disk's).

``disk_read_gbps`` measures a file's read bandwidth with ``O_DIRECT`` (past the page cache). Where a figure
could not be measured the rule takes ``ASSUMED_DISK_GBPS``, ``RAW_CACHED_RATE`` or
``JPEG_DECODE_RATE_PER_CORE``, one H200 host's and a 2-core host's figures, and says "assumed".
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_gpuopt._common import available_cpus

#: share of the machine's memory a store may take and still be read from the page cache every epoch (the
#: rest is the training processes': the model, pinned batches, the loader)
MEMORY_SHARE = 0.5
#: images a second a raw store delivers from the page cache, assumed where not measured: 4 reading threads on
#: one H200 host (docs/hdf5.md)
RAW_CACHED_RATE = 49_000
#: images a second one core decodes out of a JPEG store converted at 256 px (decode and placement on the
#: canvas), assumed where not measured: the low end of one core of a 2-core x86 host (docs/hdf5.md)
JPEG_DECODE_RATE_PER_CORE = 1_000
#: source images ``measure_rates`` encodes and decodes, and the least seconds it decodes them for
SAMPLE_IMAGES, SAMPLE_SECONDS = 32, 0.25
#: the read bandwidth assumed where the disk's cannot be measured: one H200 host's disk with ``O_DIRECT``
ASSUMED_DISK_GBPS = 0.86
#: bytes read to measure a disk's bandwidth (less where the file is smaller), and the least worth measuring
PROBE_BYTES, MIN_PROBE_BYTES = 256 << 20, 32 << 20
_BLOCK = 8 << 20


def gpus() -> int:
    """CUDA GPUs this process sees (0 without CUDA)."""
    try:
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:
        return 0


def cores_per_gpu() -> int:
    """The CPUs this process may use, shared by the GPUs it sees (all of them without a GPU)."""
    return max(1, available_cpus() // max(1, gpus()))


def memory_bytes() -> int:
    """The machine's memory (``psutil.virtual_memory().total``)."""
    import psutil

    return int(psutil.virtual_memory().total)


def disk_read_gbps(path: str | os.PathLike[str], limit: int = PROBE_BYTES) -> float | None:
    """GB/s of reading the first ``limit`` bytes of ``path`` with ``O_DIRECT`` (the disk, not the page cache),
    in 8 MiB reads into a page-aligned buffer; ``None`` where the file is smaller than ``MIN_PROBE_BYTES``
    or the file system takes no ``O_DIRECT`` reads (tmpfs, some network file systems)."""
    flag = getattr(os, "O_DIRECT", 0)
    size = min(os.path.getsize(path), limit)
    if not flag or size < MIN_PROBE_BYTES:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError:
        return None
    buf = mmap.mmap(-1, _BLOCK)
    try:
        done, t0 = 0, time.perf_counter()
        while done < size:
            n = os.preadv(fd, [buf], done)
            if n <= 0:
                break
            done += n
        seconds = time.perf_counter() - t0
    except OSError:
        return None
    finally:
        buf.close()
        os.close(fd)
    return done / seconds / 1e9 if seconds > 0 and done else None


def probe_disk_gbps(folder: str | os.PathLike[str], name: str) -> float | None:
    """The read bandwidth of the disk under ``folder``: ``PROBE_BYTES`` written to ``folder/name``, flushed,
    read back with ``disk_read_gbps`` and removed (also on failure). ``None`` where it cannot be measured
    (no room, no ``O_DIRECT``)."""
    path = Path(folder) / name
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        try:
            chunk = os.urandom(_BLOCK)  # incompressible: no file system shortcuts
            for offset in range(0, PROBE_BYTES, _BLOCK):
                os.pwrite(fd, chunk, offset)
            os.fsync(fd)
        finally:
            os.close(fd)
        return disk_read_gbps(path)
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


@dataclass(frozen=True)
class HostRates:
    """What ``measure_rates`` measured on this host: ``decode`` images a second one core decodes out of a JPEG
    store (the user's images as the store keeps them), ``copy`` images a second one thread copies out of a
    raw store in memory, over ``images`` sampled images."""

    decode: float
    copy: float
    images: int


def measure_rates(paths: Sequence[str], storage_size: int) -> HostRates | None:
    """This host's rates on up to ``SAMPLE_IMAGES`` of ``paths`` (evenly spread): each encoded as the JPEG
    store keeps it (``jpeg_store.encode_for_store``, not timed), then decoded onto its canvas one after the
    other on this thread for at least ``SAMPLE_SECONDS``; and the same canvases copied as a raw store's batch
    is read from the page cache. ``None``: no image of the sample could be read.

    Example:
        >>> measure_rates(["a.jpg", "b.jpg"], 256)  # doctest: +SKIP
        HostRates(decode=1312.5, copy=31250.0, images=2)
    """
    import numpy as np

    from lightning_gpuopt.data import layout
    from lightning_gpuopt.data.folder import decode_canvas
    from lightning_gpuopt.data.jpeg_store import encode_for_store

    paths = [p for p in paths if os.path.isfile(p)]  # regular files: a FIFO would block the sample
    step = max(1, len(paths) // SAMPLE_IMAGES)
    shape = (*layout.canvas_shape(storage_size), 3)
    encoded = []
    for path in list(paths)[::step][:SAMPLE_IMAGES]:
        # an unreadable image (or one whose store bytes do not decode) is left out: the conversion names it
        with contextlib.suppress(ValueError, OSError):
            data = encode_for_store(path, storage_size)[0]
            decode_canvas(data, storage_size, np.zeros(shape, np.uint8), name=path)
            encoded.append(data)
    if not encoded:
        return None
    shape = (len(encoded), *shape)
    canvases, copies = np.zeros(shape, np.uint8), np.empty(shape, np.uint8)
    decoded, t0 = 0, time.perf_counter()
    while decoded < len(encoded) or time.perf_counter() - t0 < SAMPLE_SECONDS:
        k = decoded % len(encoded)
        decode_canvas(encoded[k], storage_size, canvases[k], name=f"sample {k}")
        decoded += 1
    decode = decoded / (time.perf_counter() - t0)
    copied, t0 = 0, time.perf_counter()
    while copied < 4 or time.perf_counter() - t0 < SAMPLE_SECONDS / 5:
        np.copyto(copies, canvases)
        copied += 1
    return HostRates(decode, copied * len(encoded) / (time.perf_counter() - t0), len(encoded))


@dataclass
class StoreChoice:
    """What ``choose_store_format`` decided and from what.

    Attributes:
        format: ``"raw"`` or ``"jpeg"``.
        reason: the rule's comparison in one line.
        raw_rate: images a second the raw store is expected to be read at.
        jpeg_rate: likewise for the JPEG store.
        raw_bytes: the raw store's image bytes.
        jpeg_bytes: the JPEG store's image bytes (or their bound, the source JPEGs').
        memory: the machine's memory in bytes.
        disk_gbps: the disk's read bandwidth used.
        disk_measured: whether ``disk_gbps`` was measured (else ``ASSUMED_DISK_GBPS``).
        cores_per_gpu: the cores decoding for a GPU.
        rates: this host's decode and copy rates where measured (``measure_rates``), else ``None`` (the
            assumed ``JPEG_DECODE_RATE_PER_CORE`` and ``RAW_CACHED_RATE``).
    """

    format: str
    reason: str
    raw_rate: float
    jpeg_rate: float
    raw_bytes: int
    jpeg_bytes: int
    memory: int
    disk_gbps: float
    disk_measured: bool
    cores_per_gpu: int
    rates: HostRates | None = None


def fits(store_bytes: int, memory: int) -> bool:
    """Whether a store of ``store_bytes`` stays in the page cache (``MEMORY_SHARE`` of ``memory``)."""
    return store_bytes <= MEMORY_SHARE * memory


def _readers(cores: int) -> int:
    """The threads that read a raw store: ``HDF5Options``' default for a process of ``cores`` cores."""
    from lightning_gpuopt.data.hdf5 import READ_THREADS

    return min(READ_THREADS, max(1, cores))


def read_rates(
    num_images: int,
    raw_bytes: int,
    jpeg_bytes: int,
    memory: int,
    disk_gbps: float,
    cores: int,
    rates: HostRates | None = None,
) -> tuple[float, float]:
    """Expected ``(raw store, JPEG store)`` images a second under the rule (module docstring), from this
    host's ``rates`` where measured, else the assumed ones."""
    disk = disk_gbps * 1e9
    cached = rates.copy * _readers(cores) if rates is not None else RAW_CACHED_RATE
    raw = cached if fits(raw_bytes, memory) else disk / (raw_bytes / num_images)
    decode = cores * (rates.decode if rates is not None else JPEG_DECODE_RATE_PER_CORE)
    jpeg = decode if fits(jpeg_bytes, memory) else min(decode, disk / max(1.0, jpeg_bytes / num_images))
    return float(raw), float(jpeg)


def choose_store_format(
    num_images: int,
    raw_bytes: int,
    jpeg_bytes: int,
    *,
    memory: int | None = None,
    disk_gbps: float | None = None,
    cores: int | None = None,
    rates: HostRates | None = None,
) -> StoreChoice:
    """The store the rule picks for ``num_images`` images (``raw_bytes`` as canvases, ``jpeg_bytes`` as JPEG;
    the source JPEGs' bytes bound the latter): the one with the higher expected read rate, raw on a tie.

    Args:
        num_images: images in the store.
        raw_bytes: the raw store's image bytes.
        jpeg_bytes: the JPEG store's image bytes, or the source JPEGs' bytes (its bound).
        memory: the machine's memory (default ``memory_bytes()``).
        disk_gbps: the disk's read bandwidth (default ``ASSUMED_DISK_GBPS``, stated as assumed).
        cores: cores decoding for a GPU (default ``cores_per_gpu()``).
        rates: this host's rates on the user's images (``measure_rates``); ``None``: the assumed ones.

    Example:
        >>> gib = 1 << 30
        >>> host = {"memory": 128 * gib, "disk_gbps": 0.86, "cores": 16}  # one H200 host
        >>> choose_store_format(8192, 2 * gib, gib, **host).format  # fits in memory
        'raw'
        >>> choose_store_format(1_281_167, 378 * gib, 140 * gib, **host).format  # ImageNet-1k at 256 px
        'jpeg'
    """
    memory = memory_bytes() if memory is None else int(memory)
    measured = disk_gbps is not None
    disk = float(disk_gbps) if disk_gbps is not None else ASSUMED_DISK_GBPS
    cores = cores_per_gpu() if cores is None else max(1, int(cores))
    raw, jpeg = read_rates(num_images, raw_bytes, jpeg_bytes, memory, disk, cores, rates)
    gb = 1e9
    if rates is not None:
        per_core = f"{rates.decode:,.0f} img/s a core, measured on {rates.images} of your images"
        cache = (
            f"a memory copy, {rates.copy:,.0f} img/s a thread measured, x {_readers(cores)} reading threads"
        )
    else:
        per_core = f"{JPEG_DECODE_RATE_PER_CORE:,} img/s a core, assumed"
        cache = f"about {raw:,.0f} img/s, assumed"
    decode = f"{cores} cores a GPU x {per_core}"
    disk_text = f"{disk:.2f} GB/s{'' if measured else ', assumed'}"
    if fits(raw_bytes, memory):
        reason = (
            f"the raw store ({raw_bytes / gb:,.2f} GB) fits in half of {memory / gb:,.0f} GB memory: read "
            f"from the page cache ({cache}), against the JPEG store's {jpeg:,.0f} ({decode})"
        )
    else:
        reason = (
            f"the raw store ({raw_bytes / gb:,.2f} GB) does not fit in half of {memory / gb:,.0f} GB memory: "
            f"read from the disk ({disk_text}) at about {raw:,.0f} img/s, against the JPEG store's "
            f"{jpeg:,.0f} ({decode}, its bytes from the "
            f"{'page cache' if fits(jpeg_bytes, memory) else 'disk'})"
        )
    fmt = "raw" if raw >= jpeg else "jpeg"
    return StoreChoice(
        fmt, reason, raw, jpeg, int(raw_bytes), int(jpeg_bytes), memory, disk, measured, cores, rates
    )
