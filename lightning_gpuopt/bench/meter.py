"""How a ladder row is timed: a warm-up, then consecutive measuring windows, reported as median and range.

One window says how fast a row ran once; several say how much that figure moves on this machine. A row's
``samples_per_sec`` is the median of its windows, ``samples_per_sec_min``/``_max`` their range, and
``spread`` the range over the median. ``compare`` tells a difference between two rows from noise: it is a
difference only where their ranges do not overlap.
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
        self.aligned = False
        self.start_step: int | None = None
        self.measured_steps = 0
        self.seconds = 0.0
        self._rates: list[float] = []
        self._t0: float | None = None  # start of the open window
        self._samples = 0
        self._steps = 0
        self._fit_t0 = 0.0

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

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # called before the epoch's iterator exists: nothing of this epoch is buffered yet
        if self.align_epochs and self.start_step is None and trainer.global_step >= max(self.warmup, 1):
            self._start(trainer, pl_module, aligned=True)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.start_step is not None:
            return
        step = trainer.global_step
        warm_steps = step >= max(self.warmup, 1)
        warm_time = step >= 1 and time.perf_counter() - self._fit_t0 >= self.warmup_seconds
        if (warm_steps and not self.align_epochs) or warm_time:
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
