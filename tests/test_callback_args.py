"""Every public callback refuses a bad constructor argument with an error that names it (issue item 8).

One table: each row is a callback, one bad keyword value, the error it must raise (``TypeError`` for a wrong
type, ``ValueError`` for a wrong value) and the argument the message must start with. Booleans must be real
bools (``"no"`` and ``"false"`` are truthy strings, so accepting them would turn a feature on), numbers finite
and in range, ints not bools, strings from their allowed set. ``test_documented_values_construct`` keeps the
defaults and the values the docstrings show working.
"""

from __future__ import annotations

import inspect
import math
import re
from typing import Any

import pytest
from lightning.pytorch.callbacks import Callback

import lightning_gpuopt
from lightning_gpuopt import (
    BottleneckAdvisor,
    ChannelsLast,
    CompileModel,
    FusedOptimizer,
    GPUStatsMonitor,
    NVTXRanges,
)
from lightning_gpuopt.compute.ddp import NonBlockingStepChecks
from lightning_gpuopt.observe.advisor import AdvisorThresholds, Hysteresis
from lightning_gpuopt.observe.nvml import NVMLSampler

INF, NAN = math.inf, math.nan

# (factory, bad keyword arguments, error, argument named at the start of the message)
BAD: list[tuple[Any, dict[str, Any], type[Exception], str]] = [
    # GPUStatsMonitor
    (GPUStatsMonitor, {"sample_period_s": INF}, ValueError, "sample_period_s"),
    (GPUStatsMonitor, {"sample_period_s": NAN}, ValueError, "sample_period_s"),
    (GPUStatsMonitor, {"sample_period_s": 0}, ValueError, "sample_period_s"),
    (GPUStatsMonitor, {"sample_period_s": -0.1}, ValueError, "sample_period_s"),
    (GPUStatsMonitor, {"sample_period_s": "0.1"}, TypeError, "sample_period_s"),
    (GPUStatsMonitor, {"sample_period_s": True}, TypeError, "sample_period_s"),
    (GPUStatsMonitor, {"log_every_n_steps": 0}, ValueError, "log_every_n_steps"),
    (GPUStatsMonitor, {"log_every_n_steps": True}, TypeError, "log_every_n_steps"),
    (GPUStatsMonitor, {"log_every_n_steps": 10.0}, TypeError, "log_every_n_steps"),
    (GPUStatsMonitor, {"gpu": "false"}, TypeError, "gpu"),
    (GPUStatsMonitor, {"gpu": None}, TypeError, "gpu"),
    (GPUStatsMonitor, {"gpm": 1}, TypeError, "gpm"),
    (GPUStatsMonitor, {"all_ranks": "yes"}, TypeError, "all_ranks"),
    (GPUStatsMonitor, {"nvml_index": -1}, ValueError, "nvml_index"),
    (GPUStatsMonitor, {"nvml_index": "0"}, TypeError, "nvml_index"),
    (GPUStatsMonitor, {"nvml_index": False}, TypeError, "nvml_index"),
    (GPUStatsMonitor, {"ceiling": "yes"}, TypeError, "ceiling"),
    (GPUStatsMonitor, {"ceiling": 1}, TypeError, "ceiling"),
    (GPUStatsMonitor, {"ceiling": None}, TypeError, "ceiling"),  # a plain bool: off unless asked
    (GPUStatsMonitor, {"ceiling_steps": 1}, ValueError, "ceiling_steps"),
    (GPUStatsMonitor, {"ceiling_steps": 8.0}, TypeError, "ceiling_steps"),
    (GPUStatsMonitor, {"sync_steps": -1}, ValueError, "sync_steps"),
    (GPUStatsMonitor, {"sync_steps": 1.5}, TypeError, "sync_steps"),
    (GPUStatsMonitor, {"sync_steps": "5"}, TypeError, "sync_steps"),
    (GPUStatsMonitor, {"sync_idle_frac": 1.5}, ValueError, "sync_idle_frac"),
    (GPUStatsMonitor, {"sync_idle_frac": NAN}, ValueError, "sync_idle_frac"),
    (GPUStatsMonitor, {"sync_idle_frac": "0.1"}, TypeError, "sync_idle_frac"),
    # NVTXRanges
    (NVTXRanges, {"module_depth": -1}, ValueError, "module_depth"),
    (NVTXRanges, {"module_depth": True}, TypeError, "module_depth"),
    (NVTXRanges, {"module_depth": 1.0}, TypeError, "module_depth"),
    (NVTXRanges, {"module_root": None}, TypeError, "module_root"),
    (NVTXRanges, {"start_step": 3}, ValueError, "start_step and stop_step"),
    (NVTXRanges, {"start_step": -1, "stop_step": 5}, ValueError, "start_step"),
    (NVTXRanges, {"start_step": "1", "stop_step": 5}, TypeError, "start_step"),
    (NVTXRanges, {"start_step": 1, "stop_step": 5.0}, TypeError, "stop_step"),
    (NVTXRanges, {"start_step": 5, "stop_step": 5}, ValueError, "stop_step"),
    (NVTXRanges, {"phases": "no"}, TypeError, "phases"),
    (NVTXRanges, {"phases": 0}, TypeError, "phases"),
    (NVTXRanges, {"data_wait": "false"}, TypeError, "data_wait"),
    (NVTXRanges, {"validation": None}, TypeError, "validation"),
    (NVTXRanges, {"backend": "nsys"}, ValueError, "backend"),
    (NVTXRanges, {"backend": None}, TypeError, "backend"),
    (NVTXRanges, {"domain": ""}, ValueError, "domain"),
    (NVTXRanges, {"domain": 7}, TypeError, "domain"),
    # BottleneckAdvisor
    (BottleneckAdvisor, {"warmup_steps": -1}, ValueError, "warmup_steps"),
    (BottleneckAdvisor, {"warmup_steps": 2.5}, TypeError, "warmup_steps"),
    (BottleneckAdvisor, {"window_steps": 0}, ValueError, "window_steps"),
    (BottleneckAdvisor, {"window_steps": True}, TypeError, "window_steps"),
    (BottleneckAdvisor, {"min_windows": 0}, ValueError, "min_windows"),
    (BottleneckAdvisor, {"min_windows": "2"}, TypeError, "min_windows"),
    (BottleneckAdvisor, {"clear_windows": 1.5}, TypeError, "clear_windows"),
    (BottleneckAdvisor, {"thresholds": {"gpu_idle_frac": 0.2}}, TypeError, "thresholds"),
    (BottleneckAdvisor, {"verbose": "no"}, TypeError, "verbose"),
    (BottleneckAdvisor, {"verbose": None}, TypeError, "verbose"),
    # AdvisorThresholds (BottleneckAdvisor's config)
    (AdvisorThresholds, {"gpu_idle_frac": 1.5}, ValueError, "gpu_idle_frac"),
    (AdvisorThresholds, {"store_read_mb_s": -1.0}, ValueError, "store_read_mb_s"),
    (AdvisorThresholds, {"store_read_mb_s": "10"}, TypeError, "store_read_mb_s"),
    (AdvisorThresholds, {"gpu_idle_frac": NAN}, ValueError, "gpu_idle_frac"),
    (AdvisorThresholds, {"loader_share": -0.1}, ValueError, "loader_share"),
    (AdvisorThresholds, {"input_wait_frac": "0.1"}, TypeError, "input_wait_frac"),
    (AdvisorThresholds, {"input_wait_min_ms": -1.0}, ValueError, "input_wait_min_ms"),
    (AdvisorThresholds, {"input_wait_min_ms": INF}, ValueError, "input_wait_min_ms"),
    (AdvisorThresholds, {"gpu_busy_util": 0.9e3}, ValueError, "gpu_busy_util"),
    (AdvisorThresholds, {"few_workers_frac": None}, TypeError, "few_workers_frac"),
    (AdvisorThresholds, {"cores_full_frac": 2}, ValueError, "cores_full_frac"),
    (AdvisorThresholds, {"launch_util": -5}, ValueError, "launch_util"),
    (AdvisorThresholds, {"launch_sm_active": True}, TypeError, "launch_sm_active"),
    (AdvisorThresholds, {"small_batch": 16.0}, TypeError, "small_batch"),
    (AdvisorThresholds, {"small_batch": -1}, ValueError, "small_batch"),
    (AdvisorThresholds, {"headroom_mem_frac": 30}, ValueError, "headroom_mem_frac"),
    (AdvisorThresholds, {"tensor_core_capability": "7.0"}, TypeError, "tensor_core_capability"),
    (AdvisorThresholds, {"tensor_core_capability": (7,)}, TypeError, "tensor_core_capability"),
    (AdvisorThresholds, {"tensor_core_capability": (7, -1)}, ValueError, "tensor_core_capability"),
    (AdvisorThresholds, {"channels_last_frac": INF}, ValueError, "channels_last_frac"),
    (AdvisorThresholds, {"host_sync_wait_frac": 1.01}, ValueError, "host_sync_wait_frac"),
    (AdvisorThresholds, {"host_sync_busy_util": 101}, ValueError, "host_sync_busy_util"),
    (AdvisorThresholds, {"rank_wait_frac": -0.5}, ValueError, "rank_wait_frac"),
    (AdvisorThresholds, {"rank_wait_min_ms": "2"}, TypeError, "rank_wait_min_ms"),
    (AdvisorThresholds, {"fp16_scale_floor": -1.0}, ValueError, "fp16_scale_floor"),
    (AdvisorThresholds, {"fp16_scale_falls": 0}, ValueError, "fp16_scale_falls"),
    (AdvisorThresholds, {"jpeg_busy_util": 101.0}, ValueError, "jpeg_busy_util"),
    # ChannelsLast
    (ChannelsLast, {"convert_inputs": "yes"}, TypeError, "convert_inputs"),
    (ChannelsLast, {"convert_inputs": None}, TypeError, "convert_inputs"),
    # CompileModel
    (CompileModel, {"when": "sometimes"}, ValueError, "when"),
    (CompileModel, {"when": True}, TypeError, "when"),
    (CompileModel, {"when": None}, TypeError, "when"),
    (CompileModel, {"backend": ""}, ValueError, "backend"),
    (CompileModel, {"backend": None}, TypeError, "backend"),
    (CompileModel, {"mode": "fast"}, ValueError, "mode"),
    # the parts the callbacks build on, also public
    (Hysteresis, {"raise_after": 0}, ValueError, "raise_after"),
    (Hysteresis, {"clear_after": 1.0}, TypeError, "clear_after"),
    (NVMLSampler, {"index": 0, "period_s": INF}, ValueError, "period_s"),
    (NVMLSampler, {"index": 0, "gpm": "no"}, TypeError, "gpm"),
    (NVMLSampler, {"index": True}, TypeError, "index"),
]


def _id(row: tuple[Any, dict[str, Any], type[Exception], str]) -> str:
    factory, kwargs, _error, _name = row
    return f"{factory.__name__}-" + "-".join(f"{k}={v!r}" for k, v in kwargs.items())


def test_the_helpers_say_what_and_refuse_non_finite_numbers() -> None:
    from lightning_gpuopt._checks import check_bool, check_choice, check_float, check_int, check_pair

    with pytest.raises(TypeError, match=r"^on must be True, False or None, got 'yes'; say on=True$"):
        check_bool("yes", "on", none_ok=True, fix="say on=True")
    check_bool(None, "on", none_ok=True)
    with pytest.raises(ValueError, match=r"^n must be an int >= 1 and <= 3 \(steps\), got 4$"):
        check_int(4, "n", low=1, high=3, what="(steps)")
    # a string it also takes: another string is a wrong value, a float or a bool a wrong type
    check_int("auto", "workers", low=0, also=("auto",))
    with pytest.raises(ValueError, match=r"^workers must be 'auto' or an int >= 0, got 'eight'$"):
        check_int("eight", "workers", low=0, also=("auto",))
    for wrong in (2.5, True, None):
        with pytest.raises(TypeError, match=r"^workers must be 'auto' or an int >= 0, got"):
            check_int(wrong, "workers", low=0, also=("auto",))
    assert check_float(2, "x", low=0, low_open=True) == 2.0 and check_float(None, "x", none_ok=True) is None
    for bad in (INF, -INF, NAN):
        with pytest.raises(ValueError, match=r"^x must be a finite number, got"):
            check_float(bad, "x")
    with pytest.raises(ValueError, match=r"^x must be a finite number < 1, got 1$"):
        check_float(1, "x", high=1, high_open=True)
    with pytest.raises(TypeError, match=r"^mode must be one of 'a', 'b', got 1$"):
        check_choice(1, "mode", ("a", "b"))
    # a range without an upper bound still has a finite one (AugmentConfig's ratio)
    with pytest.raises(ValueError, match=r"augment.ratio must be a finite range"):
        check_pair((0.5, INF), "augment.ratio", 0.0, None, "width / height")


@pytest.mark.parametrize(("factory", "kwargs", "error", "name"), BAD, ids=[_id(r) for r in BAD])
def test_a_bad_argument_is_refused_by_name(
    factory: Any, kwargs: dict[str, Any], error: type[Exception], name: str
) -> None:
    with pytest.raises(error) as info:
        factory(**kwargs)
    assert type(info.value) is error  # not a subclass standing in for the other kind
    message = str(info.value)
    # the package's one form: "<arg> must be <what>, got <value!r>[; <fix>]"
    assert re.match(rf"{re.escape(name)} must be .+, got ", message), message


# the documented values: the defaults, and what the docstrings and docs/ show
GOOD: list[tuple[Any, dict[str, Any]]] = [
    (GPUStatsMonitor, {}),
    (GPUStatsMonitor, {"log_every_n_steps": 20}),
    (
        GPUStatsMonitor,
        {"sample_period_s": 1, "log_every_n_steps": None, "gpu": False, "gpm": False, "all_ranks": True},
    ),
    (GPUStatsMonitor, {"nvml_index": 0}),
    (GPUStatsMonitor, {"ceiling": True, "ceiling_steps": 8}),
    (NVTXRanges, {}),
    (NVTXRanges, {"module_depth": 1, "module_root": "model", "start_step": 100, "stop_step": 110}),
    (NVTXRanges, {"start_step": 0, "stop_step": 1, "phases": False, "data_wait": False, "validation": False}),
    (NVTXRanges, {"backend": "nvtx", "domain": "mine"}),
    (NVTXRanges, {"backend": "torch"}),
    (BottleneckAdvisor, {}),
    (BottleneckAdvisor, {"warmup_steps": 0, "window_steps": 2, "min_windows": 1, "clear_windows": 3}),
    (BottleneckAdvisor, {"warmup_steps": 20, "thresholds": AdvisorThresholds(), "verbose": False}),
    (AdvisorThresholds, {}),
    (AdvisorThresholds, {"gpu_idle_frac": 0.05, "input_wait_frac": 0.05}),
    (AdvisorThresholds, {"gpu_idle_frac": 0, "loader_share": 1, "gpu_busy_util": 100, "small_batch": 0}),
    (AdvisorThresholds, {"tensor_core_capability": (8, 0), "rank_wait_min_ms": 0.0}),
    (ChannelsLast, {}),
    (ChannelsLast, {"convert_inputs": False}),
    (CompileModel, {}),
    (CompileModel, {"when": "auto", "backend": "aot_eager"}),
    (CompileModel, {"mode": "reduce-overhead"}),
    (FusedOptimizer, {}),
    (NonBlockingStepChecks, {}),
    (Hysteresis, {"raise_after": 1, "clear_after": 5}),
    (NVMLSampler, {"index": 0, "period_s": 0.05, "gpm": False}),
]


@pytest.mark.parametrize(
    ("factory", "kwargs"), GOOD, ids=[f"{f.__name__}-{i}" for i, (f, _k) in enumerate(GOOD)]
)
def test_documented_values_construct(factory: Any, kwargs: dict[str, Any]) -> None:
    obj = factory(**kwargs)
    for key, value in kwargs.items():
        assert getattr(obj, key) == value, key


# Public callbacks whose arguments are checked in their own package part and tested beside it.
_TESTED_ELSEWHERE = {"WorkerTuner"}  # data/tuning.py (tests/data/test_tuning.py)


def test_the_table_covers_every_public_callback() -> None:
    public = {
        name
        for name in lightning_gpuopt.__all__
        if inspect.isclass(obj := getattr(lightning_gpuopt, name)) and issubclass(obj, Callback)
    }
    covered = {f.__name__ for f, *_ in BAD} | {f.__name__ for f, _ in GOOD}
    assert public - _TESTED_ELSEWHERE <= covered
    # and every argument of every covered callback has at least one bad value in the table
    bad_args = {(f.__name__, k) for f, kwargs, *_ in BAD for k in kwargs}
    for name in sorted(public - _TESTED_ELSEWHERE):
        params = [p for p in inspect.signature(getattr(lightning_gpuopt, name)).parameters if p != "self"]
        missing = [p for p in params if (name, p) not in bad_args]
        assert not missing, f"{name}: no bad value tested for {missing}"
    fields = inspect.signature(AdvisorThresholds).parameters
    assert not [f for f in fields if ("AdvisorThresholds", f) not in bad_args]
