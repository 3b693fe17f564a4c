"""Raw or JPEG store: the rule ``lightning-gpuopt convert`` states, from figures measured on this host where
it can, else the assumed ones below (docs/hdf5.md, "Raw or JPEG store")."""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_gpuopt._common import available_cpus
from lightning_gpuopt.data.hdf5 import READ_THREADS  # HDF5Options' default threads

#: share of the machine's memory a store may take and still be read from the page cache every epoch (the
#: rest is the training processes': the model, pinned batches, the loader)
MEMORY_SHARE = 0.5
#: images a second a raw store delivers from the page cache: 4 reading threads on one H200 host (docs/hdf5.md)
RAW_CACHED_RATE = 49_000
#: images a second one core decodes out of a JPEG store at 256 px: the low end of a 2-core x86 host's core
JPEG_DECODE_RATE_PER_CORE = 1_000
#: source images ``measure_rates`` encodes and decodes, and the least seconds it decodes them for
SAMPLE_IMAGES, SAMPLE_SECONDS = 32, 0.25
#: the read bandwidth assumed where the disk's cannot be measured: one H200 host's disk with ``O_DIRECT``
ASSUMED_DISK_GBPS = 0.86
#: bytes read to measure a disk's bandwidth (less where the file is smaller), and the least worth measuring
PROBE_BYTES, MIN_PROBE_BYTES = 256 << 20, 32 << 20
_BLOCK = 8 << 20


def cores_per_gpu() -> int:
    """The CPUs this process may use, shared by the CUDA GPUs it sees (all of them without a GPU)."""
    try:
        import torch

        gpus = int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:  # a broken CUDA setup counts as no GPU
        gpus = 0
    return max(1, available_cpus() // max(1, gpus))


def memory_bytes() -> int:
    """The machine's memory (``psutil.virtual_memory().total``)."""
    import psutil

    return int(psutil.virtual_memory().total)


def disk_read_gbps(path: str | os.PathLike[str], limit: int = PROBE_BYTES) -> float | None:
    """GB/s of reading the first ``limit`` bytes of ``path`` with ``O_DIRECT``; ``None`` where it cannot be
    measured (no ``O_DIRECT``, a file under ``MIN_PROBE_BYTES``)."""
    flag = getattr(os, "O_DIRECT", 0)
    size = min(os.path.getsize(path), limit)
    if not flag or size < MIN_PROBE_BYTES:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError:
        return None
    buf = mmap.mmap(-1, _BLOCK)  # page-aligned, as O_DIRECT needs
    try:
        done, t0 = 0, time.perf_counter()
        while done < size and (n := os.preadv(fd, [buf], done)) > 0:
            done += n
        seconds = time.perf_counter() - t0
    except OSError:
        return None
    finally:
        buf.close()
        os.close(fd)
    return done / seconds / 1e9 if seconds > 0 and done else None


def probe_disk_gbps(folder: str | os.PathLike[str], name: str) -> float | None:
    """``disk_read_gbps`` of ``PROBE_BYTES`` written to ``folder/name`` (removed after, also on failure)."""
    path = Path(folder) / name  # its name holds this process's pid: a file already there is a stale probe
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
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
    """Images a second one core decodes out of a JPEG store and one thread copies out of a raw store in
    memory, measured over ``images`` of the user's images."""

    decode: float
    copy: float
    images: int


def measure_rates(paths: Sequence[str], storage_size: int) -> HostRates | None:
    """This host's rates on up to ``SAMPLE_IMAGES`` of ``paths``, encoded as the JPEG store keeps them,
    decoded for at least ``SAMPLE_SECONDS`` and copied as a raw batch; ``None`` where none could be read.

    Example:
        >>> measure_rates(["a.jpg", "b.jpg"], 256)  # doctest: +SKIP
        HostRates(decode=1312.5, copy=31250.0, images=2)
    """
    import numpy as np

    from lightning_gpuopt.data import layout
    from lightning_gpuopt.data.folder import decode_canvas
    from lightning_gpuopt.data.jpeg_store import encode_for_store

    paths = [p for p in paths if os.path.isfile(p)]  # regular files: a FIFO would block the sample
    shape = (*layout.canvas_shape(storage_size), 3)
    encoded = []
    for path in paths[:: max(1, len(paths) // SAMPLE_IMAGES)][:SAMPLE_IMAGES]:
        # an unreadable image (or one whose store bytes do not decode) is left out: the conversion names it
        with contextlib.suppress(ValueError, OSError):
            data = encode_for_store(path, storage_size)[0]
            decode_canvas(data, storage_size, np.zeros(shape, np.uint8), name=path)
            encoded.append(data)
    if not encoded:
        return None
    canvases, copies = np.zeros((len(encoded), *shape), np.uint8), np.empty((len(encoded), *shape), np.uint8)
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
    """What ``choose_store_format`` decided (``format``; ``reason``, the comparison in one line) and from what
    (images a second of each store, memory bytes, disk GB/s, cores decoding for a GPU, measured rates)."""

    format: str
    reason: str
    raw_rate: float
    jpeg_rate: float
    memory: int
    disk_gbps: float
    cores_per_gpu: int
    rates: HostRates | None = None


def per_core(rates: HostRates | None) -> str:
    """The JPEG decode rate a core, in words: measured (``rates``) or assumed."""
    if rates is None:
        return f"{JPEG_DECODE_RATE_PER_CORE:,} img/s a core, assumed"
    return f"{rates.decode:,.0f} img/s a core, measured on {rates.images} of your images"


def fits(store_bytes: int, memory: int) -> bool:
    """Whether a store of ``store_bytes`` stays in the page cache (``MEMORY_SHARE`` of ``memory``)."""
    return store_bytes <= MEMORY_SHARE * memory


def read_rates(
    num_images: int,
    raw_bytes: int,
    jpeg_bytes: int,
    memory: int,
    disk_gbps: float,
    cores: int,
    rates: HostRates | None = None,
) -> tuple[float, float]:
    """Expected ``(raw store, JPEG store)`` images a second, from ``rates`` or the assumed ones."""
    disk = disk_gbps * 1e9
    cached = rates.copy * min(READ_THREADS, cores) if rates is not None else RAW_CACHED_RATE
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
    """The store with the higher expected read rate for ``num_images`` images, the raw one on a tie.

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
    disk = float(disk_gbps) if disk_gbps is not None else ASSUMED_DISK_GBPS
    cores = cores_per_gpu() if cores is None else max(1, int(cores))
    raw, jpeg = read_rates(num_images, raw_bytes, jpeg_bytes, memory, disk, cores, rates)
    cache, readers = f"about {raw:,.0f} img/s, assumed", min(READ_THREADS, cores)
    if rates is not None:
        cache = f"a memory copy, {rates.copy:,.0f} img/s a thread measured, x {readers} reading threads"
    decode, gb = f"{cores} cores a GPU x {per_core(rates)}", 1e9
    store = f"the raw store ({raw_bytes / gb:,.2f} GB)"
    if fits(raw_bytes, memory):
        reason = (
            f"{store} fits in half of {memory / gb:,.0f} GB memory: read from the page cache ({cache}), "
            f"against the JPEG store's {jpeg:,.0f} ({decode})"
        )
    else:
        reason = (
            f"{store} does not fit in half of {memory / gb:,.0f} GB memory: read from the disk ({disk:.2f} GB/s"
            f"{'' if disk_gbps is not None else ', assumed'}) at about {raw:,.0f} img/s, against the JPEG "
            f"store's {jpeg:,.0f} ({decode}, its bytes from the {'page cache' if fits(jpeg_bytes, memory) else 'disk'})"
        )
    fmt = "raw" if raw >= jpeg else "jpeg"
    return StoreChoice(fmt, reason, raw, jpeg, memory, disk, cores, rates)
