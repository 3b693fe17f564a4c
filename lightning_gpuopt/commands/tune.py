"""``lightning-gpuopt tune PATH``: the ``num_workers`` that ``OptimizedDataModule(num_workers="auto")`` uses.

The command asks what the DataModule asks, through the same functions of ``lightning_gpuopt.data.tuning``:
a ``BatchReader`` (an image folder or a JPEG store, read by worker processes a whole batch each; a raw
HDF5 store, read by threads of the training process) gets its readers without measuring
(``unmeasured_workers``); other data is
measured with ``tune_num_workers(**auto_tuning_arguments(...))``, the DataModule's loaders, candidates,
budget rule and cache entry, so on the same data and machine both give the same count (the second one
reads it from the cache). ``--candidates`` measures the counts given instead (for a ``BatchReader`` its own
readers: worker processes reading whole batches, or reading threads). Pinning follows
``torch.cuda.is_available()``, as a fit on a GPU pins.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from lightning_gpuopt._checks import check_arg

HELP = "the num_workers that OptimizedDataModule(num_workers='auto') uses for a folder or store"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="class-per-subfolder image folder (or a .h5/.hdf5 file)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=256,
        help="training batch size (measured in batches of at most 64; default 256)",
    )
    parser.add_argument("--budget", type=float, default=30.0, help="seconds to spend measuring (default 30)")
    parser.add_argument(
        "--size",
        type=int,
        default=256,
        help="storage size of an image folder: each image is decoded whole, its shorter side resized to "
        "this many pixels, as convert stores it (default 256; ignored for an HDF5 store)",
    )
    parser.add_argument(
        "--candidates",
        default=None,
        help="comma-separated worker counts (default 1,2,4,6,8,12,... up to the CPUs)",
    )
    parser.add_argument(
        "--target",
        type=float,
        default=None,
        help="what the model consumes (samples/s); stop once the loader delivers twice that (headroom)",
    )
    parser.add_argument(
        "--tolerance", type=float, default=0.05, help="pick the smallest count within this of the best"
    )
    parser.add_argument(
        "--on-corrupt",
        choices=("raise", "skip"),
        default="raise",
        help="stop at an unreadable image (raise) or measure without it (skip); image folders only",
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=1,
        help="training processes on this machine (the GPUs of a DDP run); they share its CPUs (default 1)",
    )
    parser.add_argument("--no-cache", action="store_true", help="measure even if a cached result exists")
    parser.add_argument(
        "--json", default=None, help="also write the result as JSON to this file (checked before measuring)"
    )


def check_args(args: argparse.Namespace) -> list[int] | None:
    """Refuse a missing path or a bad value before anything heavy is imported or measured; returns the
    parsed ``--candidates`` (``None``: the default)."""
    path = Path(args.path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r} does not exist; pass an image folder or an HDF5 file")
    check_arg(args.batch_size >= 1, "--batch-size", args.batch_size, "a positive number of samples")
    check_arg(args.devices >= 1, "--devices", args.devices, "a positive number of training processes")
    check_arg(math.isfinite(args.budget) and args.budget > 0, "--budget", args.budget, "> 0 seconds")
    check_arg(
        args.size >= 1, "--size", args.size, "a positive number of pixels", fix="e.g. 256 for 224 crops"
    )
    check_arg(
        math.isfinite(args.tolerance) and 0 <= args.tolerance < 1,
        "--tolerance",
        args.tolerance,
        "a fraction in [0, 1) such as 0.05",
    )
    check_arg(
        args.target is None or (math.isfinite(args.target) and args.target > 0),
        "--target",
        args.target,
        "> 0 samples/s",
        fix="leave it out to find the fastest count",
    )
    if not args.candidates:
        return None
    counts = [_int_or_none(c) for c in args.candidates.split(",") if c.strip()]
    check_arg(
        bool(counts) and None not in counts and min(c for c in counts if c is not None) >= 0,
        "--candidates",
        args.candidates,
        "comma-separated worker counts >= 0 such as 0,2,4",
    )
    return [int(c) for c in counts if c is not None]


def _say(message: str) -> None:
    print(f"  {message}", flush=True)  # beside the header and the table (stderr: errors only)


def run(args: argparse.Namespace) -> int:
    path = Path(args.path).expanduser()
    candidates = check_args(args)
    from lightning_gpuopt.bench.runs import check_writable_file

    # a result that cannot be saved is found out now, not after the measurement
    json_path = check_writable_file(args.json, "--json") if args.json else None
    from lightning_gpuopt.data.folder import UInt8ImageFolder
    from lightning_gpuopt.data.loader import BatchReader, reads_in_workers

    dataset: Any
    if path.is_file() and path.suffix.lower() in (".h5", ".hdf5"):
        from lightning_gpuopt.data.hdf5 import HDF5ImageDataset

        dataset = HDF5ImageDataset(str(path))
    else:
        dataset = UInt8ImageFolder(path, size=args.size, on_corrupt=args.on_corrupt)
    result = workers_for(dataset, args, candidates)
    if json_path is not None:
        json_path.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    if reads_in_workers(dataset):
        # a folder or a JPEG store under backend="auto" goes to DALI where it is installed on a CUDA machine
        named = ', backend="folder"' if isinstance(dataset, UInt8ImageFolder) else ', backend="hdf5"'
        print(
            f"suggestion: OptimizedDataModule(...{named}, num_workers={result.best})  (worker processes, a "
            f"batch each)  or  HostDataLoader(WholeBatches(dataset), num_workers={result.best}, "
            "collate_fn=UInt8Collate())"
        )
    elif isinstance(dataset, BatchReader):
        print(
            f"suggestion: OptimizedDataModule(..., num_workers={result.best})  (reading threads)  or  "
            f"HostDataLoader(..., read_threads={result.best})"
        )
    else:
        print(
            f"suggestion: OptimizedDataModule(..., num_workers={result.best})  or  "
            f"DataLoader(..., num_workers={result.best})"
        )
    return 0


def workers_for(dataset: Any, args: argparse.Namespace, candidates: list[int] | None = None) -> Any:
    """The ``TuningResult`` ``tune`` reports for ``dataset``: without ``candidates`` what
    ``OptimizedDataModule(num_workers="auto", batch_size=args.batch_size)`` resolves (``unmeasured_workers``,
    else ``tune_num_workers(**auto_tuning_arguments(...))``); with them, those counts measured (reading
    threads for a ``BatchReader``). Prints the header, a line as each count starts and the table."""
    import torch

    from lightning_gpuopt.data.datamodule import MIN_TUNE_BATCHES, READ_THREADS
    from lightning_gpuopt.data.loader import BatchReader, reads_in_workers
    from lightning_gpuopt.data.tuning import (
        MEASURE_BATCH_SIZE,
        TuningConfig,
        TuningResult,
        auto_tuning_arguments,
        tune_num_workers,
        unmeasured_workers,
    )

    whole = reads_in_workers(dataset)  # worker processes reading whole batches
    threads = isinstance(dataset, BatchReader) and not whole
    if candidates is None:
        fixed = unmeasured_workers(
            dataset,
            batch_size=args.batch_size,
            read_threads=READ_THREADS,
            min_batches=MIN_TUNE_BATCHES,
            local_world_size=args.devices,
        )
        if fixed is not None:
            unit = "reading threads" if threads else "worker processes" if whole else "workers"
            print(f"num_workers='auto' for {dataset!r}: {fixed[0]} {unit} ({fixed[1]})")
            return TuningResult(best=fixed[0], stop_reason=fixed[1])
    what = "reading threads (num_workers)" if threads else "num_workers"
    print(f"tuning {what} for {dataset!r}, batch size {args.batch_size}, budget {args.budget:g} s ...")
    arguments: dict[str, Any]
    if threads or whole:  # the counts given, as this reader's threads or whole-batch worker processes
        measure_bs = min(args.batch_size, MEASURE_BATCH_SIZE)
        arguments = {
            "loader": _reader_loaders(dataset, measure_bs, workers=whole),
            "budget_s": args.budget,
            "target_samples_per_sec": args.target,
            "cache_key": {"train_batch_size": args.batch_size, "reader": "workers" if whole else "threads"},
            "progress": _say,
        }
    else:
        arguments = auto_tuning_arguments(
            dataset,
            batch_size=args.batch_size,
            pin_memory=torch.cuda.is_available(),
            local_world_size=args.devices,
            tuning=TuningConfig(budget_s=args.budget, target_samples_per_sec=args.target),
            source="the folder",
            progress=_say,
        )
    if candidates is not None:
        arguments["candidates"] = candidates
    result = tune_num_workers(**arguments, tolerance=args.tolerance, cache=not args.no_cache)
    print(result.format_table())
    return result


def _int_or_none(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _reader_loaders(dataset: Any, batch_size: int, *, workers: bool) -> Any:
    """``n -> loader`` reading ``dataset`` (a ``BatchReader``) on ``n`` threads, or with ``workers`` in ``n``
    worker processes a whole batch each (0: in the loop)."""
    import torch
    from torch.utils.data import DataLoader

    from lightning_gpuopt.data.loader import PREFETCH_FACTOR, HostDataLoader, UInt8Collate, WholeBatches
    from lightning_gpuopt.data.tuning import endless_sampler

    pin = torch.cuda.is_available()

    def make(n: int) -> DataLoader:
        sampler = endless_sampler(dataset, batch_size)
        if workers:
            return HostDataLoader(
                WholeBatches(dataset), batch_size=batch_size, sampler=sampler, pin_memory=pin, num_workers=n,
                prefetch_factor=PREFETCH_FACTOR if n else None, collate_fn=UInt8Collate(),
            )  # fmt: skip
        if n == 0:
            return DataLoader(
                dataset, batch_size=batch_size, sampler=sampler, pin_memory=pin, collate_fn=UInt8Collate()
            )
        return HostDataLoader(dataset, batch_size=batch_size, sampler=sampler, pin_memory=pin, read_threads=n)

    return make
