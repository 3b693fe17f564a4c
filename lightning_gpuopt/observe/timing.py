"""Host-side step timing from ``time.perf_counter`` only (never touches the GPU), and how long a loader's
consumer spent inside ``next()``, where the loader says."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from lightning_gpuopt._checks import is_number
from lightning_gpuopt._common import FETCH_SECONDS_ATTR

__all__ = ["CPU_WAIT_NOTE", "HOST_KEYS", "LOADER_KEY", "StepTimer", "batch_size_of", "loader_fetch_seconds"]

HOST_KEYS: tuple[str, ...] = (
    "time/step_ms",
    "time/data_wait_ms",
    "time/data_wait_frac",
    "throughput/samples_per_sec",
)

#: Key ``StepTimer.window()`` adds when loader wait was reported (``add_loader_wait``).
LOADER_KEY = "time/loader_wait_frac"

#: What the host wait means where the CPU trains (``GPUStatsMonitor`` says it once on a CPU run).
CPU_WAIT_NOTE = (
    "time/data_wait_frac on a CPU run counts all the host's work between two steps: the loader's next() "
    "(time/loader_wait_frac), then moving the batch and its on_after_batch_transfer work, such as "
    "OptimizedDataModule's augmentation, which a CUDA run does on the GPU and this run does on the CPU that "
    "trains. The difference between the two keys is that work, not a wait for data."
)


def loader_fetch_seconds(loaders: Any) -> float | None:
    """Cumulative seconds spent inside the ``next()`` of ``loaders`` (a loader, or a list/dict of them), from
    their ``fetch_seconds`` attribute; ``None`` when any loader does not keep it."""
    items = list(loaders.values()) if isinstance(loaders, Mapping) else loaders
    if not isinstance(items, (list, tuple)):
        items = [items]
    if not items:
        return None
    total = 0.0
    for loader in items:
        value = getattr(loader, FETCH_SECONDS_ATTR, None)
        if not (is_number(value) and math.isfinite(value)):
            return None
        total += float(value)
    return total


def batch_size_of(batch: Any) -> int:
    """Leading dimension of the first tensor (or array) found in ``batch`` (tensor, sequence or mapping); 0 if none."""
    stack = [batch]
    while stack:
        item = stack.pop(0)
        shape = getattr(item, "shape", None)
        if shape is not None and not isinstance(item, type):
            return int(shape[0]) if len(shape) else 1
        if isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return 0


class StepTimer:
    """Accumulates per-step host timings into windows.

    A step's *data wait* runs from the end of the previous training batch (or from ``mark()``) to the start
    of this one; its *compute* from batch start to batch end. ``window()`` returns ``HOST_KEYS`` over the
    steps since the previous call (empty when none), and ``time/loader_wait_frac`` where ``add_loader_wait``
    was called in the window.

    Example:
        >>> timer = StepTimer()
        >>> timer.mark(0.0); timer.batch_start(0.1); timer.batch_end(0.4, n_samples=8)
        >>> round(timer.window()["time/data_wait_frac"], 2)
        0.25
    """

    def __init__(self) -> None:
        self._prev_end: float | None = None
        self._start: float | None = None
        self._pending_wait = 0.0
        self.reset_window()

    def reset_window(self) -> None:
        """Forget the current window's totals (timestamps in flight are kept)."""
        self.steps = 0
        self.samples = 0
        self.wait_s = 0.0
        self.compute_s = 0.0
        self.loader_s: float | None = None

    def add_loader_wait(self, seconds: float) -> None:
        """Add ``seconds`` spent inside the loader's ``next()`` to this window."""
        self.loader_s = (self.loader_s or 0.0) + max(seconds, 0.0)

    def mark(self, t: float) -> None:
        """Count the next batch's data wait from ``t`` (use it where the loop resumes after non-training work)."""
        self._prev_end = t

    def batch_start(self, t: float) -> None:
        """The training batch starts at ``t`` (seconds, ``time.perf_counter``)."""
        self._pending_wait = max(t - self._prev_end, 0.0) if self._prev_end is not None else 0.0
        self._start = t

    def batch_end(self, t: float, n_samples: int = 0) -> None:
        """The training batch that started last ends at ``t``, having processed ``n_samples`` samples."""
        if self._start is None:
            return  # an end without a start (e.g. a timer attached mid-batch): nothing to attribute
        self.compute_s += max(t - self._start, 0.0)
        self.wait_s += self._pending_wait
        self.samples += n_samples
        self.steps += 1
        self._start = None
        self._pending_wait = 0.0
        self._prev_end = t

    def window(self) -> dict[str, float]:
        """Metrics over the steps since the previous call, then start a new window."""
        if self.steps == 0:
            return {}
        total = self.wait_s + self.compute_s
        out = {
            "time/step_ms": 1000.0 * total / self.steps,
            "time/data_wait_ms": 1000.0 * self.wait_s / self.steps,
            "time/data_wait_frac": self.wait_s / total if total > 0 else 0.0,
            "throughput/samples_per_sec": self.samples / total if total > 0 else 0.0,
        }
        if self.loader_s is not None and total > 0:
            out[LOADER_KEY] = self.loader_s / total
        self.reset_window()
        return out
