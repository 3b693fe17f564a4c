"""Where a fitted step's GPU time goes: a ``torch.profiler`` window over a few steady steps of a fit.

Fits ``UserClassifier`` through ``Trainer(**fast_trainer_kwargs(model, compile=...))`` on each feed and, after
``--warmup`` steps, profiles ``--steps`` steps: per step, the kernel time of each CUDA stream, the training
stream's idle time, and the host's blocking CUDA calls (synchronizations and copies), the top ones by time.

    python3 benchmarks/profile_step.py --feeds resident,hdf5      # one H200: about 3 minutes
"""

from __future__ import annotations

import argparse
import collections
import gzip
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _shared import QUIET_FIT, hdf5_store, resident
from _user import UserClassifier

from lightning_gpuopt.bench.synthetic import make_jpeg_folder


class Phases(pl.Callback):
    """Host wall time of each phase of a step (perf_counter at Lightning's hooks, no synchronization) and the
    GPU's step time (a CUDA event at every batch end), over ``steps`` steps after ``start``; then stops."""

    HOOKS = ("fetch", "forward", "backward", "optimizer", "end")

    def __init__(self, start: int, steps: int) -> None:
        self.start, self.steps, self.n = start, steps, 0
        self.t: dict[str, list[float]] = {k: [] for k in self.HOOKS}
        self.events: list[Any] = []
        self.mark = 0.0

    def _lap(self, key: str) -> None:
        now = time.perf_counter()
        if self.start <= self.n < self.start + self.steps:
            self.t[key].append((now - self.mark) * 1e3)
        self.mark = now

    def on_train_batch_start(self, *args: Any) -> None:
        self._lap("fetch")

    def on_before_backward(self, *args: Any) -> None:
        self._lap("forward")

    def on_after_backward(self, *args: Any) -> None:
        self._lap("backward")

    def on_before_optimizer_step(self, *args: Any) -> None:
        self._lap("optimizer")

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self._lap("end")
        if self.start <= self.n <= self.start + self.steps:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.events.append(ev)
        self.n += 1
        if self.n > self.start + self.steps:
            torch.cuda.synchronize()
            trainer.should_stop = True

    def summary(self) -> dict[str, Any]:
        gpu = sorted(a.elapsed_time(b) for a, b in itertools.pairwise(self.events))
        q = lambda v, f: round(sorted(v)[int(f * (len(v) - 1))], 2)  # noqa: E731
        out = {f"host_{k}_ms": [q(v, 0.5), q(v, 0.9)] for k, v in self.t.items() if v}
        out["gpu_step_ms"] = [q(gpu, 0.5), q(gpu, 0.9)]
        return out


class Window(pl.Callback):
    """Profiles steps ``start`` .. ``start + steps`` of the fit, then stops it."""

    def __init__(self, start: int, steps: int, trace: Path) -> None:
        self.start, self.steps, self.trace, self.prof = start, steps, trace, None
        self.n = 0

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        if self.n == self.start:
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()
            self.prof = profile(activities=[ProfilerActivity.CUDA])
            self.prof.__enter__()

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self.n += 1
        if self.n == self.start + self.steps:
            torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            self.prof.export_chrome_trace(str(self.trace))
            trainer.should_stop = True


def analyse(trace: Path, steps: int) -> dict[str, Any]:
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_stream: dict[Any, list[tuple[float, float]]] = collections.defaultdict(list)
    for e in kernels:
        by_stream[e["args"].get("stream")].append((e["ts"], e["ts"] + e["dur"]))
    lo = min(a for v in by_stream.values() for a, _ in v)
    hi = max(b for v in by_stream.values() for _, b in v)
    streams = {}
    for s, spans in by_stream.items():
        spans.sort()
        busy, end = 0.0, -1.0
        for a, b in spans:
            if b > end:
                busy += b - max(a, end)
                end = b
        streams[str(s)] = {"busy_ms_per_step": busy / 1e3 / steps, "ops": len(spans)}
    main = max(streams, key=lambda s: streams[s]["ops"])
    api: collections.Counter[str] = collections.Counter()
    launch: dict[Any, float] = {}  # correlation id -> when the host launched it
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            api[e["name"]] += e["dur"]
            if "correlation" in e.get("args", {}):
                launch[e["args"]["correlation"]] = e["ts"]
    lags = sorted((e["ts"] - launch[c]) / 1e3 for e in kernels
                  if (c := e["args"].get("correlation")) in launch)  # fmt: skip
    main_spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels if str(e["args"].get("stream")) == main)
    gaps = sorted(((b[0] - a[1]) / 1e3 for a, b in itertools.pairwise(main_spans)), reverse=True)
    return {
        "launch_to_start_ms_p10_p50_p90": [round(lags[int(f * (len(lags) - 1))], 2) for f in (0.1, 0.5, 0.9)],
        "main_stream_largest_gaps_ms": [round(g, 2) for g in gaps[:12]],
        "window_ms_per_step": (hi - lo) / 1e3 / steps,
        "main_stream": main,
        "streams": streams,
        "main_idle_ms_per_step": (hi - lo) / 1e3 / steps - streams[main]["busy_ms_per_step"],
        "host_cuda_api_ms_per_step": {k: v / 1e3 / steps for k, v in api.most_common(8)},
    }


def main(argv: list[str] | None = None) -> int:
    from lightning_gpuopt import OptimizedDataModule, fast_trainer_kwargs

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--feeds", default="resident,hdf5")
    p.add_argument("--data", default="/tmp/gpuopt_data")
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "profile_step"))
    p.add_argument("--phases", type=int, default=150, help="steps timed by phase (no profiler) before the window")
    p.add_argument("--repeats", type=int, default=2, help="phase fits per feed, taking turns")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU: it profiles the GPU's streams")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jpegs = make_jpeg_folder(Path(args.data) / "imagenet_4096", num_images=4096, num_classes=100)
    store = Path(args.data) / "imagenet_4096_256.h5"
    hdf5_store(jpegs, store, 256)
    model = UserClassifier("resnet50", num_classes=100)
    report: dict[str, Any] = {}

    def fit(name: str, callback: pl.Callback) -> None:
        if name == "resident":
            data: dict[str, Any] = {"train_dataloaders": resident(256, 224, "cuda", classes=100)}
        else:
            data = {"datamodule": OptimizedDataModule(str(store if name == "hdf5" else jpegs), batch_size=256)}
        kwargs = fast_trainer_kwargs(model, "cuda", compile=True, accelerator="gpu", devices=1, max_epochs=-1,
                                     **QUIET_FIT, callbacks=[callback])  # fmt: skip
        pl.Trainer(**kwargs).fit(model, **data)
        model.trainer = None  # type: ignore[assignment]

    feeds = args.feeds.split(",")
    for turn in range(args.repeats):
        for name in feeds:
            phases = Phases(args.warmup, args.phases)
            fit(name, phases)
            report.setdefault(name, {})[f"phases_{turn}"] = phases.summary()
            print(name, turn, json.dumps(phases.summary()), flush=True)
    for name in feeds:
        window = Window(args.warmup, args.steps, out / f"{name}.json")
        fit(name, window)
        report[name]["profile"] = analyse(out / f"{name}.json", args.steps)
        with open(out / f"{name}.json", "rb") as src, gzip.open(out / f"{name}.json.gz", "wb") as dst:
            dst.write(src.read())
        (out / f"{name}.json").unlink()
        print(name, json.dumps(report[name]["profile"], indent=1), flush=True)
    (out / "summary.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
