import multiprocessing
import os
import pickle
import sys
import threading
import time
from collections import namedtuple
from types import SimpleNamespace

import psutil
import pytest

from lightning_gpuopt.observe import host_cpu
from lightning_gpuopt.observe.host_cpu import CPU_KEYS, READ_KEY, HostCPUReader, cpu_busy_total

# psutil's own shapes: a process's cpu_times, a thread, a Linux core's cpu_times
ProcTimes = namedtuple("ProcTimes", "user system children_user children_system iowait")
Thread = namedtuple("Thread", "id user_time system_time")
CoreTimes = namedtuple("CoreTimes", "user nice system idle iowait irq softirq steal guest guest_nice")
WinCoreTimes = namedtuple("WinCoreTimes", "user system idle interrupt dpc")


def _core(busy: float, idle: float) -> CoreTimes:
    return CoreTimes(busy, 0.0, 0.0, idle, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


class FakePsutil:
    """psutil at its boundary: one trainer (pid 100, threads 100 and 101), a worker 200 and its child 300
    (``children(recursive=True)`` lists both), and the per-core counters of two cores."""

    Error = psutil.Error
    NoSuchProcess = psutil.NoSuchProcess

    def __init__(self) -> None:
        self.set(main=0, process=0, reaped=0, worker=0, grandchild=0, busy=0, idle=0)
        self.gone: set[int] = set()
        self.read_bytes = {100: 0, 200: 0, 300: 0}  # bytes each process read from storage

    def set(self, main, process, reaped, worker, grandchild, busy, idle) -> None:
        self.times = {
            100: ProcTimes(process, 0.0, reaped, 0.0, 0.0),
            200: ProcTimes(worker * 0.75, worker * 0.25, 0.0, 0.0, 0.0),
            300: ProcTimes(grandchild, 0.0, 0.0, 0.0, 0.0),
        }
        self.threads = [Thread(100, main, 0.0), Thread(101, process - main, 0.0)]
        self.cores = [_core(busy, idle), _core(0.0, 0.0)]

    def Process(self, pid=None):  # psutil's name
        return _FakeProcess(self, pid if pid is not None else 100)

    def cpu_times(self, percpu=False):
        assert percpu
        return self.cores


class _FakeProcess:
    def __init__(self, ps: FakePsutil, pid: int) -> None:
        self.ps, self.pid = ps, pid

    def cpu_times(self):
        if self.pid in self.ps.gone:
            raise psutil.NoSuchProcess(self.pid)
        return self.ps.times[self.pid]

    def threads(self):
        return self.ps.threads

    def io_counters(self):
        if self.pid in self.ps.gone:
            raise psutil.NoSuchProcess(self.pid)
        return SimpleNamespace(read_bytes=self.ps.read_bytes[self.pid])

    def children(self, recursive=False):
        assert recursive
        return [_FakeProcess(self.ps, 200), _FakeProcess(self.ps, 300)]


def _reader(monkeypatch, clock):
    fake = FakePsutil()
    monkeypatch.setattr(host_cpu, "_psutil", lambda: fake)
    ticks = iter(clock)
    monkeypatch.setattr(host_cpu.time, "monotonic", lambda: next(ticks))
    reader = HostCPUReader(main_tid=100)  # not this thread: read through Process.threads()
    reader.pid, reader.cpus, reader.cores = 100, [0, 1], 2
    return fake, reader


def test_reader_rates_from_psutil(monkeypatch):
    fake, reader = _reader(monkeypatch, [10.0, 12.0])  # two seconds between the two snapshots
    assert reader.available
    reader.read()
    # in 2 s: main thread 1.5 s, pin thread 0.5 s, worker 3 s, its child 1 s, one reaped child 0.2 s; the two
    # cores were busy 3.2 of 4 s
    fake.set(main=1.5, process=2.0, reaped=0.2, worker=3.0, grandchild=1.0, busy=3.2, idle=0.8)
    fake.read_bytes = {100: 10e6, 200: 50e6, 300: 0}  # the trainer's threads and a worker read 60 MB
    w = reader.window()
    assert set(w) == set(CPU_KEYS)
    assert w[READ_KEY] == pytest.approx(30.0)  # MB/s over the two seconds
    assert w["host/cpu_main_pct"] == pytest.approx(75.0)
    assert w["host/cpu_workers_pct"] == pytest.approx(100.0 * (0.5 + 3.0 + 1.0 + 0.2) / 2)
    assert w["host/cpu_busy_frac"] == pytest.approx(0.8)
    assert w["host/cpu_cores"] == 2.0


def test_a_child_that_exits_between_listing_and_reading_is_skipped(monkeypatch):
    fake, reader = _reader(monkeypatch, [10.0, 12.0])
    reader.read()
    fake.set(main=1.0, process=1.0, reaped=0.0, worker=2.0, grandchild=9.0, busy=1.0, idle=1.0)
    fake.gone.add(300)
    w = reader.window()
    assert w["host/cpu_workers_pct"] == pytest.approx(100.0 * 2.0 / 2)


def test_a_window_shorter_than_a_tick_leaves_the_cores_to_the_next(monkeypatch):
    fake, reader = _reader(monkeypatch, [10.0, 10.005, 12.0])
    fake.set(main=0, process=0, reaped=0, worker=0, grandchild=0, busy=1.0, idle=1.0)
    reader.read()
    w = reader.window()  # the system counters did not move: no busy share this window
    assert "host/cpu_busy_frac" not in w and "host/cpu_main_pct" in w
    fake.set(main=1.5, process=2.0, reaped=0.2, worker=3.0, grandchild=1.0, busy=4.2, idle=1.8)
    w = reader.window()  # measured from the first snapshot's counters: 3.2 busy of 4
    assert w["host/cpu_busy_frac"] == pytest.approx(0.8)


def test_fully_busy_cores_never_read_above_one(monkeypatch):
    # two cores busy the whole window: float sums of the counters can come out a hair above 1
    fake, reader = _reader(monkeypatch, [10.0, 12.0])
    fake.cores = [_core(95603.87, 94783.27), _core(5664.57, 8496.35)]
    reader.read()
    fake.cores = [_core(95603.87 + 2.51, 94783.27), _core(5664.57 + 2.21, 8496.35)]
    assert reader.window()["host/cpu_busy_frac"] == 1.0


def test_a_main_thread_psutil_cannot_name_leaves_out_the_thread_split(monkeypatch):
    fake, reader = _reader(monkeypatch, [10.0, 12.0])
    reader.main_tid = 4242  # e.g. macOS, whose thread ids are not native ids
    reader.read()
    fake.set(main=1.0, process=1.0, reaped=0.0, worker=1.0, grandchild=0.0, busy=1.0, idle=1.0)
    assert set(reader.window()) == {"host/cpu_busy_frac", "host/cpu_cores", READ_KEY}


def test_a_process_psutil_cannot_read_reports_nothing(monkeypatch):
    fake, reader = _reader(monkeypatch, [10.0, 12.0])
    fake.gone.add(100)
    assert not reader.available
    reader.read()
    assert reader.window() == {}


def test_busy_and_total_of_a_core():
    # Linux: guest time is inside user already; idle and iowait are not busy
    linux = CoreTimes(100.0, 10.0, 50.0, 800.0, 40.0, 1.0, 2.0, 3.0, 7.0, 5.0)
    assert cpu_busy_total(linux) == pytest.approx((166.0, 1006.0))
    assert cpu_busy_total(WinCoreTimes(5.0, 3.0, 10.0, 1.0, 1.0)) == pytest.approx((10.0, 20.0))


def test_cores_of_the_affinity_among_psutils_entries(monkeypatch):
    monkeypatch.setattr(host_cpu.os, "sysconf", lambda name: 8, raising=False)
    assert host_cpu._entries([], 8) == list(range(8))
    assert host_cpu._entries(list(range(8)), 8) == list(range(8))
    assert host_cpu._entries([2, 5], 8) == [2, 5]  # every core online: entry i is core i
    assert host_cpu._entries([2, 5], 6) == []  # two cores offline: which entry is core 5 is unknown
    assert host_cpu._entries(list(range(6)), 6) == list(range(6))  # all the online cores


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_reader_sees_a_busy_worker_process_and_the_main_thread():
    reader = HostCPUReader()
    assert reader.available
    reader.read()
    worker = multiprocessing.get_context("fork").Process(target=_burn, args=(0.4,))
    worker.start()
    _burn(0.3)  # CPU time, not wall time: holds on a crowded CI machine too
    worker.join()
    w = reader.window()
    assert w["host/cpu_workers_pct"] > 5.0  # its 0.4 s of CPU reached our reaped-children time
    assert w["host/cpu_main_pct"] > 5.0
    assert 0.0 <= w["host/cpu_busy_frac"] <= 1.0
    assert w["host/cpu_cores"] == len(os.sched_getaffinity(0))


def test_reader_read_on_another_thread_finds_the_training_thread():
    reader = HostCPUReader()  # made on this thread, read on another one (psutil's thread list)
    if not any(t.id == reader.main_tid for t in psutil.Process().threads()):
        pytest.skip("psutil's thread ids are not native thread ids on this platform")
    results: list[dict[str, float]] = []
    ready, go = threading.Event(), threading.Event()

    def read_around_the_work() -> None:
        reader.read()
        ready.set()
        go.wait()
        results.append(reader.window())

    other = threading.Thread(target=read_around_the_work)
    other.start()
    ready.wait()
    _burn(0.3)
    go.set()
    other.join()
    assert results[0]["host/cpu_main_pct"] > 5.0


def test_reader_pickles_and_reads_after():
    reader = HostCPUReader()
    reader.read()
    again = pickle.loads(pickle.dumps(reader))
    assert "host/cpu_cores" in again.window()
