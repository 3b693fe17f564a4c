"""StreamPriority: the fit runs on a high-priority CUDA stream, restored afterwards; steps aside on a CPU."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch

from lightning_gpuopt import StreamPriority
from lightning_gpuopt.models import ImageClassifier
from tests._lightning import quiet_trainer


def _loader(n: int = 16, device: str = "cpu") -> torch.utils.data.DataLoader:
    x = torch.randn(n, 3, 16, 16)
    y = torch.randint(0, 4, (n,))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


class _StreamProbe(pl.Callback):
    def __init__(self) -> None:
        self.priorities: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if pl_module.device.type == "cuda":
            self.priorities.append(torch.cuda.current_stream(pl_module.device).priority)


def _trainer(callbacks: list[pl.Callback], accelerator: str = "cpu", **kw) -> pl.Trainer:  # type: ignore[no-untyped-def]
    return quiet_trainer(
        accelerator=accelerator,
        devices=1,
        max_steps=2,
        callbacks=callbacks,
        **kw,
    )


@pytest.mark.parametrize("bad", [True, 1.5, "low", None])
def test_rejects_bad_priority(bad: object) -> None:
    with pytest.raises((TypeError, ValueError), match="priority"):
        StreamPriority(bad)  # type: ignore[arg-type]


def test_cpu_run_warns_once_and_steps_aside() -> None:
    from lightning_gpuopt.compute import streams

    streams._warning_cache.clear()  # "once" per process: another test may have warned already
    cb = StreamPriority()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer([cb]).fit(ImageClassifier("small", num_classes=4), _loader())
        _trainer([cb]).fit(ImageClassifier("small", num_classes=4), _loader())
    msgs = [str(w.message) for w in caught if "StreamPriority" in str(w.message)]
    assert len(msgs) == 1 and "CUDA devices only" in msgs[0]
    assert not cb.active and cb.stream_priority is None
    assert cb.state_dict() == {"priority": "high"}
    assert repr(cb) == "StreamPriority(priority='high')"


@pytest.mark.gpu
def test_fit_runs_on_a_high_priority_stream_and_restores() -> None:
    before = torch.cuda.current_stream()
    cb, probe = StreamPriority(), _StreamProbe()
    _trainer([cb, probe], accelerator="gpu").fit(ImageClassifier("small", num_classes=4), _loader())
    highest = torch.cuda.Stream.priority_range()[1]
    assert probe.priorities and all(p == highest for p in probe.priorities)
    assert highest < 0  # a real priority above the default on this GPU
    assert torch.cuda.current_stream() == before and not cb.active


@pytest.mark.gpu
def test_restores_the_stream_after_an_exception() -> None:
    class Boom(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
            raise RuntimeError("boom")

    before = torch.cuda.current_stream()
    cb = StreamPriority(-1)
    with pytest.raises(RuntimeError, match="boom"):
        _trainer([cb, Boom()], accelerator="gpu").fit(ImageClassifier("small", num_classes=4), _loader())
    assert torch.cuda.current_stream() == before and not cb.active
