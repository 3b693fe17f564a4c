"""``fp16-overflow``: the rule on hand-made windows, ``ScaleWatch`` (the GradScaler's scale read without
a sync), and real CPU fits under ``16-mixed`` through Lightning's MixedPrecision plugin with a CPU
GradScaler."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch.nn import functional as F

from lightning_gpuopt.observe.advisor import (
    KINDS,
    AdvisorThresholds,
    BottleneckAdvisor,
    Evidence,
    RunConfig,
    diagnose,
)
from lightning_gpuopt.observe.advisor.rules import Context, fp16_overflow
from lightning_gpuopt.observe.advisor.scale import ScaleWatch, falls_between
from tests.observe.advisor_cases import TinyClassifier, cfg, cpu_trainer, ev, fast_loader, kinds

# a window of a run whose scaler backed off every step: 65536 -> 1024 in 20 steps after warm-up
OVERFLOWING: dict[str, float] = {
    "grad_scale_start": 65536.0,
    "grad_scale": 1024.0,
    "grad_scale_falls": 6.0,
    "grad_scale_window_falls": 4.0,
    "grad_scale_steps": 20.0,
}


def _context(evidence: dict[str, Any], **config: Any) -> Context:
    return Context(Evidence.from_metrics(evidence), RunConfig.from_dict(config), AdvisorThresholds())


# -----------------------------------------------------------------------------------------------------------
# the rule
# -----------------------------------------------------------------------------------------------------------


def test_the_kind_is_listed():
    assert KINDS.index("fp16-overflow") == KINDS.index("amp-host-sync") + 1


def test_falls_in_a_window_are_an_overflow_with_their_evidence():
    v = fp16_overflow(_context(OVERFLOWING, device_type="cuda", precision="16-mixed", grad_scaler=True))
    assert v is not None and v.kind == "fp16-overflow" and v.severity == "warning" and v.gain is None
    assert v.evidence == {
        "precision": "16-mixed",
        "grad_scale_start": 65536.0,
        "grad_scale_end": 1024.0,
        "scale_falls": 6,
        "window_falls": 4,
        "steps_observed": 20,
    }
    assert 'precision="bf16-mixed"' in v.advice
    assert '`Trainer(**fast_trainer_kwargs(model, precision="bf16-mixed"))`' in v.advice
    assert "at least 6 time(s) in 20 optimizer steps" in v.advice and "from 65536 to 1024" in v.advice
    assert "Below 1" not in v.advice  # the scale is still high: the floor is not what fired
    assert "diverged" not in v.advice


def test_a_scale_below_the_floor_fires_without_falls_in_the_window():
    window = {**OVERFLOWING, "grad_scale": 0.25, "grad_scale_window_falls": 0.0}
    v = fp16_overflow(_context(window, device_type="cuda", precision="16-mixed", grad_scaler=True))
    assert v is not None and v.evidence["grad_scale_end"] == 0.25 and v.evidence["window_falls"] == 0
    assert "Below 1 the scale no longer lifts small gradients" in v.advice
    # every step skipped may be a diverged loss, which no precision fixes: the advice says how to tell
    assert "the model has diverged and no precision fixes it" in v.advice and "learning rate" in v.advice
    assert "init_momentum_buffers" in v.advice  # torch's fused SGD after a skipped first step


def test_a_healthy_scaler_is_silent():
    # one backoff after a growth overshoots, a scale far above 1: the scaler doing its job
    healthy = {**OVERFLOWING, "grad_scale": 32768.0, "grad_scale_falls": 1.0, "grad_scale_window_falls": 1.0}
    assert fp16_overflow(_context(healthy, precision="16-mixed", grad_scaler=True)) is None
    grown = {**OVERFLOWING, "grad_scale": 131072.0, "grad_scale_falls": 0.0, "grad_scale_window_falls": 0.0}
    assert fp16_overflow(_context(grown, precision="16-mixed", grad_scaler=True)) is None
    two = {**OVERFLOWING, "grad_scale_window_falls": 2.0}
    assert fp16_overflow(_context(two, precision="16-mixed", grad_scaler=True)) is None


@pytest.mark.parametrize(
    "config",
    [
        {"precision": "bf16-mixed", "grad_scaler": False},
        {"precision": "32-true", "grad_scaler": False},
        {"precision": "16-mixed", "grad_scaler": False},  # GradScaler(enabled=False)
        {"precision": "bf16-mixed", "grad_scaler": True},  # no fp16 to overflow, whatever the scaler says
        {"precision": "16-mixed", "grad_scaler": None},  # unknown
    ],
)
def test_silent_without_an_fp16_grad_scaler(config):
    # the rule runs only where the run has an enabled GradScaler (NEEDS), and judges fp16 only
    assert "fp16-overflow" not in kinds(diagnose(OVERFLOWING, {"device_type": "cuda", **config}))


def test_silent_where_the_scale_was_not_read():
    assert fp16_overflow(_context({}, precision="16-mixed", grad_scaler=True)) is None
    assert "fp16-overflow" not in kinds(diagnose(ev(), cfg()))  # the healthy H200 window: no scale read


def test_diagnose_ranks_it_with_the_warnings():
    out = diagnose(ev(**OVERFLOWING), cfg())
    assert kinds(out) == ["fp16-overflow"]


def test_a_gpu_without_fast_bf16_is_told_the_fp32_way():
    v = fp16_overflow(
        _context(OVERFLOWING, device_type="cuda", capability=(7, 5), precision="16-mixed", grad_scaler=True)
    )
    assert v is not None and v.evidence["capability"] == "7.5"
    assert "7.5 has no fast bf16" in v.advice and 'precision="32-true"' in v.advice
    assert "torch.autocast" in v.advice


def test_thresholds_are_the_callers():
    two = {**OVERFLOWING, "grad_scale_window_falls": 2.0, "grad_scale": 8.0}
    c = Context(
        Evidence.from_metrics(two),
        RunConfig(precision="16-mixed", grad_scaler=True),
        AdvisorThresholds(fp16_scale_falls=2),
    )
    assert fp16_overflow(c) is not None
    strict = AdvisorThresholds(fp16_scale_falls=10, fp16_scale_floor=16.0)
    c = Context(Evidence.from_metrics(two), RunConfig(precision="16-mixed", grad_scaler=True), strict)
    assert fp16_overflow(c) is not None  # 8 < 16


@pytest.mark.parametrize(
    ("kwargs", "err"),
    [
        ({"fp16_scale_floor": -1.0}, ValueError),
        ({"fp16_scale_floor": "1"}, TypeError),
        ({"fp16_scale_falls": 0}, ValueError),
        ({"fp16_scale_falls": 3.0}, TypeError),
    ],
)
def test_threshold_validation(kwargs, err):
    with pytest.raises(err, match=next(iter(kwargs))):
        AdvisorThresholds(**kwargs)


# -----------------------------------------------------------------------------------------------------------
# ScaleWatch
# -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("before", "after", "backoff", "falls"),
    [
        (65536.0, 32768.0, 0.5, 1),
        (65536.0, 1.0, 0.5, 16),
        (65536.0, 65536.0, 0.5, 0),
        (1024.0, 4096.0, 0.5, 0),
        (100.0, 90.0, 0.5, 1),  # fell, by less than a backoff: a growth in between hid part of it
        (1000.0, 1.0, 0.1, 3),
        (8.0, 0.0, 0.5, 1),
    ],
)
def test_falls_between(before, after, backoff, falls):
    assert falls_between(before, after, backoff) == falls


class _Event:
    """A CUDA event stand-in whose completion the test decides; ``synchronize`` is a test failure."""

    def __init__(self) -> None:
        self.recorded = False
        self.done = False

    def record(self, stream: object = None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.recorded and self.done

    def synchronize(self) -> None:
        raise AssertionError("ScaleWatch waited for the GPU")


def _stepped(init: float) -> torch.amp.GradScaler:
    scaler = torch.amp.GradScaler("cpu", init_scale=init)
    scaler.scale(torch.ones(()))  # creates the scale tensor, as the first training step does
    return scaler


def test_queued_reads_wait_for_their_event_and_count_in_order():
    events: list[_Event] = []

    def factory() -> _Event:
        events.append(_Event())
        return events[-1]

    scaler = _stepped(65536.0)
    watch = ScaleWatch(scaler, torch.device("cpu"), event_factory=factory)
    watch.sample(10)
    scaler.update(8192.0)  # three backoffs' worth
    watch.sample(30)
    assert watch.evidence() == Evidence()  # neither copy has completed: nothing is read, nothing awaited
    events[0].done = True
    e = watch.evidence()
    assert (e.grad_scale_start, e.grad_scale, e.grad_scale_falls, e.grad_scale_steps) == (65536, 65536, 0, 0)
    events[1].done = True
    e = watch.evidence()
    got = (e.grad_scale, e.grad_scale_falls, e.grad_scale_window_falls, e.grad_scale_steps)
    assert got == (8192, 3, 3, 20)
    scaler.update(16384.0)  # grew: no fall
    watch.sample(50)
    events[2].done = True
    e = watch.evidence()
    assert (e.grad_scale_start, e.grad_scale, e.grad_scale_falls, e.grad_scale_window_falls) == (
        65536.0,
        16384.0,
        3,
        0,
    )


def test_a_cpu_scaler_is_read_at_once():
    scaler = _stepped(4.0)
    watch = ScaleWatch(scaler, torch.device("cpu"))
    watch.sample(0)
    scaler.update(0.5)
    watch.sample(5)
    e = watch.evidence()
    assert (e.grad_scale_start, e.grad_scale, e.grad_scale_falls, e.grad_scale_steps) == (4.0, 0.5, 3, 5)


def test_before_the_first_step_the_initial_scale_is_read():
    watch = ScaleWatch(torch.amp.GradScaler("cpu", init_scale=256.0), torch.device("cpu"))
    watch.sample(0)
    assert watch.evidence().grad_scale == 256.0


class _Plugin:
    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler


def test_only_an_enabled_grad_scaler_is_watched():
    cpu = torch.device("cpu")
    assert isinstance(ScaleWatch.of(_Plugin(torch.amp.GradScaler("cpu")), cpu), ScaleWatch)
    assert ScaleWatch.of(_Plugin(torch.amp.GradScaler("cpu", enabled=False)), cpu) is None
    assert ScaleWatch.of(_Plugin(None), cpu) is None
    assert ScaleWatch.of(object(), cpu) is None
    assert ScaleWatch.of(None, cpu) is None


class _OldScaler:
    """A GradScaler without ``_get_scale_async``: its only reading, ``get_scale()``, would sync on CUDA."""

    def is_enabled(self) -> bool:
        return True

    def get_scale(self) -> float:
        raise AssertionError("get_scale() synchronizes the GPU")


def test_on_cuda_without_an_async_read_it_warns_once_and_steps_aside():
    from lightning_gpuopt._common import _warnings

    _warnings().discard(
        "BottleneckAdvisor: this torch's GradScaler has no `_get_scale_async`; reading its scale would "
        "synchronize the GPU every window, so fp16-overflow is not judged."
    )
    watch = ScaleWatch.of(_Plugin(_OldScaler()), torch.device("cuda", 0))
    assert watch is not None
    with pytest.warns(UserWarning, match="fp16-overflow is not judged"):
        watch.sample(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        watch.sample(20)
    assert watch.evidence() == Evidence()


# -----------------------------------------------------------------------------------------------------------
# CPU fits under 16-mixed with a CPU GradScaler
# -----------------------------------------------------------------------------------------------------------


class _LossOverflow(TinyClassifier):
    """Gradients that overflow fp16: a loss a million times too large."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * 1e6


class _ActivationOverflow(TinyClassifier):
    """Activations that overflow fp16 in the forward pass: inf logits at any scale, every step skipped."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = torch.flatten(F.adaptive_avg_pool2d(F.relu(self.conv(x)), 4), 1)
        return self.head(features * 1e5)


def _fp16_fit(tmp_path: Any, model: TinyClassifier, **kwargs: Any) -> BottleneckAdvisor:
    advisor = BottleneckAdvisor(warmup_steps=2, window_steps=4, min_windows=2, verbose=False)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    cpu_trainer(tmp_path, [advisor], steps=14, plugins=[plugin], **kwargs).fit(model, fast_loader())
    return advisor


@pytest.mark.parametrize("model_type", [_LossOverflow, _ActivationOverflow])
def test_an_overflowing_fp16_fit_is_named(tmp_path, model_type):
    advisor = _fp16_fit(tmp_path, model_type())
    assert advisor.windows == 3
    assert kinds(advisor.verdicts) == ["fp16-overflow"], advisor.history
    v = advisor.verdicts[0]
    # warm-up ends after step 2, the scaler having backed off twice from 65536; one fall a step since
    assert v.evidence["precision"] == "16-mixed"
    assert v.evidence["grad_scale_start"] == 16384.0 and v.evidence["grad_scale_end"] == 4.0
    assert v.evidence["scale_falls"] == 12 and v.evidence["window_falls"] == 4
    assert v.evidence["steps_observed"] == 12
    assert "fp16-overflow" in advisor.summary() and 'precision="bf16-mixed"' in advisor.summary()


def test_a_healthy_fp16_fit_is_silent(tmp_path):
    advisor = _fp16_fit(tmp_path, TinyClassifier())
    assert advisor.windows == 3 and advisor.verdicts == [], advisor.history
    last = advisor.history[-1]["evidence"]
    # the scale was read, and held: silence is the verdict, not a blind spot
    assert (last["grad_scale_start"], last["grad_scale"], last["grad_scale_falls"]) == (65536.0, 65536.0, 0)
    assert all("fp16-overflow" not in h["diagnosed"] for h in advisor.history)


def test_bf16_and_fp32_fits_are_not_watched(tmp_path):
    # Lightning turns 16-mixed on the CPU into bf16-mixed, with no GradScaler: nothing to read or fire
    for precision in ("16-mixed", "bf16-mixed", "32-true"):
        advisor = BottleneckAdvisor(warmup_steps=2, window_steps=4, min_windows=1, verbose=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = cpu_trainer(tmp_path, [advisor], steps=10, precision=precision)
            trainer.fit(_LossOverflow(), fast_loader())
        assert advisor.config.grad_scaler is False and advisor.config.precision != "16-mixed"
        assert "fp16-overflow" not in kinds(advisor.verdicts)
        assert all(h["evidence"]["grad_scale"] is None for h in advisor.history)


# -----------------------------------------------------------------------------------------------------------
# on a GPU
# -----------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_scale_is_read_without_a_sync():
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
    scaler.scale(torch.ones((), device="cuda"))
    watch = ScaleWatch(scaler, torch.device("cuda", 0))
    torch.cuda.set_sync_debug_mode("error")
    try:
        watch.sample(0)
        scaler.update(128.0)
        watch.sample(10)
        watch.evidence()  # reads only what has completed
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    e = watch.evidence()
    assert (e.grad_scale_start, e.grad_scale, e.grad_scale_falls, e.grad_scale_steps) == (1024, 128, 3, 10)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", [TinyClassifier, _ActivationOverflow])
def test_gpu_fp16_fit(tmp_path, model_type):
    """On CUDA under 16-mixed: the overflowing model is named, the healthy one is not."""
    advisor = BottleneckAdvisor(warmup_steps=2, window_steps=4, min_windows=2, verbose=False)
    cpu_trainer(tmp_path, [advisor], steps=22, accelerator="gpu", precision="16-mixed").fit(
        model_type(), fast_loader()
    )
    assert advisor.config.grad_scaler is True
    if model_type is TinyClassifier:
        assert "fp16-overflow" not in kinds(advisor.verdicts)
        assert advisor.history[-1]["evidence"]["grad_scale"] is not None
    else:
        assert "fp16-overflow" in kinds(advisor.verdicts), advisor.history
        v = next(v for v in advisor.verdicts if v.kind == "fp16-overflow")
        assert v.evidence["scale_falls"] >= 3
        assert v.evidence["grad_scale_end"] < v.evidence["grad_scale_start"]
