"""A CUPTI kernel timeline (``torch.profiler``'s Chrome trace) read as the idle shares of a training stream.

The GPU idle test compares ``GPUStatsMonitor``'s ``gpu/idle_frac`` with these: each step is a CPU range named
``<STEP_PREFIX><index>``; a kernel belongs to the step whose range holds the CPU call that launched it
(correlation ids); the training stream is the one with the most kernel time.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

STEP_PREFIX = "gpu_idle_step_"
Kernel = tuple[float, float, int]  # start us, end us, stream


def trace_events(trace: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The event list of a Chrome trace as ``torch.profiler`` exports it."""
    return trace if isinstance(trace, list) else list(trace.get("traceEvents", []))


def step_kernels(
    events: Sequence[dict[str, Any]], prefix: str = STEP_PREFIX
) -> tuple[dict[int, list[Kernel]], list[Kernel]]:
    """Kernels by step, and all kernels; kernels launched outside every step are in the second list only."""
    ranges = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), int(e["name"][len(prefix) :]))
        for e in events
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(prefix)
    )
    starts = [r[0] for r in ranges]
    launch_ts = {
        e["args"]["correlation"]: float(e["ts"])
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    by_step: dict[int, list[Kernel]] = {}
    kernels: list[Kernel] = []
    for e in events:
        if e.get("cat") != "kernel":
            continue
        args = e.get("args", {})
        kernel = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), int(args.get("stream", -1)))
        kernels.append(kernel)
        t = launch_ts.get(args.get("correlation"))
        if t is None:
            continue
        i = bisect.bisect_right(starts, t) - 1
        if i >= 0 and t <= ranges[i][1]:
            by_step.setdefault(ranges[i][2], []).append(kernel)
    return by_step, kernels


def training_stream(by_step: dict[int, list[Kernel]]) -> int:
    """The stream with the most kernel time among the steps' kernels."""
    busy: dict[int, float] = {}
    for kernels in by_step.values():
        for start, end, stream in kernels:
            busy[stream] = busy.get(stream, 0.0) + (end - start)
    if not busy:
        raise ValueError("no kernel was launched inside a step range: is CUDA activity profiled?")
    return max(busy, key=lambda s: busy[s])


def union_length(intervals: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` clipped to ``[lo, hi]``."""
    total, cur_start, cur_end = 0.0, 0.0, None
    for start, end in sorted((max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def truth_fractions(
    by_step: dict[int, list[Kernel]],
    kernels: Sequence[Kernel],
    first: int,
    last: int,
    stream: int | None = None,
) -> dict[str, float]:
    """Idle shares of the training stream over steps ``first..last``, from the end of step ``first - 1``.

    Returns ``truth_idle_frac`` (no kernel running on the stream), ``truth_between_steps_idle_frac`` (gaps
    from one step's last kernel to the next one's first: what ``gpu/idle_frac`` measures), the window in ms
    and its steps.
    """
    stream = training_stream(by_step) if stream is None else stream

    def on_stream(k: int) -> list[Kernel]:
        mine = [kn for kn in by_step.get(k, []) if kn[2] == stream]
        if not mine:
            raise ValueError(f"step {k} launched no kernel on stream {stream}")
        return mine

    prev_end = max(e for _, e, _ in on_stream(first - 1))
    lo, between = prev_end, 0.0
    for k in range(first, last + 1):
        mine = on_stream(k)
        between += max(min(s for s, _, _ in mine) - prev_end, 0.0)
        prev_end = max(e for _, e, _ in mine)
    span = prev_end - lo
    busy = union_length([(s, e) for s, e, st in kernels if st == stream], lo, prev_end)
    return {
        "truth_idle_frac": 1.0 - busy / span,
        "truth_between_steps_idle_frac": between / span,
        "truth_window_ms": span / 1000.0,
        "truth_steps": float(last - first + 1),
        "training_stream": float(stream),
    }
