"""The host-sync locator: which line a synchronizing call is charged to (from stacks, on any machine), the
counts a step, and, on a GPU, a fit whose training_step calls ``.item()`` or prints a tensor named by the
monitor, and fits that do neither left silent: one that syncs nowhere, and one that logs with
``sync_dist=True`` on one device (Lightning reduces only under DDP, so that is no sync there)."""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from traceback import FrameSummary

import lightning
import pytest
import torch

from lightning_gpuopt.observe import host_sync
from lightning_gpuopt.observe.host_sync import SyncLocator, SyncSite, attribute, owner_of

TORCH = os.path.dirname(torch.__file__)
LIGHTNING = os.path.dirname(lightning.__file__)
OURS = os.path.dirname(os.path.dirname(host_sync.__file__))
USER = "/home/me/project"


def frame(path: str, line: int, code: str = "") -> FrameSummary:
    return FrameSummary(path, line, "f", line=code)


def trainer_fit(*inner: FrameSummary) -> list[FrameSummary]:
    """The stack of a Trainer fit from the user's script down to ``inner``."""
    return [
        frame(f"{USER}/train.py", 10, "trainer.fit(model, datamodule=dm)"),
        frame(f"{LIGHTNING}/pytorch/trainer/trainer.py", 560),
        frame(f"{LIGHTNING}/pytorch/loops/fit_loop.py", 216),
        frame(f"{LIGHTNING}/pytorch/loops/training_epoch_loop.py", 150),
        frame(f"{LIGHTNING}/pytorch/strategies/strategy.py", 390),
        *inner,
    ]


def test_owners():
    assert owner_of(f"{TORCH}/_tensor.py") == "torch"
    assert owner_of(f"{LIGHTNING}/pytorch/core/module.py") == "lightning"
    assert owner_of(f"{OURS}/data/loader.py") == "lightning-gpuopt"
    assert owner_of(threading.__file__) == "python" and owner_of("<frozen runpy>") == "python"
    assert owner_of(f"{USER}/model.py") == "user"


def test_a_sync_in_training_step_is_charged_to_the_users_line():
    item = trainer_fit(frame(f"{USER}/model.py", 42, "loss.item()"))
    assert attribute(item) == (f"{USER}/model.py", 42, "loss.item()", "user")
    printed = trainer_fit(
        frame(f"{USER}/model.py", 43, "print(loss)"),
        frame(f"{TORCH}/_tensor.py", 570, "return torch._tensor_str._str(self)"),
        frame(f"{TORCH}/_tensor_str.py", 700),
    )
    assert attribute(printed)[:2] == (f"{USER}/model.py", 43)
    logged = trainer_fit(
        frame(f"{USER}/model.py", 44, 'self.log("loss", loss, sync_dist=True)'),
        frame(f"{LIGHTNING}/pytorch/core/module.py", 520),
        frame(f"{LIGHTNING}/pytorch/trainer/connectors/logger_connector/result.py", 300),
        frame(f"{LIGHTNING}/fabric/utilities/distributed.py", 200),
    )
    assert attribute(logged)[1:] == (44, 'self.log("loss", loss, sync_dist=True)', "user")


def test_a_sync_of_lightnings_loop_or_a_loader_thread_is_theirs():
    loop = trainer_fit(
        frame(f"{LIGHTNING}/pytorch/trainer/connectors/logger_connector/logger_connector.py", 250)
    )
    where = attribute(loop)
    assert where[3] == "lightning" and where[1] == 250  # the innermost Lightning frame, not trainer.fit
    thread = [
        frame(threading.__file__, 1010),
        frame(f"{OURS}/data/loader.py", 300),
        frame(f"{TORCH}/cuda/streams.py", 90),
    ]
    assert attribute(thread)[:2] == (f"{OURS}/data/loader.py", 300)
    assert attribute(thread)[3] == "lightning-gpuopt"
    # a Fabric loop: the user's own loop calls .item() with no Lightning frame around it
    fabric = [frame(f"{USER}/loop.py", 30, "total += loss.item()")]
    assert attribute(fabric) == (f"{USER}/loop.py", 30, "total += loss.item()", "user")


def test_counts_a_step_and_the_sentence():
    locator = SyncLocator()
    for _ in range(4):
        locator.record(trainer_fit(frame(f"{USER}/model.py", 42, "loss.item()")))
        for _ in range(3):
            locator.record(
                trainer_fit(frame(f"{USER}/model.py", 50, "acc = (pred == y).float().mean().cpu()"))
            )
        locator.step()
    sites = locator.sites()
    assert [(s.lineno, s.count, s.per_step) for s in sites] == [(50, 12, 3.0), (42, 4, 1.0)]
    assert sites[1].describe() == "`model.py:42` synchronizes every step (`loss.item()`)"
    assert sites[0].describe().startswith("`model.py:50` synchronizes 3 times a step (`acc = ")
    rare = SyncSite(f"{USER}/m.py", 7, "x" * 80, "lightning", 1, 4)
    assert rare.describe() == f"`m.py:7` (lightning's own) synchronizes in 25% of steps (`{'x' * 57}...`)"


def test_the_warning_hook_records_the_callers_stack_and_passes_other_warnings_on():
    locator = SyncLocator()
    seen = []
    locator._showwarning = lambda *args: seen.append(str(args[0]))

    def user_line():
        locator._hook(UserWarning("called a synchronizing CUDA operation"), UserWarning, "x.py", 1)

    user_line()
    locator._hook(UserWarning("something else"), UserWarning, "x.py", 1)
    (site,) = locator.sites()
    assert site.filename == __file__ and site.code.startswith("locator._hook(") and site.owner == "user"
    assert seen == ["something else"]
    assert not locator.running and (torch.cuda.is_available() or locator.start() is False)


# ------------------------------------------------------------------------------------------------ on a GPU
MODEL = Path(__file__).with_name("_sync_model.py")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["item", "print", "sync_dist", "none"])
def test_a_fit_names_the_users_sync(kind, tmp_path, capsys):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import lightning.pytorch as pl

    from lightning_gpuopt import BottleneckAdvisor, GPUStatsMonitor
    from tests.observe._sync_model import LINES, SyncingModule, batches

    monitor = GPUStatsMonitor(log_every_n_steps=10)
    advisor = BottleneckAdvisor(warmup_steps=10, verbose=False)

    class Locate(pl.Callback):  # whatever the idle share (and without NVML): from the first window's end
        def on_train_start(self, trainer, pl_module):
            monitor.locate_syncs()

    trainer = pl.Trainer(max_steps=60, callbacks=[monitor, advisor, Locate()], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, accelerator="gpu", devices=1)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(SyncingModule(kind), batches())
    mine = [s for s in monitor.host_syncs if s.owner == "user"]
    if kind in ("none", "sync_dist"):
        assert mine == [], [s.describe() for s in monitor.host_syncs]
        assert all("synchronizes" not in v.advice for v in advisor.verdicts)
        return
    assert mine and mine[0].where == f"_sync_model.py:{LINES[kind]}", [
        s.describe() for s in monitor.host_syncs
    ]
    assert mine[0].per_step >= 0.95
    assert any(w.get("gpu/host_syncs_per_step", 0) >= 0.95 for w in monitor.history)
    assert torch.cuda.get_sync_debug_mode() == 0  # off again


@pytest.mark.gpu
def test_a_sync_debug_mode_of_the_users_own_is_left_alone():
    """A user who set ``set_sync_debug_mode("error")`` wants an error at every sync: the locator does not turn
    it into a warning it swallows."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.cuda.set_sync_debug_mode("error")
    try:
        locator = SyncLocator()
        assert locator.start() is False and not locator.running
        assert torch.cuda.get_sync_debug_mode() == 2
    finally:
        torch.cuda.set_sync_debug_mode(0)
    fresh = SyncLocator()
    assert fresh.start() is True  # with torch's default mode it runs
    fresh.stop()
    assert torch.cuda.get_sync_debug_mode() == 0


def test_the_monitor_runs_the_locator_for_a_few_steps_from_a_windows_end(monkeypatch):
    """The wiring, on any machine: a stand-in for torch's sync warnings records one user sync a step."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_gpuopt.observe import gpu_stats
    from lightning_gpuopt.observe.gpu_stats import GPUStatsMonitor

    started = []

    class OneSyncAStep(SyncLocator):
        def start(self):
            started.append(True)
            self._catch = object()  # running
            return True

        def step(self):
            self.record([frame(f"{USER}/model.py", 42, "loss.item()")])
            super().step()

        def stop(self):
            self._catch = None
            return self.sites()

    monkeypatch.setattr(gpu_stats, "SyncLocator", OneSyncAStep)
    monitor = GPUStatsMonitor(log_every_n_steps=6, sync_steps=3)

    class Locate(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            monitor.locate_syncs()

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(max_steps=18, callbacks=[monitor, Locate()], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, accelerator="cpu")  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4))
    assert started == [True]  # once, from the first window's end
    (site,) = monitor.host_syncs
    assert site.describe() == "`model.py:42` synchronizes every step (`loss.item()`)" and site.steps == 3
    assert [w.get("gpu/host_syncs_per_step") for w in monitor.history] == [None, 1.0, None]
