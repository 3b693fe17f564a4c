"""Read a run's configuration (``RunConfig``) through public Lightning and torch API: no GPU work, no sync."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from lightning_gpuopt._common import FeedInfo, available_cpus
from lightning_gpuopt._compat import supports_amp_scaling
from lightning_gpuopt.observe._lifecycle import Loop, TrainerLoop, first_loader
from lightning_gpuopt.observe.advisor.evidence import RunConfig, finite

__all__ = [
    "amp_facts",
    "collect_config",
    "conv_memory_formats",
    "describe_feed",
    "distinct_memory_format",
    "image_tensor",
    "loop_config",
]

_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


def _unwrap_dataset(ds: Any) -> Any:
    # torch Subset and similar wrappers keep the real dataset in .dataset
    for _ in range(5):
        inner = getattr(ds, "dataset", None)
        if inner is None or inner is ds:
            break
        ds = inner
    return ds


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors of a batch or sample, nested up to 4 levels in lists, tuples and dicts."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth <= 3 and isinstance(obj, (Mapping, list, tuple)):
        for item in obj.values() if isinstance(obj, Mapping) else obj:
            yield from _tensors(item, depth + 1)


def _dataset_on_host(ds: Any) -> bool | None:
    """Whether a map-style dataset's items live in host memory (looks at one item; None if it cannot tell)."""
    inner = _unwrap_dataset(ds)
    tensors = getattr(inner, "tensors", None)  # TensorDataset: no item fetch needed
    if isinstance(tensors, (list, tuple)) and tensors and isinstance(tensors[0], torch.Tensor):
        return tensors[0].device.type == "cpu"
    if isinstance(ds, IterableDataset) or not hasattr(ds, "__getitem__"):
        return None
    try:
        item = ds[0]
    except Exception:  # an unusual dataset: the rule that needs this stays silent
        return None
    t = next(_tensors(item), None)
    return t is None or t.device.type == "cpu"  # numpy arrays and PIL images are host memory


def _image_files(ds: Any) -> bool:
    """Whether a dataset lists image files in ``samples``/``imgs`` (torchvision's ImageFolder does)."""
    samples = getattr(ds, "samples", None) or getattr(ds, "imgs", None)
    if not isinstance(samples, Sequence) or not samples:
        return False
    first = samples[0]
    path = first[0] if isinstance(first, (tuple, list)) and first else first
    return isinstance(path, (str, os.PathLike)) and str(path).lower().endswith(_IMAGE_SUFFIXES)


def _fabric_loader(obj: Any) -> bool:
    """Whether ``obj`` is the loader ``fabric.setup_dataloaders`` returned: it carries its DataLoader's attributes."""
    from lightning.fabric.wrappers import is_wrapped

    return is_wrapped(obj) and not isinstance(obj, nn.Module) and hasattr(obj, "batch_sampler")


def describe_feed(loader: Any, probe_dataset: bool = True) -> FeedInfo:
    """How ``loader`` feeds the GPU: its ``feed_info``, its dataset's, then a ``DataLoader``'s public attributes
    (docs/advisor.md). With ``probe_dataset``, a map-style dataset read without workers is asked for one item
    to see whether batches are already on the device."""
    loader_like = isinstance(loader, DataLoader) or _fabric_loader(loader)
    dataset = getattr(loader, "dataset", None) if loader_like else None
    layers = [loader] + ([dataset, _unwrap_dataset(dataset)] if dataset is not None else [])
    infos = [info for info in (getattr(x, "feed_info", None) for x in layers) if isinstance(info, FeedInfo)]
    facts: dict[str, Any] = {}  # the known facts only: the first layer that knows one wins
    for info in reversed(infos):
        facts.update((k, v) for k, v in info.to_dict().items() if v is not None)
    if loader_like:
        facts.setdefault("num_workers", None)
        read_threads = getattr(loader, "read_threads", 0)
        if isinstance(read_threads, int) and read_threads > 0:
            # read by threads of this process (HostDataLoader): no worker processes to count
            facts.setdefault("threads", read_threads)
        elif facts["num_workers"] is None:
            facts["num_workers"] = int(loader.num_workers)
        facts.setdefault("pin_memory", bool(loader.pin_memory))
        if facts.get("batch_size") is None:
            bs = loader.batch_size
            if bs is None and loader.batch_sampler is not None:
                bs = getattr(loader.batch_sampler, "batch_size", None)
            facts["batch_size"] = int(bs) if isinstance(bs, int) else None
        if facts.get("backend") is None and dataset is not None and _image_files(_unwrap_dataset(dataset)):
            facts["backend"], facts["decoder"] = "folder", facts.get("decoder") or "cpu"
        if facts.get("host_batches") is None:
            if loader.num_workers > 0:
                facts["host_batches"] = True  # CUDA tensors cannot come out of worker processes
            elif probe_dataset and dataset is not None:
                facts["host_batches"] = _dataset_on_host(dataset)
    kind = type(infos[0]) if infos else FeedInfo  # a DALIFeedInfo keeps its measured decode rates
    return kind(**{k: facts.get(k) for k in kind().to_dict()})


def amp_facts(trainer: Any) -> dict[str, Any]:
    """``grad_scaler``, ``unfused_optimizers`` and ``gradient_clip_val`` of a Trainer or a ``Loop``, read from
    its precision plugin's ``scaler``, its optimizers as they are now and its ``gradient_clip_val``; an
    optimizer is unfused where ``GradScaler.step`` would read its ``found_inf`` on the host."""
    facts: dict[str, Any] = {}
    plugin = getattr(trainer, "precision_plugin", None)
    if plugin is not None:
        scaler = getattr(plugin, "scaler", None)
        is_enabled = getattr(scaler, "is_enabled", None)
        facts["grad_scaler"] = bool(is_enabled()) if callable(is_enabled) else scaler is not None
    optimizers = getattr(trainer, "optimizers", None)
    if isinstance(optimizers, (list, tuple)):
        facts["unfused_optimizers"] = tuple(
            type(getattr(opt, "optimizer", opt)).__name__
            for opt in optimizers
            if not supports_amp_scaling(opt)
        )
    clip: Any = getattr(trainer, "gradient_clip_val", None)
    facts["gradient_clip_val"] = float(clip) if finite(clip) and clip > 0 else None
    return facts


def distinct_memory_format(t: torch.Tensor) -> bool | None:
    """True if channels_last, False if NCHW, None if the strides cannot tell (e.g. 1x1 kernels, C == 1)."""
    cl = t.is_contiguous(memory_format=torch.channels_last)
    return None if cl == t.is_contiguous() else cl


def conv_memory_formats(model: nn.Module) -> tuple[int, int]:
    """``(decidable 4-D conv weights, of which channels_last)`` of ``model``; metadata only, no GPU work."""
    convs = [m.weight for m in model.modules() if isinstance(m, nn.Conv2d) and m.weight.dim() == 4]
    known = [fmt for fmt in map(distinct_memory_format, convs) if fmt is not None]
    return len(known), sum(known)


def image_tensor(batch: Any) -> torch.Tensor | None:
    """The floating 4-D tensor of a batch (a uint8 batch still to be normalized on the device says nothing)."""
    return next((t for t in _tensors(batch, 3) if t.dim() == 4 and t.is_floating_point()), None)


def collect_config(
    trainer: pl.Trainer, pl_module: pl.LightningModule, gpu_monitor: bool, feed: FeedInfo | None = None
) -> RunConfig:
    """Read the run's configuration as it is now (``gpu_monitor``: whether a ``GPUStatsMonitor`` is among the
    callbacks; ``feed``: the training loader's description, ``None`` describes ``trainer.train_dataloader``)."""
    return loop_config(TrainerLoop(trainer, pl_module), gpu_monitor, feed)


def loop_config(loop: Loop, gpu_monitor: bool, feed: FeedInfo | None = None) -> RunConfig:
    """``collect_config`` of any training loop (``observe._lifecycle.Loop``: a Trainer's or a Fabric loop's)."""
    device = loop.device
    if feed is None:
        loader = first_loader(loop.train_loaders)
        feed = describe_feed(loader) if loader is not None else FeedInfo()
    cfg = RunConfig(device.type, precision=loop.precision, cpus=available_cpus(), gpu_monitor=gpu_monitor)
    cfg.processes_per_node, cfg.world_size = loop.processes_per_node, loop.world_size
    # the feed's facts (a DALI loader's decode rates, measured on its own files, among them) and the AMP facts
    for key, value in {**feed.to_dict(), **amp_facts(loop)}.items():
        if key == "threads":
            cfg.decode_threads = value
        elif hasattr(cfg, key):
            setattr(cfg, key, value)
    from lightning_gpuopt.compute.compile import CompileModel

    # torch's reason for not replaying the CUDA graphs a CompileModel compiled the step to record
    compiled = [cb for cb in loop.callbacks if isinstance(cb, CompileModel) and cb.cuda_graphs_skipped]
    cfg.cuda_graphs_skipped = compiled[0].cuda_graphs_skipped if compiled else None
    cfg.conv_layers, cfg.conv_channels_last = conv_memory_formats(loop.module)
    cfg.cudnn_benchmark = bool(torch.backends.cudnn.benchmark)
    cfg.cudnn_deterministic = bool(torch.backends.cudnn.deterministic)
    cfg.cudnn_allow_tf32 = bool(torch.backends.cudnn.allow_tf32)
    cfg.float32_matmul_precision = torch.get_float32_matmul_precision()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        cfg.gpu_name = props.name
        cfg.capability = (props.major, props.minor)
        cfg.mem_total_gb = props.total_memory / 2**30
        # allocator bookkeeping on the host: no sync
        cfg.mem_peak_gb = torch.cuda.max_memory_reserved(device) / 2**30
    return cfg
