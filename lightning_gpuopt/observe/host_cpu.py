"""Where the host's CPU time goes during training, from Linux ``/proc`` (no psutil), read once a window.

``HostCPUReader.read()`` takes a snapshot of cumulative counters; ``HostCPUReader.window()`` returns the
rates since the previous snapshot. Nothing is read per step. Elsewhere than Linux (no ``/proc``) both
return nothing.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from lightning_gpuopt._common import available_cpus

__all__ = ["CPU_KEYS", "HostCPUReader", "parse_proc_stat_cpus", "parse_stat"]

#: Keys ``HostCPUReader.window()`` returns.
CPU_KEYS: tuple[str, ...] = (
    "host/cpu_main_pct",
    "host/cpu_workers_pct",
    "host/cpu_busy_frac",
    "host/cpu_cores",
)


def parse_stat(text: str) -> tuple[int, int, int]:
    """``(ppid, utime + stime, cutime + cstime)`` in clock ticks from a ``/proc/<pid>[/task/<tid>]/stat`` line.

    The command name (field 2) is in parentheses and may contain spaces, so fields are counted from the
    last ``)``.
    """
    fields = text[text.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state): ppid is field 4, utime..cstime are fields 14..17
    return int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14])


def parse_proc_stat_cpus(text: str, cpus: Iterable[int]) -> tuple[int, int]:
    """``(busy, total)`` clock ticks summed over the ``cpuN`` lines of ``/proc/stat`` for ``cpus``.

    Busy is user + nice + system + irq + softirq + steal; idle and iowait are not busy.
    """
    wanted = {f"cpu{c}" for c in cpus}
    busy = total = 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if name not in wanted:
            continue
        v = [int(x) for x in rest.split()[:8]]
        v += [0] * (8 - len(v))
        user, nice, system, idle, iowait, irq, softirq, steal = v
        b = user + nice + system + irq + softirq + steal
        busy += b
        total += b + idle + iowait
    return busy, total


@dataclass
class _Snapshot:
    t: float
    main: int  # the training thread's ticks
    process: int  # all threads of this process
    children: int  # live descendants (their threads and reaped children) + this process's reaped children
    cpu_busy: int
    cpu_total: int


class HostCPUReader:
    """Rates of CPU use by the training thread, the rest of the trainer, and the cores it may use.

    ``window()`` returns, since the previous ``read()`` or ``window()``:

    - ``host/cpu_main_pct``: the thread that runs the training loop (the one that made the reader, or
      ``main_tid``); 100 = one core busy all the time. Near 100 means the loop itself is CPU-bound.
    - ``host/cpu_workers_pct``: everything else working for the trainer: the process's other threads (DALI's
      CPU pools, the pin-memory thread, torch's intra-op threads on a CPU run, the NVML sampler) and its
      child processes and their descendants (DataLoader workers, also under a forkserver); 100 = one core.
    - ``host/cpu_busy_frac``: share of the cores this process may run on (its affinity) that were busy,
      by anyone, 0..1. The system's counters move in clock ticks (10 ms): a window shorter than a tick has no
      figure, and the next window covers both.
    - ``host/cpu_cores``: how many cores that is.

    Live children are found through ``/proc/<pid>/task/<tid>/children`` (or, where the kernel lacks it, a
    scan of ``/proc``); a child that exited and was reaped keeps counting through this process's reaped
    children's time.

    Args:
        proc: the ``/proc`` mount (tests point it at a folder of fake files).
        main_tid: thread id of the training thread (default: the calling thread).

    Example:
        >>> reader = HostCPUReader()
        >>> reader.read()  # baseline
        >>> # ... train for a while ...
        >>> sorted(reader.window())  # doctest: +SKIP
        ['host/cpu_busy_frac', 'host/cpu_cores', 'host/cpu_main_pct', 'host/cpu_workers_pct']
    """

    def __init__(self, proc: str | os.PathLike[str] = "/proc", main_tid: int | None = None) -> None:
        self.proc = Path(proc)
        self.pid = os.getpid()
        self.main_tid = main_tid if main_tid is not None else threading.get_native_id()
        self.cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.cores = available_cpus()
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._prev: _Snapshot | None = None

    @property
    def available(self) -> bool:
        """Whether this system has the ``/proc`` files the reader needs (Linux)."""
        return (self.proc / str(self.pid) / "stat").exists()

    def _text(self, *parts: str | int) -> str | None:
        try:
            return self.proc.joinpath(*map(str, parts)).read_text()
        except OSError:  # a process or thread that just exited, or no /proc at all
            return None

    def _children_of(self, pid: int, tid: int | None = None) -> list[int] | None:
        text = self._text(pid, "task", pid if tid is None else tid, "children")
        return None if text is None else [int(c) for c in text.split()]

    def _descendants(self) -> list[int]:
        roots = self._children_of(self.pid)
        if roots is None:  # a kernel without CONFIG_PROC_CHILDREN
            return self._scan_descendants()
        try:
            tids = [int(t.name) for t in (self.proc / str(self.pid) / "task").iterdir() if t.name.isdigit()]
        except OSError:
            tids = []
        for tid in tids:  # a child belongs to the thread that forked it
            if tid != self.pid:
                roots += self._children_of(self.pid, tid) or []
        out: list[int] = []
        seen: set[int] = set()
        stack = roots
        while stack:
            pid = stack.pop()
            if pid not in seen:
                seen.add(pid)
                out.append(pid)
                stack += self._children_of(pid) or []  # e.g. a forkserver's workers
        return out

    def _scan_descendants(self) -> list[int]:
        parent: dict[int, int] = {}
        for entry in self.proc.iterdir():
            if entry.name.isdigit():
                text = self._text(entry.name, "stat")
                if text is not None:
                    parent[int(entry.name)] = parse_stat(text)[0]
        out: list[int] = []
        frontier = {self.pid}
        while frontier:
            frontier = {p for p, pp in parent.items() if pp in frontier}
            out.extend(frontier)
        return out

    def read(self) -> None:
        """Take the baseline snapshot the next ``window()`` is measured from."""
        self._prev = self._snapshot()

    def _snapshot(self) -> _Snapshot | None:
        own = self._text(self.pid, "stat")
        main = self._text(self.pid, "task", self.main_tid, "stat")
        if own is None or main is None:
            return None
        _, process, reaped = parse_stat(own)
        children = reaped
        for pid in self._descendants():
            text = self._text(pid, "stat")
            if text is not None:
                _, ticks, their_reaped = parse_stat(text)
                children += ticks + their_reaped
        busy, total = parse_proc_stat_cpus(self._text("stat") or "", self.cpus)
        return _Snapshot(time.monotonic(), parse_stat(main)[1], process, children, busy, total)

    def window(self) -> dict[str, float]:
        """Rates since the previous snapshot, then start a new window; empty without ``/proc``."""
        prev, cur = self._prev, self._snapshot()
        self._prev = cur
        if prev is None or cur is None or cur.t <= prev.t:
            return {}
        if cur.cpu_total <= prev.cpu_total:  # no tick yet: the next window measures the cores from prev
            self._prev = dataclasses.replace(cur, cpu_busy=prev.cpu_busy, cpu_total=prev.cpu_total)
        wall_ticks = (cur.t - prev.t) * self._tick
        main = max(cur.main - prev.main, 0)
        others = max(cur.process - prev.process - main, 0) + max(cur.children - prev.children, 0)
        out = {
            "host/cpu_main_pct": 100.0 * main / wall_ticks,
            "host/cpu_workers_pct": 100.0 * others / wall_ticks,
        }
        if cur.cpu_total > prev.cpu_total:
            out["host/cpu_busy_frac"] = (cur.cpu_busy - prev.cpu_busy) / (cur.cpu_total - prev.cpu_total)
        out["host/cpu_cores"] = float(self.cores)
        return out
