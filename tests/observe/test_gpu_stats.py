import csv
import pickle
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_gpuopt import GPUStatsMonitor
from lightning_gpuopt._common import _warnings
from lightning_gpuopt.observe.gpu_idle import StreamIdleMeter
from lightning_gpuopt.observe.gpu_stats import METRIC_KEYS
from lightning_gpuopt.observe.host_cpu import CPU_KEYS
from lightning_gpuopt.observe.nvml import GPM_KEYS, GPU_KEYS
from lightning_gpuopt.observe.timing import CPU_WAIT_NOTE, HOST_KEYS, LOADER_KEY
from tests._ddp import CloseProcessGroup
from tests.observe.fake_cuda_events import host_clock_event
from tests.observe.fake_pynvml import install

# host/ keys come from Linux /proc; elsewhere they are absent
HOST_ONLY = {*HOST_KEYS, *CPU_KEYS} if Path("/proc/self/stat").exists() else set(HOST_KEYS)
CUDA_ONLY = {
    "gpu/idle_frac",
    "time/gpu_blocked_frac",
    "gpu/step_idle_frac",
    "gpu/ceiling_frac",
    "throughput/ceiling_samples_per_sec",
    "gpu/host_syncs_per_step",
}
NO_LOGGER = "GPUStatsMonitor: the Trainer has no logger"


@pytest.fixture(autouse=True)
def _fresh_warnings():
    """Warn-once is per process; each test starts as a fresh process would."""
    _warnings().clear()


class TinyModule(pl.LightningModule):
    def __init__(
        self, fail_at: int | None = None, interrupt_at: int | None = None, batch_size: int = 4
    ) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 2)
        self.fail_at = fail_at
        self.interrupt_at = interrupt_at
        self.batch_size = batch_size

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise RuntimeError("boom")
        if batch_idx == self.interrupt_at:
            raise KeyboardInterrupt
        x, y = batch
        loss = nn.functional.cross_entropy(self.layer(x), y)
        self.log("train/loss", loss)
        return loss

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        ds = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 2, (64,), generator=g))
        return DataLoader(ds, batch_size=self.batch_size)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(tmp_path, monitor, loggers=False, **kw):
    kwargs = dict(
        accelerator="cpu",
        devices=1,
        max_steps=9,
        logger=loggers,
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    kwargs.update(kw)
    return pl.Trainer(**kwargs)


def _csv_rows(logger: CSVLogger) -> list[dict[str, str]]:
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _tb_scalars(log_dir: str) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir)
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("NVMLSampler")]


def test_cpu_fit_logs_host_keys_to_every_logger_at_the_interval(tmp_path):
    monitor = GPUStatsMonitor(log_every_n_steps=3)
    csv_logger = CSVLogger(tmp_path, name="csv")
    tb_logger = TensorBoardLogger(tmp_path, name="tb")
    with pytest.warns(UserWarning, match="not CUDA") as record:
        _trainer(tmp_path, monitor, [csv_logger, tb_logger]).fit(TinyModule())
    assert sum("GPUStatsMonitor" in str(w.message) for w in record) == 1  # not CUDA; there are loggers
    # windows end at optimizer steps 3, 6, 9; Lightning puts step k's row at logger step k-1
    assert [w["step"] for w in monitor.history] == [2.0, 5.0, 8.0]
    assert monitor.last_window is monitor.history[-1]
    for w in monitor.history:
        # a plain DataLoader keeps no fetch_seconds: no loader wait; a window shorter than one /proc/stat
        # tick (10 ms) has no cpu_busy_frac
        assert set(w) | {"host/cpu_busy_frac"} == {*HOST_ONLY, "step"} | {"host/cpu_busy_frac"}
        assert set(w) >= {*HOST_ONLY, "step"} - {"host/cpu_busy_frac"}
        assert w["time/step_ms"] > 0 and 0.0 <= w["time/data_wait_frac"] <= 1.0
        assert w["throughput/samples_per_sec"] > 0
    rows = [r for r in _csv_rows(csv_logger) if r.get("time/step_ms")]
    assert [int(r["step"]) for r in rows] == [2, 5, 8]
    assert all(r.get("gpu/util", "") == "" for r in rows)
    tb = _tb_scalars(tb_logger.log_dir)
    for key in HOST_KEYS:
        assert tb[key] == [2, 5, 8]
    assert not any(k.startswith("gpu/") for k in tb)


def test_trainer_interval_is_the_default_and_last_window_is_flushed(tmp_path):
    monitor = GPUStatsMonitor(gpu=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # gpu=False never warns about the GPU
        warnings.filterwarnings("ignore", message=".*(num_workers|bottleneck|log_every_n_steps|no logger).*")
        _trainer(tmp_path, monitor, log_every_n_steps=4, max_steps=10).fit(TinyModule())
    # windows at steps 4 and 8, then the 2-step tail when training ends
    assert [w["step"] for w in monitor.history] == [3.0, 7.0, 9.0]


def test_a_cpu_run_without_the_gpu_says_once_what_its_data_wait_holds(tmp_path, caplog):
    """gpu=False warns nothing, but on a CPU the data wait beyond the loader's is the batch's transfer work run
    on the training CPU (OptimizedDataModule's augmentation): one note at INFO level says so, once."""
    with warnings.catch_warnings(), caplog.at_level("INFO"):
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*(num_workers|bottleneck|log_every_n_steps|no logger).*")
        for _ in range(2):
            _trainer(tmp_path, GPUStatsMonitor(gpu=False, log_every_n_steps=3)).fit(TinyModule())
    notes = [r.getMessage() for r in caplog.records if CPU_WAIT_NOTE in r.getMessage()]
    assert notes == [f"GPUStatsMonitor: {CPU_WAIT_NOTE}"]
    assert "time/loader_wait_frac" in CPU_WAIT_NOTE and "augmentation" in CPU_WAIT_NOTE


def test_fake_nvml_fit_logs_every_documented_key(tmp_path, monkeypatch):
    fake = install(monkeypatch)
    fake.set(0, util=87.0, mem_util=30.0, jpeg_util=98.0)
    monitor = GPUStatsMonitor(log_every_n_steps=4, sample_period_s=0.01, nvml_index=0)
    csv_logger = CSVLogger(tmp_path, name="csv")
    tb_logger = TensorBoardLogger(tmp_path, name="tb")

    class SlowModule(TinyModule):
        def training_step(self, batch, batch_idx):
            time.sleep(0.06)  # long enough for GPM pairs (> 100 ms) inside a 4-step window
            return super().training_step(batch, batch_idx)

    _trainer(tmp_path, monitor, [csv_logger, tb_logger], max_steps=8).fit(SlowModule())
    assert monitor.sampler is None and not _sampler_threads()
    assert fake.refcount == 0 and fake.gpm_allocated == 0
    assert len(monitor.history) == 2
    expected = set(METRIC_KEYS) - CUDA_ONLY - {LOADER_KEY} - (set(CPU_KEYS) - HOST_ONLY)
    for w in monitor.history:
        assert set(w) == {*expected, "step"}
        assert w["gpu/util"] == pytest.approx(87.0)
        assert w["gpu/power_w"] == pytest.approx(250.0, rel=1e-3)
        # the energy a trained sample costs: the window's joules a second over its samples a second
        assert w["gpu/joules_per_sample"] == pytest.approx(w["gpu/power_w"] / w["throughput/samples_per_sec"])
        assert w["gpu/jpeg_util"] == pytest.approx(98.0) and w["gpu/video_dec_util"] == 0.0
        assert w["gpu/sm_active"] == pytest.approx(71.0)
    rows = [r for r in _csv_rows(csv_logger) if r.get("gpu/util")]
    assert [int(r["step"]) for r in rows] == [3, 7]
    assert expected <= set(rows[0])
    tb = _tb_scalars(tb_logger.log_dir)
    for key in expected:
        assert tb[key] == [3, 7], key


class SlowData(Dataset):
    def __init__(self, seconds: float = 0.02) -> None:
        self.seconds = seconds

    def __len__(self):
        return 64

    def __getitem__(self, i):
        # 4 items a batch: 80 ms of "decoding" per step on the main process, in CPU time: a busy machine slows
        # it as much as the training step, so the share of each step spent waiting holds
        end = time.thread_time() + self.seconds
        while time.thread_time() < end:
            pass
        return torch.randn(8), i % 2


class TimedLoader(DataLoader):
    """A DataLoader that keeps ``fetch_seconds``, as ContinuousDataLoader and DALILoader do."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fetch_seconds = 0.0

    def __iter__(self):
        it = super().__iter__()
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            finally:
                self.fetch_seconds += time.perf_counter() - t0
            yield batch


class FakeEventMonitor(GPUStatsMonitor):
    """The monitor on a CPU run, its CUDA events replaced by ones that execute the moment they are recorded."""

    def setup(self, trainer, pl_module, stage):
        super().setup(trainer, pl_module, stage)
        self.idle_meter = StreamIdleMeter(event_factory=host_clock_event)


def test_data_wait_shows_a_starving_loop(tmp_path):
    class Starved(TinyModule):
        def train_dataloader(self):
            return DataLoader(SlowData(), batch_size=4)

    starved = GPUStatsMonitor(gpu=False, log_every_n_steps=4)
    _trainer(tmp_path, starved, max_steps=8).fit(Starved())
    fed = GPUStatsMonitor(gpu=False, log_every_n_steps=4)
    _trainer(tmp_path, fed, max_steps=8).fit(TinyModule())
    slow, fast = starved.history[-1], fed.history[-1]
    assert slow["time/data_wait_ms"] >= 75.0  # every step waited for 4 x 20 ms of loading
    assert fast["time/data_wait_ms"] < slow["time/data_wait_ms"] / 4  # the same loop, its loader in memory
    assert slow["time/data_wait_frac"] > fast["time/data_wait_frac"] + 0.2
    assert slow["throughput/samples_per_sec"] < 4 / 0.08


def test_missing_nvml_bindings_warn_once_and_host_metrics_go_on(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ModuleNotFoundError
    monitor = GPUStatsMonitor(log_every_n_steps=3, nvml_index=0)
    with pytest.warns(UserWarning, match=r"lightning-gpuopt\[nvml\]") as record:
        _trainer(tmp_path, monitor).fit(TinyModule())
        _trainer(tmp_path, monitor).fit(TinyModule())  # a second fit does not warn again
    assert sum("nvidia-ml-py" in str(w.message) for w in record) == 1
    assert monitor.sampler is None
    assert len(monitor.history) == 3 and all(
        "time/step_ms" in w and "gpu/util" not in w for w in monitor.history
    )


def test_missing_nvml_library_warns_and_does_not_crash(tmp_path, monkeypatch):
    install(monkeypatch, library=False)
    monitor = GPUStatsMonitor(log_every_n_steps=3, nvml_index=0)
    with pytest.warns(UserWarning, match="NVMLError_LibraryNotFound"):
        _trainer(tmp_path, monitor).fit(TinyModule())
    assert len(monitor.history) == 3


def test_no_logger_is_said_once_at_setup(tmp_path):
    with pytest.warns(UserWarning, match=NO_LOGGER) as record:
        with pytest.raises(RuntimeError, match="boom"):  # said at setup, before any step ran
            _trainer(tmp_path, GPUStatsMonitor(gpu=False)).fit(TinyModule(fail_at=0))
        monitor = GPUStatsMonitor(gpu=False, log_every_n_steps=3)
        _trainer(tmp_path, monitor).fit(TinyModule())
    assert sum(NO_LOGGER in str(w.message) for w in record) == 1
    assert "history" in str(record[0].message)
    assert len(monitor.history) == 3  # kept, only not logged
    _warnings().clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _trainer(tmp_path, GPUStatsMonitor(gpu=False), CSVLogger(tmp_path)).fit(TinyModule())
    assert not any(NO_LOGGER in str(w.message) for w in seen)


def test_a_reused_monitor_reports_each_fit_on_its_own(tmp_path):
    monitor = GPUStatsMonitor(gpu=False, log_every_n_steps=3)
    _trainer(tmp_path, monitor).fit(TinyModule())
    first = list(monitor.history)
    _trainer(tmp_path, monitor, max_steps=6).fit(TinyModule())
    assert [w["step"] for w in first] == [2.0, 5.0, 8.0]
    assert [w["step"] for w in monitor.history] == [2.0, 5.0]
    assert all(w is not f for w in monitor.history for f in first)


def test_windows_follow_short_epochs_and_summary_leaves_the_warm_up_out(tmp_path):
    class ShortEpochs(TinyModule):
        def train_dataloader(self):  # 36 samples of batch 4: 9-step epochs, Trainer default interval 50
            return DataLoader(TensorDataset(torch.randn(36, 8), torch.randint(0, 2, (36,))), batch_size=4)

    monitor = GPUStatsMonitor(gpu=False)
    _trainer(tmp_path, monitor, max_steps=-1, max_epochs=3).fit(ShortEpochs())
    assert [w["step"] for w in monitor.history] == [8.0, 17.0, 26.0]
    later = [w["time/step_ms"] for w in monitor.history[1:]]
    assert monitor.summary()["time/step_ms"] == pytest.approx(sum(later) / 2)
    accumulated = GPUStatsMonitor(gpu=False)  # 9 batches, 3 a step: 3 optimizer steps an epoch
    _trainer(tmp_path, accumulated, max_steps=-1, max_epochs=2, accumulate_grad_batches=3).fit(ShortEpochs())
    assert [w["step"] for w in accumulated.history] == [2.0, 5.0]
    one = GPUStatsMonitor(gpu=False, log_every_n_steps=50)
    _trainer(tmp_path, one, max_steps=5).fit(TinyModule())
    assert len(one.history) == 1 and one.summary() == {}  # the warm-up window alone


def test_loader_wait_is_the_part_of_the_data_wait_inside_the_loader(tmp_path):
    class Fed(TinyModule):
        def train_dataloader(self):
            return TimedLoader(SlowData(0.01), batch_size=4)

    monitor = GPUStatsMonitor(gpu=False, log_every_n_steps=4)
    _trainer(tmp_path, monitor, max_steps=8).fit(Fed())
    assert len(monitor.history) == 2
    for w in monitor.history:
        assert 0.5 * w["time/data_wait_frac"] < w[LOADER_KEY] <= w["time/data_wait_frac"] + 0.02, w
        assert "time/gpu_blocked_frac" not in w  # needs CUDA events


def test_idle_frac_equals_the_data_wait_when_the_gpu_is_never_behind(tmp_path):
    class Starved(TinyModule):
        def train_dataloader(self):
            return DataLoader(SlowData(0.01), batch_size=4)

    monitor = FakeEventMonitor(gpu=False, log_every_n_steps=4)
    _trainer(tmp_path, monitor, max_steps=8).fit(Starved())
    assert len(monitor.history) == 2
    for w in monitor.history:
        assert w["gpu/idle_frac"] == pytest.approx(w["time/data_wait_frac"], abs=0.02)
        assert w["gpu/idle_frac"] > 0.3
        assert w["time/gpu_blocked_frac"] == pytest.approx(0.0, abs=0.02)  # no wait was hidden
    assert monitor.idle_meter is None  # released at teardown


def test_thread_is_joined_when_training_raises(tmp_path, monkeypatch):
    fake = install(monkeypatch)
    monitor = GPUStatsMonitor(nvml_index=1, sample_period_s=0.01)
    with pytest.raises(RuntimeError, match="boom"):
        _trainer(tmp_path, monitor).fit(TinyModule(fail_at=3))
    assert monitor.sampler is None and not _sampler_threads()
    assert fake.refcount == 0 and fake.gpm_allocated == 0


def test_thread_is_joined_on_keyboard_interrupt(tmp_path, monkeypatch):
    fake = install(monkeypatch)
    monitor = GPUStatsMonitor(nvml_index=2, sample_period_s=0.01)
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):  # Lightning's graceful shutdown on Ctrl+C ends in sys.exit(1)
            _trainer(tmp_path, monitor).fit(TinyModule(interrupt_at=2))
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT after the first one
    assert monitor.sampler is None and not _sampler_threads()
    assert fake.refcount == 0


def test_validation_and_pickling_and_state(tmp_path):
    with pytest.raises(ValueError, match="sample_period_s"):
        GPUStatsMonitor(sample_period_s=0)
    with pytest.raises(ValueError, match="log_every_n_steps"):
        GPUStatsMonitor(log_every_n_steps=0)
    with pytest.raises(TypeError, match="all_ranks"):
        GPUStatsMonitor(all_ranks="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="nvml_index"):
        GPUStatsMonitor(nvml_index=-2)
    monitor = GPUStatsMonitor(log_every_n_steps=3, gpu=False)
    copy = pickle.loads(pickle.dumps(monitor))
    assert copy.log_every_n_steps == 3 and copy.history == []
    _trainer(tmp_path, monitor).fit(TinyModule())
    state = monitor.state_dict()
    assert state == {"last_logged_step": 9}
    other = GPUStatsMonitor(log_every_n_steps=3, gpu=False)
    other.load_state_dict(state)
    assert other.state_dict() == state
    assert pickle.loads(pickle.dumps(monitor)).history == monitor.history
    assert monitor.summary()["time/step_ms"] > 0


def test_lightning_cli_config(tmp_path):
    pytest.importorskip("jsonargparse")
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(
        f"""
trainer:
  accelerator: cpu
  max_steps: 4
  logger: false
  enable_progress_bar: false
  enable_model_summary: false
  enable_checkpointing: false
  default_root_dir: {tmp_path}
  callbacks:
    - class_path: lightning_gpuopt.GPUStatsMonitor
      init_args:
        log_every_n_steps: 2
        gpu: false
"""
    )
    cli = LightningCLI(TinyModule, args=["fit", "--config", str(config)], save_config_callback=None)
    monitors = [c for c in cli.trainer.callbacks if isinstance(c, GPUStatsMonitor)]
    assert len(monitors) == 1
    assert monitors[0].log_every_n_steps == 2 and monitors[0].gpu is False
    assert [w["step"] for w in monitors[0].history] == [1.0, 3.0]


@pytest.mark.slow
def test_all_ranks_under_cpu_ddp(tmp_path):
    monitor = GPUStatsMonitor(gpu=False, log_every_n_steps=2, all_ranks=True)
    logger = CSVLogger(tmp_path, name="csv", version=0)
    trainer = _trainer(
        tmp_path,
        monitor,
        logger,
        devices=2,
        strategy="ddp_spawn",
        max_steps=4,
        callbacks=[monitor, CloseProcessGroup()],
    )
    trainer.fit(TinyModule())
    rows = [r for r in _csv_rows(logger) if r.get("time/step_ms")]
    assert [int(r["step"]) for r in rows] == [1, 3]
    for r in rows:
        for key in HOST_KEYS:
            assert float(r[f"{key}/rank0"]) >= 0 and float(r[f"{key}/rank1"]) >= 0
        assert float(r["time/step_ms"]) == float(r["time/step_ms/rank0"])


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_util_busy_then_idle():
    from lightning_gpuopt.observe.nvml import NVMLSampler, nvml_device_index

    device = torch.device("cuda", 0)
    a = torch.randn(8192, 8192, device=device, dtype=torch.float16)
    with NVMLSampler(nvml_device_index(device), period_s=0.1) as sampler:
        t_end = time.perf_counter() + 1.0
        while time.perf_counter() < t_end:  # warm up and drop the ramp
            for _ in range(8):
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize(device)
        sampler.window()
        t_end = time.perf_counter() + 3.0
        while time.perf_counter() < t_end:
            for _ in range(8):
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize(device)
        busy = sampler.window()
        time.sleep(1.0)
        sampler.window()
        time.sleep(3.0)
        idle = sampler.window()
    print(f"\nbusy window: {busy}\nidle window: {idle}")
    assert busy["gpu/util"] >= 90.0
    assert idle["gpu/util"] <= 10.0
    assert busy["gpu/power_w"] > idle["gpu/power_w"]


@pytest.mark.gpu
def test_gpu_fit_tensorboard_event_file_holds_the_keys(tmp_path):
    class GPUModule(TinyModule):
        def __init__(self):
            super().__init__(batch_size=64)
            self.layer = nn.Sequential(
                nn.Linear(8, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 2)
            )

        def train_dataloader(self):
            ds = TensorDataset(torch.randn(4096, 8), torch.randint(0, 2, (4096,)))
            return DataLoader(ds, batch_size=64)

    monitor = GPUStatsMonitor(log_every_n_steps=10)
    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        max_steps=60,
        logger=logger,
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(GPUModule())
    assert monitor.sampler is None and not _sampler_threads()
    expected = set(GPU_KEYS) - set(GPM_KEYS) | HOST_ONLY | CUDA_ONLY
    if torch.cuda.get_device_capability(0) >= (9, 0):  # Hopper and newer answer GPM
        expected |= set(GPM_KEYS)
    tb = _tb_scalars(logger.log_dir)
    print(f"\nlast window: {monitor.last_window}\ntensorboard tags: {sorted(tb)}")
    missing = expected - set(tb)
    assert not missing, missing
    assert tb["gpu/util"] == [9, 19, 29, 39, 49, 59]


@pytest.mark.gpu
def test_gpu_idle_frac_tells_a_starved_fit_from_a_fed_one(tmp_path):
    device = torch.device("cuda", 0)

    class Heavy(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8192, 8192), nn.ReLU(), nn.Linear(8192, 10))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    x = torch.randn(4096, 8192, device=device)
    y = torch.randint(0, 10, (4096,), device=device)

    class Resident(torch.utils.data.IterableDataset):
        def __init__(self, delay_s):
            self.delay_s = delay_s

        def __iter__(self):
            for _ in range(24):
                time.sleep(self.delay_s)  # stands in for decoding on the host
                yield x, y

    results = {}
    for name, delay in (("fed", 0.0), ("starved", 0.15)):
        monitor = GPUStatsMonitor(log_every_n_steps=8)
        pl.Trainer(
            accelerator="gpu",
            devices=1,
            max_steps=24,
            logger=False,
            callbacks=[monitor],
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            default_root_dir=tmp_path,
        ).fit(Heavy(), train_dataloaders=DataLoader(Resident(delay), batch_size=None))
        results[name] = monitor.summary()
        assert monitor.idle_meter is None
    print(f"\nfed: {results['fed']}\nstarved: {results['starved']}")
    assert results["fed"]["gpu/idle_frac"] < 0.15
    assert results["starved"]["gpu/idle_frac"] > 0.5
    assert results["starved"]["gpu/idle_frac"] > results["fed"]["gpu/idle_frac"] + 0.4
