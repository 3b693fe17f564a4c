"""JPEGs at full speed: the folder backend and the stores against torchvision v2 and the host's decode limit.

The same generated ImageNet-like JPEGs (``make_jpeg_folder``: sizes and aspects spread as ImageNet's, a few
grey and CMYK images) feed one ``UserClassifier`` (torchvision's ResNet-50, its own SGD) through
``Trainer(**fast_trainer_kwargs(model, compile=True, max_epochs=-1))``; rows and the compiled plain loop
take turns ``--repeats`` times, each repetition one fit timed by a CUDA event at every batch end after
``--warmup`` steps (``peers.py``'s measurement). Rows that train:

    ours_folder          OptimizedDataModule("train/"), the default backend ("auto": DALI with a CUDA GPU and
                         DALI installed, else whole-batch worker processes; the row records which)
    ours_folder_cpu_decode, ours_folder_gpu_decode   the same with ``DALIOptions(decoder="cpu")`` (DALI's
                         CPU threads) or ``"gpu"`` (nvJPEG): either decoder, whatever the default picks;
                         ``ours_folder_cpu_decode:16`` with 16 DALI threads (several counts can share a run)
    torchvision_v2       peers.py's torchvision row (``decode_jpeg`` + ``transforms.v2`` on uint8, workers)
    raw_store_cold       OptimizedDataModule("train.h5") (``convert --format raw``) with its file evicted from
                         the page cache every ``--evict-every`` seconds while it trains (a store bigger than
                         memory): ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the file and ``madvise
                         (MADV_DONTNEED)`` on the store's memory map
    compact_store_warm   OptimizedDataModule("train_jpeg.h5") (``convert --format jpeg``, the default backend:
                         DALI decodes its training batches where it would a folder's), page cache warm
    compact_store_cold   the same store evicted as ``raw_store_cold``

Rows with no model (images a second, median of ``--repeats``, spread beside):

    decode_limit         the same JPEG files decoded to RGB by one process a CPU, nothing else: the host's limit
    loader_cpu_threads   the DALI backend decoding on its CPU threads (``DALIOptions(decoder="cpu")``) alone
    loader_cpu_workers   the folder backend's training loader alone onto the GPU (its worker processes)
    loader_gpu_decode    the DALI backend with nvJPEG (``DALIOptions(decoder="gpu")``) alone; skipped without DALI

Cold rows carry ``disk_read_bytes_per_image`` (what the block devices read over the images trained: about
``bytes_per_image`` when the eviction kept the store out of memory); ``disk_read_gbps_o_direct`` (2 GiB read
with ``O_DIRECT``: the disk's own rate) and the JPEGs' ``source_bytes_per_image`` are at the top of the JSON.

    python3 benchmarks/jpeg.py --only ours_folder,torchvision_v2,decode_limit,loader_cpu_threads,\
        loader_cpu_workers,loader_gpu_decode --out a.json                # one GPU host: about 7 minutes
    python3 benchmarks/jpeg.py --only raw_store_cold,compact_store_warm,compact_store_cold --out b.json
    python3 benchmarks/peers.py merge a.json b.json --out merged.json  # all: > 10 min
    python3 benchmarks/jpeg.py --quick                                   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from _shared import add_feed, feed_args, format_rows, free, hdf5_store, loader_rate, measured_fit, say, take_turns
from _zoo import UserClassifier, compiled_ceiling, measure_ceiling
from peers import feed_torchvision_v2, files_of, folder_bytes
from stores import evict

from lightning_gpuopt import DALIOptions

from lightning_gpuopt._common import available_cpus
from lightning_gpuopt.bench.measure import write_results
from lightning_gpuopt.bench.steady import summarize
from lightning_gpuopt.bench.synthetic import make_jpeg_folder
from lightning_gpuopt.data.store_choice import disk_read_gbps

DECODER_ROWS = ("ours_folder_cpu_decode", "ours_folder_gpu_decode")
TRAINING = ("ours_folder", *DECODER_ROWS, "torchvision_v2", "raw_store_cold", "compact_store_warm",
            "compact_store_cold")
ALONE = ("decode_limit", "loader_cpu_threads", "loader_cpu_workers", "loader_gpu_decode")
ROWS = (*TRAINING, *ALONE)
CEILING = "ceiling_compiled"
#: the store each training row reads (``None``: the JPEG folder or the peer's own loader) and whether it is
#: evicted while it trains
STORE_OF = {"raw_store_cold": ("raw", True), "compact_store_warm": ("jpeg", False),
            "compact_store_cold": ("jpeg", True)}


# ------------------------------------------------------------------------------------------------ the data
def prepare(args: argparse.Namespace, rows: list[str]) -> dict[str, Any]:
    """The JPEG folder and the stores the rows read; bytes an image and conversion seconds of each."""
    root = Path(args.data)
    size: Any = (96, 72) if args.quick else "imagenet"
    jpegs = make_jpeg_folder(root / "train", num_images=args.images, num_classes=10, image_size=size)
    files = files_of(jpegs)
    info: dict[str, Any] = {"train": jpegs, "files": files, "bytes": {}, "convert_s": {},
                            "source_bytes_per_image": folder_bytes(jpegs) / len(files)}
    for fmt in sorted({STORE_OF[r][0] for r in rows if r in STORE_OF}):
        path = root / f"train_{args.storage}_{fmt}.h5"
        cost = hdf5_store(jpegs, path, args.storage, format=fmt)
        info[fmt] = path
        info["bytes"][fmt] = path.stat().st_size / len(files)
        info["convert_s"][fmt] = cost.get("seconds")
    return info


# ----------------------------------------------------------------------------------------------- eviction
def _maps_of(dm: Any) -> list[mmap.mmap]:
    """The memory maps under the training dataset's arrays (the raw store reads through one)."""
    dataset = getattr(dm, "_datasets", {}).get("train")
    found: list[mmap.mmap] = []
    for array in (getattr(dataset, "_win", None), getattr(dataset, "_rows", None)):
        base = array
        while base is not None and not isinstance(base, mmap.mmap):
            base = getattr(base, "base", None) if not isinstance(base, memoryview) else base.obj
        if isinstance(base, mmap.mmap) and all(base is not m for m in found):
            found.append(base)
    return found


@contextlib.contextmanager
def evicting(path: Path, dm: Any, every_s: float) -> Iterator[None]:
    """While inside, drop ``path``'s pages from the page cache every ``every_s`` seconds: the pages mapped by
    the DataModule's store are unmapped first (``MADV_DONTNEED``), which a mapped page needs to be dropped."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(every_s):
            for mapped in _maps_of(dm):
                with contextlib.suppress(ValueError, OSError):  # closed under us: nothing left to drop
                    mapped.madvise(mmap.MADV_DONTNEED)
            evict(path)

    thread = threading.Thread(target=run, name="jpeg-bench-evict", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def disk_read_bytes() -> int | None:
    """Bytes read by every block device so far (psutil), or ``None`` where the platform does not say."""
    import psutil

    counters = psutil.disk_io_counters()
    return None if counters is None else int(counters.read_bytes)


# ------------------------------------------------------------------------------------------------ the rows
def _datamodule(path: Path, args: argparse.Namespace, **kw: Any) -> Any:
    from lightning_gpuopt import OptimizedDataModule

    return OptimizedDataModule(str(path), batch_size=args.batch_size, image_size=args.image_size,
                               num_workers="auto", **kw)


def training_variant(name: str, model: Any, args: argparse.Namespace, info: dict[str, Any],
                     disk: dict[str, list[tuple[int, int]]]) -> Callable[[], Any]:
    def go() -> Any:
        if name.startswith("ours_folder"):  # the default decoder, or the one the row names
            row, _, count = name.partition(":")
            decoder = row.split("_")[2] if row in DECODER_ROWS else None  # None: the default's choice
            kw = {"dali": DALIOptions(decoder, int(count) if count else None)} if decoder else {}
            feed: dict[str, Any] = {"datamodule": _datamodule(info["train"], args, **kw)}
        elif name == "torchvision_v2":
            feed = feed_torchvision_v2(args, info)
        else:
            fmt, cold = STORE_OF[name]
            feed = {"datamodule": _datamodule(info[fmt], args)}
        if (dm := feed.get("datamodule")) is not None:
            info.setdefault("backend", {})[name] = [dm.backend, dm.backend_reason]
        cold = name in STORE_OF and STORE_OF[name][1]
        before = disk_read_bytes()
        try:
            with evicting(info[STORE_OF[name][0]], feed["datamodule"], args.evict_every) if cold else (
                    contextlib.nullcontext()):
                m = measured_fit(model, args.warmup, args.steps, device=args.device,
                                 compile=args.device == "cuda", settle=True, **feed)
            after = disk_read_bytes()
            if cold and before is not None and after is not None:
                disk.setdefault(name, []).append((after - before, (args.warmup + args.steps) * args.batch_size))
            return m
        finally:
            del feed
            free()

    return go


def _decode_files(paths: list[str]) -> int:
    from PIL import Image

    for path in paths:
        with Image.open(path) as img:
            img.convert("RGB").load()
    return len(paths)


def decode_limit(files: list[str], processes: int) -> float:
    """Images a second ``processes`` processes decode ``files`` to RGB (PIL), after a warm pass of the page
    cache: the host's decode limit with nothing else running."""
    chunks = [files[i::processes] for i in range(processes)]
    with ProcessPoolExecutor(processes) as pool:
        list(pool.map(_decode_files, [c[:8] for c in chunks]))  # the processes started, PIL imported
        t0 = time.perf_counter()
        done = sum(pool.map(_decode_files, chunks))
        return done / (time.perf_counter() - t0)


def alone_rate(name: str, args: argparse.Namespace, info: dict[str, Any]) -> float | None:
    """One repetition of a row with no model."""
    if name == "decode_limit":
        return decode_limit([p for p, _ in info["files"]], available_cpus())
    if name in ("loader_gpu_decode", "loader_cpu_threads"):
        if args.device != "cuda":
            raise RuntimeError("the DALI rows need a CUDA GPU")
        decoder = "gpu" if name == "loader_gpu_decode" else "cpu"
        dm = _datamodule(info["train"], args, backend="dali", dali=DALIOptions(decoder=decoder))
    else:
        dm = _datamodule(info["train"], args, backend="folder")
    dm.setup("fit")
    try:
        return loader_rate(dm.train_dataloader(), args.device, args.loader_batches, skip=args.warmup)
    finally:
        dm.teardown("fit")
        free()


# -------------------------------------------------------------------------------------------------- the run
def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = list(args.only or ROWS)
    info = prepare(args, rows)
    out: dict[str, Any] = {"source_bytes_per_image": info["source_bytes_per_image"], "images": len(info["files"]),
                           "cpus": available_cpus()}
    if cold := [info[STORE_OF[r][0]] for r in rows if r in STORE_OF and STORE_OF[r][1]]:  # the disk, beside
        out["disk_read_gbps_o_direct"] = disk_read_gbps(cold[0], 2 << 30)  # the cold rows: 2 GiB, O_DIRECT
    table: list[dict[str, Any]] = []
    training = [r for r in rows if r.partition(":")[0] in TRAINING]
    no_dali = args.device != "cuda" or not find_spec("nvidia.dali")
    if skipped := [r for r in training if r.partition(":")[0] in DECODER_ROWS and no_dali]:
        training = [r for r in training if r not in skipped]
        print(f"  {', '.join(skipped)}: skipped (they need a CUDA GPU and DALI)", file=sys.stderr)
    if training:
        model = UserClassifier(args.arch, num_classes=10)
        ceiling, compile_s = compiled_ceiling(args.arch, args.batch_size, args.image_size, 10, args.device)
        out["ceiling_compile_seconds"] = compile_s
        disk: dict[str, list[tuple[int, int]]] = {}
        variants = {CEILING: lambda: measure_ceiling(ceiling, 10, args.steps),
                    **{r: training_variant(r, model, args, info, disk) for r in training}}
        done: dict[str, list[Any]] = {}

        def keep(name: str, turn: int, m: Any) -> None:
            say(name, turn, m)
            done.setdefault(name, []).append(m)
            write_results(args.out + ".partial", summarize(done, CEILING), **out)

        table = summarize(take_turns(variants, args.repeats, on_result=keep), CEILING)
        for row in table:
            name = row["name"]
            row["of_compiled_ceiling"] = row["of_ceiling"]
            if name in STORE_OF:
                row["bytes_per_image"] = info["bytes"][STORE_OF[name][0]]
                row["convert_seconds"] = info["convert_s"][STORE_OF[name][0]]
            elif name != CEILING:
                row["bytes_per_image"] = info["source_bytes_per_image"]
            if disk.get(name):
                row["disk_read_bytes_per_image"] = statistics.median(b / n for b, n in disk[name])
            row["backend"], row["backend_reason"] = info.get("backend", {}).get(name, [None, None])
    for name in (r for r in rows if r in ALONE):
        try:
            rates = [r for r in (alone_rate(name, args, info) for _ in range(args.repeats)) if r is not None]
            table.append({"name": name, "error": "no figure"} if not rates else {
                "name": name, "samples_per_sec": statistics.median(rates), "samples_per_sec_min": min(rates),
                "samples_per_sec_max": max(rates), "repeats": [{"samples_per_sec": v} for v in rates]})
        except Exception as err:  # noqa: BLE001 - a row that cannot run here says why; the others go on
            table.append({"name": name, "error": f"{type(err).__name__}: {err}"})
            print(f"  {name}: {type(err).__name__}: {err}", file=sys.stderr)
        write_results(args.out + ".partial", table, **out)  # a run stopped by its time limit keeps these
    limit = next((r for r in table if r["name"] == "decode_limit" and "samples_per_sec" in r), None)
    for cpu_loader in (r for r in table if r["name"].startswith("loader_cpu") and "samples_per_sec" in r):
        if limit:
            cpu_loader["of_decode_limit"] = cpu_loader["samples_per_sec"] / limit["samples_per_sec"]
    out["rows"] = table
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_feed(p, "gpuopt_jpeg", "jpeg", ROWS, "torchvision_v2's workers")
    p.add_argument("--evict-every", type=float, default=0.25, help="seconds between evictions of a cold store")
    return feed_args(p, argv, ROWS, DECODER_ROWS)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = run(args)
    write_results(args.out, out["rows"], **{k: v for k, v in out.items() if k != "rows"},
                  settings={k: v for k, v in vars(args).items()}, quick=args.quick)
    print(f"{out['images']} images, {out['source_bytes_per_image']:,.0f} JPEG bytes an image, "
          f"{out['cpus']} CPUs")
    print(format_rows(out["rows"], "of compiled ceiling median (worst)"))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
