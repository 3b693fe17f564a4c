"""Optional dependencies: availability flags and imports that name the extra to install.

Nothing here imports an optional package at module import time; ``RequirementCache`` only looks up
distribution metadata.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from lightning_utilities.core.imports import RequirementCache

# distribution requirement, import name, extra that provides it
_OPTIONAL: dict[str, tuple[str, str, str]] = {
    "pynvml": ("nvidia-ml-py", "pynvml", "nvml"),
    "nvtx": ("nvtx", "nvtx", "nvtx"),
    "h5py": ("h5py", "h5py", "hdf5"),
    "tensorboard": ("tensorboard", "tensorboard", "tensorboard"),
    "torchvision": ("torchvision", "torchvision", "vision"),
    "matplotlib": ("matplotlib", "matplotlib", "plot"),
}

_H5PY_AVAILABLE = RequirementCache(module="h5py")
_TENSORBOARD_AVAILABLE = RequirementCache(module="tensorboard")
_TORCHVISION_AVAILABLE = RequirementCache(module="torchvision")
_DALI_AVAILABLE = RequirementCache(module="nvidia.dali")


def require(name: str) -> ModuleType:
    """Import an optional dependency or raise ``ModuleNotFoundError`` naming the extra to install.

    Args:
        name: one of ``pynvml``, ``nvtx``, ``h5py``, ``tensorboard``, ``torchvision``, ``matplotlib``.
    """
    dist, module, extra = _OPTIONAL[name]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"{module!r} is not installed. Install it with `pip install 'lightning-gpuopt[{extra}]'` "
            f"(or `pip install {dist}`)."
        ) from err


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
