"""The model of the demo, the ladder, the benchmarks and the tests: ``ImageClassifier``, a plain
LightningModule around torchvision's ResNets or a built-in one small enough for a 2-core CPU."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from typing_extensions import override

from lightning_gpuopt._imports import require
from lightning_gpuopt.compute.optimizer import init_momentum_buffers


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.down(x))


class SmallResNet(nn.Module):
    """A four-stage ResNet (one basic block a stage) for small images and CPU demos.

    Example:
        >>> SmallResNet(num_classes=10)(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        widths = [width, width * 2, width * 4, width * 8]
        layers = []
        cin = width
        for i, w in enumerate(widths):
            layers.append(_BasicBlock(cin, w, 1 if i == 0 else 2))
            cin = w
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


MODEL_NAMES = ("small", "resnet18", "resnet50")


def build_model(name: str = "small", num_classes: int = 10) -> nn.Module:
    """A freshly initialised classifier: ``"small"`` (built in), ``"resnet18"`` or ``"resnet50"`` (torchvision,
    extra ``vision``)."""
    if name == "small":
        return SmallResNet(num_classes)
    if name in ("resnet18", "resnet50"):
        tv_models = require("torchvision").models
        return getattr(tv_models, name)(weights=None, num_classes=num_classes)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")


class ImageClassifier(pl.LightningModule):
    """Cross-entropy classifier of float NCHW batches, trained with SGD + momentum.

    Args:
        model: ``"small"``, ``"resnet18"``, ``"resnet50"`` or an ``nn.Module``.
        num_classes: classes (ignored when ``model`` is a module).
        lr: learning rate.
        fused: the fused SGD kernel (under 16-mixed the GradScaler then skips a step without a host wait);
            ``None``: fused where the parameters are on a CUDA device and no gradient clipping is asked for.

    Example:
        >>> model = ImageClassifier("small", num_classes=10)
        >>> trainer = pl.Trainer(max_steps=100)  # doctest: +SKIP
        >>> trainer.fit(model, datamodule=OptimizedDataModule("data/train"))  # doctest: +SKIP
    """

    def __init__(
        self,
        model: str | nn.Module = "small",
        num_classes: int = 10,
        lr: float = 0.05,
        fused: bool | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model"] if isinstance(model, nn.Module) else None)
        self.model = model if isinstance(model, nn.Module) else build_model(model, num_classes)
        self.lr = lr
        self.fused = fused

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        # on_step logging without prog_bar sync: no host sync beyond Lightning's own
        self.log("train/loss", loss, on_step=True, on_epoch=False)
        return loss

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val/loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val/acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = list(self.parameters())
        fused = self.fused
        if fused is None:
            # Lightning refuses gradient clipping with an optimizer that unscales inside its step under 16-mixed
            try:
                clip = bool(self.trainer.gradient_clip_val)
            except RuntimeError:  # not attached to a Trainer
                clip = False
            fused = not clip and bool(params) and all(p.device.type == "cuda" for p in params)
        return torch.optim.SGD(params, lr=self.lr, momentum=0.9, weight_decay=5e-5, fused=fused or None)

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # a fused SGD's first step skipped by the GradScaler would leave its momentum uninitialized; once an
        # optimizer (each fit's configure_optimizers makes a new one)
        if getattr(self, "_momentum_ready", None) != id(optimizer):
            self._momentum_ready = id(optimizer)
            init_momentum_buffers(optimizer)
