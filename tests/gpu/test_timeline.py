"""The CPU pieces of the GPU idle test: from a profiler trace to the idle shares it calls the truth.

Not marked ``gpu``: they need no GPU and run in a second, so they run wherever the tests run.
"""

import pytest

from tests.gpu import _timeline as timeline


def _trace():
    """Four steps on stream 7 (CPU ranges at 100 k us), a kernel launched between steps, one on stream 9."""
    events = []
    corr = 0

    def kernel(cpu_ts, start, end, stream=7):
        nonlocal corr
        corr += 1
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": cpu_ts, "dur": 2,
                       "args": {"correlation": corr}})  # fmt: skip
        events.append({"ph": "X", "cat": "kernel", "name": f"k{corr}", "ts": start, "dur": end - start,
                       "args": {"correlation": corr, "stream": stream, "device": 0}})  # fmt: skip

    for k in range(4):
        events.append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": f"{timeline.STEP_PREFIX}{k}",
                "ts": 100 * k,
                "dur": 50,
            }
        )
    kernel(10, 1000, 1030)
    kernel(20, 1030, 1060)
    kernel(110, 1070, 1100)
    kernel(120, 1105, 1130)  # 5 us idle inside step 1
    kernel(160, 1130, 1140)  # launched between steps (CPU 160 is outside every range)
    kernel(210, 1150, 1200)
    kernel(215, 1150, 1160, stream=9)
    kernel(220, 1200, 1210)
    kernel(310, 1210, 1260)
    kernel(320, 1270, 1280)  # 10 us idle inside step 3
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 12, "dur": 3, "args": {}})
    return {"traceEvents": events, "deviceProperties": []}


def test_kernels_are_assigned_to_the_step_that_launched_them():
    by_step, kernels = timeline.step_kernels(timeline.trace_events(_trace()))
    assert sorted(by_step) == [0, 1, 2, 3]
    assert [len(by_step[k]) for k in range(4)] == [2, 2, 3, 2]
    assert len(kernels) == 10  # the one launched between steps is kept for the union
    assert timeline.training_stream(by_step) == 7


def test_truth_fractions_over_the_monitor_window():
    by_step, kernels = timeline.step_kernels(timeline.trace_events(_trace()))
    truth = timeline.truth_fractions(by_step, kernels, first=1, last=3)
    # window: end of step 0 (1060) to end of step 3 (1280) = 220 us
    assert truth["truth_window_ms"] == pytest.approx(0.220)
    # between steps: 1070-1060, 1150-1130 (the gap kernel ends step 1's run), 1210-1210
    assert truth["truth_between_steps_idle_frac"] == pytest.approx(30 / 220)
    # no kernel on stream 7: 1060-1070, 1100-1105, 1140-1150, 1260-1270 (the gap kernel counts as busy)
    assert truth["truth_idle_frac"] == pytest.approx(35 / 220)
    assert truth["truth_steps"] == 3


def test_union_length_and_missing_steps():
    assert timeline.union_length([(0, 10), (5, 20), (30, 40)], 2, 35) == pytest.approx(18 + 5)
    assert timeline.union_length([], 0, 10) == 0.0
    by_step, kernels = timeline.step_kernels(timeline.trace_events(_trace()))
    with pytest.raises(ValueError, match="step 4"):
        timeline.truth_fractions(by_step, kernels, first=1, last=4)
    with pytest.raises(ValueError, match="no kernel"):
        timeline.training_stream({})
