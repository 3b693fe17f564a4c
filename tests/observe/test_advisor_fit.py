"""BottleneckAdvisor through real Lightning fits on the CPU (and two on a GPU)."""

from __future__ import annotations

import pickle
import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt._common import FETCH_SECONDS_ATTR
from lightning_gpuopt._compat import supports_amp_scaling
from lightning_gpuopt.compute.optimizer import FusedOptimizer
from lightning_gpuopt.observe.advisor import BottleneckAdvisor, Hysteresis, RunConfig, diagnose
from lightning_gpuopt.observe.gpu_stats import GPUStatsMonitor
from tests.observe.advisor_cases import (
    ReadyBatches,
    SleepyImages,
    TinyClassifier,
    cfg,
    cpu_trainer,
    ev,
    fast_loader,
    kinds,
)


def test_slow_loader_without_workers_is_input_bound(tmp_path, caplog):
    advisor = BottleneckAdvisor(warmup_steps=2, window_steps=4, min_windows=2)
    loader = DataLoader(SleepyImages(delay_s=0.02), batch_size=4, num_workers=0)
    with caplog.at_level("INFO"):
        cpu_trainer(tmp_path, [advisor], steps=14).fit(TinyClassifier(), loader)
    assert advisor.windows == 3
    assert [(v.kind, v.cause) for v in advisor.verdicts] == [("input-bound", "too-few-workers")]
    evidence = advisor.verdicts[0].evidence
    assert evidence["data_wait_frac"] >= 0.1 and evidence["num_workers"] == 0
    assert evidence["data_wait_ms"] >= 4 * 20.0 * 0.9
    assert "BottleneckAdvisor after 3 window(s)" in caplog.text and "too-few-workers" in caplog.text


def test_healthy_cpu_run_no_false_alarm(tmp_path):
    advisor = BottleneckAdvisor(warmup_steps=2, window_steps=4, min_windows=2)
    cpu_trainer(tmp_path, [advisor], steps=18).fit(TinyClassifier(), fast_loader())
    assert advisor.windows == 4
    assert advisor.verdicts == [], advisor.history
    assert "no bottleneck found" in advisor.summary()


def test_config_is_read_from_the_run(tmp_path):
    advisor = BottleneckAdvisor(warmup_steps=1, window_steps=1, verbose=False)
    loader = DataLoader(SleepyImages(64), batch_size=16, num_workers=1, pin_memory=False)
    cpu_trainer(tmp_path, [advisor], steps=2).fit(TinyClassifier(), loader)
    c = advisor.config
    assert (c.device_type, c.num_workers, c.pin_memory, c.batch_size, c.host_batches) == (
        "cpu",
        1,
        False,
        16,
        True,
    )
    assert c.precision == "32-true" and c.cpus >= 1 and c.processes_per_node == 1 and c.world_size == 1
    assert c.conv_layers == 1 and c.conv_channels_last == 0


class _OptimizersAtTrainStart(Callback):
    """Records the optimizers' fused state when the advisor's own on_train_start runs (it is listed first)."""

    seen: tuple[str, ...] | None = None

    def on_train_start(self, trainer, pl_module):
        self.seen = tuple(type(o).__name__ for o in trainer.optimizers if not supports_amp_scaling(o))


def _amp_fit(tmp_path, callbacks, fused=False, scaler_enabled=True, clip=None):
    """A CPU fit through Lightning's MixedPrecision plugin holding a (CPU) GradScaler."""
    advisor = BottleneckAdvisor(warmup_steps=1, window_steps=2, min_windows=1, verbose=False)
    scaler = torch.amp.GradScaler("cpu", enabled=scaler_enabled)
    trainer = cpu_trainer(
        tmp_path,
        [advisor, *callbacks],
        steps=5,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        gradient_clip_val=clip,
    )
    trainer.fit(TinyClassifier(fused=fused), fast_loader())
    return advisor


def test_config_is_read_after_another_callback_fused_the_optimizer(tmp_path):
    # FusedOptimizer runs after the advisor's on_train_start: what counts is the optimizer that trains
    probe = _OptimizersAtTrainStart()
    fuser = FusedOptimizer()
    advisor = _amp_fit(tmp_path, [probe, fuser])
    assert probe.seen == ("SGD",) and fuser.fused == ["SGD"]
    c = advisor.config
    assert (c.grad_scaler, c.unfused_optimizers) == (True, ())
    on_cuda = RunConfig.from_dict({**c.to_dict(), "device_type": "cuda", "capability": (9, 0)})
    assert "amp-host-sync" not in kinds(diagnose(ev(), on_cuda))


def test_config_reads_grad_scaler_and_unfused_optimizers(tmp_path):
    advisor = _amp_fit(tmp_path, [])
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
    assert _amp_fit(tmp_path, [], fused=True).config.unfused_optimizers == ()
    assert _amp_fit(tmp_path, [], scaler_enabled=False).config.grad_scaler is False


def test_32_true_has_no_grad_scaler(tmp_path):
    advisor = BottleneckAdvisor(warmup_steps=1, window_steps=2, min_windows=1, verbose=False)
    cpu_trainer(tmp_path, [advisor], steps=3, gradient_clip_val=0.5).fit(TinyClassifier(), fast_loader())
    c = advisor.config
    assert (c.precision, c.grad_scaler, c.unfused_optimizers, c.gradient_clip_val) == (
        "32-true",
        False,
        ("SGD",),
        0.5,
    )
    on_cuda = {**c.to_dict(), "device_type": "cuda", "capability": (9, 0)}
    assert "amp-host-sync" not in kinds(diagnose(ev(), on_cuda))


class _FetchTimedLoader(DataLoader):
    """A DataLoader that keeps ``fetch_seconds`` (cumulative seconds its consumer spent inside ``next()``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        setattr(self, FETCH_SECONDS_ATTR, 0.0)

    def __iter__(self):
        import time

        it = super().__iter__()
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            setattr(self, FETCH_SECONDS_ATTR, getattr(self, FETCH_SECONDS_ATTR) + time.perf_counter() - t0)
            yield batch


def test_loader_wait_is_read_from_the_loaders_fetch_seconds(tmp_path):
    advisor = BottleneckAdvisor(warmup_steps=2, window_steps=3, min_windows=1, verbose=False)
    loader = _FetchTimedLoader(SleepyImages(128, delay_s=0.01), batch_size=2)
    cpu_trainer(tmp_path, [advisor], steps=8).fit(TinyClassifier(), loader)
    for h in advisor.history:
        e = h["evidence"]
        assert 0.5 * e["data_wait_frac"] <= e["loader_wait_frac"] <= e["data_wait_frac"] * 1.05 + 0.01
    assert kinds(advisor.verdicts) == ["input-bound"]
    # a plain DataLoader keeps no fetch_seconds: nothing is guessed
    plain = BottleneckAdvisor(warmup_steps=1, window_steps=2, min_windows=1, verbose=False)
    cpu_trainer(tmp_path, [plain], steps=3).fit(TinyClassifier(), fast_loader())
    assert plain.history[0]["evidence"]["loader_wait_frac"] is None


def test_short_epochs_get_windows_of_half_an_epoch(tmp_path):
    advisor = BottleneckAdvisor(verbose=False)  # warm-up 20, windows of 20
    trainer = cpu_trainer(tmp_path, [advisor], steps=-1, max_epochs=4)
    trainer.fit(TinyClassifier(), fast_loader(n=9))  # 9 batches an epoch
    # warm-up and windows of 4 batches: evaluated after batches 8, 12, ..., 36
    assert [h["step"] for h in advisor.history] == [8, 12, 16, 20, 24, 28, 32, 36]
    assert "8 window(s) of 4 steps" in advisor.summary()
    assert all(h["evidence"]["step_ms"] > 0 for h in advisor.history)


def test_without_a_logger_it_says_so_once_and_still_prints(tmp_path, caplog):
    advisor = BottleneckAdvisor(warmup_steps=1, window_steps=2, min_windows=1)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("INFO"):
        warnings.simplefilter("always")
        cpu_trainer(tmp_path, [advisor], steps=5).fit(TinyClassifier(), fast_loader())
        cpu_trainer(tmp_path, [advisor], steps=5).fit(TinyClassifier(), fast_loader())
    said = [w for w in caught if "BottleneckAdvisor: the Trainer has no logger" in str(w.message)]
    assert len(said) == 1 and "printed at the end of fit" in str(said[0].message)
    assert said[0].filename == __file__  # the user's fit line, not the package's
    assert caplog.text.count("BottleneckAdvisor after 2 window(s)") == 2
    # with a logger there is nothing to say
    logged = BottleneckAdvisor(warmup_steps=1, window_steps=2, verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cpu_trainer(tmp_path, [logged], steps=3, logger=CSVLogger(tmp_path)).fit(
            TinyClassifier(), fast_loader()
        )
    assert not [w for w in caught if "no logger" in str(w.message)]


class FakeMonitor(GPUStatsMonitor):
    """A ``GPUStatsMonitor`` whose windows are made up: GPU figures every ``every`` optimizer steps."""

    def __init__(self, every: int = 1, util: float = 35.0, idle: float | None = None) -> None:
        self.history: list[dict[str, float]] = []
        self.last_window: dict[str, float] = {}
        self.every, self.util, self.idle = every, util, idle

    @property
    def state_key(self) -> str:
        return "FakeMonitor"

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step % self.every == 0:
            w = {
                "gpu/util": self.util,
                "gpu/sm_active": 8.0,
                "gpu/mem_used_gb": 2.0,
                "step": trainer.global_step - 1,
            }
            if self.idle is not None:
                w["gpu/idle_frac"] = self.idle
            self.history.append(w)
            self.last_window = w


# the real monitor's other hooks stay out of the fake's way
for _name in [n for n in dir(GPUStatsMonitor) if n.startswith("on_") or n in ("setup", "teardown")]:
    if _name not in vars(FakeMonitor):
        setattr(FakeMonitor, _name, lambda self, *args, **kwargs: None)


def test_gpu_evidence_is_read_from_a_monitor_history(tmp_path):
    advisor = BottleneckAdvisor(warmup_steps=2, window_steps=4, min_windows=2)
    # monitor before the advisor so its window is in the history when the advisor evaluates
    cpu_trainer(tmp_path, [FakeMonitor(idle=0.3), advisor], steps=10).fit(TinyClassifier(), fast_loader())
    assert [h["step"] for h in advisor.history] == [6, 10]
    assert advisor.history[-1]["evidence"]["gpu_util"] == 35.0
    assert advisor.history[-1]["evidence"]["gpu_idle_frac"] == 0.3
    assert advisor.config.gpu_monitor is True
    # a CPU run: the GPU rules stay silent even with low GPU figures
    gpu_kinds = {"host-bound", "launch-bound", "memory-headroom", "gpu-metrics-missing", "nchw-convolutions"}
    assert not gpu_kinds & {k for h in advisor.history for k in h["diagnosed"]}


def test_windows_follow_the_monitor_by_default(tmp_path):
    monitor = FakeMonitor(every=3, util=20.0)
    advisor = BottleneckAdvisor(warmup_steps=2, min_windows=1, verbose=False)
    cpu_trainer(tmp_path, [monitor, advisor], steps=12).fit(TinyClassifier(), fast_loader())
    # warm-up ends with the monitor window closing at step 3; windows 4-6, 7-9, 10-12 are judged
    assert [h["step"] for h in advisor.history] == [6, 9, 12]
    assert all(h["evidence"]["gpu_util"] == 20.0 and h["evidence"]["step_ms"] > 0 for h in advisor.history)
    assert "3 window(s) of 3 steps" in advisor.summary()
    # a second fit ignores the first fit's monitor windows
    cpu_trainer(tmp_path, [monitor, advisor], steps=6).fit(TinyClassifier(), fast_loader())
    assert [h["step"] for h in advisor.history] == [6]


def test_logs_flags_and_tensorboard_text(tmp_path):
    """The flags of kinds a CPU run of one process cannot raise (host-bound, straggler, amp-host-sync, ...)
    are not logged: a constant 0 on every run of this kind would say nothing."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    advisor = BottleneckAdvisor(warmup_steps=1, window_steps=3, min_windows=1, verbose=False)
    loader = DataLoader(SleepyImages(128, delay_s=0.02), batch_size=4)
    tb = TensorBoardLogger(tmp_path, name="tb")
    csv = CSVLogger(tmp_path, name="csv")
    cpu_trainer(tmp_path, [advisor], steps=7, logger=[tb, csv]).fit(TinyClassifier(), loader)
    assert [v.kind for v in advisor.verdicts] == ["input-bound"]
    tb.experiment.flush()
    acc = EventAccumulator(tb.log_dir, size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    texts = acc.Tensors("advisor/summary/text_summary")
    assert texts and b"too-few-workers" in texts[-1].tensor_proto.string_val[0]
    assert acc.Scalars("advisor/input-bound")[-1].value == 1.0
    assert acc.Scalars("advisor/num_warnings")[-1].value == 1.0
    assert {t for t in acc.Tags()["scalars"] if t.startswith("advisor/")} == {
        "advisor/input-bound",
        "advisor/num_warnings",
    }
    csv_text = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text()
    assert "advisor/input-bound" in csv_text and "advisor/num_warnings" in csv_text
    assert "advisor/amp-host-sync" not in csv_text and "advisor/straggler" not in csv_text


class KeyRecorder(Logger):
    """A logger that keeps every row it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "keys"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append(dict(metrics))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def test_a_cpu_run_logs_what_means_something_there_and_says_once_why_the_rest_is_absent(tmp_path, caplog):
    """A CPU run of one process in fp32 can raise input-bound only: the 12 other flags, 0 by construction,
    are left out and named once; the monitor says once that the data wait there holds the batch's transfer
    work (the "GPU" augmentation runs on the training CPU), which the loader's own wait does not."""
    from lightning_gpuopt._common import _warnings
    from lightning_gpuopt.observe.timing import CPU_WAIT_NOTE

    _warnings().clear()
    recorder = KeyRecorder()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("INFO"):
        warnings.simplefilter("always")
        for _ in range(2):  # the second fit in the process says nothing again
            monitor = GPUStatsMonitor(log_every_n_steps=3)
            advisor = BottleneckAdvisor(warmup_steps=3, min_windows=1, verbose=False)
            cpu_trainer(tmp_path, [monitor, advisor], steps=9, logger=recorder).fit(
                TinyClassifier(), fast_loader()
            )
    keys = set().union(*recorder.rows)
    assert {k for k in keys if k.startswith("advisor/")} == {"advisor/input-bound", "advisor/num_warnings"}
    assert {"time/data_wait_frac", "throughput/samples_per_sec"} <= keys
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("BottleneckAdvisor: logging")]
    assert len(said) == 1, said
    assert "straggler, comm-bound (need several processes)" in said[0]
    assert "host-bound, pageable-copies, launch-bound" in said[0] and "(need a CUDA device)" in said[0]
    notes = [str(w.message) for w in caught if CPU_WAIT_NOTE in str(w.message)]
    assert len(notes) == 1 and "not CUDA, so there is no GPU to measure" in notes[0]


def test_state_round_trip_and_second_fit(tmp_path):
    advisor = BottleneckAdvisor(warmup_steps=1, window_steps=3, min_windows=1, verbose=False)
    loader = DataLoader(SleepyImages(128, delay_s=0.02), batch_size=4)
    cpu_trainer(tmp_path, [advisor], steps=7).fit(TinyClassifier(), loader)
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
    cpu_trainer(tmp_path, [advisor], steps=7).fit(TinyClassifier(), fast_loader())
    assert advisor.windows == 2
    assert [h["step"] for h in advisor.history] == [4, 7]


def test_short_run_says_not_enough_evidence(tmp_path):
    advisor = BottleneckAdvisor(warmup_steps=20, window_steps=20, verbose=False)
    data = SleepyImages(64)
    cpu_trainer(tmp_path, [advisor], steps=3).fit(
        TinyClassifier(), DataLoader(TensorDataset(data.x, data.y), batch_size=8)
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
        ({"verbose": "yes"}, TypeError),
    ],
)
def test_argument_validation(kwargs, err):
    with pytest.raises(err, match=next(iter(kwargs))):
        BottleneckAdvisor(**kwargs)


# ---------------------------------------------------------------------------------------------------------------
# on a GPU
# ---------------------------------------------------------------------------------------------------------------


def _gpu_trainer(tmp_path, callbacks, **kwargs):
    return cpu_trainer(tmp_path, callbacks, steps=11, accelerator="gpu", **kwargs)


@pytest.mark.gpu
def test_gpu_configuration_verdicts(tmp_path):
    """On CUDA: fp32 on a tensor-core GPU, pageable copies, cudnn.benchmark off, and no monitor."""
    advisor = BottleneckAdvisor(warmup_steps=2, window_steps=3, min_windows=1, verbose=False)
    data = SleepyImages()
    loader = DataLoader(TensorDataset(data.x, data.y), batch_size=32, pin_memory=False)
    _gpu_trainer(tmp_path, [advisor], precision="32-true", benchmark=False).fit(TinyClassifier(), loader)
    got = {v.kind for v in advisor.verdicts}
    assert {"pageable-copies", "cudnn-benchmark-off", "gpu-metrics-missing"} <= got
    if torch.cuda.get_device_capability() >= (7, 0):
        assert "fp32-on-tensor-cores" in got
    assert advisor.config.device_type == "cuda" and advisor.config.host_batches is True


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_amp_host_sync(tmp_path, fused):
    """On CUDA under 16-mixed: an unfused SGD is amp-host-sync, a fused one is not."""
    advisor = BottleneckAdvisor(warmup_steps=2, window_steps=3, min_windows=1, verbose=False)
    data = ReadyBatches(n=64, batch=32, size=16)
    _gpu_trainer(tmp_path, [advisor], precision="16-mixed").fit(
        TinyClassifier(fused=fused), DataLoader(data, batch_size=None, pin_memory=True)
    )
    assert advisor.config.grad_scaler is True
    got = {v.kind for v in advisor.verdicts}
    if not fused:
        assert advisor.config.unfused_optimizers == ("SGD",) and "amp-host-sync" in got
    else:
        assert advisor.config.unfused_optimizers == () and "amp-host-sync" not in got
