"""Optional dependencies: availability flags (no import) and imports that name the extra to install."""

from __future__ import annotations

import importlib
import importlib.util
from importlib import metadata
from types import ModuleType

from lightning_utilities.core.imports import RequirementCache

# import name -> distribution requirement, extra that provides it
_OPTIONAL: dict[str, tuple[str, str]] = {
    "pynvml": ("nvidia-ml-py", "nvml"),
    "nvtx": ("nvtx", "nvtx"),
    "h5py": ("h5py", "hdf5"),
    "tensorboard": ("tensorboard", "tensorboard"),
    "torchvision": ("torchvision", "vision"),
    "matplotlib": ("matplotlib", "plot"),
}

_H5PY_AVAILABLE = RequirementCache(module="h5py")
_TENSORBOARD_AVAILABLE = RequirementCache(module="tensorboard")
_TORCHVISION_AVAILABLE = RequirementCache(module="torchvision")
_DALI_AVAILABLE = RequirementCache(module="nvidia.dali")


def require(name: str) -> ModuleType:
    """Import the optional dependency ``name`` (a key of ``_OPTIONAL``) or raise ``ModuleNotFoundError`` naming
    the extra to install."""
    dist, extra = _OPTIONAL[name]
    broken = torchvision_problem() if name == "torchvision" else None  # installed, built for another torch
    if broken is not None:
        raise ImportError(broken)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"{name!r} is not installed. Install it with `pip install 'lightning-gpuopt[{extra}]'` "
            f"(or `pip install {dist}`)."
        ) from err


def torchvision_mismatch(err: BaseException) -> str:
    """One line: the installed torchvision cannot be imported with this torch (it fails as ``err``, and takes
    ``import lightning.pytorch`` down through torchmetrics), and the pip command that installs the right one."""
    import torch

    try:
        installed = f"torchvision {metadata.version('torchvision')}"
    except metadata.PackageNotFoundError:
        installed = "the installed torchvision"
    release, _, build = torch.__version__.partition("+")
    major, _, rest = release.partition(".")
    minor = rest.partition(".")[0]
    # the torchvision made for torch 2.x is 0.(x + 15): torch 2.13 pairs with torchvision 0.28
    pair = f"torchvision==0.{int(minor) + 15}.*" if major == "2" and minor.isdigit() else "torchvision"
    # a local build label (cpu, cu130, rocm6.4) names PyTorch's own index of that build
    index = f" --index-url https://download.pytorch.org/whl/{build}" if build else ""
    reason = (str(err).strip().splitlines() or [type(err).__name__])[-1]
    return (
        f"{installed} cannot be imported with torch {torch.__version__} ({type(err).__name__}: {reason}): "
        f"it was built for another torch release or build (CUDA or CPU). Install the one made for this "
        f'torch: pip install --force-reinstall --no-deps "{pair}"{index} (or pip uninstall torchvision: '
        "lightning-gpuopt needs it only for torchvision's models, such as bench --model resnet50)"
    )


def torchvision_problem() -> str | None:
    """``torchvision_mismatch`` of an installed torchvision that fails to import, else ``None`` (it imports
    torchvision, as ``import lightning.pytorch`` does: call it before importing Lightning)."""
    if importlib.util.find_spec("torchvision") is None:
        return None
    try:
        importlib.import_module("torchvision")
    except Exception as err:  # any failure of an installed torchvision ends every Lightning import
        return torchvision_mismatch(err)
    return None


def require_dali() -> ModuleType:
    """Import ``nvidia.dali`` or raise ``ModuleNotFoundError`` naming the extra for each CUDA major."""
    try:
        return importlib.import_module("nvidia.dali")
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            "NVIDIA DALI is not installed. Install the build matching your CUDA driver: "
            "`pip install 'lightning-gpuopt[dali]'` for CUDA 12 (nvidia-dali-cuda120) or "
            "`pip install 'lightning-gpuopt[dali-cu13]'` for CUDA 13 (nvidia-dali-cuda130)."
        ) from err
