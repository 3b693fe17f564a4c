"""ImageClassifier's optimizer: fused (no per-step host sync under GradScaler) where it can be."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_gpuopt.bench.models import ImageClassifier
from tests._lightning import quiet_trainer


def _fused(opt: torch.optim.Optimizer) -> bool:
    return bool(opt.defaults.get("fused")) and bool(getattr(opt, "_step_supports_amp_scaling", False))


def test_auto_is_unfused_for_cpu_parameters() -> None:
    opt = ImageClassifier("small").configure_optimizers()
    assert not _fused(opt)


def test_explicit_fused_lets_the_scaler_skip_steps_on_the_device() -> None:
    opt = ImageClassifier("small", fused=True).configure_optimizers()
    assert _fused(opt)
    assert not _fused(ImageClassifier("small", fused=False).configure_optimizers())


def test_auto_is_fused_for_cuda_parameters_without_clipping(monkeypatch: pytest.MonkeyPatch) -> None:
    """The auto rule itself (the device check) without a GPU: parameters that report a CUDA device."""
    module = ImageClassifier("small")
    captured: dict[str, object] = {}

    class FakeParam:
        device = torch.device("cuda", 0)

    def fake_sgd(params: list[object], **kwargs: object) -> str:
        captured.update(kwargs)
        return "sgd"

    monkeypatch.setattr(module, "parameters", lambda: iter([FakeParam(), FakeParam()]))
    monkeypatch.setattr(torch.optim, "SGD", fake_sgd)
    assert module.configure_optimizers() == "sgd"
    assert captured["fused"] is True

    trainer = pl.Trainer(gradient_clip_val=1.0, logger=False, enable_checkpointing=False)
    trainer.strategy.connect(module)
    module.trainer = trainer
    module.configure_optimizers()
    assert captured["fused"] is None  # Lightning refuses clipping with an unscaling optimizer under 16-mixed


def test_fused_model_trains_under_lightning_on_cpu() -> None:
    x = torch.randn(16, 3, 16, 16)
    y = torch.randint(0, 4, (16,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    module = ImageClassifier("small", num_classes=4, fused=True)
    before = [p.detach().clone() for p in module.parameters()]
    trainer = quiet_trainer(
        max_steps=2,
    )
    trainer.fit(module, loader)
    assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
