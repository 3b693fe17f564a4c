"""A LightningModule that synchronizes the host with the GPU every step in one of three ways (or not), and
the line each way is on (``LINES``), for the host-sync locator's GPU tests."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_gpuopt.bench.rows import DeviceBatches


class SyncingModule(pl.LightningModule):
    """A small conv net; ``kind``: ``"item"``, ``"print"``, ``"sync_dist"`` or ``"none"``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        if self.kind == "item":
            self.last = loss.item()  # sync: item
        elif self.kind == "print":
            print(loss)  # sync: print
        elif self.kind == "sync_dist":
            self.log("loss", loss, sync_dist=True)  # no sync on one device: Lightning reduces under DDP only
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def batches() -> DeviceBatches:
    x = torch.randn(32, 3, 32, 32, device="cuda")
    return DeviceBatches(x, torch.randint(0, 4, (32,), device="cuda"), length=10**6)


LINES = {
    kind: n
    for n, text in enumerate(Path(__file__).read_text().splitlines(), 1)
    for kind in ("item", "print")
    if text.endswith(f"# sync: {kind}")
}
