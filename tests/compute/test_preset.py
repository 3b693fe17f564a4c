"""fast_trainer_kwargs: the preset composing precision, TF32, cuDNN autotuning, channels_last, fused optimizers,
compile and DDP's settings into ``Trainer`` keyword arguments."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt.bench.models import ImageClassifier, SmallResNet
from lightning_gpuopt.compute.channels_last import ChannelsLast
from lightning_gpuopt.compute.compile import CompileModel
from lightning_gpuopt.compute.ddp import NonBlockingStepChecks
from lightning_gpuopt.compute.optimizer import FusedOptimizer
from lightning_gpuopt.compute.precision import configure_backends
from lightning_gpuopt.compute.preset import PRESET_DDP_KWARGS, fast_trainer_kwargs
from tests._lightning import quiet_trainer
from tests.compute._models import conv1d, convnet, mlp

TRANSFORMER = nn.TransformerEncoderLayer(d_model=16, nhead=2)


def _compile_callbacks(kwargs: dict) -> list[CompileModel]:
    return [c for c in kwargs["callbacks"] if isinstance(c, CompileModel)]


# --- what the preset picks --------------------------------------------------------------------------------
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


def test_fast_trainer_kwargs_for_a_transformer(fake_gpu, restore_backends):
    fake_gpu((8, 0))
    kwargs = fast_trainer_kwargs(TRANSFORMER)
    assert kwargs["precision"] == "bf16-mixed"
    # no convolution: no channels_last; fused updates under bf16-mixed; judged by the compile rule
    assert [type(c) for c in kwargs["callbacks"]] == [FusedOptimizer, CompileModel]
    assert kwargs["callbacks"][1].when == "auto"
    unfused = fast_trainer_kwargs(TRANSFORMER, fused_optimizer=False)
    assert [type(c) for c in unfused["callbacks"]] == [CompileModel]


def test_a_vit_is_a_transformer_with_channels_last_for_its_patches(fake_gpu, restore_backends):
    fake_gpu((9, 0))
    vit = nn.Sequential(nn.Conv2d(3, 16, 4, 4), nn.Flatten(2), TRANSFORMER)
    kwargs = fast_trainer_kwargs(vit)
    assert kwargs["precision"] == "bf16-mixed"  # the patch convolution does not make it a conv net
    assert [type(c) for c in kwargs["callbacks"]] == [ChannelsLast, FusedOptimizer, CompileModel]


def test_a_model_of_no_measured_family_is_left_alone(fake_gpu, restore_backends):
    fake_gpu((9, 0))
    kwargs = fast_trainer_kwargs(mlp())
    assert kwargs["precision"] == "bf16-mixed"
    # no convolution, no attention: the compile rule does not judge it; the update is fused all the same
    assert [type(c) for c in kwargs["callbacks"]] == [FusedOptimizer]


def test_a_conv1d_model_is_a_conv_net_without_channels_last(fake_gpu, restore_backends):
    # one detector, two questions: any convolution (precision, compile) and a Conv2d (channels_last)
    fake_gpu((9, 0))
    kwargs = fast_trainer_kwargs(conv1d())
    assert kwargs["precision"] == "16-mixed"
    assert [type(c) for c in kwargs["callbacks"]] == [FusedOptimizer, CompileModel]


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
    trainer = quiet_trainer(**kwargs, accelerator="cpu", max_steps=1)
    trainer.fit(model, data)
    cl = next(c for c in trainer.callbacks if isinstance(c, ChannelsLast))
    assert cl.active
    assert model.model.stem[0].weight.is_contiguous(memory_format=torch.channels_last)


# --- compile -------------------------------------------------------------------------------------------------
def test_preset_compile_choices_on_cpu():
    assert _compile_callbacks(fast_trainer_kwargs(convnet(), "cpu")) == []  # the rule: CUDA only
    (forced,) = _compile_callbacks(fast_trainer_kwargs(convnet(), "cpu", compile=True))
    assert forced.when == "always"
    assert _compile_callbacks(fast_trainer_kwargs(convnet(), "cpu", compile=False)) == []
    mine = CompileModel(backend="eager")
    assert _compile_callbacks(fast_trainer_kwargs(convnet(), "cpu", compile=True, callbacks=[mine])) == [
        mine
    ]
    with pytest.raises(TypeError, match="compile must be True, False or None, got 'yes'"):
        fast_trainer_kwargs(convnet(), "cpu", compile="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("capability", "model", "expected"),
    [
        ((9, 0), convnet(), ["auto"]),
        ((6, 1), convnet(), []),
        ((9, 0), mlp(), []),
        ((8, 0), None, ["auto"]),
    ],
)
def test_preset_compile_rule_on_cuda(fake_gpu, restore_backends, capability, model, expected):
    fake_gpu(capability)
    kwargs = fast_trainer_kwargs(model)
    assert [c.when for c in _compile_callbacks(kwargs)] == expected


# --- DDP -----------------------------------------------------------------------------------------------------
def test_preset_configures_ddp():
    kwargs = fast_trainer_kwargs(convnet(), "cpu", strategy="ddp")
    strategy = kwargs["strategy"]
    assert isinstance(strategy, DDPStrategy)
    assert PRESET_DDP_KWARGS["gradient_as_bucket_view"] is True
    assert strategy._ddp_kwargs == PRESET_DDP_KWARGS  # what DDPStrategy hands DistributedDataParallel
    mine = DDPStrategy(static_graph=True)
    assert fast_trainer_kwargs(convnet(), "cpu", strategy=mine)["strategy"] is mine
    assert fast_trainer_kwargs(convnet(), "cpu", strategy="ddp_spawn")["strategy"] == "ddp_spawn"


def test_ddp_preset_adds_nonblocking_step_checks():
    kwargs = fast_trainer_kwargs(nn.Linear(2, 2), device="cpu", strategy="ddp")
    assert isinstance(kwargs["strategy"], DDPStrategy)
    assert sum(isinstance(c, NonBlockingStepChecks) for c in kwargs["callbacks"]) == 1
    single = fast_trainer_kwargs(nn.Linear(2, 2), device="cpu")
    assert not any(isinstance(c, NonBlockingStepChecks) for c in single["callbacks"])


def test_the_preset_says_what_it_chose_and_why(fake_gpu, restore_backends, caplog):
    fake_gpu((9, 0))
    with caplog.at_level(logging.INFO):
        fast_trainer_kwargs(TRANSFORMER)
        fast_trainer_kwargs(convnet(), precision="32-true")
        fast_trainer_kwargs(mlp())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fast_trainer_kwargs:")]
    assert len(lines) == 3
    transformer, conv, other = lines
    assert "precision='bf16-mixed' (a transformer on compute capability 9.0)" in transformer
    assert "no ChannelsLast (no Conv2d layer)" in transformer
    assert "CompileModel (transformer: compiles when over 117 s of eager training is left, a break-even assumed" in transformer
    assert "FusedOptimizer (bf16-mixed on CUDA: one kernel for each parameter group's update)" in transformer
    assert "precision='32-true' (yours)" in conv and "ChannelsLast (Conv2d layers)" in conv
    assert "CompileModel (conv: compiles when over 300 s" in conv and "FusedOptimizer" not in conv
    assert "no CompileModel (no convolution or attention layer" in other


# --- on a GPU ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_preset_on_this_gpu(restore_backends):
    major, _ = torch.cuda.get_device_capability()
    kwargs = fast_trainer_kwargs(SmallResNet())
    assert kwargs["precision"] == ("32-true" if major < 7 else "16-mixed")
    assert kwargs["benchmark"] is True
    assert torch.get_float32_matmul_precision() == "high"


@pytest.mark.gpu
def test_gpu_preset_compiles_with_fp16_channels_last_and_fused_sgd(tmp_path, restore_backends):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 3, 8, 8, generator=g), torch.randint(0, 4, (64,), generator=g))
    model = ImageClassifier(convnet(), fused=False)
    kwargs = fast_trainer_kwargs(model, compile=True, max_steps=4, default_root_dir=tmp_path)
    trainer = quiet_trainer(**kwargs, accelerator="gpu", devices=1)
    trainer.fit(model, DataLoader(data, batch_size=16, drop_last=True))
    cb = next(c for c in trainer.callbacks if isinstance(c, CompileModel))
    fused = next(c for c in trainer.callbacks if isinstance(c, FusedOptimizer))
    assert trainer.precision == "16-mixed" and fused.fused == ["SGD"]
    assert cb.compiled_calls == 4 and cb.eager_calls == 0
    trainer.save_checkpoint(tmp_path / "gpu.ckpt")
    state = torch.load(tmp_path / "gpu.ckpt", weights_only=False)["state_dict"]
    assert list(state) == list(ImageClassifier(convnet()).state_dict())
