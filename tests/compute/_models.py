"""Small models the compute tests judge: a convolution net, an MLP, a 1-D convolution net."""

from __future__ import annotations

from torch import nn


def convnet(num_classes: int = 4) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, num_classes),
    )


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 4))


def conv1d() -> nn.Module:
    return nn.Sequential(nn.Conv1d(3, 8, 3), nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(8, 4))
