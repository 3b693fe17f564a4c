"""Where the host's CPU time goes during training, and how much it reads from storage: psutil, read once a
window, nothing per step."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from lightning_gpuopt._common import available_cpus

__all__ = ["CPU_KEYS", "READ_KEY", "HostCPUReader", "cpu_busy_total"]

#: Key of the bytes this process and its children read from storage, MB/s (``HostCPUReader.window()``).
READ_KEY = "host/read_mb_s"

#: Keys ``HostCPUReader.window()`` returns.
CPU_KEYS: tuple[str, ...] = (
    "host/cpu_main_pct",
    "host/cpu_workers_pct",
    "host/cpu_busy_frac",
    "host/cpu_cores",
    READ_KEY,
)

#: fields of ``psutil.cpu_times()`` that are not busy time (idle, waiting for I/O) or that are already
#: counted in ``user``/``nice`` (Linux's guest times)
_NOT_BUSY = ("idle", "iowait")
_COUNTED_TWICE = ("guest", "guest_nice")


def _psutil() -> Any:
    import psutil

    return psutil


def cpu_busy_total(times: Any) -> tuple[float, float]:
    """``(busy, total)`` seconds of one ``psutil.cpu_times()`` entry (a core's, or the system's), split as
    psutil's own ``cpu_percent`` splits them."""
    fields = times._asdict()
    total = sum(v for k, v in fields.items() if k not in _COUNTED_TWICE)
    return total - sum(fields.get(k, 0.0) for k in _NOT_BUSY), total


@dataclass
class _Snapshot:
    t: float
    main: float | None  # the training thread's CPU seconds (None: not readable from here)
    process: float  # all threads of this process
    children: float  # live descendants (with their reaped children) + this process's reaped children
    cpu_busy: float
    cpu_total: float
    read_bytes: float | None = None  # bytes read from storage by this process and its live descendants


class HostCPUReader:
    """Rates of CPU use by the training thread, the rest of the trainer, and the cores it may use.

    ``read()`` takes the baseline; ``window()`` returns ``CPU_KEYS`` since the previous snapshot (what each
    key counts: docs/gpu_stats.md), or nothing where psutil cannot read this process. The training thread's
    time is ``time.thread_time()`` when read on that thread, else its entry in ``psutil.Process.threads()``.

    Args:
        main_tid: native thread id (``threading.get_native_id()``) of the training thread (default: the
            calling thread).

    Example:
        >>> reader = HostCPUReader()
        >>> reader.read()  # baseline
        >>> # ... train for a while ...
        >>> sorted(reader.window())  # doctest: +SKIP
        ['host/cpu_busy_frac', 'host/cpu_cores', 'host/cpu_main_pct', 'host/cpu_workers_pct']
    """

    def __init__(self, main_tid: int | None = None) -> None:
        self.pid = os.getpid()
        self.main_tid = main_tid if main_tid is not None else threading.get_native_id()
        self.cpus = _affinity()
        self.cores = len(self.cpus) if self.cpus else available_cpus()
        self._process: Any = None
        self._prev: _Snapshot | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_process": None}  # a psutil.Process holds a lock: made again on use

    @property
    def available(self) -> bool:
        """Whether psutil can read this process's CPU times here."""
        psutil = _psutil()
        try:
            self._proc().cpu_times()
        except (psutil.Error, OSError):
            return False
        return True

    def _proc(self) -> Any:
        if self._process is None:
            self._process = _psutil().Process(self.pid)
        return self._process

    def read(self) -> None:
        """Take the baseline snapshot the next ``window()`` is measured from."""
        self._prev = self._snapshot()

    def _main_seconds(self, proc: Any) -> float | None:
        if threading.get_native_id() == self.main_tid:
            return time.thread_time()
        for thread in proc.threads():
            if thread.id == self.main_tid:
                return thread.user_time + thread.system_time
        return None

    def _snapshot(self) -> _Snapshot | None:
        psutil = _psutil()
        try:
            proc = self._proc()
            own = proc.cpu_times()
            main = self._main_seconds(proc)
            descendants = proc.children(recursive=True)
        except (psutil.Error, OSError):  # no such process, or the platform keeps its figures from us
            return None
        children = own.children_user + own.children_system
        for child in descendants:
            try:
                t = child.cpu_times()
            except (psutil.Error, OSError):  # exited since it was listed: its time is in a reaped total
                continue
            children += t.user + t.system + t.children_user + t.children_system
        read = _read_bytes(proc, descendants, psutil)
        busy = total = 0.0
        cores = psutil.cpu_times(percpu=True)
        for index in _entries(self.cpus, len(cores)):
            b, t = cpu_busy_total(cores[index])
            busy, total = busy + b, total + t
        return _Snapshot(time.monotonic(), main, own.user + own.system, children, busy, total, read)

    def window(self) -> dict[str, float]:
        """Rates since the previous snapshot, then start a new window; empty where psutil cannot read this
        process."""
        prev, cur = self._prev, self._snapshot()
        self._prev = cur
        if prev is None or cur is None or cur.t <= prev.t:
            return {}
        if cur.cpu_total <= prev.cpu_total:  # no tick yet: the next window measures the cores from prev
            self._prev = dataclasses.replace(cur, cpu_busy=prev.cpu_busy, cpu_total=prev.cpu_total)
        wall = cur.t - prev.t
        out: dict[str, float] = {}
        if cur.main is not None and prev.main is not None:
            main = max(cur.main - prev.main, 0.0)
            others = max(cur.process - prev.process - main, 0.0) + max(cur.children - prev.children, 0.0)
            out["host/cpu_main_pct"] = 100.0 * main / wall
            out["host/cpu_workers_pct"] = 100.0 * others / wall
        if cur.cpu_total > prev.cpu_total:
            # min: float sums of the per-core counters can land a hair above 1 on a fully busy machine
            out["host/cpu_busy_frac"] = min(
                (cur.cpu_busy - prev.cpu_busy) / (cur.cpu_total - prev.cpu_total), 1.0
            )
        out["host/cpu_cores"] = float(self.cores)
        if cur.read_bytes is not None and prev.read_bytes is not None:
            out[READ_KEY] = max(cur.read_bytes - prev.read_bytes, 0.0) / wall / 1e6
        return out


def _read_bytes(proc: Any, descendants: list[Any], psutil: Any) -> float | None:
    """Bytes ``proc`` and ``descendants`` read from storage so far; ``None`` where ``proc``'s are not counted."""
    try:
        total = float(proc.io_counters().read_bytes)
    except (AttributeError, psutil.Error, OSError):  # macOS has no io_counters
        return None
    for child in descendants:
        try:
            total += float(child.io_counters().read_bytes)
        except (psutil.Error, OSError):  # exited since it was listed
            continue
    return total


def _affinity() -> list[int]:
    """The cores this process may run on, sorted; empty where the platform does not say (macOS)."""
    if hasattr(os, "sched_getaffinity"):  # Linux: respects taskset and cgroup cpusets
        return sorted(os.sched_getaffinity(0))
    psutil = _psutil()
    try:
        return sorted(psutil.Process().cpu_affinity())
    except (AttributeError, psutil.Error, OSError):  # macOS has no cpu_affinity
        return []


def _entries(cpus: list[int], count: int) -> list[int]:
    """Which of the ``count`` entries of ``psutil.cpu_times(percpu=True)`` are the cores ``cpus``; none where
    cores are offline and ``cpus`` is a subset (the list skips offline cores without naming the others)."""
    if not cpus or len(cpus) == count:
        return list(range(count))
    configured = os.sysconf("SC_NPROCESSORS_CONF") if hasattr(os, "sysconf") else count
    if configured == count and max(cpus) < count:
        return cpus
    return []
