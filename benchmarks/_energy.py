"""What a trained sample costs the GPU in joules, beside samples/s, and whether the step replays CUDA graphs:
the rows of ``benchmarks/energy.py``, which imports it from its own folder.

Each row fits an ``ImageClassifier`` (``--arch``) with a ``GPUStatsMonitor`` (the energy counter, the JPEG
engine's load) and, where it goes through the preset, its own ``CompileModel`` (whether the step replays CUDA
graphs, and torch's reason where not):

===================  =====================================================================================
row                  what trains
===================  =====================================================================================
``naive``            the ladder's first row: ``NaiveImageFolder`` (PIL decode, crop and float normalize on
                     the CPU) through a ``DataLoader`` with 0 workers, fp32, NCHW, pageable memory; a plain
                     ``Trainer``
``preset``           one uint8 batch kept on the GPU, normalized in ``forward``, through
                     ``Trainer(**fast_trainer_kwargs(model, compile=True))`` (CUDA graphs on one GPU)
``gpu_decode``       the JPEG files decoded on the GPU, through the preset: DALI's mixed decoder
                     (``OptimizedDataModule(backend="dali", dali=DALIOptions(decoder="gpu"))``, the hardware
                     JPEG decoder on Hopper) where DALI is installed, else torchvision's batched
                     ``decode_jpeg(device="cuda")`` (nvJPEG) with a random resized crop and flip on the GPU
``graphs_skipped``   ``preset`` with a ``forward`` that normalizes its input in place: torch records no CUDA
                     graphs for a graph that changes its input ("mutated inputs"), and ``CompileModel`` says so
===================  =====================================================================================

A row's ``joules_per_sample`` is the monitor's mean ``gpu/power_w`` (the energy counter) over the windows of
its measured steps, over that window's samples/s (``meter.joules_per_sample``); ``jpeg_engine_util`` the mean
``gpu/jpeg_util`` over the same windows.
"""

from __future__ import annotations

import os
import re
import statistics
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from _zoo import EncodedJPEGs, GPUDecodeClassifier, InPlaceNormalize, Uint8Classifier
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt._common import available_cpus
from lightning_gpuopt.bench.models import ImageClassifier
from lightning_gpuopt.bench.rows import DeviceBatches, NaiveImageFolder
from lightning_gpuopt.bench.steady import joules_per_sample, window_means

__all__ = [
    "ROWS",
    "fit_figures",
    "gpu_decoder",
    "gpu_tag",
    "row_figures",
    "row_setup",
    "rows_of",
    "why_not",
]

ROWS: tuple[str, ...] = ("naive", "preset", "gpu_decode", "graphs_skipped")
#: the columns of the printed table (every row of the JSON has them, null where not measured)
COLUMNS = ("name", "samples_per_sec", "joules_per_sample", "power_w", "jpeg_engine_util", "gpu_util_mean",
           "cuda_graphs", "cuda_graphs_reason", "status", "reason")  # fmt: skip


def gpu_tag(name: str | None) -> str:
    """``h100``/``h200``/... from a GPU's name (the model number, not the memory's), ``cpu`` without one.

    Example:
        >>> gpu_tag("NVIDIA H100 80GB HBM3"), gpu_tag("NVIDIA A100-SXM4-80GB"), gpu_tag(None)
        ('h100', 'a100', 'cpu')
    """
    if not name:
        return "cpu"
    model = re.search(r"\b[a-z]{1,2}\d{2,4}\b", name.lower())
    return model.group(0) if model else name.split()[-1].lower()


def gpu_decoder(choice: str = "auto", cuda: bool = True) -> str | None:
    """The GPU decoder the ``gpu_decode`` row uses: ``"dali"`` or ``"torchvision"`` (``choice="auto"``: DALI
    where installed), or ``None`` where neither can run."""
    from lightning_gpuopt._imports import _DALI_AVAILABLE, _TORCHVISION_AVAILABLE

    if not cuda:
        return None
    found = {"dali": bool(_DALI_AVAILABLE), "torchvision": bool(_TORCHVISION_AVAILABLE)}
    order = ("dali", "torchvision") if choice == "auto" else (choice,)
    return next((d for d in order if found.get(d)), None)


def why_not(name: str, cuda: bool, decoder: str | None) -> str | None:
    """Why row ``name`` cannot run here, or ``None``."""
    if name == "naive":
        return None
    if not cuda:
        return "needs a CUDA GPU: it measures the preset's CUDA graphs and the GPU's energy and decoders"
    if name == "gpu_decode" and decoder is None:
        return "needs DALI or torchvision to decode JPEGs on the GPU"
    return None


# -------------------------------------------------------------------------------------------------- data
class JPEGBytes(Dataset):
    """An image folder's files as ``(uint8 tensor of the file's bytes, label)``."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        from lightning_gpuopt.data.folder import scan_image_folder

        self.classes, self.samples = scan_image_folder(root)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        with open(path, "rb") as f:
            return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8), label


def collate_jpegs(items: Sequence[tuple[torch.Tensor, int]]) -> tuple[EncodedJPEGs, torch.Tensor]:
    return EncodedJPEGs([data for data, _ in items]), torch.tensor([label for _, label in items])


# ------------------------------------------------------------------------------------------------- rows
def row_setup(
    name: str,
    folder: str | os.PathLike[str],
    arch: str,
    batch_size: int,
    image_size: int,
    device: str,
    decoder: str | None = None,
) -> tuple[pl.LightningModule, dict[str, Any], bool]:
    """Row ``name``'s model, its ``Trainer.fit`` keywords (``train_dataloaders=`` or ``datamodule=``) and
    whether it trains through the preset (``decoder``: ``gpu_decoder``'s, for ``gpu_decode``)."""
    naive = NaiveImageFolder(folder, size=image_size)
    classes = len(naive.classes)
    if name == "naive":
        loader = DataLoader(naive, batch_size=batch_size, shuffle=True, num_workers=0, drop_last=True)
        return ImageClassifier(arch, classes), {"train_dataloaders": loader}, False
    if name in ("preset", "graphs_skipped"):
        x = torch.randint(0, 256, (batch_size, 3, image_size, image_size), dtype=torch.uint8, device=device)
        ys = [torch.randint(0, classes, (batch_size,), device=device) for _ in range(4)]
        model = (Uint8Classifier if name == "preset" else InPlaceNormalize)(arch, classes)
        return model, {"train_dataloaders": DeviceBatches(x, ys, length=10**6)}, True
    if decoder == "dali":
        from lightning_gpuopt import DALIOptions, OptimizedDataModule

        dm = OptimizedDataModule(str(folder), backend="dali", batch_size=batch_size, image_size=image_size,
                                 dali=DALIOptions(decoder="gpu"))  # fmt: skip
        return ImageClassifier(arch, classes), {"datamodule": dm}, True
    workers = max(1, min(8, available_cpus() - 2))
    loader = DataLoader(JPEGBytes(folder), batch_size=batch_size, shuffle=True, num_workers=workers,
                        collate_fn=collate_jpegs, drop_last=True, persistent_workers=True)  # fmt: skip
    return GPUDecodeClassifier(arch, classes, image_size), {"train_dataloaders": loader}, True


def fit_figures(monitor: Any, compiler: Any, steps: int, samples_per_sec: float | None) -> dict[str, Any]:
    """One fit's ``joules_per_sample``, ``power_w``, ``jpeg_engine_util`` and ``gpu_util_mean`` from the
    monitor's windows over its last ``steps`` steps (the measured ones), and ``cuda_graphs`` and
    ``cuda_graphs_reason`` as ``compiler`` (a ``CompileModel``, or ``None`` for an eager fit) found them."""
    history = list(getattr(monitor, "history", []))
    start = int(history[-1]["step"]) + 1 - steps if history else None
    power, jpeg, util = window_means(history, start, ("gpu/power_w", "gpu/jpeg_util", "gpu/util"))
    graphs, reason = (False, "eager: not compiled") if compiler is None else (
        compiler.cuda_graphs, compiler.cuda_graphs_reason)  # fmt: skip
    return {
        "joules_per_sample": joules_per_sample(history, start, samples_per_sec),
        "power_w": power,
        "jpeg_engine_util": jpeg,
        "gpu_util_mean": util,
        "cuda_graphs": graphs,
        "cuda_graphs_reason": reason,
    }


def row_figures(repeats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A row's ``fit_figures`` from its repetitions' (``summarize``'s ``repeats``): the median of each
    number, and what the first repetition that knew it found about CUDA graphs.

    Example:
        >>> row_figures([{"joules_per_sample": 0.3, "cuda_graphs": True, "cuda_graphs_reason": None},
        ...              {"joules_per_sample": 0.5, "cuda_graphs": True, "cuda_graphs_reason": None}])["joules_per_sample"]
        0.4
    """
    out: dict[str, Any] = {}
    for key in ("joules_per_sample", "power_w", "jpeg_engine_util", "gpu_util_mean"):
        values = [r[key] for r in repeats if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    known = next((r for r in repeats if r.get("cuda_graphs") is not None), {})
    out["cuda_graphs"], out["cuda_graphs_reason"] = known.get("cuda_graphs"), known.get("cuda_graphs_reason")
    return out


def rows_of(results: dict[str, list[Any]], why: dict[str, str | None]) -> list[dict[str, Any]]:
    """The rows of the results file, in ``why``'s order: ``summarize``'s for the rows that ran (with
    ``row_figures``, ``status`` ``"ok"`` or ``"failed"``), ``"cannot run"`` and the reason for the others."""
    from lightning_gpuopt.bench.steady import summarize

    table = summarize(results, None)
    for row in table:
        row.update(
            row_figures(row["repeats"]), status="failed" if row["error"] else "ok", reason=row["error"]
        )
    table += [
        {**dict.fromkeys(COLUMNS), "name": n, "status": "cannot run", "reason": r}
        for n, r in why.items()
        if r
    ]
    order = list(why)
    return sorted(table, key=lambda r: order.index(r["name"]))
