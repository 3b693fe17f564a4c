"""How a ladder row is timed: a warm-up, then consecutive measuring windows, reported as median and range.

One window says how fast a row ran once; several say how much that figure moves on this machine. A row's
``samples_per_sec`` is the median of its windows, ``samples_per_sec_min``/``_max`` their range, and
``spread`` the range over the median. ``compare`` tells a difference between two rows from noise: it is a
difference only where their ranges do not overlap.

A compiled row first spends its compile in the warm-up: ``first_fast_step`` says from which step on the step
time has settled, and ``RowMeter(settle=True)`` measures only after it, recording the compile time.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

#: a row whose windows range over more than this fraction of their median is called noisy
NOISE_SPREAD = 0.25
#: consecutive steps that must agree for the step time to count as settled
FAST_RUN = 3
#: those steps agree when the slowest takes at most this many times the fastest; a step slower than this many
#: times the settled step time is still compiling (compiling takes hundreds of times a step)
FAST_SPREAD = 2.0
#: seconds a compiled row may spend before its step time settles; the row fails after that
SETTLE_LIMIT_S = 600.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Windows:
    """Samples/s of consecutive windows of one row.

    Example:
        >>> w = Windows((90.0, 100.0, 120.0))
        >>> w.median, w.low, w.high, round(w.spread, 2)
        (100.0, 90.0, 120.0, 0.3)
    """

    rates: tuple[float, ...]

    @property
    def median(self) -> float | None:
        return statistics.median(self.rates) if self.rates else None

    @property
    def low(self) -> float | None:
        return min(self.rates) if self.rates else None

    @property
    def high(self) -> float | None:
        return max(self.rates) if self.rates else None

    @property
    def spread(self) -> float | None:
        """``(max - min) / median``; ``None`` with fewer than two windows."""
        med = self.median
        if len(self.rates) < 2 or not med:
            return None
        return (max(self.rates) - min(self.rates)) / med

    @property
    def noisy(self) -> bool:
        return self.spread is not None and self.spread > NOISE_SPREAD

    def row_fields(self) -> dict[str, Any]:
        """The row keys these windows fill in."""
        return {
            "samples_per_sec": self.median,
            "samples_per_sec_min": self.low,
            "samples_per_sec_max": self.high,
            "spread": self.spread,
            "windows": list(self.rates),
        }


def first_fast_step(
    step_seconds: Sequence[float], run: int = FAST_RUN, spread: float = FAST_SPREAD
) -> int | None:
    """Index of the first fast step: the step from which on every step takes at most ``spread`` times the
    settled step time, once the last ``run`` steps agree within ``spread`` (their median is the settled time).

    ``None`` while the step time has not settled. The time of the steps before the first fast one is what a
    compile (and cuDNN autotuning, and a recompile) cost.

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


def compare(row: dict[str, Any], other: dict[str, Any]) -> float | None:
    """``row``'s median over ``other``'s, or ``None`` when either did not run or their window ranges overlap
    (the difference is within what the windows of one row already vary by)."""
    a, b = row.get("samples_per_sec"), other.get("samples_per_sec")
    if not a or not b:
        return None
    a_lo, a_hi = row.get("samples_per_sec_min") or a, row.get("samples_per_sec_max") or a
    b_lo, b_hi = other.get("samples_per_sec_min") or b, other.get("samples_per_sec_max") or b
    if a_lo <= b_hi and b_lo <= a_hi:
        return None
    return float(a / b)


class RowMeter(pl.Callback):
    """Times a fit: a warm-up, then ``windows`` consecutive windows; stops the fit after the last.

    Warm-up lasts ``warmup`` steps (at least one: it pays for cuDNN autotuning and worker start-up), cut short
    after ``warmup_seconds``. The measured part lasts ``seconds`` (or ``max_steps`` steps), split evenly into
    the windows. The device is synchronised at each window boundary only.

    With ``align_epochs`` (rows whose DataLoader workers prefetch) measuring starts at an epoch start and the
    last window ends at an epoch end: batches the workers buffered while the model was still starting up
    would otherwise be counted as if the pipeline had produced them inside the windows, overstating a
    data-bound row. At an epoch boundary the buffer is empty. When an epoch is too long for that (no epoch
    start within ``warmup_seconds``, no epoch end within ``warmup_seconds`` after the last window's time)
    the boundary falls mid-epoch and ``aligned`` says so.

    With ``settle`` (a compiled model) the warm-up first waits for the compile: each warm-up step is timed
    (a device sync at each step start), and the warm-up's steps and seconds count from the first fast step
    (``first_fast_step``). ``compile_seconds`` is the time from the first step's start to the first fast
    step's start.

    Example:
        >>> meter = RowMeter(warmup=5, warmup_seconds=10.0, seconds=6.0, max_steps=None, windows=3)
        >>> trainer = pl.Trainer(max_epochs=-1, callbacks=[meter])  # doctest: +SKIP
        >>> trainer.fit(model, loader); meter.result.median  # doctest: +SKIP
    """

    def __init__(
        self,
        warmup: int,
        warmup_seconds: float,
        seconds: float,
        max_steps: int | None,
        windows: int = 3,
        align_epochs: bool = False,
        settle: bool = False,
    ) -> None:
        if max_steps is not None:
            windows = max(1, min(windows, max_steps))
        self.warmup = warmup
        self.warmup_seconds = warmup_seconds
        self.windows = windows
        self.window_seconds = seconds / windows
        self.window_steps = None if max_steps is None else math.ceil(max_steps / windows)
        self.max_steps = max_steps
        self.align_epochs = align_epochs
        self.settle = settle
        self.compile_seconds: float | None = None
        self.aligned = False
        self.start_step: int | None = None
        self.measured_steps = 0
        self.seconds = 0.0
        self._rates: list[float] = []
        self._t0: float | None = None  # start of the open window
        self._samples = 0
        self._steps = 0
        self._fit_t0 = 0.0
        self._starts: list[float] = []  # synced warm-up step starts (settle only)
        self._fast: int | None = None  # index of the first fast warm-up step (settle only)

    @property
    def result(self) -> Windows:
        return Windows(tuple(self._rates))

    @property
    def samples_per_sec(self) -> float | None:
        return self.result.median

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, aligned: bool) -> None:
        _sync(pl_module.device)
        self._t0 = time.perf_counter()
        self.start_step = trainer.global_step
        self.aligned = aligned

    def _close(self, pl_module: pl.LightningModule) -> None:
        if self._t0 is None or self._steps == 0:
            return
        _sync(pl_module.device)
        now = time.perf_counter()
        elapsed = now - self._t0
        if elapsed > 0:
            self._rates.append(self._samples / elapsed)
            self.seconds += elapsed
        self.measured_steps += self._steps
        self._t0, self._samples, self._steps = now, 0, 0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_t0 = time.perf_counter()

    def _warm_steps(self, step: int) -> bool:
        """Whether the warm-up has run its steps (after the first fast step, with ``settle``)."""
        if not self.settle:
            return step >= max(self.warmup, 1)
        return self._fast is not None and len(self._starts) - 1 - self._fast >= max(self.warmup, 1)

    def _warm_since(self) -> float | None:
        """When the warm-up's time cap starts counting: the fit's start, or the first fast step's start."""
        if not self.settle:
            return self._fit_t0
        return None if self._fast is None else self._starts[self._fast]

    def _time_step(self, pl_module: pl.LightningModule) -> None:
        _sync(pl_module.device)
        self._starts.append(time.perf_counter())
        if self._fast is None and len(self._starts) > FAST_RUN:
            fast = first_fast_step([b - a for a, b in zip(self._starts, self._starts[1:], strict=False)])
            if fast is not None:
                self._fast = fast
                self.compile_seconds = self._starts[fast] - self._starts[0]

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # called before the epoch's iterator exists: nothing of this epoch is buffered yet
        if self.align_epochs and self.start_step is None and self._warm_steps(trainer.global_step):
            self._start(trainer, pl_module, aligned=True)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.start_step is not None:
            return
        if self.settle:
            self._time_step(pl_module)
        step = trainer.global_step
        since = self._warm_since()
        warm_time = step >= 1 and since is not None and time.perf_counter() - since >= self.warmup_seconds
        if (self._warm_steps(step) and not self.align_epochs) or warm_time:
            self._start(trainer, pl_module, aligned=False)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._t0 is None:
            return
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        self._samples += int(x.shape[0]) if hasattr(x, "shape") else 0
        self._steps += 1
        elapsed = time.perf_counter() - self._t0
        by_steps = self.window_steps is not None and self._steps >= self.window_steps
        by_time = self.window_seconds > 0 and elapsed >= self.window_seconds
        if not (by_steps or by_time):
            return
        if len(self._rates) < self.windows - 1:
            self._close(pl_module)
            return
        # the last window: with aligned epochs it runs on to the epoch's end, within a grace period
        epoch_end = batch_idx + 1 >= trainer.num_training_batches
        if by_steps:
            self.aligned = False
        elif self.aligned and not epoch_end and elapsed < self.window_seconds + self.warmup_seconds:
            return
        else:
            self.aligned = self.aligned and epoch_end
        self._close(pl_module)
        self._t0 = None
        trainer.should_stop = True

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the fit ended before the last window did (max_time, or a loader that ran out): keep what was measured
        if self._t0 is not None:
            self.aligned = False
            self._close(pl_module)
            self._t0 = None


def window_means(
    history: Sequence[dict[str, float]], start_step: int | None
) -> tuple[float | None, float | None]:
    """Mean ``gpu/util`` and ``time/data_wait_frac`` over monitor windows logged after the warm-up."""
    rows = [h for h in history if start_step is None or h.get("step", 0) > start_step] or list(history)

    def mean(key: str) -> float | None:
        vals = [float(h[key]) for h in rows if h.get(key) is not None and math.isfinite(float(h[key]))]
        return statistics.fmean(vals) if vals else None

    return mean("gpu/util"), mean("time/data_wait_frac")
