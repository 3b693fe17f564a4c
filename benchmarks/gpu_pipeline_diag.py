"""Where does a fed ResNet-50 lose time against the ceiling? Per-step data waits, one variant at a time.

ResNet-50 16-mixed + channels_last through Lightning, fed by ``OptimizedDataModule`` from the uint8
HDF5 store (8,192 ImageNet-sized images: 32 batches of 256 an epoch), measured over whole epochs
against the plain-loop ceiling of the same run (also with an unfused SGD, whose GradScaler step syncs the
host). Variants switch one thing each against the default loader (workers prefetching across epoch
boundaries, the next batch copied and augmented on a side CUDA stream): an unfused SGD, and
``pin_memory=False`` (no staging on the side stream: the copy and the augmentation run in the step). Each
row reports samples/s, the median and 95th-percentile host wait for a batch, and the mean wait of each
epoch's first batch.

    PYTHONPATH=. python3 benchmarks/gpu_pipeline_diag.py --out $OUT/pipeline_diag_h200.json
    PYTHONPATH=. python3 benchmarks/gpu_pipeline_diag.py --quick      # CPU, tiny
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _shared import hdf5_store, quick_out

from lightning_gpuopt import ChannelsLast, OptimizedDataModule
from lightning_gpuopt._common import format_table
from lightning_gpuopt.bench.measure import plain_loop_throughput, write_results
from lightning_gpuopt.bench.models import ImageClassifier
from lightning_gpuopt.bench.synthetic import make_jpeg_folder


class StepWaits(pl.Callback):
    """Host time between the end of one training batch and the start of the next, per step."""

    def __init__(self, skip_epochs: int = 1) -> None:
        self.skip_epochs = skip_epochs
        self.waits: list[tuple[int, int, float]] = []  # (epoch, batch_idx, wait_s)
        self._end: float | None = None
        self.t0: float | None = None
        self.t1: float | None = None
        self.samples = 0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == self.skip_epochs:
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            self.t0 = time.perf_counter()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._end is not None and trainer.current_epoch >= self.skip_epochs:
            self.waits.append((trainer.current_epoch, batch_idx, now - self._end))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._end = time.perf_counter()
        if trainer.current_epoch >= self.skip_epochs:
            self.samples += int(batch[0].shape[0])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        self.t1 = time.perf_counter()


def run(h5: str, args: argparse.Namespace, fused: bool | None = None, **dm_kwargs: Any) -> dict[str, Any]:
    dm = OptimizedDataModule(
        h5,
        backend="hdf5",
        batch_size=args.batch_size,
        num_workers=args.workers,
        image_size=args.image_size,
        **dm_kwargs,
    )
    waits = StepWaits()
    gpu = torch.cuda.is_available()
    trainer = pl.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        precision="16-mixed" if gpu else "32-true",
        max_epochs=args.epochs,
        callbacks=[ChannelsLast(), waits],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        benchmark=True,
    )
    trainer.fit(ImageClassifier(args.model, num_classes=100, fused=fused), datamodule=dm)
    seconds = (waits.t1 or 0) - (waits.t0 or 0)
    all_w = [w for _, _, w in waits.waits]
    first = [w for _, b, w in waits.waits if b == 0]
    rest = [w for _, b, w in waits.waits if b > 0]
    return {
        "samples_per_sec": waits.samples / seconds if seconds > 0 else None,
        "wait_median_ms": 1e3 * statistics.median(rest) if rest else None,
        "wait_p95_ms": 1e3 * sorted(rest)[int(0.95 * (len(rest) - 1))] if rest else None,
        "epoch_first_wait_ms": 1e3 * statistics.mean(first) if first else None,
        "data_wait_frac": sum(all_w) / seconds if seconds > 0 else None,
        "seconds": seconds,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/pipeline_diag_h200.json")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--data-root", default="/tmp/gpuopt_data")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--epochs", type=int, default=4, help="the first epoch is warm-up, the rest are timed")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--model", default="resnet50")
    args = p.parse_args()
    args.out = quick_out(args.out, p.get_default("out"), args.quick)
    root = Path(args.data_root)
    if args.quick:
        args.batch_size, args.image_size, args.model, args.workers, args.epochs = 8, 32, "small", 1, 2
        folder = make_jpeg_folder(root / "diag_quick_32", 32, 4, image_size=(64, 48), workers=1)
        h5 = root / "diag_quick_32_37.h5"
        size = 37
    else:
        folder = make_jpeg_folder(root / "imagenet_8192", 8192, 100)
        h5 = root / "imagenet_8192_256.h5"
        size = 256
    hdf5_store(folder, h5, size)
    rows: list[dict[str, Any]] = []
    ceiling = None
    if torch.cuda.is_available():
        from lightning_gpuopt.bench.models import build_model

        ceiling = plain_loop_throughput(build_model(args.model, 100), args.batch_size, args.image_size, 100)
        rows.append(
            {"name": "ceiling: plain loop, batch on GPU", "samples_per_sec": ceiling, "ratio_to_ceiling": 1.0}
        )
        unfused = plain_loop_throughput(
            build_model(args.model, 100), args.batch_size, args.image_size, 100, fused=False
        )
        rows.append(
            {
                "name": "ceiling with unfused SGD (host sync each step)",
                "samples_per_sec": unfused,
                "ratio_to_ceiling": unfused / ceiling,
            }
        )
    variants: list[tuple[str, dict[str, Any]]] = [
        ("default: continuous epochs, staged on the GPU", {}),
        ("default, unfused SGD (GradScaler syncs the host each step)", {"fused": False}),
    ]
    if torch.cuda.is_available():  # staging needs pinned batches on a CUDA run; on a CPU run nothing changes
        variants.append(("pin_memory=False (no staging: copy + augment in the step)", {"pin_memory": False}))
    for name, kwargs in variants:
        t0 = time.perf_counter()
        row = {"name": name, **run(str(h5), args, **kwargs)}
        if ceiling and row["samples_per_sec"]:
            row["ratio_to_ceiling"] = row["samples_per_sec"] / ceiling
        print(
            f"{name}: {row['samples_per_sec']:.1f} samples/s ({time.perf_counter() - t0:.1f} s)", flush=True
        )
        rows.append(row)
    path = write_results(args.out, rows, workers=args.workers, batch_size=args.batch_size, epochs=args.epochs)
    print(f"wrote {path}")
    print(
        format_table(
            rows,
            [
                "name",
                "samples_per_sec",
                "ratio_to_ceiling",
                "wait_median_ms",
                "wait_p95_ms",
                "epoch_first_wait_ms",
                "data_wait_frac",
            ],
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
