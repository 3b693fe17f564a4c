"""GPUStatsMonitor on the GPU: what it costs, whether it reads busy and idle right, and a TensorBoard run.

1. Overhead: ResNet-50, "16-mixed" + channels_last, batch 256 already on the GPU (no data pipeline), through
   Lightning, alternating monitor off / on for a few repetitions; samples/s by ThroughputMeter; the plain
   PyTorch loop of the same model is the ceiling. Target: the monitor costs <= 1 % (median on / median off).
2. Busy vs idle: NVMLSampler readings during an fp16 matmul loop and during sleep (GPU-Util from the driver's
   sample buffer, cross-checked with nvmlDeviceGetUtilizationRates snapshots; GPM SM activity, occupancy and
   tensor activity).
3. A TensorBoard run under ``--tb-dir`` for the screenshot: one fit whose first half is fed from the host
   with a simulated 60 ms of loading per batch (the GPU starves) and whose second half gets batches already
   on the GPU, so GPU-Util and data-wait change visibly in the middle.

    PYTHONPATH=. python3 benchmarks/gpu_monitor.py --out benchmarks/results/gpu_monitor.json --tb-dir $OUT/tb
    PYTHONPATH=. python3 benchmarks/gpu_monitor.py --quick      # CPU, tiny sizes; writes to the temp folder
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from _shared import quick_out
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, IterableDataset

from lightning_gpuopt._common import format_table
from lightning_gpuopt.bench.measure import ThroughputMeter, plain_loop_throughput, write_results
from lightning_gpuopt.bench.models import ImageClassifier, build_model
from lightning_gpuopt.observe.gpu_stats import GPUStatsMonitor

T_START = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T_START


class Batches(IterableDataset):
    """Yields one pre-made batch ``steps`` times; before ``host_steps`` it yields a host copy after ``delay_s``."""

    def __init__(
        self, x: torch.Tensor, y: torch.Tensor, steps: int, host_steps: int = 0, delay_s: float = 0.0
    ):
        self.x, self.y, self.steps, self.host_steps, self.delay_s = x, y, steps, host_steps, delay_s
        self.host = (x.cpu(), y.cpu()) if host_steps else None

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(self.steps):
            if i < self.host_steps and self.host is not None:
                time.sleep(self.delay_s)  # stands in for decoding on the host
                yield self.host
            else:
                yield self.x, self.y


def make_batch(cfg: dict[str, Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    s, b = cfg["image_size"], cfg["batch_size"]
    x = torch.randn(b, 3, s, s, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, cfg["num_classes"], (b,), device=device)
    return x, y


def fit(
    module: ImageClassifier, cfg: dict[str, Any], loader: DataLoader, callbacks: list, **kw: Any
) -> Trainer:
    trainer = Trainer(
        accelerator=cfg["accelerator"],
        devices=1,
        precision=cfg["precision"],
        max_steps=cfg["steps"],
        logger=kw.pop("logger", False),
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        benchmark=cfg["accelerator"] == "gpu",
        **kw,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*(num_workers|does not have many workers|log_every_n_steps|val_dataloader).*"
        )
        trainer.fit(module, train_dataloaders=loader)
    return trainer


def overhead(cfg: dict[str, Any], device: torch.device) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    ceiling = plain_loop_throughput(
        build_model(cfg["model"], cfg["num_classes"]),
        cfg["batch_size"],
        cfg["image_size"],
        cfg["num_classes"],
        steps=cfg["steps"] - cfg["warmup"],
        warmup=cfg["warmup"],
        dtype=torch.float16 if device.type == "cuda" else None,
        device=device,
    )
    module = ImageClassifier(build_model(cfg["model"], cfg["num_classes"]))
    module = module.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    x, y = make_batch(cfg, device)

    def loader() -> DataLoader:
        return DataLoader(Batches(x, y, cfg["steps"]), batch_size=None, num_workers=0)

    fit(module, cfg, loader(), [])  # warm-up: cudnn autotuning, allocator, lazy init
    runs: dict[str, list[float]] = {"off": [], "on": []}
    last_monitor: GPUStatsMonitor | None = None
    for rep in range(cfg["reps"]):
        if rep > 0 and elapsed() > cfg["overhead_budget_s"]:
            break  # keep inside the time budget: fewer repetitions rather than an overrun
        for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
            meter = ThroughputMeter(warmup=cfg["warmup"])
            callbacks: list = [meter]
            if mode == "on":
                last_monitor = GPUStatsMonitor(log_every_n_steps=10, gpu=device.type == "cuda")
                callbacks.append(last_monitor)
            fit(module, cfg, loader(), callbacks)
            runs[mode].append(float(meter.samples_per_sec or 0.0))
    off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
    summary = last_monitor.summary() if last_monitor is not None else {}
    rows = [
        {"name": "plain loop (ceiling)", "samples_per_sec": ceiling, "ratio_to_ceiling": 1.0},
        {
            "name": "lightning, monitor off",
            "samples_per_sec": off,
            "ratio_to_ceiling": off / ceiling,
            "reps": runs["off"],
        },
        {
            "name": "lightning, GPUStatsMonitor on",
            "samples_per_sec": on,
            "ratio_to_ceiling": on / ceiling,
            "gpu_util_mean": summary.get("gpu/util"),
            "data_wait_frac": summary.get("time/data_wait_frac"),
            "sm_active_mean": summary.get("gpu/sm_active"),
            "tensor_active_mean": summary.get("gpu/tensor_active"),
            "reps": runs["on"],
        },
    ]
    overhead_pct = 100.0 * (1.0 - on / off) if off > 0 else None
    return rows, {
        "overhead_pct": overhead_pct,
        "overhead_target_pct": 1.0,
        "overhead_pass": overhead_pct is not None and overhead_pct <= 1.0,
        "monitor_last_window": last_monitor.last_window if last_monitor else None,
    }


def busy_idle(cfg: dict[str, Any], device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"skipped": "no CUDA device"}
    import pynvml

    from lightning_gpuopt.observe.nvml import NVMLSampler, nvml_device_index

    index = nvml_device_index(device)
    a = torch.randn(8192, 8192, device=device, dtype=torch.float16)
    out: dict[str, Any] = {"nvml_index": index}
    with NVMLSampler(index, period_s=0.1) as sampler:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        out["sample_buffer"] = sampler.uses_sample_buffer
        out["gpm"] = sampler.gpm_active

        def busy_for(seconds: float) -> list[int]:
            snaps = []
            t_end = time.perf_counter() + seconds
            while time.perf_counter() < t_end:
                for _ in range(8):
                    torch.matmul(a, a, out=a).clamp_(-1, 1)
                torch.cuda.synchronize(device)
                snaps.append(int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu))
            return snaps

        busy_for(1.0)  # ramp up clocks; not part of the window
        sampler.window()
        snaps = busy_for(cfg["busy_s"])
        out["busy"] = sampler.window()
        out["busy_utilization_rates_mean"] = statistics.mean(snaps)
        time.sleep(1.0)  # let the driver's utilisation average fall
        sampler.window()
        time.sleep(cfg["busy_s"])
        out["idle"] = sampler.window()
        out["idle_utilization_rates"] = int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    out["busy_util_pass"] = out["busy"].get("gpu/util", 0.0) >= 90.0
    out["idle_util_pass"] = out["idle"].get("gpu/util", 100.0) <= 10.0
    return out


def tensorboard_run(cfg: dict[str, Any], device: torch.device, tb_dir: Path) -> str:
    module = ImageClassifier(build_model(cfg["model"], cfg["num_classes"]))
    module = module.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    x, y = make_batch(cfg, device)
    steps = cfg["tb_steps"]
    data = Batches(x, y, steps, host_steps=steps // 2, delay_s=cfg["tb_delay_s"])
    logger = TensorBoardLogger(save_dir=str(tb_dir), name="gpu_monitor")
    monitor = GPUStatsMonitor(log_every_n_steps=cfg["tb_every"], gpu=device.type == "cuda")
    fit(
        module,
        {**cfg, "steps": steps},
        DataLoader(data, batch_size=None, num_workers=0),
        [monitor],
        logger=logger,
        log_every_n_steps=cfg["tb_every"],
    )
    return str(logger.log_dir)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="benchmarks/results/gpu_monitor.json")
    parser.add_argument(
        "--tb-dir", default="gpuopt_runs/gpu_monitor_tb", help="TensorBoard run for the screenshot"
    )
    parser.add_argument("--quick", action="store_true", help="CPU, tiny sizes: proves the script end to end")
    args = parser.parse_args()
    args.out = quick_out(args.out, parser.get_default("out"), args.quick)
    args.tb_dir = quick_out(args.tb_dir, parser.get_default("tb_dir"), args.quick)
    cuda = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        cfg: dict[str, Any] = dict(
            model="resnet50", image_size=224, batch_size=256, num_classes=1000, precision="16-mixed",
            accelerator="gpu", steps=60, warmup=15, reps=3, overhead_budget_s=55.0, busy_s=3.0,
            tb_steps=160, tb_every=5, tb_delay_s=0.06,
        )  # fmt: skip
    else:
        cfg = dict(
            model="small", image_size=32, batch_size=16, num_classes=10, precision="32-true",
            accelerator="cpu", steps=6, warmup=2, reps=1, overhead_budget_s=60.0, busy_s=0.5,
            tb_steps=8, tb_every=2, tb_delay_s=0.02,
        )  # fmt: skip
    if cuda:
        torch.backends.cudnn.benchmark = True
    rows, extra = overhead(cfg, device)
    t_overhead = elapsed()
    readings = busy_idle(cfg, device)
    tb_log_dir = tensorboard_run(cfg, device, Path(args.tb_dir))
    path = write_results(
        args.out,
        rows,
        config=cfg,
        **extra,
        busy_idle=readings,
        tensorboard_log_dir=tb_log_dir,
        seconds={"overhead": round(t_overhead, 1), "total": round(elapsed(), 1)},
    )
    print(f"\nresults: {path}\ntensorboard run: {tb_log_dir}")
    if "busy" in readings:
        b, i = readings["busy"], readings["idle"]
        print(
            f"busy: GPU-Util {b.get('gpu/util', float('nan')):.1f} % (utilization-rates snapshots "
            f"{readings['busy_utilization_rates_mean']:.1f} %), SM active {b.get('gpu/sm_active', float('nan')):.1f} %, "
            f"occupancy {b.get('gpu/sm_occupancy', float('nan')):.1f} %, tensor {b.get('gpu/tensor_active', float('nan')):.1f} %"
            f"\nidle: GPU-Util {i.get('gpu/util', float('nan')):.1f} %, power {i.get('gpu/power_w', float('nan')):.0f} W "
            f"(busy {b.get('gpu/power_w', float('nan')):.0f} W)"
        )
    pct = extra["overhead_pct"]
    verdict = "PASS" if extra["overhead_pass"] else "FAIL"
    print(f"monitor overhead: {pct:.2f} % (target <= 1 %: {verdict}); total {elapsed():.0f} s\n")
    print(
        format_table(rows, ["name", "samples_per_sec", "ratio_to_ceiling", "gpu_util_mean", "data_wait_frac"])
    )


if __name__ == "__main__":
    main()
