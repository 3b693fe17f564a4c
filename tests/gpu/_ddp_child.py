"""One two-GPU DDP fit of ``test_ddp.py``: every rank writes what it saw to ``<workdir>/rank<N>.json``.

Lightning's DDP launcher runs this script again for rank 1. ``Trainer(devices=2, strategy="ddp")`` with
``GPUStatsMonitor(all_ranks=True)``, ``NVTXRanges``, ``ChannelsLast`` and ``BottleneckAdvisor`` trains
``OptimizedDataModule(train, val, backend=...)`` for two epochs; labels are sample ids, so the parent can
check which samples each rank trained and validated on.

    python tests/gpu/_ddp_child.py --backend folder --train T --val V --workdir W
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_gpuopt import BottleneckAdvisor, ChannelsLast, GPUStatsMonitor, NVTXRanges, OptimizedDataModule
from lightning_gpuopt.bench.models import ImageClassifier

BATCH = 64


class Probe(ImageClassifier):
    """Records the labels (sample ids) this rank trains and validates on, per epoch."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.seen: dict[str, list[torch.Tensor]] = {"train": [], "val": []}
        self.records: list[dict[str, Any]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen["train"].append(batch[1].detach())
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.seen["val"].append(batch[1].detach())
        super().validation_step(batch, batch_idx)

    def _record(self, split: str) -> None:
        seen = self.seen[split]
        labels = torch.cat(seen).tolist() if seen else []
        record = {"split": split, "epoch": self.current_epoch, "batches": len(seen), "labels": labels}
        self.records.append(record)
        self.seen[split] = []

    def on_validation_epoch_end(self) -> None:
        self._record("val")

    def on_train_epoch_end(self) -> None:
        self._record("train")


class MonitorProbe(pl.Callback):
    """The NVML device index the monitor samples, read while training (its sampler stops at teardown)."""

    def __init__(self, monitor: GPUStatsMonitor) -> None:
        self.monitor = monitor
        self.nvml_index: int | None = None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.monitor.sampler is not None:
            self.nvml_index = self.monitor.sampler.index


def device_of(trainer: pl.Trainer, nvml_index: int | None) -> dict[str, Any]:
    """The rank's torch device, its UUID and the UUID of the NVML device its monitor sampled."""
    import pynvml

    idx = trainer.strategy.root_device.index
    out: dict[str, Any] = {
        "root_device": str(trainer.strategy.root_device),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "torch_uuid": str(torch.cuda.get_device_properties(idx).uuid),
        "monitor_nvml_index": nvml_index,
    }
    if nvml_index is not None:
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index)
            out["monitor_nvml_uuid"] = str(pynvml.nvmlDeviceGetUUID(handle))
        finally:
            pynvml.nvmlShutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("--backend", "--train", "--val", "--workdir"):
        p.add_argument(name, required=True)
    p.add_argument("--classes", type=int, required=True)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--accelerator", default="gpu", help="cpu: the same fit on gloo, for a look without GPUs")
    args = p.parse_args()
    out = Path(args.workdir)
    monitor = GPUStatsMonitor(all_ranks=True, log_every_n_steps=5)
    probe, advisor = MonitorProbe(monitor), BottleneckAdvisor()
    dm = OptimizedDataModule(args.train, args.val, backend=args.backend, batch_size=BATCH, num_workers=2,
                             image_size=args.image_size, storage_size=args.image_size)  # fmt: skip
    model = Probe(model="small", num_classes=args.classes)
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=2, strategy="ddp", max_epochs=2,
        precision="16-mixed" if args.accelerator == "gpu" else "32-true",
        callbacks=[monitor, probe, ChannelsLast(), NVTXRanges(), advisor],
        logger=CSVLogger(str(out), name="csv", version=0), log_every_n_steps=5, num_sanity_val_steps=0,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=dm)
    result = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "device": device_of(trainer, probe.nvml_index) if args.accelerator == "gpu" else {},
        "records": model.records,
        "monitor_windows": len(monitor.history),
        "advisor": [v.kind for v in advisor.verdicts],
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
