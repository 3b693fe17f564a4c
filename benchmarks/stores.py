"""Stores read from a warm and a cold page cache: the raw uint8 store and the compact JPEG store of the same
generated ImageNet-like JPEGs, each read by the DataModule's host loader alone (no model), beside the disk's
own ``O_DIRECT`` read bandwidth.

For a folder of generated JPEGs (``make_jpeg_folder``'s ImageNet-like images) the script converts to both
stores (``convert --format raw`` and ``--format jpeg``: seconds, bytes an image against the source JPEGs'),
then times ``OptimizedDataModule(store, num_workers="auto")``'s training loader onto the device, one whole
epoch a repetition (from the loader's start: its first batch's latency included), after an unmeasured one:

    raw_store_warm, compact_store_warm   the store's pages already in the page cache (read once before)
    raw_store_cold, compact_store_cold   the store evicted before each repetition with
                                         ``posix_fadvise(POSIX_FADV_DONTNEED)``; the eviction is checked by
                                         timing reads of a sample of the file right after it against the
                                         same reads warm (``eviction``: the cold sample must be the slower)
    disk_odirect                         the raw store's file read whole with ``O_DIRECT`` (page-aligned
                                         buffers from ``mmap``, ``--odirect-threads`` streams): the disk's
                                         own bandwidth in GB/s, which a cold store is read at at best

A cold repetition reads each image once (one epoch), all of it inside the timed window, so what it measures
is the disk, not pages that read-ahead brought in before the timing started. Rows carry ``samples_per_sec``
(median of ``--repeats``, spread ``min``-``max`` beside), ``bytes_per_image`` (the store file's bytes over its
images) and, for the disk, ``GBps``; each store row also has ``disk_bound_per_sec`` (the images a second the
disk allows at its bytes an image), ``per_thread_per_sec`` (its rate over its reading threads) and
``rule_expected_per_sec``, what ``store_choice``'s rule expects of it here (``rule`` in the JSON: the cold
rows as if neither store fitted in memory). ``source_bytes_per_image`` (the JPEGs') is at the top of the JSON.

    python3 benchmarks/stores.py                       # 8,192 images; about 2 minutes on one H200 host
    python3 benchmarks/stores.py --data /mnt/nvme/x    # the stores on another disk
    python3 benchmarks/stores.py --quick               # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import mmap
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from _shared import device_of, hdf5_store, results_path

from lightning_gpuopt.bench.measure import write_results
from lightning_gpuopt.bench.synthetic import make_jpeg_folder

#: row prefix -> ``convert --format``
STORES = {"raw_store": "raw", "compact_store": "jpeg"}
ROWS = ("raw_store_warm", "raw_store_cold", "compact_store_warm", "compact_store_cold", "disk_odirect")
_ALIGN = 4096  # O_DIRECT: offsets, lengths and buffers aligned to the logical block (4 KiB covers them)
_BLOCK = 16 << 20  # bytes an O_DIRECT read


def filesystem(path: Path) -> str:
    """The type of the file system holding ``path`` (the longest mount point above it in /proc/mounts)."""
    best, kind = "", "unknown"
    real = os.path.realpath(path)
    with contextlib.suppress(OSError), open("/proc/mounts") as fh:
        for line in fh:
            parts = line.split()
            above = len(parts) > 2 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/"))
            if above and len(parts[1]) > len(best):
                best, kind = parts[1], parts[2]
    return kind


def evict(path: Path) -> None:
    """Drop ``path``'s pages from the page cache (clean pages only: the conversion flushed them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm(path: Path) -> float:
    """Read ``path`` whole through the page cache (its pages stay there); return the seconds it took."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        while fh.read(_BLOCK):
            pass
    return time.perf_counter() - t0


def sample_seconds(path: Path, reads: int = 256) -> float:
    """Seconds positional reads of single pages spread evenly over ``path`` take (at most ``reads``, every
    other page at most; no read-ahead, so each read touches its own page only)."""
    total = path.stat().st_size
    reads = max(1, min(reads, total // (2 * _ALIGN)))
    step = total // reads // _ALIGN * _ALIGN
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        t0 = time.perf_counter()
        for k in range(reads):
            os.pread(fd, _ALIGN, k * step)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def checked_eviction(path: Path) -> dict[str, Any]:
    """Evict ``path`` and check it by timing a sample of its reads cold, then warm (the same reads again),
    and evict again so the sample's pages do not stay. ``evicted``: the cold sample took at least twice as
    long as the warm one."""
    evict(path)
    cold = sample_seconds(path)
    hot = sample_seconds(path)
    evict(path)
    return {"cold_sample_s": round(cold, 5), "warm_sample_s": round(hot, 5), "evicted": cold >= 2 * hot}


def odirect_gbps(path: Path, threads: int) -> float | None:
    """GB/s of reading ``path`` whole with ``O_DIRECT`` in ``threads`` interleaved streams of 16 MiB reads
    into page-aligned ``mmap`` buffers; ``None`` where the file system refuses ``O_DIRECT`` (tmpfs)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError:
        return None
    size = path.stat().st_size
    blocks = (size + _BLOCK - 1) // _BLOCK
    done = [0] * threads
    errors: list[BaseException] = []

    def stream(k: int) -> None:
        buf = mmap.mmap(-1, _BLOCK)  # anonymous: page-aligned, as O_DIRECT needs
        try:
            for b in range(k, blocks, threads):
                done[k] += os.preadv(fd, [buf], b * _BLOCK)
        except OSError as err:
            errors.append(err)
        finally:
            buf.close()

    try:
        workers = [threading.Thread(target=stream, args=(k,)) for k in range(threads)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
    if errors:
        return None  # e.g. EINVAL: this file system takes no O_DIRECT reads
    return sum(done) / seconds / 1e9


def loader_epoch_rate(store: Path, args: argparse.Namespace) -> tuple[float, int]:
    """Images a second of one whole epoch of ``OptimizedDataModule(store)``'s training loader onto the
    device, timed from the loader's start (its first reads included) to the epoch's end; returns ``(rate,
    reading threads)``."""
    import torch

    from lightning_gpuopt import OptimizedDataModule
    from lightning_gpuopt.data.loader import close_workers

    dm = OptimizedDataModule(str(store), batch_size=args.batch_size, image_size=args.image_size)
    dm.setup("fit")
    loader = dm.train_dataloader()
    try:
        n, t0 = 0, time.perf_counter()
        for batch in loader:
            n += batch[0].to(args.device, non_blocking=True).shape[0]
        if args.device == "cuda":
            torch.cuda.synchronize()
        # its readers: a raw store's reading threads, a JPEG store's worker processes
        return n / (time.perf_counter() - t0), int(loader.read_threads or loader.num_workers)
    finally:
        close_workers(loader)  # its reads ahead into the next epoch end first: they would map the store again
        dm.teardown("fit")
        del dm, loader
        gc.collect()  # no memory map of the store outlives the repetition (mapped pages are not evicted)


def spread(values: list[float]) -> dict[str, Any]:
    """Median, min and max of the repetitions."""
    return {
        "samples_per_sec": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "repeats": [round(v, 1) for v in values],
    }


def measure_store(name: str, store: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """``<name>_warm`` and ``<name>_cold`` rows: ``--repeats`` epochs each, after one unmeasured epoch.

    A warm epoch follows a whole read of the file, a cold one the checked eviction."""
    rows: dict[str, dict[str, Any]] = {}
    loader_epoch_rate(store, args)  # first use: the package's imports, pinned buffers
    for state in ("warm", "cold"):
        rates, checks, threads = [], [], 0
        for _ in range(args.repeats):
            if state == "warm":
                warm(store)
            else:
                checks.append(checked_eviction(store))
            rate, threads = loader_epoch_rate(store, args)
            rates.append(rate)
        row = {"name": f"{name}_{state}", **spread(rates), "read_threads": threads}
        if checks:
            row["eviction"] = checks
            row["evicted"] = all(c["evicted"] for c in checks)
        rows[row["name"]] = row
        print(f"  {row['name']:20s} {row['samples_per_sec']:10,.0f} img/s  [{row['min']:,.0f}-"
              f"{row['max']:,.0f}]" + ("" if state == "warm" else f"  evicted: {row['evicted']}"),
              flush=True)  # fmt: skip
    return rows


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """The generated JPEGs (``imagenet_<N>``, shared with feeds.py under the same ``--data``) and both stores,
    converted afresh so that the conversion is measured."""
    root = Path(args.data)
    name = f"stores_quick_{args.images}" if args.quick else f"imagenet_{args.images}"
    size: dict[str, Any] = {"image_size": (64, 48)} if args.quick else {}
    t0 = time.perf_counter()
    jpegs = make_jpeg_folder(root / name, num_images=args.images, num_classes=args.classes, **size)
    files = [p for p in jpegs.rglob("*") if p.suffix.lower() in (".jpg", ".png")]
    source = sum(p.stat().st_size for p in files) / len(files)
    info: dict[str, Any] = {"folder": str(jpegs), "generate_seconds": round(time.perf_counter() - t0, 1),
                            "source_bytes_per_image": source, "stores": {},
                            "filesystem": filesystem(root)}  # fmt: skip
    if info["filesystem"] in ("tmpfs", "ramfs"):
        print(f"note: {root} is on {info['filesystem']} (memory): its pages cannot be evicted and it takes "
              "no O_DIRECT reads; pass --data on a disk for the cold rows", flush=True)  # fmt: skip
    for row, fmt in STORES.items():
        path = root / f"stores_{args.images}_{args.storage}_{fmt}.h5"
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        cost = hdf5_store(jpegs, path, args.storage, format=fmt)
        per = path.stat().st_size / len(files)
        info["stores"][row] = {"path": path, "format": fmt, **cost, "bytes_per_image": per}
        print(f"{row}: {path} ({cost['seconds']:.1f} s, {cost['images_per_sec']:,.0f} img/s), "
              f"{per / 1e3:,.1f} kB an image, {per / source:.2f}x the JPEGs", flush=True)  # fmt: skip
    return info


def table(rows: list[dict[str, Any]], source: float) -> str:
    """The short text table: rate, spread, bytes an image (and against the JPEGs), the disk's bound, the
    rule's expectation."""
    head = f"{'row':20s} {'img/s':>10s} {'spread':>17s} {'kB/img':>8s} {'x JPEG':>7s} {'disk-bound':>11s}"
    lines = [f"{head} {'rule':>8s}"]
    for r in rows:
        if r["name"] == "disk_odirect":
            gbps = "n/a" if r["GBps"] is None else f"{r['GBps']:.2f} GB/s"
            lines.append(f"{r['name']:20s} {gbps:>10s} {'(1 stream: ' + str(r['GBps_1_stream']) + ')':>17s}")
            continue
        bound, rule = r.get("disk_bound_per_sec"), r.get("rule_expected_per_sec")
        lines.append(
            f"{r['name']:20s} {r['samples_per_sec']:10,.0f} {r['min']:8,.0f}-{r['max']:<8,.0f} "
            f"{r['bytes_per_image'] / 1e3:8.1f} {r['bytes_per_image'] / source:7.2f} "
            f"{'' if bound is None else f'{bound:11,.0f}':>11s} {'' if rule is None else f'{rule:8,.0f}':>8s}"
        )
    return "\n".join(lines)


def rule_check(stores: dict[str, Any], gbps: float | None, images: int) -> dict[str, Any]:
    """What ``store_choice``'s rule expects of these stores on this machine, beside the measured rows:
    warm (the machine's memory) and cold (as if neither store fitted), with the disk's measured bandwidth."""
    from lightning_gpuopt.data import store_choice as rule

    raw, jpeg = (stores[k]["bytes_per_image"] * images for k in ("raw_store", "compact_store"))
    disk = gbps or rule.ASSUMED_DISK_GBPS
    cores, memory = rule.cores_per_gpu(), rule.memory_bytes()
    warm = rule.read_rates(images, int(raw), int(jpeg), memory, disk, cores)
    cold = rule.read_rates(images, int(raw), int(jpeg), 0, disk, cores)
    choice = rule.choose_store_format(images, int(raw), int(jpeg), memory=memory, disk_gbps=disk, cores=cores)
    return {"raw_store_warm": warm[0], "compact_store_warm": warm[1], "raw_store_cold": cold[0],
            "compact_store_cold": cold[1], "cores_per_gpu": cores, "memory_bytes": memory,
            "disk_GBps": disk, "choice": choice.format, "reason": choice.reason}  # fmt: skip


def run(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every row, in ``ROWS`` order, and what the files and conversions cost."""
    info = prepare(args)
    stores = info["stores"]
    raw = stores["raw_store"]["path"]
    gbps = [odirect_gbps(raw, args.odirect_threads) for _ in range(args.repeats)]
    one = odirect_gbps(raw, 1)
    disk = {
        "name": "disk_odirect",
        "samples_per_sec": None,
        "GBps": None if None in gbps else statistics.median(gbps),  # type: ignore[type-var]
        "GBps_repeats": gbps,
        "GBps_1_stream": None if one is None else round(one, 3),
        "threads": args.odirect_threads,
        "file": str(raw),
    }
    print(f"  disk_odirect         {disk['GBps'] or 0:.2f} GB/s ({args.odirect_threads} streams)", flush=True)
    measured: dict[str, dict[str, Any]] = {}
    for name, store in stores.items():
        for row in measure_store(name, store["path"], args).values():
            row["bytes_per_image"] = store["bytes_per_image"]
            if disk["GBps"]:
                row["disk_bound_per_sec"] = disk["GBps"] * 1e9 / store["bytes_per_image"]
            row["per_thread_per_sec"] = row["samples_per_sec"] / max(1, row["read_threads"])
            measured[row["name"]] = row
    measured["disk_odirect"] = disk
    info["rule"] = rule_check(stores, disk["GBps"], args.images)
    for name, expected in info["rule"].items():
        if name in measured:
            measured[name]["rule_expected_per_sec"] = expected
    print(f"the rule here: --format {info['rule']['choice']}: {info['rule']['reason']}", flush=True)
    info["stores"] = {k: {**v, "path": str(v["path"])} for k, v in stores.items()}
    return [measured[n] for n in ROWS], info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="results JSON (default results/<date>-stores-<gpu>.json)")
    p.add_argument("--quick", action="store_true", help="a CPU smoke run: 64 tiny images")
    p.add_argument("--data", default="/tmp/gpuopt_data", help="where the JPEGs and the stores are made")
    p.add_argument("--images", type=int, default=8192)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--storage", type=int, default=256, help="the stores' shorter side")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--repeats", type=int, default=3, help="repetitions of every row (medians reported)")
    p.add_argument("--odirect-threads", type=int, default=4, help="O_DIRECT read streams")
    args = p.parse_args(argv)
    if args.quick:
        args.images, args.classes, args.storage, args.batch_size, args.image_size = 64, 4, 37, 8, 32
        args.repeats = min(args.repeats, 2)
    args.device = device_of(args)
    if not hasattr(os, "posix_fadvise"):
        p.error("the cold rows need os.posix_fadvise (Linux)")
    t0 = time.perf_counter()
    rows, info = run(args)
    source = info["source_bytes_per_image"]
    path = results_path(args.out, "stores", args.quick)
    write_results(path, rows, source_bytes_per_image=source, quick=args.quick, data=info,
                  settings={k: v for k, v in vars(args).items() if k != "out"},
                  seconds=round(time.perf_counter() - t0, 1))  # fmt: skip
    print(table(rows, source))
    print(f"source JPEGs: {source / 1e3:,.1f} kB an image; wrote {path}")
    return 0 if all(r.get("evicted", True) for r in rows) else 1


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
