"""channels_last memory format: convert a model once, before DDP wraps it, and its inputs on the way in
(``apply_channels_last`` does the work, ``ChannelsLast`` adapts it to Lightning's hooks; docs/compute.md)."""

from __future__ import annotations

import itertools
from typing import Any, cast

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

_FORMATS: dict[str, torch.memory_format] = {
    "channels_last": torch.channels_last,
    "channels_last_3d": torch.channels_last_3d,
}
# rank of the tensors each format applies to, and the dimensionality of the convolutions that prefer it
_RANK = {torch.channels_last: 4, torch.channels_last_3d: 5}
_CONV_DIMS = {torch.channels_last: 2, torch.channels_last_3d: 3}
# lazy modules' placeholders have no shape yet
_UNINITIALIZED = (UninitializedParameter, UninitializedBuffer)
_FORMAT_MUST = (
    "'channels_last' (4-D, Conv2d) or 'channels_last_3d' (5-D, Conv3d), by name or as a torch.memory_format"
)


def _resolve_format(memory_format: torch.memory_format | str) -> torch.memory_format:
    ok_type = isinstance(memory_format, (str, torch.memory_format))
    check_arg(ok_type, "memory_format", memory_format, _FORMAT_MUST, error=TypeError)
    fmt = (
        _FORMATS.get(memory_format.replace("torch.", "")) if isinstance(memory_format, str) else memory_format
    )
    check_arg(fmt in _RANK, "memory_format", memory_format, _FORMAT_MUST)
    return cast(torch.memory_format, fmt)


def _no_conv_warning(who: str, model: nn.Module, fmt: torch.memory_format, what: str) -> None:
    conv, name = ("Conv2d", "channels_last") if fmt == torch.channels_last else ("Conv3d", "channels_last_3d")
    warn_once(f"{who}: {type(model).__name__} has no {conv} layer, so {name} cannot speed it up; {what}")


def _in_format(t: torch.Tensor, fmt: torch.memory_format) -> bool:
    # `is_contiguous(memory_format=...)` ignores the strides of size-1 dims (a 1x1 conv weight passes it in
    # NCHW), but DDP compares full strides against its gradient buckets: compare the canonical ones
    if fmt == torch.channels_last:
        _n, c, h, w = t.shape
        return t.stride() == (h * w * c, 1, w * c, c)
    _n, c, d, h, w = t.shape
    return t.stride() == (d * h * w * c, 1, h * w * c, w * c, c)


def _ranked(model: nn.Module, fmt: torch.memory_format) -> list[torch.Tensor]:
    # a torch.compile'd OptimizedModule's parameters() include its `_orig_mod`'s
    tensors = itertools.chain(model.parameters(), model.buffers())
    return [t for t in tensors if not isinstance(t, _UNINITIALIZED) and t.dim() == _RANK[fmt]]


def is_channels_last(
    model: nn.Module, memory_format: torch.memory_format | str = torch.channels_last
) -> bool:
    """Whether every parameter and buffer of the format's rank (4-D or 5-D) is already in ``memory_format``."""
    fmt = _resolve_format(memory_format)
    return all(_in_format(t, fmt) for t in _ranked(model, fmt))


def apply_channels_last(
    model: nn.Module, memory_format: torch.memory_format | str = torch.channels_last
) -> nn.Module:
    """Convert ``model``'s 4-D (or 5-D) parameters, their gradients and buffers to channels_last, in place.

    Parameters keep their identity (only ``.data`` changes); tensors of other ranks are left alone.

    Args:
        model: the module (a ``LightningModule``, a plain ``nn.Module`` or an ``OptimizedModule``).
        memory_format: ``"channels_last"`` (4-D tensors, Conv2d) or ``"channels_last_3d"`` (5-D, Conv3d), or
            the ``torch.memory_format``.

    Returns:
        The same ``model``; without a matching convolution unchanged, with a warning (once a process).
    """
    fmt = _resolve_format(memory_format)
    check_arg(isinstance(model, nn.Module), "model", model, "a torch.nn.Module", error=TypeError)
    if not has_conv(model, _CONV_DIMS[fmt]):
        _no_conv_warning("apply_channels_last", model, fmt, "the model was left unchanged.")
        return model
    with torch.no_grad():
        for t in _ranked(model, fmt):
            if not _in_format(t, fmt):
                t.data = torch.empty_like(t.data, memory_format=fmt).copy_(t.data)
            grad = t.grad
            if grad is not None and not _in_format(grad, fmt):
                t.grad = torch.empty_like(grad, memory_format=fmt).copy_(grad)
    return model


def to_channels_last(data: Any, memory_format: torch.memory_format | str = torch.channels_last) -> Any:
    """``data`` (a tensor or a collection of them) with its floating tensors of the format's rank converted;
    those already in the format are returned as they are (no copy)."""
    fmt = _resolve_format(memory_format)
    return apply_to_collection(data, torch.Tensor, _converter(fmt, []))


def _converter(fmt: torch.memory_format, converted: list[bool]) -> Any:
    def convert(t: torch.Tensor) -> torch.Tensor:
        # layout checks read metadata only: no device work, no sync
        if t.dim() == _RANK[fmt] and t.is_floating_point() and not t.is_contiguous(memory_format=fmt):
            converted.append(True)
            return t.contiguous(memory_format=fmt)
        return t

    return convert


class ChannelsLast(pl.Callback):
    """Train in channels_last: the model is converted at ``setup``, before the strategy wraps it in
    ``DistributedDataParallel``, and ``forward``'s inputs by a pre-hook (removed at ``teardown``).

    Steps aside, warning once, for a model without Conv2d (Conv3d for ``channels_last_3d``) or a device other
    than CUDA and CPU. Layers built in ``configure_model`` are converted at ``on_fit_start`` (and the other
    stages' starts) where the strategy has not wrapped the model; otherwise a warning names the fix.

    Args:
        memory_format: ``"channels_last"`` (4-D, Conv2d models) or ``"channels_last_3d"`` (5-D, Conv3d
            models); a ``torch.memory_format`` is accepted too.
        convert_inputs: also convert ``forward``'s tensor arguments (off: the first convolution converts its
            input itself and keeps that copy for backward).

    Attributes:
        active: whether the model was converted in the current (or last) run.
        inputs_converted: how many ``forward`` calls had an input that needed converting.

    Example::

        trainer = Trainer(precision="16-mixed", callbacks=[ChannelsLast()])
    """

    def __init__(
        self, memory_format: torch.memory_format | str = "channels_last", convert_inputs: bool = True
    ) -> None:
        super().__init__()
        self._format = _resolve_format(memory_format)
        check_bool(convert_inputs, "convert_inputs")
        self.memory_format = "channels_last" if self._format == torch.channels_last else "channels_last_3d"
        self.convert_inputs = convert_inputs
        self.active = False
        self.inputs_converted = 0
        self._pending = False
        self._handle: RemovableHandle | None = None

    @property
    @override
    def state_key(self) -> str:
        # two instances (e.g. a 2-D and a 3-D one) may coexist in one Trainer
        return self._generate_state_key(memory_format=self.memory_format)

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
        elif has_conv(pl_module, _CONV_DIMS[self._format]):
            self._activate(pl_module)
        else:  # maybe built later in `configure_model`: decide once the strategy has set the model up
            self._pending = True

    def _activate(self, pl_module: pl.LightningModule) -> None:
        apply_channels_last(pl_module, self._format)
        self.active = True
        if self.convert_inputs and self._handle is None:
            self._handle = pl_module.register_forward_pre_hook(self._convert_inputs, with_kwargs=True)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Layers created after `setup` (in `configure_model`). Converting them under a wrapper such as DDP
        # would leave its gradient buckets laid out for the old strides: only an unwrapped model is converted.
        if not (self._pending or (self.active and not is_channels_last(pl_module, self._format))):
            return
        pending, self._pending = self._pending, False
        if pending and not has_conv(pl_module, _CONV_DIMS[self._format]):
            _no_conv_warning(
                "ChannelsLast",
                pl_module,
                self._format,
                "the callback does nothing. Remove it to silence this warning.",
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
        converted: list[bool] = []
        new_args, new_kwargs = apply_to_collection(
            (args, kwargs), torch.Tensor, _converter(self._format, converted)
        )
        self.inputs_converted += int(bool(converted))
        return new_args, new_kwargs

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"memory_format": self.memory_format, "inputs_converted": self.inputs_converted}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # the format is the constructor's; only the statistic carries over
        self.inputs_converted = int(state_dict.get("inputs_converted", 0))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handle"] = None  # a hook handle belongs to one process's module
        return state
