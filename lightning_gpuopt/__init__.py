"""lightning-gpuopt: keep the GPU busy in PyTorch Lightning.

``data/`` feeds the GPU, ``compute/`` makes its work cheaper, ``observe/`` shows what it does. Public names
are imported when first used (PEP 562), so ``import lightning_gpuopt`` is light (README.md).

Example:
    >>> from lightning_gpuopt import GPUStatsMonitor, OptimizedDataModule, fast_trainer_kwargs
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: the package's version (PEP 440)
__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # observe/: see what the GPU does
    "GPUStatsMonitor": "lightning_gpuopt.observe.gpu_stats",
    "NVTXRanges": "lightning_gpuopt.observe.nvtx",
    "BottleneckAdvisor": "lightning_gpuopt.observe.advisor",
    "Verdict": "lightning_gpuopt.observe.advisor",
    # compute/: make its work cheaper
    "ChannelsLast": "lightning_gpuopt.compute.channels_last",
    "FusedOptimizer": "lightning_gpuopt.compute.optimizer",
    "CompileModel": "lightning_gpuopt.compute.compile",
    "fast_trainer_kwargs": "lightning_gpuopt.compute.preset",
    "choose_precision": "lightning_gpuopt.compute.precision",
    "GPUOptCLI": "lightning_gpuopt.lightning_cli",
    "FabricObserver": "lightning_gpuopt.observe.fabric",
    # data/: feed it
    "OptimizedDataModule": "lightning_gpuopt.data.datamodule",
    "AugmentConfig": "lightning_gpuopt.data.transforms",
    "TuningConfig": "lightning_gpuopt.data.tuning",
    "DALIOptions": "lightning_gpuopt.data.dali",
    "DecodeOptions": "lightning_gpuopt.data.decode",
    "HDF5Options": "lightning_gpuopt.data.hdf5",
    "GPUAugment": "lightning_gpuopt.data.transforms",
    "UInt8ImageFolder": "lightning_gpuopt.data.folder",
    "HDF5ImageDataset": "lightning_gpuopt.data.hdf5",
    "convert_folder_to_hdf5": "lightning_gpuopt.data.convert",
    "DALILoader": "lightning_gpuopt.data.dali",
    "WorkerTuner": "lightning_gpuopt.data.tuning",
    "tune_num_workers": "lightning_gpuopt.data.tuning",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_gpuopt' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except Exception as err:
        from lightning_gpuopt._imports import torchvision_problem

        # a torchvision built for another torch fails every Lightning import (torchmetrics imports it)
        broken = torchvision_problem()
        if broken is None:
            raise
        raise ImportError(broken) from err
    globals()[name] = value  # cache: the next access is a plain attribute lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from lightning_gpuopt.compute.channels_last import ChannelsLast
    from lightning_gpuopt.compute.compile import CompileModel
    from lightning_gpuopt.compute.optimizer import FusedOptimizer
    from lightning_gpuopt.compute.precision import choose_precision
    from lightning_gpuopt.compute.preset import fast_trainer_kwargs
    from lightning_gpuopt.data.convert import convert_folder_to_hdf5
    from lightning_gpuopt.data.dali import DALILoader, DALIOptions
    from lightning_gpuopt.data.datamodule import OptimizedDataModule
    from lightning_gpuopt.data.decode import DecodeOptions
    from lightning_gpuopt.data.folder import UInt8ImageFolder
    from lightning_gpuopt.data.hdf5 import HDF5ImageDataset, HDF5Options
    from lightning_gpuopt.data.transforms import AugmentConfig, GPUAugment
    from lightning_gpuopt.data.tuning import TuningConfig, WorkerTuner, tune_num_workers
    from lightning_gpuopt.lightning_cli import GPUOptCLI
    from lightning_gpuopt.observe.advisor import BottleneckAdvisor, Verdict
    from lightning_gpuopt.observe.fabric import FabricObserver
    from lightning_gpuopt.observe.gpu_stats import GPUStatsMonitor
    from lightning_gpuopt.observe.nvtx import NVTXRanges
