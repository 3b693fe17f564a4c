"""Steady-state measurement as a user reads a long fit: step times from the GPU's own clock, repetitions
taking turns, medians with their spread.

``StepClock`` is a callback for any fit: it records a CUDA event at every batch end (no synchronisation on
the way), skips a warm-up (a compile, cuDNN autotuning, and the batches the loader prefetched while the
model was starting), measures ``steps`` steps, and stops the fit. ``PlainLoop`` runs are measured the same
way by ``measure_loop``. ``summarize`` reduces each variant's repetitions, taken in turns, to a
row: the median repetition, the worst and best, the ratio to a ceiling taken turn by turn, and p50/p90 step
times.

Example:
    >>> clock = StepClock(warmup=30, steps=200)
    >>> trainer = pl.Trainer(max_epochs=-1, callbacks=[clock])  # doctest: +SKIP
    >>> trainer.fit(model, datamodule=dm); clock.measurement.samples_per_sec  # doctest: +SKIP
"""

from __future__ import annotations

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

#: the first and the second half of a measured window differ by more than this: the pipeline was not steady
UNSTEADY = 0.05


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
    """One measured window: ``steps`` steps of ``samples`` samples in ``seconds``, and each step's time.

    ``seconds`` is the GPU's time from the batch end before the window to its last batch end (CUDA events),
    so a GPU left waiting for the host counts as time; on a CPU it is the host clock.
    """

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
        return {
            "samples_per_sec": self.samples_per_sec,
            "p50_ms": self.p50_ms,
            "p90_ms": self.p90_ms,
            "steps": self.steps,
            "seconds": self.seconds,
            "halves": self.halves,
            "compile_seconds": self.compile_seconds,
            **self.extra,
        }


class _Marks:
    """Batch-end marks on the device's clock: CUDA events on the current stream, the host clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.marks: list[Any] = []
        self.host: list[float] = []  # the host clock at each mark: when the host got past the batch end

    def mark(self) -> None:
        self.host.append(time.perf_counter())
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def step_ms(self) -> list[float]:
        """Milliseconds between consecutive marks (one device sync, here, after the window)."""
        if len(self.marks) < 2:
            return []
        if self.cuda:
            synchronize(self.device)
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]


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

    The first ``warmup`` steps are not measured; with ``settle`` they start counting once the step time has
    settled (a compiled model's first steps compile it: each warm-up step is then timed with a host sync
    until three agree, the compile's time kept as ``compile_seconds``). Choose ``warmup`` past what the
    loader prefetches (workers x prefetch factor batches, or a pipeline's depth), so the measured steps are
    fed at the rate the loader sustains, not from its buffer. Then ``steps`` steps are measured with no
    synchronisation, and the fit is stopped.

    Args:
        warmup: steps before the window (after the compile, with ``settle``).
        steps: steps measured.
        settle: wait for the step time to settle before counting the warm-up (compiled models).
        cpu: read the host's CPU use over the window (``HostCPUReader``: this process and its loader
            workers), kept in ``measurement.extra`` as ``host/cpu_main_pct``, ``host/cpu_cores``, ...

    Under fp16 (a ``GradScaler``) ``measurement.extra`` also holds the scaler's scale at the window's start
    and end and its falls between (``grad_scale_start``, ``grad_scale_end``, ``grad_scale_falls``; read
    without a host sync inside the window): each step whose gradients overflow is skipped (no weight
    update) and halves the scale, so falls mean the window timed skipped updates, and an end far below 1 a
    loss that is NaN.

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
        from lightning_gpuopt.bench.meter import FAST_RUN, first_fast_step

        synchronize(pl_module.device)
        self._starts.append(time.perf_counter())
        if len(self._starts) > FAST_RUN:
            steps = [b - a for a, b in zip(self._starts, self._starts[1:], strict=False)]
            fast = first_fast_step(steps)
            if fast is not None:
                self._settled = True
                self.compile_seconds = self._starts[fast] - self._starts[0]
                self._warm_done = len(steps) - fast

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.measurement is not None:
            return
        if not self._settled:
            self._settle_step(pl_module)
            return
        if self._marks is None:
            if self._warm_done < self.warmup:
                self._warm_done += 1
                return
            self._marks = _Marks(pl_module.device)
            self._marks.mark()  # the window opens at this batch's end
            from lightning_gpuopt.observe.advisor.scale import ScaleWatch

            self._scale = ScaleWatch.of(trainer.precision_plugin, pl_module.device)
            if self._scale is not None:
                self._scale.sample(trainer.global_step)  # a queued copy, read after the window
            if self.cpu:
                from lightning_gpuopt.observe.host_cpu import HostCPUReader

                self._cpu = HostCPUReader()
                self._cpu.read()
            return
        self._samples += _batch_size(batch)
        self._marks.mark()
        if len(self._marks.marks) > self.steps:
            self._finish(trainer)
            trainer.should_stop = True

    def _finish(self, trainer: pl.Trainer) -> None:
        step_ms = self._marks.step_ms() if self._marks is not None else []
        extra = dict(self._cpu.window()) if self._cpu is not None else {}
        if self._marks is not None and len(self._marks.host) > 1:
            h = self._marks.host
            host_ms = [(b - a) * 1e3 for a, b in zip(h, h[1:], strict=False)]
            extra.update(host_p50_ms=percentile(host_ms, 0.5), host_p90_ms=percentile(host_ms, 0.9))
        if self._scale is not None:
            self._scale.sample(trainer.global_step)
            synchronize(trainer.strategy.root_device)  # the window has closed: the reads may complete
            e = self._scale.evidence()
            extra.update(grad_scale_start=e.grad_scale_start, grad_scale_end=e.grad_scale,
                         grad_scale_falls=e.grad_scale_falls)  # fmt: skip
        self.measurement = Measurement(
            self._samples, sum(step_ms) / 1e3, tuple(step_ms), compile_seconds=self.compile_seconds, extra=extra
        )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the fit ended before the window did (a loader that ran out, max_steps): keep what was measured
        if self.measurement is None and self._marks is not None and len(self._marks.marks) > 2:
            self._finish(trainer)


def measure_loop(step: Callable[[], None], device: torch.device | str, warmup: int, steps: int,
                 batch_size: int) -> Measurement:
    """``warmup`` calls of ``step``, then ``steps`` calls each closed by a mark on the device's clock.

    Example:
        >>> m = measure_loop(lambda: None, "cpu", warmup=1, steps=5, batch_size=8)
        >>> m.steps, m.samples
        (5, 40)
    """
    device = torch.device(device)
    for _ in range(warmup):
        step()
    marks = _Marks(device)
    marks.mark()
    for _ in range(steps):
        step()
        marks.mark()
    step_ms = marks.step_ms()
    return Measurement(batch_size * steps, sum(step_ms) / 1e3, tuple(step_ms))


def _summed(values: Any) -> float | None:
    """The sum of the values that are not ``None``; ``None`` where all are."""
    known = [v for v in values if v is not None]
    return float(sum(known)) if known else None


def summarize(
    results: Mapping[str, Sequence[Measurement | BaseException]], ceiling: str | None
) -> list[dict[str, Any]]:
    """A row a variant: the median repetition's samples/s, the worst and best, each repetition's ratio to the
    ceiling of the same turn (``repeats``), the median and worst of those ratios, and p50/p90 step times over
    all measured steps.

    Example:
        >>> res = {"ceiling": [Measurement(100, 1.0, (10.0,))] * 3,
        ...        "fed": [Measurement(90, 1.0, (11.0,)), Measurement(80, 1.0, (12.0,)), Measurement(95, 1.0, (11.0,))]}
        >>> row = summarize(res, "ceiling")[1]
        >>> row["samples_per_sec"], row["of_ceiling"], row["of_ceiling_worst"], row["grad_scale_falls"]
        (90.0, 0.9, 0.8, None)
    """
    base = [r for r in results.get(ceiling, ())] if ceiling else []
    rows = []
    for name, reps in results.items():
        errors = [r for r in reps if isinstance(r, BaseException)]
        ms = [r for r in reps if isinstance(r, Measurement)]
        row: dict[str, Any] = {"name": name, "error": f"{type(errors[0]).__name__}: {errors[0]}" if errors else None}
        rates = [m.samples_per_sec or 0.0 for m in ms]
        ratios = []
        for turn, m in enumerate(reps):
            c = base[turn] if turn < len(base) else None
            if isinstance(m, Measurement) and isinstance(c, Measurement) and c.samples_per_sec:
                ratios.append((m.samples_per_sec or 0.0) / c.samples_per_sec)
        steps = [s for m in ms for s in m.step_ms]
        med = statistics.median(rates) if rates else None
        row.update(
            samples_per_sec=med,
            samples_per_sec_min=min(rates) if rates else None,
            samples_per_sec_max=max(rates) if rates else None,
            spread=(max(rates) - min(rates)) / med if med and len(rates) > 1 else None,
            of_ceiling=statistics.median(ratios) if ratios else None,
            of_ceiling_worst=min(ratios) if ratios else None,
            p50_ms=percentile(steps, 0.5),
            p90_ms=percentile(steps, 0.9),
            compile_seconds=next((m.compile_seconds for m in ms if m.compile_seconds is not None), None),
            # the GradScaler's falls inside the windows, summed over the repetitions (None: no scaler)
            grad_scale_falls=_summed(m.extra.get("grad_scale_falls") for m in ms),
            repeats=[
                {**m.to_dict(), "of_ceiling": ratios[i] if i < len(ratios) else None}
                for i, m in enumerate(ms)
            ],
        )
        rows.append(row)
    return rows
