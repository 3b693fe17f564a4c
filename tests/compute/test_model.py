"""has_conv, has_attention, family: what the precision, compile and channels_last rules read off a model."""

import pytest
from torch import nn

from lightning_gpuopt.compute._model import family, has_attention, has_conv


@pytest.mark.parametrize(
    ("layer", "dims"),
    [
        (nn.Conv1d(2, 2, 3), 1),
        (nn.ConvTranspose1d(2, 2, 3), 1),
        (nn.Conv2d(2, 2, 3), 2),
        (nn.ConvTranspose2d(2, 2, 3), 2),
        (nn.Conv3d(2, 2, 3), 3),
        (nn.ConvTranspose3d(2, 2, 3), 3),
    ],
)
def test_has_conv_by_dimensionality(layer, dims):
    model = nn.Sequential(nn.Sequential(layer), nn.ReLU())  # found in a submodule too
    assert has_conv(model)
    assert has_conv(model, dims)
    assert has_conv(model, [dims, 3])
    assert not has_conv(model, [d for d in (1, 2, 3) if d != dims])


def test_a_model_without_convolutions():
    assert not has_conv(nn.TransformerEncoderLayer(d_model=16, nhead=2))
    assert not has_conv(nn.Linear(2, 2), 2)


@pytest.mark.parametrize("dims", [0, 4, (2, 5), True, "2"])
def test_bad_dims(dims):
    with pytest.raises(ValueError, match="dims must be 1, 2 or 3"):
        has_conv(nn.Linear(2, 2), dims)


class GPT2Attention(nn.Module):
    """Named as ``transformers``' attention layer, which is not an ``nn.MultiheadAttention``."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)


def test_family_attention_before_convolution():
    encoder = nn.TransformerEncoderLayer(d_model=16, nhead=2)
    assert has_attention(encoder) and family(encoder) == "transformer"
    vit = nn.Sequential(nn.Conv2d(3, 16, 4, 4), encoder)  # a ViT: a patch convolution, then attention
    assert family(vit) == "transformer"
    assert has_attention(nn.Sequential(GPT2Attention())) and family(GPT2Attention()) == "transformer"
    assert family(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())) == "conv"
    assert not has_attention(nn.Linear(2, 2)) and family(nn.Sequential(nn.Linear(2, 2))) is None
