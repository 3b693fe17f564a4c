"""``lightning-gpuopt tune PATH``: the counts ``OptimizedDataModule(num_workers="auto")`` uses, or with
``--candidates`` those counts measured (docs/worker_tuning.md)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from lightning_gpuopt._checks import check_arg

HELP = "the num_workers OptimizedDataModule(num_workers='auto') uses for a folder or store, or measure counts"

#: flags that shape a measurement, with their defaults: refused without ``--candidates`` (nothing measured)
MEASURING = {"budget": 30.0, "target": None, "tolerance": 0.05, "no_cache": False}
#: flags that only an image folder reads, with their defaults: refused for a store file
FOLDER_ONLY = {"size": 256, "on_corrupt": "raise"}


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("path", help="class-per-subfolder image folder (or a .h5/.hdf5 file)")
    add("--batch-size", type=int, default=256, help="training batch size (measured in batches of at most 64)")
    add(
        "--candidates",
        help="comma-separated counts to measure, e.g. 0,1,2,4: worker processes for a folder or a JPEG store, "
        "reading threads for a raw store (0: read in the training loop); without it nothing is measured",
    )
    add("--budget", type=float, help="seconds to spend measuring (default 30; with --candidates)")
    add("--target", type=float, help="the model's samples/s: stop once the loader delivers twice that")
    add("--tolerance", type=float, help="pick the smallest count within this of the best (default 0.05)")
    add("--no-cache", action="store_true", help="measure even if a cached result exists (with --candidates)")
    add(
        "--size",
        type=int,
        help="storage size of an image folder: each image is decoded whole, its shorter side resized to "
        "this many pixels, as convert stores it (default 256; image folders only)",
    )
    add("--on-corrupt", choices=("raise", "skip"), help="stop at an unreadable image (raise) or skip it")
    add("--devices", type=int, default=1, help="training processes on this machine, sharing its CPUs")
    add("--json", help="also write the result as JSON to this file (checked before measuring)")


def check_args(args: argparse.Namespace) -> list[int] | None:
    """Refuse bad input before heavy imports, fill in defaults; the ``--candidates`` (None: not measured)."""
    path = Path(args.path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r} does not exist; pass an image folder or an HDF5 file")
    check_arg(args.batch_size >= 1, "--batch-size", args.batch_size, "a positive number of samples")
    check_arg(args.devices >= 1, "--devices", args.devices, "a positive number of training processes")
    candidates = _parse_candidates(args.candidates)
    _refuse_unused(args, store=_is_store(path), measuring=candidates is not None)
    for name, default in {**MEASURING, **FOLDER_ONLY}.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    check_arg(math.isfinite(args.budget) and args.budget > 0, "--budget", args.budget, "> 0 seconds")
    check_arg(args.size >= 1, "--size", args.size, "a positive number of pixels", "e.g. 256 for 224 crops")
    ok = math.isfinite(args.tolerance) and 0 <= args.tolerance < 1
    check_arg(ok, "--tolerance", args.tolerance, "a fraction in [0, 1) such as 0.05")
    ok = args.target is None or (math.isfinite(args.target) and args.target > 0)
    check_arg(ok, "--target", args.target, "> 0 samples/s", "leave it out to find the fastest count")
    return candidates


def _parse_candidates(text: str | None) -> list[int] | None:
    if not text:
        return None
    counts = [c.strip() for c in text.split(",") if c.strip()]
    ok = bool(counts) and all(c.isdigit() for c in counts)
    check_arg(ok, "--candidates", text, "comma-separated counts >= 0 such as 0,2,4")
    return [int(c) for c in counts]


def _refuse_unused(args: argparse.Namespace, *, store: bool, measuring: bool) -> None:
    """A flag this run would ignore is an error naming why."""
    for name in MEASURING:
        value = getattr(args, name)
        must = "given only with --candidates: without it nothing is measured (num_workers='auto' chooses the "
        must += "count from the cores for an image folder or a store)"
        fix = "add --candidates 0,1,2 to measure those counts, or leave the flag out"
        check_arg(measuring or value is None or value is False, _flag(name), value, must, fix)
    for name in FOLDER_ONLY:
        value = getattr(args, name)
        must = (
            "given only for an image folder: a store file keeps its own size and holds no unreadable images"
        )
        check_arg(not store or value is None, _flag(name), value, must, "leave it out")
    must = "left out with --candidates: the counts measured are the ones listed (--devices divides the cores "
    must += "for the chosen count)"
    fix = "leave --devices out, or drop --candidates to see the count chosen for that many processes"
    check_arg(not measuring or args.devices == 1, "--devices", args.devices, must, fix)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_store(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in (".h5", ".hdf5")


def run(args: argparse.Namespace) -> int:
    path = Path(args.path).expanduser()
    candidates = check_args(args)
    from lightning_gpuopt.bench.runs import check_writable_file

    # a result that cannot be saved is found out now, not after the measurement
    json_path = check_writable_file(args.json, "--json") if args.json else None
    if _is_store(path):
        from lightning_gpuopt.data.hdf5 import HDF5ImageDataset

        dataset: Any = HDF5ImageDataset(str(path))
    else:
        from lightning_gpuopt.data.folder import UInt8ImageFolder

        dataset = UInt8ImageFolder(path, size=args.size, on_corrupt=args.on_corrupt)
    result = chosen(dataset, args) if candidates is None else measured(dataset, args, candidates)
    if json_path is not None:
        json_path.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    print(suggestion(dataset, result.best, measured=candidates is not None))
    return 0


def chosen(dataset: Any, args: argparse.Namespace) -> Any:
    """The ``TuningResult`` of what ``num_workers="auto"`` chooses for ``dataset``, printed with how."""
    from lightning_gpuopt._common import available_cpus
    from lightning_gpuopt.data.datamodule import MIN_TUNE_BATCHES
    from lightning_gpuopt.data.loader import read_by_threads
    from lightning_gpuopt.data.tuning import TuningResult, unmeasured_workers

    fixed = unmeasured_workers(
        dataset, batch_size=args.batch_size, min_batches=MIN_TUNE_BATCHES, local_world_size=args.devices
    )
    if fixed is None:  # a dataset tune does not build (the DataModule measures such data)
        raise ValueError(f"{dataset!r} is neither an image folder nor a store; pass one of those")
    print(f"num_workers='auto' for {dataset!r}: {fixed[0]} worker processes ({fixed[1]})")
    if read_by_threads(dataset):
        from lightning_gpuopt.data.hdf5 import HDF5Options

        threads, how = HDF5Options().resolved_threads(cpus=max(1, available_cpus() // args.devices))
        print(f"reading threads for {dataset!r}: {threads} ({how}; HDF5Options(threads=...) sets them)")
    return TuningResult(best=fixed[0], stop_reason=fixed[1])


def measured(dataset: Any, args: argparse.Namespace, candidates: list[int]) -> Any:
    """The ``TuningResult`` of ``candidates`` measured on ``dataset`` (worker processes or reading threads)."""
    import torch

    from lightning_gpuopt.data.loader import UInt8Collate, read_by_threads
    from lightning_gpuopt.data.tuning import _measure_workers

    threads = read_by_threads(dataset)
    what = "reading threads" if threads else "worker processes (num_workers)"
    print(f"measuring {what} for {dataset!r}, batch size {args.batch_size}, budget {args.budget:g} s ...")
    result = _measure_workers(
        dataset,
        args.batch_size,
        loader_kwargs=dict(threads=threads, pin_memory=torch.cuda.is_available(), collate_fn=UInt8Collate()),
        candidates=candidates,
        budget_s=args.budget,
        target_samples_per_sec=args.target,
        tolerance=args.tolerance,
        cache=not args.no_cache,
        cache_key={"reader": "threads" if threads else "workers"},
        progress=lambda line: print(f"  {line}", flush=True),  # stdout, beside the table
    )
    print(result.format_table())
    return result


def suggestion(dataset: Any, best: int, *, measured: bool) -> str:
    """The line ``tune`` ends with: the DataModule arguments (and the loader) that use ``best``."""
    from lightning_gpuopt.data.folder import UInt8ImageFolder
    from lightning_gpuopt.data.loader import read_by_threads

    how = "measured" if measured else "chosen, not measured"
    if read_by_threads(dataset):
        if not measured:
            return 'suggestion: OptimizedDataModule(..., num_workers="auto")  (no worker processes; threads chosen)'
        return (
            f"suggestion: OptimizedDataModule(..., hdf5=HDF5Options(threads={best}))  (reading threads, "
            f"{how})  or  HostDataLoader(..., read_threads={best})"
        )
    # a folder or a JPEG store under backend="auto" goes to DALI where it is installed on a CUDA machine
    named = 'backend="folder"' if isinstance(dataset, UInt8ImageFolder) else 'backend="hdf5"'
    return (
        f"suggestion: OptimizedDataModule(..., {named}, num_workers={best})  (worker processes, a batch "
        f"each, {how})  or  HostDataLoader(WholeBatches(dataset), num_workers={best}, collate_fn=UInt8Collate())"
    )
