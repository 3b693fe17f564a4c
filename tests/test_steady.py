"""``bench.steady``: a fit measured from batch-end marks, stopped after its window; turns (``benchmarks/_shared.py``) and
their rows."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt.bench.steady import Measurement, StepClock, measure_loop, summarize
from tests._lightning import quiet_trainer
from tests.test_benchmarks import load


class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _loader(n: int = 64, batch: int = 4) -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(n, 4), torch.randint(0, 2, (n,))), batch_size=batch)


def test_step_clock_measures_its_window_and_stops_the_fit():
    clock = StepClock(warmup=3, steps=10)
    trainer = quiet_trainer(accelerator="cpu", max_epochs=-1, callbacks=[clock])
    trainer.fit(_Module(), _loader())
    m = clock.measurement
    assert m is not None and m.steps == 10 and m.samples == 40
    assert trainer.global_step == 3 + 1 + 10  # warm-up, the batch that opens the window, the window
    assert m.samples_per_sec and m.samples_per_sec > 0 and m.p50_ms is not None and m.p90_ms >= m.p50_ms


def test_step_clock_keeps_a_short_window_when_the_fit_ends_first():
    clock = StepClock(warmup=1, steps=500)
    trainer = quiet_trainer(accelerator="cpu", max_epochs=1, callbacks=[clock])
    trainer.fit(_Module(), _loader(n=40))
    assert clock.measurement is not None and clock.measurement.steps == 10 - 1 - 1


def test_step_clock_resets_for_a_second_fit():
    clock = StepClock(warmup=0, steps=4)
    for _ in range(2):
        quiet_trainer(accelerator="cpu", max_epochs=-1, callbacks=[clock]).fit(_Module(), _loader())
        assert clock.measurement is not None and clock.measurement.steps == 4


class _Overflows(_Module):
    """fp16 gradients that overflow at every step: the GradScaler skips each update and halves its scale."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * 1e30


@pytest.mark.parametrize(("module", "falls"), [(_Module, 0), (_Overflows, 6)])
def test_step_clock_records_where_fp16s_grad_scaler_went_in_its_window(module, falls):
    from lightning.pytorch.plugins import MixedPrecision

    torch.manual_seed(0)  # the healthy module's gradients stay far below fp16's limit at this scale
    clock = StepClock(warmup=2, steps=6)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    quiet_trainer(accelerator="cpu", max_epochs=-1, callbacks=[clock], plugins=[plugin]).fit(module(), _loader())
    extra = clock.measurement.extra
    assert extra["grad_scale_falls"] == falls
    assert extra["grad_scale_end"] == extra["grad_scale_start"] / 2**falls
    # without a GradScaler (fp32, bf16) there is nothing to read
    clock = StepClock(warmup=2, steps=6)
    quiet_trainer(accelerator="cpu", max_epochs=-1, callbacks=[clock]).fit(module(), _loader())
    assert "grad_scale_end" not in clock.measurement.extra


@pytest.mark.parametrize(
    ("kwargs", "error"), [({"warmup": -1}, ValueError), ({"steps": 1}, ValueError), ({"warmup": True}, TypeError)]
)
def test_step_clock_checks_its_arguments(kwargs, error):
    """A wrong value is a ``ValueError``, a wrong type (a bool for a count) a ``TypeError``."""
    with pytest.raises(error, match=next(iter(kwargs))):
        StepClock(**kwargs)


def test_turns_alternate_and_a_failing_variant_keeps_its_error():
    order: list[str] = []

    def ok(name: str):
        def run() -> Measurement:
            order.append(name)
            return Measurement(10, 1.0, (1.0, 2.0))

        return run

    def bad() -> Measurement:
        order.append("bad")
        raise RuntimeError("no data")

    out = load("_shared.py").take_turns({"ceiling": ok("ceiling"), "a": ok("a"), "bad": bad}, repeats=3)
    assert order == ["ceiling", "a", "bad", "ceiling", "a", "ceiling", "a"]
    rows = {r["name"]: r for r in summarize(out, "ceiling")}
    assert rows["bad"]["samples_per_sec"] is None and "no data" in rows["bad"]["error"]
    assert rows["a"]["of_ceiling"] == 1.0 and len(rows["a"]["repeats"]) == 3


def test_ratios_are_taken_turn_by_turn():
    ceil = [Measurement(100, 1.0, (1.0,)), Measurement(50, 1.0, (1.0,)), Measurement(100, 1.0, (1.0,))]
    fed = [Measurement(90, 1.0, (1.0,)), Measurement(45, 1.0, (1.0,)), Measurement(70, 1.0, (1.0,))]
    row = summarize({"c": ceil, "f": fed}, "c")[1]
    assert [r["of_ceiling"] for r in row["repeats"]] == [0.9, 0.9, 0.7]
    assert row["of_ceiling"] == 0.9 and row["of_ceiling_worst"] == 0.7
    assert row["samples_per_sec"] == 70 and row["spread"] == pytest.approx(45 / 70)


def test_measure_loop_counts_every_step():
    calls = []
    m = measure_loop(lambda: calls.append(1), "cpu", warmup=2, steps=6, batch_size=3)
    assert len(calls) == 8 and m.steps == 6 and m.samples == 18


def test_a_row_sums_the_grad_scalers_falls_of_its_repetitions():
    def m(falls):
        return Measurement(100, 1.0, (1.0,), extra={} if falls is None else {"grad_scale_falls": falls})

    rows = {r["name"]: r for r in summarize({"c": [m(None)] * 3, "fp16": [m(0.0), m(2.0), m(1.0)]}, "c")}
    assert rows["fp16"]["grad_scale_falls"] == 3.0
    assert rows["c"]["grad_scale_falls"] is None  # no GradScaler: not a zero
