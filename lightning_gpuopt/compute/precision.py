"""The precision rule: which Lightning ``precision`` a device and model train fastest with
(``choose_precision``), and the process-wide fp32 settings that go with it, TF32 and cuDNN autotuning
(``configure_backends``).

``fast_trainer_kwargs`` (``lightning_gpuopt.compute.preset``) applies both with the other compute settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from lightning_gpuopt._checks import check_arg, is_int
from lightning_gpuopt._compat import cpu_has_fast_bf16
from lightning_gpuopt.compute import _model

ModelFamily = Literal["conv", "transformer"]
_FAMILIES = ("conv", "transformer")


def resolve_device(device: str | int | torch.device | None) -> torch.device:
    """The ``torch.device`` that ``device`` names: ``None`` is the current CUDA device if there is one, else the
    CPU; an ``int`` is a CUDA index."""
    if device is None:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    if is_int(device):
        return torch.device("cuda", device)
    check_arg(
        isinstance(device, (str, torch.device)),
        "device",
        device,
        "a str, int, torch.device or None",
        error=TypeError,
    )
    check_arg(
        _is_device_string(device), "device", device, "a torch device string", fix="e.g. 'cuda:0' or 'cpu'"
    )
    return torch.device(device)


def _is_device_string(device: str | torch.device) -> bool:
    try:
        torch.device(device)
    except RuntimeError:
        return False
    return True


def _family(model: nn.Module | None, model_family: str | None) -> str | None:
    if model_family is not None:
        check_arg(model_family in _FAMILIES, "model_family", model_family, "'conv', 'transformer' or None")
        return model_family
    if model is None:
        return None
    check_arg(isinstance(model, nn.Module), "model", model, "a torch.nn.Module or None", error=TypeError)
    return _model.family(model)


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
    CUDA >= 8.0                   transformer (ViT   ``"bf16-mixed"``: same tensor-core rate for matmuls, fp32's
                                  too), no conv,     range (no loss scaling, no overflow in attention logits)
                                  or unknown
    CPU with AVX512-BF16 or AMX   any                ``"bf16-mixed"``
    other CPU, other devices      any                ``"32-true"``
    ============================  =================  ==========================================================

    Args:
        device: the training device (``"cuda:0"``, an index, a ``torch.device``); ``None`` is the current CUDA
            device if there is one, else the CPU. Under multi-GPU, pass one of them (devices are assumed alike).
        model: the model; an attention layer makes it a transformer (a ViT's patch convolution does not make
            it a conv net), else any ``Conv*d`` layer a conv net (``_model.family``).
        model_family: ``"conv"`` or ``"transformer"``; overrides what ``model`` suggests.

    Example::

        choose_precision("cuda:0", model)   # "16-mixed" for a conv net on compute capability >= 7.0
    """
    return precision_and_reason(device, model, model_family)[0]


def precision_and_reason(
    device: str | int | torch.device | None = None,
    model: nn.Module | None = None,
    model_family: ModelFamily | None = None,
) -> tuple[str, str]:
    """``choose_precision``'s answer and the fact that decided it, in a few words (what the preset logs)."""
    dev = resolve_device(device)
    family = _family(model, model_family)
    if dev.type == "cpu":
        if cpu_has_fast_bf16():
            return "bf16-mixed", "a CPU with AVX512-BF16 or AMX"
        return "32-true", "a CPU without fast bf16"
    if dev.type != "cuda":
        return "32-true", f"a {dev.type!r} device"
    major, minor = torch.cuda.get_device_capability(dev)
    gpu = f"compute capability {major}.{minor}"
    if major < 7:
        return "32-true", f"{gpu}: no tensor cores"
    if major < 8:
        return "16-mixed", f"{gpu}: no bf16 hardware"
    if family == "conv":
        return "16-mixed", f"a conv net on {gpu}"
    if family == "transformer":
        what = "a transformer"
    else:
        what = "no model given" if model is None else "a model with no convolution or attention layer"
    return "bf16-mixed", f"{what} on {gpu}"


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
        check_arg(
            value is None or isinstance(value, bool), name, value, "True, False or None", error=TypeError
        )
    previous = _current_backends()
    if tf32 is not None:
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = tf32
    if cudnn_benchmark is not None:
        torch.backends.cudnn.benchmark = cudnn_benchmark
    return previous
