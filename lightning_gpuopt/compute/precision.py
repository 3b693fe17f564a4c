"""Choose the compute settings a device runs fastest with: precision, TF32, cuDNN autotuning, channels_last,
fused optimizers, ``torch.compile`` and DDP's settings.

``fast_trainer_kwargs`` is the one-line preset::

    trainer = Trainer(**fast_trainer_kwargs(model, max_epochs=10))

Precision has to be a ``Trainer`` argument (Lightning builds its precision plugin in ``Trainer.__init__``;
a callback comes too late), so the preset is a function returning ``Trainer`` keyword arguments rather
than a callback. It is the only piece with a process-wide side effect: on CUDA it enables TF32 (see
``configure_backends``), as ``torch.set_float32_matmul_precision`` is meant to be called once at the top of
a script.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from lightning_gpuopt._compat import cpu_has_fast_bf16

ModelFamily = Literal["conv", "transformer"]
_FAMILIES = ("conv", "transformer")

# Layers whose presence makes a model a "conv net" for the precision and compile rules.
_CONV_TYPES: tuple[type[nn.Module], ...] = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)


def _resolve_device(device: str | int | torch.device | None) -> torch.device:
    if device is None:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    if isinstance(device, int):
        return torch.device("cuda", device)
    if isinstance(device, (str, torch.device)):
        try:
            return torch.device(device)
        except RuntimeError as err:
            raise ValueError(
                f"device={device!r} is not a torch device string (e.g. 'cuda:0' or 'cpu')."
            ) from err
    raise TypeError(f"device must be a str, int, torch.device or None, got {type(device).__name__}")


def _family(model: nn.Module | None, model_family: str | None) -> str | None:
    if model_family is not None:
        if model_family not in _FAMILIES:
            raise ValueError(
                f"model_family={model_family!r} is not supported; use one of {_FAMILIES} or None."
            )
        return model_family
    if model is None:
        return None
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    return "conv" if is_convnet(model) else "transformer"


def is_convnet(model: nn.Module) -> bool:
    """Whether ``model`` has a convolution layer (``Conv1d``/``2d``/``3d`` or a transposed one)."""
    return any(isinstance(m, _CONV_TYPES) for m in model.modules())


def choose_precision(
    device: str | int | torch.device | None = None,
    model: nn.Module | None = None,
    model_family: ModelFamily | None = None,
) -> str:
    """Return the Lightning ``precision`` string that trains fastest on ``device`` without losing stability.

    ============================  =================  ==========================================================
    device                        model              precision
    ============================  =================  ==========================================================
    CUDA, compute capability <7   any                ``"32-true"`` (no tensor cores; autocast only adds casts)
    CUDA 7.x (Volta, Turing)      any                ``"16-mixed"`` (no bf16 hardware)
    CUDA >= 8.0 (Ampere, Hopper)  conv net           ``"16-mixed"``: fp16 convolutions train faster than bf16
                                                     ones (``docs/compute.md``)
    CUDA >= 8.0                   no convolution,    ``"bf16-mixed"``: same tensor-core rate for matmuls, fp32's
                                  or unknown         range (no loss scaling, no overflow in attention logits)
    CPU with AVX512-BF16 or AMX   any                ``"bf16-mixed"``
    other CPU, other devices      any                ``"32-true"``
    ============================  =================  ==========================================================

    Args:
        device: the training device (``"cuda:0"``, an index, a ``torch.device``); ``None`` is the current CUDA
            device if there is one, else the CPU. Under multi-GPU, pass one of them (devices are assumed alike).
        model: the model; any ``Conv*d`` layer makes it a conv net.
        model_family: ``"conv"`` or ``"transformer"``; overrides what ``model`` suggests.

    Example::

        choose_precision("cuda:0", model)   # "16-mixed" for a conv net on compute capability >= 7.0
    """
    dev = _resolve_device(device)
    family = _family(model, model_family)
    if dev.type == "cpu":
        return "bf16-mixed" if cpu_has_fast_bf16() else "32-true"
    if dev.type != "cuda":
        return "32-true"
    major, _minor = torch.cuda.get_device_capability(dev)
    if major < 7:
        return "32-true"
    if major < 8:
        return "16-mixed"
    return "16-mixed" if family == "conv" else "bf16-mixed"


@dataclass(frozen=True)
class BackendSettings:
    """The process-wide backend flags ``configure_backends`` touches; ``restore()`` puts them back.

    Example::

        previous = configure_backends()
        ...
        previous.restore()
    """

    float32_matmul_precision: str
    cudnn_allow_tf32: bool
    cudnn_benchmark: bool

    def restore(self) -> None:
        """Set the flags back to these values."""
        torch.set_float32_matmul_precision(self.float32_matmul_precision)
        torch.backends.cudnn.allow_tf32 = self.cudnn_allow_tf32
        torch.backends.cudnn.benchmark = self.cudnn_benchmark


def _current_backends() -> BackendSettings:
    return BackendSettings(
        float32_matmul_precision=torch.get_float32_matmul_precision(),
        cudnn_allow_tf32=bool(torch.backends.cudnn.allow_tf32),
        cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
    )


def configure_backends(tf32: bool | None = True, cudnn_benchmark: bool | None = True) -> BackendSettings:
    """Enable TF32 for fp32 matmuls and convolutions and cuDNN autotuning; return the previous settings.

    TF32 keeps fp32's range with a 10-bit mantissa and runs fp32 work on tensor cores (about twice fp32's
    rate for a ResNet). It matters for ``"32-true"`` and for the ops autocast keeps in fp32.
    ``cudnn.benchmark`` times the convolution algorithms once per input shape; it pays when shapes repeat
    (fixed image size, ``drop_last``), and costs a re-tune for every new shape otherwise.

    Args:
        tf32: ``True`` sets ``torch.set_float32_matmul_precision("high")`` and ``cudnn.allow_tf32``;
            ``False`` sets ``"highest"`` and disallows it; ``None`` leaves both alone.
        cudnn_benchmark: value for ``torch.backends.cudnn.benchmark``; ``None`` leaves it alone. In a
            ``Trainer``, prefer its own ``benchmark=`` argument, which sets the same flag.

    Returns:
        The settings before the call; ``configure_backends(...).restore()`` undoes it.
    """
    for name, value in (("tf32", tf32), ("cudnn_benchmark", cudnn_benchmark)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be True, False or None, got {value!r}")
    previous = _current_backends()
    if tf32 is not None:
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = tf32
    if cudnn_benchmark is not None:
        torch.backends.cudnn.benchmark = cudnn_benchmark
    return previous


#: What ``fast_trainer_kwargs(..., strategy="ddp")`` passes to ``DDPStrategy``: gradients live in DDP's
#: all-reduce buckets (no copy into them after backward, one copy of the gradients in memory).
PRESET_DDP_KWARGS: dict[str, Any] = {"gradient_as_bucket_view": True}


def _cuda_capability(dev: torch.device) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(dev)
    return int(major), int(minor)


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

    - ``precision=choose_precision(device, model)`` (``"16-mixed"`` for a conv net on a recent GPU),
    - ``benchmark=True`` on CUDA (Lightning sets ``cudnn.benchmark``), unless ``deterministic`` is asked for,
    - a ``ChannelsLast()`` callback when the model has a Conv2d (or is not given), on CUDA and CPU,
    - a ``FusedOptimizer()`` callback when the precision is ``"16-mixed"``: the optimizers run their fused
      kernels, so the GradScaler never makes the host wait for the GPU,
    - a ``CompileModel`` callback (``torch.compile`` of ``forward``): ``compile=None`` adds
      ``CompileModel(when="auto")`` for a model with a convolution (or no model given) on a CUDA device of
      compute capability >= 7.0, which compiles where ``should_compile`` finds that the run is long enough
      to win back the compile time (about 300 s of eager training); ``True`` adds ``CompileModel()``
      (compile on any device, the CPU included); ``False`` adds nothing,
    - ``strategy="ddp"`` replaced by ``DDPStrategy(**PRESET_DDP_KWARGS)``, and a ``NonBlockingStepChecks()``
      callback (under DDP, Lightning's per-step SIGTERM check no longer makes the host wait for the GPU),
    - side effect, CUDA only: TF32 enabled process-wide via ``configure_backends(tf32=True)``.

    Any keyword you pass wins over the preset's (``callbacks`` are merged, keeping yours first; a callback
    of a class the preset adds is not added twice; a ``Strategy`` object or another strategy name is kept).
    From ``LightningCLI``, write the same in the config; see ``docs/compute.md``.

    Args:
        model: the model to be trained (a ``LightningModule`` or ``nn.Module``); drives the precision choice
            and whether channels_last and compiling can pay.
        device: the training device; ``None`` is the current CUDA device if any, else the CPU.
        tf32: enable TF32 on CUDA (process-wide side effect); ``False`` leaves the flags alone.
        fused_optimizer: add ``FusedOptimizer()`` under ``"16-mixed"``; ``False`` leaves optimizers alone.
        compile: ``None`` compile where the rule says it pays, ``True`` always, ``False`` never.
        **trainer_kwargs: any other ``Trainer`` arguments, returned merged.

    Example::

        trainer = Trainer(**fast_trainer_kwargs(model, max_epochs=90, devices=2, strategy="ddp"))
    """
    from lightning_gpuopt.compute.channels_last import ChannelsLast, has_conv
    from lightning_gpuopt.compute.compile import MIN_CAPABILITY, CompileModel
    from lightning_gpuopt.compute.ddp import NonBlockingStepChecks
    from lightning_gpuopt.compute.optimizer import FusedOptimizer

    if compile is not None and not isinstance(compile, bool):
        raise TypeError(f"compile must be True, False or None, got {compile!r}")
    dev = _resolve_device(device)
    kwargs: dict[str, Any] = {"precision": choose_precision(dev, model)}
    if dev.type == "cuda":
        if not trainer_kwargs.get("deterministic"):
            kwargs["benchmark"] = True
        if tf32:
            configure_backends(tf32=True, cudnn_benchmark=None)
    if trainer_kwargs.get("strategy") == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        trainer_kwargs["strategy"] = DDPStrategy(**PRESET_DDP_KWARGS)

    callbacks = trainer_kwargs.pop("callbacks", None)
    if callbacks is None:
        callbacks = []
    elif not isinstance(callbacks, (list, tuple)):
        callbacks = [callbacks]
    callbacks = list(callbacks)

    def add(callback_type: type, make: Any) -> None:
        if not any(isinstance(c, callback_type) for c in callbacks):
            callbacks.append(make())

    if (model is None or has_conv(model)) and dev.type in ("cuda", "cpu"):
        add(ChannelsLast, ChannelsLast)
    from lightning.pytorch.strategies import DDPStrategy

    if isinstance(trainer_kwargs.get("strategy"), DDPStrategy):
        add(NonBlockingStepChecks, NonBlockingStepChecks)
    kwargs["callbacks"] = callbacks
    kwargs.update(trainer_kwargs)
    if fused_optimizer and str(kwargs.get("precision")) in ("16-mixed", "16"):
        add(FusedOptimizer, FusedOptimizer)
    if compile:
        add(CompileModel, CompileModel)
    elif (
        compile is None
        and dev.type == "cuda"
        and (model is None or is_convnet(model))
        and _cuda_capability(dev) >= MIN_CAPABILITY
    ):
        add(CompileModel, lambda: CompileModel(when="auto"))
    return kwargs
