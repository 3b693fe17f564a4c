"""``lightning-gpuopt bench``: the ladder from a naive input pipeline to the full stack, on this machine
(``lightning_gpuopt.bench``); each run writes a new ``<out>/version_<n>`` and prints the table last.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_gpuopt._checks import check_arg

if TYPE_CHECKING:
    from lightning_gpuopt.bench.rows import LadderConfig

HELP = "benchmark a ladder of settings from naive to fully optimized"


def _progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _src_size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT such as 500x375, got {text!r}") from None
    if w < 8 or h < 8:
        raise argparse.ArgumentTypeError(f"both sides must be >= 8 pixels, got {text!r}")
    return w, h


# (flag, type, default, help) of the flags that take one value; docs/benchmarks.md says more of each
_FLAGS: tuple[tuple[str, Any, Any, str], ...] = (
    ("--images", int, 8192, "images in the generated folder (default 8192)"),
    ("--classes", int, 100, "classes in the generated folder (default 100)"),
    ("--batch-size", int, 256, "samples a step (default 256)"),
    ("--image-size", int, 224, "training crop side in pixels (default 224)"),
    ("--seconds", float, 10.0, "measured seconds a row over its repetitions (default 10; 0: --steps alone)"),
    ("--steps", int, None, "steps a repetition measures: at most (with --seconds) or exactly (--seconds 0)"),
    ("--warmup", int, 5, "warm-up steps of a fit, past the loader's prefetch and a compile (default 5)"),
    ("--repeats", int, 3, "fits a row, the rows taking turns; rows report the median and range (default 3)"),
    ("--workers", int, None, "DataLoader workers for the tuned rows (default: measured)"),
    ("--tune-seconds", float, 10.0, "budget of each worker tuning (default 10)"),
    ("--time-budget", float, None, "whole-run seconds; rows shrink to fit (default: none)"),
    ("--out", str, "lightning_gpuopt_bench", "output folder; each run writes a new version_<n> inside it"),
    ("--cache-dir", str, None, "cache (default $LIGHTNING_GPUOPT_CACHE_DIR, else ~/.cache/lightning_gpuopt)"),
)


def configure(parser: argparse.ArgumentParser) -> None:
    from lightning_gpuopt.bench.rows import ROW_NAMES

    parser.add_argument(
        "--data",
        help="class-per-subfolder image folder or a .h5 file made by `lightning-gpuopt convert` "
        "(default: a generated ImageNet-shaped JPEG folder, cached)",
    )
    parser.add_argument(
        "--image-size-src",
        type=_src_size,
        default=(500, 375),
        metavar="WxH",
        help="size of the generated JPEGs (default 500x375, ImageNet's median)",
    )
    parser.add_argument(
        "--model",
        choices=("small", "resnet18", "resnet50"),
        help="model (default resnet50 when torchvision is installed, else the built-in small ResNet)",
    )
    parser.add_argument(
        "--rows",
        default=",".join(ROW_NAMES),
        help=f"comma-separated rows to run (default all: {','.join(ROW_NAMES)}); ceiling_eager runs beside "
        "any row that can run, ceiling_compiled on CUDA or with +compile; on a CPU the compiled rows run "
        "only when named; rows this machine cannot run say why, and when none can the command ends (exit 1)",
    )
    for flag, kind, default, text in _FLAGS:
        parser.add_argument(flag, type=kind, default=default, help=text)
    parser.add_argument("--accelerator", choices=("auto", "cpu", "gpu"), default="auto", help="default auto")
    parser.add_argument("--no-tensorboard", action="store_true", help="do not write TensorBoard runs")


def ladder_failure(results: list[dict[str, Any]], requested: set[str]) -> str | None:
    """Why a ladder run failed, in one line with each row's reason: no requested row was measured (all
    rows when ``requested`` is empty), or rows raised; ``None`` when it did not fail. ``bench`` and
    ``demo`` exit 1 with it."""
    from lightning_gpuopt.bench.rows import FAILED, OK

    asked = [r for r in results if r["name"] in requested] or results
    if not any(r["status"] == OK for r in asked):
        reasons: dict[str, list[str]] = {}
        for r in asked:
            reasons.setdefault(f"{r['status']}: {r.get('reason') or 'no reason given'}", []).append(r["name"])
        why = "; ".join(f"{', '.join(names)}: {reason}" for reason, names in reasons.items())
        return f"no row ran ({why})"
    failed = [r for r in results if r["status"] == FAILED]
    if failed:
        why = "; ".join(f"{r['name']}: {r.get('reason') or 'no reason given'}" for r in failed)
        return f"{len(failed)} row{'s' if len(failed) > 1 else ''} failed ({why})"
    return None


def _some_row_runs(config: LadderConfig) -> bool:
    """Whether a row asked for can run here; when none can, say why for each, before any data is made or
    anything timed."""
    from lightning_gpuopt.bench.rows import blocked_rows

    blocked = blocked_rows(config)
    if len(blocked) < len(config.rows):
        return True
    for name, (status, reason) in blocked.items():
        print(f"lightning-gpuopt bench: {name}: {status}: {reason}", file=sys.stderr)
    print(
        f"lightning-gpuopt bench: error: no row ran (none of {', '.join(blocked)} can run here; "
        "nothing was measured)",
        file=sys.stderr,
    )
    return False


def run(args: argparse.Namespace) -> int:
    for flag, value in (("--images", args.images), ("--classes", args.classes)):
        check_arg(value >= 1, flag, value, ">= 1")
    from lightning_gpuopt._imports import _TORCHVISION_AVAILABLE

    # before the heavy imports: found in a moment
    if args.model not in (None, "small") and not _TORCHVISION_AVAILABLE:
        raise ValueError(
            f"--model {args.model} is torchvision's, which is not installed; "
            "pip install 'lightning-gpuopt[vision]' (or torchvision), or pass --model small"
        )
    from lightning_gpuopt._common import cache_dir
    from lightning_gpuopt.bench import rows, runs
    from lightning_gpuopt.bench.synthetic import cached_jpeg_folder

    cache = cache_dir(args.cache_dir)
    config = rows.LadderConfig(
        data=args.data or os.fspath(cache),  # the generated folder replaces it once it exists
        model=args.model or rows.default_model(),
        batch_size=args.batch_size,
        image_size=args.image_size,
        rows=rows.parse_rows(args.rows),
        seconds=args.seconds,
        steps=args.steps,
        warmup=args.warmup,
        repeats=args.repeats,
        accelerator=args.accelerator,
        num_workers=args.workers,
        tune_seconds=args.tune_seconds,
        cache_dir=cache,
        time_budget_s=args.time_budget,
    )
    config.validate(check_data=bool(args.data))  # bad arguments fail before any dataset work
    if not _some_row_runs(config):
        return 1
    runs.check_output_folder(args.out)
    if not args.data:
        config.data = cached_jpeg_folder(
            cache, args.images, args.classes, args.image_size_src, progress=_progress
        )
    return runs.in_new_run(args.out, lambda run: _run_in(run, args, config))


def _run_in(run: Path, args: argparse.Namespace, config: LadderConfig) -> int:
    import torch

    from lightning_gpuopt._imports import _TENSORBOARD_AVAILABLE
    from lightning_gpuopt.bench import report
    from lightning_gpuopt.bench.measure import quiet_lightning
    from lightning_gpuopt.bench.runner import run_ladder

    if not args.no_tensorboard and _TENSORBOARD_AVAILABLE:
        config.tb_dir = run / "tensorboard"
    elif not args.no_tensorboard:
        _progress(
            "TensorBoard logs skipped: tensorboard is not installed "
            "(pip install 'lightning-gpuopt[tensorboard]')"
        )
    _progress(f"this run writes to {run}")
    with quiet_lightning():
        results = run_ladder(config, progress=_progress)
    cuda = torch.cuda.is_available() and args.accelerator != "cpu"
    device = torch.cuda.get_device_name(0) if cuda else "CPU"
    title = f"{config.model}, batch {config.batch_size}, {config.image_size}px on {device}"
    js, png, note = report.write_outputs(results, config, run / "ladder.json", run / "ladder.png", title)
    if note:
        _progress(note)
    _progress(
        f"wrote {js}"
        + (f", {png}" if png else "")
        + (f", TensorBoard runs in {config.tb_dir}" if config.tb_dir else "")
    )
    print(report.format_ladder_table(results))
    for line in [report.budget_note(results, config.repeats), *report.noise_notes(results, marks=False)]:
        if line:
            print(line)
    failure = ladder_failure(results, set(config.rows))
    if failure is not None:
        print(f"lightning-gpuopt bench: error: {failure}", file=sys.stderr)
        return 1
    return 0
