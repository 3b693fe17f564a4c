"""Per-rank timing under DDP: each rank's wait in the gradient all-reduce (from its last gradient being ready
to the end of its backward), gathered once a window (docs/advisor.md)."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Any

import torch
from torch import nn

from lightning_gpuopt.observe._lifecycle import Loop
from lightning_gpuopt.observe.advisor.evidence import RankEvidence

__all__ = ["AllReduceWaitTimer", "gather_ranks"]


class AllReduceWaitTimer:
    """Measures each step's wait in the gradient all-reduce; ``window()`` gives the median since the last call.

    Example:
        >>> timer = AllReduceWaitTimer(torch.device("cpu"))
        >>> attached = timer.attach(nn.Linear(2, 2))
        >>> timer.window() is None  # no backward yet
        True
        >>> timer.detach()
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._handle: Any = None
        self._ready_s: float | None = None
        self._ready_event: Any = None
        # event pairs waiting for completion; past the bound the GPU is far behind and the oldest are dropped
        self._pending: deque[tuple[Any, Any]] = deque(maxlen=256)
        self._waits_ms: list[float] = []

    def attach(self, module: nn.Module) -> bool:
        """Hook the first parameter that requires grad; ``False`` when there is none."""
        param = next((p for p in module.parameters() if p.requires_grad), None)
        if param is None:
            return False
        self._handle = param.register_post_accumulate_grad_hook(self._grad_ready)
        return True

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _grad_ready(self, param: torch.Tensor) -> None:
        if self.cuda:
            self._ready_event = torch.cuda.Event(enable_timing=True)
            self._ready_event.record()  # on the stream the backward of this parameter runs on
        else:
            self._ready_s = time.perf_counter()

    def backward_end(self) -> None:
        """The step's backward (with DDP's wait for the reduced gradients) has returned."""
        if self.cuda:
            if self._ready_event is None:
                return
            done = torch.cuda.Event(enable_timing=True)
            done.record()
            self._pending.append((self._ready_event, done))
            self._ready_event = None
        elif self._ready_s is not None:
            self._waits_ms.append(1000.0 * (time.perf_counter() - self._ready_s))
            self._ready_s = None

    def window(self) -> float | None:
        """Median wait (ms) of the steps completed since the last call; ``None`` if none completed."""
        while self._pending and self._pending[0][1].query():
            ready, done = self._pending.popleft()
            self._waits_ms.append(ready.elapsed_time(done))
        median = statistics.median(self._waits_ms) if self._waits_ms else None
        self._waits_ms.clear()
        return median


def gather_ranks(
    loop: Loop, step_ms: float | None, data_wait_ms: float | None, wait_ms: float | None
) -> RankEvidence:
    """Every rank's ``(step_ms, data_wait_ms, allreduce_wait_ms)``: one ``all_gather``, called by every rank."""
    row = [math.nan if v is None else float(v) for v in (step_ms, data_wait_ms, wait_ms)]
    local = torch.tensor(row, dtype=torch.float64, device=loop.device)
    gathered = loop.all_gather(local)
    return RankEvidence.from_rows(gathered.reshape(-1, len(row)).cpu().tolist())
