"""Shared pieces of the BottleneckAdvisor tests: a configuration and a window of a healthy H200 run, small
datasets, a tiny classifier and a CPU Trainer."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

H200: dict[str, Any] = {
    "device_type": "cuda",
    "gpu_name": "NVIDIA H200",
    "capability": (9, 0),
    "cpus": 16,
    "processes_per_node": 1,
    "num_workers": 12,
    "pin_memory": True,
    "host_batches": True,
    "batch_size": 256,
    "backend": "hdf5",
    "precision": "16-mixed",
    "conv_layers": 36,
    "conv_channels_last": 36,
    "input_channels_last": True,
    "cudnn_benchmark": True,
    "cudnn_deterministic": False,
    "cudnn_allow_tf32": True,
    "float32_matmul_precision": "high",
    "mem_peak_gb": 60.0,
    "mem_total_gb": 140.0,
    "gpu_monitor": True,
    "grad_scaler": True,  # 16-mixed: Lightning's MixedPrecision plugin holds an enabled GradScaler
    "unfused_optimizers": (),  # fused SGD: the GradScaler's inf check stays on the device
    "gradient_clip_val": None,
}

BUSY_GPU: dict[str, float] = {
    "time/step_ms": 45.0,
    "time/data_wait_ms": 0.5,
    "time/data_wait_frac": 0.011,
    "throughput/samples_per_sec": 5700.0,
    "gpu/util": 99.0,
    "gpu/sm_active": 75.0,
    "gpu/mem_used_gb": 62.0,
    "gpu/mem_total_gb": 143.0,
}


def kinds(verdicts: list) -> list[str]:
    return [v.kind for v in verdicts]


def cfg(**over: Any) -> dict[str, Any]:
    return {**H200, **over}


def ev(**over: Any) -> dict[str, Any]:
    return {**BUSY_GPU, **over}


class SleepyImages(Dataset):
    """Small images whose loading takes ``delay_s`` each: a slow loader."""

    def __init__(self, n: int = 256, delay_s: float = 0.0) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, 16, 16, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.x[i], self.y[i]


class ReadyBatches(Dataset):
    """Pre-made batches (``DataLoader(batch_size=None)``): fetching costs nothing, so the run is not input-bound."""

    def __init__(self, n: int = 64, batch: int = 64, size: int = 32) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(batch, 3, size, size, generator=g)
        self.y = torch.randint(0, 4, (batch,), generator=g)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x, self.y


def fast_loader(n: int = 64) -> DataLoader:
    return DataLoader(ReadyBatches(n), batch_size=None)


class TinyClassifier(pl.LightningModule):
    """Conv -> ReLU -> pool -> Linear, trained with SGD + momentum (``fused`` as torch.optim.SGD takes it).

    ``sleep_s``: seconds each global rank sleeps in every training step (work that is not CPU time, as a GPU
    step's is; a longer sleep on one rank makes it a straggler under DDP).
    """

    def __init__(self, fused: bool | None = None, sleep_s: dict[int, float] | None = None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.head = nn.Linear(8 * 4 * 4, 4)
        self.fused = fused
        self.sleep_s = dict(sleep_s or {})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(F.adaptive_avg_pool2d(F.relu(self.conv(x)), 4), 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.sleep_s.get(self.global_rank):
            time.sleep(self.sleep_s[self.global_rank])
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9, fused=self.fused)


def cpu_trainer(tmp_path: Any, callbacks: list, steps: int, logger: Any = False, **kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": steps,
        "limit_val_batches": 0,
        "logger": logger,
        "callbacks": callbacks,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "default_root_dir": tmp_path,
    }
    return pl.Trainer(**{**options, **kwargs})
