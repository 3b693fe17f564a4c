"""What a user writes, for the benchmarks that measure as a user measures.

``UserClassifier`` is a plain LightningModule: a torchvision-shaped model, cross-entropy, its own
``SGD(momentum=0.9)``; uint8 batches (a loader that leaves normalizing to the GPU) are normalized in
``training_step``. ``compiled_ceiling`` is the plain PyTorch loop it is held against; ``_shared.measured_fit``
fits it through ``Trainer(**fast_trainer_kwargs(...))`` and measures the fit.

The scripts import it from their own folder (``python benchmarks/<script>.py`` puts that folder first on
``sys.path``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from lightning_gpuopt._common import IMAGENET_MEAN, IMAGENET_STD
from lightning_gpuopt.bench.measure import PlainLoop
from lightning_gpuopt.bench.models import build_model
from lightning_gpuopt.bench.steady import Measurement, measure_loop

class UserClassifier(pl.LightningModule):
    """A classifier as a user writes it: ``arch`` (``"resnet50"``: torchvision's), SGD with momentum at the
    plain loop's rate (``PlainLoop``'s 0.01), so both sides make the same update.

    Example:
        >>> model = UserClassifier("small", num_classes=10)
        >>> model.training_step((torch.randint(0, 255, (2, 3, 32, 32), dtype=torch.uint8), torch.zeros(2).long()), 0).ndim
        0
    """

    def __init__(self, arch: str = "resnet50", num_classes: int = 10, lr: float = 0.01) -> None:
        super().__init__()
        self.model = build_model(arch, num_classes)
        self.lr = lr
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1) * 255, persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if x.dtype == torch.uint8:  # a loader that leaves normalizing to the GPU
            x = ((x.float() - self.mean) / self.std).contiguous(memory_format=torch.channels_last)
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=1e-4)


def compiled_ceiling(arch: str, batch_size: int, image_size: int, num_classes: int, device: str,
                     compile: bool = True) -> tuple[PlainLoop, float]:
    """The plain PyTorch loop on one batch kept on ``device`` (fp16 autocast on CUDA, channels_last, fused
    SGD), compiled, and the seconds its first steps took (the compile)."""
    import time

    dtype = torch.float16 if device == "cuda" else None
    loop = PlainLoop(build_model(arch, num_classes), batch_size, image_size, num_classes, dtype=dtype,
                     device=device, label_sets=4, compile=compile)
    t0 = time.perf_counter()
    for _ in range(3):
        loop.timed_step()
    return loop, time.perf_counter() - t0


def measure_ceiling(loop: PlainLoop, warmup: int, steps: int) -> Measurement:
    """``steps`` steps of the plain loop after ``warmup``, on the GPU's clock."""
    return measure_loop(loop.step, loop.device, warmup, steps, loop.batch_size)

