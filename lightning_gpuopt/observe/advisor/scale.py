"""The GradScaler's scale at the advisor's window ends, read without a sync (``ScaleWatch``): the figures of
the ``fp16-overflow`` rule (docs/advisor.md)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from lightning_gpuopt._common import warn_once
from lightning_gpuopt._compat import async_scale_reader
from lightning_gpuopt.observe.advisor.evidence import Evidence

__all__ = ["ScaleWatch", "falls_between"]


def falls_between(before: float, after: float, backoff: float = 0.5) -> int:
    """Backoffs that took the scale from ``before`` to ``after``: a lower bound (a growth hides one).

    Example:
        >>> falls_between(65536.0, 8192.0)
        3
        >>> falls_between(1024.0, 2048.0)
        0
    """
    if not (after < before) or before <= 0:
        return 0
    if after <= 0 or not 0 < backoff < 1:
        return 1
    return max(1, math.floor(math.log(before / after) / math.log(1.0 / backoff) + 1e-6))


class ScaleWatch:
    """Reads a GradScaler's scale where the advisor's windows end and counts its falls across the fit.

    Example:
        >>> scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        >>> _ = scaler.scale(torch.ones(()))  # the first step creates the scale tensor
        >>> watch = ScaleWatch(scaler, torch.device("cpu"))
        >>> watch.sample(0)
        >>> scaler.update(256.0)  # the scale as the scaler sets it after two skipped steps
        >>> watch.sample(20)
        >>> e = watch.evidence()
        >>> (e.grad_scale_start, e.grad_scale, e.grad_scale_falls, e.grad_scale_steps)
        (1024.0, 256.0, 2.0, 20.0)

    Args:
        scaler: an enabled ``torch.amp.GradScaler`` (the precision plugin's ``scaler``).
        device: the training device: on CUDA the scale is read once its copy has completed.
        event_factory: makes the events that mark a queued copy (``torch.cuda.Event`` by default).
    """

    def __init__(
        self, scaler: Any, device: torch.device, event_factory: Callable[[], Any] | None = None
    ) -> None:
        self.scaler = scaler
        self.device = device
        self._event_factory = event_factory
        # reads queued behind the GPU; past 8 the oldest are dropped, never waited for
        self._pending: deque[tuple[int, torch.Tensor, Any]] = deque(maxlen=8)
        self._first: tuple[int, float] | None = None  # (global step, scale) of the first read
        self._last: tuple[int, float] | None = None
        self.falls = 0  # backoffs seen across the fit
        self._window_falls = 0  # backoffs read since the last ``evidence()``
        self._blind = False

    @classmethod
    def of(cls, precision_plugin: Any, device: torch.device) -> ScaleWatch | None:
        """A watch on the plugin's enabled GradScaler; ``None`` without one (bf16, fp32, a disabled one)."""
        scaler = getattr(precision_plugin, "scaler", None)
        is_enabled = getattr(scaler, "is_enabled", None)
        if not callable(is_enabled) or not callable(getattr(scaler, "get_scale", None)):
            return None
        try:
            enabled = bool(is_enabled())
        except Exception:  # an unusual scaler: the rule stays silent
            return None
        return cls(scaler, device) if enabled else None

    def _read(self, step: int, value: float) -> None:
        if self._last is not None:
            backoff = getattr(self.scaler, "get_backoff_factor", lambda: 0.5)()
            backoff = float(backoff) if isinstance(backoff, (int, float)) else 0.5
            n = falls_between(self._last[1], value, backoff)
            self.falls += n
            self._window_falls += n
        self._last = (step, value)
        if self._first is None:
            self._first = self._last

    def sample(self, step: int) -> None:
        """Queue a read of the scale as it is now, at optimizer step ``step`` (after that step's update)."""
        if self._blind:
            return
        get_async = async_scale_reader(self.scaler)
        if get_async is None and self.device.type == "cuda":
            self._blind = True  # get_scale() would make the host wait for the GPU: step aside
            warn_once(
                "BottleneckAdvisor: this torch's GradScaler has no `_get_scale_async`; reading its scale "
                "would synchronize the GPU every window, so fp16-overflow is not judged."
            )
            return
        scale = get_async() if get_async is not None else None
        if not isinstance(scale, torch.Tensor):  # no step scaled yet, or a CPU scaler: nothing to wait for
            self._read(step, float(self.scaler.get_scale()))
            return
        if not scale.is_cuda and self._event_factory is None:
            self._read(step, float(scale.reshape(-1)[0]))
            return
        host = torch.empty(scale.shape, dtype=scale.dtype, pin_memory=scale.is_cuda)
        host.copy_(scale, non_blocking=scale.is_cuda)  # queued behind the step's scaler.update()
        event = (self._event_factory or torch.cuda.Event)()
        event.record()
        self._pending.append((step, host, event))

    def evidence(self) -> Evidence:
        """The reads completed so far: the scale at the first and the latest read, the falls across the fit
        and since the last call, and the optimizer steps between those reads."""
        while self._pending and self._pending[0][2].query():
            step, host, _ = self._pending.popleft()
            self._read(step, float(host.reshape(-1)[0]))
        window, self._window_falls = self._window_falls, 0
        if self._first is None or self._last is None:
            return Evidence()
        return Evidence(
            grad_scale_start=self._first[1],
            grad_scale=self._last[1],
            grad_scale_falls=float(self.falls),
            grad_scale_window_falls=float(window),
            grad_scale_steps=float(self._last[0] - self._first[0]),
        )

    def release(self) -> None:
        """Drop the queued reads (fit ends)."""
        self._pending.clear()
