"""channels_last memory format: convert a model once, before DDP wraps it, and its inputs on the way in
(``apply_channels_last`` does the work, ``ChannelsLast`` adapts it to Lightning's hooks; docs/compute.md)."""

from __future__ import annotations

import itertools
from typing import Any

import lightning.pytorch as pl
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_gpuopt._checks import check_arg, check_bool
from lightning_gpuopt._common import warn_once
from lightning_gpuopt.compute._model import has_conv

_CL = torch.channels_last


def _no_conv_warning(who: str, model: nn.Module, what: str) -> None:
    warn_once(
        f"{who}: {type(model).__name__} has no Conv2d layer, so channels_last cannot speed it up; {what}"
    )


def _in_format(t: torch.Tensor) -> bool:
    # `is_contiguous(memory_format=...)` ignores the strides of size-1 dims (a 1x1 conv weight passes it in
    # NCHW), but DDP compares full strides against its gradient buckets: compare the canonical ones
    _n, c, h, w = t.shape
    return t.stride() == (h * w * c, 1, w * c, c)


def _4d(model: nn.Module) -> list[torch.Tensor]:
    # a torch.compile'd OptimizedModule's parameters() include its `_orig_mod`'s; lazy placeholders have no shape
    tensors = itertools.chain(model.parameters(), model.buffers())
    lazy = (UninitializedParameter, UninitializedBuffer)
    return [t for t in tensors if not isinstance(t, lazy) and t.dim() == 4]


def is_channels_last(model: nn.Module) -> bool:
    """Whether every 4-D parameter and buffer of ``model`` is already channels_last."""
    return all(_in_format(t) for t in _4d(model))


def apply_channels_last(model: nn.Module) -> nn.Module:
    """Convert ``model``'s 4-D parameters, their gradients and buffers to channels_last, in place (parameters
    keep their identity: only ``.data`` changes).

    Args:
        model: the module (a ``LightningModule``, a plain ``nn.Module`` or an ``OptimizedModule``).

    Returns:
        The same ``model``; without a Conv2d unchanged, with a warning (once a process).
    """
    check_arg(isinstance(model, nn.Module), "model", model, "a torch.nn.Module", error=TypeError)
    if not has_conv(model, 2):
        _no_conv_warning("apply_channels_last", model, "the model was left unchanged.")
        return model
    with torch.no_grad():
        for t in _4d(model):
            if not _in_format(t):
                t.data = torch.empty_like(t.data, memory_format=_CL).copy_(t.data)
            grad = t.grad
            if grad is not None and not _in_format(grad):
                t.grad = torch.empty_like(grad, memory_format=_CL).copy_(grad)
    return model


class ChannelsLast(pl.Callback):
    """Train in channels_last: the model is converted at ``setup``, before the strategy wraps it in
    ``DistributedDataParallel``, and ``forward``'s inputs by a pre-hook (docs/compute.md).

    Args:
        convert_inputs: also convert ``forward``'s 4-D floating tensor arguments (off: the first convolution
            converts its input itself and keeps that copy for backward).

    Example::

        trainer = Trainer(precision="16-mixed", callbacks=[ChannelsLast()])
    """

    def __init__(self, convert_inputs: bool = True) -> None:
        super().__init__()
        check_bool(convert_inputs, "convert_inputs")
        self.convert_inputs = convert_inputs
        self.active = False
        self.inputs_converted = 0
        self._pending = False
        self._handle: RemovableHandle | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.active = False
        self._pending = False
        device = trainer.strategy.root_device
        if device.type not in ("cuda", "cpu"):  # the devices whose convolutions have a channels_last path
            warn_once(
                f"ChannelsLast: {device.type!r} devices have no channels_last convolution path that is known "
                "to pay; the callback does nothing. Remove it to silence this warning."
            )
        elif has_conv(pl_module, 2):
            self._activate(pl_module)
        else:  # maybe built later in `configure_model`: decide once the strategy has set the model up
            self._pending = True

    def _activate(self, pl_module: pl.LightningModule) -> None:
        apply_channels_last(pl_module)
        self.active = True
        if self.convert_inputs and self._handle is None:
            self._handle = pl_module.register_forward_pre_hook(self._convert_inputs, with_kwargs=True)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Layers created after `setup` (in `configure_model`). Converting them under a wrapper such as DDP
        # would leave its gradient buckets laid out for the old strides: only an unwrapped model is converted.
        if not (self._pending or (self.active and not is_channels_last(pl_module))):
            return
        pending, self._pending = self._pending, False
        if pending and not has_conv(pl_module, 2):
            _no_conv_warning(
                "ChannelsLast", pl_module, "the callback does nothing. Remove it to silence this warning."
            )
        elif trainer.strategy.model is pl_module:
            self._activate(pl_module)
        else:
            warn_once(
                f"ChannelsLast: layers of {type(pl_module).__name__} were created after setup (in "
                "`configure_model`) and the strategy has already wrapped the model, so they stay in the "
                "default layout. Call `apply_channels_last(self)` at the end of `configure_model`."
            )

    on_validation_start = on_test_start = on_predict_start = on_fit_start

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _convert_inputs(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        converted = False

        def convert(t: torch.Tensor) -> torch.Tensor:
            nonlocal converted
            # layout checks read metadata only: no device work, no sync
            if t.dim() == 4 and t.is_floating_point() and not t.is_contiguous(memory_format=_CL):
                converted = True
                return t.contiguous(memory_format=_CL)
            return t

        new_args, new_kwargs = apply_to_collection((args, kwargs), torch.Tensor, convert)
        self.inputs_converted += int(converted)
        return new_args, new_kwargs

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"inputs_converted": self.inputs_converted}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inputs_converted = int(state_dict.get("inputs_converted", 0))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handle"] = None  # a hook handle belongs to one process's module
        return state
