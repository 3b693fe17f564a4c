"""``fast_trainer_kwargs``: the one-line preset that composes every compute setting for a ``Trainer``.

::

    trainer = Trainer(**fast_trainer_kwargs(model, max_epochs=10))

Precision has to be a ``Trainer`` argument (Lightning builds its precision plugin in ``Trainer.__init__``;
a callback comes too late), so the preset is a function returning ``Trainer`` keyword arguments rather
than a callback. It is the only piece with a process-wide side effect: on CUDA it enables TF32 (see
``configure_backends``), as ``torch.set_float32_matmul_precision`` is meant to be called once at the top of
a script.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from lightning_gpuopt._checks import check_arg
from lightning_gpuopt.compute._model import family, has_conv
from lightning_gpuopt.compute.channels_last import ChannelsLast
from lightning_gpuopt.compute.compile import COMPILE_COST, MIN_CAPABILITY, CompileModel
from lightning_gpuopt.compute.ddp import NonBlockingStepChecks
from lightning_gpuopt.compute.optimizer import FusedOptimizer
from lightning_gpuopt.compute.precision import configure_backends, precision_and_reason, resolve_device

__all__ = ["PRESET_DDP_KWARGS", "fast_trainer_kwargs"]

#: What ``fast_trainer_kwargs(..., strategy="ddp")`` passes to ``DDPStrategy``: gradients live in DDP's
#: all-reduce buckets (no copy into them after backward, one copy of the gradients in memory).
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

    def add(callback_type: type, make: Any, why: str) -> None:
        if not any(isinstance(c, callback_type) for c in callbacks):
            callbacks.append(make())
            said.append(f"{callback_type.__name__} ({why})")

    if (model is None or has_conv(model, dims=2)) and dev.type in ("cuda", "cpu"):
        add(ChannelsLast, ChannelsLast, "Conv2d layers" if model is not None else "no model given")
    elif dev.type in ("cuda", "cpu"):
        said.append("no ChannelsLast (no Conv2d layer)")
    if ddp:
        add(NonBlockingStepChecks, NonBlockingStepChecks, "DDP")
    if fused_optimizer and precision in ("16-mixed", "16"):
        add(FusedOptimizer, FusedOptimizer, "16-mixed: no GradScaler host sync")
    elif fused_optimizer and precision == "bf16-mixed" and dev.type == "cuda":
        add(
            FusedOptimizer, FusedOptimizer, "bf16-mixed on CUDA: one kernel for each parameter group's update"
        )
    kind = None if model is None else family(model)
    if compile:
        add(CompileModel, CompileModel, "compile=True")
    elif (
        compile is None
        and dev.type == "cuda"
        and tuple(torch.cuda.get_device_capability(dev)) >= MIN_CAPABILITY
    ):
        if model is None or kind is not None:
            seconds, saving = COMPILE_COST[kind or "conv"]
            why = f"{kind or 'no model given'}: compiles when over {seconds / saving:.0f} s of eager training"
            why += " is left, a break-even assumed until this model's compile is measured on this GPU"
            add(CompileModel, lambda: CompileModel(when="auto"), why)
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
    """``Trainer`` keyword arguments for the fastest compute on ``device``: the one-line preset.

    ``Trainer(**fast_trainer_kwargs(model, max_epochs=10))`` gives:

    - ``precision=choose_precision(device, model)`` (``"16-mixed"`` for a conv net on a recent GPU,
      ``"bf16-mixed"`` for a transformer, a ViT included),
    - ``benchmark=True`` on CUDA (Lightning sets ``cudnn.benchmark``), unless ``deterministic`` is asked for,
    - a ``ChannelsLast()`` callback when the model has a Conv2d (or is not given), on CUDA and CPU,
    - a ``FusedOptimizer()`` callback when the precision is ``"16-mixed"`` (the optimizers run their fused
      kernels, so the GradScaler never makes the host wait for the GPU), or ``"bf16-mixed"`` on CUDA (one
      kernel updates a parameter group instead of one for each tensor and operation),
    - a ``CompileModel`` callback: ``compile=None`` adds ``CompileModel(when="auto")`` for a conv net or a
      transformer (or no model given) on a CUDA device of compute capability >= 7.0, which compiles where
      ``should_compile`` finds the run long enough to win back the compile time; ``True`` adds
      ``CompileModel()`` (any device, the CPU included); ``False`` adds nothing,
    - ``strategy="ddp"`` replaced by ``DDPStrategy(**PRESET_DDP_KWARGS)``, and a ``NonBlockingStepChecks()``
      callback (under DDP, Lightning's per-step SIGTERM check no longer makes the host wait for the GPU),
    - side effect, CUDA only: TF32 enabled process-wide via ``configure_backends(tf32=True)``.

    It logs one line (rank zero) naming each choice and the fact behind it, and what it left out. Any
    keyword you pass wins over the preset's (``callbacks`` are merged, keeping yours first; a callback of a
    class the preset adds is not added twice; a ``Strategy`` object or another strategy name is kept). From
    ``LightningCLI``, write the same in the config; see ``docs/compute.md``.

    Args:
        model: the model to be trained (a ``LightningModule`` or ``nn.Module``); drives the precision choice
            and whether channels_last and compiling can pay.
        device: the training device; ``None`` is the current CUDA device if any, else the CPU.
        tf32: enable TF32 on CUDA (process-wide side effect); ``False`` leaves the flags alone.
        fused_optimizer: add ``FusedOptimizer()`` under ``"16-mixed"``, and ``"bf16-mixed"`` on CUDA;
            ``False`` leaves optimizers alone.
        compile: ``None`` compile where the rule says it pays, ``True`` always, ``False`` never.
        **trainer_kwargs: any other ``Trainer`` arguments, returned merged.

    Example::

        trainer = Trainer(**fast_trainer_kwargs(model, max_epochs=90, devices=2, strategy="ddp"))
    """
    check_arg(
        compile is None or isinstance(compile, bool),
        "compile",
        compile,
        "True, False or None",
        error=TypeError,
    )
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

    callbacks = trainer_kwargs.pop("callbacks", None)
    if callbacks is None:
        callbacks = []
    elif not isinstance(callbacks, (list, tuple)):
        callbacks = [callbacks]
    callbacks = list(callbacks)
    kwargs["callbacks"] = callbacks
    if "precision" in trainer_kwargs and str(trainer_kwargs["precision"]) != precision:
        said[0] = f"precision={trainer_kwargs['precision']!r} (yours)"
    kwargs.update(trainer_kwargs)
    ddp = isinstance(trainer_kwargs.get("strategy"), DDPStrategy)
    _add_callbacks(callbacks, said, model, dev, str(kwargs.get("precision")), ddp, fused_optimizer, compile)
    rank_zero_info("fast_trainer_kwargs: " + ", ".join(said))
    return kwargs
