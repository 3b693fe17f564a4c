"""Stand-ins for ``torch.cuda.Event`` on a scripted GPU timeline, for CPU tests of ``StreamIdleMeter``.

An event recorded now takes the timeline's ``now`` (ms of GPU time) as the moment the GPU reaches it; it has
completed once ``done`` (ms) has passed it. ``elapsed_time`` refuses events that have not completed, as
CUDA does (``cudaErrorNotReady``), so a test fails if the meter reads one too early.
"""

from __future__ import annotations

import math
import time


class FakeTimeline:
    """The GPU's clock as a test scripts it; ``event()`` is the meter's ``event_factory``."""

    def __init__(self) -> None:
        self.now = 0.0  # GPU time (ms) at which the next recorded event will execute
        self.done = math.inf  # every event at or before this GPU time has completed
        self.created = 0
        self.synchronized = 0

    def event(self) -> FakeEvent:
        self.created += 1
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, timeline: FakeTimeline) -> None:
        self.timeline = timeline
        self.t: float | None = None

    def record(self, stream: object = None) -> None:
        self.t = self.timeline.now

    def query(self) -> bool:
        return self.t is not None and self.t <= self.timeline.done

    def synchronize(self) -> None:
        self.timeline.synchronized += 1
        if self.t is not None:
            self.timeline.done = max(self.timeline.done, self.t)

    def elapsed_time(self, other: FakeEvent) -> float:
        if not (self.query() and other.query()):
            raise RuntimeError("CUDA error: device not ready (an event read before it completed)")
        assert self.t is not None and other.t is not None
        return other.t - self.t


class HostClockEvent(FakeEvent):
    """An event that executes the moment the host records it: a GPU that is never the slow side."""

    def record(self, stream: object = None) -> None:
        self.t = time.perf_counter() * 1000.0


def host_clock_event() -> HostClockEvent:
    return HostClockEvent(FakeTimeline())
