"""Data feeds: which of the package's feeds, with which setting, keeps a user's model fed, and how much
headroom each feed has.

Every row fits one ``UserClassifier`` (torchvision's ResNet-50, its own SGD) through
``Trainer(**fast_trainer_kwargs(model, compile=...))`` on the same 8,192 generated 500x375 JPEGs; only the
feed differs. A feed is ``backend[:setting]``:

    resident        one uint8 batch kept on the GPU: the preset with a free feed
    hdf5[:N]        OptimizedDataModule("store.h5"): the uint8 store read by N threads (HDF5Options; default:
                    chosen from the cores)
    hdf5:inline     the same store with each batch copied and transformed by the training thread itself,
                    one step ahead, instead of by the loader's staging thread
    jpegstore[:N]   OptimizedDataModule("store_jpeg.h5"): the compact JPEG store (convert --format jpeg),
                    decoded by N worker processes (default "auto": one a CPU)
    folder[:N]      OptimizedDataModule("jpegs/"): decoded by N worker processes (default "auto": one a CPU)
    folder:workers  the same folder through DataLoader worker processes (num_workers="auto", measured)
    dali[:cpu|gpu]  OptimizedDataModule("jpegs/", backend="dali"): DALI decodes on its CPU threads or with
                    nvJPEG (default: the decoder its rule picks for the cores a GPU has)

The rows and the plain-loop ceiling (compiled where the model is) take turns ``--repeats`` times; each
repetition is one fit measured by ``StepClock`` after ``--warmup`` steps, past every loader's prefetch.
``loader_alone_per_sec`` is the feed's training loader iterated with no model: its headroom over the model.

    python3 benchmarks/feeds.py                               # one H200: about 9 minutes
    python3 benchmarks/feeds.py --feeds hdf5,hdf5:1,hdf5:8    # the store's reading threads
    python3 benchmarks/feeds.py --feeds resident,folder,folder:workers,jpegstore  # JPEGs: threads or workers
    python3 benchmarks/feeds.py --quick                       # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from _shared import (
    add_common,
    device_of,
    free,
    hdf5_store,
    loader_rate,
    measured_fit,
    report,
    resident,
    results_path,
    say,
    take_turns,
)
from _zoo import UserClassifier, compiled_ceiling, measure_ceiling
from torch.utils.data import Dataset

from lightning_gpuopt.bench.steady import Measurement
from lightning_gpuopt.bench.synthetic import make_jpeg_folder

BACKENDS = ("resident", "hdf5", "jpegstore", "folder", "dali")
DEFAULT_FEEDS = "resident,hdf5,hdf5:1,folder,dali,dali:cpu,dali:gpu"


def parse_feed(spec: str) -> tuple[str, int | str | None]:
    """``"hdf5:8"`` -> ``("hdf5", 8)``, ``"dali:cpu"`` -> ``("dali", "cpu")``, ``"folder"`` ->
    ``("folder", None)``."""
    backend, _, setting = spec.partition(":")
    if backend not in BACKENDS:
        raise ValueError(f"feed {spec!r}: the backend is one of {', '.join(BACKENDS)}")
    if not setting:
        return backend, None
    if backend == "dali" and setting in ("cpu", "gpu"):
        return backend, setting
    if backend in ("hdf5", "jpegstore", "folder") and setting.isdigit():
        return backend, int(setting)
    if backend == "hdf5" and setting == "inline":
        return backend, setting
    if backend == "folder" and setting == "workers":
        return backend, setting
    raise ValueError(
        f"feed {spec!r}: hdf5:N, jpegstore:N and folder:N take a count, hdf5:inline staging "
        "on the training thread, folder:workers DataLoader workers, dali:cpu|gpu a decoder"
    )


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """The JPEG folder and the uint8 store converted from it, made once under ``--data`` and reused."""
    root = Path(args.data)
    size = dict(num_images=64, num_classes=4, image_size=(64, 48)) if args.quick else dict(
        num_images=8192, num_classes=100)  # fmt: skip
    name = "quick_feeds_64" if args.quick else "imagenet_8192"
    t0 = time.perf_counter()
    jpegs = make_jpeg_folder(root / name, **size)  # type: ignore[arg-type]
    info: dict[str, Any] = {
        "folder": jpegs,
        "dali": jpegs,
        "jpeg_seconds": round(time.perf_counter() - t0, 1),
    }
    store = root / f"{name}_{args.storage}.h5"
    info["store"] = hdf5_store(jpegs, store, args.storage)
    info["hdf5"] = store
    if any(parse_feed(f)[0] == "jpegstore" for f in args.feeds.split(",") if f):
        compact = root / f"{name}_{args.storage}_jpeg.h5"
        info["jpeg_store"] = hdf5_store(jpegs, compact, args.storage, format="jpeg")
        info["jpegstore"] = compact
    return info


class _PerImage(Dataset):
    """An image folder seen through ``__getitem__`` only, so the DataModule feeds it through DataLoader
    worker processes (``folder:workers``) instead of reading threads."""

    def __init__(self, folder: Any) -> None:
        self.folder = folder

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, i: int) -> Any:
        return self.folder[i]

    def fingerprint(self) -> dict[str, Any]:
        return {**self.folder.fingerprint(), "class": type(self).__name__}


def _per_image_module() -> type:
    from lightning_gpuopt import OptimizedDataModule

    class PerImageDataModule(OptimizedDataModule):
        def _default_dataset(self, split: str) -> Any:
            folder = super()._default_dataset(split)
            return None if folder is None else _PerImage(folder)

    return PerImageDataModule


def feed(spec: str, args: argparse.Namespace, info: dict[str, Any]) -> dict[str, Any]:
    """What ``Trainer.fit`` takes for the feed: ``datamodule=`` or ``train_dataloaders=``."""
    from lightning_gpuopt import DALIOptions, HDF5Options, OptimizedDataModule

    backend, setting = parse_feed(spec)
    if backend == "resident":
        return {"train_dataloaders": resident(args.batch_size, args.image_size, args.device)}
    kwargs: dict[str, Any] = {
        "backend": backend,
        "batch_size": args.batch_size,
        "image_size": args.image_size,
    }
    if backend == "jpegstore":
        kwargs["backend"] = "hdf5"
    if backend == "dali":
        kwargs["dali"] = DALIOptions(decoder=setting) if setting else None
    elif setting == "inline":
        pass  # the store's own thread count; ``reading`` changes how it is staged
    elif setting == "workers":
        return {"datamodule": _per_image_module()(str(info[backend]), **kwargs)}
    elif setting is not None and backend == "hdf5":
        kwargs["hdf5"] = HDF5Options(threads=int(setting))  # the raw store's reading threads
    elif setting is not None:
        kwargs["num_workers"] = setting
    return {"datamodule": OptimizedDataModule(str(info[backend]), **kwargs)}


def _inline_staged(source: Iterator[Any], device: Any, transform: Callable[[Any], Any]) -> Iterator[Any]:
    """Staging on the training thread: each batch copied and transformed on a side stream one step ahead."""
    import torch

    from lightning_gpuopt.data.loader import StagedBatch, _record, _to_device

    side = torch.cuda.Stream(device)

    def stage(batch: Any) -> Any:
        with torch.cuda.stream(side):
            out = transform(_to_device(batch, device))
        return StagedBatch(out) if isinstance(out, (list, tuple)) else out

    ready = stage(next(source))
    while True:
        current = torch.cuda.current_stream(device)
        current.wait_stream(side)
        _record(ready, current)
        batch = ready
        try:
            ready = stage(next(source))
        except StopIteration:
            yield batch
            return
        yield batch


@contextlib.contextmanager
def reading(spec: str) -> Iterator[None]:
    """Inside, ``hdf5:inline`` stages batches on the training thread; other feeds are left as they are."""
    if parse_feed(spec) != ("hdf5", "inline"):
        yield
        return
    from lightning_gpuopt.data import loader

    staged = loader._staged
    loader._staged = _inline_staged  # type: ignore[assignment]
    try:
        yield
    finally:
        loader._staged = staged  # type: ignore[assignment]


def alone(spec: str, args: argparse.Namespace, info: dict[str, Any]) -> float | None:
    """The feed's training loader alone: images a second onto the device after ``--warmup`` batches (past
    what its workers prefetched); ``None`` for ``resident``."""
    dm = feed(spec, args, info).get("datamodule")
    if dm is None or not args.loader_batches:
        return None
    with reading(spec):
        dm.setup("fit")
        try:
            return loader_rate(dm.train_dataloader(), args.device, args.loader_batches, skip=args.warmup)
        finally:
            dm.teardown("fit")


def skip_reason(spec: str, device: str) -> str | None:
    """Why a feed cannot run here (DALI or h5py missing), else ``None``."""
    backend, setting = parse_feed(spec)
    dali = (
        importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.dali") is not None
    )
    if backend == "dali" and not dali:
        return "nvidia.dali is not installed (pip install 'lightning-gpuopt[dali]')"
    if backend == "dali" and setting == "gpu" and device != "cuda":
        return "nvJPEG needs a CUDA device"
    return None


def run(args: argparse.Namespace, feeds: list[str]) -> dict[str, Any]:
    """Every feed and the ceiling taking turns; rows with each feed's loader-alone rate."""
    info = prepare(args)
    model = UserClassifier(args.arch, num_classes=100)
    loop, compile_s = compiled_ceiling(args.arch, args.batch_size, args.image_size, 100, args.device,
                                       compile=args.compile)  # fmt: skip

    def variant(spec: str) -> Callable[[], Measurement]:
        def go() -> Measurement:
            with reading(spec):
                m = measured_fit(model, args.warmup, args.steps, device=args.device, compile=args.compile,
                                 **feed(spec, args, info))  # fmt: skip
            free()
            return m

        return go

    runnable = [f for f in feeds if skip_reason(f, args.device) is None]
    variants = {"ceiling": lambda: measure_ceiling(loop, 10, args.steps), **{f: variant(f) for f in runnable}}
    results = take_turns(variants, args.repeats, on_result=say)
    headroom = {f: {"loader_alone_per_sec": alone(f, args, info)} for f in runnable}
    skipped = {f: skip_reason(f, args.device) for f in feeds if f not in runnable}
    return {"results": results, "per_row": headroom, "skipped": skipped, "ceiling_compile_seconds": compile_s,
            "data": {k: str(v) if isinstance(v, Path) else v for k, v in info.items()}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common(p, warmup=40, steps=200)
    p.add_argument("--feeds", default=DEFAULT_FEEDS, help="comma-separated backend[:setting]")
    p.add_argument("--data", default="/tmp/gpuopt_data", help="where the JPEGs and the store are made")
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--storage", type=int, default=256, help="the store's shorter side")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the model and the ceiling (default: on CUDA)")  # fmt: skip
    p.add_argument(
        "--loader-batches", type=int, default=30, help="batches timed for a loader alone (0: skip)"
    )
    args = p.parse_args(argv)
    feeds = [f for f in args.feeds.split(",") if f]
    try:
        [parse_feed(f) for f in feeds]
    except ValueError as err:
        p.error(f"--feeds: {err}")
    args.device = device_of(args)
    args.compile = args.device == "cuda" if args.compile is None else args.compile
    if args.quick:
        args.arch, args.batch_size, args.image_size, args.storage = "small", 8, 32, 37
        args.warmup, args.steps, args.repeats, args.loader_batches = 2, 3, min(args.repeats, 2), 2
    t0 = time.perf_counter()
    out = run(args, feeds)
    results = out.pop("results")
    for name, why in out["skipped"].items():
        print(f"skipped {name}: {why}")
    table = report(results_path(args.out, "feeds", args.quick), results, "ceiling", quick=args.quick,
                   settings=vars(args), seconds=time.perf_counter() - t0, **out)  # fmt: skip
    return 0 if all(r["error"] is None for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
