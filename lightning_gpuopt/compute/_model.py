"""What the compute rules read off a model: its convolutions, its attention layers, and so its family."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from torch import nn

from lightning_gpuopt._checks import check_arg, is_int

#: Convolution layers (and their transposed forms) by spatial dimensionality.
CONV_LAYERS: dict[int, tuple[type[nn.Module], ...]] = {
    1: (nn.Conv1d, nn.ConvTranspose1d),
    2: (nn.Conv2d, nn.ConvTranspose2d),
    3: (nn.Conv3d, nn.ConvTranspose3d),
}


def has_conv(model: nn.Module, dims: int | Iterable[int] = (1, 2, 3)) -> bool:
    """Whether ``model`` has a convolution layer of spatial dimensionality ``dims`` (1, 2, 3, or several)."""
    wanted = (dims,) if isinstance(dims, int) else tuple(dims)
    check_arg(
        all(is_int(d) and d in CONV_LAYERS for d in wanted), "dims", dims, "1, 2 or 3, or several of them"
    )
    layers = tuple(layer for d in wanted for layer in CONV_LAYERS[d])
    return any(isinstance(m, layers) for m in model.modules())


#: The families the precision and compile rules tell apart.
Family = Literal["conv", "transformer"]


def has_attention(model: nn.Module) -> bool:
    """Whether ``model`` has ``nn.MultiheadAttention`` or a module whose class name ends in ``Attention``
    (``transformers``' ``GPT2Attention``, timm's ``Attention``)."""
    return any(
        isinstance(m, nn.MultiheadAttention) or type(m).__name__.endswith("Attention")
        for m in model.modules()
    )


def family(model: nn.Module) -> Family | None:
    """The model's family for the precision and compile rules: ``"transformer"`` with an attention layer,
    else ``"conv"`` with a convolution, else ``None``."""
    if has_attention(model):
        return "transformer"
    return "conv" if has_conv(model) else None
