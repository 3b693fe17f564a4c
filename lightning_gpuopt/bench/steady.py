"""Steady-state measurement on the device's own clock: ``StepClock`` times a fit past its warm-up (and
compile), ``measure_loop`` a plain loop; ``summarize`` reduces each variant's repetitions to a row.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_gpuopt._checks import check_int
from lightning_gpuopt._common import synchronize

#: the step time has settled when this many consecutive steps agree within ``FAST_SPREAD`` (slowest over
#: fastest); a step slower than that times the settled step time is still compiling
FAST_RUN, FAST_SPREAD = 3, 2.0
#: seconds a compiled row may spend before its step time settles; the row fails after that
SETTLE_LIMIT_S = 600.0


def first_fast_step(
    step_seconds: Sequence[float], run: int = FAST_RUN, spread: float = FAST_SPREAD
) -> int | None:
    """Index of the first step from which every step takes at most ``spread`` times the settled step time
    (the median of the last ``run`` steps, once they agree within ``spread``); ``None`` while unsettled.

    Example:
        >>> first_fast_step([41.0, 0.10, 0.11, 0.10])
        1
        >>> first_fast_step([41.0, 0.10, 3.0]) is None
        True
    """
    if run < 1 or len(step_seconds) < run:
        return None
    tail = step_seconds[-run:]
    if max(tail) > spread * min(tail):
        return None
    limit = spread * statistics.median(tail)
    first = len(step_seconds) - run
    while first > 0 and step_seconds[first - 1] <= limit:
        first -= 1
    return first


def window_means(
    history: Sequence[dict[str, float]],
    start_step: int | None,
    keys: Sequence[str] = ("gpu/util", "time/data_wait_frac"),
) -> tuple[float | None, ...]:
    """Mean of each of ``keys`` over the monitor windows logged after ``start_step`` (else all of them)."""
    rows = [h for h in history if start_step is None or h.get("step", 0) > start_step] or list(history)

    def mean(key: str) -> float | None:
        vals = [float(h[key]) for h in rows if h.get(key) is not None and math.isfinite(float(h[key]))]
        return statistics.fmean(vals) if vals else None

    return tuple(mean(key) for key in keys)


def joules_per_sample(
    history: Sequence[dict[str, float]], start_step: int | None, samples_per_sec: float | None
) -> float | None:
    """The monitor's mean ``gpu/power_w`` after ``start_step`` over ``samples_per_sec``; ``None`` without.

    Example:
        >>> joules_per_sample([{"step": 9, "gpu/power_w": 300.0}, {"step": 19, "gpu/power_w": 500.0}], 9, 1000.0)
        0.5
    """
    (power,) = window_means(history, start_step, ("gpu/power_w",))
    return power / samples_per_sec if power is not None and samples_per_sec else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) of ``values``, linearly interpolated; ``None`` for no values.

    Example:
        >>> percentile([1.0, 2.0, 3.0, 4.0], 0.5), percentile([1.0, 2.0, 3.0, 4.0], 0.9)
        (2.5, 3.7)
    """
    if not values:
        return None
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return round(s[lo] + (s[hi] - s[lo]) * (pos - lo), 6)


@dataclass(frozen=True)
class Measurement:
    """One measured window: ``steps`` steps of ``samples`` samples in ``seconds`` (the device's clock), and
    each step's time."""

    samples: int
    seconds: float
    step_ms: tuple[float, ...]
    compile_seconds: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return len(self.step_ms)

    @property
    def samples_per_sec(self) -> float | None:
        return self.samples / self.seconds if self.seconds > 0 and self.samples else None

    @property
    def p50_ms(self) -> float | None:
        return percentile(self.step_ms, 0.5)

    @property
    def p90_ms(self) -> float | None:
        return percentile(self.step_ms, 0.9)

    @property
    def halves(self) -> float | None:
        """Mean step time of the window's second half over its first (1.0: steady)."""
        n = len(self.step_ms) // 2
        if n == 0:
            return None
        first, second = statistics.fmean(self.step_ms[:n]), statistics.fmean(self.step_ms[n:])
        return second / first if first > 0 else None

    def to_dict(self) -> dict[str, Any]:
        keys = ("samples_per_sec", "p50_ms", "p90_ms", "steps", "seconds", "halves", "compile_seconds")
        return {**{k: getattr(self, k) for k in keys}, **self.extra}


class _Marks:
    """Batch-end marks on the device's clock: CUDA events on the current stream, the host clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def step_ms(self) -> list[float]:
        """Milliseconds between consecutive marks (one device sync, here, after the window)."""
        if self.cuda and self.marks:
            synchronize(self.device)
            return [a.elapsed_time(b) for a, b in itertools.pairwise(self.marks)]
        return [(b - a) * 1e3 for a, b in itertools.pairwise(self.marks)]


def _batch_size(batch: Any) -> int:
    x = batch
    while isinstance(x, (list, tuple)) and x:
        x = x[0]
    if isinstance(x, dict) and x:
        x = next(iter(x.values()))
    shape = getattr(x, "shape", None)
    return int(shape[0]) if shape else 0


class StepClock(pl.Callback):
    """Measures a fit's steady state from a CUDA event recorded at every batch end, then stops the fit.

    Choose ``warmup`` past what the loader prefetches, so the window is fed at the rate the loader sustains.
    Under a ``GradScaler``, ``measurement.extra`` holds ``grad_scale_start``, ``grad_scale_end`` and
    ``grad_scale_falls`` (each fall is a skipped update).

    Args:
        warmup: steps before the window (after the compile, with ``settle``).
        steps: steps measured.
        settle: wait for the step time to settle (a compiled model) before counting the warm-up; the time
            until then is ``compile_seconds``.
        cpu: keep the host's CPU use over the window (``HostCPUReader``) in ``measurement.extra``.

    Example:
        >>> clock = StepClock(warmup=30, steps=200, settle=True)
        >>> trainer = pl.Trainer(max_epochs=-1, callbacks=[clock])  # doctest: +SKIP
        >>> trainer.fit(model, datamodule=dm)  # doctest: +SKIP
        >>> m = clock.measurement; m.samples_per_sec, m.p50_ms, m.p90_ms  # doctest: +SKIP
    """

    def __init__(self, warmup: int = 30, steps: int = 200, settle: bool = False, cpu: bool = False) -> None:
        check_int(warmup, "warmup", low=0)
        check_int(steps, "steps", low=2)
        self.warmup, self.steps, self.settle, self.cpu = warmup, steps, settle, cpu
        self._reset()

    def _reset(self) -> None:
        self._marks: _Marks | None = None
        self._samples = 0
        self._warm_done = 0
        self._settled = not self.settle
        self._starts: list[float] = []
        self._cpu: Any = None
        self._scale: Any = None
        self.compile_seconds: float | None = None
        self.measurement: Measurement | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()

    def _settle_step(self, pl_module: pl.LightningModule) -> None:
        synchronize(pl_module.device)
        self._starts.append(time.perf_counter())
        if len(self._starts) > FAST_RUN:
            fast = first_fast_step([b - a for a, b in itertools.pairwise(self._starts)])
            if fast is not None:
                self._settled = True
                self.compile_seconds = self._starts[fast] - self._starts[0]
                self._warm_done = len(self._starts) - 1 - fast

    def _open(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_gpuopt.observe.advisor.scale import ScaleWatch

        self._marks = _Marks(pl_module.device)
        self._marks.mark()
        self._scale = ScaleWatch.of(trainer.precision_plugin, pl_module.device)
        if self._scale is not None:
            self._scale.sample(trainer.global_step)  # a queued copy, read after the window
        if self.cpu:
            from lightning_gpuopt.observe.host_cpu import HostCPUReader

            self._cpu = HostCPUReader()
            self._cpu.read()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.measurement is not None:
            return
        if not self._settled:
            self._settle_step(pl_module)
        elif self._marks is None and self._warm_done < self.warmup:
            self._warm_done += 1
        elif self._marks is None:
            self._open(trainer, pl_module)
        else:
            self._samples += _batch_size(batch)
            self._marks.mark()
            if len(self._marks.marks) > self.steps:
                self._finish(trainer)
                trainer.should_stop = True

    def _finish(self, trainer: pl.Trainer) -> None:
        step_ms = self._marks.step_ms() if self._marks is not None else []
        extra = dict(self._cpu.window()) if self._cpu is not None else {}
        if self._scale is not None:
            self._scale.sample(trainer.global_step)
            synchronize(trainer.strategy.root_device)  # the window has closed: the reads may complete
            e = self._scale.evidence()
            extra.update(
                grad_scale_start=e.grad_scale_start,
                grad_scale_end=e.grad_scale,
                grad_scale_falls=e.grad_scale_falls,
            )
        seconds = sum(step_ms) / 1e3
        self.measurement = Measurement(self._samples, seconds, tuple(step_ms), self.compile_seconds, extra)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the fit ended before the window did (a loader that ran out, max_steps): keep what was measured
        if self.measurement is None and self._marks is not None and len(self._marks.marks) > 2:
            self._finish(trainer)


def measure_loop(
    step: Callable[[], None], device: torch.device | str, warmup: int, steps: int, batch_size: int
) -> Measurement:
    """``warmup`` calls of ``step``, then ``steps`` calls each closed by a mark on the device's clock.

    Example:
        >>> m = measure_loop(lambda: None, "cpu", warmup=1, steps=5, batch_size=8)
        >>> m.steps, m.samples
        (5, 40)
    """
    for _ in range(warmup):
        step()
    marks = _Marks(torch.device(device))
    marks.mark()
    for _ in range(steps):
        step()
        marks.mark()
    step_ms = marks.step_ms()
    return Measurement(batch_size * steps, sum(step_ms) / 1e3, tuple(step_ms))


def summarize(
    results: Mapping[str, Sequence[Measurement | BaseException]], ceiling: str | None
) -> list[dict[str, Any]]:
    """A row a variant: the median repetition's samples/s, the worst and best, each repetition's ratio to the
    ceiling of the same turn, the median and worst of those ratios, and p50/p90 over all measured steps.

    Example:
        >>> m = lambda sps, ms: Measurement(sps, 1.0, (ms,))
        >>> res = {"ceiling": [m(100, 10.0)] * 3, "fed": [m(90, 11.0), m(80, 12.0), m(95, 11.0)]}
        >>> row = summarize(res, "ceiling")[1]
        >>> row["samples_per_sec"], row["of_ceiling"], row["of_ceiling_worst"], row["grad_scale_falls"]
        (90.0, 0.9, 0.8, None)
    """
    base = list(results.get(ceiling, ())) if ceiling else []
    rows = []
    for name, reps in results.items():
        errors = [r for r in reps if isinstance(r, BaseException)]
        ms = [r for r in reps if isinstance(r, Measurement)]
        rates = [m.samples_per_sec or 0.0 for m in ms]
        ratios = []
        for m, c in zip(reps, base, strict=False):
            if isinstance(m, Measurement) and isinstance(c, Measurement) and c.samples_per_sec:
                ratios.append((m.samples_per_sec or 0.0) / c.samples_per_sec)
        steps = [s for m in ms for s in m.step_ms]
        med = statistics.median(rates) if rates else None
        # the GradScaler's falls inside the windows, summed over the repetitions (None: no scaler)
        falls = [m.extra["grad_scale_falls"] for m in ms if m.extra.get("grad_scale_falls") is not None]
        rows.append(
            {
                "name": name,
                "error": f"{type(errors[0]).__name__}: {errors[0]}" if errors else None,
                "samples_per_sec": med,
                "samples_per_sec_min": min(rates, default=None),
                "samples_per_sec_max": max(rates, default=None),
                "spread": (max(rates) - min(rates)) / med if med and len(rates) > 1 else None,
                "of_ceiling": statistics.median(ratios) if ratios else None,
                "of_ceiling_worst": min(ratios, default=None),
                "p50_ms": percentile(steps, 0.5),
                "p90_ms": percentile(steps, 0.9),
                "compile_seconds": next(
                    (m.compile_seconds for m in ms if m.compile_seconds is not None), None
                ),
                "grad_scale_falls": float(sum(falls)) if falls else None,
                "repeats": [
                    {**m.to_dict(), "of_ceiling": ratios[i] if i < len(ratios) else None}
                    for i, m in enumerate(ms)
                ],
            }
        )
    return rows
