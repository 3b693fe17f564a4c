"""How a ladder row's fits are read: when a compile is over, whether two rows differ beyond their noise,
and the monitor's means over a measured window.
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
    """Index of the first step from which every step takes at most ``spread`` times the settled step time
    (the median of the last ``run`` steps, once they agree within ``spread``); ``None`` while unsettled.
    The steps before it are what a compile cost.

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
    difference is within the noise).

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
