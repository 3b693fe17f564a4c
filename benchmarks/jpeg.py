"""JPEGs at full speed: a JPEG folder and the compact JPEG store against the compiled plain loop and
torchvision v2, without DALI and with it.

The same generated ImageNet-like JPEGs (``make_jpeg_folder``: widths 200 to 1,000 px, aspect ratios 0.5 to 2,
about 2 % grey and 2 % CMYK; the file's ``images`` says what was generated) feed one ``UserClassifier``
(torchvision's ResNet-50, its own SGD) through ``Trainer(**fast_trainer_kwargs(model, compile=True,
max_epochs=-1))``; rows and the compiled plain loop take turns ``--repeats`` times, each repetition one fit
timed by a CUDA event at every batch end after ``--warmup`` steps (``peers.py``'s measurement). Rows (the
default run: the first four):

    ours_folder          OptimizedDataModule("train/") with ``nvidia.dali`` unimportable in this process while
                         the row runs (``dali_hidden``), as the README's install has it: the training process
                         decodes (nvJPEG or CPU threads, measured at setup)
    ours_jpeg_store      OptimizedDataModule("train_256_jpeg.h5") (``convert --format jpeg``), DALI unimportable
    ours_folder_dali     OptimizedDataModule("train/") with DALI importable: ``backend="auto"`` takes DALI
    torchvision_v2       peers.py's torchvision row (``decode_jpeg`` + ``transforms.v2`` on uint8, workers)
    ours_folder_threads, ours_folder_nvjpeg   the folder with ``DecodeOptions(decoder="cpu")`` or ``"gpu"``
    ours_jpeg_store_dali the JPEG store with DALI importable
    decode_limit         no model: the same files decoded to RGB by one process a CPU (PIL), the host's limit

Each training row records ``decoder`` (what decoded it) and ``decoder_reason``, the CPU cores used while it
trained (``cpu_main_cores``, ``cpu_loader_cores``) and, after the turns, its loader alone onto the GPU
(``loader_alone_per_sec``, past ``--warmup`` batches) with the cores the process and its workers used
meanwhile (``loader_alone_cpu_cores``). DALI's decoders and the folder's worker processes alone: ``feeds.py``;
stores from a cold page cache: ``stores.py``.

    python3 benchmarks/jpeg.py --loader-batches 10       # the default rows on one GPU host: about 7 minutes
    python3 benchmarks/jpeg.py --quick                   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from _shared import (
    add_feed,
    feed_args,
    format_rows,
    free,
    hdf5_store,
    loader_rate,
    measured_fit,
    say,
    take_turns,
)
from _zoo import UserClassifier, compiled_ceiling, measure_ceiling
from peers import feed_torchvision_v2, files_of, folder_bytes

from lightning_gpuopt import DecodeOptions
from lightning_gpuopt._common import available_cpus
from lightning_gpuopt.bench.measure import cpu_seconds, write_results
from lightning_gpuopt.bench.steady import summarize
from lightning_gpuopt.bench.synthetic import make_jpeg_folder
from lightning_gpuopt.data.backends import dali_installed

#: rows read with DALI unimportable (``dali_hidden``), and the ``DecodeOptions`` each asks for
NO_DALI = {"ours_folder": None, "ours_jpeg_store": None, "ours_folder_threads": DecodeOptions(decoder="cpu"),
           "ours_folder_nvjpeg": DecodeOptions(decoder="gpu")}
DALI_ROWS = ("ours_folder_dali", "ours_jpeg_store_dali")
TRAINING = (*NO_DALI, *DALI_ROWS, "torchvision_v2")
ROWS = (*TRAINING, "decode_limit")
DEFAULT_ROWS = ("ours_folder", "ours_jpeg_store", "ours_folder_dali", "torchvision_v2")
CEILING = "ceiling_compiled"


@contextlib.contextmanager
def dali_hidden() -> Iterator[None]:
    """While inside, ``import nvidia.dali`` fails in this process (its ``sys.modules`` entry is ``None``), as on
    a machine without DALI; the module, where it was imported, is put back afterwards."""
    saved = sys.modules.get("nvidia.dali")
    sys.modules["nvidia.dali"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        del sys.modules["nvidia.dali"]
        if saved is not None:
            sys.modules["nvidia.dali"] = saved


def describe_images(paths: list[Path]) -> dict[str, Any]:
    """What the JPEGs at ``paths`` are, from their frame headers: ``count`` (files), ``jpeg`` (readable headers),
    ``width_``/``height_``/``aspect_min`` and ``_max``, ``grayscale``, ``cmyk`` and ``progressive``."""
    from lightning_gpuopt.data.decode import jpeg_info

    infos = []
    for path in paths:
        with open(path, "rb") as fh:
            infos.append(jpeg_info(fh.read(1 << 16)))
    ok = [i for i in infos if i is not None]
    sides = {"width": [i.width for i in ok], "height": [i.height for i in ok], "aspect": [i.width / i.height for i in ok]}
    out: dict[str, Any] = {"count": len(infos), "jpeg": len(ok)}
    for key, values in sides.items():
        out.update({f"{key}_min": min(values, default=None), f"{key}_max": max(values, default=None)})
    return {**out, "grayscale": sum(i.components == 1 for i in ok), "cmyk": sum(i.components == 4 for i in ok),
            "progressive": sum(not i.baseline for i in ok)}


def prepare(args: argparse.Namespace, rows: list[str]) -> dict[str, Any]:
    """The JPEG folder, and the JPEG store where a row reads it; what the images are."""
    root = Path(args.data)
    size: Any = (96, 72) if args.quick else "imagenet"
    jpegs = make_jpeg_folder(root / "train", num_images=args.images, num_classes=10, image_size=size)
    files = files_of(jpegs)
    info: dict[str, Any] = {"train": jpegs, "files": files, "images": describe_images([p for p, _ in files]),
                            "source_bytes_per_image": folder_bytes(jpegs) / len(files)}
    if any("jpeg_store" in r for r in rows):
        info["store"] = root / f"train_{args.storage}_jpeg.h5"
        info["store_convert_seconds"] = hdf5_store(jpegs, info["store"], args.storage, format="jpeg").get("seconds")
        info["store_bytes_per_image"] = info["store"].stat().st_size / len(files)
    return info


def make_feed(name: str, args: argparse.Namespace, info: dict[str, Any]) -> dict[str, Any]:
    """The fit arguments of training row ``name`` (``datamodule=`` or ``train_dataloaders=``)."""
    if name == "torchvision_v2":
        return feed_torchvision_v2(args, info)
    from lightning_gpuopt import OptimizedDataModule

    kw: dict[str, Any] = {}
    if (options := NO_DALI.get(name)) is not None or (args.quick and name in NO_DALI):
        kw["decode"] = options or DecodeOptions()  # a CPU run: the decoding a CUDA machine without DALI does
    elif args.quick and name in DALI_ROWS:
        kw["backend"] = "dali"  # DALI's CPU pipeline, as "auto" takes DALI on a CUDA machine
    path = info["store"] if "jpeg_store" in name else info["train"]
    return {"datamodule": OptimizedDataModule(str(path), batch_size=args.batch_size, image_size=args.image_size,
                                              num_workers="auto", **kw)}


def describe_feed(loader: Any, dm: Any) -> dict[str, Any]:
    """``decoder`` (what decodes the JPEGs), ``decoder_reason`` and the measured rates behind a choice."""
    feed = getattr(loader, "feed_info", None)
    choice = getattr(getattr(dm, "_backend", None), "choice", None)
    out: dict[str, Any] = {"decoder_reason": getattr(feed, "decoder_reason", None)}
    if choice is not None:
        out.update(decoder_reason=choice.reason, decoder_measured=choice.measured, decode_cpu_rate=choice.cpu_rate,
                   decode_gpu_rate=choice.gpu_rate)
    n = getattr(feed, "threads", None) or getattr(loader, "num_workers", 0)
    dali = getattr(feed, "backend", None) == "dali"
    out["decoder"] = (f"torchvision decode_image, {n} worker processes" if feed is None
                      else ("DALI nvJPEG" if dali else f"torchvision nvJPEG, {n} reading threads")
                      if feed.decoder == "gpu" else f"{'DALI ' if dali else ''}CPU, {n} threads"
                      if feed.threads else f"CPU, {n} worker processes")  # fmt: skip
    return out


class FeedRecorder(pl.Callback):
    """Keeps ``describe_feed`` of the fit's training loader."""

    seen: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen = describe_feed(trainer.train_dataloader, trainer.datamodule)


def _hidden(name: str) -> Any:
    return dali_hidden() if name in NO_DALI else contextlib.nullcontext()


def training_variant(name: str, model: Any, args: argparse.Namespace, info: dict[str, Any]) -> Callable[[], Any]:
    def go() -> Any:
        with _hidden(name):
            feed, recorder = make_feed(name, args, info), FeedRecorder()
            if (dm := feed.get("datamodule")) is not None:
                info.setdefault("backend", {})[name] = [dm.backend, dm.backend_reason]
            info.setdefault("dali_importable", {})[name] = dali_installed()
            try:
                m = measured_fit(model, args.warmup, args.steps, device=args.device, callbacks=[recorder],
                                 compile=args.device == "cuda", settle=True, **feed)
                info.setdefault("feeds", {})[name] = recorder.seen
                return m
            finally:
                del feed
                free()

    return go


def loader_alone(name: str, args: argparse.Namespace, info: dict[str, Any]) -> tuple[float, float]:
    """Images a second training row ``name``'s loader delivers onto the device with no model, past ``--warmup``
    batches, and the CPU cores its process and workers used meanwhile."""
    with _hidden(name):
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


def train_rows(args: argparse.Namespace, info: dict[str, Any], training: list[str], out: dict[str, Any]
               ) -> list[dict[str, Any]]:  # fmt: skip
    """The training rows and the ceiling taking turns, then each row's loader alone."""
    model = UserClassifier(args.arch, num_classes=10)
    ceiling, out["ceiling_compile_seconds"] = compiled_ceiling(args.arch, args.batch_size, args.image_size, 10,
                                                               args.device)  # fmt: skip
    variants = {CEILING: lambda: measure_ceiling(ceiling, 10, args.steps),
                **{r: training_variant(r, model, args, info) for r in training}}
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
        if name != CEILING:
            store = "jpeg_store" in name
            row["bytes_per_image"] = info["store_bytes_per_image" if store else "source_bytes_per_image"]
            row["backend"], row["backend_reason"] = info.get("backend", {}).get(name, [None, None])
            row["dali_importable"] = info.get("dali_importable", {}).get(name)
            row.update(info.get("feeds", {}).get(name, {}))
        for key, pct in (("cpu_main_cores", "host/cpu_main_pct"), ("cpu_loader_cores", "host/cpu_workers_pct")):
            vals = [r[pct] / 100 for r in row["repeats"] if r.get(pct) is not None]
            row[key] = statistics.median(vals) if vals else None
    for row in (r for r in table if args.loader_batches and r["name"] != CEILING and not r.get("error")):
        try:
            row["loader_alone_per_sec"], row["loader_alone_cpu_cores"] = loader_alone(row["name"], args, info)
        except Exception as err:  # the row's training figures stand; say why this one is missing
            row["loader_alone_error"] = f"{type(err).__name__}: {err}"
            print(f"  loader alone {row['name']}: {type(err).__name__}: {err}", file=sys.stderr)
        write_results(args.out + ".partial", table, **out)
    return table


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = list(args.only or DEFAULT_ROWS)
    info = prepare(args, rows)
    out: dict[str, Any] = {"images": info["images"], "source_bytes_per_image": info["source_bytes_per_image"],
                           "store_convert_seconds": info.get("store_convert_seconds"), "cpus": available_cpus()}
    training = [r for r in rows if r in TRAINING]
    if skipped := [r for r in training if r in DALI_ROWS and not dali_installed()]:
        training = [r for r in training if r not in skipped]
        print(f"  {', '.join(skipped)}: skipped (DALI is not installed)", file=sys.stderr)
    table = train_rows(args, info, training, out) if training else []
    if "decode_limit" in rows:
        rates = [decode_limit([p for p, _ in info["files"]], available_cpus()) for _ in range(args.repeats)]
        table.append({"name": "decode_limit", "samples_per_sec": statistics.median(rates),
                      "samples_per_sec_min": min(rates), "samples_per_sec_max": max(rates),
                      "repeats": [{"samples_per_sec": v} for v in rates]})
    out["rows"] = table
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_feed(p, "gpuopt_jpeg", "jpeg", ROWS, "torchvision_v2's workers")
    return feed_args(p, argv, ROWS)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    out = run(args)
    write_results(args.out, out["rows"], **{k: v for k, v in out.items() if k != "rows"},
                  settings={k: v for k, v in vars(args).items()}, quick=args.quick, seconds=time.perf_counter() - t0)
    images = out["images"]
    print(f"{images['count']} images, widths {images['width_min']}-{images['width_max']} px, {images['grayscale']} "
          f"grey, {images['cmyk']} CMYK, {out['source_bytes_per_image']:,.0f} bytes an image, {out['cpus']} CPUs")
    print(format_rows(out["rows"], "of compiled ceiling median (worst)"))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
