"""What the compute rules read off a model: whether it has convolutions (and of which dimensionality) or
attention layers, and so its family: a conv net or a transformer."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from torch import nn

from lightning_gpuopt._checks import check_arg, is_int

#: Convolution layers by spatial dimensionality (1: ``Conv1d``, 2: ``Conv2d``, 3: ``Conv3d``, each with its
#: transposed form).
CONV_LAYERS: dict[int, tuple[type[nn.Module], ...]] = {
    1: (nn.Conv1d, nn.ConvTranspose1d),
    2: (nn.Conv2d, nn.ConvTranspose2d),
    3: (nn.Conv3d, nn.ConvTranspose3d),
}


def has_conv(model: nn.Module, dims: int | Iterable[int] = (1, 2, 3)) -> bool:
    """Whether ``model`` has a convolution layer of the given spatial dimensionality.

    Args:
        model: the module to search (its submodules included).
        dims: ``1``, ``2`` or ``3``, or several of them; the default, any convolution, is what makes a model
            a conv net for the precision and compile rules. ``ChannelsLast`` asks for ``2`` (``3`` for
            ``channels_last_3d``), the layers whose kernels prefer that layout.

    Example::

        has_conv(nn.Sequential(nn.Conv1d(1, 4, 3)))           # True
        has_conv(nn.Sequential(nn.Conv1d(1, 4, 3)), dims=2)   # False
    """
    wanted = (dims,) if isinstance(dims, int) else tuple(dims)
    check_arg(
        all(is_int(d) and d in CONV_LAYERS for d in wanted), "dims", dims, "1, 2 or 3, or several of them"
    )
    layers = tuple(layer for d in wanted for layer in CONV_LAYERS[d])
    return any(isinstance(m, layers) for m in model.modules())


#: The families the precision and compile rules tell apart.
Family = Literal["conv", "transformer"]


def has_attention(model: nn.Module) -> bool:
    """Whether ``model`` has an attention layer: ``nn.MultiheadAttention`` (torchvision's ViT,
    ``nn.TransformerEncoderLayer``) or a module whose class name ends in ``Attention`` (``transformers``'
    ``GPT2Attention``, ``BertSelfAttention``, timm's ``Attention``)."""
    return any(
        isinstance(m, nn.MultiheadAttention) or type(m).__name__.endswith("Attention")
        for m in model.modules()
    )


def family(model: nn.Module) -> Family | None:
    """The model's family for the precision and compile rules: ``"transformer"`` when it has an attention
    layer (a ViT's patch convolution does not make it a conv net), else ``"conv"`` when it has a convolution,
    else ``None`` (an MLP, a model of another shape: no rule was measured on it).

    Example::

        family(torchvision.models.resnet50())    # "conv"
        family(torchvision.models.vit_b_16())    # "transformer"
        family(nn.Sequential(nn.Linear(4, 4)))   # None
    """
    if has_attention(model):
        return "transformer"
    return "conv" if has_conv(model) else None
