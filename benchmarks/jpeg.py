"""JPEGs at full speed: a JPEG folder and the compact JPEG store against the compiled plain loop and
torchvision v2, with and without DALI.

The same generated ImageNet-like JPEGs (``make_jpeg_folder``: widths 200 to 1,000 px, aspect ratios 0.5 to 2,
about 2 % grey and 2 % CMYK; the file's ``images`` object says what was generated) feed one
``UserClassifier`` (torchvision's ResNet-50, its own SGD) through ``Trainer(**fast_trainer_kwargs(model,
compile=True, max_epochs=-1))``; rows and the compiled plain loop take turns ``--repeats`` times, each
repetition one fit timed by a CUDA event at every batch end after ``--warmup`` steps (``peers.py``'s
measurement). Rows that train (the default run: the first four):

    ours_folder          OptimizedDataModule("train/") with ``nvidia.dali`` made unimportable in this process
                         while the row runs (``dali_hidden``): what the README's install (no DALI) gets, the
                         folder decoded in the training process (nvJPEG or CPU threads, chosen at setup)
    ours_jpeg_store      OptimizedDataModule("train_256_jpeg.h5") (``convert --format jpeg``), DALI unimportable
    ours_folder_dali     OptimizedDataModule("train/") with DALI importable: ``backend="auto"`` takes DALI
    torchvision_v2       peers.py's torchvision row (``decode_jpeg`` + ``transforms.v2`` on uint8, workers)
    ours_folder_threads, ours_folder_nvjpeg   the folder with ``DecodeOptions(decoder="cpu")`` or ``"gpu"``,
                         DALI unimportable: either decoder, whatever the rule picks
    ours_folder_cpu_decode, ours_folder_gpu_decode   the folder through DALI with ``DALIOptions(decoder="cpu")``
                         or ``"gpu"``; ``ours_folder_cpu_decode:16`` with 16 DALI threads
    raw_store_cold       OptimizedDataModule("train.h5") (``convert --format raw``) with its file evicted from
                         the page cache every ``--evict-every`` seconds while it trains (a store bigger than
                         memory): ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the file and ``madvise
                         (MADV_DONTNEED)`` on the store's memory map
    compact_store_warm   OptimizedDataModule("train_jpeg.h5") with the default backend (DALI where installed)
    compact_store_cold   the same store evicted as ``raw_store_cold``

Each training row records ``decoder`` (what decoded it) and ``decoder_reason``, and, after the turns, its
loader alone onto the GPU (``loader_alone_per_sec``) with the CPU cores the process and its workers used
meanwhile (``loader_alone_cpu_cores``); ``cpu_main_cores`` and ``cpu_loader_cores`` are the cores used while
it trained. Rows with no model (images a second, median of ``--repeats``, spread beside):

    decode_limit         the same JPEG files decoded to RGB by one process a CPU, nothing else: the host's limit
    loader_cpu_threads   the DALI backend decoding on its CPU threads (``DALIOptions(decoder="cpu")``) alone
    loader_cpu_workers   the folder backend's training loader alone onto the GPU (its worker processes)
    loader_gpu_decode    the DALI backend with nvJPEG (``DALIOptions(decoder="gpu")``) alone; skipped without DALI

Cold rows carry ``disk_read_bytes_per_image`` (what the block devices read over the images trained: about
``bytes_per_image`` when the eviction kept the store out of memory); ``disk_read_gbps_o_direct`` (2 GiB read
with ``O_DIRECT``: the disk's own rate) and the JPEGs' ``source_bytes_per_image`` are at the top of the JSON.

    python3 benchmarks/jpeg.py --loader-batches 15          # the default rows on one GPU host: about 8 minutes
    python3 benchmarks/jpeg.py --only raw_store_cold,compact_store_cold --out b.json
    python3 benchmarks/peers.py merge a.json b.json --out benchmarks/results/jpeg_h200.json
    python3 benchmarks/jpeg.py --quick                      # a CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from _shared import add_feed, feed_args, free, hdf5_store, loader_rate, machine_tag, measured_fit, say
from _user import UserClassifier, compiled_ceiling, measure_ceiling
from peers import feed_torchvision_v2, files_of, folder_bytes
from stores import evict

from lightning_gpuopt import DALIOptions, DecodeOptions
from lightning_gpuopt._common import available_cpus
from lightning_gpuopt.bench.measure import write_results
from lightning_gpuopt.bench.steady import format_rows, summarize, take_turns
from lightning_gpuopt.bench.synthetic import make_jpeg_folder
from lightning_gpuopt.data.backends import dali_installed
from lightning_gpuopt.data.decode import jpeg_info
from lightning_gpuopt.data.store_choice import disk_read_gbps

DECODER_ROWS = ("ours_folder_cpu_decode", "ours_folder_gpu_decode")
#: rows read without DALI importable (``dali_hidden``), and the ``DecodeOptions`` each asks for
NO_DALI = {"ours_folder": None, "ours_jpeg_store": None, "ours_folder_threads": DecodeOptions(decoder="cpu"),
           "ours_folder_nvjpeg": DecodeOptions(decoder="gpu")}
TRAINING = ("ours_folder", "ours_jpeg_store", "ours_folder_dali", "torchvision_v2", "ours_folder_threads",
            "ours_folder_nvjpeg", *DECODER_ROWS, "raw_store_cold", "compact_store_warm", "compact_store_cold")
ALONE = ("decode_limit", "loader_cpu_threads", "loader_cpu_workers", "loader_gpu_decode")
ROWS = (*TRAINING, *ALONE)
#: what a run without ``--only`` measures
DEFAULT_ROWS = ("ours_folder", "ours_jpeg_store", "ours_folder_dali", "torchvision_v2")
CEILING = "ceiling_compiled"
#: the store each training row reads (``None``: the JPEG folder or the peer's own loader) and whether it is
#: evicted while it trains
STORE_OF = {"raw_store_cold": ("raw", True), "compact_store_warm": ("jpeg", False),
            "compact_store_cold": ("jpeg", True), "ours_jpeg_store": ("jpeg", False)}


# ------------------------------------------------------------------------------------------------ the data
def images_of(files: list[tuple[str, int]]) -> dict[str, Any]:
    """What the generated images are: counts, side and aspect ranges, grey, CMYK and progressive JPEGs (from
    each file's frame header)."""
    infos = []
    for path, _ in files:
        with open(path, "rb") as fh:
            infos.append(jpeg_info(fh.read(1 << 16)))
    ok = [i for i in infos if i is not None]
    widths, heights = [i.width for i in ok], [i.height for i in ok]
    aspects = [i.width / i.height for i in ok]
    return {"count": len(files), "jpeg": len(ok), "width_min": min(widths), "width_max": max(widths),
            "height_min": min(heights), "height_max": max(heights), "aspect_min": min(aspects),
            "aspect_max": max(aspects), "grayscale": sum(i.components == 1 for i in ok),
            "cmyk": sum(i.components == 4 for i in ok), "progressive": sum(not i.baseline for i in ok)}


def prepare(args: argparse.Namespace, rows: list[str]) -> dict[str, Any]:
    """The JPEG folder and the stores the rows read; bytes an image and conversion seconds of each."""
    root = Path(args.data)
    size: Any = (96, 72) if args.quick else "imagenet"
    jpegs = make_jpeg_folder(root / "train", num_images=args.images, num_classes=10, image_size=size)
    files = files_of(jpegs)
    info: dict[str, Any] = {"train": jpegs, "files": files, "bytes": {}, "convert_s": {},
                            "source_bytes_per_image": folder_bytes(jpegs) / len(files), "images": images_of(files)}
    for fmt in sorted({STORE_OF[r][0] for r in rows if r in STORE_OF}):
        path = root / f"train_{args.storage}_{fmt}.h5"
        cost = hdf5_store(jpegs, path, args.storage, format=fmt)
        info[fmt] = path
        info["bytes"][fmt] = path.stat().st_size / len(files)
        info["convert_s"][fmt] = cost.get("seconds")
    return info


@contextlib.contextmanager
def dali_hidden() -> Iterator[None]:
    """While inside, ``import nvidia.dali`` fails in this process (its ``sys.modules`` entry is ``None``), as
    on a machine without DALI; the module, where it was imported, is put back afterwards."""
    saved = sys.modules.get("nvidia.dali")
    sys.modules["nvidia.dali"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if saved is None:
            del sys.modules["nvidia.dali"]
        else:
            sys.modules["nvidia.dali"] = saved


def dali_importable() -> bool:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


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


def make_feed(name: str, args: argparse.Namespace, info: dict[str, Any]) -> dict[str, Any]:
    """The fit arguments of training row ``name`` (``datamodule=`` or ``train_dataloaders=``)."""
    row, _, count = name.partition(":")
    if row in DECODER_ROWS:  # DALI with either decoder
        options = DALIOptions(row.split("_")[2], int(count) if count else None)
        return {"datamodule": _datamodule(info["train"], args, dali=options)}
    if row == "torchvision_v2":
        return feed_torchvision_v2(args, info)
    if row in NO_DALI or row == "ours_folder_dali":
        options = NO_DALI.get(row)
        if args.quick and options is None and row != "ours_folder_dali":
            options = DecodeOptions()  # a CPU run: the in-process decoding, as a CUDA machine without DALI has
        kw: dict[str, Any] = {"decode": options} if options is not None else {}
        if args.quick and row == "ours_folder_dali":
            kw["backend"] = "dali"  # DALI's CPU pipeline, as "auto" takes DALI on a CUDA machine
        path = info[STORE_OF[row][0]] if row in STORE_OF else info["train"]
        return {"datamodule": _datamodule(path, args, **kw)}
    return {"datamodule": _datamodule(info[STORE_OF[row][0]], args)}


class FeedRecorder(pl.Callback):
    """Keeps what feeds the fit: the training loader's ``feed_info`` and the DataModule's decoder choice."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen = describe_feed(trainer.train_dataloader, trainer.datamodule)


def describe_feed(loader: Any, dm: Any) -> dict[str, Any]:
    """``decoder`` (what decodes the JPEGs), ``decoder_reason`` and the measured rates behind a choice."""
    feed = getattr(loader, "feed_info", None)
    choice = getattr(getattr(dm, "_backend", None), "choice", None)
    out: dict[str, Any] = {"decoder": None, "decoder_reason": None}
    if choice is not None:
        out.update(decoder_reason=choice.reason, decoder_measured=choice.measured, decode_cpu_rate=choice.cpu_rate,
                   decode_gpu_rate=choice.gpu_rate)
    if feed is None:  # a peer's own DataLoader
        workers = getattr(loader, "num_workers", 0)
        out["decoder"] = f"torchvision decode_image, {_n(workers, 'worker process')}"
    elif feed.backend == "dali":
        out["decoder"] = "DALI nvJPEG" if feed.decoder == "gpu" else f"DALI CPU, {_n(feed.threads, 'thread')}"
        out["decoder_reason"] = getattr(feed, "decoder_reason", None)
    elif feed.decoder == "gpu":
        out["decoder"] = f"torchvision nvJPEG, {_n(feed.threads, 'reading thread')}"
    elif feed.threads:
        out["decoder"] = f"CPU, {_n(feed.threads, 'thread')} of the training process"
    else:
        out["decoder"] = f"CPU, {_n(feed.num_workers, 'worker process')}"
    return out


def _n(count: Any, what: str) -> str:
    return f"{count} {what}{'es' if what.endswith('s') else 's'}" if count != 1 else f"1 {what}"


def training_variant(name: str, model: Any, args: argparse.Namespace, info: dict[str, Any],
                     disk: dict[str, list[tuple[int, int]]]) -> Callable[[], Any]:
    def go() -> Any:
        hidden = dali_hidden() if name.partition(":")[0] in NO_DALI else contextlib.nullcontext()
        with hidden:
            feed = make_feed(name, args, info)
            if (dm := feed.get("datamodule")) is not None:
                info.setdefault("backend", {})[name] = [dm.backend, dm.backend_reason]
            info.setdefault("dali_importable", {})[name] = dali_importable()
            cold = name in STORE_OF and STORE_OF[name][1]
            recorder = FeedRecorder()
            before = disk_read_bytes()
            try:
                with evicting(info[STORE_OF[name][0]], feed["datamodule"], args.evict_every) if cold else (
                        contextlib.nullcontext()):
                    m = measured_fit(model, args.warmup, args.steps, device=args.device, callbacks=[recorder],
                                     compile=args.device == "cuda", settle=True, **feed)
                after = disk_read_bytes()
                if cold and before is not None and after is not None:
                    disk.setdefault(name, []).append((after - before, (args.warmup + args.steps) * args.batch_size))
                info.setdefault("feeds", {})[name] = recorder.seen
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


def cpu_seconds() -> float:
    """CPU seconds this process and its children (loader workers) have used so far."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += sum(child.cpu_times()[:2])
    return total


def loader_alone(name: str, args: argparse.Namespace, info: dict[str, Any]) -> tuple[float, float] | None:
    """Images a second training row ``name``'s loader delivers onto the device with no model, past
    ``--warmup`` batches, and the CPU cores its process and workers used meanwhile."""
    hidden = dali_hidden() if name.partition(":")[0] in NO_DALI else contextlib.nullcontext()
    with hidden:
        feed = make_feed(name, args, info)
        loader, dm = feed.get("train_dataloaders"), feed.get("datamodule")
        if dm is not None:
            dm.setup("fit")
            loader = dm.train_dataloader()
        try:
            cpu0, t0 = cpu_seconds(), time.perf_counter()
            rate = loader_rate(loader, args.device, args.loader_batches, skip=args.warmup)
            return rate, (cpu_seconds() - cpu0) / (time.perf_counter() - t0)
        finally:
            if dm is not None:
                dm.teardown("fit")
            del feed, loader
            free()


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
def train_rows(args: argparse.Namespace, info: dict[str, Any], training: list[str], out: dict[str, Any]
               ) -> list[dict[str, Any]]:  # fmt: skip
    """The training rows and the ceiling, taking turns; then each row's loader alone."""
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
        for rep in row["repeats"]:
            rep["of_compiled_ceiling"] = rep.get("of_ceiling")
        if name in STORE_OF:
            row["bytes_per_image"] = info["bytes"][STORE_OF[name][0]]
            row["convert_seconds"] = info["convert_s"][STORE_OF[name][0]]
        elif name != CEILING:
            row["bytes_per_image"] = info["source_bytes_per_image"]
        if disk.get(name):
            row["disk_read_bytes_per_image"] = statistics.median(b / n for b, n in disk[name])
        row["backend"], row["backend_reason"] = info.get("backend", {}).get(name, [None, None])
        row["dali_importable"] = info.get("dali_importable", {}).get(name)
        row.update(info.get("feeds", {}).get(name, {}))
        for key, pct in (("cpu_main_cores", "host/cpu_main_pct"), ("cpu_loader_cores", "host/cpu_workers_pct")):
            vals = [r[pct] / 100 for r in row["repeats"] if r.get(pct) is not None]
            row[key] = statistics.median(vals) if vals else None
    for row in table if args.loader_batches else ():
        if row["name"] == CEILING or row.get("error"):
            continue
        try:
            row["loader_alone_per_sec"], row["loader_alone_cpu_cores"] = loader_alone(row["name"], args, info)
        except Exception as err:
            row["loader_alone_error"] = f"{type(err).__name__}: {err}"
            print(f"  loader alone {row['name']}: {type(err).__name__}: {err}", file=sys.stderr)
        write_results(args.out + ".partial", table, **out)
    return table


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = list(args.only or DEFAULT_ROWS)
    info = prepare(args, rows)
    out: dict[str, Any] = {"source_bytes_per_image": info["source_bytes_per_image"], "images": info["images"],
                           "cpus": available_cpus()}
    if cold := [info[STORE_OF[r][0]] for r in rows if r in STORE_OF and STORE_OF[r][1]]:  # the disk, beside
        out["disk_read_gbps_o_direct"] = disk_read_gbps(cold[0], 2 << 30)  # the cold rows: 2 GiB, O_DIRECT
    table: list[dict[str, Any]] = []
    training = [r for r in rows if r.partition(":")[0] in TRAINING]
    has_dali = dali_installed()
    if skipped := [r for r in training if (r == "ours_folder_dali" and not has_dali)
                   or (r.partition(":")[0] in DECODER_ROWS and not (has_dali and args.device == "cuda"))]:
        training = [r for r in training if r not in skipped]
        print(f"  {', '.join(skipped)}: skipped (they need DALI, the DALI decoder rows a CUDA GPU)", file=sys.stderr)
    if training:
        table = train_rows(args, info, training, out)
    for name in (r for r in rows if r in ALONE):
        try:
            rates = [r for r in (alone_rate(name, args, info) for _ in range(args.repeats)) if r is not None]
            table.append({"name": name, "error": "no figure"} if not rates else {
                "name": name, "samples_per_sec": statistics.median(rates), "samples_per_sec_min": min(rates),
                "samples_per_sec_max": max(rates), "repeats": [{"samples_per_sec": v} for v in rates]})
        except Exception as err:
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
    add_feed(p, "gpuopt_jpeg", "", ROWS, "torchvision_v2's workers")
    p.add_argument("--evict-every", type=float, default=0.25, help="seconds between evictions of a cold store")
    args = feed_args(p, argv, ROWS, DECODER_ROWS)
    if not args.out:  # benchmarks/results/jpeg_<gpu>.json (a --quick run: the temp folder)
        folder = Path(tempfile.gettempdir()) if args.quick else Path(__file__).resolve().parent / "results"
        args.out = str(folder / f"jpeg_{'quick' if args.quick else machine_tag()}.json")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    out = run(args)
    write_results(args.out, out["rows"], **{k: v for k, v in out.items() if k != "rows"},
                  settings={k: v for k, v in vars(args).items()}, quick=args.quick,
                  seconds=time.perf_counter() - t0)
    images = out["images"]
    print(f"{images['count']} images, widths {images['width_min']}-{images['width_max']} px, "
          f"{images['grayscale']} grey, {images['cmyk']} CMYK, {out['source_bytes_per_image']:,.0f} JPEG bytes an "
          f"image, {out['cpus']} CPUs")
    print(format_rows(out["rows"], "of compiled ceiling median (worst)"))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
