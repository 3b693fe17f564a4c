"""The private internals behind ``lightning_gpuopt._compat``: present in this torch/Lightning, and the
replacements built on them behave as the originals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_gpuopt import _compat


def test_every_relied_on_internal_exists():
    # fails when a torch or Lightning release renames one: update _compat.py, then TESTED_TORCH
    assert _compat.missing_internals() == []


def test_shared_uint8_is_shared_memory():
    t = _compat.shared_uint8(12)
    assert t.dtype == torch.uint8 and t.numel() == 12 and t.is_shared()


def test_supports_amp_scaling_follows_fused_flag():
    p = [nn.Parameter(torch.zeros(2))]
    assert not _compat.supports_amp_scaling(torch.optim.SGD(p, lr=0.1))
    assert _compat.supports_amp_scaling(torch.optim.SGD(p, lr=0.1, fused=True))


_SCRIPT = """
import json, os, signal, sys
from pathlib import Path
import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from lightning_gpuopt import _compat

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


class UseNonBlockingCheck(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        (out / f"replaced{trainer.global_rank}").write_text(str(_compat.nonblocking_sigterm_check(trainer)))


if __name__ == "__main__":
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator=accelerator, devices=2, strategy="ddp", max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[UseNonBlockingCheck()],
    )
    trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4))
"""


def _fit(tmp_path: Path, stop_at: int, accelerator: str = "cpu") -> subprocess.CompletedProcess:
    script = tmp_path / "fit.py"
    script.write_text(_SCRIPT)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(stop_at), accelerator],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
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


def _check_sigterm_run(tmp_path: Path, stop_at: int, accelerator: str) -> None:
    proc = _fit(tmp_path, stop_at, accelerator)
    for rank in (0, 1):
        assert (tmp_path / f"replaced{rank}").read_text() == "True", proc.stderr[-2000:]
        last = json.loads((tmp_path / f"rank{rank}.json").read_text())["last"]
        if stop_at < 0:
            assert last == 7, proc.stderr[-2000:]  # 64 samples / batch 4 / 2 ranks, all steps ran
        else:
            assert stop_at <= last <= stop_at + 2, (
                f"rank {rank} ran to step {last} after SIGTERM at {stop_at}"
            )
