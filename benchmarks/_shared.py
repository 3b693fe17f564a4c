"""The measuring harness every benchmark script shares, on top of ``lightning_gpuopt.bench.steady``.

A fit is measured as a user would read a long run (``measured_fit``): the user's module, ``StepClock``'s
warm-up past the compile and the loader's prefetch, then a window timed by a CUDA event at every batch end.
Variants take turns (``take_turns``) and ``report`` reduces each to its median repetition, the worst, the
ratio to a ceiling of the same turn and p50/p90 step times, writes one JSON file (``write_results``) and
prints the table last. Also here: a uint8 HDF5 store in the current format, resident batches, a loader
timed alone, and where results go (``results_path``). The user's module itself is ``_zoo.UserClassifier``.

The scripts import it from their own folder (``python benchmarks/<script>.py`` puts that folder first on
``sys.path``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import os
import re
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_gpuopt._checks import check_int
from lightning_gpuopt._common import available_cpus, format_table
from lightning_gpuopt.bench.measure import quiet_lightning, write_results
from lightning_gpuopt.bench.rows import DeviceBatches
from lightning_gpuopt.bench.steady import Measurement, StepClock, summarize

#: a fit that measures training alone: no logger, bars, summary, checkpoints or validation
QUIET_FIT: dict[str, Any] = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
    "num_sanity_val_steps": 0,
    "limit_val_batches": 0,
}
#: results go here, named ``<date>-<subject>-<machine>.json``: scratch that git ignores until a document
#: cites the file and it moves into its subject folder (``results/README.md``, the index)
RESULTS = Path(__file__).resolve().parent / "results"


Variant = Callable[[], Measurement]


def take_turns(
    variants: Mapping[str, Variant], repeats: int, on_result: Callable[[str, int, Measurement], None] | None = None
) -> dict[str, list[Measurement | BaseException]]:
    """Run each variant once a turn, in order, for ``repeats`` turns; a variant that raises keeps its error
    in its place (the others go on) and is not run again.

    Example:
        >>> out = take_turns({"a": lambda: Measurement(8, 1.0, (1.0,))}, repeats=2)
        >>> [m.samples_per_sec for m in out["a"]]
        [8.0, 8.0]
    """
    check_int(repeats, "repeats", low=1)
    out: dict[str, list[Measurement | BaseException]] = {name: [] for name in variants}
    for turn in range(repeats):
        for name, run in variants.items():
            if any(isinstance(r, BaseException) for r in out[name]):
                continue
            try:
                m = run()
            except KeyboardInterrupt:
                raise
            except Exception as err:  # kept as the row's error
                out[name].append(err)
                continue
            out[name].append(m)
            if on_result is not None:
                on_result(name, turn, m)
    return out


def format_rows(rows: Sequence[Mapping[str, Any]], ceiling_label: str = "of ceiling") -> str:
    """A text table of ``summarize``'s rows: samples/s median [min-max], ratio median (worst), p50/p90."""
    def rate(r: Mapping[str, Any]) -> str | None:
        if r.get("samples_per_sec") is None:
            return r.get("error") and f"failed: {r['error'][:60]}"
        return f"{r['samples_per_sec']:,.0f} [{r['samples_per_sec_min']:,.0f}-{r['samples_per_sec_max']:,.0f}]"

    table = [
        {
            "row": r["name"],
            "samples/s median [min-max]": rate(r),
            ceiling_label: None if r.get("of_ceiling") is None else f"{r['of_ceiling']:.3f} ({r['of_ceiling_worst']:.3f})",
            "p50 ms": r.get("p50_ms"),
            "p90 ms": r.get("p90_ms"),
        }
        for r in rows
    ]
    return format_table(table, ["row", "samples/s median [min-max]", ceiling_label, "p50 ms", "p90 ms"])


def machine_tag() -> str:
    """``h200`` for an NVIDIA H200 (the last word of the GPU's name), ``cpu`` without CUDA."""
    return torch.cuda.get_device_name(0).split()[-1].lower() if torch.cuda.is_available() else "cpu"


def results_path(out: str | None, subject: str, quick: bool) -> Path:
    """``out``, or ``results/<date>-<subject>-<machine>.json``; a ``--quick`` run without ``--out`` writes
    to the temp folder, so a smoke run never lands among recorded results."""
    if out:
        return Path(out)
    if quick:
        return Path(tempfile.gettempdir()) / f"{subject}_quick.json"
    return RESULTS / f"{dt.date.today().isoformat()}-{subject}-{machine_tag()}.json"


def add_common(p: argparse.ArgumentParser, warmup: int, steps: int, repeats: int = 3) -> None:
    """``--out``, ``--quick``, ``--warmup``, ``--steps``, ``--repeats``."""
    p.add_argument("--out", default=None, help="results JSON (default results/<date>-<subject>-<gpu>.json)")
    p.add_argument("--quick", action="store_true", help="a CPU smoke run: small model, tiny images")
    p.add_argument("--warmup", type=int, default=warmup, help="steps before each window (past the prefetch)")
    p.add_argument("--steps", type=int, default=steps, help="steps a window")
    p.add_argument("--repeats", type=int, default=repeats, help="turns: every variant once a turn")


def add_model(p: argparse.ArgumentParser, rows: Sequence[str]) -> None:
    """``--arch``, ``--batch-size``, ``--image-size`` and ``--rows`` (a comma-separated choice of ``rows``)."""
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--rows", default=",".join(rows), help="comma-separated rows")


def add_feed(p: argparse.ArgumentParser, data: str, subject: str, rows: Sequence[str], workers: str) -> None:
    """A feed benchmark's arguments: ``--data`` (the temp folder's ``data``), ``--out`` (by default
    ``results_path`` of ``subject``), ``--only`` (some of ``rows``), the images and stores, the model, the
    windows, ``--loader-batches`` and ``--quick``."""
    p.add_argument("--data", default=os.path.join(tempfile.gettempdir(), data))
    p.add_argument("--out", default=None, help=f"results JSON (default results/<date>-{subject}-<gpu>.json)")
    p.set_defaults(results_subject=subject)
    p.add_argument("--only", type=lambda s: [r.strip() for r in s.split(",") if r.strip()],
                   help=f"comma-separated rows (default all: {','.join(rows)})")
    p.add_argument("--images", type=int, default=8192)
    p.add_argument("--storage", type=int, default=256, help="the stores' shorter side (convert --size)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--workers", type=int, default=available_cpus() - 1, help=workers)
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--warmup", type=int, default=40, help="steps before each window (past the prefetch)")
    p.add_argument("--steps", type=int, default=200, help="steps a window")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--loader-batches", type=int, default=30, help="batches timed for a loader alone (0: skip)")
    p.add_argument("--quick", action="store_true", help="a CPU smoke run: tiny images, a small model")


def feed_args(p: argparse.ArgumentParser, argv: list[str] | None, rows: Sequence[str],
              counted: Sequence[str] = ()) -> argparse.Namespace:
    """Parse ``add_feed``'s arguments (an unknown ``--only`` row stops the script, naming the choices; a row
    of ``counted`` may end in ``:N``, N >= 1); sets ``args.out`` (``results_path``), ``args.device`` and, with
    ``--quick``, 64 tiny images, a small model and a few steps."""
    args = p.parse_args(argv)
    args.out = str(results_path(args.out, vars(args).pop("results_subject"), args.quick))
    pattern = "|".join(map(re.escape, rows)) + "".join(f"|{re.escape(c)}:[1-9][0-9]*" for c in counted)
    if bad := sorted(r for r in args.only or () if not re.fullmatch(pattern, r)):
        p.error(f"--only: unknown rows {bad}; choose from {', '.join(rows)} ({', '.join(counted)}: also :N)")
    args.device = device_of(args)
    if args.quick:
        args.images, args.storage, args.batch_size, args.image_size = 64, 40, 8, 32
        args.arch, args.warmup, args.steps, args.repeats = "small", 2, 4, 2
        args.loader_batches, args.workers = min(args.loader_batches, 3), min(args.workers, 2)
    return args


def chosen_rows(p: argparse.ArgumentParser, args: argparse.Namespace, rows: Sequence[str]) -> list[str]:
    """The ``--rows`` asked for (an unknown one stops the script, naming the choices); sets ``args.device``
    and, with ``--quick``, a small model on tiny images for a few steps."""
    chosen = [r for r in args.rows.split(",") if r]
    if unknown := sorted(set(chosen) - set(rows)):
        p.error(f"--rows: unknown {unknown}; choose from {', '.join(rows)}")
    args.device = device_of(args)
    if args.quick:
        args.arch, args.batch_size, args.image_size = "small", 4, 32
        args.warmup, args.steps, args.repeats = 1, 3, min(args.repeats, 2)
    return chosen


def device_of(args: argparse.Namespace) -> str:
    """``"cuda"`` where a GPU is visible and the run is not ``--quick``, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() and not args.quick else "cpu"


def free() -> None:
    """Drop what the last fit left: its model, optimizer state, the allocator's cached blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measured_fit(
    model: pl.LightningModule,
    warmup: int,
    steps: int,
    *,
    device: str,
    preset: bool = True,
    compile: bool | None = False,
    settle: bool = False,
    callbacks: Sequence[pl.Callback] = (),
    trainer: Mapping[str, Any] | None = None,
    **fit: Any,
) -> Measurement:
    """One fit of ``model`` stopped after ``StepClock(warmup, steps)``'s window.

    ``preset``: ``Trainer(**fast_trainer_kwargs(model, compile=compile, ...))``; else a plain ``Trainer``.
    ``trainer`` holds more ``Trainer`` arguments (they win over the preset's), ``callbacks`` run before the
    clock, ``fit`` holds ``datamodule=`` or ``train_dataloaders=``.
    """
    from lightning_gpuopt import fast_trainer_kwargs

    clock = StepClock(warmup=warmup, steps=steps, settle=settle or compile, cpu=True)
    kwargs: dict[str, Any] = {
        "accelerator": "gpu" if device == "cuda" else "cpu",
        "devices": 1,
        "max_epochs": -1,
        **QUIET_FIT,
        **(trainer or {}),
        "callbacks": [*callbacks, clock],
    }
    if preset:
        kwargs = fast_trainer_kwargs(model, device, compile=compile, **kwargs)
    with quiet_lightning(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(no `validation_step`|has no logger).*")
        try:
            pl.Trainer(**kwargs).fit(model, **fit)
        finally:
            # a module keeps its last Trainer, and with it the fit's loaders, workers and pipelines: let go,
            # so they end now (``free``) and not in the middle of the next variant's window
            model.trainer = None  # type: ignore[assignment]
    if clock.measurement is None:
        raise RuntimeError(f"the fit ended before its {warmup}-step warm-up did")
    return clock.measurement


def resident(batch: int, size: int, device: str, classes: int = 10, uint8: bool = True) -> DeviceBatches:
    """One batch kept on ``device`` (uint8 as a loader that leaves normalizing to the GPU hands it over, or
    float channels_last), endlessly; labels cycle through four sets."""
    if uint8:
        x = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, device=device)
    else:
        x = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=torch.channels_last)
    ys = [torch.randint(0, classes, (batch,), device=device) for _ in range(4)]
    return DeviceBatches(x, ys, length=10**6)


def loader_rate(loader: Iterable[Any], device: str, batches: int, skip: int = 5) -> float:
    """Images a second ``loader`` delivers onto ``device`` with no model, after ``skip`` batches; an epoch's
    end starts the next one."""
    it = (batch for _ in iter(int, 1) for batch in loader)  # endless: epoch after epoch
    n, t0 = 0, 0.0
    for i in range(skip + batches):
        x = next(it)[0].to(device, non_blocking=True)
        if i == skip - 1:
            torch.cuda.synchronize() if device == "cuda" else None
            t0 = time.perf_counter()
        elif i >= skip:
            n += x.shape[0]
    if device == "cuda":
        torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def say(name: str, turn: int, m: Measurement) -> None:
    """A progress line for each measured repetition (``take_turns``' ``on_result``)."""
    print(f"  turn {turn + 1} {name:32s} {m.samples_per_sec or 0:10,.0f}/s  p50 {m.p50_ms or 0:7.2f} ms"
          f"  p90 {m.p90_ms or 0:7.2f} ms", flush=True)  # fmt: skip


def report(
    path: Path,
    results: Mapping[str, Sequence[Measurement | BaseException]],
    ceiling: str | None,
    label: str = "of ceiling",
    per_row: Mapping[str, Mapping[str, Any]] | None = None,
    **extra: Any,
) -> list[dict[str, Any]]:
    """``summarize`` the repetitions into rows (``ratio_to_ceiling``: the median turn-by-turn ratio), add
    ``per_row[name]``'s keys to each, write ``path`` and print the table last; ``extra`` goes into the file
    beside the rows."""
    rows = summarize(results, ceiling)
    for row in rows:
        row["ratio_to_ceiling"] = row["of_ceiling"]
        row.update((per_row or {}).get(row["name"], {}))
    write_results(path, rows, ceiling=ceiling, **extra)
    print(format_rows(rows, label))
    print(f"wrote {path}")
    return rows


def hdf5_store(
    src: str | os.PathLike[str], path: str | os.PathLike[str], storage_size: int, format: str = "raw"
) -> dict[str, Any]:
    """Make ``path`` a store of the JPEG folder ``src`` at ``storage_size`` (``format``: ``"raw"`` or
    ``"jpeg"``, as ``convert --format``); return what the conversion cost.

    A store already there is reused when this version of the package reads it at that size; one of an
    older format (or another size) is converted again, so a data folder kept between runs never breaks a
    benchmark.

    Returns:
        ``{"cached": True}`` for a reused store, else ``{"cached": False, "seconds", "images_per_sec"}``.
    """
    from lightning_gpuopt.data.convert import convert_folder_to_hdf5
    from lightning_gpuopt.data.hdf5 import HDF5ImageDataset
    from lightning_gpuopt.data.jpeg_store import JPEGStoreDataset

    path = Path(path)
    if path.exists():
        try:
            store = HDF5ImageDataset(path)
            jpeg = isinstance(store, JPEGStoreDataset)
            if store.storage_size == storage_size and jpeg == (format == "jpeg"):
                return {"cached": True}
        except (ValueError, RuntimeError):  # another format version, or damaged: convert again below
            pass
    path.parent.mkdir(parents=True, exist_ok=True)
    res = convert_folder_to_hdf5(
        src, path, storage_size=storage_size, progress=False, overwrite=True, format=format
    )
    return {
        "cached": False,
        "seconds": res.seconds,
        "images_per_sec": res.num_images / max(res.seconds, 1e-9),
    }
