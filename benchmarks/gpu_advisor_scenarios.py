"""BottleneckAdvisor on a GPU: is it silent on a healthy run and right on the runs built to have one problem?

Every scenario is a short Lightning fit of ResNet-50 (torchvision; ``--model small`` without it) with a
``GPUStatsMonitor`` first and a ``BottleneckAdvisor`` following its windows:

    healthy            batches already on the GPU (a HostDataLoader, which times its next()), 16-mixed,
                       channels_last, fused SGD, cudnn.benchmark: no verdict at all
    starved            JPEGs decoded and resized by PIL in the training process (a plain DataLoader,
                       num_workers=0), batch 64: input-bound (too-few-workers)
    fast-kwargs-sgd    a plain torch.optim.SGD(momentum=0.9) under Trainer(**fast_trainer_kwargs(...)), whose
                       FusedOptimizer fuses it after the advisor's on_train_start: no amp-host-sync
    unfused-16-mixed   the same SGD under 16-mixed without FusedOptimizer: amp-host-sync
    host-bound         the healthy run with a callback that synchronizes and sleeps on the host after each
                       step: host-bound (the GPU idles between steps, the loader is quick)

A row holds the verdicts raised, whether they match, the monitor's means over the fit (GPU idle share between
steps, GPU-Util, data and loader wait, CPU load) and the evidence of the expected verdict. Runs in about two
minutes on one H200 (most of it cuDNN autotuning and model set-up).

    PYTHONPATH=. python3 benchmarks/gpu_advisor_scenarios.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt._common import IMAGENET_MEAN, IMAGENET_STD, available_cpus, format_table
from lightning_gpuopt.compute.channels_last import apply_channels_last
from lightning_gpuopt.compute.precision import fast_trainer_kwargs
from lightning_gpuopt.data.loader import HostDataLoader
from lightning_gpuopt.observe.advisor import BottleneckAdvisor
from lightning_gpuopt.observe.gpu_stats import GPUStatsMonitor


def _write_results(path: Path, rows: list[dict[str, Any]], **extra: Any) -> Path:
    """The bench harness's results file, or the same shape where the harness is not importable."""
    try:
        from lightning_gpuopt.bench.measure import write_results
    except ImportError:
        try:
            from lightning_gpuopt.benchmarking import write_results  # type: ignore[no-redef]
        except ImportError:
            write_results = None  # type: ignore[assignment]
    if write_results is not None:
        return write_results(path, rows, **extra)
    import lightning

    machine = {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "driver": None,
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "cpus": available_cpus(),
    }
    doc = {
        "machine": machine,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "rows": rows,
        **extra,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return path


# ------------------------------------------------------------------------------------------------ model, data
def build_net(name: str, classes: int) -> nn.Module:
    if name == "resnet50":
        import torchvision

        return torchvision.models.resnet50(weights=None, num_classes=classes)
    return nn.Sequential(  # a small convnet for machines without torchvision
        nn.Conv2d(3, 64, 7, 2, 3), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(64, 128, 3, 2, 1), nn.BatchNorm2d(128), nn.ReLU(),
        nn.Conv2d(128, 256, 3, 2, 1), nn.BatchNorm2d(256), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, classes),
    )  # fmt: skip


class Classifier(pl.LightningModule):
    """Cross-entropy classifier trained with SGD + momentum; ``fused`` as ``torch.optim.SGD`` takes it."""

    def __init__(self, net: nn.Module, fused: bool | None) -> None:
        super().__init__()
        self.net = net
        self.fused = fused

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9, fused=self.fused)


class DeviceBatches(Dataset):
    """The same batch, already on the GPU, ``n`` times (``DataLoader(batch_size=None)``)."""

    def __init__(self, n: int, batch: int, size: int, classes: int, device: torch.device) -> None:
        self.x = torch.randn(batch, 3, size, size, device=device).contiguous(
            memory_format=torch.channels_last
        )
        self.y = torch.randint(0, classes, (batch,), device=device)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x, self.y


def make_jpegs(folder: Path, n: int, size: tuple[int, int] = (500, 375)) -> list[Path]:
    """``n`` JPEGs of ImageNet's typical size with photo-like texture (smooth noise), quality 90."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    files = []
    for i in range(n):
        path = folder / f"{i:05d}.jpg"
        if not path.exists():
            coarse = rng.integers(0, 256, (size[1] // 8, size[0] // 8, 3), dtype=np.uint8)
            img = Image.fromarray(coarse).resize(size, Image.BICUBIC)
            noise = rng.integers(-20, 20, (size[1], size[0], 3))
            pixels = np.clip(np.asarray(img, dtype=np.int16) + noise, 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(path, quality=90)
        files.append(path)
    return files


class PILImages(Dataset):
    """Decode, resize (shorter side 256), centre-crop and normalize a JPEG with PIL, as a naive loader does."""

    def __init__(self, files: list[Path], size: int, classes: int) -> None:
        self.files, self.size, self.classes = files, size, classes
        self.mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        with Image.open(self.files[i]) as im:
            im = im.convert("RGB")
            w, h = im.size
            short = round(self.size * 256 / 224)
            im = im.resize(
                (max(short, round(w * short / h)), max(short, round(h * short / w))), Image.BILINEAR
            )
            left, top = (im.width - self.size) // 2, (im.height - self.size) // 2
            im = im.crop((left, top, left + self.size, top + self.size))
            x = torch.from_numpy(np.asarray(im, dtype=np.uint8).copy()).permute(2, 0, 1).float().div_(255)
        return (x - self.mean) / self.std, i % self.classes


class HostStall(pl.Callback):
    """After every training batch the host waits for the GPU, then does ``stall_s`` of other work."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        torch.cuda.synchronize()
        time.sleep(self.stall_s)


# ------------------------------------------------------------------------------------------------ scenarios
@dataclass
class Scenario:
    name: str
    expected: str | None  # the verdict kind that must be raised; None: no verdict at all
    absent: str | None = None  # a verdict kind that must NOT be raised (with expected None: others allowed)
    cause: str | None = None
    data: str = "device"  # "device" (GPU-resident batches) or "jpeg" (PIL in the training process)
    batch_size: int = 256
    window: int = 15
    fused: bool | None = True
    fast_kwargs: bool = False  # Trainer(**fast_trainer_kwargs(...)) instead of an explicit 16-mixed Trainer
    stall_s: float = 0.0


SCENARIOS = [
    Scenario("healthy", None),
    Scenario("starved", "input-bound", cause="too-few-workers", data="jpeg", batch_size=64, window=6),
    Scenario("fast-kwargs-sgd", None, absent="amp-host-sync", fused=None, fast_kwargs=True),
    Scenario("unfused-16-mixed", "amp-host-sync", fused=None),
    Scenario("host-bound", "host-bound", stall_s=0.03),
]


def run(sc: Scenario, args: argparse.Namespace, device: torch.device, files: list[Path]) -> dict[str, Any]:
    steps = sc.window * 4  # warm-up of one window, then three windows judged
    model = Classifier(build_net(args.model, args.classes), fused=sc.fused)
    monitor = GPUStatsMonitor(log_every_n_steps=sc.window, sample_period_s=0.05)
    advisor = BottleneckAdvisor(warmup_steps=sc.window, window_steps=None, min_windows=2, verbose=False)
    callbacks: list[pl.Callback] = [monitor, advisor]  # monitor first: its window is in `history` in time
    if sc.stall_s:
        callbacks.append(HostStall(sc.stall_s))
    common: dict[str, Any] = {
        "accelerator": "gpu",
        "devices": 1,
        "max_steps": steps,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "default_root_dir": args.tmp,
    }
    if sc.fast_kwargs:
        trainer = pl.Trainer(**fast_trainer_kwargs(model, device, callbacks=callbacks, **common))
    else:
        apply_channels_last(model)
        trainer = pl.Trainer(precision="16-mixed", benchmark=True, callbacks=callbacks, **common)
    if sc.data == "jpeg":
        loader = DataLoader(PILImages(files, args.image_size, args.classes), batch_size=sc.batch_size,
                            shuffle=True, num_workers=0, pin_memory=True, drop_last=True)  # fmt: skip
    else:
        # HostDataLoader keeps fetch_seconds: the advisor tells time in the loader from other host time
        ds = DeviceBatches(steps + 1, sc.batch_size, args.image_size, args.classes, device)
        loader = HostDataLoader(ds, batch_size=None)
    torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    trainer.fit(model, loader)
    seconds = time.perf_counter() - t0

    raised = advisor.verdicts
    got = [v.kind for v in raised]
    if sc.expected is None:
        ok = (sc.absent not in got) if sc.absent else not raised
    else:
        ok = any(v.kind == sc.expected and (sc.cause is None or v.cause == sc.cause) for v in raised)
        ok = ok and (sc.absent is None or sc.absent not in got)
    means = monitor.summary()
    expected_v = next((v for v in raised if v.kind == sc.expected), None)
    row = {
        "name": sc.name,
        "expected": (sc.expected if sc.cause is None else f"{sc.expected} ({sc.cause})") or "silent",
        "absent": sc.absent,
        "got": [v.label for v in raised],
        "pass": ok,
        "samples_per_sec": means.get("throughput/samples_per_sec"),
        "ratio_to_ceiling": None,
        "gpu_idle_frac": means.get("gpu/idle_frac"),
        "gpu_util_mean": means.get("gpu/util"),
        "data_wait_frac": means.get("time/data_wait_frac"),
        "loader_wait_frac": means.get("time/loader_wait_frac"),
        "cpu_busy_frac": means.get("host/cpu_busy_frac"),
        "evidence": expected_v.evidence if expected_v is not None else None,
        "verdicts": [v.to_dict() for v in raised],
        "windows": [{"step": h["step"], "diagnosed": h["diagnosed"], "raised": h["raised"]} for h in advisor.history],
        "unfused_optimizers": list(advisor.config.unfused_optimizers or ()) if advisor.config else None,
        "setup": {"batch_size": sc.batch_size, "data": sc.data, "fused": sc.fused, "fast_trainer_kwargs": sc.fast_kwargs,
                  "host_stall_s": sc.stall_s, "steps": steps, "window_steps": sc.window, "model": args.model},
        "seconds": seconds,
    }  # fmt: skip
    del trainer, model, advisor, monitor, loader
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", default="benchmarks/results", help="folder for <date>-advisor-scenarios-h200.json"
    )
    parser.add_argument(
        "--model", default=None, choices=["resnet50", "small"], help="default: resnet50 if torchvision"
    )
    parser.add_argument("--only", default=None, help="comma-separated scenario names")
    parser.add_argument(
        "--data-root", default=None, help="folder for the generated JPEGs (default: a temp folder)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the advisor's GPU verdicts cannot be checked on a CPU)")
    if args.model is None:
        try:
            import torchvision  # noqa: F401

            args.model = "resnet50"
        except ImportError:
            args.model = "small"
    args.classes, args.image_size = 100, 224
    specs = SCENARIOS
    if args.only:
        keep = {s.strip() for s in args.only.split(",") if s.strip()}
        unknown = keep - {s.name for s in SCENARIOS}
        if unknown:
            parser.error(
                f"--only: unknown scenario(s) {sorted(unknown)}; choose from {[s.name for s in SCENARIOS]}"
            )
        specs = [s for s in SCENARIOS if s.name in keep]
    tmp = tempfile.TemporaryDirectory(prefix="advisor_scenarios_")
    args.tmp = tmp.name
    t_start = time.perf_counter()
    device = torch.device("cuda", 0)
    files: list[Path] = []
    if any(s.data == "jpeg" for s in specs):
        root = Path(args.data_root) if args.data_root else Path(tmp.name, "jpegs")
        files = make_jpegs(root, 384)
        print(f"{len(files)} JPEGs in {root} ({time.perf_counter() - t_start:.1f} s)", flush=True)

    rows = []
    for sc in specs:
        row = run(sc, args, device, files)
        rows.append(row)
        print(f"{sc.name}: pass={row['pass']} got={row['got']} ({row['seconds']:.1f} s)", flush=True)

    date = dt.datetime.now(dt.timezone.utc).date().isoformat()
    gpu = torch.cuda.get_device_name(0).lower()
    tag = "h200" if "h200" in gpu else gpu.replace("nvidia", "").strip().replace(" ", "-")
    path = _write_results(
        Path(args.out, f"{date}-advisor-scenarios-{tag}.json"),
        rows,
        model=args.model,
        all_pass=all(r["pass"] for r in rows),
        cpus=available_cpus(),
        seconds=time.perf_counter() - t_start,
    )
    print(f"results: {path}")
    table = [{**r, "got": ", ".join(r["got"]) or "-", "pass": "yes" if r["pass"] else "NO"} for r in rows]
    print(format_table(table, ["name", "expected", "pass", "got", "samples_per_sec", "gpu_idle_frac",
                               "gpu_util_mean", "data_wait_frac", "loader_wait_frac", "cpu_busy_frac"]))  # fmt: skip
    return 0 if all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    raise SystemExit(main())
