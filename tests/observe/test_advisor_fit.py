"""BottleneckAdvisor: pure rules, hysteresis, and CPU scenario runs through Lightning."""

from __future__ import annotations

import json
import pickle
import time
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_gpuopt.models import ImageClassifier
from lightning_gpuopt.observe.advisor import (
    KINDS,
    AdvisorThresholds,
    BottleneckAdvisor,
    Evidence,
    Hysteresis,
    RunConfig,
    Verdict,
    amp_facts,
    collect_config,
    conv_memory_formats,
    diagnose,
)
from tests._lightning import quiet_trainer

H200 = {
    "device_type": "cuda",
    "gpu_name": "NVIDIA H200",
    "capability": (9, 0),
    "cpus": 16,
    "processes_per_node": 1,
    "num_workers": 12,
    "pin_memory": True,
    "host_batches": True,
    "batch_size": 256,
    "backend": "hdf5",
    "precision": "16-mixed",
    "conv_layers": 36,
    "conv_channels_last": 36,
    "input_channels_last": True,
    "cudnn_benchmark": True,
    "cudnn_deterministic": False,
    "cudnn_allow_tf32": True,
    "float32_matmul_precision": "high",
    "mem_peak_gb": 60.0,
    "mem_total_gb": 140.0,
    "gpu_monitor": True,
    "grad_scaler": True,  # 16-mixed: Lightning's MixedPrecision plugin holds an enabled GradScaler
    "unfused_optimizers": (),  # fused SGD: the GradScaler's inf check stays on the device
    "gradient_clip_val": None,
}
BUSY_GPU = {
    "time/step_ms": 45.0,
    "time/data_wait_ms": 0.5,
    "time/data_wait_frac": 0.011,
    "throughput/samples_per_sec": 5700.0,
    "gpu/util": 99.0,
    "gpu/sm_active": 75.0,
    "gpu/mem_used_gb": 62.0,
    "gpu/mem_total_gb": 143.0,
}


def kinds(verdicts):
    return [v.kind for v in verdicts]


def cfg(**over):
    return {**H200, **over}


def ev(**over):
    return {**BUSY_GPU, **over}


# ---------------------------------------------------------------------------------------------------------------
# pure rules
# ---------------------------------------------------------------------------------------------------------------


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


def test_input_bound_decode_bound_on_jpeg_folder_with_many_workers():
    out = diagnose(
        ev(**{"time/data_wait_frac": 0.45, "time/data_wait_ms": 40.0, "gpu/util": 55.0}),
        cfg(num_workers=16, backend="folder"),
    )
    assert out[0].cause == "decode-bound"
    assert 'backend="hdf5"' in out[0].advice and 'backend="dali"' in out[0].advice


@pytest.mark.parametrize(
    ("decoder", "remedy"),
    [("cpu", '{"decoder": "gpu"}'), ("gpu", '{"decoder": "cpu"}'), (None, "hw_decoder_load")],
)
def test_input_bound_dali_names_the_other_decoder(decoder, remedy):
    wait = {"time/data_wait_frac": 0.3, "time/data_wait_ms": 14.0, "gpu/util": 70.0}
    out = diagnose(ev(**wait), cfg(backend="dali", dali_decoder=decoder, dali_threads=14, pin_memory=None))
    assert [(v.kind, v.cause) for v in out] == [("input-bound", "dali-bound")]
    assert remedy in out[0].advice and 'backend="hdf5"' in out[0].advice
    assert out[0].evidence.get("dali_decoder") == decoder and out[0].evidence["dali_threads"] == 14


def test_loader_facts_read_a_dali_loaders_decoder_and_threads(jpeg_folder):
    from types import SimpleNamespace

    from lightning_gpuopt.data.dali import DALILoader
    from lightning_gpuopt.data.folder import scan_image_folder
    from lightning_gpuopt.observe.advisor import _loader_facts

    _, samples = scan_image_folder(jpeg_folder)
    files, labels = [p for p, _ in samples], [y for _, y in samples]
    loader = DALILoader(files, labels, batch_size=4, image_size=16, train=True, decoder="cpu", num_threads=6)
    facts = _loader_facts(SimpleNamespace(train_dataloader=loader, datamodule=None))  # no DALI import needed
    assert facts == {"backend": "dali", "host_batches": False, "dali_decoder": "cpu", "dali_threads": 6}
    loader = DALILoader(files, labels, batch_size=4, image_size=16, train=True)
    assert _loader_facts(SimpleNamespace(train_dataloader=loader, datamodule=None))["dali_decoder"] == "gpu"


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
    assert "logged no GPU-Util" in out[0].advice


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
    assert "pipeline_diag_h200.json" in v.advice and "0.762" in v.advice and "0.973" in v.advice
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
    # the H200 scenario: 92.4% GPU-Util while 9% slower than the fused run (advisor_h200.json)
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
    assert "pipeline_diag_h200.json" in v.advice
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
# Lightning runs on the CPU
# ---------------------------------------------------------------------------------------------------------------


class SleepyImages(Dataset):
    """Small images whose loading takes ``delay_s`` each: a slow loader."""

    def __init__(self, n: int = 256, delay_s: float = 0.0) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, 16, 16, generator=g)
        self.y = torch.randint(0, 4, (n,), generator=g)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.x[i], self.y[i]


def _trainer(tmp_path, callbacks, steps, logger=False):
    return Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        limit_val_batches=0,
        logger=logger,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )


class ReadyBatches(Dataset):
    """Pre-made batches (``DataLoader(batch_size=None)``): fetching costs nothing, so the run is not input-bound."""

    def __init__(self, n: int = 64, batch: int = 64, size: int = 32) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(batch, 3, size, size, generator=g)
        self.y = torch.randint(0, 4, (batch,), generator=g)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.x, self.y


def _fast_loader():
    return DataLoader(ReadyBatches(), batch_size=None)


def _model():
    return ImageClassifier(
        nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(4)), lr=0.01
    )


def test_scenario_slow_loader_without_workers_is_input_bound(tmp_path, caplog):
    advisor = BottleneckAdvisor(warmup_steps=2, window_steps=4, min_windows=2)
    loader = DataLoader(SleepyImages(delay_s=0.02), batch_size=4, num_workers=0)
    with caplog.at_level("INFO"):
        _trainer(tmp_path, [advisor], steps=14).fit(_model(), loader)
    assert advisor.windows == 3
    assert [(v.kind, v.cause) for v in advisor.verdicts] == [("input-bound", "too-few-workers")]
    ev_ = advisor.verdicts[0].evidence
    assert ev_["data_wait_frac"] >= 0.1 and ev_["num_workers"] == 0
    assert ev_["data_wait_ms"] >= 4 * 20.0 * 0.9
    assert "BottleneckAdvisor after 3 window(s)" in caplog.text and "too-few-workers" in caplog.text


def test_scenario_healthy_cpu_run_no_false_alarm(tmp_path):
    advisor = BottleneckAdvisor(warmup_steps=2, window_steps=4, min_windows=2)
    _trainer(tmp_path, [advisor], steps=18).fit(_model(), _fast_loader())
    assert advisor.windows == 4
    assert advisor.verdicts == [], advisor.history
    assert "no bottleneck found" in advisor.summary()


def test_collect_config_reads_the_run(tmp_path):
    seen = {}

    class Probe(BottleneckAdvisor):
        def on_train_start(self, trainer, pl_module):
            super().on_train_start(trainer, pl_module)
            seen["cfg"] = collect_config(trainer, pl_module, gpu_monitor=False)

    loader = DataLoader(SleepyImages(64), batch_size=16, num_workers=1, pin_memory=False)
    _trainer(tmp_path, [Probe(warmup_steps=1, window_steps=1)], steps=2).fit(_model(), loader)
    c = seen["cfg"]
    assert (c.device_type, c.num_workers, c.pin_memory, c.batch_size, c.host_batches) == (
        "cpu",
        1,
        False,
        16,
        True,
    )
    assert c.precision == "32-true" and c.cpus >= 1 and c.processes_per_node == 1
    assert c.conv_layers == 1 and c.conv_channels_last == 0


def _amp_fit(tmp_path, fused, scaler_enabled=True, clip=None):
    """A CPU fit through Lightning's MixedPrecision plugin holding a (CPU) GradScaler; returns the advisor."""
    from lightning.pytorch.plugins import MixedPrecision

    advisor = BottleneckAdvisor(warmup_steps=1, window_steps=2, min_windows=1, verbose=False)
    model = ImageClassifier(
        nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(4)), lr=0.01, fused=fused
    )
    scaler = torch.amp.GradScaler("cpu", enabled=scaler_enabled)
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1,
        max_steps=5,
        limit_val_batches=0,
        callbacks=[advisor],
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        gradient_clip_val=clip,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, _fast_loader())
    return advisor


def test_collect_config_reads_grad_scaler_and_optimizers(tmp_path):
    advisor = _amp_fit(tmp_path, fused=False)
    c = advisor.config
    assert (c.precision, c.grad_scaler, c.unfused_optimizers, c.gradient_clip_val) == (
        "16-mixed",
        True,
        ("SGD",),
        None,
    )
    # a CPU run: .item() waits for no device, so nothing is raised
    assert "amp-host-sync" not in {k for h in advisor.history for k in h["diagnosed"]}
    # the same configuration on a CUDA device is the verdict
    cuda = RunConfig.from_dict({**c.to_dict(), "device_type": "cuda", "capability": (9, 0)})
    assert "amp-host-sync" in kinds(diagnose(ev(), cuda))
    fused = _amp_fit(tmp_path, fused=True).config
    assert (fused.grad_scaler, fused.unfused_optimizers) == (True, ())
    fused_on_cuda = {**fused.to_dict(), "device_type": "cuda", "capability": (9, 0)}
    assert "amp-host-sync" not in kinds(diagnose(ev(), fused_on_cuda))
    disabled = _amp_fit(tmp_path, fused=False, scaler_enabled=False).config
    assert disabled.grad_scaler is False


def test_collect_config_32_true_has_no_grad_scaler(tmp_path):
    advisor = BottleneckAdvisor(warmup_steps=1, window_steps=2, min_windows=1, verbose=False)
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        limit_val_batches=0,
        callbacks=[advisor],
        gradient_clip_val=0.5,
        default_root_dir=tmp_path,
    )
    trainer.fit(_model(), _fast_loader())
    c = advisor.config
    assert (c.precision, c.grad_scaler, c.unfused_optimizers, c.gradient_clip_val) == (
        "32-true",
        False,
        ("SGD",),  # unfused on the CPU, but without a GradScaler that costs no sync
        0.5,
    )
    on_cuda = {**c.to_dict(), "device_type": "cuda", "capability": (9, 0)}
    assert "amp-host-sync" not in kinds(diagnose(ev(), on_cuda))


def test_amp_facts_reads_public_attributes_only():
    fused = SimpleNamespace(_step_supports_amp_scaling=True)
    scaler = torch.amp.GradScaler("cpu")
    trainer = SimpleNamespace(
        precision_plugin=SimpleNamespace(scaler=scaler),
        optimizers=[torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), fused],
        gradient_clip_val=1,
    )
    assert amp_facts(trainer) == {
        "grad_scaler": True,
        "unfused_optimizers": ("SGD",),
        "gradient_clip_val": 1.0,
    }
    # plugins without a scaler attribute (32-true, bf16-mixed, DeepSpeed...) have no GradScaler
    no_scaler = SimpleNamespace(precision_plugin=object(), optimizers=[fused], gradient_clip_val=0)
    assert amp_facts(no_scaler) == {"grad_scaler": False, "unfused_optimizers": (), "gradient_clip_val": None}
    # what cannot be read stays unknown
    assert amp_facts(SimpleNamespace()) == {"gradient_clip_val": None}


def test_conv_memory_formats():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 1), nn.Conv2d(8, 4, 3))
    assert conv_memory_formats(model) == (2, 0)  # the 1x1 kernel cannot tell
    model.to(memory_format=torch.channels_last)
    assert conv_memory_formats(model) == (2, 2)


class FakeMonitor(Callback):
    """Stands in for GPUStatsMonitor's public surface (``history``, ``last_window``), one window every ``every``."""

    def __init__(self, every: int = 1, util: float = 35.0):
        self.history = []
        self.last_window = {}
        self.every = every
        self.util = util

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step % self.every == 0:
            w = {
                "gpu/util": self.util,
                "gpu/sm_active": 8.0,
                "gpu/mem_used_gb": 2.0,
                "step": trainer.global_step - 1,
            }
            self.history.append(w)
            self.last_window = w


def test_gpu_evidence_is_read_from_a_monitor_history(tmp_path):
    advisor = BottleneckAdvisor(warmup_steps=2, window_steps=4, min_windows=2)
    # monitor before the advisor so its window is in the history when the advisor evaluates
    _trainer(tmp_path, [FakeMonitor(), advisor], steps=10).fit(_model(), _fast_loader())
    assert [h["step"] for h in advisor.history] == [6, 10]
    assert advisor.history[-1]["evidence"]["gpu_util"] == 35.0
    assert advisor.config.gpu_monitor is True
    # a CPU run: the GPU rules stay silent even with low GPU figures
    gpu_kinds = {"launch-bound", "memory-headroom", "gpu-metrics-missing", "nchw-convolutions"}
    assert not gpu_kinds & {k for h in advisor.history for k in h["diagnosed"]}


def test_windows_follow_the_monitor_by_default(tmp_path):
    monitor = FakeMonitor(every=3, util=20.0)
    advisor = BottleneckAdvisor(warmup_steps=2, min_windows=1, verbose=False)
    _trainer(tmp_path, [monitor, advisor], steps=12).fit(_model(), _fast_loader())
    # warm-up ends with the monitor window closing at step 3; windows 4-6, 7-9, 10-12 are judged
    assert [h["step"] for h in advisor.history] == [6, 9, 12]
    assert all(h["evidence"]["gpu_util"] == 20.0 and h["evidence"]["step_ms"] > 0 for h in advisor.history)
    assert "3 window(s) of 3 steps" in advisor.summary()
    # a second fit ignores the first fit's monitor windows
    _trainer(tmp_path, [monitor, advisor], steps=6).fit(_model(), _fast_loader())
    assert [h["step"] for h in advisor.history] == [6]


def test_logs_flags_and_tensorboard_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    advisor = BottleneckAdvisor(warmup_steps=1, window_steps=3, min_windows=1, verbose=False)
    loader = DataLoader(SleepyImages(128, delay_s=0.02), batch_size=4)
    tb = TensorBoardLogger(tmp_path, name="tb")
    csv = CSVLogger(tmp_path, name="csv")
    _trainer(tmp_path, [advisor], steps=7, logger=[tb, csv]).fit(_model(), loader)
    assert [v.kind for v in advisor.verdicts] == ["input-bound"]
    tb.experiment.flush()
    acc = EventAccumulator(tb.log_dir, size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    texts = acc.Tensors("advisor/summary/text_summary")
    assert texts and b"too-few-workers" in texts[-1].tensor_proto.string_val[0]
    assert acc.Scalars("advisor/input-bound")[-1].value == 1.0
    assert acc.Scalars("advisor/launch-bound")[-1].value == 0.0
    assert acc.Scalars("advisor/amp-host-sync")[-1].value == 0.0
    csv_text = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text()
    assert "advisor/input-bound" in csv_text and "advisor/num_warnings" in csv_text
    assert "advisor/amp-host-sync" in csv_text


def test_state_round_trip_and_second_fit(tmp_path):
    advisor = BottleneckAdvisor(warmup_steps=1, window_steps=3, min_windows=1, verbose=False)
    loader = DataLoader(SleepyImages(128, delay_s=0.02), batch_size=4)
    _trainer(tmp_path, [advisor], steps=7).fit(_model(), loader)
    state = pickle.loads(pickle.dumps(advisor.state_dict()))
    restored = BottleneckAdvisor(min_windows=1)
    restored.load_state_dict(state)
    assert restored.verdicts == advisor.verdicts and restored.windows == advisor.windows == 2
    # a raised amp-host-sync verdict survives the round trip too
    h = Hysteresis(1, 1)
    h.update(diagnose(ev(), cfg(unfused_optimizers=("SGD",), gradient_clip_val=1.0)))
    h2 = Hysteresis(1, 1)
    h2.load_state_dict(pickle.loads(pickle.dumps(h.state_dict())))
    assert kinds(h2.verdicts) == ["amp-host-sync"] and h2.verdicts == h.verdicts
    pickle.dumps(advisor)
    # a second fit starts over: its windows and history are its own (what it concludes about a tiny,
    # fast CPU loader depends on the machine's load, so that is not asserted here)
    _trainer(tmp_path, [advisor], steps=7).fit(_model(), _fast_loader())
    assert advisor.windows == 2
    assert [h["step"] for h in advisor.history] == [4, 7]


def test_short_run_says_not_enough_evidence(tmp_path):
    advisor = BottleneckAdvisor(warmup_steps=20, window_steps=20, verbose=False)
    data = SleepyImages(64)
    _trainer(tmp_path, [advisor], steps=3).fit(
        _model(), DataLoader(TensorDataset(data.x, data.y), batch_size=8)
    )
    assert advisor.windows == 0 and advisor.verdicts == []
    assert "no verdict" in advisor.summary()


@pytest.mark.parametrize(
    ("kwargs", "err"),
    [
        ({"warmup_steps": -1}, ValueError),
        ({"window_steps": 0}, ValueError),
        ({"min_windows": 0}, ValueError),
        ({"clear_windows": 1.5}, TypeError),
        ({"thresholds": {"input_wait_frac": 0.2}}, TypeError),
    ],
)
def test_argument_validation(kwargs, err):
    with pytest.raises(err, match=next(iter(kwargs))):
        BottleneckAdvisor(**kwargs)


@pytest.mark.gpu
def test_gpu_configuration_verdicts(tmp_path):
    """On CUDA: fp32 on a tensor-core GPU, pageable copies, cudnn.benchmark off, and no monitor."""
    advisor = BottleneckAdvisor(warmup_steps=2, window_steps=3, min_windows=1, verbose=False)
    data = SleepyImages()
    loader = DataLoader(TensorDataset(data.x, data.y), batch_size=32, pin_memory=False)
    trainer = quiet_trainer(
        accelerator="gpu",
        devices=1,
        precision="32-true",
        benchmark=False,
        max_steps=11,
        limit_val_batches=0,
        callbacks=[advisor],
        default_root_dir=tmp_path,
    )
    trainer.fit(_model(), loader)
    got = {v.kind for v in advisor.verdicts}
    assert {"pageable-copies", "cudnn-benchmark-off", "gpu-metrics-missing"} <= got
    if torch.cuda.get_device_capability() >= (7, 0):
        assert "fp32-on-tensor-cores" in got
    assert advisor.config.device_type == "cuda" and advisor.config.host_batches is True


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, None])
def test_gpu_amp_host_sync(tmp_path, fused):
    """On CUDA under 16-mixed: an unfused SGD is amp-host-sync, ImageClassifier's default (fused) is not."""
    advisor = BottleneckAdvisor(warmup_steps=2, window_steps=3, min_windows=1, verbose=False)
    data = SleepyImages()
    model = ImageClassifier(
        nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(4)), lr=0.01, fused=fused
    )
    trainer = quiet_trainer(
        accelerator="gpu",
        devices=1,
        precision="16-mixed",
        max_steps=11,
        limit_val_batches=0,
        callbacks=[advisor],
        default_root_dir=tmp_path,
    )
    trainer.fit(model, DataLoader(TensorDataset(data.x, data.y), batch_size=32, pin_memory=True))
    assert advisor.config.grad_scaler is True
    got = {v.kind for v in advisor.verdicts}
    if fused is False:
        assert advisor.config.unfused_optimizers == ("SGD",) and "amp-host-sync" in got
    else:
        assert advisor.config.unfused_optimizers == () and "amp-host-sync" not in got
