"""``store-bound``: a store read from the disk is named with the disk's figure and the compact store as the
fix; the same slow store served from the page cache is not called disk-bound."""

from __future__ import annotations

import statistics
import time
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt import BottleneckAdvisor, GPUStatsMonitor
from lightning_gpuopt._common import FeedInfo
from lightning_gpuopt.observe import host_cpu
from lightning_gpuopt.observe.advisor import diagnose


class FakeStore(Dataset):
    """An HDF5 store as the advisor sees it, whose reads take 2 ms of the training thread's CPU an image and,
    when ``cold``, read a 1024 px canvas (``IMAGE_BYTES``) an image from "the disk" (``READ``: what the
    process's storage counter reports).

    A busy machine slows the reads as much as the rest of the step, so the share of each step spent waiting
    holds; at that canvas the disk's rate stays far above ``store_read_mb_s`` however slowly the steps run."""

    feed_info = FeedInfo(backend="hdf5", threads=2)
    IMAGE_BYTES = 1024 * 1024 * 3
    READ = [0.0]

    def __init__(self, cold: bool) -> None:
        self.cold = cold

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int):
        end = time.thread_time() + 0.002
        while time.thread_time() < end:
            pass
        if self.cold:
            FakeStore.READ[0] += FakeStore.IMAGE_BYTES
        return torch.randn(8), i % 2


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(cold: bool, monkeypatch) -> BottleneckAdvisor:
    monkeypatch.setattr(host_cpu, "_read_bytes", lambda proc, children, psutil: FakeStore.READ[0])
    advisor = BottleneckAdvisor(warmup_steps=4, min_windows=1, verbose=False)
    trainer = pl.Trainer(max_steps=24, callbacks=[GPUStatsMonitor(log_every_n_steps=4), advisor], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         accelerator="cpu")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Net(), DataLoader(FakeStore(cold), batch_size=8))
    return advisor


def test_a_cold_store_is_store_bound_with_the_disks_figure(monkeypatch):
    advisor = _fit(True, monkeypatch)
    (verdict,) = [v for v in advisor.verdicts if v.kind == "input-bound"]
    assert verdict.cause == "store-bound"
    # the disk's figure over the run's own rate, both of the same window: the bytes of one image a sample
    windows = [h["evidence"] for h in advisor.history]
    per_sample = [w["read_mb_s"] * 1e6 / w["samples_per_sec"] for w in windows]
    assert statistics.median(per_sample) == pytest.approx(FakeStore.IMAGE_BYTES, rel=0.2), windows
    assert "read from the disk at" in verdict.advice and "convert --format jpeg" in verdict.advice
    assert verdict.gain is not None and verdict.gain > 1.5  # most of each step waits for the store


def test_a_warm_store_is_not_called_disk_bound(monkeypatch):
    verdicts = _fit(False, monkeypatch).verdicts
    (verdict,) = [v for v in verdicts if v.kind == "input-bound"]  # still slow: 2 ms an image
    assert verdict.cause == "slow-loader" and verdict.evidence["read_mb_s"] == 0.0
    assert "convert --format jpeg" not in verdict.advice


@pytest.mark.parametrize(
    ("read_mb_s", "decoder", "cause", "fix"),
    [
        (400.0, None, "store-bound", "convert --format jpeg"),
        (400.0, "cpu", "store-bound", "already compact"),
        (0.5, None, "slow-loader", "Profile the dataset"),
        (None, None, "store-bound", "reading threads"),  # unmeasured: the threads' verdict as before
    ],
)
def test_the_rule(read_mb_s, decoder, cause, fix):
    window = {"gpu/idle_frac": 0.5, "time/loader_wait_frac": 0.45, "throughput/samples_per_sec": 2000.0}
    if read_mb_s is not None:
        window["host/read_mb_s"] = read_mb_s
    cfg = {"device_type": "cuda", "backend": "hdf5", "decoder": decoder, "decode_threads": 8, "cpus": 16}
    (v,) = [v for v in diagnose(window, cfg) if v.kind == "input-bound"]
    assert v.cause == cause and fix in v.advice
    assert v.gain == pytest.approx(2.0)  # half the GPU's time idle: at most twice the rate
