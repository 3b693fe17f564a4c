"""``lightning-gpuopt bench``: the ladder from a naive input pipeline to the full stack, on this machine.

Writes ``<out>/ladder.json`` (``write_results`` shape), ``<out>/ladder.png`` (extra ``plot``) and TensorBoard
runs under ``<out>/tensorboard/`` (one run a row), and prints the table last. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

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


def configure(parser: argparse.ArgumentParser) -> None:
    from lightning_gpuopt.ladder import ROW_NAMES

    parser.add_argument(
        "--data",
        help="class-per-subfolder image folder or a .h5 file made by `lightning-gpuopt convert` "
        "(default: a generated ImageNet-shaped JPEG folder, cached)",
    )
    parser.add_argument(
        "--images", type=int, default=8192, help="images in the generated folder (default 8192)"
    )
    parser.add_argument(
        "--image-size-src",
        type=_src_size,
        default=(500, 375),
        metavar="WxH",
        help="size of the generated JPEGs (default 500x375, ImageNet's median)",
    )
    parser.add_argument(
        "--classes", type=int, default=100, help="classes in the generated folder (default 100)"
    )
    parser.add_argument(
        "--model",
        choices=("small", "resnet18", "resnet50"),
        default=None,
        help="model (default resnet50 when torchvision is installed, else the built-in small ResNet)",
    )
    parser.add_argument("--batch-size", type=int, default=256, help="samples a step (default 256)")
    parser.add_argument(
        "--image-size", type=int, default=224, help="training crop side in pixels (default 224)"
    )
    parser.add_argument(
        "--rows",
        default=",".join(ROW_NAMES),
        help=f"comma-separated rows to run, in any order (default all: {','.join(ROW_NAMES)}); "
        "ceiling_plain always runs, it is the ratios' ceiling",
    )
    parser.add_argument(
        "--seconds", type=float, default=10.0, help="measured seconds a row (default 10; 0: off)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="measured steps a row at most (default: no cap)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=5,
        help="warm-up steps a row (default 5; cut short after half --seconds)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="DataLoader workers for the tuned rows (default: measured with tune_num_workers)",
    )
    parser.add_argument(
        "--tune-seconds", type=float, default=10.0, help="budget of each worker tuning (default 10)"
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="whole-run seconds; rows shrink to fit (default: none)",
    )
    parser.add_argument(
        "--out", default="lightning_gpuopt_bench", help="output folder (default ./lightning_gpuopt_bench)"
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="where generated data and HDF5 copies are cached (default ~/.cache/lightning_gpuopt)",
    )
    parser.add_argument("--accelerator", choices=("auto", "cpu", "gpu"), default="auto", help="default auto")
    parser.add_argument("--no-tensorboard", action="store_true", help="do not write TensorBoard runs")


def _check_numbers(args: argparse.Namespace) -> None:
    for flag, value, low in (
        ("--images", args.images, 1),
        ("--classes", args.classes, 1),
        ("--batch-size", args.batch_size, 1),
        ("--image-size", args.image_size, 8),
    ):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if args.time_budget is not None and args.time_budget <= 0:
        raise ValueError(f"--time-budget must be > 0 seconds, got {args.time_budget}")


def resolve_data(args: argparse.Namespace, cache_dir: Path) -> Path:
    """``--data`` as given, or the generated folder (made once under ``cache_dir``)."""
    if args.data:
        data = Path(args.data).expanduser()
        if not data.exists():
            raise FileNotFoundError(
                f"--data {str(data)!r} does not exist; give an image folder or an HDF5 file"
            )
        return data
    from lightning_gpuopt.data.synthetic import make_jpeg_folder

    w, h = args.image_size_src
    classes = min(args.classes, args.images)
    root = cache_dir / f"jpeg_{args.images}_{classes}c_{w}x{h}"
    if not (root / "lightning_gpuopt_synthetic.json").is_file():
        _progress(
            f"generating {args.images} {w}x{h} JPEGs in {classes} classes under {root} (once, cached)..."
        )
        t0 = time.perf_counter()
        make_jpeg_folder(root, num_images=args.images, num_classes=classes, image_size=(w, h))
        _progress(f"  -> generated in {time.perf_counter() - t0:.1f} s")
    else:
        _progress(f"using cached generated folder {root}")
    return root


def run(args: argparse.Namespace) -> int:
    from lightning_gpuopt import ladder

    _check_numbers(args)
    rows = ladder.parse_rows(args.rows)
    cache_dir = Path(args.cache_dir).expanduser() if args.cache_dir else ladder.default_cache_dir()
    out = Path(args.out).expanduser()
    tb_dir: Path | None = None
    if not args.no_tensorboard:
        from lightning_gpuopt._imports import _TENSORBOARD_AVAILABLE

        if _TENSORBOARD_AVAILABLE:
            tb_dir = out / "tensorboard"
        else:
            _progress(
                "TensorBoard logs skipped: tensorboard is not installed (pip install 'lightning-gpuopt[tensorboard]')"
            )
    config = ladder.LadderConfig(
        data=args.data or os.fspath(cache_dir),  # validated again once the folder exists
        model=args.model or ladder.default_model(),
        batch_size=args.batch_size,
        image_size=args.image_size,
        rows=rows,
        seconds=args.seconds,
        steps=args.steps,
        warmup=args.warmup,
        accelerator=args.accelerator,
        num_workers=args.workers,
        tune_seconds=args.tune_seconds,
        cache_dir=cache_dir,
        tb_dir=tb_dir,
        time_budget_s=args.time_budget,
    )
    if args.data:
        config.validate()  # bad arguments fail before any dataset work
    config.data = resolve_data(args, cache_dir)
    lightning_log = logging.getLogger("lightning.pytorch")
    old_level = lightning_log.level
    lightning_log.setLevel(
        logging.WARNING
    )  # the per-row "GPU available" banners would drown the progress lines
    try:
        results = ladder.run_ladder(config, progress=_progress)
    finally:
        lightning_log.setLevel(old_level)
    import torch

    device = (
        torch.cuda.get_device_name(0) if torch.cuda.is_available() and args.accelerator != "cpu" else "CPU"
    )
    title = f"{config.model}, batch {config.batch_size}, {config.image_size}px on {device}"
    js, png, note = ladder.write_outputs(results, config, out / "ladder.json", out / "ladder.png", title)
    if note:
        _progress(note)
    _progress(
        f"wrote {js}" + (f", {png}" if png else "") + (f", TensorBoard runs in {tb_dir}" if tb_dir else "")
    )
    print(ladder.format_ladder_table(results))
    return 1 if any(r["status"] == ladder.FAILED for r in results) else 0
