"""``lightning-gpuopt demo``: a short Lightning fit on generated JPEGs with ``GPUStatsMonitor`` on, then the
short version of ``lightning-gpuopt bench``: a few ladder rows from a naive loader to the optimized stack on
the same images, each measured for ``--ladder-seconds`` next to a ceiling measured in the same run.

It writes TensorBoard logs (CSV when tensorboard is not installed) and ends by printing samples/s, the share of
step time spent waiting for data, GPU-Util where there is a GPU, and where the logs are with the command that
opens them.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path
from typing import Any

HELP = "short Lightning fit on generated images with the GPU monitor on"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="./gpuopt_runs/demo", help="output folder (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="training steps (default: %(default)s)")
    parser.add_argument("--images", type=int, default=256, help="generated JPEGs (default: %(default)s)")
    parser.add_argument(
        "--image-size",
        type=int,
        default=32,
        help="side of the square images the model sees (default: %(default)s)",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="batch size (default: %(default)s)")
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="DataLoader workers (default: min(4, CPUs - 1): one core stays with training)",
    )
    parser.add_argument(
        "--ladder-seconds",
        type=float,
        default=4.0,
        help="measured seconds per ladder row after the fit; 0 skips the ladder (default: %(default)s)",
    )
    parser.add_argument(
        "--accelerator",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="where to train (default: %(default)s)",
    )


def _check(args: argparse.Namespace) -> None:
    for name in ("steps", "images", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.image_size < 16:
        raise ValueError(f"--image-size must be >= 16 pixels, got {args.image_size}")
    if args.workers is not None and args.workers < 0:
        raise ValueError(f"--workers must be >= 0, got {args.workers}")
    if args.ladder_seconds < 0:
        raise ValueError(f"--ladder-seconds must be >= 0 (0 skips the ladder), got {args.ladder_seconds}")


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def run(args: argparse.Namespace) -> int:
    _check(args)
    import lightning.pytorch as pl
    import torch

    from lightning_gpuopt._imports import _TENSORBOARD_AVAILABLE
    from lightning_gpuopt.data.datamodule import OptimizedDataModule
    from lightning_gpuopt.data.synthetic import make_jpeg_folder
    from lightning_gpuopt.models import ImageClassifier
    from lightning_gpuopt.observe.gpu_stats import GPUStatsMonitor

    use_gpu = torch.cuda.is_available() if args.accelerator == "auto" else args.accelerator == "gpu"
    if use_gpu and not torch.cuda.is_available():
        raise ValueError("--accelerator gpu was asked for but torch sees no CUDA GPU; use --accelerator cpu")
    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    num_classes = 10

    # generated once and reused by later runs with the same settings (make_jpeg_folder keeps a manifest)
    t0 = time.perf_counter()
    data_dir = out / "data" / f"jpeg_{args.images}_{args.image_size}"
    width = round(args.image_size * 1.25)
    make_jpeg_folder(
        data_dir, num_images=args.images, num_classes=num_classes, image_size=(width, args.image_size)
    )
    print(
        f"data: {args.images} JPEGs ({width}x{args.image_size}) in {data_dir} ({time.perf_counter() - t0:.1f} s)"
    )

    cpus = os.cpu_count() or 1
    workers = args.workers if args.workers is not None else min(4, cpus - 1)
    datamodule = OptimizedDataModule(
        train_dir=data_dir,
        batch_size=args.batch_size,
        num_workers=workers,
        image_size=args.image_size,
        persistent_workers=workers > 0,
    )
    model = ImageClassifier("small", num_classes=num_classes)

    logger: Any
    if _TENSORBOARD_AVAILABLE:
        from lightning.pytorch.loggers import TensorBoardLogger

        logger = TensorBoardLogger(save_dir=str(out), name="tensorboard")
    else:
        from lightning.pytorch.loggers import CSVLogger

        print(
            "note: tensorboard is not installed, writing CSV logs (`pip install 'lightning-gpuopt[tensorboard]'`)"
        )
        logger = CSVLogger(save_dir=str(out), name="csv")

    interval = max(1, min(10, args.steps // 8))
    monitor = GPUStatsMonitor(log_every_n_steps=interval, gpu=use_gpu)
    if not use_gpu:
        print("note: no CUDA GPU in use: gpu/ metrics are skipped; time/ and throughput/ are logged")
    trainer = pl.Trainer(
        accelerator="gpu" if use_gpu else "cpu",
        devices=1,
        max_steps=args.steps,
        precision="16-mixed" if use_gpu else "32-true",
        logger=logger,
        callbacks=[monitor],
        log_every_n_steps=interval,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
    )
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        # the demo's dataset is small on purpose; Lightning's advice about it is noise here
        warnings.filterwarnings(
            "ignore", message=".*(log_every_n_steps|num_workers|does not have many workers|Total length of).*"
        )
        trainer.fit(model, datamodule=datamodule)
    seconds = time.perf_counter() - t0

    summary = monitor.summary()
    log_dir = Path(logger.log_dir)
    print()
    print(f"lightning-gpuopt demo: {trainer.global_step} steps of batch {args.batch_size} in {seconds:.1f} s")
    print(f"  samples/s             {_fmt(summary.get('throughput/samples_per_sec'), '.1f')}")
    print(f"  step time             {_fmt(summary.get('time/step_ms'), '.1f', ' ms')}")
    print(
        f"  data-wait fraction    {_fmt(summary.get('time/data_wait_frac'), '.2f')}  (0 = never waits for data)"
    )
    if "gpu/util" in summary:
        print(
            f"  GPU-Util              {summary['gpu/util']:.0f} %  (min {summary.get('gpu/util_min', 0):.0f} %)"
        )
        if "gpu/sm_active" in summary:
            print(
                f"  SM active / tensor    {summary['gpu/sm_active']:.0f} % / {summary.get('gpu/tensor_active', 0):.0f} %"
            )
    else:
        print("  GPU-Util              - (no GPU sampled)")
    if args.ladder_seconds > 0:
        _ladder(args, data_dir, out, use_gpu, workers)
    print(f"logs: {log_dir}")
    if _TENSORBOARD_AVAILABLE:
        print(f"open them with: tensorboard --logdir {log_dir.parent}")
    else:
        print(f"metrics table: {log_dir / 'metrics.csv'}")
    return 0


# the short ladder: each row adds one thing; rows a CPU cannot run say why instead of vanishing
DEMO_ROWS = (
    "naive",
    "+workers",
    "+uint8_gpu_aug",
    "+hdf5",
    "+16-mixed",
    "+channels_last",
    "ceiling_lightning",
)


def _ladder(args: argparse.Namespace, data_dir: Path, out: Path, use_gpu: bool, workers: int) -> None:
    from lightning_gpuopt._imports import _H5PY_AVAILABLE, _MATPLOTLIB_AVAILABLE, _TENSORBOARD_AVAILABLE
    from lightning_gpuopt.ladder import LadderConfig, format_ladder_table, run_ladder, write_outputs

    rows = [r for r in DEMO_ROWS if r != "+hdf5" or _H5PY_AVAILABLE]
    config = LadderConfig(
        data=data_dir,
        model="small",
        batch_size=args.batch_size,
        image_size=args.image_size,
        rows=rows,
        seconds=args.ladder_seconds,
        warmup=2,
        accelerator="gpu" if use_gpu else "cpu",
        num_workers=workers if workers > 0 else None,
        tune_seconds=min(5.0, 2 * args.ladder_seconds),
        cache_dir=out / "cache",
        tb_dir=out / "ladder_tb" if _TENSORBOARD_AVAILABLE else None,
        time_budget_s=30 * args.ladder_seconds,
    )
    print()
    print(
        f"ladder: {len(rows) + 1} rows of ~{args.ladder_seconds:g} s each on the same images (bench's short version)"
    )
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*(log_every_n_steps|num_workers|does not have many workers|Total length of).*"
        )
        results = run_ladder(config, progress=lambda line: print(f"  {line}", flush=True))
    png = out / "ladder.png" if _MATPLOTLIB_AVAILABLE else None
    write_outputs(results, config, out / "ladder.json", png, title="lightning-gpuopt demo ladder")
    print(format_ladder_table(results))
    print(f"ladder results: {out / 'ladder.json'}" + (f", chart: {png}" if png else ""))
