"""``warn_once``: once a process and message, attributed to the user's line."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_gpuopt import ChannelsLast
from lightning_gpuopt._common import _warnings, warn_once
from lightning_gpuopt.compute.channels_last import apply_channels_last
from tests._lightning import quiet_trainer


@pytest.fixture(autouse=True)
def _fresh_warnings():
    _warnings().clear()
    yield
    _warnings().clear()


def test_warning_names_the_callers_line_not_the_package():
    with pytest.warns(UserWarning, match="has no Conv2d layer") as record:
        apply_channels_last(nn.Linear(2, 2))  # the line the warning must name
    (w,) = record.list
    assert w.filename == __file__
    assert "lightning_gpuopt" not in w.filename


def test_warning_through_a_lightning_hook_names_the_fit_call():
    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 2)), batch_size=2)
    trainer = quiet_trainer(accelerator="cpu", max_steps=1, callbacks=[ChannelsLast()])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(Tiny(), data)
    ours = [w for w in record if str(w.message).startswith("ChannelsLast:")]
    assert len(ours) == 1
    assert ours[0].filename == __file__


def test_once_a_process_and_message():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            warn_once("test_common: once")
        warn_once("test_common: another")
    assert [str(w.message) for w in record] == ["test_common: once", "test_common: another"]
    assert all(w.filename == __file__ for w in record)


def test_only_rank_zero_warns(monkeypatch):
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", 1, raising=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        warn_once("test_common: rank one")
    assert record == []


#: a fit with ``GPUStatsMonitor`` on a CPU: the monitor warns in ``setup`` (no GPU to sample), from a
#: ``__main__`` whose loader has no source (``python -c``, standard input, the interactive prompt)
_INTERACTIVE_FIT = """\
import warnings, torch, lightning.pytorch as pl
from torch import nn
from lightning_gpuopt import GPUStatsMonitor
warnings.simplefilter("always")
class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__(); self.layer = nn.Linear(2, 1)
    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 2)), batch_size=2)
trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False, callbacks=[GPUStatsMonitor()])
trainer.fit(Tiny(), data)
print("FIT-ENDED", trainer.global_step)
"""

_CONSOLE = """\
import code, sys
console = code.InteractiveConsole(vars(sys.modules["__main__"]))  # the prompt's namespace, as at >>>
source = sys.stdin.read()
for line in source.splitlines():
    console.push(line)
console.push("")
"""


def _run(args, stdin=None):
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONWARNINGS": "always"}
    return subprocess.run(
        [sys.executable, *args], input=stdin, capture_output=True, text=True, timeout=300, env=env
    )


@pytest.mark.parametrize("how", ["python -c", "python - < script", "InteractiveConsole"])
def test_a_fit_from_an_interactive_main_warns_instead_of_crashing(how):
    """``__main__`` without a source loader: the package's warnings are shown, the fit ends normally."""
    if how == "python -c":
        done = _run(["-c", _INTERACTIVE_FIT])
    elif how == "python - < script":
        done = _run(["-"], stdin=_INTERACTIVE_FIT)
    else:  # the interactive prompt: each statement pushed to a console, as typed
        lines = _INTERACTIVE_FIT.replace("\nclass ", "\n\nclass ").replace("\ndata =", "\n\ndata =")
        done = _run(["-c", _CONSOLE], stdin=lines)
    assert "not a built-in module" not in done.stderr, done.stderr[-3000:]
    assert "FIT-ENDED 2" in done.stdout, done.stderr[-3000:]
    assert "GPUStatsMonitor" in done.stderr  # the CPU run's warning was shown
