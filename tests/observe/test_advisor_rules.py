"""BottleneckAdvisor's rules: ``diagnose`` on hand-made windows and configurations, and ``Hysteresis``."""

from __future__ import annotations

import json
import pickle

import pytest

from lightning_gpuopt.observe.advisor import (
    KINDS,
    AdvisorThresholds,
    Evidence,
    Hysteresis,
    RankEvidence,
    RunConfig,
    Verdict,
    diagnose,
)
from tests.observe.advisor_cases import BUSY_GPU, cfg, ev, kinds


def test_healthy_gpu_run_raises_nothing():
    assert diagnose(ev(), cfg()) == []


def test_healthy_cpu_run_raises_nothing():
    config = {"device_type": "cpu", "cpus": 2, "num_workers": 0, "pin_memory": False, "precision": "32-true"}
    assert (
        diagnose({"time/data_wait_frac": 0.02, "time/data_wait_ms": 0.1, "time/step_ms": 5.0}, config) == []
    )


def test_input_bound_too_few_workers():
    out = diagnose(
        ev(**{"time/data_wait_frac": 0.6, "time/data_wait_ms": 60.0, "gpu/util": 40.0}), cfg(num_workers=2)
    )
    assert kinds(out) == ["input-bound"]
    v = out[0]
    assert v.cause == "too-few-workers" and v.severity == "warning"
    assert v.evidence["data_wait_frac"] == 0.6 and v.evidence["num_workers"] == 2 and v.evidence["cpus"] == 16
    assert 'num_workers="auto"' in v.advice


def test_input_bound_zero_workers_on_two_cores():
    config = {"device_type": "cpu", "cpus": 2, "num_workers": 0}
    out = diagnose({"time/data_wait_frac": 0.5, "time/data_wait_ms": 20.0}, config)
    assert [(v.kind, v.cause) for v in out] == [("input-bound", "too-few-workers")]


def test_input_bound_too_many_workers_counts_processes():
    # 10 workers are fine for one process on 16 cores, not for 4 processes sharing them
    wait = {"time/data_wait_frac": 0.3, "time/data_wait_ms": 15.0, "gpu/util": 60.0}
    out = diagnose(ev(**wait), cfg(num_workers=10, processes_per_node=4))
    assert out[0].kind == "input-bound" and out[0].cause == "too-many-workers"
    assert out[0].evidence["processes_per_node"] == 4
    assert (
        diagnose(ev(**wait), cfg(num_workers=10, processes_per_node=1, backend="hdf5"))[0].cause
        == "slow-loader"
    )


def test_input_bound_store_read_by_threads_names_the_storage():
    wait = {"time/data_wait_frac": 0.3, "time/data_wait_ms": 14.0, "gpu/util": 70.0}
    out = diagnose(ev(**wait), cfg(backend="hdf5", num_workers=None, decode_threads=4))
    assert [(v.kind, v.cause) for v in out] == [("input-bound", "store-bound")]
    v = out[0]
    assert v.evidence["read_threads"] == 4 and "num_workers" not in v.evidence
    assert "4 reading threads" in v.advice and "/dev/shm" in v.advice and "HDF5Options(threads=8)" in v.advice


def test_input_bound_decode_bound_on_jpeg_folder_with_many_workers():
    out = diagnose(
        ev(**{"time/data_wait_frac": 0.45, "time/data_wait_ms": 40.0, "gpu/util": 55.0}),
        cfg(num_workers=16, backend="folder"),
    )
    assert out[0].cause == "decode-bound"
    assert "convert SRC OUT.h5 --format auto" in out[0].advice and 'backend="dali"' in out[0].advice


@pytest.mark.parametrize(
    ("threads", "cause", "words"),
    [
        (2, "too-few-workers", "The folder's 2 reading threads use few of the 16 cores"),
        (16, "decode-bound", "16 reading threads on 16 cores cannot decode JPEGs"),
        (40, "too-many-workers", "40 reading threads x 1 process(es) oversubscribe 16 cores"),
    ],
)
def test_input_bound_folder_read_by_threads_counts_its_threads(threads, cause, words):
    """A folder's reading threads are not ``num_workers`` (DataLoader worker processes): the advice counts
    them without naming ``num_workers``, and says their default is chosen, not measured."""
    wait = {"time/data_wait_frac": 0.45, "time/data_wait_ms": 40.0, "gpu/util": 55.0}
    out = diagnose(ev(**wait), cfg(backend="folder", num_workers=None, decode_threads=threads))
    assert [(v.kind, v.cause) for v in out] == [("input-bound", cause)]
    assert words in out[0].advice and "workers cannot" not in out[0].advice
    assert "num_workers" not in out[0].advice and "measures" not in out[0].advice
    # like any loader's, the advice opens with the measured wait
    assert out[0].advice.startswith("The loop waits for data 45% of each step while the GPU is busy 55%")


@pytest.mark.parametrize(
    ("decoder", "rates", "remedy"),
    [
        ("cpu", (6_000.0, 5_000.0), "slower still"),  # nvJPEG measured slower on these files
        ("cpu", (4_000.0, 9_000.0), 'DALIOptions(decoder="gpu")'),  # nvJPEG measured faster: the remedy
        ("cpu", (None, None), 'DALIOptions(decoder="gpu")'),  # the decoder was set, nothing measured
        ("gpu", (4_000.0, 9_000.0), 'DALIOptions(decoder="cpu")'),
        (None, (None, None), "more CPU threads"),
    ],
)
def test_input_bound_dali_names_the_other_decoder(decoder, rates, remedy):
    """The advice weighs the rates the loader measured on its own files when it chose its decoder, not a
    rule of cores against one host's training rate."""
    wait = {"time/data_wait_frac": 0.3, "time/data_wait_ms": 14.0, "gpu/util": 70.0}
    config = cfg(backend="dali", decoder=decoder, decode_threads=14, pin_memory=None, cpus=16,
                 cpu_decode_rate=rates[0], gpu_decode_rate=rates[1])  # fmt: skip
    out = diagnose(ev(**wait), config)
    assert [(v.kind, v.cause) for v in out] == [("input-bound", "dali-bound")]
    store = "--format auto" if decoder == "cpu" else 'backend="hdf5"'  # the cores' own remedy: a store
    assert remedy in out[0].advice and store in out[0].advice
    assert out[0].evidence.get("decoder") == decoder and out[0].evidence["decode_threads"] == 14
    if remedy == "slower still":
        assert "nvJPEG decoded 5,000 img/s of these files against the threads' 6,000" in out[0].advice
        assert 'DALIOptions(decoder="gpu")' not in out[0].advice


def test_wait_overlapping_a_busy_gpu_is_not_input_bound():
    # the host waits for data while the GPU still works on queued steps: not a bottleneck
    assert (
        diagnose(
            ev(**{"time/data_wait_frac": 0.3, "time/data_wait_ms": 15.0, "gpu/util": 97.0}),
            cfg(num_workers=0),
        )
        == []
    )


def test_tiny_waits_of_tiny_steps_are_not_input_bound():
    out = diagnose(
        {"time/data_wait_frac": 0.2, "time/data_wait_ms": 0.3, "time/step_ms": 1.5}, cfg(num_workers=0)
    )
    assert "input-bound" not in kinds(out)


def test_pageable_copies():
    out = diagnose(ev(), cfg(pin_memory=False))
    assert kinds(out) == ["pageable-copies"]
    assert "pin_memory=True" in out[0].advice
    # batches already on the GPU (no copy), DALI, or a CPU run: nothing to pin
    assert diagnose(ev(), cfg(pin_memory=False, host_batches=False)) == []
    assert diagnose(ev(), cfg(pin_memory=False, backend="dali")) == []
    assert "pageable-copies" not in kinds(diagnose(ev(), cfg(pin_memory=False, device_type="cpu")))
    # unknown origin with workers: worker processes only produce host tensors
    assert kinds(diagnose(ev(), cfg(pin_memory=False, host_batches=None, num_workers=4))) == [
        "pageable-copies"
    ]


def test_launch_bound_tiny_batch():
    out = diagnose(
        ev(**{"gpu/util": 62.0, "gpu/sm_active": 9.0, "time/step_ms": 14.0, "gpu/mem_used_gb": 4.0}),
        cfg(batch_size=4, mem_peak_gb=3.0),
    )
    assert kinds(out) == ["launch-bound", "memory-headroom"]
    assert out[0].evidence["gpu_util"] == 62.0 and out[0].evidence["batch_size"] == 4
    assert "Grow the batch" in out[0].advice
    assert out[1].severity == "info" and out[1].evidence["mem_frac"] < 0.3


def test_launch_bound_needs_gpu_metrics():
    out = diagnose({"time/data_wait_frac": 0.01, "time/step_ms": 14.0}, cfg(batch_size=4, gpu_monitor=False))
    assert kinds(out) == ["gpu-metrics-missing"]
    assert "GPUStatsMonitor()" in out[0].advice


def test_low_sm_activity_alone_is_launch_bound():
    assert "launch-bound" in kinds(diagnose(ev(**{"gpu/sm_active": 12.0}), cfg()))
    # without GPM, a busy GPU on a big batch is not
    busy_no_gpm = {k: v for k, v in BUSY_GPU.items() if k != "gpu/sm_active"}
    assert diagnose(busy_no_gpm, cfg()) == []


def test_fp32_on_tensor_cores():
    out = diagnose(ev(), cfg(precision="32-true", float32_matmul_precision="highest"))
    assert kinds(out) == ["fp32-on-tensor-cores"]
    v = out[0]
    assert v.evidence["capability"] == "9.0" and v.evidence["precision"] == "32-true"
    assert (
        '"16-mixed"' in v.advice and "bf16-mixed" in v.advice and "set_float32_matmul_precision" in v.advice
    )
    # pre-Volta GPUs have no tensor cores; CPU runs are out of scope
    assert diagnose(ev(), cfg(precision="32-true", capability=(6, 1))) == []
    assert diagnose(ev(), cfg(precision="32-true", device_type="cpu")) == []


def test_compute_verdicts_are_info_when_input_bound():
    out = diagnose(
        ev(**{"time/data_wait_frac": 0.5, "time/data_wait_ms": 40.0, "gpu/util": 40.0}),
        cfg(precision="32-true", num_workers=1),
    )
    sev = {v.kind: v.severity for v in out}
    assert sev["input-bound"] == "warning" and sev["fp32-on-tensor-cores"] == "info"


def test_nchw_convolutions():
    out = diagnose(ev(), cfg(conv_channels_last=0, input_channels_last=False))
    assert kinds(out) == ["nchw-convolutions"]
    assert out[0].evidence["conv_channels_last_frac"] == 0.0
    assert "ChannelsLast()" in out[0].advice
    # fp32 without TF32 on a pre-Ampere GPU: NHWC buys little, so no verdict about it
    assert "nchw-convolutions" not in kinds(
        diagnose(ev(), cfg(conv_channels_last=0, precision="32-true", capability=(7, 0)))
    )
    # fp32 on Ampere+ convolutions use TF32 tensor cores by default
    assert "nchw-convolutions" in kinds(diagnose(ev(), cfg(conv_channels_last=0, precision="32-true")))
    # a model without convolutions
    assert diagnose(ev(), cfg(conv_layers=0, conv_channels_last=0)) == []


def test_cudnn_benchmark_off():
    out = diagnose(ev(), cfg(cudnn_benchmark=False))
    assert kinds(out) == ["cudnn-benchmark-off"] and out[0].severity == "info"
    assert "benchmark=True" in out[0].advice
    assert diagnose(ev(), cfg(cudnn_benchmark=False, cudnn_deterministic=True)) == []


def test_memory_headroom_only_when_gpu_not_saturated():
    # little memory but a saturated GPU: a bigger batch would not help, stay quiet
    assert diagnose(ev(), cfg(mem_peak_gb=10.0)) == []
    out = diagnose(ev(**{"gpu/util": 80.0, "gpu/sm_active": 40.0}), cfg(mem_peak_gb=10.0, batch_size=32))
    assert kinds(out) == ["memory-headroom"]
    assert out[0].evidence["mem_frac"] == pytest.approx(10 / 140, abs=1e-3)
    assert "batch_size=32 could grow about 8x" in out[0].advice
    # falls back to NVML memory figures when the allocator's are unknown
    out = diagnose(
        ev(**{"gpu/util": 80.0, "gpu/mem_used_gb": 20.0}), cfg(mem_peak_gb=None, mem_total_gb=None)
    )
    assert out[0].evidence["mem_used_gb"] == 20.0


def test_gpu_metrics_missing_with_monitor_present():
    out = diagnose({"time/data_wait_frac": 0.0}, cfg(gpu_monitor=True))
    assert kinds(out) == ["gpu-metrics-missing"]
    assert "logged no GPU figure" in out[0].advice


def test_warnings_sorted_first_and_every_kind_is_known():
    out = diagnose(
        ev(**{"gpu/util": 50.0}),
        cfg(
            precision="32-true",
            conv_channels_last=0,
            cudnn_benchmark=False,
            pin_memory=False,
            mem_peak_gb=5.0,
        ),
    )
    assert set(kinds(out)) <= set(KINDS)
    sev = [v.severity for v in out]
    assert sev == sorted(sev, key=lambda s: s != "warning")
    assert kinds(out)[:4] == ["pageable-copies", "launch-bound", "fp32-on-tensor-cores", "nchw-convolutions"]


def test_diagnose_accepts_dataclasses_and_rejects_unknown_config_keys():
    out = diagnose(Evidence(data_wait_frac=0.5, data_wait_ms=9.0), RunConfig(cpus=2, num_workers=0))
    assert kinds(out) == ["input-bound"]
    with pytest.raises(TypeError, match="num_worker"):
        diagnose({}, {"num_worker": 2})


def test_thresholds_are_used():
    strict = AdvisorThresholds(input_wait_frac=0.05)
    wait = {"time/data_wait_frac": 0.07, "time/data_wait_ms": 5.0}
    config = {"cpus": 2, "num_workers": 0}
    assert diagnose(wait, config) == []
    assert kinds(diagnose(wait, config, strict)) == ["input-bound"]


def test_amp_host_sync_unfused_optimizer_under_a_grad_scaler():
    out = diagnose(ev(), cfg(unfused_optimizers=("SGD",)))
    assert kinds(out) == ["amp-host-sync"]
    v = out[0]
    # a busy GPU and no data wait: the sync costs little here, so it is an opportunity
    assert v.severity == "info"
    assert v.evidence == {
        "precision": "16-mixed",
        "optimizers": "SGD",
        "step_ms": 45.0,
        "data_wait_frac": 0.011,
        "gpu_util": 99.0,
        "sm_active": 75.0,
    }
    assert "found_inf" in v.advice and "fused=True" in v.advice
    assert "torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9, fused=True)" in v.advice
    assert "init_momentum_buffers(optimizer)" in v.advice  # fused SGD's uninitialized first momentum
    assert "bf16-mixed" not in v.advice
    # the example follows the user's optimizer class
    adamw = diagnose(ev(), cfg(unfused_optimizers=("AdamW",)))[0]
    assert "torch.optim.AdamW(self.parameters(), lr=lr, fused=True)" in adamw.advice


def test_amp_host_sync_severity():
    unfused = cfg(unfused_optimizers=("SGD",))

    def severity(metrics, thresholds=None):
        return {v.kind: v.severity for v in diagnose(metrics, unfused, thresholds)}["amp-host-sync"]

    # GPU not busy: the host's work between steps leaves it idle
    assert severity(ev(**{"gpu/util": 85.0})) == "warning"
    # a GPU-Util in the nineties still hides the idle the sync causes
    assert severity(ev(**{"gpu/util": 92.4})) == "warning"
    assert severity(ev(**{"gpu/util": 97.0})) == "info"
    assert severity(ev(**{"gpu/util": 92.4}), AdvisorThresholds(host_sync_busy_util=90.0)) == "info"
    # GPU busy, but there is a data wait for the sync to expose
    assert severity(ev(**{"time/data_wait_frac": 0.02})) == "warning"
    assert severity(ev(**{"time/data_wait_frac": 0.019})) == "info"
    assert severity(ev(**{"time/data_wait_frac": 0.019}), AdvisorThresholds(host_sync_wait_frac=0.01)) == (
        "warning"
    )
    # nothing measured: the configuration alone is an opportunity, not a measured loss
    assert severity({}) == "info"
    # a launch-bound window is also an amp-host-sync warning, ordered after launch-bound
    out = diagnose(ev(**{"gpu/util": 60.0}), cfg(unfused_optimizers=("SGD",), mem_peak_gb=100.0))
    assert [(v.kind, v.severity) for v in out] == [("launch-bound", "warning"), ("amp-host-sync", "warning")]


def test_amp_host_sync_silent_without_the_sync():
    unfused = ("SGD",)
    # fused optimizers (the healthy default) and runs without a GradScaler: bf16-mixed, 32-true, 16-true
    assert diagnose(ev(), cfg(unfused_optimizers=())) == []
    assert diagnose(ev(), cfg(precision="bf16-mixed", grad_scaler=False, unfused_optimizers=unfused)) == []
    assert "amp-host-sync" not in kinds(
        diagnose(ev(), cfg(precision="32-true", grad_scaler=False, unfused_optimizers=unfused))
    )
    # unknown configuration: the rule stays silent
    assert diagnose(ev(), cfg(grad_scaler=None, unfused_optimizers=unfused)) == []
    assert diagnose(ev(), cfg(unfused_optimizers=None)) == []
    # on the CPU .item() does not wait for a device
    assert diagnose(ev(), cfg(device_type="cpu", unfused_optimizers=unfused)) == []


def test_amp_host_sync_with_gradient_clipping_advises_bf16():
    v = diagnose(ev(), cfg(unfused_optimizers=("SGD",), gradient_clip_val=1.0))[0]
    assert v.kind == "amp-host-sync" and v.evidence["gradient_clip_val"] == 1.0
    assert "gradient_clip_val=1" in v.advice and "RuntimeError" in v.advice
    assert 'precision="bf16-mixed"' in v.advice and "capability 9.0" in v.advice
    assert "torch.optim.SGD(self.parameters()" not in v.advice  # Lightning would refuse that with clipping
    assert "drop gradient_clip_val and add FusedOptimizer()" in v.advice  # which zeroes SGD's first momentum
    # before Ampere bf16 is no way out
    old = diagnose(ev(), cfg(unfused_optimizers=("SGD",), gradient_clip_val=1.0, capability=(7, 5)))[0]
    assert "not fast on compute capability 7.5" in old.advice and "Use Trainer(" not in old.advice
    # gradient_clip_val=0 means no clipping (Lightning skips it)
    off = diagnose(ev(), cfg(unfused_optimizers=("SGD",), gradient_clip_val=0.0))[0]
    assert "gradient_clip_val" not in off.evidence and "fused=True, e.g." not in off.advice
    assert "momentum=0.9, fused=True)" in off.advice


def test_amp_host_sync_optimizer_without_a_fused_step():
    v = diagnose(ev(), cfg(unfused_optimizers=("RMSprop",)))[0]
    assert v.evidence["optimizers"] == "RMSprop"
    assert "RMSprop has no fused step" in v.advice and "SGD, Adam, AdamW, Adagrad" in v.advice
    both = diagnose(ev(), cfg(unfused_optimizers=("Adam", "RMSprop")))[0]
    assert both.evidence["optimizers"] == "Adam,RMSprop"
    assert "torch.optim.Adam(" in both.advice and "RMSprop has no fused step" in both.advice


def test_run_config_dict_round_trip_keeps_tuples():
    c = RunConfig.from_dict(cfg(unfused_optimizers=("SGD", "Adam"), gradient_clip_val=0.5))
    again = RunConfig.from_dict(json.loads(json.dumps(c.to_dict())))
    assert again == c and again.unfused_optimizers == ("SGD", "Adam") and again.capability == (9, 0)


def test_verdict_round_trip():
    v = diagnose(ev(), cfg(pin_memory=False))[0]
    assert Verdict.from_dict(v.to_dict()) == v
    assert v.label == "pageable-copies"


# ---------------------------------------------------------------------------------------------------------------
# hysteresis
# ---------------------------------------------------------------------------------------------------------------


def _v(kind, x=0.0):
    return Verdict(kind, {"x": x}, "advice")


def test_hysteresis_raises_after_k_and_clears_after_n():
    h = Hysteresis(raise_after=2, clear_after=3)
    assert not h.update([_v("input-bound")]) and h.verdicts == []
    assert h.update([_v("input-bound", 1.0)]) and kinds(h.verdicts) == ["input-bound"]
    assert h.verdicts[0].evidence["x"] == 1.0
    assert not h.update([]) and not h.update([])
    assert kinds(h.verdicts) == ["input-bound"]
    assert h.update([]) and h.verdicts == []


def test_hysteresis_does_not_flap_on_alternating_windows():
    h = Hysteresis(raise_after=2, clear_after=2)
    changes = [h.update([_v("launch-bound")] if i % 2 == 0 else []) for i in range(12)]
    assert not any(changes) and h.verdicts == []
    # once raised, a single missing window does not clear it
    h.update([_v("launch-bound")])
    h.update([_v("launch-bound")])
    flips = [h.update([] if i % 2 == 0 else [_v("launch-bound")]) for i in range(12)]
    assert not any(flips) and kinds(h.verdicts) == ["launch-bound"]


def test_hysteresis_state_round_trip():
    h = Hysteresis(2, 2)
    for _ in range(3):
        h.update([_v("nchw-convolutions", 0.25)])
    h2 = Hysteresis(2, 2)
    h2.load_state_dict(pickle.loads(pickle.dumps(h.state_dict())))
    assert h2.verdicts == h.verdicts and h2.windows == 3
    h2.update([])
    assert kinds(h2.verdicts) == ["nchw-convolutions"]


# ---------------------------------------------------------------------------------------------------------------
# starvation measured on the GPU (gpu/idle_frac) and the host split of the wait
# ---------------------------------------------------------------------------------------------------------------


def test_gpu_idle_decides_input_bound_even_when_gpu_util_reads_busy():
    # GPU-Util counts a sample busy while any kernel runs: 99% does not mean the stream never waited
    window = ev(**{"gpu/idle_frac": 0.35, "time/loader_wait_frac": 0.3, "time/data_wait_frac": 0.32})
    out = diagnose(window, cfg(num_workers=2))
    assert [(v.kind, v.cause) for v in out] == [("input-bound", "too-few-workers")]
    assert out[0].evidence["gpu_idle_frac"] == 0.35 and out[0].evidence["loader_wait_frac"] == 0.3
    assert out[0].advice.startswith("The GPU sits idle 35% of the time between steps")


def test_gpu_idle_small_is_not_input_bound_however_long_the_host_waits():
    # the host waited behind the GPU's queue (data_wait), but the GPU itself never starved
    window = ev(
        **{"gpu/idle_frac": 0.02, "time/data_wait_frac": 0.4, "time/data_wait_ms": 20.0, "gpu/util": 60.0}
    )
    out = diagnose(window, cfg(num_workers=0, mem_peak_gb=100.0))
    assert "input-bound" not in kinds(out) and "host-bound" not in kinds(out)


def test_idle_gpu_with_a_quick_loader_is_host_bound():
    window = ev(**{"gpu/idle_frac": 0.3, "time/loader_wait_frac": 0.02, "time/data_wait_frac": 0.03,
                   "gpu/util": 65.0, "host/cpu_main_pct": 99.0})  # fmt: skip
    out = diagnose(window, cfg(mem_peak_gb=100.0))
    assert kinds(out) == ["host-bound"]  # not input-bound, and launch-bound is the same finding
    v = out[0]
    assert v.evidence["gpu_idle_frac"] == 0.3 and v.evidence["loader_wait_frac"] == 0.02
    assert v.evidence["cpu_main_pct"] == 99.0
    assert "not the data" in v.advice and ".item()" in v.advice and "keeps a core busy" in v.advice
    assert "grow the batch" not in v.advice
    # a small batch: growing it is part of the advice; an unfused optimizer's sync is named
    small = diagnose(window, cfg(batch_size=8, unfused_optimizers=("SGD",), mem_peak_gb=100.0))
    host = next(v for v in small if v.kind == "host-bound")
    assert "grow the batch (batch_size=8)" in host.advice and "amp-host-sync" in host.advice
    assert "amp-host-sync" in kinds(small)


def test_loader_share_of_the_idle_splits_input_from_host():
    idle = {"gpu/idle_frac": 0.2}
    assert kinds(diagnose(ev(**idle, **{"time/loader_wait_frac": 0.1}), cfg())) == ["input-bound"]
    assert kinds(diagnose(ev(**idle, **{"time/loader_wait_frac": 0.09}), cfg())) == ["host-bound"]
    # without the loader's own figure the whole data wait stands in for it
    assert kinds(diagnose(ev(**idle, **{"time/data_wait_frac": 0.15}), cfg())) == ["input-bound"]
    half = AdvisorThresholds(loader_share=0.8)
    assert kinds(diagnose(ev(**idle, **{"time/loader_wait_frac": 0.15}), cfg(), half)) == ["host-bound"]


def test_without_gpu_idle_the_loader_wait_is_preferred_to_the_data_wait():
    # the host waited 30% between steps but only 1% inside the loader: it was blocked behind the GPU
    window = {"time/data_wait_frac": 0.3, "time/data_wait_ms": 20.0, "time/loader_wait_frac": 0.01}
    assert diagnose(window, {"device_type": "cpu", "cpus": 2, "num_workers": 0}) == []
    window["time/loader_wait_frac"] = 0.25
    assert kinds(diagnose(window, {"device_type": "cpu", "cpus": 2, "num_workers": 0})) == ["input-bound"]


@pytest.mark.parametrize(
    ("busy", "phrase"), [(0.97, "are full (97% of 16 cores busy"), (0.55, "are not full (55%")]
)
def test_decode_bound_shows_whether_the_cores_are_full(busy, phrase):
    window = ev(**{"gpu/idle_frac": 0.4, "time/loader_wait_frac": 0.38, "host/cpu_busy_frac": busy,
                   "host/cpu_workers_pct": 1400.0, "host/cpu_main_pct": 60.0, "host/cpu_cores": 16.0})  # fmt: skip
    v = diagnose(window, cfg(num_workers=14, backend="folder"))[0]
    assert (v.kind, v.cause) == ("input-bound", "decode-bound")
    assert v.evidence["cpu_busy_frac"] == busy and v.evidence["cpu_workers_pct"] == 1400.0
    assert v.evidence["cpu_cores"] == 16.0
    assert (
        f"The CPU cores {phrase}" in v.advice
        and "worker processes and other threads use 14.0 cores)" in v.advice
    )
    assert ("more workers can use them" in v.advice) == (busy < 0.9)
    assert "--format auto" in v.advice


def test_without_workers_the_cpu_evidence_points_at_the_training_process():
    window = ev(**{"gpu/idle_frac": 0.9, "time/data_wait_frac": 0.9, "host/cpu_busy_frac": 0.92,
                   "host/cpu_workers_pct": 1370.0, "host/cpu_main_pct": 97.0, "host/cpu_cores": 16.0})  # fmt: skip
    v = diagnose(window, cfg(num_workers=0, backend="folder"))[0]
    assert v.cause == "too-few-workers"
    assert "The training process builds every batch itself (its main thread at 97% of a core)" in v.advice
    assert "cores are full" not in v.advice


def test_amp_host_sync_severity_with_the_gpu_idle_share():
    unfused = cfg(unfused_optimizers=("SGD",))

    def severity(idle, util=99.0):
        out = diagnose(ev(**{"gpu/idle_frac": idle, "gpu/util": util}), unfused)
        return {v.kind: v.severity for v in out}["amp-host-sync"]

    assert severity(0.05) == "warning" and severity(0.01) == "info"
    # the sync idles the GPU inside the step, which the idle share between steps does not count: little idle
    # between steps but a GPU-Util short of saturation is the unfused optimizer's signature
    assert severity(0.016, util=92.3) == "warning"


def test_gpu_idle_alone_counts_as_a_gpu_measurement():
    window = {"gpu/idle_frac": 0.01, "time/data_wait_frac": 0.01, "time/step_ms": 40.0}
    assert "gpu-metrics-missing" not in kinds(diagnose(window, cfg()))


# ---------------------------------------------------------------------------------------------------------------
# DDP: every rank's all-reduce wait
# ---------------------------------------------------------------------------------------------------------------


def _ranks(waits, data=(1.0, 1.0), step=(60.0, 60.0)):
    return {**BUSY_GPU, "ranks": {"step_ms": step, "data_wait_ms": data, "allreduce_wait_ms": waits}}


def test_straggler_names_the_rank_the_others_wait_for():
    out = diagnose(_ranks((42.0, 1.5)), cfg())
    assert [(v.kind, v.cause) for v in out] == [("straggler", "compute")]
    v = out[0]
    assert v.evidence["straggler_rank"] == 1 and v.evidence["late_ms"] == 40.5
    assert v.evidence["allreduce_wait_ms_per_rank"] == "42.0,1.5" and v.evidence["world_size"] == 2
    assert v.advice.startswith("Rank 1 is late") and "nvidia-smi" in v.advice
    # its loader makes it late: it waited for data while the others waited for it
    loader = diagnose(_ranks((1.0, 40.0, 41.0), data=(38.0, 1.0, 1.0), step=(60.0,) * 3), cfg())
    assert [(v.kind, v.cause) for v in loader] == [("straggler", "loader")]
    assert loader[0].evidence["straggler_rank"] == 0 and "its loader is slower" in loader[0].advice


def test_every_rank_waiting_is_comm_bound():
    out = diagnose(_ranks((14.0, 12.0)), cfg())
    assert kinds(out) == ["comm-bound"]
    assert out[0].evidence["least_allreduce_wait_ms"] == 12.0 and out[0].evidence["wait_frac"] == 0.2
    assert "fp16_compress_hook" in out[0].advice and "accumulate_grad_batches" in out[0].advice
    # with a straggler the straggler is the finding, even where its own wait is long too
    assert kinds(diagnose(_ranks((60.0, 12.0), step=(90.0, 90.0)), cfg())) == ["straggler"]


def test_balanced_ranks_and_unmeasured_waits_stay_silent():
    assert diagnose(_ranks((0.6, 0.9)), cfg()) == []
    assert diagnose(_ranks((3.0, 0.5), step=(60.0, 60.0)), cfg()) == []  # 2.5 ms < 10% of the step
    assert diagnose(_ranks((40.0, None)), cfg()) == []
    assert diagnose(_ranks((40.0,), data=(1.0,), step=(60.0,)), cfg()) == []  # one rank: nothing to compare


def test_rank_evidence_round_trips_through_evidence():
    e = Evidence.from_metrics(_ranks((42.0, 1.5)))
    assert isinstance(e.ranks, RankEvidence) and e.ranks.world_size == 2
    again = Evidence.from_metrics({**BUSY_GPU, "ranks": json.loads(json.dumps(e.to_dict()["ranks"]))})
    assert again.ranks == e.ranks
    rows = RankEvidence.from_rows([[50.0, 1.0, float("nan")], [51.0, 2.0, 3.0]])
    assert rows.allreduce_wait_ms == (None, 3.0) and rows.step_ms == (50.0, 51.0)


def test_every_kind_has_one_rule():
    from lightning_gpuopt.observe.advisor.rules import RULES

    assert [r.__name__.replace("_", "-") for r in RULES] == list(KINDS)


def test_cpu_input_bound_headlines_the_logged_wait_and_names_no_gpu():
    config = {"device_type": "cpu", "cpus": 2, "num_workers": 0}
    metrics = {"time/data_wait_frac": 0.71, "time/data_wait_ms": 20.0, "time/loader_wait_frac": 0.13}
    (v,) = diagnose(metrics, config)
    head = v.advice.split(". ")[0]
    assert "71%" in head and "13% inside the loader" in head and "host figures" in head
    assert "GPU" not in head


# a window and a configuration that raise each kind of NEEDS on a CUDA run of two processes under 16-mixed
_IDLE = {"gpu/idle_frac": 0.3, "time/loader_wait_frac": 0.02, "time/data_wait_frac": 0.03, "gpu/util": 65.0}
_RAISES: dict[str, tuple[dict, dict]] = {
    "host-bound": (ev(**_IDLE), cfg(mem_peak_gb=100.0)),
    "straggler": (_ranks((42.0, 1.5)), cfg()),
    "comm-bound": (_ranks((14.0, 12.0)), cfg()),
    "pageable-copies": (ev(), cfg(pin_memory=False)),
    "launch-bound": (ev(**{"gpu/sm_active": 12.0}), cfg()),
    "amp-host-sync": (ev(), cfg(unfused_optimizers=("SGD",))),
    "fp16-overflow": (ev(grad_scale_start=65536.0, grad_scale=1024.0, grad_scale_window_falls=4.0), cfg()),
    "fp32-on-tensor-cores": (ev(), cfg(precision="32-true")),
    "nchw-convolutions": (ev(), cfg(conv_channels_last=0)),
    "cudnn-benchmark-off": (ev(), cfg(cudnn_benchmark=False)),
    "memory-headroom": (ev(**{"gpu/util": 80.0, "gpu/sm_active": 40.0}), cfg(mem_peak_gb=10.0)),
    "gpu-metrics-missing": ({"time/data_wait_frac": 0.0}, cfg()),
}
#: the configuration of a run without a need (a run of one process gathers no per-rank figures instead)
_WITHOUT = {"cuda": {"device_type": "cpu"}, "scaler": {"grad_scaler": False}}


@pytest.mark.parametrize("kind", sorted(_RAISES))
def test_needs_names_what_each_rule_cannot_raise_its_kind_without(kind):
    """``BottleneckAdvisor`` logs ``advisor/<kind>`` only where the run has what ``NEEDS`` lists: each listed
    need taken away (a CPU device, one process's evidence, no GradScaler) silences the rule."""
    from lightning_gpuopt.observe.advisor.rules import NEEDS

    window, config = _RAISES[kind]
    assert kind in kinds(diagnose(window, config))
    for need in NEEDS[kind]:
        if need == "ranks":
            without = diagnose({k: v for k, v in window.items() if k != "ranks"}, config)
        else:
            without = diagnose(window, {**config, **_WITHOUT[need]})
        assert kind not in kinds(without), need


def test_only_input_bound_can_be_raised_on_any_run():
    from lightning_gpuopt.observe.advisor.rules import NEEDS, unmet_needs

    assert set(KINDS) - set(_RAISES) == {"input-bound"} and NEEDS["input-bound"] == ()
    cpu = unmet_needs(cuda=False, world_size=1, grad_scaler=False)
    assert set(KINDS) - set(cpu) == {"input-bound"}
    assert cpu["amp-host-sync"] == "a CUDA device and a GradScaler (16-mixed)"
    assert set(unmet_needs(cuda=True, world_size=1, grad_scaler=True)) == {"straggler", "comm-bound"}


def test_a_saturated_jpeg_engine_is_named_with_its_remedy():
    # DALI decoding on the GPU: the engine's load, not a guess at CPU threads, names what limits the loader
    wait = {"time/data_wait_frac": 0.3, "time/data_wait_ms": 14.0, "gpu/util": 70.0, "gpu/jpeg_util": 98.0}
    config = cfg(backend="dali", decoder="gpu", decode_threads=8, pin_memory=None, cpus=16)
    out = diagnose(ev(**wait), config)
    assert [(v.kind, v.cause) for v in out] == [("input-bound", "jpeg-engine")]
    v = out[0]
    assert "The GPU's JPEG decoder is busy 98% of the time" in v.advice
    assert "--format jpeg" in v.advice and "--format raw" in v.advice
    assert v.evidence["jpeg_util"] == 98.0 and v.evidence["decoder"] == "gpu"
    # an engine with room: the loader's settings are judged as before
    calm = diagnose(ev(**{**wait, "gpu/jpeg_util": 40.0}), config)
    assert [(v.kind, v.cause) for v in calm] == [("input-bound", "dali-bound")]
    strict = AdvisorThresholds(jpeg_busy_util=30.0)
    assert diagnose(ev(**{**wait, "gpu/jpeg_util": 40.0}), config, strict)[0].cause == "jpeg-engine"
    with pytest.raises(ValueError, match="jpeg_busy_util"):
        AdvisorThresholds(jpeg_busy_util=120.0)


def test_skipped_cuda_graphs_are_named_in_launch_and_host_bound_advice():
    skipped = "mutated inputs (1 instances) at model.py:12"
    launch = diagnose(
        ev(**{"gpu/util": 62.0, "gpu/sm_active": 9.0}), cfg(batch_size=4, cuda_graphs_skipped=skipped)
    )
    v = next(v for v in launch if v.kind == "launch-bound")
    assert (
        f"CUDA graphs were skipped: {skipped}." in v.advice and v.evidence["cuda_graphs_skipped"] == skipped
    )
    assert 'mode="reduce-overhead" replays' not in v.advice  # it did not: no advice to turn it on
    window = ev(**{"gpu/idle_frac": 0.3, "time/loader_wait_frac": 0.02, "time/data_wait_frac": 0.03,
                   "gpu/util": 65.0})  # fmt: skip
    host = diagnose(window, cfg(mem_peak_gb=100.0, cuda_graphs_skipped=skipped))[0]
    assert host.kind == "host-bound" and f"CUDA graphs were skipped: {skipped}." in host.advice
    # graphs that replay (or none asked for): the usual hint
    plain = diagnose(window, cfg(mem_peak_gb=100.0))[0]
    assert "CUDA graphs were skipped" not in plain.advice and 'mode="reduce-overhead"' in plain.advice


@pytest.mark.parametrize(
    ("backend", "words"),
    [
        ("folder", "one worker process a CPU: chosen, not measured"),
        ("hdf5", "one worker process a CPU: chosen, not measured"),  # a JPEG store's worker processes
        (None, "for a dataset of yours it measures the loader"),
    ],
)
def test_auto_workers_advice_says_whether_it_measures(backend, words):
    """``num_workers="auto"`` measures a dataset of the user's only; for an image folder or a store the
    advice says the count is chosen, not measured."""
    wait = {"time/data_wait_frac": 0.6, "time/data_wait_ms": 60.0, "gpu/util": 40.0}
    for workers in (2, 40):  # too few, too many
        (v,) = diagnose(ev(**wait), cfg(num_workers=workers, backend=backend))
        assert v.cause in ("too-few-workers", "too-many-workers", "decode-bound")
        if v.cause != "decode-bound":
            assert words in v.advice, v.advice
