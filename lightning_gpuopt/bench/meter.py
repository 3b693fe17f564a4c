"""How a ladder row's repetitions are read: when a compiled model's step time has settled, whether two rows
differ by more than their repetitions vary, and the monitor's means over a measured window.

A row's ``samples_per_sec`` is the median of its repetitions (each one fit measured by
``bench.steady.StepClock``), ``samples_per_sec_min``/``_max`` their range and ``spread`` the range over the
median. ``compare`` tells a difference between two rows from noise: it is a difference only where their
ranges do not overlap. ``first_fast_step`` says from which step on a compiled model's step time has settled:
what comes before it is the compile. ``joules_per_sample`` turns the monitor's power into the energy a sample
costs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

#: a row whose repetitions range over more than this fraction of their median is called noisy
NOISE_SPREAD = 0.25
#: consecutive steps that must agree for the step time to count as settled
FAST_RUN = 3
#: those steps agree when the slowest takes at most this many times the fastest; a step slower than this many
#: times the settled step time is still compiling (compiling takes hundreds of times a step)
FAST_SPREAD = 2.0
#: seconds a compiled row may spend before its step time settles; the row fails after that
SETTLE_LIMIT_S = 600.0


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
    """``row``'s median over ``other``'s, or ``None`` when either did not run or their ranges overlap (the
    difference is within what the repetitions of one row already vary by).

    Example:
        >>> compare({"samples_per_sec": 31, "samples_per_sec_min": 30, "samples_per_sec_max": 33},
        ...         {"samples_per_sec": 11, "samples_per_sec_min": 10, "samples_per_sec_max": 12})
        2.8181818181818183
    """
    a, b = row.get("samples_per_sec"), other.get("samples_per_sec")
    if not a or not b:
        return None
    a_lo, a_hi = row.get("samples_per_sec_min") or a, row.get("samples_per_sec_max") or a
    b_lo, b_hi = other.get("samples_per_sec_min") or b, other.get("samples_per_sec_max") or b
    if a_lo <= b_hi and b_lo <= a_hi:
        return None
    return float(a / b)


def window_means(
    history: Sequence[dict[str, float]],
    start_step: int | None,
    keys: Sequence[str] = ("gpu/util", "time/data_wait_frac"),
) -> tuple[float | None, ...]:
    """Mean of each of ``keys`` (``gpu/util`` and ``time/data_wait_frac``) over monitor windows logged after
    ``start_step`` (the warm-up's last step), or over all of them when none was."""
    rows = [h for h in history if start_step is None or h.get("step", 0) > start_step] or list(history)

    def mean(key: str) -> float | None:
        vals = [float(h[key]) for h in rows if h.get(key) is not None and math.isfinite(float(h[key]))]
        return statistics.fmean(vals) if vals else None

    return tuple(mean(key) for key in keys)


def joules_per_sample(
    history: Sequence[dict[str, float]], start_step: int | None, samples_per_sec: float | None
) -> float | None:
    """The energy a trained sample cost in a measured window: the monitor's mean ``gpu/power_w`` over its
    windows after ``start_step``, over the window's ``samples_per_sec``; ``None`` without either.

    Example:
        >>> joules_per_sample([{"step": 9, "gpu/power_w": 300.0}, {"step": 19, "gpu/power_w": 500.0}], 9, 1000.0)
        0.5
    """
    (power,) = window_means(history, start_step, ("gpu/power_w",))
    return power / samples_per_sec if power is not None and samples_per_sec else None
