"""The feeds a user would otherwise pick, side by side: the same images, the same compiled model and preset.

Every row trains one ``UserClassifier`` (torchvision's ResNet-50, its own SGD) through
``Trainer(**fast_trainer_kwargs(model, compile=True, max_epochs=-1))``; only the feed differs. The model is
compiled once, in the first fit, and every row reuses it. Rows and the compiled plain loop (the ceiling)
take turns, ``--repeats`` times; each repetition is one fit measured by ``StepClock``: ``--warmup`` steps
past the loader's prefetch, then ``--steps`` steps timed by a CUDA event at every batch end. A row's ratio is
taken against the ceiling of its own turn; the table shows the median repetition and the worst.

Feeds (each set up as its own docs recommend; ``--only`` picks some):
  ours_resident     one batch kept on the GPU (what the preset reaches with a free feed)
  ours_hdf5         ``OptimizedDataModule("train.h5", num_workers="auto")`` (``lightning-gpuopt convert --size 256``)
  ours_jpeg_store   the compact JPEG store (``convert --size 256 --format jpeg``), ``num_workers="auto"``
  ours_folder       ``OptimizedDataModule("train/", backend="folder")`` (worker processes)
  ours_folder_workers  the same folder through DataLoader worker processes (only with ``--only``)
  ours_dali         ``OptimizedDataModule("train/", backend="dali")`` (the default decoder; "auto" with DALI)
  torchvision_v2    ``ImageFolder`` + ``decode_jpeg`` + ``transforms.v2`` on uint8 tensors, normalized on the GPU
  torchvision_pil   the classic recipe: PIL, ``RandomResizedCrop``, ``ToTensor``, ``Normalize``
  litdata_jpeg      ``litdata.optimize`` of the JPEGs as they are, ``StreamingDataLoader``, v2 on uint8
  litdata_jpeg256   litdata's fast format: shorter side 256 (its serializer re-encodes it at quality 75)
  webdataset        tar shards of the JPEGs, ``WebDataset(resampled=True)`` + ``WebLoader``, v2 on uint8
  dali_native       DALI's own pipeline: ``fn.readers.file`` + ``fn.decoders.image_random_crop(device="mixed")``
                    + ``DALIGenericIterator``
FFCV is not a row: its only distribution is a source package whose build needs OpenCV and libjpeg-turbo
development files found by pkg-config, which a pip-only environment does not have (``--ffcv-sdist`` tries).

    python3 benchmarks/peers.py                    # every row: longer than 10 minutes on one H200
    python3 benchmarks/peers.py --only ours_hdf5,torchvision_v2 --out a.json   # some rows (the ceiling always runs)
    python3 benchmarks/peers.py merge a.json b.json --out merged.json          # runs of one machine, one file
    python3 benchmarks/peers.py --quick                                        # a CPU smoke run
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _shared import add_feed, feed_args, format_rows, free, hdf5_store, loader_rate, measured_fit, resident, say, take_turns
from _zoo import UserClassifier, compiled_ceiling, measure_ceiling

from lightning_gpuopt._common import available_cpus
from lightning_gpuopt.bench.measure import write_results
from lightning_gpuopt.bench.rows import DeviceBatches
from lightning_gpuopt.bench.steady import summarize
from lightning_gpuopt.bench.synthetic import make_jpeg_folder

ROWS = ("ours_resident", "ours_hdf5", "ours_jpeg_store", "ours_folder", "ours_dali", "torchvision_v2",
        "torchvision_pil", "litdata_jpeg", "litdata_jpeg256", "webdataset", "dali_native")
CEILING = "ceiling_compiled"


# ---------------------------------------------------------------------------------------------- the data
def files_of(root: Path) -> list[tuple[str, int]]:
    """``(path, label)`` of every image under the class-per-subfolder ``root``, labels by sorted class."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    return [(str(f), i) for i, c in enumerate(classes) for f in sorted((root / c).iterdir())]


def folder_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def _litdata_item(item: tuple[str, int], short: int | None) -> tuple[Any, int]:
    from PIL import Image

    path, label = item
    img = Image.open(path)
    if short is None:
        return img, label  # a JpegImageFile: litdata keeps its bytes as they are
    img = img.convert("RGB")
    scale = short / min(img.size)
    img = img.resize((round(img.width * scale), round(img.height * scale)), Image.BILINEAR)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    buf.seek(0)
    return Image.open(buf), label


def _litdata_jpeg(item: tuple[str, int]) -> tuple[Any, int]:
    return _litdata_item(item, None)


def _litdata_jpeg256(item: tuple[str, int]) -> tuple[Any, int]:
    return _litdata_item(item, 256)


def prepare(args: argparse.Namespace, rows: list[str]) -> dict[str, Any]:
    """Make the JPEGs and every store the rows read; return paths, bytes per image and conversion times."""
    root = Path(args.data)
    size = (96, 72) if args.quick else (500, 375)
    jpegs = make_jpeg_folder(root / "train", num_images=args.images, num_classes=10, image_size=size)
    files = files_of(jpegs)
    info: dict[str, Any] = {"train": jpegs, "files": files, "bytes": {}, "convert_s": {}}
    jpeg_bytes = folder_bytes(jpegs) / len(files)
    for name in ("ours_folder", "ours_folder_workers", "ours_dali", "torchvision_v2", "torchvision_pil",
                 "dali_native"):
        info["bytes"][name] = jpeg_bytes
    if "ours_hdf5" in rows:
        h5 = root / f"train_{args.storage}.h5"
        cost = hdf5_store(jpegs, h5, args.storage)
        info.update(h5=h5)
        info["bytes"]["ours_hdf5"] = h5.stat().st_size / len(files)
        info["convert_s"]["ours_hdf5"] = cost.get("seconds")
    if "ours_jpeg_store" in rows:
        compact = root / f"train_{args.storage}_jpeg.h5"
        cost = hdf5_store(jpegs, compact, args.storage, format="jpeg")
        info.update(h5jpeg=compact)
        info["bytes"]["ours_jpeg_store"] = compact.stat().st_size / len(files)
        info["convert_s"]["ours_jpeg_store"] = cost.get("seconds")
    for name, fn in (("litdata_jpeg", _litdata_jpeg), ("litdata_jpeg256", _litdata_jpeg256)):
        if name in rows:
            info[name] = _optional(info, name, lambda n=name, f=fn: _litdata_optimize(root / n, files, f))
    if "webdataset" in rows:
        info["webdataset"] = _optional(info, "webdataset", lambda: _wds_shards(root / "wds", files))
    return info


def _optional(info: dict[str, Any], name: str, make: Callable[[], Path]) -> Path | BaseException:
    t0 = time.perf_counter()
    try:
        out = make()
    except (ImportError, OSError, RuntimeError, ValueError) as err:
        return err
    info["convert_s"][name] = time.perf_counter() - t0
    info["bytes"][name] = folder_bytes(out) / len(info["files"])
    return out


def _litdata_optimize(out: Path, files: list[tuple[str, int]], fn: Callable[..., Any]) -> Path:
    import shutil

    from litdata import optimize

    shutil.rmtree(out, ignore_errors=True)
    # optimize() sets the whole process's start method (spawn by default): a user converts in a script of
    # its own, so the start method every later loader of this run forks with is put back
    previous = multiprocessing.get_start_method(allow_none=True)
    try:
        optimize(fn=fn, inputs=files, output_dir=str(out), chunk_bytes="64MB", num_workers=available_cpus())
    finally:
        multiprocessing.set_start_method(previous, force=True)
    return out


def _wds_shards(out: Path, files: list[tuple[str, int]], per_shard: int = 256) -> Path:
    import random
    import shutil

    import webdataset as wds

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    order = list(files)
    random.Random(0).shuffle(order)  # the documented way: shuffle once when writing the shards
    with wds.ShardWriter(str(out / "train-%05d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i, (path, label) in enumerate(order):
            sink.write({"__key__": f"{i:08d}", "jpg": Path(path).read_bytes(), "cls": label})
    return out


# --------------------------------------------------------------------------------------------- the feeds
def _v2_train(image_size: int) -> Any:
    from torchvision.transforms import v2

    return v2.Compose([v2.RandomResizedCrop(image_size, antialias=True), v2.RandomHorizontalFlip()])


def _loader(dataset: Any, args: argparse.Namespace, **kw: Any) -> torch.utils.data.DataLoader:
    workers = args.workers
    return torch.utils.data.DataLoader(
        dataset, batch_size=args.batch_size, num_workers=workers, pin_memory=True, drop_last=True,
        persistent_workers=workers > 0, prefetch_factor=2 if workers else None, **kw,
    )


def _rgb(x: torch.Tensor) -> torch.Tensor:
    return x.expand(3, -1, -1) if x.shape[0] == 1 else x[:3]


class _DecodeJpeg:
    """torchvision's tensor path: the file's bytes decoded by ``decode_jpeg`` to a uint8 tensor."""

    def __call__(self, path: str) -> torch.Tensor:
        from torchvision.io import ImageReadMode, decode_image, read_file

        return decode_image(read_file(path), mode=ImageReadMode.RGB)


def feed_torchvision_v2(args: argparse.Namespace, info: dict[str, Any]) -> dict[str, Any]:
    from torchvision.datasets import ImageFolder

    ds = ImageFolder(str(info["train"]), loader=_DecodeJpeg(), transform=_v2_train(args.image_size))
    return {"train_dataloaders": _loader(ds, args, shuffle=True)}


def feed_torchvision_pil(args: argparse.Namespace, info: dict[str, Any]) -> dict[str, Any]:
    from torchvision import transforms as T
    from torchvision.datasets import ImageFolder

    from lightning_gpuopt._common import IMAGENET_MEAN, IMAGENET_STD

    tf = T.Compose([T.RandomResizedCrop(args.image_size), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    return {"train_dataloaders": _loader(ImageFolder(str(info["train"]), transform=tf), args, shuffle=True)}


class _RgbTransform:
    """``transform(_rgb(x))``: a picklable map for WebDataset's workers."""

    def __init__(self, transform: Any) -> None:
        self.transform = transform

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.transform(_rgb(x))


def _litdata_feed(name: str) -> Callable[[argparse.Namespace, dict[str, Any]], dict[str, Any]]:
    def feed(args: argparse.Namespace, info: dict[str, Any]) -> dict[str, Any]:
        if isinstance(info.get(name), BaseException):
            raise info[name]
        from litdata import StreamingDataLoader, StreamingDataset

        transform = _v2_train(args.image_size)

        class Images(StreamingDataset):  # litdata's ImageNet benchmark, uint8 kept for the GPU
            def __getitem__(self, index: Any) -> tuple[torch.Tensor, int]:
                img, label = super().__getitem__(index)
                if not isinstance(img, torch.Tensor):
                    from torchvision.transforms.v2.functional import pil_to_tensor

                    img = pil_to_tensor(img.convert("RGB"))
                return transform(_rgb(img)), int(label)

        ds = Images(input_dir=str(info[name]), shuffle=True, drop_last=True)
        loader = StreamingDataLoader(ds, batch_size=args.batch_size, num_workers=args.workers,
                                     pin_memory=True, drop_last=True, persistent_workers=args.workers > 0)
        return {"train_dataloaders": loader}

    return feed


def feed_webdataset(args: argparse.Namespace, info: dict[str, Any]) -> dict[str, Any]:
    if isinstance(info.get("webdataset"), BaseException):
        raise info["webdataset"]
    import webdataset as wds

    urls = sorted(str(p) for p in Path(info["webdataset"]).glob("*.tar"))
    transform = _v2_train(args.image_size)
    ds = (
        wds.WebDataset(urls, resampled=True, shardshuffle=False, nodesplitter=wds.split_by_node)
        .shuffle(1000)
        .decode("torchrgb8")
        .to_tuple("jpg", "cls")
        .map_tuple(_RgbTransform(transform), int)
        .batched(args.batch_size, partial=False)
    )
    loader = wds.WebLoader(ds, batch_size=None, num_workers=args.workers, pin_memory=True,
                           persistent_workers=args.workers > 0, prefetch_factor=2 if args.workers else None)
    return {"train_dataloaders": loader.with_epoch(len(info["files"]) // args.batch_size)}


class _DaliBatches:
    """``DALIGenericIterator`` as a Lightning train loader: ``(images, labels)`` a batch, reset each epoch."""

    def __init__(self, pipe: Any, size: int) -> None:
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        self.it = DALIGenericIterator(pipe, ["data", "label"], reader_name="Reader",
                                      last_batch_policy=LastBatchPolicy.DROP, auto_reset=True)
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Any:
        for out in self.it:
            yield out[0]["data"], out[0]["label"].squeeze(-1).long()


def feed_dali_native(args: argparse.Namespace, info: dict[str, Any]) -> dict[str, Any]:
    from nvidia.dali import fn, pipeline_def, types

    from lightning_gpuopt._common import IMAGENET_MEAN, IMAGENET_STD

    gpu = args.device == "cuda"

    @pipeline_def(batch_size=args.batch_size, num_threads=available_cpus(), device_id=0 if gpu else None,
                  prefetch_queue_depth=2)
    def pipe() -> Any:  # DALI's documented ImageNet training pipeline
        jpegs, labels = fn.readers.file(file_root=str(info["train"]), random_shuffle=True, name="Reader")
        images = fn.decoders.image_random_crop(jpegs, device="mixed" if gpu else "cpu", output_type=types.RGB)
        images = fn.resize(images, resize_x=args.image_size, resize_y=args.image_size)
        images = fn.crop_mirror_normalize(
            images, dtype=types.FLOAT, output_layout="CHW", mirror=fn.random.coin_flip(),
            mean=[m * 255 for m in IMAGENET_MEAN], std=[s * 255 for s in IMAGENET_STD],
        )
        return images, labels.gpu() if gpu else labels

    return {"train_dataloaders": _DaliBatches(pipe(), len(info["files"]) // args.batch_size)}


def _datamodule(path_key: str, **kw: Any) -> Callable[[argparse.Namespace, dict[str, Any]], dict[str, Any]]:
    def feed(args: argparse.Namespace, info: dict[str, Any]) -> dict[str, Any]:
        from lightning_gpuopt import OptimizedDataModule

        return {"datamodule": OptimizedDataModule(str(info[path_key]), batch_size=args.batch_size,
                                                  image_size=args.image_size, **kw)}

    return feed


def feed_folder_workers(args: argparse.Namespace, info: dict[str, Any]) -> dict[str, Any]:
    """The folder through DataLoader worker processes (``num_workers="auto"``, measured), not threads."""
    from feeds import _per_image_module

    return {"datamodule": _per_image_module()(str(info["train"]), batch_size=args.batch_size,
                                               image_size=args.image_size, num_workers="auto")}


def feed_resident(args: argparse.Namespace, info: dict[str, Any]) -> dict[str, Any]:
    return {"train_dataloaders": resident(args.batch_size, args.image_size, args.device)}


FEEDS: dict[str, Callable[[argparse.Namespace, dict[str, Any]], dict[str, Any]]] = {
    "ours_resident": feed_resident,
    "ours_hdf5": _datamodule("h5", num_workers="auto"),
    "ours_jpeg_store": _datamodule("h5jpeg", num_workers="auto"),
    "ours_folder": _datamodule("train", backend="folder", num_workers="auto"),
    "ours_dali": _datamodule("train", backend="dali"),
    "ours_folder_workers": feed_folder_workers,  # not a default row: the folder's threads against workers
    "torchvision_v2": feed_torchvision_v2,
    "torchvision_pil": feed_torchvision_pil,
    "litdata_jpeg": _litdata_feed("litdata_jpeg"),
    "litdata_jpeg256": _litdata_feed("litdata_jpeg256"),
    "webdataset": feed_webdataset,
    "dali_native": feed_dali_native,
}


# ------------------------------------------------------------------------------------------------- the run
def loader_alone(feed: dict[str, Any], args: argparse.Namespace) -> float | None:
    """Images a second the feed's loader delivers onto the device with no model, past its prefetch."""
    loader, dm = feed.get("train_dataloaders"), feed.get("datamodule")
    if dm is not None:
        dm.setup("fit")
        loader = dm.train_dataloader()
    if loader is None or isinstance(loader, DeviceBatches):
        return None
    try:
        return loader_rate(loader, args.device, args.loader_batches, skip=args.warmup)
    finally:
        if dm is not None:
            dm.teardown("fit")


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = list(args.only or ROWS)
    info = prepare(args, rows)
    model = UserClassifier(args.arch, num_classes=10)
    ceiling, ceiling_compile_s = compiled_ceiling(args.arch, args.batch_size, args.image_size, 10, args.device)

    def variant(name: str) -> Callable[[], Any]:
        def go() -> Any:
            feed = FEEDS[name](args, info)
            # the first fit compiles the model, later ones find it compiled (or recompile for a new input
            # dtype): the warm-up waits for the step time to settle either way
            try:
                return measured_fit(model, args.warmup, args.steps, device=args.device,
                                    compile=args.device == "cuda", settle=True, **feed)
            finally:
                del feed
                free()  # the feed's workers, threads and pipelines end here, not during a later row

        return go

    variants = {CEILING: lambda: measure_ceiling(ceiling, 10, args.steps), **{r: variant(r) for r in rows}}
    done: dict[str, list[Any]] = {}

    def keep(name: str, turn: int, m: Any) -> None:
        say(name, turn, m)
        done.setdefault(name, []).append(m)  # what a run cut short still leaves behind
        write_results(args.out + ".partial", summarize(done, CEILING))

    results = take_turns(variants, args.repeats, on_result=keep)
    table = summarize(results, CEILING)
    alone = {}
    for r in rows if args.loader_batches else ():
        try:
            alone[r] = loader_alone(FEEDS[r](args, info), args)
        except Exception as err:  # noqa: BLE001 - the row's own error is already recorded
            alone[r] = None
            print(f"  loader alone {r}: {type(err).__name__}: {err}", file=sys.stderr)
    for row in table:
        name = row["name"]
        row["of_compiled_ceiling"] = row["ratio_to_ceiling"] = row["of_ceiling"]
        for rep in row["repeats"]:
            rep["of_compiled_ceiling"] = rep.get("of_ceiling")
        row["bytes_per_image"] = info["bytes"].get(name)
        row["convert_seconds"] = info["convert_s"].get(name)
        row["loader_alone_per_sec"] = alone.get(name)
        for key, pct in (("cpu_main_cores", "host/cpu_main_pct"), ("cpu_loader_cores", "host/cpu_workers_pct")):
            vals = [r[pct] / 100 for r in row["repeats"] if r.get(pct) is not None]
            row[key] = statistics.median(vals) if vals else None
        if isinstance(info.get(name), BaseException):
            row["error"] = f"{type(info[name]).__name__}: {info[name]}"
    return {"rows": table, "ceiling_compile_seconds": ceiling_compile_s, "images": len(info["files"])}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_feed(p, "gpuopt_peers", "peers", FEEDS, "peers' DataLoader workers")
    return feed_args(p, argv, FEEDS)


def merge(paths: list[str], out: str) -> Path:
    """One results file of several runs of this script (or ``jpeg.py``) on one machine: a row keeps the ratio to
    its own run's ceiling (``ceiling_run``), every ceiling is kept, each other top-level key from the first run
    that has it; a CPU loader's ``of_decode_limit`` is against whichever run measured ``decode_limit``."""
    import json

    docs = [json.loads(Path(p).read_text()) for p in paths]
    rows: list[dict[str, Any]] = []
    for i, doc in enumerate(docs):
        for row in doc["rows"]:
            if row["name"] == CEILING:
                row = {**row, "name": f"{CEILING}_run{i + 1}"}
            rows.append({**row, "ceiling_run": i + 1})
    runs = [{"command": d["command"], "date": d["date"], "seconds": d.get("seconds")} for d in docs]
    limit = next((r for r in rows if r["name"] == "decode_limit" and "samples_per_sec" in r), None)
    for row in rows:  # one machine: a loader of one run against the decode limit of another
        if limit and row["name"].startswith("loader_cpu") and "samples_per_sec" in row:
            row["of_decode_limit"] = row["samples_per_sec"] / limit["samples_per_sec"]
    keep = {k: v for d in reversed(docs) for k, v in d.items() if k not in ("rows", "command", "date", "seconds")}
    return write_results(out, rows, **{**keep, "command": " && ".join(r["command"] for r in runs),
                                       "runs": runs, "machine_runs": [d["machine"] for d in docs]})


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "merge":
        p = argparse.ArgumentParser(prog="peers.py merge", description=merge.__doc__)
        p.add_argument("paths", nargs="+")
        p.add_argument("--out", required=True)
        m = p.parse_args(sys.argv[2:])
        print(f"wrote {merge(m.paths, m.out)}")
        return 0
    args = parse_args(argv)
    t0 = time.perf_counter()
    doc = run(args)
    path = write_results(args.out, doc.pop("rows"), **doc, settings={k: v for k, v in vars(args).items()},
                         seconds=time.perf_counter() - t0)
    import json

    rows = json.loads(path.read_text())["rows"]
    print(format_rows(rows, "of compiled ceiling median (worst)"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
