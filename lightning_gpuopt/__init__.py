"""lightning-gpuopt: keep the GPU busy in PyTorch Lightning.

Public names are resolved lazily (PEP 562) so that ``import lightning_gpuopt`` stays light: it imports
neither pynvml, h5py, nvidia.dali nor nvtx, does not import lightning or torch until a name that needs
them is touched, and never initialises CUDA.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # observe/: what the GPU does
    "GPUStatsMonitor": "lightning_gpuopt.observe.gpu_stats",
    "NVMLSampler": "lightning_gpuopt.observe.nvml",
    "nvml_device_index": "lightning_gpuopt.observe.nvml",
    "NVTXRanges": "lightning_gpuopt.observe.nvtx",
    "BottleneckAdvisor": "lightning_gpuopt.observe.advisor",
    "diagnose": "lightning_gpuopt.observe.advisor",
    "Verdict": "lightning_gpuopt.observe.advisor",
    # compute/: make the GPU's work cheaper
    "ChannelsLast": "lightning_gpuopt.compute.channels_last",
    "apply_channels_last": "lightning_gpuopt.compute.channels_last",
    "to_channels_last": "lightning_gpuopt.compute.channels_last",
    "choose_precision": "lightning_gpuopt.compute.precision",
    "fast_trainer_kwargs": "lightning_gpuopt.compute.precision",
    "configure_backends": "lightning_gpuopt.compute.precision",
    "StreamPriority": "lightning_gpuopt.compute.streams",
    "FusedOptimizer": "lightning_gpuopt.compute.optimizer",
    # data/: feed the GPU
    "OptimizedDataModule": "lightning_gpuopt.data.datamodule",
    "UInt8ImageFolder": "lightning_gpuopt.data.folder",
    "GPUAugment": "lightning_gpuopt.data.transforms",
    "WorkerTuner": "lightning_gpuopt.data.tuning",
    "tune_num_workers": "lightning_gpuopt.data.tuning",
    "HDF5ImageDataset": "lightning_gpuopt.data.hdf5",
    "convert_folder_to_hdf5": "lightning_gpuopt.data.hdf5",
    "DALILoader": "lightning_gpuopt.data.dali",
    "build_dali_loader": "lightning_gpuopt.data.dali",
    "ContinuousDataLoader": "lightning_gpuopt.data.loader",
    "ConversionResult": "lightning_gpuopt.data.hdf5",
    "make_jpeg_folder": "lightning_gpuopt.data.synthetic",
    # the before/after ladder behind `lightning-gpuopt bench`
    "run_ladder": "lightning_gpuopt.ladder",
    "LadderConfig": "lightning_gpuopt.ladder",
    # models used by the demo and the benchmarks
    "ImageClassifier": "lightning_gpuopt.models",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_gpuopt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: the next access is a plain attribute lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from lightning_gpuopt.compute.channels_last import ChannelsLast, apply_channels_last, to_channels_last
    from lightning_gpuopt.compute.optimizer import FusedOptimizer
    from lightning_gpuopt.compute.precision import choose_precision, configure_backends, fast_trainer_kwargs
    from lightning_gpuopt.compute.streams import StreamPriority
    from lightning_gpuopt.data.dali import DALILoader, build_dali_loader
    from lightning_gpuopt.data.datamodule import OptimizedDataModule
    from lightning_gpuopt.data.folder import UInt8ImageFolder
    from lightning_gpuopt.data.hdf5 import ConversionResult, HDF5ImageDataset, convert_folder_to_hdf5
    from lightning_gpuopt.data.loader import ContinuousDataLoader
    from lightning_gpuopt.data.synthetic import make_jpeg_folder
    from lightning_gpuopt.data.transforms import GPUAugment
    from lightning_gpuopt.data.tuning import WorkerTuner, tune_num_workers
    from lightning_gpuopt.ladder import LadderConfig, run_ladder
    from lightning_gpuopt.models import ImageClassifier
    from lightning_gpuopt.observe.advisor import BottleneckAdvisor, Verdict, diagnose
    from lightning_gpuopt.observe.gpu_stats import GPUStatsMonitor
    from lightning_gpuopt.observe.nvml import NVMLSampler, nvml_device_index
    from lightning_gpuopt.observe.nvtx import NVTXRanges
