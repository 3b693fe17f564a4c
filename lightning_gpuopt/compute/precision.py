"""The precision rule: which Lightning ``precision`` a device and model train fastest with
(``choose_precision``), and the process-wide fp32 settings that go with it (``configure_backends``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_gpuopt._checks import check_arg, check_bool, check_choice, is_int
from lightning_gpuopt._compat import cpu_has_fast_bf16
from lightning_gpuopt.compute import _model


def resolve_device(device: str | int | torch.device | None) -> torch.device:
    """The ``torch.device`` that ``device`` names: ``None`` is the current CUDA device if there is one, else the
    CPU; an ``int`` is a CUDA index."""
    if device is None:
        cuda = torch.cuda.is_available()
        return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if is_int(device):
        return torch.device("cuda", device)
    must = "a str, int, torch.device or None"
    check_arg(isinstance(device, (str, torch.device)), "device", device, must, error=TypeError)
    try:
        return torch.device(device)
    except RuntimeError:
        check_arg(False, "device", device, "a torch device string", fix="e.g. 'cuda:0' or 'cpu'")
        raise


def choose_precision(
    device: str | int | torch.device | None = None,
    model: nn.Module | None = None,
    model_family: _model.Family | None = None,
) -> str:
    """Return the Lightning ``precision`` string that trains fastest on ``device`` without losing stability:
    ``"16-mixed"`` for a conv net on CUDA >= 7.0 (and anything on 7.x), ``"bf16-mixed"`` for other models on
    CUDA >= 8.0 and on CPUs with AVX512-BF16 or AMX, else ``"32-true"`` (the table in docs/compute.md).

    Args:
        device: the training device (``"cuda:0"``, an index, a ``torch.device``); ``None`` is the current CUDA
            device if there is one, else the CPU. Under multi-GPU, pass one of them (devices are assumed alike).
        model: the model; an attention layer makes it a transformer, else a ``Conv*d`` layer a conv net.
        model_family: ``"conv"`` or ``"transformer"``; overrides what ``model`` suggests.

    Example::

        choose_precision("cuda:0", model)   # "16-mixed" for a conv net on compute capability >= 7.0
    """
    return precision_and_reason(device, model, model_family)[0]


def precision_and_reason(
    device: str | int | torch.device | None = None,
    model: nn.Module | None = None,
    model_family: _model.Family | None = None,
) -> tuple[str, str]:
    """``choose_precision``'s answer and the fact that decided it, in a few words (what the preset logs)."""
    dev = resolve_device(device)
    family: str | None = model_family
    if model_family is not None:
        check_choice(model_family, "model_family", ("conv", "transformer"))
    elif model is not None:
        check_arg(isinstance(model, nn.Module), "model", model, "a torch.nn.Module or None", error=TypeError)
        family = _model.family(model)
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
    what = "no model given" if model is None else "a model with no convolution or attention layer"
    return "bf16-mixed", f"{'a transformer' if family == 'transformer' else what} on {gpu}"


@dataclass(frozen=True)
class BackendSettings:
    """The process-wide backend flags ``configure_backends`` touches; ``restore()`` puts them back."""

    float32_matmul_precision: str
    cudnn_allow_tf32: bool
    cudnn_benchmark: bool

    def restore(self) -> None:
        torch.set_float32_matmul_precision(self.float32_matmul_precision)
        torch.backends.cudnn.allow_tf32 = self.cudnn_allow_tf32
        torch.backends.cudnn.benchmark = self.cudnn_benchmark


def configure_backends(tf32: bool | None = True, cudnn_benchmark: bool | None = True) -> BackendSettings:
    """Enable TF32 for fp32 matmuls and convolutions and cuDNN autotuning; return the previous settings.

    Args:
        tf32: ``True`` sets ``torch.set_float32_matmul_precision("high")`` and ``cudnn.allow_tf32``;
            ``False`` sets ``"highest"`` and disallows it; ``None`` leaves both alone.
        cudnn_benchmark: value for ``torch.backends.cudnn.benchmark``; ``None`` leaves it alone.

    Returns:
        The settings before the call; ``configure_backends(...).restore()`` undoes it.
    """
    check_bool(tf32, "tf32", none_ok=True)
    check_bool(cudnn_benchmark, "cudnn_benchmark", none_ok=True)
    previous = BackendSettings(
        torch.get_float32_matmul_precision(),
        bool(torch.backends.cudnn.allow_tf32),
        bool(torch.backends.cudnn.benchmark),
    )
    if tf32 is not None:
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = tf32
    if cudnn_benchmark is not None:
        torch.backends.cudnn.benchmark = cudnn_benchmark
    return previous
