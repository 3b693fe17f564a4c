"""BottleneckAdvisor: does it name what starves the GPU, and stay quiet when nothing does?

Each scenario is a short fit of ``UserClassifier`` (torchvision's ResNet-50, its own SGD) built to have one
known problem, with ``GPUStatsMonitor`` first and the advisor judging the monitor's windows:

    healthy          the preset on GPU-resident batches: no warning (the preset fuses the user's SGD, so
                     no amp-host-sync either)
    unfused-16-mixed Trainer(precision="16-mixed") + ChannelsLast, the user's unfused SGD: amp-host-sync
    fp32             Trainer(precision="32-true"): fp32-on-tensor-cores
    nchw             Trainer(precision="16-mixed") without channels_last: nchw-convolutions
    tiny-batch       the preset at batch 4: launch-bound (or host-bound: the GPU idles between steps)
    host-bound       the preset with a callback that syncs and sleeps 30 ms after each step: host-bound
    too-few-workers  the preset fed by OptimizedDataModule(jpegs, num_workers=2), batch 64: input-bound
    decode-bound     1,536 JPEGs of 1360x1020 at quality 95 (about 1.2 MB: PIL draft mode can only halve
                     them) decoded on a reading thread a core, batch 128: input-bound (decode-bound)

A row holds the verdicts raised, whether the expected one is among them (``pass``; null where the verdict
needs a GPU and the run has none), the monitor's means and the expected verdict's evidence. What the
advisor costs a step is ``overhead.py``'s row ``monitor+advisor``.

    python3 benchmarks/advisor.py                           # one H200: about 4 minutes
    python3 benchmarks/advisor.py --only decode-bound
    python3 benchmarks/advisor.py --quick                   # CPU smoke run: the host-side verdicts only
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _shared import free, measured_fit, results_path
from _zoo import UserClassifier

from lightning_gpuopt import BottleneckAdvisor, ChannelsLast, GPUStatsMonitor
from lightning_gpuopt._common import available_cpus, format_table
from lightning_gpuopt.bench.measure import write_results


@dataclass(frozen=True)
class Scenario:
    """One fit with one known problem; ``expected`` kinds count (any one), ``()``: no warning allowed."""

    name: str
    expected: tuple[str, ...]
    cause: str | None = None
    preset: bool = True
    precision: str | None = None  # a plain Trainer's precision (with ``preset=False``)
    channels_last: bool = True
    batch: int = 256
    data: str = "resident"  # "resident", "jpegs" (500x375) or "large" (1360x1020)
    workers: int = 0
    window: int = 15
    stall_s: float = 0.0
    gpu_only: bool = True  # the verdict rests on GPU readings: a CPU run only proves the scenario runs
    extra: dict[str, Any] = field(default_factory=dict)


def quick_scenario(s: Scenario) -> Scenario:
    """CPU-sized: batches of 16 at most, windows of 3 steps; 0 workers (2 keep up with a CPU fit)."""
    return replace(s, batch=min(s.batch, 16), window=3, workers=0 if s.workers == 2 else min(s.workers, 2))


def scenarios(cpus: int) -> list[Scenario]:
    return [
        Scenario("healthy", (), gpu_only=False),
        Scenario("unfused-16-mixed", ("amp-host-sync",), preset=False, precision="16-mixed"),
        Scenario("fp32", ("fp32-on-tensor-cores",), preset=False, precision="32-true", batch=128, window=10),
        Scenario("nchw", ("nchw-convolutions",), preset=False, precision="16-mixed", channels_last=False,
                 window=8),
        Scenario("tiny-batch", ("launch-bound", "host-bound"), batch=4, window=40),
        Scenario("host-bound", ("host-bound",), stall_s=0.03),
        Scenario("too-few-workers", ("input-bound",), "too-few-workers", batch=64, data="jpegs", workers=2,
                 window=6, gpu_only=False),
        # a window of num_workers steps holds one round of whole-batch deliveries
        Scenario("decode-bound", ("input-bound",), "decode-bound", batch=128, data="large", workers=cpus,
                 window=max(8, cpus)),
    ]  # fmt: skip


#: make_jpeg_folder arguments of the generated folders, full size and ``--quick``
LARGE = {"quality": 95, "texture": 40.0}
FOLDERS = {
    "jpegs": ({"num_images": 8192, "num_classes": 100},
              {"num_images": 96, "num_classes": 4, "image_size": (320, 240)}),
    "large": ({"num_images": 1536, "num_classes": 100, "image_size": (1360, 1020), **LARGE},
              {"num_images": 32, "num_classes": 4, "image_size": (680, 510), **LARGE}),
}  # fmt: skip


class HostStall(pl.Callback):
    """After every training batch the host waits for the GPU, then does ``stall_s`` of other work."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        time.sleep(self.stall_s)


class Same(torch.utils.data.Dataset):
    """The same batch at every index (``HostDataLoader(..., batch_size=None)`` times its fetches)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return 10**6

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x, self.y


def feed(sc: Scenario, args: argparse.Namespace) -> dict[str, Any]:
    from lightning_gpuopt import OptimizedDataModule
    from lightning_gpuopt.data.loader import HostDataLoader

    if sc.data != "resident":
        dm = OptimizedDataModule(str(args.folders[sc.data]), backend="folder", batch_size=sc.batch,
                                 num_workers=sc.workers, image_size=args.image_size)  # fmt: skip
        return {"datamodule": dm}
    x = torch.randint(
        0, 256, (sc.batch, 3, args.image_size, args.image_size), dtype=torch.uint8, device=args.device
    )
    y = torch.randint(0, 100, (sc.batch,), device=args.device)
    return {"train_dataloaders": HostDataLoader(Same(x, y), batch_size=None)}


def judge(sc: Scenario, raised: list[Any], cuda: bool) -> bool | None:
    if sc.gpu_only and not cuda:
        return None
    if not sc.expected:
        return not [v for v in raised if v.severity == "warning"]
    return any(v.kind in sc.expected and (sc.cause is None or v.cause == sc.cause) for v in raised)


def run(sc: Scenario, args: argparse.Namespace) -> dict[str, Any]:
    """The scenario's fit: three judged windows after one of warm-up; its row."""
    cuda = args.device == "cuda"
    monitor = GPUStatsMonitor(log_every_n_steps=sc.window, sample_period_s=0.05, ceiling=cuda)
    advisor = BottleneckAdvisor(warmup_steps=sc.window, window_steps=None, min_windows=2, verbose=False)
    callbacks: list[pl.Callback] = [monitor, advisor]  # monitor first: its window is in `history` in time
    callbacks += [HostStall(sc.stall_s)] if sc.stall_s else []
    callbacks += [ChannelsLast()] if sc.channels_last and not sc.preset else []
    precision = sc.precision if cuda or sc.precision != "16-mixed" else "bf16-mixed"
    trainer = {
        "max_steps": 4 * sc.window,
        "benchmark": cuda,
        **({} if sc.preset else {"precision": precision}),
    }
    if cuda:
        torch.cuda.reset_peak_memory_stats()  # memory-headroom reads this scenario's peak
    t0 = time.perf_counter()
    m = measured_fit(UserClassifier(args.arch, num_classes=100), sc.window, 3 * sc.window, device=args.device,
                     preset=sc.preset, callbacks=callbacks, trainer=trainer, **feed(sc, args))  # fmt: skip
    raised = advisor.verdicts
    means = monitor.summary()
    expected = next((v for v in raised if v.kind in sc.expected), None)
    row = {
        "name": sc.name, "expected": " | ".join(sc.expected) or "no warning", "cause": sc.cause,
        "got": [v.label for v in raised], "pass": judge(sc, raised, cuda),
        "samples_per_sec": m.samples_per_sec, "p50_ms": m.p50_ms, "p90_ms": m.p90_ms,
        "gpu_util_mean": means.get("gpu/util"), "gpu_idle_frac": means.get("gpu/idle_frac"),
        "data_wait_frac": means.get("time/data_wait_frac"),
        "loader_wait_frac": means.get("time/loader_wait_frac"),
        "evidence": expected.evidence if expected is not None else None,
        "verdicts": [v.to_dict() for v in raised], "seconds": round(time.perf_counter() - t0, 1),
        "setup": {k: v for k, v in vars(sc).items() if k not in ("name", "expected")},
    }  # fmt: skip
    del monitor, advisor
    free()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="results JSON (default results/<date>-advisor-<gpu>.json)")
    p.add_argument("--quick", action="store_true", help="a CPU smoke run: small model, tiny images")
    p.add_argument("--only", default=None, help="comma-separated scenario names")
    p.add_argument("--data", default="/tmp/gpuopt_data", help="where the JPEG folders are made")
    p.add_argument("--arch", default="resnet50")
    args = p.parse_args(argv)
    args.device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    specs = scenarios(available_cpus())
    if args.only:
        keep = {s.strip() for s in args.only.split(",") if s.strip()}
        if unknown := sorted(keep - {s.name for s in specs}):
            p.error(f"--only: unknown {unknown}; choose from {', '.join(s.name for s in specs)}")
        specs = [s for s in specs if s.name in keep]
    args.image_size = 32 if args.quick else 224
    if args.quick:
        args.arch = "small"
        # no GradScaler on a CPU: nothing for amp-host-sync to find
        specs = [quick_scenario(s) for s in specs if s.name != "unfused-16-mixed"]
    from lightning_gpuopt.bench.synthetic import make_jpeg_folder

    args.folders = {}
    for name in dict.fromkeys(s.data for s in specs if s.data != "resident"):
        spec = FOLDERS[name][1 if args.quick else 0]
        folder = (
            "imagenet_8192" if name == "jpegs" and not args.quick else f"advisor_{name}_{spec['num_images']}"
        )
        args.folders[name] = make_jpeg_folder(Path(args.data) / folder, **spec)
    t0 = time.perf_counter()
    rows = []
    for sc in specs:
        rows.append(run(sc, args))
        print(
            f"{sc.name}: pass={rows[-1]['pass']} got={rows[-1]['got']} ({rows[-1]['seconds']} s)", flush=True
        )
    checked = [r["pass"] for r in rows if r["pass"] is not None]
    path = write_results(results_path(args.out, "advisor", args.quick), rows, quick=args.quick,
                         all_pass=all(checked) if checked else None,
                         seconds=time.perf_counter() - t0)  # fmt: skip
    verdict = {True: "yes", False: "NO", None: "n/a"}
    shown = [{**r, "got": ", ".join(r["got"]) or "-", "pass": verdict[r["pass"]]} for r in rows]
    print(format_table(shown, ["name", "expected", "pass", "got", "samples_per_sec", "gpu_util_mean",
                               "gpu_idle_frac", "data_wait_frac"]))  # fmt: skip
    print(f"wrote {path}")
    return 0 if all(checked) else 1


if __name__ == "__main__":
    sys.exit(main())
