"""The replayed ceiling: it leaves training where it was, the monitor logs ``gpu/ceiling_frac`` from it and
keeps the replay out of its windows."""

from __future__ import annotations

import copy
import time
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt.observe.ceiling import CEILING_KEY, CEILING_RATE_KEY, ReplayCeiling, ceiling_frac
from lightning_gpuopt.observe.gpu_stats import GPUStatsMonitor


class Net(pl.LightningModule):
    """BatchNorm (buffers), dropout (the RNG), momentum SGD (optimizer state), and a logged loss."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Dropout(0.3), nn.ReLU(), nn.Linear(32, 2)
        )
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    out += [p.grad.clone() for p in model.parameters() if p.grad is not None]
    out += [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def test_the_replay_leaves_training_exactly_where_it_was():
    torch.manual_seed(0)
    model = Net()
    opt = model.configure_optimizers()
    batch = (torch.randn(16, 8), torch.randint(0, 2, (16,)))
    for _ in range(2):  # momentum buffers and gradients exist, as after warm-up
        opt.zero_grad()
        model.training_step(batch, 0).backward()
        opt.step()
    twin, twin_opt = copy.deepcopy(model), None
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # load_state_dict keeps the tensors it is given
    before, rng = _state(model, opt), torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log outside a Trainer would warn: the replay must drop it
        c = ReplayCeiling(steps=3, warmup=1).measure(model, [opt], batch)
    assert c is not None and c.batch_size == 16 and len(c.step_ms) == 3 and c.samples_per_sec > 0
    after = _state(model, opt)
    assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert torch.equal(torch.get_rng_state(), rng)
    assert "log" not in model.__dict__  # the logging patch is gone
    # one more step of each trains identically: the replay changed nothing the next step reads
    for m, o in ((model, opt), (twin, twin_opt)):
        torch.manual_seed(1)
        o.zero_grad()
        m.training_step(batch, 0).backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


def test_the_replay_puts_a_grad_scalers_scale_back():
    """Under a GradScaler (``16-mixed``'s) every replayed step scales, unscales and updates: the scale, its
    growth tracker and the weights are as before, with the replay's steps run through the scaler."""
    from types import SimpleNamespace

    torch.manual_seed(0)
    model = Net()
    opt = model.configure_optimizers()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)  # grows at every step
    plugin = SimpleNamespace(scaler=scaler, forward_context=lambda: torch.autocast("cpu", torch.bfloat16))
    batch = (torch.randn(16, 8), torch.randint(0, 2, (16,)))
    scaler.scale(model.training_step(batch, 0)).backward()
    scaler.step(opt)
    scaler.update()
    before, scale = _state(model, opt), scaler.get_scale()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = ReplayCeiling(steps=3, warmup=1).measure(model, [opt], batch, precision_plugin=plugin)
    assert c is not None and len(c.step_ms) == 3
    assert scaler.get_scale() == scale == 2.0**11
    assert scaler.state_dict()["_growth_tracker"] == 0
    after = _state(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_the_replay_says_what_it_cannot_replay():
    assert (
        ReplayCeiling.unsupported(nn.Linear(2, 2), [object()]) == "the module has no training_step to replay"
    )
    assert "manually" in ReplayCeiling.unsupported(Net(manual=True), [object()])
    assert ReplayCeiling.unsupported(Net(), []) == "the run has no optimizer"
    assert ReplayCeiling.unsupported(Net(), [object()]) is None
    assert (
        ceiling_frac(50.0, 100.0) == 0.5
        and ceiling_frac(None, 100.0) is None
        and ceiling_frac(5.0, 0.0) is None
    )
    with pytest.raises(ValueError, match="steps"):
        ReplayCeiling(steps=1)


class _Slow(Dataset):
    """A loader slower than the model: most of each step is data wait."""

    def __len__(self):
        return 512

    def __getitem__(self, i):
        time.sleep(0.001)
        return torch.randn(8), i % 2


def _fit(monitor: GPUStatsMonitor, model: pl.LightningModule, steps: int = 24, quiet: bool = True) -> None:
    trainer = pl.Trainer(
        max_steps=steps,
        callbacks=[monitor],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        accelerator="cpu",
    )
    # one intra-op thread: on a loaded 2-core machine torch's threads wait for each other at every op (a
    # step of well under a millisecond took 440 ms), which would time the contention rather than the model
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            if quiet:
                warnings.simplefilter("ignore")
            trainer.fit(model, DataLoader(_Slow(), batch_size=8))
    finally:
        torch.set_num_threads(threads)


def test_the_monitor_logs_the_ceiling_fraction_after_the_first_window():
    monitor = GPUStatsMonitor(log_every_n_steps=6, ceiling=True, ceiling_steps=3)
    _fit(monitor, Net())
    first, *later = monitor.history
    assert CEILING_KEY not in first  # the warm-up window ends before the replay
    assert later and all(CEILING_KEY in w for w in later)
    c = monitor.last_ceiling
    assert c is not None and c.batch_size == 8
    for w in later:
        assert w[CEILING_RATE_KEY] == c.samples_per_sec
        assert w[CEILING_KEY] == pytest.approx(w["throughput/samples_per_sec"] / c.samples_per_sec)
        assert 0 < w[CEILING_KEY] < 1  # 8 ms of loading a step against a step of well under a millisecond
    # the replay's time is in none of the windows: the window after it waits for data as the others do
    start, end = monitor.pause
    assert end > start
    waits = [w["time/data_wait_ms"] for w in later]
    assert max(waits) < 3 * min(waits)
    assert "gpu/ceiling_frac" in monitor.summary()


def test_the_ceiling_is_off_on_a_cpu_run_unless_asked_and_says_why_it_cannot_run():
    monitor = GPUStatsMonitor(log_every_n_steps=6)
    _fit(monitor, Net(), steps=12)
    assert monitor.last_ceiling is None and all(CEILING_KEY not in w for w in monitor.history)

    class Manual(Net):
        def __init__(self):
            super().__init__(manual=True)

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            loss = super().training_step(batch, batch_idx)
            self.manual_backward(loss)
            opt.step()

    from lightning_gpuopt._common import _warnings

    _warnings().clear()
    monitor = GPUStatsMonitor(log_every_n_steps=6, ceiling=True)
    trainer_warnings = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(monitor, Manual(), steps=12, quiet=False)
        trainer_warnings = [str(w.message) for w in caught]
    assert any(
        "gpu/ceiling_frac is not measured: the module optimizes manually" in m for m in trainer_warnings
    )
    assert monitor.last_ceiling is None


class _Counting(Net):
    """Counts its training steps: a side effect of a step that the replay cannot put back."""

    calls = 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        return super().training_step(batch, batch_idx)


def test_nothing_is_replayed_unless_asked():
    """The replay puts the training state back but not what a step does besides (this counter; a
    torchmetrics state, a file, a call to a tracker), so only ``ceiling=True`` runs it: not the default
    monitor, on a single-process CUDA run neither, and ``measure_ceiling()`` does not turn it on; asked for on
    several processes it says once why not."""
    from types import SimpleNamespace

    from lightning_gpuopt._common import _warnings

    def due(monitor: GPUStatsMonitor, world_size: int) -> bool:
        """Whether a fit on CUDA with ``world_size`` processes would replay (the monitor's fit start)."""
        monitor._begin(SimpleNamespace(device=torch.device("cuda", 0), world_size=world_size, loggers=[None]))
        return monitor._ceiling_due

    assert due(GPUStatsMonitor(gpu=False), 1) is False
    assert due(GPUStatsMonitor(gpu=False, ceiling=True), 1) is True
    _warnings().clear()
    with pytest.warns(UserWarning, match="gpu/ceiling_frac is not measured: the run has several processes"):
        assert due(GPUStatsMonitor(gpu=False, ceiling=True), 2) is False

    def fit(monitor: GPUStatsMonitor) -> int:
        class Again(pl.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if trainer.global_step == 5:
                    monitor.measure_ceiling()

        model = _Counting()
        trainer = pl.Trainer(max_steps=12, callbacks=[monitor, Again()], logger=False, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False, accelerator="cpu")  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, DataLoader(_Slow(), batch_size=8))
        return model.calls

    default = GPUStatsMonitor(log_every_n_steps=4)
    assert fit(default) == 12 and default.last_ceiling is None
    asked = GPUStatsMonitor(log_every_n_steps=4, ceiling=True, ceiling_steps=2)
    assert fit(asked) == 12 + 2 * (3 + 2) and asked.last_ceiling is not None  # after window 1, again after 5


def test_measure_ceiling_measures_again_at_the_next_window():
    monitor = GPUStatsMonitor(log_every_n_steps=4, ceiling=True, ceiling_steps=2)

    class Again(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 9:
                self.first = monitor.last_ceiling
                monitor.measure_ceiling()

    again = Again()
    trainer = pl.Trainer(max_steps=16, callbacks=[monitor, again], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, accelerator="cpu")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Net(), DataLoader(_Slow(), batch_size=8))
    assert again.first is not None and monitor.last_ceiling is not again.first


@pytest.mark.gpu
def test_on_a_gpu_the_replay_leaves_a_16_mixed_fit_where_it_was():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")

    def fit(ceiling: bool) -> tuple[Net, GPUStatsMonitor]:
        torch.manual_seed(0)
        model = Net()
        data = [
            (torch.randn(64, 8, device="cuda"), torch.randint(0, 2, (64,), device="cuda")) for _ in range(4)
        ]
        monitor = GPUStatsMonitor(log_every_n_steps=5, ceiling=ceiling)
        trainer = pl.Trainer(max_steps=20, callbacks=[monitor], logger=False, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False, accelerator="gpu",
                             devices=1, precision="16-mixed")  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(model, DataLoader(data * 10, batch_size=None))  # each item a whole batch
        return model, monitor

    replayed, monitor = fit(True)
    plain, _ = fit(False)
    c = monitor.last_ceiling
    assert c is not None and c.on_device and c.samples_per_sec > 0 and len(c.step_ms) == monitor.ceiling_steps
    assert all(CEILING_KEY in w for w in monitor.history[1:])
    for a, b in zip(replayed.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.allclose(
            a.float(), b.float(), rtol=0, atol=1e-6
        )  # a step of the replay moves them ~1e-2


@pytest.mark.gpu
def test_on_a_gpu_the_default_monitor_replays_nothing():
    """A single-process CUDA run is one the replay can measure; without ``ceiling=True`` it runs the user's
    steps only."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = _Counting()
    data = [(torch.randn(64, 8, device="cuda"), torch.randint(0, 2, (64,), device="cuda")) for _ in range(4)]
    monitor = GPUStatsMonitor(log_every_n_steps=5)
    trainer = pl.Trainer(max_steps=20, callbacks=[monitor], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, accelerator="gpu", devices=1)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, DataLoader(data * 10, batch_size=None))
    assert model.calls == 20 and monitor.last_ceiling is None
    assert len(monitor.history) == 4 and all(CEILING_KEY not in w for w in monitor.history)
    assert all("gpu/idle_frac" in w for w in monitor.history)  # a CUDA run, measured as one


def test_a_replay_that_raises_warns_and_training_goes_on():
    class Fragile(Net):
        def training_step(self, batch, batch_idx):
            if "log" in self.__dict__:  # inside the replay, which drops self.log
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    from lightning_gpuopt._common import _warnings

    _warnings().clear()
    monitor = GPUStatsMonitor(log_every_n_steps=4, ceiling=True)
    model = Fragile()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(monitor, model, steps=12, quiet=False)
    said = [str(w.message) for w in caught]
    assert any("replaying training_step raised RuntimeError: boom" in m for m in said), said
    assert monitor.last_ceiling is None and len(monitor.history) == 3 and model.trainer.global_step == 12
    assert "log" not in model.__dict__
