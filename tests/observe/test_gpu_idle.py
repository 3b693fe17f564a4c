import time

import pytest
import torch

from lightning_gpuopt.observe.gpu_idle import StreamIdleMeter
from tests.observe.fake_cuda_events import FakeTimeline


def _step(meter, gpu, gpu_start, gpu_end, host_start, host_end):
    gpu.now = gpu_start
    meter.step_start(host_start)
    gpu.now = gpu_end
    meter.step_end(host_end)


def test_meter_measures_gaps_and_the_host_time_hidden_behind_the_gpu():
    gpu = FakeTimeline()
    meter = StreamIdleMeter(event_factory=gpu.event)
    meter.mark(0.0)  # GPU time 0, host time 0 s
    # GPU ms / host s: step 0 runs at once; step 1 after a 2 ms gap that the host also spent (no overlap);
    # step 2's host gap is 26 ms, of which the GPU waited 10 ms: 16 ms were hidden behind the GPU's work
    _step(meter, gpu, 0.0, 10.0, 0.000, 0.001)
    _step(meter, gpu, 12.0, 20.0, 0.003, 0.004)
    _step(meter, gpu, 30.0, 40.0, 0.030, 0.031)
    w = meter.window()
    assert w["gpu/idle_frac"] == pytest.approx(12.0 / 40.0)
    # hidden: step 1 max(2 - 2, 0) = 0, step 2 max(26 - 10, 0) = 16 ms; host step times 1 + 3 + 27 ms
    assert w["time/gpu_blocked_frac"] == pytest.approx(16.0 / 31.0)
    assert meter.window() == {}  # read once


def test_steps_not_yet_completed_wait_for_a_later_window_and_are_never_read_early():
    gpu = FakeTimeline()
    meter = StreamIdleMeter(event_factory=gpu.event)
    meter.mark(0.0)
    for k in range(4):  # 10 ms steps with a 5 ms gap before each but the first
        _step(meter, gpu, 15.0 * k, 15.0 * k + 10.0, 0.0, 0.0)
    gpu.done = 26.0  # the GPU has finished step 1 only (step 2 ends at 40)
    first = meter.window()  # FakeEvent.elapsed_time raises if an incomplete event were read
    assert first["gpu/idle_frac"] == pytest.approx(5.0 / 25.0)
    assert meter.pending == 2
    gpu.done = 1e9
    second = meter.window()
    assert second["gpu/idle_frac"] == pytest.approx(10.0 / 30.0)  # its first gap is from step 1's end
    assert meter.pending == 0 and gpu.synchronized == 0


def test_wait_synchronizes_the_last_step_only():
    gpu = FakeTimeline()
    meter = StreamIdleMeter(event_factory=gpu.event)
    meter.mark(0.0)
    _step(meter, gpu, 1.0, 5.0, 0.0, 0.0)
    gpu.done = -1.0  # nothing complete
    assert meter.window() == {}
    assert meter.window(wait=True)["gpu/idle_frac"] == pytest.approx(1.0 / 5.0)
    assert gpu.synchronized == 1


def test_a_mark_restarts_the_gap_so_validation_is_not_idle():
    gpu = FakeTimeline()
    meter = StreamIdleMeter(event_factory=gpu.event)
    meter.mark(0.0)
    _step(meter, gpu, 0.0, 10.0, 0.0, 0.01)
    gpu.now = 500.0  # a validation run kept the stream busy until 500 ms
    meter.mark(0.5)
    _step(meter, gpu, 503.0, 513.0, 0.503, 0.513)
    w = meter.window()
    assert w["gpu/idle_frac"] == pytest.approx(3.0 / 23.0)


def test_events_are_reused_and_odd_hook_orders_are_survived():
    gpu = FakeTimeline()
    meter = StreamIdleMeter(event_factory=gpu.event)
    meter.step_end(0.0)  # an end without a start: ignored
    meter.mark(0.0)
    t = 0.0
    for k in range(1000):
        if k % 97 == 5:
            gpu.now = t
            meter.step_start(t)  # a batch skipped after its start hook: no end follows
        if k % 250 == 0:
            meter.mark(t)
        _step(meter, gpu, t + 1.0, t + 4.0, 0.0, 0.0)
        t += 4.0
        if k % 10 == 9:
            assert meter.window()["gpu/idle_frac"] == pytest.approx(0.25, abs=0.05)
    assert meter.pending == 0
    assert gpu.created <= 2 * 10 + 2  # two a step of one window, recycled: not two a step of the run
    assert meter.pool_size + 1 == gpu.created  # all back in the pool but the anchor


def test_first_step_without_a_mark_only_anchors():
    gpu = FakeTimeline()
    meter = StreamIdleMeter(event_factory=gpu.event)
    _step(meter, gpu, 0.0, 10.0, 0.0, 0.0)
    assert meter.window() == {}
    _step(meter, gpu, 20.0, 30.0, 0.0, 0.0)
    assert meter.window()["gpu/idle_frac"] == pytest.approx(0.5)


@pytest.mark.gpu
def test_cuda_events_measure_a_host_gap_without_synchronising():
    device = torch.device("cuda", 0)
    a = torch.randn(4096, 4096, device=device, dtype=torch.float16)
    meter = StreamIdleMeter(device)
    torch.cuda.synchronize(device)
    meter.mark(time.perf_counter())
    for k in range(12):
        meter.step_start(time.perf_counter())
        for _ in range(20):  # ~ a few ms of GPU work
            a = (a @ a).clamp_(-1, 1)
        meter.step_end(time.perf_counter())
        if k % 2:
            torch.cuda.synchronize(device)  # the GPU drains, then the host "loads" for 20 ms
            time.sleep(0.02)
    w = meter.window(wait=True)
    print(f"\nidle window: {w}")
    assert 0.2 < w["gpu/idle_frac"] < 0.95
    assert meter.pending == 0
