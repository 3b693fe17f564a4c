"""``fast_trainer_kwargs``: the one-line preset that composes every compute setting for a ``Trainer`` (a
function: precision is a ``Trainer`` argument, which a callback would set too late)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from lightning_gpuopt._checks import check_bool
from lightning_gpuopt.compute._model import family, has_conv
from lightning_gpuopt.compute.channels_last import ChannelsLast
from lightning_gpuopt.compute.compile import COMPILE_COST, MIN_CAPABILITY, CompileModel
from lightning_gpuopt.compute.ddp import NonBlockingStepChecks
from lightning_gpuopt.compute.optimizer import FusedOptimizer
from lightning_gpuopt.compute.precision import configure_backends, precision_and_reason, resolve_device

__all__ = ["PRESET_DDP_KWARGS", "fast_trainer_kwargs"]

#: What ``fast_trainer_kwargs(..., strategy="ddp")`` passes to ``DDPStrategy``: gradients live in DDP's buckets.
PRESET_DDP_KWARGS: dict[str, Any] = {"gradient_as_bucket_view": True}


def _add_callbacks(
    callbacks: list[Any],
    said: list[str],
    model: nn.Module | None,
    dev: torch.device,
    precision: str,
    ddp: bool,
    fused_optimizer: bool,
    compile: bool | None,
) -> None:
    """Append the preset's callbacks of the classes ``callbacks`` lacks; ``said`` gets each one's reason."""

    def add(callback: Any, why: str) -> None:
        if not any(isinstance(c, type(callback)) for c in callbacks):
            callbacks.append(callback)
            said.append(f"{type(callback).__name__} ({why})")

    if (model is None or has_conv(model, dims=2)) and dev.type in ("cuda", "cpu"):
        add(ChannelsLast(), "Conv2d layers" if model is not None else "no model given")
    elif dev.type in ("cuda", "cpu"):
        said.append("no ChannelsLast (no Conv2d layer)")
    if ddp:
        add(NonBlockingStepChecks(), "DDP")
    if fused_optimizer and precision in ("16-mixed", "16"):
        add(FusedOptimizer(), "16-mixed: no GradScaler host sync")
    elif fused_optimizer and precision == "bf16-mixed" and dev.type == "cuda":
        add(FusedOptimizer(), "bf16-mixed on CUDA: one kernel for each parameter group's update")
    kind = None if model is None else family(model)
    if compile:
        add(CompileModel(), "compile=True")
    elif compile is None and dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= MIN_CAPABILITY:
        if model is None or kind is not None:
            seconds, saving = COMPILE_COST[kind or "conv"]
            why = f"{kind or 'no model given'}: compiles when over {seconds / saving:.0f} s of eager training"
            why += " is left, a break-even assumed until this model's compile is measured on this GPU"
            add(CompileModel(when="auto"), why)
        else:
            said.append("no CompileModel (no convolution or attention layer: not judged by the compile rule)")


def fast_trainer_kwargs(
    model: nn.Module | None = None,
    device: str | int | torch.device | None = None,
    *,
    tf32: bool = True,
    fused_optimizer: bool = True,
    compile: bool | None = None,
    **trainer_kwargs: Any,
) -> dict[str, Any]:
    """``Trainer`` keyword arguments for the fastest compute on ``device``, each choice logged in one line with
    its reason; any keyword you pass wins (``callbacks`` are merged, yours first; docs/compute.md).

    Args:
        model: the model to be trained; drives the precision and whether channels_last and compiling pay.
        device: the training device; ``None`` is the current CUDA device if any, else the CPU.
        tf32: enable TF32 on CUDA (process-wide side effect); ``False`` leaves the flags alone.
        fused_optimizer: add ``FusedOptimizer()`` under ``"16-mixed"``, and ``"bf16-mixed"`` on CUDA;
            ``False`` leaves optimizers alone.
        compile: ``None``: ``CompileModel(when="auto")`` for a conv net or a transformer on CUDA >= 7.0;
            ``True``: ``CompileModel()``; ``False``: none.
        **trainer_kwargs: any other ``Trainer`` arguments, returned merged.

    Example::

        trainer = Trainer(**fast_trainer_kwargs(model, max_epochs=90, devices=2, strategy="ddp"))
    """
    check_bool(compile, "compile", none_ok=True)
    dev = resolve_device(device)
    precision, why = precision_and_reason(dev, model)
    kwargs: dict[str, Any] = {"precision": precision}
    said = [f"precision={precision!r} ({why})"]
    if dev.type == "cuda":
        if not trainer_kwargs.get("deterministic"):
            kwargs["benchmark"] = True
        if tf32:
            configure_backends(tf32=True, cudnn_benchmark=None)
    if trainer_kwargs.get("strategy") == "ddp":
        trainer_kwargs["strategy"] = DDPStrategy(**PRESET_DDP_KWARGS)

    callbacks = trainer_kwargs.pop("callbacks", None) or []
    callbacks = kwargs["callbacks"] = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
    if "precision" in trainer_kwargs and str(trainer_kwargs["precision"]) != precision:
        said[0] = f"precision={trainer_kwargs['precision']!r} (yours)"
    kwargs.update(trainer_kwargs)
    ddp = isinstance(trainer_kwargs.get("strategy"), DDPStrategy)
    _add_callbacks(callbacks, said, model, dev, str(kwargs.get("precision")), ddp, fused_optimizer, compile)
    rank_zero_info("fast_trainer_kwargs: " + ", ".join(said))
    return kwargs
