"""How long the training stream sat idle between steps, from CUDA events read without synchronising."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BLOCKED_KEY", "IDLE_KEY", "StreamIdleMeter"]

#: Key of the GPU's idle share between steps (``StreamIdleMeter.window()``).
IDLE_KEY = "gpu/idle_frac"
#: Key of the host's wait between batches while the GPU still ran earlier work (``StreamIdleMeter.window()``).
BLOCKED_KEY = "time/gpu_blocked_frac"


@dataclass
class _Step:
    anchor: Any  # event where the stream's previous training work ended, or None (first step of a chain)
    start: Any
    end: Any
    host_gap_s: float  # host time from the previous batch end (or mark) to this batch start
    host_step_s: float  # host time from the previous batch end (or mark) to this batch end
    end_is_anchor: bool = True  # the next step measures its gap from this end


class StreamIdleMeter:
    """CUDA-event timeline of the training steps; ``window()`` turns the completed part into two fractions.

    ``window()`` reads only the steps whose events completed (``wait=True`` waits for the last) and returns
    ``gpu/idle_frac`` and ``time/gpu_blocked_frac`` (docs/gpu_stats.md). Each call records at most one event.

    Args:
        device: CUDA device whose current stream is recorded on (default: the current device).
        event_factory: makes an event (default ``torch.cuda.Event(enable_timing=True)``).

    Example:
        >>> meter = StreamIdleMeter(torch.device("cuda", 0))  # doctest: +SKIP
        >>> meter.mark(time.perf_counter())  # doctest: +SKIP
        >>> for x in batches:  # doctest: +SKIP
        ...     meter.step_start(time.perf_counter()); train_step(x); meter.step_end(time.perf_counter())
        >>> meter.window()["gpu/idle_frac"]  # doctest: +SKIP
    """

    def __init__(
        self, device: torch.device | None = None, event_factory: Callable[[], Any] | None = None
    ) -> None:
        self.device = device
        self._new_event = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        self._pool: list[Any] = []
        self._pending: deque[_Step] = deque()
        self._anchor: Any = None
        self._anchor_step: _Step | None = None  # the pending step whose end is the current anchor
        self._host_anchor: float | None = None
        self._start: Any = None
        self._host_start = 0.0

    def _record(self) -> Any:
        event = self._pool.pop() if self._pool else self._new_event()
        if self.device is None:
            event.record()
        else:
            event.record(torch.cuda.current_stream(self.device))
        return event

    def _release(self, event: Any) -> None:
        if event is not None:
            self._pool.append(event)

    def _drop_anchor(self) -> None:
        if self._anchor_step is not None:
            self._anchor_step.end_is_anchor = False  # released when that step is read
        elif self._anchor is not None:
            self._release(self._anchor)  # a mark no step used
        self._anchor = self._anchor_step = None

    def mark(self, t: float) -> None:
        """The loop resumes training at host time ``t``: the next step's gap counts from here."""
        self._drop_anchor()
        self._anchor = self._record()
        self._host_anchor = t

    def step_start(self, t: float) -> None:
        """A training batch starts at host time ``t`` (its batch is already on the device)."""
        if self._start is not None:  # a batch that never ended (skipped): forget it
            self._release(self._start)
        self._start = self._record()
        self._host_start = t

    def step_end(self, t: float) -> None:
        """The training batch that started last has queued all its work by host time ``t``."""
        if self._start is None:
            return
        host_anchor = self._host_anchor if self._host_anchor is not None else self._host_start
        step = _Step(
            anchor=self._anchor,
            start=self._start,
            end=self._record(),
            host_gap_s=max(self._host_start - host_anchor, 0.0),
            host_step_s=max(t - host_anchor, 0.0),
        )
        self._pending.append(step)
        self._start = None
        self._anchor, self._anchor_step, self._host_anchor = step.end, step, t

    def window(self, wait: bool = False) -> dict[str, float]:
        """Fractions over the steps completed since the previous call; ``wait`` first waits for the last."""
        if wait and self._pending:
            self._pending[-1].end.synchronize()
        gpu_idle = gpu_span = host_hidden = host_total = 0.0
        while self._pending and self._pending[0].end.query():
            step = self._pending.popleft()
            if step.anchor is not None:
                gap_ms = max(step.anchor.elapsed_time(step.start), 0.0)
                gpu_idle += gap_ms
                gpu_span += max(step.anchor.elapsed_time(step.end), 0.0)
                host_hidden += min(max(step.host_gap_s - gap_ms / 1000.0, 0.0), step.host_gap_s)
                host_total += step.host_step_s
                self._release(step.anchor)
            self._release(step.start)
            if not step.end_is_anchor:
                self._release(step.end)
            if self._anchor_step is step:
                self._anchor_step = None  # its end stays the anchor, now owned by the meter
        out: dict[str, float] = {}
        if gpu_span > 0:
            out[IDLE_KEY] = gpu_idle / gpu_span
        if host_total > 0:
            out[BLOCKED_KEY] = host_hidden / host_total
        return out

    @property
    def pending(self) -> int:
        """Steps recorded but not read yet."""
        return len(self._pending)

    @property
    def pool_size(self) -> int:
        """Events waiting in the pool for reuse."""
        return len(self._pool)
