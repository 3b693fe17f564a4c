"""``GPUStatsMonitor``'s ``gpu/idle_frac`` against a CUPTI kernel timeline of the same steps, on one GPU.

Three Lightning fits of ResNet-50 (the built-in small network without torchvision), 16-mixed +
channels_last, each with the monitor and ``torch.profiler`` on: batches already on the GPU (no idle),
JPEGs decoded by PIL in the training process (mostly idle), and the resident batch handed out on a clock at
half the rate the first fit measured (about half idle). The monitor's second window is compared with the
timeline's gaps between one step's last kernel and the next step's first, over the same steps.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_gpuopt import GPUStatsMonitor
from lightning_gpuopt._common import IMAGENET_MEAN, IMAGENET_STD
from lightning_gpuopt._imports import _TORCHVISION_AVAILABLE
from lightning_gpuopt.bench.models import ImageClassifier, build_model
from lightning_gpuopt.bench.synthetic import make_jpeg_folder
from tests.gpu import _timeline as timeline

pytestmark = pytest.mark.gpu

BATCH, SIZE, CLASSES, STEPS = 256, 224, 1000, 20
#: the monitor's idle share may differ from the timeline's by this much (measured: 0.001-0.006)
TOLERANCE = 0.05


class Resident(IterableDataset):
    """The same batch ``steps`` times; with ``period_s`` no sooner than one every ``period_s`` (a clock)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, steps: int, period_s: float = 0.0) -> None:
        self.x, self.y, self.steps, self.period_s = x, y, steps, period_s

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        due = time.perf_counter()
        for _ in range(self.steps):
            if self.period_s:
                due += self.period_s
                time.sleep(max(due - time.perf_counter(), 0.0))
            yield self.x, self.y


class DecodeOnCPU(Dataset):
    """PIL decode, resize and normalise to float on the CPU, one sample at a time."""

    def __init__(self, files: list[Path], length: int) -> None:
        self.files, self.length = files, length
        self.mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        with Image.open(self.files[i % len(self.files)]) as img:
            rgb = img.convert("RGB").resize((SIZE, SIZE), Image.BILINEAR)
        x = torch.from_numpy(np.asarray(rgb).copy()).permute(2, 0, 1).float().div_(255.0)
        return (x - self.mean) / self.std, i % 10


class Timeline(pl.Callback):
    """Profiles the fit with CUPTI, one named CPU range a step; notes the steps the monitor deferred.

    Placed after the monitor, so its ranges hold the monitor's events; at ``window_step`` it reads how many
    steps the monitor's first window left for the second.
    """

    def __init__(self, monitor: GPUStatsMonitor, window_step: int, trace: Path) -> None:
        self.monitor, self.window_step, self.trace = monitor, window_step, trace
        self.deferred = 0
        self._prof: Any = None
        self._range: Any = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        self._prof = torch.profiler.profile(activities=acts)
        self._prof.start()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int
    ) -> None:
        self._range = torch.profiler.record_function(f"{timeline.STEP_PREFIX}{trainer.global_step}")
        self._range.__enter__()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        self._range.__exit__(None, None, None)
        if trainer.global_step == self.window_step:
            meter = self.monitor.idle_meter
            self.deferred = meter.pending if meter is not None else 0

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.cuda.synchronize(pl_module.device)  # every kernel's record is in before CUPTI is flushed
        self._prof.stop()
        self._prof.export_chrome_trace(str(self.trace))


def fit_and_compare(loader: DataLoader, p: int, trace: Path) -> dict[str, Any]:
    """A fit of ``2 p`` steps: the monitor's second window and the timeline's idle shares of those steps."""
    # no ceiling replay and no sync locator: their kernels, run between two steps at a window's end, are
    # no training step's, and the timeline would count them as the steps' busy time
    monitor = GPUStatsMonitor(log_every_n_steps=p, ceiling=False, sync_steps=0)
    probe = Timeline(monitor, p, trace)
    module = ImageClassifier(build_model("resnet50" if _TORCHVISION_AVAILABLE else "small", CLASSES))
    module = module.to(memory_format=torch.channels_last)
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, precision="16-mixed", max_steps=2 * p, logger=False, benchmark=True,
        callbacks=[monitor, probe], enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=loader)
    assert len(monitor.history) == 2, monitor.history
    window = monitor.history[-1]
    by_step, kernels = timeline.step_kernels(timeline.trace_events(json.loads(trace.read_text())))
    truth = timeline.truth_fractions(by_step, kernels, p - probe.deferred, 2 * p - 1)
    return {**window, **truth}


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(BATCH, 3, SIZE, SIZE, device="cuda").contiguous(memory_format=torch.channels_last)
    return x, torch.randint(0, CLASSES, (BATCH,), device="cuda")


@pytest.fixture(scope="module")
def resident(
    batch: tuple[torch.Tensor, torch.Tensor], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    loader = DataLoader(Resident(*batch, 2 * STEPS), batch_size=None)
    return fit_and_compare(loader, STEPS, tmp_path_factory.mktemp("idle") / "resident.json")


def test_resident_batches_read_busy(resident: dict[str, Any]) -> None:
    assert resident["gpu/idle_frac"] < TOLERANCE, resident
    assert abs(resident["gpu/idle_frac"] - resident["truth_between_steps_idle_frac"]) < TOLERANCE


def test_pil_decoding_in_the_training_process_reads_idle(tmp_path: Path) -> None:
    folder = make_jpeg_folder(tmp_path / "jpegs", num_images=512, num_classes=10, image_size=(500, 375))
    files = sorted(folder.rglob("*.jpg"))
    p = 8
    loader = DataLoader(DecodeOnCPU(files, 2 * p * BATCH), batch_size=BATCH, num_workers=0)
    row = fit_and_compare(loader, p, tmp_path / "naive.json")
    assert row["gpu/idle_frac"] > 0.8, row
    assert abs(row["gpu/idle_frac"] - row["truth_between_steps_idle_frac"]) < TOLERANCE, row


def test_a_loader_at_half_the_rate_reads_half_idle(
    batch: tuple[torch.Tensor, torch.Tensor], resident: dict[str, Any], tmp_path: Path
) -> None:
    period = 2.0 * BATCH / resident["throughput/samples_per_sec"]
    row = fit_and_compare(DataLoader(Resident(*batch, 2 * STEPS, period), batch_size=None), STEPS,
                          tmp_path / "throttled.json")  # fmt: skip
    assert 0.35 < row["gpu/idle_frac"] < 0.65, row
    assert abs(row["gpu/idle_frac"] - row["truth_between_steps_idle_frac"]) < TOLERANCE, row
