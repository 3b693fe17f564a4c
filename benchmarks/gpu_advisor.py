"""Scenario runs for BottleneckAdvisor: does it name what starves the GPU, and stay quiet when nothing does?

Each scenario is a short Lightning fit of ResNet-50 built to have one known problem; the advisor (with a
``GPUStatsMonitor`` feeding it GPU-Util and SM activity) runs unchanged in every one. A row records the
expected verdict, the verdicts raised, whether they match, and the evidence the advisor gave.

    1 decode-bound      large JPEGs (1360x1020, quality 95, ~1.2 MB) decoded by PIL in as many workers as
                        cores, fp16 + channels_last, batch 128
    2 too-few-workers   ImageNet-sized JPEGs (500x375, ~110 kB) with 2 workers
    3 fp32              precision "32-true" on GPU-resident batches
    4 nchw              "16-mixed" without channels_last
    5 tiny-batch        batch 4: launch-bound, or host-bound where the monitor measures the GPU idling
                        between steps (the same finding: the host cannot keep the GPU fed)
    6 healthy           "16-mixed" + channels_last + cudnn.benchmark, batch 256 on the GPU, ImageClassifier's
                        default fused SGD: no warning allowed
    7 unfused-fp16      as healthy, but ImageClassifier(fused=False): Lightning's GradScaler.step reads
                        found_inf with .item() every step (amp-host-sync); CUDA only, skipped by --quick

Why the decode-bound scenario uses large JPEGs: an ImageNet-sized JPEG (500x375, ~110 kB) is cheap enough to
decode that a GPU host's workers keep up with ResNet-50. A 1360x1020 one at quality 95 holds about ten times
the entropy-coded bytes, all of which must be read, and ``load_canvas`` can only draft it at half scale
(``Image.draft``; a quarter would fall below the 256 px stored side), so each image costs several times the
decoding and the workers fall behind the GPU. The 1,536 images are generated once and reused from
``--data-root``. Warm-up and window are ``num_workers`` steps: every worker delivers a whole batch at about
the same time, so the wait comes once every ``num_workers`` steps and windows of that length each hold one.

``ratio_to_ceiling`` compares each scenario's samples/s with the plain PyTorch loop (fp16, channels_last,
batch 256, GPU-resident data) measured in the same run.

    PYTHONPATH=. python3 benchmarks/gpu_advisor.py --out benchmarks/results/gpu_advisor.json
    PYTHONPATH=. python3 benchmarks/gpu_advisor.py --only decode-bound --out /tmp/advisor_decode.json
    PYTHONPATH=. python3 benchmarks/gpu_advisor.py --quick      # CPU, tiny sizes; writes to the temp folder
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _shared import quick_out
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt._common import format_table
from lightning_gpuopt.bench.measure import ThroughputMeter, plain_loop_throughput, write_results
from lightning_gpuopt.bench.models import ImageClassifier, build_model
from lightning_gpuopt.observe.advisor import BottleneckAdvisor
from lightning_gpuopt.observe.gpu_stats import GPUStatsMonitor


@dataclass
class Scenario:
    name: str
    expected: str | None  # verdict kind that must be raised; None: no warning may be raised
    cause: str | None = None  # expected Verdict.cause where the kind has causes
    alternative: str | None = None  # another kind that counts as the expected finding
    data: str = "device"  # "device" (GPU-resident batches) or "jpeg" (OptimizedDataModule over a JPEG folder)
    folder: str = "imagenet"  # with data="jpeg": which JPEG_FOLDERS entry
    precision: str = "16-mixed"
    channels_last: bool = True
    benchmark: bool = True
    batch_size: int = 256
    num_workers: int = 0
    warmup: int = 10  # equal to window: warm-up ends with the monitor's first window
    window: int = 10  # the monitor's logging window, judged by the advisor
    windows: int = 3
    needs_cuda: bool = True  # the expected verdict can only be checked on a GPU
    cuda_only: str | None = None  # reason to skip the scenario without CUDA (a CPU run would check nothing)
    fused: bool | None = None  # ImageClassifier(fused=...): None is fused SGD on CUDA
    extra: dict[str, Any] = field(default_factory=dict)


# make_jpeg_folder arguments of the generated folders, full-size (GPU) and quick (CPU)
JPEG_FOLDERS: dict[str, dict[str, Any]] = {
    "imagenet": {"num_images": 8192, "num_classes": 100},  # 500x375, quality 90, ~110 kB
    "large": {
        "num_images": 1536,
        "num_classes": 100,
        "image_size": (1360, 1020),
        "quality": 95,
        "texture": 40.0,
    },
}
JPEG_FOLDERS_QUICK: dict[str, dict[str, Any]] = {
    "imagenet": {"num_images": 96, "num_classes": 4, "image_size": (320, 240), "workers": 1},
    "large": {"num_images": 32, "num_classes": 4, "image_size": (680, 510), "quality": 95, "texture": 40.0,
              "workers": 1},
}  # fmt: skip


def jpeg_folder_dir(name: str, spec: dict[str, Any]) -> str:
    """Folder name under --data-root; the ImageNet-sized one keeps the name other benchmarks share."""
    if name == "imagenet" and set(spec) == {"num_images", "num_classes"}:
        return f"imagenet_{spec['num_images']}"
    w, h = spec.get("image_size", (500, 375))
    return f"jpeg_{w}x{h}_q{spec.get('quality', 90)}_t{spec.get('texture', 28.0):g}_{spec['num_images']}"


class DeviceBatches(Dataset):
    """The same ready batch, already on the device, ``n`` times (``DataLoader(batch_size=None)``)."""

    def __init__(
        self, n: int, batch: int, size: int, classes: int, device: torch.device, channels_last: bool
    ):
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        self.x = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=fmt)
        self.y = torch.randint(0, classes, (batch,), device=device)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x, self.y


class TimedAdvisor(BottleneckAdvisor):
    """The advisor with the host time of its own per-batch hooks measured (for the overhead figure)."""

    hook_s = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self.hook_s += time.perf_counter() - t0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.hook_s += time.perf_counter() - t0


UNFUSED_CPU_SKIP = (
    "needs CUDA: a CPU run trains in 32-true without a GradScaler, and on the CPU found_inf.item() waits for no "
    "device, so there is no sync to diagnose"
)


def scenarios(quick: bool, cpus: int) -> list[Scenario]:
    if quick:  # CPU: tiny everything; only the host-side verdicts can be checked
        return [
            Scenario("decode-bound", "input-bound", "decode-bound", data="jpeg", folder="large",
                     batch_size=16, num_workers=max(1, cpus), warmup=3, window=3),
            Scenario("too-few-workers", "input-bound", "too-few-workers", data="jpeg", batch_size=16,
                     num_workers=0, warmup=3, window=3, needs_cuda=False),
            Scenario("fp32", "fp32-on-tensor-cores", precision="32-true", batch_size=8, warmup=3, window=3),
            Scenario("nchw", "nchw-convolutions", channels_last=False, batch_size=8, warmup=3, window=3),
            Scenario("tiny-batch", "launch-bound", batch_size=2, warmup=3, window=3, alternative="host-bound"),
            Scenario("healthy", None, batch_size=16, warmup=3, window=3, needs_cuda=False),
            Scenario("unfused-fp16", "amp-host-sync", fused=False, batch_size=16, warmup=3, window=3,
                     cuda_only=UNFUSED_CPU_SKIP),
        ]  # fmt: skip
    return [
        # a window of num_workers steps holds one round of whole-batch deliveries (see the module docstring)
        Scenario("decode-bound", "input-bound", "decode-bound", data="jpeg", folder="large", batch_size=128,
                 num_workers=cpus, warmup=max(8, cpus), window=max(8, cpus)),
        Scenario("too-few-workers", "input-bound", "too-few-workers", data="jpeg", batch_size=64,
                 num_workers=2, warmup=6, window=6),
        Scenario("fp32", "fp32-on-tensor-cores", precision="32-true", batch_size=128, warmup=10, window=10),
        Scenario("nchw", "nchw-convolutions", channels_last=False, warmup=8, window=8),
        Scenario("tiny-batch", "launch-bound", batch_size=4, warmup=40, window=40, alternative="host-bound"),
        Scenario("healthy", None, warmup=15, window=15),
        Scenario("unfused-fp16", "amp-host-sync", fused=False, warmup=15, window=15),
    ]  # fmt: skip


def run_scenario(
    sc: Scenario, args: argparse.Namespace, device: torch.device, jpeg_roots: dict[str, Path]
) -> dict:
    from lightning_gpuopt.compute.channels_last import apply_channels_last

    cuda = device.type == "cuda"
    steps = sc.warmup + sc.windows * sc.window
    model = ImageClassifier(build_model(args.model, args.classes), lr=0.01, fused=sc.fused)
    if sc.channels_last:
        apply_channels_last(model)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)  # memory-headroom reads this scenario's peak
    monitor = GPUStatsMonitor(log_every_n_steps=sc.window, sample_period_s=0.05)
    # window_steps=None: the advisor judges the monitor's windows
    advisor = TimedAdvisor(warmup_steps=sc.warmup, window_steps=None, min_windows=2, verbose=False)
    meter = ThroughputMeter(warmup=sc.warmup)
    trainer = Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        precision=sc.precision if cuda else "32-true",  # CPU autocast has no fp16
        benchmark=sc.benchmark if cuda else None,
        max_steps=steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        callbacks=[
            monitor,
            advisor,
            meter,
        ],  # monitor first: its window is in `history` when the advisor looks
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=args.tmp,
    )
    t0 = time.perf_counter()
    if sc.data == "jpeg":
        from lightning_gpuopt.data.datamodule import OptimizedDataModule

        dm = OptimizedDataModule(
            str(jpeg_roots[sc.folder]), backend="folder", batch_size=sc.batch_size,
            num_workers=sc.num_workers, image_size=args.image_size,
        )  # fmt: skip
        trainer.fit(model, datamodule=dm)
    else:
        ds = DeviceBatches(steps, sc.batch_size, args.image_size, args.classes, device, sc.channels_last)
        trainer.fit(model, DataLoader(ds, batch_size=None, num_workers=0))
    seconds = time.perf_counter() - t0

    raised = advisor.verdicts
    kinds = [v.kind for v in raised]
    warnings_ = [v.label for v in raised if v.severity == "warning"]
    if sc.needs_cuda and not cuda:
        ok: bool | None = None  # the rule needs a GPU; the run only proves the scenario executes
    elif sc.expected is None:
        ok = not warnings_
    else:
        match = [
            v
            for v in raised
            if v.kind in (sc.expected, sc.alternative) and (sc.cause is None or v.cause == sc.cause)
        ]
        ok = bool(match)
    expected_v = next((v for v in raised if v.kind == sc.expected), None)
    gpu = monitor.summary()
    # the advisor's own cost: its hooks' host time a step (windows included) against the measured step time
    hook_us = 1e6 * advisor.hook_s / steps
    step_s = sc.batch_size / meter.samples_per_sec if meter.samples_per_sec else None
    row = {
        "name": sc.name,
        "expected": sc.expected if sc.cause is None else f"{sc.expected} ({sc.cause})",
        "got": [v.label for v in raised],
        "warnings": warnings_,
        "pass": ok,
        "samples_per_sec": meter.samples_per_sec,
        "gpu_util_mean": gpu.get("gpu/util"),
        "sm_active_mean": gpu.get("gpu/sm_active"),
        "data_wait_frac": gpu.get("time/data_wait_frac"),
        "evidence": expected_v.evidence if expected_v is not None else None,
        "severity": expected_v.severity if expected_v is not None else None,
        "verdicts": [v.to_dict() for v in raised],
        "windows": [
            {"step": h["step"], "diagnosed": h["diagnosed"], "raised": h["raised"]} for h in advisor.history
        ],
        "config": advisor.config.to_dict() if advisor.config is not None else None,
        "setup": {
            "precision": sc.precision,
            "fused_sgd": sc.fused,
            "channels_last": sc.channels_last,
            "cudnn_benchmark": sc.benchmark,
            "batch_size": sc.batch_size,
            "num_workers": sc.num_workers,
            "data": sc.data,
            "jpeg_folder": str(jpeg_roots[sc.folder]) if sc.data == "jpeg" else None,
            "steps": steps,
            "warmup_steps": sc.warmup,
            "window_steps": sc.window,
        },
        "advisor_hook_us_per_step": hook_us,
        "advisor_overhead_frac": hook_us * 1e-6 / step_s if step_s else None,
        "seconds": seconds,
        "kinds": kinds,
    }
    del trainer, model, advisor, monitor
    gc.collect()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="benchmarks/results/gpu_advisor.json")
    parser.add_argument("--quick", action="store_true", help="CPU-sized run (small model, tiny images)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="no new scenario after 80%% of this (default 150 s, --quick 900 s)",
    )
    parser.add_argument("--data-root", default="/tmp/gpuopt_data")
    parser.add_argument("--only", default=None, help="comma-separated scenario names")
    args = parser.parse_args()
    args.out = quick_out(args.out, parser.get_default("out"), args.quick)
    t_start = time.perf_counter()
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*validation_step.*")

    cuda = torch.cuda.is_available() and not args.quick
    if args.budget_s is None:
        args.budget_s = 150.0 if cuda else 900.0
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    args.model = "resnet50" if cuda else "small"
    args.classes = 100 if cuda else 4
    args.image_size = 224 if cuda else 32
    tmp = tempfile.TemporaryDirectory(prefix="gpu_advisor_")
    args.tmp = tmp.name

    specs = scenarios(not cuda, cpus)
    if args.only:
        keep = {name.strip() for name in args.only.split(",") if name.strip()}
        unknown = keep - {s.name for s in specs}
        if unknown:
            parser.error(
                f"--only: unknown scenario(s) {sorted(unknown)}; choose from {[s.name for s in specs]}"
            )
        specs = [s for s in specs if s.name in keep]

    from lightning_gpuopt.bench.synthetic import make_jpeg_folder

    jpeg_roots: dict[str, Path] = {}
    folder_specs = JPEG_FOLDERS if cuda else JPEG_FOLDERS_QUICK
    for name in dict.fromkeys(s.folder for s in specs if s.data == "jpeg"):  # only the folders needed
        t0 = time.perf_counter()
        spec = folder_specs[name]
        base = Path(args.data_root) if cuda else Path(tmp.name)
        jpeg_roots[name] = make_jpeg_folder(base / jpeg_folder_dir(name, spec), **spec)
        print(
            f"JPEG folder {name!r} ready in {time.perf_counter() - t0:.1f} s: {jpeg_roots[name]}", flush=True
        )

    ceiling = None
    if cuda:
        ceiling = plain_loop_throughput(build_model("resnet50", args.classes), 256, num_classes=args.classes,
                                        steps=30, warmup=10)  # fmt: skip
        print(f"ceiling (plain loop, fp16 + channels_last, batch 256): {ceiling:,.0f} img/s", flush=True)
        gc.collect()
        torch.cuda.empty_cache()

    rows: list[dict] = []
    for sc in specs:
        elapsed = time.perf_counter() - t_start
        if elapsed > args.budget_s * 0.8:
            rows.append({"name": sc.name, "expected": sc.expected, "pass": None, "skipped": "time budget"})
            continue
        if sc.cuda_only and not cuda:
            rows.append({"name": sc.name, "expected": sc.expected, "pass": None, "skipped": sc.cuda_only})
            print(f"{sc.name}: skipped ({sc.cuda_only})", flush=True)
            continue
        row = run_scenario(sc, args, device, jpeg_roots)
        if ceiling and row["samples_per_sec"]:
            row["ratio_to_ceiling"] = row["samples_per_sec"] / ceiling
        rows.append(row)
        print(f"{sc.name}: pass={row['pass']} got={row['got']} ({row['seconds']:.1f} s)", flush=True)

    checked = [r for r in rows if r.get("pass") is not None]
    by_name = {r["name"]: r for r in rows}
    # what the GradScaler's per-step sync costs: the unfused run against the fused (healthy) one, same setup
    fused_sps = by_name.get("healthy", {}).get("samples_per_sec")
    unfused_sps = by_name.get("unfused-fp16", {}).get("samples_per_sec")
    unfused_over_healthy = unfused_sps / fused_sps if fused_sps and unfused_sps else None
    write_results(
        args.out,
        rows,
        ceiling_samples_per_sec=ceiling,
        model=args.model,
        quick=not cuda,
        all_pass=bool(checked) and all(r["pass"] for r in checked),
        unfused_over_healthy=unfused_over_healthy,
        max_advisor_overhead_frac=max((r.get("advisor_overhead_frac") or 0.0 for r in rows), default=None),
        seconds=time.perf_counter() - t_start,
    )
    table_rows = [
        {
            **r,
            "got": "(skipped)" if r.get("skipped") else ", ".join(r.get("got") or []) or "-",
            "pass": {True: "yes", False: "NO", None: "n/a"}[r.get("pass")],
        }
        for r in rows
    ]
    print(f"results: {args.out}")
    if unfused_over_healthy is not None:
        print(f"unfused-fp16 / healthy (fused) samples/s: {unfused_over_healthy:.3f}")
    print(format_table(table_rows, ["name", "expected", "pass", "got", "samples_per_sec", "ratio_to_ceiling",
                                    "gpu_util_mean", "sm_active_mean", "data_wait_frac", "advisor_overhead_frac"]))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
