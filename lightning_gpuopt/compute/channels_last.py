"""channels_last memory format: convert a model once, before DDP wraps it, and its inputs on the way in.

Tensor-core convolutions (cuDNN) and oneDNN's CPU convolutions work in NHWC. A model left in the default
NCHW layout makes every convolution transpose its input and output, which costs a ResNet about half its
fp16 throughput on a recent GPU. ``apply_channels_last`` does the work (a pure function, testable without a
Trainer); ``ChannelsLast`` only adapts it to Lightning's hooks.
"""

from __future__ import annotations

from collections.abc import Iterator
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
# devices whose convolution kernels have a channels_last path (cuDNN, oneDNN)
_PAYING_DEVICES = ("cuda", "cpu")


_FORMAT_MUST = (
    "'channels_last' (4-D, Conv2d) or 'channels_last_3d' (5-D, Conv3d), by name or as a torch.memory_format"
)


def _resolve_format(memory_format: torch.memory_format | str) -> torch.memory_format:
    check_arg(
        isinstance(memory_format, (str, torch.memory_format)),
        "memory_format",
        memory_format,
        _FORMAT_MUST,
        error=TypeError,
    )
    fmt = (
        _FORMATS.get(memory_format.replace("torch.", "")) if isinstance(memory_format, str) else memory_format
    )
    known = isinstance(fmt, torch.memory_format) and fmt in _RANK
    check_arg(known, "memory_format", memory_format, _FORMAT_MUST)
    return cast(torch.memory_format, fmt)


def _format_name(fmt: torch.memory_format) -> str:
    return "channels_last" if fmt == torch.channels_last else "channels_last_3d"


def _tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    # parameters() and buffers() of a torch.compile'd OptimizedModule include its `_orig_mod`'s, because
    # the original module is a registered submodule: the same code converts both.
    yield from model.parameters()
    yield from model.buffers()


def _canonical_strides(size: torch.Size, fmt: torch.memory_format) -> tuple[int, ...]:
    # `is_contiguous(memory_format=...)` ignores the strides of size-1 dims, so a 1x1 conv weight in NCHW
    # passes it although its strides differ from the ones convolution backward gives its gradient. DDP
    # compares full strides (gradient buckets are laid out like the parameters), so compare them here.
    if fmt == torch.channels_last:
        _n, c, h, w = size
        return (h * w * c, 1, w * c, c)
    _n, c, d, h, w = size
    return (d * h * w * c, 1, h * w * c, w * c, c)


def _in_format(t: torch.Tensor, fmt: torch.memory_format) -> bool:
    return t.stride() == _canonical_strides(t.shape, fmt)


def is_channels_last(
    model: nn.Module, memory_format: torch.memory_format | str = torch.channels_last
) -> bool:
    """Whether every parameter and buffer of the format's rank (4-D or 5-D) is already in ``memory_format``."""
    fmt = _resolve_format(memory_format)
    rank = _RANK[fmt]
    return all(
        _in_format(t, fmt) for t in _tensors(model) if not isinstance(t, _UNINITIALIZED) and t.dim() == rank
    )


def apply_channels_last(
    model: nn.Module, memory_format: torch.memory_format | str = torch.channels_last
) -> nn.Module:
    """Convert ``model``'s 4-D (or 5-D) parameters, their gradients and buffers to channels_last, in place.

    Parameters keep their identity (only ``.data`` changes, as ``Module.to`` does), so an optimizer that
    already holds them stays valid. Works on ``torch.compile``'d modules (their ``_orig_mod`` is converted);
    converting before compiling avoids one recompilation. Tensors of other ranks are left alone, so a model
    mixing Conv2d and Conv3d can be converted for one of them (``Module.to(memory_format=...)`` would raise).

    Args:
        model: the module (a ``LightningModule``, a plain ``nn.Module`` or an ``OptimizedModule``).
        memory_format: ``torch.channels_last`` (4-D tensors; for Conv2d models) or ``torch.channels_last_3d``
            (5-D tensors; for Conv3d models), or their names as strings.

    Returns:
        The same ``model``. Without a matching convolution it is returned unchanged and a warning says why
        (once a process).
    """
    fmt = _resolve_format(memory_format)
    check_arg(isinstance(model, nn.Module), "model", model, "a torch.nn.Module", error=TypeError)
    if not has_conv(model, _CONV_DIMS[fmt]):
        conv = "Conv2d" if fmt == torch.channels_last else "Conv3d"
        warn_once(
            f"apply_channels_last: {type(model).__name__} has no {conv} layer, so {_format_name(fmt)} cannot "
            "speed it up; the model was left unchanged."
        )
        return model
    rank = _RANK[fmt]
    with torch.no_grad():
        for t in _tensors(model):
            if isinstance(t, _UNINITIALIZED) or t.dim() != rank:
                continue
            if not _in_format(t, fmt):
                t.data = torch.empty_like(t.data, memory_format=fmt).copy_(t.data)
            grad = t.grad
            if grad is not None and not _in_format(grad, fmt):
                t.grad = torch.empty_like(grad, memory_format=fmt).copy_(grad)
    return model


def to_channels_last(data: Any, memory_format: torch.memory_format | str = torch.channels_last) -> Any:
    """Return ``data`` (a tensor or a collection of them) with floating tensors of the format's rank converted.

    Tensors already in the format are returned as they are (no copy), so batches that arrive channels_last,
    as ``OptimizedDataModule``'s and DALI's do, are not converted twice.
    """
    fmt = _resolve_format(memory_format)
    rank = _RANK[fmt]

    def convert(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == rank and t.is_floating_point() and not t.is_contiguous(memory_format=fmt):
            return t.contiguous(memory_format=fmt)
        return t

    return apply_to_collection(data, torch.Tensor, convert)


class ChannelsLast(pl.Callback):
    """Train in channels_last: the model is converted at ``setup`` and its inputs on the way into ``forward``.

    ``setup`` runs before the strategy moves the model to its device and wraps it in
    ``DistributedDataParallel``, so DDP's gradient buckets are laid out for the converted parameters. Inputs
    are converted by a forward pre-hook on the ``LightningModule`` (removed at ``teardown``): 4-D floating
    tensors among ``forward``'s arguments that are not channels_last yet are made so; batches already in the
    format pass untouched. The callback steps aside (warning once) where it cannot pay: a model without
    Conv2d (Conv3d for ``channels_last_3d``), or a device other than CUDA and CPU. On CPU it converts too:
    oneDNN's convolutions have a channels_last path.

    Layers created in ``LightningModule.configure_model`` do not exist yet at ``setup``. They are converted
    at ``on_fit_start`` (``on_validation_start``, ...) if the strategy has not wrapped the model; under DDP
    a warning names the fix (call ``apply_channels_last(self)`` at the end of ``configure_model``).

    Args:
        memory_format: ``"channels_last"`` (4-D, Conv2d models) or ``"channels_last_3d"`` (5-D, Conv3d
            models); a ``torch.memory_format`` is accepted too.
        convert_inputs: also convert ``forward``'s tensor arguments. Off, the first convolution converts its
            input itself (its weight is channels_last), at the cost of keeping that copy for backward.

    Attributes:
        active: whether the model was converted in the current (or last) run.
        inputs_converted: how many ``forward`` calls had an input that needed converting. A count close to
            the number of steps means the data pipeline delivers NCHW batches; ``OptimizedDataModule``
            delivers channels_last ones.

    Logs nothing.

    Example::

        trainer = Trainer(precision="16-mixed", callbacks=[ChannelsLast()])
    """

    def __init__(
        self, memory_format: torch.memory_format | str = "channels_last", convert_inputs: bool = True
    ) -> None:
        super().__init__()
        self._format = _resolve_format(memory_format)
        check_bool(convert_inputs, "convert_inputs")
        self.memory_format = _format_name(self._format)
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

    # --- hooks -------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.active = False
        self._pending = False
        device = trainer.strategy.root_device
        if device.type not in _PAYING_DEVICES:
            warn_once(
                f"ChannelsLast: {device.type!r} devices have no channels_last convolution path that is known "
                "to pay; the callback does nothing. Remove it to silence this warning."
            )
            return
        if not has_conv(pl_module, _CONV_DIMS[self._format]):
            # maybe built later in `configure_model`: decide once the strategy has set the model up
            self._pending = True
            return
        self._activate(pl_module)

    def _activate(self, pl_module: pl.LightningModule) -> None:
        apply_channels_last(pl_module, self._format)
        self.active = True
        if self.convert_inputs and self._handle is None:
            self._handle = pl_module.register_forward_pre_hook(self._convert_inputs, with_kwargs=True)

    def _after_strategy_setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Layers created after `setup` (in `configure_model`). Converting them under a wrapper such as DDP
        # would leave its gradient buckets laid out for the old strides, so only an unwrapped model is
        # converted here.
        if not (self._pending or (self.active and not is_channels_last(pl_module, self._format))):
            return
        pending, self._pending = self._pending, False
        name = type(pl_module).__name__
        if pending and not has_conv(pl_module, _CONV_DIMS[self._format]):
            conv = "Conv2d" if self._format == torch.channels_last else "Conv3d"
            warn_once(
                f"ChannelsLast: {name} has no {conv} layer, so {self.memory_format} cannot speed it up; "
                "the callback does nothing. Remove it to silence this warning."
            )
        elif trainer.strategy.model is pl_module:
            self._activate(pl_module)
        else:
            warn_once(
                f"ChannelsLast: layers of {name} were created after setup (in `configure_model`) and the "
                "strategy has already wrapped the model, so they stay in the default layout. Call "
                "`apply_channels_last(self)` at the end of `configure_model`."
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._after_strategy_setup(trainer, pl_module)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._after_strategy_setup(trainer, pl_module)

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._after_strategy_setup(trainer, pl_module)

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._after_strategy_setup(trainer, pl_module)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _convert_inputs(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        rank = _RANK[self._format]
        converted = False

        def convert(t: torch.Tensor) -> torch.Tensor:
            nonlocal converted
            # layout checks read metadata only: no device work, no sync
            if t.dim() == rank and t.is_floating_point() and not t.is_contiguous(memory_format=self._format):
                converted = True
                return t.contiguous(memory_format=self._format)
            return t

        new_args = apply_to_collection(args, torch.Tensor, convert)
        new_kwargs = apply_to_collection(kwargs, torch.Tensor, convert)
        if converted:
            self.inputs_converted += 1
        return new_args, new_kwargs

    # --- state and pickling -------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"memory_format": self.memory_format, "inputs_converted": self.inputs_converted}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The format is the user's current choice (constructor); only the statistic carries over.
        self.inputs_converted = int(state_dict.get("inputs_converted", 0))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handle"] = None  # a hook handle belongs to one process's module
        return state
