"""HDF5 backend on the GPU: conversion time, and ResNet-50 fed from uint8 HDF5 against the ceiling.

In one run:
(a) ``convert_folder_to_hdf5`` of 8,192 ImageNet-sized JPEGs (``make_jpeg_folder``, 100 classes) to a
    uint8 store of whole images at 256 px (timed; reused when it already exists in the current format).
(b) the ceiling: ResNet-50 fp16 autocast + channels_last on one batch already on the GPU, plain PyTorch
    loop (``plain_loop_throughput``, batch 256);
(c) the same model through Lightning (``precision="16-mixed"``, channels_last) fed by
    ``OptimizedDataModule(backend="hdf5")`` (batched ``__getitems__`` reads, uint8 pinned batches, GPU
    crop/flip/normalize) for several ``num_workers``; target >= 0.95 of the ceiling;
(d) for contrast, the same with ``__getitems__`` hidden (one ``__getitem__`` per image).

Steps are few (the data is 32 batches an epoch; runs cross epoch boundaries) and rows are skipped, not
run short, when the time budget is near.

    PYTHONPATH=. python3 benchmarks/gpu_hdf5.py --out $OUT/hdf5_h200.json
    PYTHONPATH=. python3 benchmarks/gpu_hdf5.py --quick          # CPU, tiny, proves the path end to end
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _shared import hdf5_store, quick_out

from lightning_gpuopt._common import format_table
from lightning_gpuopt.bench.measure import ThroughputMeter, plain_loop_throughput, write_results
from lightning_gpuopt.bench.synthetic import make_jpeg_folder
from lightning_gpuopt.data.hdf5 import HDF5ImageDataset

T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


class _PerItem(torch.utils.data.Dataset):
    """The HDF5 dataset with ``__getitems__`` hidden: the DataLoader fetches one index at a time."""

    def __init__(self, ds: HDF5ImageDataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> Any:
        return self.ds[i]


def _gpu_sampler(gpu: bool) -> Any:
    if not gpu:
        return None
    try:
        from lightning_gpuopt.observe.nvml import NVMLSampler, nvml_device_index

        sampler = NVMLSampler(nvml_device_index(torch.device("cuda", 0)), period_s=0.1)
        sampler.start()
        return sampler
    except Exception as err:  # GPU-Util is informative only; the throughput figures stand without it
        print(f"(no NVML sampling: {err})")
        return None


def lightning_run(
    h5: Path, workers: int | str, per_item: bool, cfg: dict[str, Any], gpu: bool
) -> dict[str, Any]:
    import lightning.pytorch as pl

    from lightning_gpuopt.bench.models import ImageClassifier
    from lightning_gpuopt.data.datamodule import OptimizedDataModule
    from lightning_gpuopt.data.tuning import TuningConfig

    class PerItemData(OptimizedDataModule):
        def train_dataset(self) -> Any:
            return _PerItem(HDF5ImageDataset(h5))

    cls = PerItemData if per_item else OptimizedDataModule
    dm = cls(
        h5,
        backend="hdf5",
        batch_size=cfg["batch"],
        num_workers=workers,
        image_size=cfg["image_size"],
        storage_size=cfg["storage"],
        tuning=TuningConfig(budget_s=cfg["tune_budget_s"], cache_dir=tempfile.mkdtemp(prefix="gpuopt_tune_")),
    )
    model = ImageClassifier(cfg["model"], num_classes=cfg["classes"], lr=0.01)
    model = model.to(memory_format=torch.channels_last)
    sampler = _gpu_sampler(gpu)

    class Meter(ThroughputMeter):
        """Also reads the NVML window over the timed steps only (not tuning, start-up, cuDNN autotuning)."""

        window: dict[str, Any] = {}

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            started = self._t0 is not None
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
            if sampler is not None and not started and self._t0 is not None:
                sampler.window()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            super().on_train_end(trainer, pl_module)
            if sampler is not None:
                self.window = sampler.window()

    meter = Meter(warmup=cfg["warmup"])
    trainer = pl.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        precision="16-mixed" if gpu else "32-true",
        max_steps=cfg["warmup"] + cfg["steps"],
        limit_val_batches=0,
        num_sanity_val_steps=0,
        benchmark=gpu,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[meter],
    )
    t0 = time.perf_counter()
    try:
        trainer.fit(model, datamodule=dm)
    finally:
        if sampler is not None:
            sampler.stop()
    window = meter.window
    return {
        "samples_per_sec": meter.samples_per_sec,
        "num_workers": dm.num_workers,
        "gpu_util_mean": window.get("gpu/util"),
        "gpu_sm_active": window.get("gpu/sm_active"),
        "wall_s": time.perf_counter() - t0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/hdf5_h200.json")
    parser.add_argument("--data-root", default="/tmp/gpuopt_data")
    parser.add_argument("--workers", default="4,6,8,12,auto", help="comma-separated num_workers values")
    parser.add_argument(
        "--repeats", type=int, default=2, help="passes over the worker list, alternating order; median kept"
    )
    parser.add_argument("--budget-s", type=float, default=220.0)
    parser.add_argument("--quick", action="store_true", help="CPU, tiny images and model")
    args = parser.parse_args()
    args.out = quick_out(args.out, parser.get_default("out"), args.quick)
    gpu = torch.cuda.is_available() and not args.quick
    if args.quick:
        root = make_jpeg_folder(
            Path(args.data_root) / "quick_hdf5_48",
            num_images=48,
            num_classes=4,
            image_size=(64, 48),
            workers=1,
        )
        h5 = Path(args.data_root) / "quick_hdf5_48_32.h5"
        cfg = dict(
            model="small",
            classes=4,
            batch=8,
            image_size=28,
            storage=32,
            steps=3,
            warmup=2,
            tune_budget_s=3.0,
        )
        workers = [0, 1]
        args.repeats = 1
    else:
        if gpu:
            torch.backends.cudnn.benchmark = True  # same setting for the ceiling and the Lightning runs
        root = make_jpeg_folder(Path(args.data_root) / "imagenet_8192", num_images=8192, num_classes=100)
        h5 = Path(args.data_root) / "imagenet_8192_256.h5"
        cfg = dict(
            model="resnet50",
            classes=100,
            batch=256,
            image_size=224,
            storage=256,
            steps=120,
            warmup=15,
            tune_budget_s=10.0,
        )
        workers = [w if w == "auto" else int(w) for w in args.workers.split(",")]
    gen_s = elapsed()

    conversion = hdf5_store(root, h5, cfg["storage"])
    conversion.update(bytes=h5.stat().st_size, path=str(h5))
    ds = HDF5ImageDataset(h5)
    ds.__getitems__(list(range(len(ds))))  # page cache warm, as in any epoch after the first

    from lightning_gpuopt.bench.models import build_model

    device = "cuda" if gpu else "cpu"
    ceiling = plain_loop_throughput(
        build_model(cfg["model"], cfg["classes"]),
        batch_size=cfg["batch"],
        image_size=cfg["image_size"],
        num_classes=cfg["classes"],
        steps=cfg["steps"],
        warmup=cfg["warmup"],
        dtype=torch.float16 if gpu else None,
        device=device,
    )
    rows: list[dict[str, Any]] = [
        {"name": "ceiling: plain loop, batch on GPU", "samples_per_sec": ceiling, "ratio_to_ceiling": 1.0}
    ]
    plan: list[tuple[int | str, bool]] = []
    for r in range(max(1, args.repeats)):  # alternate the order so drift hits every count alike
        plan += [(w, False) for w in (workers if r % 2 == 0 else workers[::-1])]
    plan.append((8 if gpu else 1, True))
    per_run = None
    skipped = []
    runs: dict[str, list[dict[str, Any]]] = {}
    for w, per_item in plan:
        name = f"Lightning + HDF5 {'per-item' if per_item else '__getitems__'}, workers={w}"
        if per_run is not None and elapsed() + per_run * 1.3 + (10 if w == "auto" else 0) > args.budget_s:
            skipped.append(name)
            continue
        r = lightning_run(h5, w, per_item, cfg, gpu)
        per_run = max(per_run or 0.0, r["wall_s"])
        print(
            f"[{elapsed():.0f}s] {name}: {r['samples_per_sec']} samples/s, workers {r['num_workers']}",
            flush=True,
        )
        runs.setdefault(name, []).append(r)
    for name, rs in runs.items():
        rates = sorted(x["samples_per_sec"] for x in rs if x["samples_per_sec"])
        if not rates:
            continue
        sps = statistics.median(rates)
        chosen = sorted({x["num_workers"] for x in rs})
        label = name + (f" (-> {', '.join(map(str, chosen))})" if name.endswith("auto") else "")
        rows.append(
            {
                "name": label,
                "samples_per_sec": sps,
                "ratio_to_ceiling": sps / ceiling if sps else None,
                "runs_ratio_to_ceiling": [round(x / ceiling, 4) for x in rates],
                "gpu_util_mean": statistics.mean(x["gpu_util_mean"] for x in rs)
                if all(x["gpu_util_mean"] is not None for x in rs)
                else None,
                "num_workers": chosen[0] if len(chosen) == 1 else chosen,
                "wall_s": sum(x["wall_s"] for x in rs),
            }
        )
    best = max((r["ratio_to_ceiling"] or 0.0) for r in rows[1:]) if len(rows) > 1 else None
    write_results(
        args.out,
        rows,
        conversion=conversion,
        setup_seconds=gen_s,
        config=cfg,
        skipped_rows=skipped,
        target={"ratio_to_ceiling": 0.95, "best": best, "met": bool(best and best >= 0.95)},
        total_seconds=elapsed(),
    )
    print(
        f"wrote {args.out}  (conversion: {conversion}; total {elapsed():.0f} s; skipped: {skipped or 'none'})"
    )
    print(
        format_table(
            rows,
            [
                "name",
                "samples_per_sec",
                "ratio_to_ceiling",
                "runs_ratio_to_ceiling",
                "gpu_util_mean",
                "num_workers",
            ],
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
