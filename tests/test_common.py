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
