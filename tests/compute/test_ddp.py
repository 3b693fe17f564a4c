"""NonBlockingStepChecks / nonblocking_sigterm_check: DDP steps without a per-step host sync, a SIGTERM still
stopping every rank."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt.bench.models import ImageClassifier
from lightning_gpuopt.compute.ddp import NonBlockingStepChecks
from tests._lightning import quiet_trainer

_SCRIPT = """
import json, os, signal, sys
from pathlib import Path
import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from lightning_gpuopt.compute.ddp import NonBlockingStepChecks

out, stop_at, accelerator = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        if self.global_rank == 0 and batch_idx == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)  # Lightning's handler sets trainer.received_sigterm
        (out / f"rank{self.global_rank}.json").write_text(json.dumps({"last": batch_idx}))
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class RecordActive(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        checks = next(c for c in trainer.callbacks if isinstance(c, NonBlockingStepChecks))
        (out / f"replaced{trainer.global_rank}").write_text(str(checks.active))
        # Lightning's SIGTERM handler no longer broadcasts from inside the signal handler (which could meet
        # the other rank inside the gradient all-reduce and hang)
        handlers = getattr(signal.getsignal(signal.SIGTERM), "signal_handlers", [])
        quiet = any(type(h).__name__ == "_SigtermNotifier" for h in handlers)
        (out / f"quiet{trainer.global_rank}").write_text(str(quiet))


if __name__ == "__main__":
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator=accelerator, devices=2, strategy="ddp", max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[NonBlockingStepChecks(), RecordActive()],
    )
    trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4))
"""


def _fit(tmp_path: Path, stop_at: int, accelerator: str = "cpu") -> subprocess.CompletedProcess:
    script = tmp_path / "fit.py"
    script.write_text(_SCRIPT)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(stop_at), accelerator],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )


def _check_sigterm_run(tmp_path: Path, stop_at: int, accelerator: str) -> None:
    proc = _fit(tmp_path, stop_at, accelerator)
    for rank in (0, 1):
        assert (tmp_path / f"replaced{rank}").read_text() == "True", proc.stderr[-2000:]
        assert (tmp_path / f"quiet{rank}").read_text() == "True", proc.stderr[-2000:]
        last = json.loads((tmp_path / f"rank{rank}.json").read_text())["last"]
        if stop_at < 0:
            assert last == 7, proc.stderr[-2000:]  # 64 samples / batch 4 / 2 ranks, all steps ran
        else:
            assert stop_at <= last <= stop_at + 2, (
                f"rank {rank} ran to step {last} after SIGTERM at {stop_at}"
            )


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed (gloo)")
@pytest.mark.parametrize("stop_at", [-1, 2])
def test_nonblocking_sigterm_check_trains_and_stops_all_ranks(tmp_path, stop_at):
    _check_sigterm_run(tmp_path, stop_at, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL)")
@pytest.mark.parametrize("stop_at", [-1, 2])
def test_nonblocking_sigterm_check_on_two_gpus(tmp_path, stop_at):
    _check_sigterm_run(tmp_path, stop_at, "gpu")


def test_on_one_device_it_does_nothing():
    cb = NonBlockingStepChecks()
    model = ImageClassifier(nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 2)))
    data = DataLoader(TensorDataset(torch.randn(8, 3, 4, 4), torch.randint(0, 2, (8,))), batch_size=4)
    for _ in range(2):  # a second fit with the same callback
        trainer = quiet_trainer(accelerator="cpu", max_steps=2, callbacks=[cb])
        original = trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor
        trainer.fit(model, data)
        assert cb.active is False
        assert "_broadcast_sigterm_tensor" not in vars(trainer.fit_loop.epoch_loop)
        assert trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor == original
    assert cb.state_dict() == {}
    assert isinstance(pickle.loads(pickle.dumps(cb)), NonBlockingStepChecks)
