import multiprocessing
import os
import sys
import time
from pathlib import Path

import pytest

from lightning_gpuopt.observe import host_cpu
from lightning_gpuopt.observe.host_cpu import CPU_KEYS, HostCPUReader, parse_proc_stat_cpus, parse_stat

linux = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def _stat(pid: int, comm: str, ppid: int, ticks: int, reaped: int = 0) -> str:
    # fields 3.. : state ppid pgrp sid tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime cstime
    return f"{pid} ({comm}) S {ppid} 1 1 0 -1 0 0 0 0 0 {ticks} 0 {reaped} 0 20 0 1 0\n"


def test_parse_stat_counts_fields_after_the_command_name():
    line = "4242 (py (thread) x) R 17 1 1 0 -1 4194304 10 0 0 0 300 45 7 3 20 0 5 0 9"
    assert parse_stat(line) == (17, 345, 10)


def test_parse_proc_stat_cpus_sums_the_allowed_cores():
    text = (
        "cpu  999 0 999 999 0 0 0 0 0 0\n"
        "cpu0 100 10 50 800 40 0 0 0 0 0\n"
        "cpu1 1 0 1 1 0 0 0 0 0 0\n"
        "cpu2 30 0 20 150 0 5 5 0\n"
        "intr 1 2 3\n"
    )
    busy, total = parse_proc_stat_cpus(text, [0, 2])
    assert busy == 160 + 60  # user+nice+system (+irq+softirq+steal)
    assert total == 160 + 840 + 60 + 150


class FakeProc:
    """A /proc tree for one trainer (pid 100, threads 100 and 101), a worker 200 and its child 300."""

    def __init__(self, root: Path, children_files: bool = True) -> None:
        self.root = root
        self.children_files = children_files
        self.set(main=0, process=0, reaped=0, worker=0, grandchild=0, busy=0, idle=0)

    def _write(self, rel: str, text: str) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def set(self, main, process, reaped, worker, grandchild, busy, idle) -> None:
        self._write("100/stat", _stat(100, "python", 1, process, reaped))
        self._write("100/task/100/stat", _stat(100, "python", 1, main))
        self._write("100/task/101/stat", _stat(101, "pt_data_pin", 1, process - main))
        self._write("200/stat", _stat(200, "pt_data_worker", 100, worker))
        self._write("300/stat", _stat(300, "grandchild", 200, grandchild))
        self._write("999/stat", _stat(999, "unrelated", 1, 10_000))
        if self.children_files:
            self._write("100/task/100/children", "200 ")
            self._write("100/task/101/children", "")
            self._write("200/task/200/children", "300")
            self._write("300/task/300/children", "")
        self._write("stat", f"cpu0 {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu1 0 0 0 0 0 0 0 0 0 0\n")


@pytest.mark.parametrize("children_files", [True, False])
def test_reader_rates_from_a_fake_proc(tmp_path, monkeypatch, children_files):
    proc = FakeProc(tmp_path, children_files)
    clock = iter([10.0, 12.0])  # two seconds between the two snapshots
    monkeypatch.setattr(host_cpu.time, "monotonic", lambda: next(clock))
    reader = HostCPUReader(proc=tmp_path, main_tid=100)
    reader.pid = 100
    reader.cpus = [0, 1]
    reader._tick = 100
    assert reader.available
    reader.read()
    # in 2 s (200 ticks): main thread 150, pin thread 50, worker 300, its child 100, one reaped child 20;
    # the two cores were busy 320 of 400 ticks
    proc.set(main=150, process=200, reaped=20, worker=300, grandchild=100, busy=320, idle=80)
    w = reader.window()
    assert set(w) == set(CPU_KEYS)
    assert w["host/cpu_main_pct"] == pytest.approx(75.0)
    assert w["host/cpu_workers_pct"] == pytest.approx(100.0 * (50 + 300 + 100 + 20) / 200)
    assert w["host/cpu_busy_frac"] == pytest.approx(0.8)
    assert w["host/cpu_cores"] == float(reader.cores)


def test_a_window_shorter_than_a_tick_leaves_the_cores_to_the_next(tmp_path, monkeypatch):
    proc = FakeProc(tmp_path, True)
    clock = iter([10.0, 10.005, 12.0])
    monkeypatch.setattr(host_cpu.time, "monotonic", lambda: next(clock))
    reader = HostCPUReader(proc=tmp_path, main_tid=100)
    reader.pid, reader.cpus, reader._tick = 100, [0, 1], 100
    proc.set(main=0, process=0, reaped=0, worker=0, grandchild=0, busy=100, idle=100)
    reader.read()
    w = reader.window()  # the system counters did not move: no busy share this window
    assert "host/cpu_busy_frac" not in w and "host/cpu_main_pct" in w
    proc.set(main=150, process=200, reaped=20, worker=300, grandchild=100, busy=420, idle=180)
    w = reader.window()  # measured from the first snapshot's counters: 320 busy of 400
    assert w["host/cpu_busy_frac"] == pytest.approx(0.8)


def test_reader_without_proc_reports_nothing(tmp_path):
    reader = HostCPUReader(proc=tmp_path / "missing")
    assert not reader.available
    reader.read()
    assert reader.window() == {}


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


@linux
@pytest.mark.skipif(sys.platform != "linux", reason="fork start method")
def test_reader_sees_a_busy_worker_process_and_the_main_thread():
    reader = HostCPUReader()
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
