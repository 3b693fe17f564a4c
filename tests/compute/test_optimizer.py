"""FusedOptimizer / fuse_optimizer: optimizers switched to fused kernels in place, exactly as if built fused."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_gpuopt.compute.optimizer import FusedOptimizer, fuse_optimizer, init_momentum_buffers, is_fused
from tests._lightning import quiet_trainer


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(5, 3, generator=g)),
        torch.nn.Parameter(torch.randn(3, generator=g)),
    ]


def _step(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()


@pytest.mark.parametrize(
    ("cls", "kw"),
    [
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4}),
        (torch.optim.Adam, {"lr": 1e-2}),
        (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01}),
        (torch.optim.Adagrad, {"lr": 0.1}),
    ],
)
def test_switched_optimizer_steps_like_one_built_fused(cls, kw) -> None:
    a, b = _params(), _params()
    switched, native = cls(a, **kw), cls(b, **kw, fused=True)
    for seed in range(2):  # state exists before the switch (momentum, moments): it is kept
        _step(switched, a, seed)
        _step(native, b, seed)
    assert not is_fused(switched)
    assert fuse_optimizer(switched) is None
    assert is_fused(switched) and all(g["fused"] and not g["foreach"] for g in switched.param_groups)
    assert fuse_optimizer(switched) is None  # idempotent
    for seed in range(2, 6):
        _step(switched, a, seed)
        _step(native, b, seed)
    for p, q in zip(a, b, strict=True):  # fused and foreach kernels round differently in the first steps
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_switched_sgd_skips_an_inf_step_on_the_device() -> None:
    """GradScaler hands the inf flag to the switched optimizer: the step is skipped without reading it."""
    params = _params()
    opt = torch.optim.SGD(params, lr=0.1)
    assert fuse_optimizer(opt) is None
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    before = [p.detach().clone() for p in params]
    loss = (params[0].sum() + params[1].sum()) * float("inf")
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    for p, q in zip(params, before, strict=True):
        assert torch.equal(p, q)  # skipped
    assert scaler.get_scale() < 2.0**4  # and the scale backed off


def test_classes_without_fused_kernels_are_named() -> None:
    opt = torch.optim.RMSprop(_params(), lr=0.1)
    why = fuse_optimizer(opt)
    assert why is not None and "RMSprop" in why and "no fused kernel" in why
    assert not is_fused(opt)


def test_torch_validation_is_respected() -> None:
    opt = torch.optim.SGD(_params(), lr=0.1, differentiable=True)  # fused kernels refuse differentiable
    why = fuse_optimizer(opt)
    assert why is not None and "cannot be fused" in why
    assert not is_fused(opt) and not opt.param_groups[0]["fused"]


@pytest.fixture
def uninitialized_memory(monkeypatch):
    """``torch.empty_like`` in torch's SGD returns NaNs, as uninitialized device memory may hold."""
    import torch.optim.sgd as sgd

    monkeypatch.setattr(sgd.torch, "empty_like", lambda t, **kw: torch.full_like(t, float("nan")))


def _overflow_first(params, opt, scaler, steps=3):  # type: ignore[no-untyped-def]
    """``steps`` scaled steps; the first one's gradients are inf, so the GradScaler skips it."""
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        loss = sum((p * torch.randn(p.shape, generator=g)).sum() for p in params) ** 2
        opt.zero_grad()
        scaler.scale(loss * (float("inf") if i == 0 else 1.0)).backward()
        scaler.step(opt)
        scaler.update()


def test_zero_buffers_make_a_fused_sgds_skipped_first_step_harmless(uninitialized_memory) -> None:
    kw = {"lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4}
    ref = _params()
    _overflow_first(ref, torch.optim.SGD(ref, **kw), torch.amp.GradScaler("cpu"))  # skips the step itself
    bare = _params()
    _overflow_first(bare, torch.optim.SGD(bare, **kw, fused=True), torch.amp.GradScaler("cpu"))
    assert not all(torch.isfinite(p).all() for p in bare)  # torch's own fused SGD: momentum from garbage
    guarded, opt = _params(), None
    opt = torch.optim.SGD(guarded, **kw, fused=True)
    assert init_momentum_buffers(opt) == 2 and init_momentum_buffers(opt) == 0  # once
    assert all(torch.equal(opt.state[p]["momentum_buffer"], torch.zeros_like(p)) for p in guarded)
    _overflow_first(guarded, opt, torch.amp.GradScaler("cpu"))
    for p, q in zip(guarded, ref, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert init_momentum_buffers(torch.optim.Adam(_params(), lr=0.1, fused=True)) == 0  # Adam has no bug
    assert init_momentum_buffers(torch.optim.SGD(_params(), lr=0.1, fused=True)) == 0  # no momentum


def test_channels_last_parameters_get_buffers_of_their_layout() -> None:
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(conv.parameters(), lr=0.1, momentum=0.9, fused=True)
    init_momentum_buffers(opt)
    buf = opt.state[conv.weight]["momentum_buffer"]
    assert buf.stride() == conv.weight.stride() and buf.is_contiguous(memory_format=torch.channels_last)


def test_sgd_with_dampening_stays_unfused_under_a_grad_scaler() -> None:
    opt = torch.optim.SGD(_params(), lr=0.1, momentum=0.9, dampening=0.1)
    why = fuse_optimizer(opt)
    assert why is not None and "dampening" in why and not is_fused(opt)
    assert fuse_optimizer(opt, amp_scaling=False) is None  # no GradScaler, no skipped step: fused


class _Module(pl.LightningModule):
    def __init__(self, opt_cls: type[torch.optim.Optimizer] = torch.optim.SGD) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 2)
        self.opt_cls = opt_cls

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return torch.nn.functional.cross_entropy(self.lin(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return self.opt_cls(self.parameters(), lr=0.1)


def _data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(
        torch.randn(32, 8, generator=g), torch.randint(0, 2, (32,), generator=g)
    )
    return torch.utils.data.DataLoader(ds, batch_size=8)


def _fit(module: pl.LightningModule, callbacks: list[pl.Callback], **kw) -> pl.Trainer:  # type: ignore[no-untyped-def]
    trainer = quiet_trainer(
        accelerator="cpu",
        max_steps=4,
        callbacks=callbacks,
        **kw,
    )
    trainer.fit(module, _data())
    return trainer


def _amp() -> MixedPrecision:
    # 16-mixed with a GradScaler, on the CPU (Lightning refuses precision="16-mixed" there, not the plugin)
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


def test_callback_fuses_under_a_grad_scaler_and_matches_a_native_fused_run() -> None:
    cb = FusedOptimizer()
    mod = _Module()
    trainer = _fit(mod, [cb], plugins=[_amp()])
    assert cb.fused == ["SGD"] and cb.skipped == []
    assert is_fused(trainer.optimizers[0])

    class Native(_Module):
        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1, fused=True)

    ref = Native()
    _fit(ref, [], plugins=[_amp()])
    torch.testing.assert_close(mod.lin.weight, ref.lin.weight, rtol=0, atol=0)
    assert cb.state_dict() == {"fused": ["SGD"], "skipped": []}
    other = FusedOptimizer()
    other.load_state_dict(cb.state_dict())
    assert other.fused == ["SGD"]


class _Overflowing(_Module):
    """SGD with momentum whose first step's loss is inf (as fp16 at the GradScaler's first scale)."""

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if self.global_step == 0 and batch_idx == 0 else loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, fused=self.fused)


@pytest.mark.parametrize("built_fused", [False, True])
def test_callback_gives_fused_sgd_zero_momentum_before_a_skipped_first_step(
    uninitialized_memory, built_fused
) -> None:
    ref = _Overflowing()
    ref.fused = None
    _fit(ref, [], plugins=[_amp()])  # unfused: the GradScaler skips the whole first step
    assert torch.isfinite(ref.lin.weight).all()
    mod = _Overflowing()
    mod.fused = True if built_fused else None  # constructed fused, or switched by the callback
    _fit(mod, [FusedOptimizer()], plugins=[_amp()])
    torch.testing.assert_close(mod.lin.weight, ref.lin.weight, rtol=1e-6, atol=1e-7)


def test_unsupported_optimizer_warns_once_with_the_reason() -> None:
    cb = FusedOptimizer()
    with pytest.warns(UserWarning, match="RMSprop"):
        _fit(_Module(torch.optim.RMSprop), [cb], plugins=[_amp()])
    assert cb.fused == [] and cb.skipped and cb.skipped[0][0] == "RMSprop"


def test_gradient_clipping_under_mixed_precision_leaves_optimizers_alone() -> None:
    cb = FusedOptimizer()
    with pytest.warns(UserWarning, match="gradient clipping"):
        trainer = _fit(_Module(), [cb], plugins=[_amp()], gradient_clip_val=1.0)
    assert not is_fused(trainer.optimizers[0])  # Lightning would raise on the first clip otherwise
    assert cb.skipped == [("SGD", "gradient clipping under mixed precision")]


def test_clipping_in_full_precision_still_fuses() -> None:
    cb = FusedOptimizer()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec).*")
        trainer = _fit(_Module(), [cb], gradient_clip_val=1.0)
    assert is_fused(trainer.optimizers[0]) and cb.fused == ["SGD"]


@pytest.mark.parametrize("clip", [None, 1.0])
def test_bf16_mixed_fuses_adamw_and_keeps_gradient_clipping(clip) -> None:
    # no GradScaler under bf16-mixed: the switch changes the kernel only, and Lightning still clips
    cb = FusedOptimizer()
    mod = _Module(torch.optim.AdamW)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec).*")
        trainer = _fit(mod, [cb], precision="bf16-mixed", gradient_clip_val=clip)
    inner = trainer.optimizers[0]
    assert cb.fused == ["AdamW"] and cb.skipped == []
    assert inner.defaults["fused"] and all(g["fused"] for g in inner.param_groups)
    assert not is_fused(inner)  # not marked as unscaling inside its step: clip_gradients accepts it

    class Native(_Module):
        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.AdamW(self.parameters(), lr=0.1, fused=True)

    ref = Native(torch.optim.AdamW)
    if clip is None:  # Lightning refuses to clip a natively fused optimizer under mixed precision
        _fit(ref, [], precision="bf16-mixed")
        torch.testing.assert_close(mod.lin.weight, ref.lin.weight, rtol=0, atol=0)


def test_resume_keeps_the_switch(tmp_path) -> None:
    def trainer(max_steps: int, cb: FusedOptimizer) -> pl.Trainer:
        return quiet_trainer(
            accelerator="cpu",
            max_steps=max_steps,
            callbacks=[cb],
            plugins=[_amp()],
            default_root_dir=str(tmp_path),
        )

    first = trainer(2, FusedOptimizer())
    first.fit(_Module(), _data())
    ckpt = tmp_path / "mid.ckpt"
    first.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["optimizer_states"][0]["param_groups"][0]
    assert saved["fused"] is True  # the switch is part of the optimizer state
    cb = FusedOptimizer()
    resumed = trainer(4, cb)
    resumed.fit(_Module(), _data(), ckpt_path=str(ckpt))
    assert is_fused(resumed.optimizers[0])
    assert resumed.global_step == 4


@pytest.mark.gpu
def test_gpu_16_mixed_fit_runs_fused() -> None:
    from lightning_gpuopt.bench.models import ImageClassifier

    cb = FusedOptimizer()
    x = torch.randn(32, 3, 16, 16)
    y = torch.randint(0, 4, (32,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    trainer = quiet_trainer(
        accelerator="gpu",
        devices=1,
        precision="16-mixed",
        max_steps=4,
        callbacks=[cb],
    )
    trainer.fit(ImageClassifier("small", num_classes=4, fused=False), loader)
    assert cb.fused == ["SGD"] and is_fused(trainer.optimizers[0])


@pytest.mark.gpu
def test_gpu_fused_sgd_trains_through_fp16_overflow_at_the_first_scale() -> None:
    """A ResNet-style net whose first fp16 steps overflow at the GradScaler's 65536: its loss stays finite."""
    from lightning_gpuopt.bench.models import SmallResNet

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net, self.losses = SmallResNet(num_classes=1000), []

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y) * 4096.0  # overflows fp16 at 65536
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=1e-6, momentum=0.9)

    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 1000, (64,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    model, cb = Net(), FusedOptimizer()
    trainer = quiet_trainer(accelerator="gpu", devices=1, precision="16-mixed", max_steps=12, callbacks=[cb])
    trainer.fit(model, loader)
    scale = trainer.precision_plugin.scaler.get_scale()
    assert cb.fused == ["SGD"] and scale < 65536.0  # at least one step was skipped ...
    assert all(torch.isfinite(v) for v in model.losses[-4:]) and scale > 1.0  # ... and training went on


class CLIModule(_Module):
    """For LightningCLI: a module with a data loader of its own."""

    def __init__(self) -> None:
        super().__init__()

    def train_dataloader(self):  # type: ignore[no-untyped-def]
        return _data()


def test_compute_callbacks_from_lightning_cli_yaml(tmp_path) -> None:
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    from lightning_gpuopt.compute.compile import CompileModel

    config = tmp_path / "config.yaml"
    config.write_text(
        f"""
trainer:
  accelerator: cpu
  max_steps: 2
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  enable_checkpointing: false
  default_root_dir: {tmp_path}
  callbacks:
    - class_path: lightning_gpuopt.FusedOptimizer
    - class_path: lightning_gpuopt.compute.compile.CompileModel
      init_args:
        when: auto
"""
    )
    with pytest.warns(UserWarning, match=r"CompileModel\(when='auto'\)"):
        cli = LightningCLI(CLIModule, args=["fit", "--config", str(config)], save_config_callback=None)
    fused = next(c for c in cli.trainer.callbacks if isinstance(c, FusedOptimizer))
    comp = next(c for c in cli.trainer.callbacks if isinstance(c, CompileModel))
    assert fused.fused == ["SGD"] and is_fused(cli.trainer.optimizers[0])
    assert comp.when == "auto" and not comp.compiled and comp.decision is None  # CPU: warned, stepped aside


def test_image_classifier_zeroes_the_momentum_of_each_fits_optimizer() -> None:
    from lightning_gpuopt.bench.models import ImageClassifier

    module = ImageClassifier("small", num_classes=4, fused=True)
    for _ in range(2):  # each fit's configure_optimizers makes a new optimizer
        opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9, fused=True)
        module.on_before_optimizer_step(opt)
        assert all(torch.count_nonzero(opt.state[p]["momentum_buffer"]) == 0 for p in module.parameters())
