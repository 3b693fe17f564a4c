"""The private internals behind ``lightning_gpuopt._compat``: present in this torch/Lightning, found by looking
them up on the objects that carry them, and the guarded accessors behave as documented."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_gpuopt import _compat
from lightning_gpuopt._common import _warnings
from tests._lightning import quiet_trainer


def test_every_relied_on_internal_exists():
    # fails when a torch or Lightning release renames one: update _compat.py, then TESTED_TORCH
    assert _compat.missing_internals() == []


def test_missing_internals_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(
        _compat,
        "_INTERNALS",
        (*_compat._INTERNALS, "torch.utils.data:DataLoader._renamed", "torch.no_such_module:Thing._x"),
    )
    assert _compat.missing_internals() == [
        "torch.utils.data:DataLoader._renamed",
        "torch.no_such_module:Thing._x",
    ]


def test_instance_attributes_are_checked_on_instances(monkeypatch):
    # set in __init__, absent from the class: the check must build an instance to see them
    assert not hasattr(torch.optim.SGD, "_step_supports_amp_scaling")
    assert not hasattr(torch.utils.data.DataLoader, "_iterator")
    assert {"torch.optim:SGD._step_supports_amp_scaling", "torch.utils.data:DataLoader._iterator"} <= set(
        _compat._INSTANCES
    )
    monkeypatch.setattr(_compat, "_INTERNALS", tuple(_compat._INSTANCES))
    assert _compat.missing_internals() == []

    def fails() -> None:
        raise RuntimeError("this torch cannot build one")

    monkeypatch.setitem(_compat._INSTANCES, "torch.optim:SGD._step_supports_amp_scaling", fails)
    assert _compat.missing_internals() == ["torch.optim:SGD._step_supports_amp_scaling"]


def test_shared_uint8_is_shared_memory():
    t = _compat.shared_uint8(12)
    assert t.dtype == torch.uint8 and t.numel() == 12 and t.is_shared()


def test_supports_amp_scaling_follows_fused_flag():
    p = [nn.Parameter(torch.zeros(2))]
    assert not _compat.supports_amp_scaling(torch.optim.SGD(p, lr=0.1))
    assert _compat.supports_amp_scaling(torch.optim.SGD(p, lr=0.1, fused=True))


def test_replace_sigterm_check_on_a_trainer():
    trainer = quiet_trainer(accelerator="cpu", max_steps=1)
    calls = []
    assert _compat.replace_sigterm_check(trainer, lambda: calls.append(1)) is True
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    assert calls == [1]
    other = quiet_trainer(accelerator="cpu", max_steps=1)
    assert "_broadcast_sigterm_tensor" not in vars(other.fit_loop.epoch_loop)  # only that trainer's loop


def test_replace_sigterm_check_falls_back_where_the_loop_lacks_it():
    _warnings().clear()
    loop = SimpleNamespace()
    with pytest.warns(UserWarning, match="_broadcast_sigterm_tensor"):
        assert (
            _compat.replace_sigterm_check(SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=loop)), print)
            is False
        )
    assert vars(loop) == {}
    assert _compat.replace_sigterm_check(object(), print) is False
    _warnings().clear()


class _Refused(ValueError):
    """An error of the package's own kind (defined outside builtins)."""


class _RaisesAt:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        if i == 2:
            raise _Refused("cannot read item 2; fix it")
        return i


def test_worker_error_message_reads_a_worker_errors_own_line_back():
    """What DataLoader re-raises in the main process for a worker's exception: the type, called with the
    worker's traceback text, whose last line holds the original message."""
    loader = torch.utils.data.DataLoader(_RaisesAt(), batch_size=1, num_workers=1)
    with pytest.raises(_Refused) as raised:
        list(loader)
    text = str(raised.value)
    assert "\n" in text  # torch's text, the traceback around the message
    assert _compat.worker_error_message(text, _Refused) == "cannot read item 2; fix it"
    assert _compat.worker_error_message(text, KeyError) is None  # another type's text
    assert _compat.worker_error_message("cannot read item 2; fix it", _Refused) is None  # a plain message


def test_cuda_graph_skips_are_read_where_torch_records_them(monkeypatch):
    import logging

    import torch._dynamo.utils as dynamo_utils

    assert isinstance(_compat.cudagraph_skip_count(), int)
    assert isinstance(_compat.cudagraph_skip_logger(), logging.Logger)
    _warnings().clear()
    monkeypatch.setattr(dynamo_utils, "counters", None)
    with pytest.warns(UserWarning, match="counters"):
        assert _compat.cudagraph_skip_count() is None  # unknown, never a guess
