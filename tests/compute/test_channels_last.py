import copy
import pickle
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt.bench.models import ImageClassifier, SmallResNet
from lightning_gpuopt.compute.channels_last import (
    ChannelsLast,
    apply_channels_last,
    has_conv,
    is_channels_last,
)
from tests._lightning import quiet_trainer

CL = torch.channels_last


def _strides_cl(t: torch.Tensor) -> bool:
    # exact channels_last strides (is_contiguous ignores size-1 dims, e.g. 1x1 conv weights)
    return t.stride() == torch.empty_like(t, memory_format=CL).stride()


def _conv_weights(module: nn.Module) -> list[torch.Tensor]:
    return [p for p in module.parameters() if p.dim() == 4]


def _loader(n: int = 16, size: int = 16, batch_size: int = 8, channels_last: bool = False) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, size, size, generator=g)
    if channels_last:
        x = x.contiguous(memory_format=CL)
    y = torch.randint(0, 10, (n,), generator=g)
    if channels_last:
        # pre-made batches (collate would stack them into NCHW again), as a GPU pipeline delivers them
        batches = [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, n, batch_size)]
        return DataLoader(batches, batch_size=None)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def _trainer(callbacks, max_steps: int = 2, **kw) -> pl.Trainer:
    kw.setdefault("accelerator", "cpu")
    kw.setdefault("devices", 1)
    return quiet_trainer(
        max_steps=max_steps,
        callbacks=callbacks,
        **kw,
    )


class _InputProbe(pl.Callback):
    """Records, at every training step, the layout of the conv weights and of the model's input."""

    def __init__(self) -> None:
        self.weights_cl: list[bool] = []
        self.inputs_cl: list[bool] = []

    def on_fit_start(self, trainer, pl_module) -> None:
        inner = pl_module.model

        def record(module, args):
            self.inputs_cl.append(args[0].is_contiguous(memory_format=CL))

        self._handle = inner.register_forward_pre_hook(record)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.weights_cl.append(all(_strides_cl(w) for w in _conv_weights(pl_module)))

    def on_fit_end(self, trainer, pl_module) -> None:
        self._handle.remove()


# --- apply_channels_last ---------------------------------------------------------------------------------
def test_apply_converts_4d_params_and_buffers_keeping_identity():
    model = SmallResNet()
    model.register_buffer("mask", torch.ones(1, 3, 4, 4))
    params_before = list(model.parameters())
    bias = model.fc.bias.clone()
    out = apply_channels_last(model)
    assert out is model
    assert all(a is b for a, b in zip(params_before, model.parameters(), strict=True))
    assert all(_strides_cl(w) for w in _conv_weights(model))
    assert _strides_cl(model.mask)
    # 1x1 downsample weights get exact channels_last strides, not just is_contiguous(channels_last)
    assert model.layer2.down[0].weight.stride()[2:] != (1, 1)
    assert torch.equal(model.fc.bias, bias)
    assert is_channels_last(model)


def test_apply_converts_existing_gradients():
    model = SmallResNet()
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    apply_channels_last(model)
    assert all(_strides_cl(w.grad) for w in _conv_weights(model))


def test_apply_keeps_outputs():
    torch.manual_seed(0)
    model = SmallResNet().eval()
    x = torch.randn(4, 3, 16, 16)
    ref = model(x)
    apply_channels_last(model)
    out = model(x.contiguous(memory_format=CL))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_apply_without_conv_warns_once_and_leaves_model():
    model = nn.Sequential(nn.Linear(4, 4))
    model.register_buffer("img", torch.randn(2, 3, 4, 4))
    with pytest.warns(UserWarning, match="no Conv2d layer"):
        assert apply_channels_last(model) is model
    assert not _strides_cl(model.img)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_channels_last(model)  # second time: silent


def test_apply_channels_last_on_mixed_model():
    model = nn.ModuleDict({"c2": nn.Conv2d(3, 4, 3), "c3": nn.Conv3d(3, 4, 3)})
    # Module.to(memory_format=channels_last) raises on the 5-D weight; the function converts 4-D tensors
    apply_channels_last(model)
    assert _strides_cl(model["c2"].weight)
    assert model["c3"].weight.is_contiguous()


def test_apply_rejects_bad_arguments():
    with pytest.raises(TypeError, match="model must be"):
        apply_channels_last("resnet")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="convert_inputs"):
        ChannelsLast(convert_inputs="yes")  # type: ignore[arg-type]


def test_apply_on_compiled_module():
    torch.manual_seed(0)
    model = SmallResNet().eval()
    x = torch.randn(2, 3, 16, 16)
    ref = model(x)
    compiled = torch.compile(model, backend="eager")
    assert has_conv(compiled)
    out_mod = apply_channels_last(compiled)
    assert out_mod is compiled
    assert all(_strides_cl(w) for w in _conv_weights(model))  # the original module's tensors
    # (running the compiled forward is covered by test_callback_with_compiled_inner_model)
    torch.testing.assert_close(model(x), ref, rtol=1e-4, atol=1e-5)


# --- ChannelsLast callback -------------------------------------------------------------------------------
def test_callback_converts_params_and_inputs_during_fit():
    cb, probe = ChannelsLast(), _InputProbe()
    model = ImageClassifier("small")
    _trainer([cb, probe], max_steps=2).fit(model, _loader())
    assert cb.active
    assert probe.weights_cl == [True, True]
    assert probe.inputs_cl == [True, True]
    assert cb.inputs_converted == 2


def test_callback_does_not_convert_channels_last_inputs_again():
    cb, probe = ChannelsLast(), _InputProbe()
    _trainer([cb, probe], max_steps=2).fit(ImageClassifier("small"), _loader(channels_last=True))
    assert probe.inputs_cl == [True, True]
    assert cb.inputs_converted == 0


def test_callback_without_input_conversion():
    cb, probe = ChannelsLast(convert_inputs=False), _InputProbe()
    _trainer([cb, probe], max_steps=1).fit(ImageClassifier("small"), _loader())
    assert probe.weights_cl == [True]
    assert probe.inputs_cl == [False]


def test_callback_training_matches_plain_training():
    torch.manual_seed(0)
    base = ImageClassifier("small", lr=0.01)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    _trainer([], max_steps=2).fit(a, _loader())
    _trainer([ChannelsLast()], max_steps=2).fit(b, _loader())
    # a wrong conversion (e.g. a permuted weight) would move the logits by O(1); kernels differ by ~1e-5
    assert (b.model.stem[0].weight - base.model.stem[0].weight).abs().max() > 1e-4  # it did train
    x = torch.randn(4, 3, 16, 16)
    a.eval()
    b.eval()
    with torch.no_grad():
        torch.testing.assert_close(b(x), a(x), rtol=1e-2, atol=2e-3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pb, pa, rtol=1e-2, atol=1e-3, msg=name)


class _LateChannelsLast(pl.Callback):
    """Negative control: converts after the strategy wrapped the model."""

    def on_fit_start(self, trainer, pl_module) -> None:
        apply_channels_last(pl_module)


class _DDPProbe(pl.Callback):
    def __init__(self) -> None:
        self.wrapped_at_setup: bool | None = None
        self.wrapped_at_fit_start: bool | None = None
        self.bucket_grads_cl: bool | None = None

    def setup(self, trainer, pl_module, stage) -> None:
        self.wrapped_at_setup = isinstance(trainer.strategy.model, nn.parallel.DistributedDataParallel)

    def on_fit_start(self, trainer, pl_module) -> None:
        self.wrapped_at_fit_start = isinstance(trainer.strategy.model, nn.parallel.DistributedDataParallel)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # With gradient_as_bucket_view, .grad IS DDP's bucket view, laid out like the parameters were when
        # DDP was built (DDP rebuilds its buckets after the first step, so look at step 0).
        if trainer.global_step == 0:
            self.bucket_grads_cl = all(_strides_cl(w.grad) for w in _conv_weights(pl_module))


@pytest.mark.parametrize(("converter", "expect_cl"), [(ChannelsLast, True), (_LateChannelsLast, False)])
def test_conversion_happens_before_ddp_wraps_the_model(converter, expect_cl):
    probe = _DDPProbe()
    trainer = _trainer([converter(), probe], max_steps=1, strategy=DDPStrategy(gradient_as_bucket_view=True))
    trainer.fit(ImageClassifier("small"), _loader())
    assert probe.wrapped_at_setup is False
    assert probe.wrapped_at_fit_start is True
    assert probe.bucket_grads_cl is expect_cl


class _NoConv(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_callback_steps_aside_without_conv_and_warns_once():
    cb = ChannelsLast()
    with pytest.warns(UserWarning, match="no Conv2d layer"):
        _trainer([cb], max_steps=1).fit(_NoConv(), _loader())
    assert not cb.active
    assert cb.inputs_converted == 0
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _trainer([cb], max_steps=1).fit(_NoConv(), _loader())
    assert not [w for w in record if "ChannelsLast" in str(w.message)]


class _BuiltInConfigureModel(ImageClassifier):
    def __init__(self) -> None:
        super().__init__(nn.Identity())

    def configure_model(self) -> None:
        if isinstance(self.model, nn.Identity):
            self.model = SmallResNet()


def test_layers_from_configure_model_are_converted_on_single_device():
    cb, probe = ChannelsLast(), _InputProbe()
    _trainer([cb, probe], max_steps=1).fit(_BuiltInConfigureModel(), _loader())
    assert cb.active
    assert probe.weights_cl == [True]
    assert probe.inputs_cl == [True]


def test_layers_from_configure_model_under_ddp_warn_with_fix():
    cb = ChannelsLast()
    trainer = _trainer([cb], max_steps=1, strategy="ddp")
    with pytest.warns(UserWarning, match=r"apply_channels_last\(self\)"):
        trainer.fit(_BuiltInConfigureModel(), _loader())
    assert not cb.active


def test_second_fit_state_round_trip_pickle_and_teardown():
    cb = ChannelsLast()
    model = ImageClassifier("small")
    _trainer([cb], max_steps=1).fit(model, _loader())
    _trainer([cb], max_steps=2).fit(model, _loader())
    assert cb.inputs_converted == 3
    # the hook is gone after teardown: a plain call does not count
    model.eval()
    model(torch.randn(1, 3, 8, 8))
    assert cb.inputs_converted == 3

    state = cb.state_dict()
    assert state == {"inputs_converted": 3}
    fresh = ChannelsLast()
    fresh.load_state_dict(state)
    assert fresh.inputs_converted == 3

    clone = pickle.loads(pickle.dumps(cb))
    assert clone.inputs_converted == 3


def test_pickle_while_hook_registered():
    cb = ChannelsLast()
    trainer = _trainer([cb], max_steps=1)
    model = ImageClassifier("small")
    cb.setup(trainer, model, "fit")
    try:
        clone = pickle.loads(pickle.dumps(cb))
        assert clone._handle is None
    finally:
        cb.teardown(trainer, model, "fit")


def test_checkpoint_resume_restores_state(tmp_path):
    cb = ChannelsLast()
    trainer = _trainer([cb], max_steps=2, default_root_dir=tmp_path)
    model = ImageClassifier("small")
    trainer.fit(model, _loader())
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    cb2 = ChannelsLast()
    _trainer([cb2], max_steps=3, default_root_dir=tmp_path).fit(
        ImageClassifier("small"), _loader(), ckpt_path=ckpt
    )
    assert cb2.inputs_converted == 3  # 2 restored + 1 new step
    assert is_channels_last(model)


def test_callback_with_compiled_inner_model():
    cb, probe = ChannelsLast(), _InputProbe()
    net = SmallResNet()
    model = ImageClassifier(torch.compile(net, backend="eager"))
    _trainer([cb, probe], max_steps=2).fit(model, _loader())
    assert cb.active
    assert probe.weights_cl == [True, True]
    assert probe.inputs_cl == [True, True]
    assert is_channels_last(net)


@pytest.mark.gpu
def test_callback_on_cuda_with_fp16():
    cb, probe = ChannelsLast(), _InputProbe()
    devices: list[str] = []

    class _Device(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            devices.append(pl_module.device.type)

    model = ImageClassifier("small")
    _trainer([cb, probe, _Device()], max_steps=2, accelerator="gpu", precision="16-mixed").fit(
        model, _loader()
    )
    assert cb.active
    assert probe.weights_cl == [True, True]
    assert probe.inputs_cl == [True, True]
    assert devices == ["cuda", "cuda"]  # Lightning moves the model back to the CPU after fit
