import numpy as np
import pytest
import torch

from lightning_gpuopt.observe.timing import (
    HOST_KEYS,
    LOADER_KEY,
    StepTimer,
    batch_size_of,
    loader_fetch_seconds,
)


def test_window_splits_wait_and_compute():
    t = StepTimer()
    t.mark(0.0)
    # step 1: waits 0.1 s for data, computes 0.3 s; step 2: waits 0.3 s, computes 0.3 s
    t.batch_start(0.1)
    t.batch_end(0.4, 8)
    t.batch_start(0.7)
    t.batch_end(1.0, 8)
    w = t.window()
    assert set(w) == set(HOST_KEYS)
    assert w["time/step_ms"] == pytest.approx(500.0)
    assert w["time/data_wait_ms"] == pytest.approx(200.0)
    assert w["time/data_wait_frac"] == pytest.approx(0.4)
    assert w["throughput/samples_per_sec"] == pytest.approx(16.0)
    assert t.window() == {}  # reset after reading


def test_mark_excludes_non_training_time():
    t = StepTimer()
    t.batch_start(0.0)  # no mark: the first wait is unknown and counts as 0
    t.batch_end(1.0, 4)
    t.mark(5.0)  # e.g. a validation run ended at 5 s
    t.batch_start(5.5)
    t.batch_end(6.0, 4)
    w = t.window()
    assert w["time/data_wait_ms"] == pytest.approx(250.0)
    assert w["time/step_ms"] == pytest.approx(1000.0)


def test_window_boundary_keeps_the_gap():
    t = StepTimer()
    t.mark(0.0)
    t.batch_start(0.0)
    t.batch_end(1.0, 1)
    t.window()
    t.batch_start(3.0)  # the gap after the previous window's last batch belongs to this step
    t.batch_end(4.0, 1)
    assert t.window()["time/data_wait_frac"] == pytest.approx(2.0 / 3.0)


def test_end_without_start_is_ignored():
    t = StepTimer()
    t.batch_end(1.0, 10)
    assert t.window() == {}


def test_batch_size_of():
    assert batch_size_of((torch.zeros(7, 3), torch.zeros(7))) == 7
    assert batch_size_of({"x": np.zeros((5, 2)), "y": [1, 2]}) == 5
    assert batch_size_of([[torch.zeros(3)]]) == 3
    assert batch_size_of(torch.tensor(1.0)) == 1
    assert batch_size_of(["a", "b"]) == 0


def test_loader_wait_is_reported_only_when_added():
    t = StepTimer()
    t.mark(0.0)
    t.batch_start(0.3)
    t.batch_end(1.0, 4)
    t.add_loader_wait(0.2)
    w = t.window()
    assert w[LOADER_KEY] == pytest.approx(0.2)  # 0.2 s inside next() of a 1.0 s step
    t.batch_start(1.1)
    t.batch_end(2.0, 4)
    assert LOADER_KEY not in t.window()  # nothing added: unknown, not zero


class _Loader:
    def __init__(self, seconds):
        self.fetch_seconds = seconds


def test_loader_fetch_seconds_sums_loaders_and_refuses_to_guess():
    assert loader_fetch_seconds(_Loader(1.5)) == 1.5
    assert loader_fetch_seconds([_Loader(1.0), _Loader(2.0)]) == 3.0
    assert loader_fetch_seconds({"a": _Loader(1.0), "b": _Loader(0.5)}) == 1.5
    assert loader_fetch_seconds(object()) is None
    assert loader_fetch_seconds([_Loader(1.0), object()]) is None  # one loader unmeasured: no total
    assert loader_fetch_seconds(_Loader(True)) is None
    assert loader_fetch_seconds([]) is None
