"""num_workers: 0 vs tuned (``num_workers="auto"``) vs an exhaustive sweep, through Lightning's Trainer.

ResNet-50, fp16-mixed + channels_last, batch 256, fed by ``OptimizedDataModule`` from an ImageNet-shaped
JPEG folder (``/tmp/gpuopt_data/imagenet_8192``: 8,192 images of 500x375, ~110 kB). Every row is a ratio
to the ceiling measured in the same run (``plain_loop_throughput``: the same model on one batch already on
the GPU). Pass: the tuned count's throughput is within 5% of the sweep's best and tuning took <= 30 s.

    PYTHONPATH=. python3 benchmarks/gpu_workers.py --out $OUT/workers_h200.json      # H200, ~110 s
    PYTHONPATH=. python3 benchmarks/gpu_workers.py --quick                            # CPU smoke test

``benchmarks/cpu_workers.py`` runs the same with CPU-sized defaults.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _shared import quick_out

from lightning_gpuopt._common import available_cpus, format_table
from lightning_gpuopt.bench.measure import ThroughputMeter, plain_loop_throughput, write_results
from lightning_gpuopt.bench.models import ImageClassifier, build_model
from lightning_gpuopt.bench.synthetic import make_jpeg_folder
from lightning_gpuopt.data.datamodule import OptimizedDataModule
from lightning_gpuopt.data.tuning import TuningConfig

GPU_DEFAULTS: dict[str, Any] = dict(
    data="/tmp/gpuopt_data/imagenet_8192",
    images=8192,
    classes=100,
    image_wh=(500, 375),
    model="resnet50",
    batch_size=256,
    image_size=224,
    steps=20,
    warmup=5,
    zero_steps=3,
    sweep="2,4,8,12,16",
    tune_budget=25.0,
    budget=110.0,
)
QUICK_DEFAULTS: dict[str, Any] = dict(
    data="/tmp/gpuopt_data/quick_512_64x48",
    images=512,
    classes=10,
    image_wh=(64, 48),
    model="small",
    batch_size=32,
    image_size=32,
    steps=6,
    warmup=2,
    zero_steps=3,
    sweep="1,2",
    tune_budget=2.0,
    budget=300.0,
)


class Meter(ThroughputMeter):
    """ThroughputMeter plus host-side data wait (gap between a batch's end and the next batch's start) and
    mean GPU-Util over the timed window (NVML, when available)."""

    def __init__(self, warmup: int) -> None:
        super().__init__(warmup)
        self._last_end: float | None = None
        self._wait = 0.0
        self._sampler: Any = None
        self.gpu_util: float | None = None
        self.data_wait_frac: float | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            try:
                from lightning_gpuopt.observe.nvml import NVMLSampler, nvml_device_index

                self._sampler = NVMLSampler(nvml_device_index(pl_module.device), period_s=0.05).start()
            except Exception as err:  # GPU-Util is informative; the benchmark goes on without it
                print(f"(no NVML: {err})", file=sys.stderr)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        started = self._t0 is not None
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self._t0 is not None and not started and self._sampler is not None:
            self._sampler.window()  # discard the warm-up
        if started and self._last_end is not None:
            self._wait += time.perf_counter() - self._last_end

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._last_end = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if self._sampler is not None:
            self.gpu_util = self._sampler.window().get("gpu/util")
            self._sampler.stop()
        if self.seconds:
            self.data_wait_frac = self._wait / self.seconds


def fit_row(
    args: argparse.Namespace, root: Path, num_workers: int | str, steps: int, cuda: bool
) -> dict[str, Any]:
    warmup = args.warmup if num_workers != 0 else 1
    dm = OptimizedDataModule(
        root,
        batch_size=args.batch_size,
        num_workers=num_workers,
        image_size=args.image_size,
        tuning=TuningConfig(budget_s=args.tune_budget, cache_dir=args.cache_dir),
    )
    module = ImageClassifier(build_model(args.model, args.classes), lr=0.01)
    module.model = module.model.to(memory_format=torch.channels_last)
    meter = Meter(warmup)
    trainer = pl.Trainer(
        accelerator="cuda" if cuda else "cpu",
        devices=1,
        precision="16-mixed" if cuda else "32-true",
        max_steps=warmup + steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        benchmark=cuda,
        callbacks=[meter],
    )
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=dm)
    tuning = dm.tuning_result
    wall = time.perf_counter() - t0
    num_workers = dm.num_workers
    # drop the loaders now so their (persistent) workers exit before the next run starts
    del trainer, dm, module
    gc.collect()
    return {
        "num_workers": num_workers,
        "samples_per_sec": meter.samples_per_sec,
        "gpu_util_mean": meter.gpu_util,
        "data_wait_frac": meter.data_wait_frac,
        "steps": steps,
        "wall_s": wall,
        "tuning_s": tuning.seconds if tuning is not None else None,
        "tuning_table": tuning.table if tuning is not None else None,
    }


def main(
    argv: list[str] | None = None,
    defaults: dict[str, Any] | None = None,
    out: str = "benchmarks/results/workers_h200.json",
) -> int:
    """Run the benchmark; ``defaults`` and ``out`` are the machine's settings (``cpu_workers.py`` passes its own)."""
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=out)
    parser.add_argument("--quick", action="store_true", help="tiny CPU-sized run (smoke test)")
    parser.add_argument("--data", help="image folder (generated with make_jpeg_folder when absent)")
    parser.add_argument("--images", type=int)
    parser.add_argument("--model")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--image-size", type=int)
    parser.add_argument("--steps", type=int, help="timed steps per run")
    parser.add_argument("--warmup", type=int, help="untimed steps per run")
    parser.add_argument("--zero-steps", type=int, help="timed steps of the 0-worker run (it is slow)")
    parser.add_argument("--sweep", help="comma-separated worker counts of the exhaustive sweep")
    parser.add_argument("--tune-budget", type=float, help="seconds num_workers='auto' may spend")
    parser.add_argument("--budget", type=float, help="wall-clock budget of the whole script (s)")
    parser.add_argument(
        "--cache-dir", default=None, help="tuning cache (default: a fresh temp dir -> always tunes)"
    )
    args = parser.parse_args(argv)
    args.out = quick_out(args.out, out, args.quick)
    base = dict(QUICK_DEFAULTS if args.quick else (defaults or GPU_DEFAULTS))
    for key, value in base.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.classes = base["classes"]
    if args.cache_dir is None:
        import tempfile

        args.cache_dir = tempfile.mkdtemp(prefix="gpuopt_tune_cache_")  # measure tuning, not a cache hit
    t_start = time.perf_counter()
    load_start = os.getloadavg()[0]  # other processes on the machine skew CPU-bound figures: record it
    torch.backends.cudnn.benchmark = cuda

    root = make_jpeg_folder(
        args.data, num_images=args.images, num_classes=args.classes, image_size=args.image_wh
    )
    gen_s = time.perf_counter() - t_start
    ceiling = plain_loop_throughput(
        build_model(args.model, args.classes),
        args.batch_size,
        image_size=args.image_size,
        num_classes=args.classes,
        steps=max(10, args.steps),
        warmup=max(3, args.warmup),
        dtype=torch.float16 if cuda else None,
        channels_last=True,
        device="cuda" if cuda else "cpu",
    )
    rows: list[dict[str, Any]] = [
        {"name": "ceiling (plain loop, batch on device)", "samples_per_sec": ceiling, "ratio_to_ceiling": 1.0}
    ]
    skipped: list[str] = []

    def add(name: str, result: dict[str, Any]) -> dict[str, Any]:
        sps = result["samples_per_sec"]
        row = {"name": name, **result, "ratio_to_ceiling": sps / ceiling if sps else None}
        rows.append(row)
        print(f"  {name}: {sps or 0:,.0f} samples/s in {result['wall_s']:.1f} s", file=sys.stderr)
        return row

    zero = add("0 workers", fit_row(args, root, 0, args.zero_steps, cuda))
    tuned = add("tuned (num_workers='auto')", fit_row(args, root, "auto", args.steps, cuda))
    sweep_rows: list[dict[str, Any]] = []
    # largest counts first: they are the quick runs and the likely best, so a budget cut loses the slow tail
    for n in sorted({int(v) for v in args.sweep.split(",") if v.strip()}, reverse=True):
        elapsed = time.perf_counter() - t_start
        per_run = max((r["wall_s"] for r in rows[2:]), default=10.0)
        if elapsed + per_run > args.budget:
            skipped.append(f"sweep {n}: over the budget ({elapsed:.0f} s used)")
            continue
        sweep_rows.append(add(f"sweep {n} workers", fit_row(args, root, n, args.steps, cuda)))

    best = max(sweep_rows, key=lambda r: r["samples_per_sec"] or 0.0, default=None)
    tuned_vs_best = (
        (tuned["samples_per_sec"] / best["samples_per_sec"]) if best and best["samples_per_sec"] else None
    )
    passed = (
        tuned_vs_best is not None
        and tuned_vs_best >= 0.95
        and tuned["tuning_s"] is not None
        and tuned["tuning_s"] <= 30.0
    )
    summary = {
        "tuned_num_workers": tuned["num_workers"],
        "tuning_s": tuned["tuning_s"],
        "sweep_best_num_workers": best["num_workers"] if best else None,
        "tuned_vs_sweep_best": tuned_vs_best,
        "pass": passed,
        "criteria": "tuned samples/s >= 0.95 x sweep best and tuning <= 30 s",
        "zero_workers_ratio": zero["ratio_to_ceiling"],
    }
    write_results(
        args.out,
        rows,
        summary=summary,
        config={
            k: getattr(args, k)
            for k in (
                "data",
                "images",
                "model",
                "batch_size",
                "image_size",
                "steps",
                "warmup",
                "sweep",
                "tune_budget",
            )
        },
        cpus_available=available_cpus(),
        dataset_generation_s=gen_s,
        skipped=skipped,
        total_s=time.perf_counter() - t_start,
        device="cuda" if cuda else "cpu",
        load_avg_1min_start_end=[load_start, os.getloadavg()[0]],
    )
    table_rows = [{**r, "num_workers": r.get("num_workers", "-")} for r in rows]
    print(
        format_table(
            table_rows,
            ["name", "num_workers", "samples_per_sec", "ratio_to_ceiling", "gpu_util_mean", "data_wait_frac"],
        )
    )
    print(
        f"tuned={tuned['num_workers']} in {tuned['tuning_s'] or 0:.1f} s; sweep best={summary['sweep_best_num_workers']}; "
        f"tuned/best={tuned_vs_best if tuned_vs_best is None else round(tuned_vs_best, 3)}; "
        f"{'PASS' if passed else 'FAIL'}; total {time.perf_counter() - t_start:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
