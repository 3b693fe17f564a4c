"""Does GPUStatsMonitor's ``gpu/idle_frac`` read starvation right? Checked against CUPTI, on one GPU.

Three Lightning fits of ResNet-50 (torchvision; a small built-in convnet where torchvision is missing),
16-mixed + channels_last, batch 256, each with ``GPUStatsMonitor`` and ``torch.profiler`` (CUPTI) on:

- ``gpu-resident``: the batch is already on the GPU; the loader yields the same CUDA tensors.
- ``naive``: 0 workers; JPEGs decoded with PIL, resized and turned into floats on the CPU, per sample.
- ``throttled-50``: the resident batch, handed out on a clock at half the rate ``gpu-resident`` measured.

Each fit has two monitor windows of ``P`` steps: the first is warm-up, the second is compared. The truth
comes from the profiler's trace of the same run: every step's CPU range (``record_function``), each
kernel assigned to the step whose range launched it (CUDA runtime/driver correlation ids), the kernels
on the training stream (the stream with the most kernel time). Over the same steps as the monitor's second
window (the monitor's ``idle_meter.pending`` says which steps it deferred into that window), from the end of
the step before to the end of the last:

- ``truth_idle_frac``: share of that GPU time with no kernel running on the training stream (the union of
  kernel intervals); idle inside a step counts too.
- ``truth_between_steps_idle_frac``: only the gaps from one step's last kernel to the next step's first:
  what ``gpu/idle_frac`` measures with its two CUDA events a step.

Last, the monitor's overhead: one fit on the resident batch, the monitor's hooks (and its NVML thread) on and
off in alternating blocks of steps (ABBA), each block timed between two ``torch.cuda.synchronize``.

    PYTHONPATH=. python3 benchmarks/gpu_idle.py --out benchmarks/results
    PYTHONPATH=. python3 benchmarks/gpu_idle.py --quick --out /tmp/gpu_idle_quick   # CPU, tiny sizes

It writes ``<out>/<date>-idle-<gpu>.json`` and prints a table last.
"""

from __future__ import annotations

import argparse
import bisect
import datetime as _dt
import gzip
import json
import statistics
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_gpuopt._common import IMAGENET_MEAN, IMAGENET_STD, format_table
from lightning_gpuopt._imports import _TORCHVISION_AVAILABLE
from lightning_gpuopt.bench.measure import write_results
from lightning_gpuopt.bench.models import ImageClassifier, build_model
from lightning_gpuopt.bench.synthetic import make_jpeg_folder
from lightning_gpuopt.observe.gpu_stats import GPUStatsMonitor

STEP_PREFIX = "gpu_idle_step_"
T0 = time.perf_counter()


# ---------------------------------------------------------------------------------------- timeline math
def trace_events(trace: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The event list of a Chrome trace as ``torch.profiler`` exports it."""
    return trace if isinstance(trace, list) else list(trace.get("traceEvents", []))


def step_kernels(
    events: Sequence[dict[str, Any]], prefix: str = STEP_PREFIX
) -> tuple[dict[int, list[tuple[float, float, int]]], list[tuple[float, float, int]]]:
    """Kernels by step, and all kernels, as ``(start_us, end_us, stream)``.

    A step is a ``user_annotation`` range named ``<prefix><index>``; a kernel belongs to the step whose range
    holds the CPU timestamp of the runtime or driver call that launched it (matched by correlation id).
    Kernels launched outside every step are in the second list only.
    """
    ranges = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), int(e["name"][len(prefix) :]))
        for e in events
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(prefix)
    )
    starts = [r[0] for r in ranges]
    launch_ts = {
        e["args"]["correlation"]: float(e["ts"])
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    by_step: dict[int, list[tuple[float, float, int]]] = {}
    kernels: list[tuple[float, float, int]] = []
    for e in events:
        if e.get("cat") != "kernel":
            continue
        args = e.get("args", {})
        kernel = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), int(args.get("stream", -1)))
        kernels.append(kernel)
        t = launch_ts.get(args.get("correlation"))
        if t is None:
            continue
        i = bisect.bisect_right(starts, t) - 1
        if i >= 0 and t <= ranges[i][1]:
            by_step.setdefault(ranges[i][2], []).append(kernel)
    return by_step, kernels


def training_stream(by_step: dict[int, list[tuple[float, float, int]]]) -> int:
    """The stream with the most kernel time among the steps' kernels."""
    busy: dict[int, float] = {}
    for kernels in by_step.values():
        for start, end, stream in kernels:
            busy[stream] = busy.get(stream, 0.0) + (end - start)
    if not busy:
        raise ValueError("no kernel was launched inside a step range: is CUDA activity profiled?")
    return max(busy, key=lambda s: busy[s])


def union_length(intervals: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` clipped to ``[lo, hi]``."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted((max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start  # type: ignore[operator]
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start  # type: ignore[operator]
    return total


def truth_fractions(
    by_step: dict[int, list[tuple[float, float, int]]],
    kernels: Sequence[tuple[float, float, int]],
    first: int,
    last: int,
    stream: int | None = None,
) -> dict[str, float]:
    """Idle shares of the training stream over steps ``first..last``, from the end of step ``first - 1``.

    Returns ``truth_idle_frac`` (no kernel running on the stream: union of busy intervals),
    ``truth_between_steps_idle_frac`` (gaps from one step's last kernel to the next one's first), the
    window's length in ms and how many steps it holds.
    """
    stream = training_stream(by_step) if stream is None else stream

    def on_stream(k: int) -> list[tuple[float, float, int]]:
        mine = [kn for kn in by_step.get(k, []) if kn[2] == stream]
        if not mine:
            raise ValueError(f"step {k} launched no kernel on stream {stream}")
        return mine

    prev_end = max(e for _, e, _ in on_stream(first - 1))
    lo, between = prev_end, 0.0
    for k in range(first, last + 1):
        mine = on_stream(k)
        between += max(min(s for s, _, _ in mine) - prev_end, 0.0)
        prev_end = max(e for _, e, _ in mine)
    hi = prev_end
    span = hi - lo
    busy = union_length([(s, e) for s, e, st in kernels if st == stream], lo, hi)
    return {
        "truth_idle_frac": 1.0 - busy / span,
        "truth_between_steps_idle_frac": between / span,
        "truth_window_ms": span / 1000.0,
        "truth_steps": float(last - first + 1),
        "training_stream": float(stream),
    }


# ------------------------------------------------------------------------------------------- data
class Resident(IterableDataset):
    """Yields the same batch ``steps`` times; with ``period_s`` no sooner than one every ``period_s``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, steps: int, period_s: float = 0.0) -> None:
        self.x, self.y, self.steps, self.period_s = x, y, steps, period_s

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        due = time.perf_counter()
        for _ in range(self.steps):
            if self.period_s:
                due += self.period_s
                time.sleep(max(due - time.perf_counter(), 0.0))  # on a clock: the loader's rate, not a delay
            yield self.x, self.y


class DecodeOnCPU(Dataset):
    """PIL decode, resize to ``size`` x ``size`` and normalise to float on the CPU, one sample at a time."""

    def __init__(self, files: list[Path], size: int, length: int) -> None:
        self.files, self.size, self.length = files, size, length
        self.mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        with Image.open(self.files[i % len(self.files)]) as img:
            rgb = img.convert("RGB").resize((self.size, self.size), Image.BILINEAR)
        x = torch.from_numpy(np.asarray(rgb).copy()).permute(2, 0, 1).float().div_(255.0)
        return (x - self.mean) / self.std, i % 10


# ------------------------------------------------------------------------------------------ fits
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timeline(pl.Callback):
    """Profiles the fit with CUPTI, a named CPU range a step; notes the steps the monitor deferred.

    Placed after the monitor: its ranges open after the monitor's start event and close after its end event,
    and at ``window_step`` it reads how many steps the monitor's first window left for the second.
    """

    def __init__(self, monitor: GPUStatsMonitor, window_step: int, trace_path: Path | None) -> None:
        self.monitor, self.window_step, self.trace_path = monitor, window_step, trace_path
        self.deferred: int | None = None
        self._prof: Any = None
        self._range: Any = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.trace_path is not None:
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            self._prof = torch.profiler.profile(activities=acts)
            self._prof.start()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int
    ) -> None:
        self._range = torch.profiler.record_function(f"{STEP_PREFIX}{trainer.global_step}")
        self._range.__enter__()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if trainer.global_step == self.window_step:
            meter = self.monitor.idle_meter
            self.deferred = meter.pending if meter is not None else 0

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._prof is not None:
            _sync(pl_module.device)  # every kernel's record is in before CUPTI is flushed
            self._prof.stop()
            self._prof.export_chrome_trace(str(self.trace_path))
            self._prof = None


def _trainer(cfg: dict[str, Any], steps: int, callbacks: list[pl.Callback]) -> pl.Trainer:
    return pl.Trainer(
        accelerator=cfg["accelerator"],
        devices=1,
        precision=cfg["precision"],
        max_steps=steps,
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        benchmark=cfg["accelerator"] == "gpu",
    )


def _fit(cfg: dict[str, Any], module: pl.LightningModule, loader: DataLoader, steps: int, cbs: list) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*(num_workers|log_every_n_steps|no logger|val_dataloader).*"
        )
        _trainer(cfg, steps, cbs).fit(module, train_dataloaders=loader)


def make_module(cfg: dict[str, Any]) -> ImageClassifier:
    module = ImageClassifier(build_model(cfg["model"], cfg["num_classes"]))
    return module.to(memory_format=torch.channels_last)  # type: ignore[call-overload,no-any-return]


def run_row(
    name: str, cfg: dict[str, Any], loader: DataLoader, p: int, device: torch.device, trace_dir: Path
) -> dict[str, Any]:
    """One fit of ``2 p`` steps: the monitor's second window against the trace of the same steps."""
    monitor = GPUStatsMonitor(log_every_n_steps=p, gpu=device.type == "cuda")
    cuda = device.type == "cuda"
    trace = trace_dir / f"{name}.json" if cuda else None
    timeline = Timeline(monitor, p, trace)
    t0 = time.perf_counter()
    _fit(cfg, make_module(cfg), loader, 2 * p, [monitor, timeline])
    window = monitor.history[-1] if len(monitor.history) == 2 else {}
    deferred = timeline.deferred or 0
    row: dict[str, Any] = {
        "name": name,
        "gpu_idle_frac": window.get("gpu/idle_frac"),
        "truth_idle_frac": None,
        "truth_between_steps_idle_frac": None,
        "samples_per_sec": window.get("throughput/samples_per_sec"),
        "gpu_util_mean": window.get("gpu/util"),
        "sm_active_mean": window.get("gpu/sm_active"),
        "data_wait_frac": window.get("time/data_wait_frac"),
        "gpu_blocked_frac": window.get("time/gpu_blocked_frac"),
        "cpu_main_pct": window.get("host/cpu_main_pct"),
        "cpu_workers_pct": window.get("host/cpu_workers_pct"),
        "step_ms": window.get("time/step_ms"),
        "monitor_windows": len(monitor.history),
        "steps_deferred_into_window": deferred,
        "compared_steps": [p - deferred, 2 * p - 1],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if trace is not None:
        try:
            by_step, kernels = step_kernels(trace_events(json.loads(trace.read_text())))
            truth = truth_fractions(by_step, kernels, p - deferred, 2 * p - 1)
            row.update(truth)
            row["samples_per_sec_gpu_timeline"] = (
                cfg["batch_size"] * truth["truth_steps"] / (truth["truth_window_ms"] / 1000.0)
            )
            if row["gpu_idle_frac"] is not None:
                row["error_vs_between_steps"] = row["gpu_idle_frac"] - truth["truth_between_steps_idle_frac"]
            trace.unlink()
        except (ValueError, KeyError, OSError) as err:
            row["truth_error"] = f"{type(err).__name__}: {err}"
            with open(trace, "rb") as src, gzip.open(trace_dir / f"{name}.json.gz", "wb") as dst:
                dst.write(src.read())  # kept for a look at why
    print(f"[{time.perf_counter() - T0:6.1f}s] {name}: {json.dumps(row, default=str)}", flush=True)
    return row


class Toggle(pl.Callback):
    """Calls the monitor's hooks in alternate blocks of steps only (ABBA), timing each block."""

    def __init__(self, monitor: GPUStatsMonitor, warmup: int, block: int) -> None:
        self.monitor, self.warmup, self.block = monitor, warmup, block
        self.times: dict[str, list[float]] = {"on": [], "off": []}
        self.on = True
        self._t: float | None = None
        self._blocks = 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.monitor.setup(trainer, pl_module, stage)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.monitor.teardown(trainer, pl_module, stage)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.monitor.on_train_start(trainer, pl_module)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.monitor.on_train_epoch_start(trainer, pl_module)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int
    ) -> None:
        g = trainer.global_step
        if g >= self.warmup and (g - self.warmup) % self.block == 0:
            _sync(pl_module.device)
            if self._t is not None:
                self.times["on" if self.on else "off"].append((time.perf_counter() - self._t) / self.block)
            self.on = self._blocks % 4 in (1, 2)  # off, on, on, off, off, on, on, off, ...
            self._blocks += 1
            sampler = self.monitor.sampler
            if sampler is not None and self.on:  # the NVML thread is part of what the monitor costs
                sampler.start()
            elif sampler is not None:
                sampler.stop()
            self._t = time.perf_counter()
        if self.on:
            self.monitor.on_train_batch_start(trainer, pl_module, batch, i)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if self.on:
            self.monitor.on_train_batch_end(trainer, pl_module, outputs, batch, i)


def overhead(cfg: dict[str, Any], x: torch.Tensor, y: torch.Tensor, device: torch.device) -> dict[str, Any]:
    warmup, block, blocks = cfg["overhead_warmup"], cfg["overhead_block"], cfg["overhead_blocks"]
    steps = warmup + block * blocks + 1
    monitor = GPUStatsMonitor(log_every_n_steps=cfg["p"], gpu=device.type == "cuda")
    toggle = Toggle(monitor, warmup, block)
    loader = DataLoader(Resident(x, y, steps), batch_size=None, num_workers=0)
    _fit(cfg, make_module(cfg), loader, steps, [toggle])
    on, off = statistics.median(toggle.times["on"]), statistics.median(toggle.times["off"])
    return {
        "overhead_frac": on / off - 1.0,
        "step_ms_monitor_on": 1000.0 * on,
        "step_ms_monitor_off": 1000.0 * off,
        "blocks_ms": {k: [round(1000.0 * v, 3) for v in vs] for k, vs in toggle.times.items()},
        "design": f"one fit, {warmup} warm-up steps, then blocks of {block} steps alternating off/on ABBA, "
        "each timed between two synchronizes; median step time of each mode",
    }


# ------------------------------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="benchmarks/results", help="folder for the results JSON")
    parser.add_argument("--data-root", default="/tmp/gpuopt_data")
    parser.add_argument("--quick", action="store_true", help="CPU, tiny sizes: proves the script end to end")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    model = "resnet50" if cuda and _TORCHVISION_AVAILABLE else "small"
    if cuda:
        torch.backends.cudnn.benchmark = True
        cfg: dict[str, Any] = dict(
            model=model, image_size=224, batch_size=256, num_classes=1000, precision="16-mixed",
            accelerator="gpu", p=20, p_naive=8, jpegs=512, overhead_warmup=15, overhead_block=10,
            overhead_blocks=12,
        )  # fmt: skip
    else:
        cfg = dict(
            model=model, image_size=32, batch_size=8, num_classes=10, precision="32-true", accelerator="cpu",
            p=3, p_naive=3, jpegs=16, overhead_warmup=2, overhead_block=2, overhead_blocks=4,
        )  # fmt: skip
    s, b = cfg["image_size"], cfg["batch_size"]
    x = torch.randn(b, 3, s, s, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, cfg["num_classes"], (b,), device=device)
    size = (500, 375) if cuda else (64, 48)
    folder = make_jpeg_folder(Path(args.data_root) / f"idle_{cfg['jpegs']}_{size[0]}", cfg["jpegs"], 10, size)
    files = sorted(folder.rglob("*.jpg"))
    p = cfg["p"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(args.out)
        trace_dir = Path(tmp)
        resident = DataLoader(Resident(x, y, 2 * p), batch_size=None, num_workers=0)
        rows.append(run_row("gpu-resident", cfg, resident, p, device, trace_dir))
        rate = rows[0]["samples_per_sec"] or 0.0
        period = 2.0 * b / rate if rate > 0 else 0.1  # half the measured rate
        pn = cfg["p_naive"]
        naive = DataLoader(DecodeOnCPU(files, s, 2 * pn * b), batch_size=b, num_workers=0)
        rows.append(run_row("naive", cfg, naive, pn, device, trace_dir))
        throttled = DataLoader(Resident(x, y, 2 * p, period_s=period), batch_size=None, num_workers=0)
        rows.append(run_row("throttled-50", cfg, throttled, p, device, trace_dir))
        rows[-1]["loader_period_ms"] = 1000.0 * period
        for left in trace_dir.glob("*.json.gz"):
            out_dir.mkdir(parents=True, exist_ok=True)
            left.replace(out_dir / f"idle-trace-{left.name}")
    over = overhead(cfg, x, y, device)
    print(f"[{time.perf_counter() - T0:6.1f}s] overhead: {json.dumps(over)}", flush=True)
    gpu = torch.cuda.get_device_name(0) if cuda else "cpu"
    slug = "h200" if "H200" in gpu else ("cpu" if not cuda else gpu.lower().replace(" ", "-"))
    path = Path(args.out) / f"{_dt.date.today().isoformat()}-idle-{slug}.json"
    write_results(
        path,
        rows,
        config=cfg,
        overhead_frac=over["overhead_frac"],
        overhead=over,
        truth="torch.profiler (CUPTI) kernel timestamps on the training stream",
        seconds=round(time.perf_counter() - T0, 1),
    )
    cols = [
        "name",
        "gpu_idle_frac",
        "truth_between_steps_idle_frac",
        "truth_idle_frac",
        "samples_per_sec",
        "gpu_util_mean",
        "data_wait_frac",
        "gpu_blocked_frac",
    ]
    print(f"\nresults: {path}")
    print(f"monitor overhead: {100.0 * over['overhead_frac']:+.2f}% of step time")
    print(format_table(rows, cols))


if __name__ == "__main__":
    main()
