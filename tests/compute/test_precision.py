"""choose_precision / configure_backends: the precision rule and the fp32 backend flags that go with it."""

import re

import pytest
import torch
from torch import nn

from lightning_gpuopt.bench.models import SmallResNet
from lightning_gpuopt.compute.precision import choose_precision, configure_backends, resolve_device

TRANSFORMER = nn.TransformerEncoderLayer(d_model=16, nhead=2)


@pytest.mark.parametrize(
    ("capability", "model", "expected"),
    [
        ((6, 0), SmallResNet(), "32-true"),  # Pascal: no tensor cores
        ((7, 0), SmallResNet(), "16-mixed"),  # Volta: no bf16
        ((7, 5), TRANSFORMER, "16-mixed"),  # Turing: no bf16 even for transformers
        ((8, 0), SmallResNet(), "16-mixed"),  # Ampere conv net
        ((9, 0), SmallResNet(), "16-mixed"),  # Hopper conv net: measured fp16 > bf16
        ((9, 0), TRANSFORMER, "bf16-mixed"),  # no conv: bf16 for range
        ((9, 0), None, "bf16-mixed"),  # unknown model: the safe choice
    ],
)
def test_choose_precision_cuda(fake_gpu, capability, model, expected):
    fake_gpu(capability)
    assert choose_precision(model=model) == expected
    assert choose_precision("cuda:0", model=model) == expected


def test_model_family_overrides_model(fake_gpu):
    fake_gpu((9, 0))
    assert choose_precision("cuda", model=TRANSFORMER, model_family="conv") == "16-mixed"
    assert choose_precision("cuda", model=SmallResNet(), model_family="transformer") == "bf16-mixed"
    with pytest.raises(ValueError, match="model_family"):
        choose_precision("cuda", model_family="cnn")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("bf16", "amx", "expected"),
    [(True, False, "bf16-mixed"), (False, True, "bf16-mixed"), (False, False, "32-true")],
)
def test_choose_precision_cpu(monkeypatch, bf16, amx, expected):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert choose_precision("cpu", model=SmallResNet()) == expected


def test_a_conv1d_model_is_a_conv_net(fake_gpu):
    fake_gpu((9, 0))
    assert choose_precision("cuda", model=nn.Sequential(nn.Conv1d(2, 4, 3))) == "16-mixed"


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(1) == torch.device("cuda", 1)
    assert resolve_device(torch.device("meta")) == torch.device("meta")
    with pytest.raises(
        TypeError, match=re.escape("device must be a str, int, torch.device or None, got True")
    ):
        resolve_device(True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("device must be a torch device string, got 'gpu0'; e.g.")):
        resolve_device("gpu0")


def test_choose_precision_other_devices_and_bad_arguments():
    assert choose_precision("meta") == "32-true"
    with pytest.raises(ValueError, match="device"):
        choose_precision("gpu0")
    with pytest.raises(TypeError, match="device"):
        choose_precision(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model"):
        choose_precision("cpu", model="resnet")  # type: ignore[arg-type]


def test_configure_backends_sets_and_restores(restore_backends):
    configure_backends(tf32=False, cudnn_benchmark=False)
    previous = configure_backends(tf32=True, cudnn_benchmark=True)
    assert torch.get_float32_matmul_precision() == "high"
    assert torch.backends.cudnn.allow_tf32 is True
    assert torch.backends.cudnn.benchmark is True
    assert previous.float32_matmul_precision == "highest"
    assert previous.cudnn_allow_tf32 is False
    assert previous.cudnn_benchmark is False
    previous.restore()
    assert torch.get_float32_matmul_precision() == "highest"
    assert torch.backends.cudnn.allow_tf32 is False
    assert torch.backends.cudnn.benchmark is False
    untouched = configure_backends(tf32=None, cudnn_benchmark=None)
    assert untouched == previous
    with pytest.raises(TypeError, match="tf32"):
        configure_backends(tf32="yes")  # type: ignore[arg-type]


@pytest.mark.gpu
def test_choose_precision_on_this_gpu():
    major, _ = torch.cuda.get_device_capability()
    expected = "32-true" if major < 7 else "16-mixed"
    assert choose_precision(model=SmallResNet()) == expected
