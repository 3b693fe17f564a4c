import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt.bench.models import ImageClassifier, SmallResNet
from lightning_gpuopt.compute.channels_last import ChannelsLast
from lightning_gpuopt.compute.compile import CompileModel
from lightning_gpuopt.compute.optimizer import FusedOptimizer
from lightning_gpuopt.compute.precision import (
    choose_precision,
    configure_backends,
    fast_trainer_kwargs,
)
from tests._lightning import quiet_trainer

TRANSFORMER = nn.TransformerEncoderLayer(d_model=16, nhead=2)


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device of a chosen compute capability, faked at torch's boundary."""

    def install(capability: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    return install


@pytest.fixture
def restore_backends():
    previous = configure_backends(tf32=None, cudnn_benchmark=None)
    yield previous
    previous.restore()


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


def test_fast_trainer_kwargs_on_gpu(fake_gpu, restore_backends):
    fake_gpu((9, 0))
    configure_backends(tf32=False)
    mine = pl.Callback()
    kwargs = fast_trainer_kwargs(SmallResNet(), callbacks=[mine], max_epochs=3)
    assert kwargs["precision"] == "16-mixed"
    assert kwargs["benchmark"] is True
    assert kwargs["max_epochs"] == 3
    assert kwargs["callbacks"][0] is mine
    assert [type(c) for c in kwargs["callbacks"]] == [pl.Callback, ChannelsLast, FusedOptimizer, CompileModel]
    assert kwargs["callbacks"][-1].when == "auto"  # the rule decides once the run's length is known
    assert torch.get_float32_matmul_precision() == "high"  # the documented side effect
    plain = fast_trainer_kwargs(SmallResNet(), fused_optimizer=False, compile=False)
    assert [type(c) for c in plain["callbacks"]] == [ChannelsLast]
    assert torch.backends.cudnn.allow_tf32 is True


def test_fast_trainer_kwargs_user_choices_win(fake_gpu, restore_backends):
    fake_gpu((9, 0))
    configure_backends(tf32=False)
    own = ChannelsLast(convert_inputs=False)
    kwargs = fast_trainer_kwargs(
        SmallResNet(), tf32=False, precision="32-true", deterministic=True, callbacks=own, compile=False
    )
    assert kwargs["precision"] == "32-true"
    assert "benchmark" not in kwargs  # deterministic asked for: no cuDNN autotuning
    assert kwargs["callbacks"] == [own]  # not duplicated
    assert torch.get_float32_matmul_precision() == "highest"


def test_fast_trainer_kwargs_without_conv(fake_gpu, restore_backends):
    fake_gpu((8, 0))
    kwargs = fast_trainer_kwargs(TRANSFORMER)
    assert kwargs["precision"] == "bf16-mixed"
    assert kwargs["callbacks"] == []  # no convolution: no channels_last, and the compile rule does not apply


def test_fast_trainer_kwargs_fit_on_cpu(monkeypatch, restore_backends):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    before = configure_backends(tf32=None, cudnn_benchmark=None)
    model = ImageClassifier("small")
    kwargs = fast_trainer_kwargs(model, "cpu")
    assert kwargs["precision"] == "32-true"
    assert "benchmark" not in kwargs
    assert configure_backends(tf32=None, cudnn_benchmark=None) == before  # no side effect on CPU
    data = DataLoader(TensorDataset(torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))), batch_size=4)
    trainer = quiet_trainer(
        **kwargs,
        accelerator="cpu",
        max_steps=1,
    )
    trainer.fit(model, data)
    cl = next(c for c in trainer.callbacks if isinstance(c, ChannelsLast))
    assert cl.active
    assert model.model.stem[0].weight.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.gpu
def test_choose_precision_on_this_gpu(restore_backends):
    major, _ = torch.cuda.get_device_capability()
    expected = "32-true" if major < 7 else "16-mixed"
    assert choose_precision(model=SmallResNet()) == expected
    kwargs = fast_trainer_kwargs(SmallResNet())
    assert kwargs["benchmark"] is True
    assert torch.get_float32_matmul_precision() == "high"


def test_ddp_preset_adds_nonblocking_step_checks():
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_gpuopt.compute.ddp import NonBlockingStepChecks

    kwargs = fast_trainer_kwargs(nn.Linear(2, 2), device="cpu", strategy="ddp")
    assert isinstance(kwargs["strategy"], DDPStrategy)
    assert sum(isinstance(c, NonBlockingStepChecks) for c in kwargs["callbacks"]) == 1
    single = fast_trainer_kwargs(nn.Linear(2, 2), device="cpu")
    assert not any(isinstance(c, NonBlockingStepChecks) for c in single["callbacks"])
