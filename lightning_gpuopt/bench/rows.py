"""The rows of the ladder (``lightning-gpuopt bench`` and ``demo``; docs/benchmarks.md), the settings of a
run, and why a row cannot run here (it stays in the results with ``status`` and ``reason``).
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_gpuopt._checks import check_arg, is_int
from lightning_gpuopt._common import IMAGENET_MEAN, IMAGENET_STD
from lightning_gpuopt._common import cache_dir as default_cache_dir

# status values of a row
OK = "ok"
CANNOT_RUN = "cannot run"
SKIPPED = "skipped"
FAILED = "failed"
#: the reason of a row the whole-run time budget left without a fit
BUDGET_SPENT = "time budget spent"


@dataclass(frozen=True)
class RowSpec:
    """What one ladder row runs: ``adds`` says what it adds to the row above; ``loader`` is ``"naive"``,
    ``"folder"``, ``"hdf5"``, ``"dali"``, ``"best"`` (the fastest data backend measured in this run),
    ``"device"`` (synthetic batches through Lightning) or ``"plain"`` (``PlainLoop``); ``needs_cuda`` says why
    the row means nothing without a CUDA GPU (``None``: it runs on a CPU too).

    Example:
        >>> SPEC_BY_NAME["+hdf5"].loader
        'hdf5'
    """

    name: str
    adds: str
    loader: str
    needs_cuda: str | None = None
    tuned_workers: bool = False
    pin_memory: bool = False
    mixed: bool = False
    channels_last: bool = False
    compiled: bool = False


# why a row means nothing without a CUDA GPU
_NEEDS_CUDA = {
    "+pinned": "pinned memory only speeds up copies to a CUDA GPU; none in this run",
    "+dali": "DALI decodes on a CUDA GPU; none in this run",
    "+16-mixed": "16-mixed needs a CUDA GPU (on a CPU Lightning falls back to bf16, slower there)",
}
# name, adds, loader, flags: w tuned_workers, p pin_memory, m mixed, l channels_last, c compiled
_ROWS = (
    ("naive", "DataLoader, PIL decode + float normalize on CPU, 0 workers, fp32, NCHW", "naive", ""),
    ("+workers", "tuned DataLoader workers", "naive", "w"),
    ("+pinned", "pin_memory=True", "naive", "wp"),
    ("+uint8_gpu_aug", "OptimizedDataModule: uint8 batches, crop/flip/normalize on GPU", "folder", ""),
    ("+hdf5", "uint8 HDF5 file instead of JPEG decode", "hdf5", ""),
    ("+dali", "DALI: JPEG decoding, decoder chosen from rates measured on the files (not HDF5)", "dali", ""),
    ("+16-mixed", "precision='16-mixed' (best data backend)", "best", "m"),
    ("+channels_last", "ChannelsLast model: the full stack", "best", "ml"),
    ("+compile", "CompileModel(): the full stack, forward compiled", "best", "mlc"),
    ("ceiling_lightning", "synthetic batches on the device, Lightning", "device", "ml"),
    ("ceiling_eager", "synthetic batches on the device, plain loop", "plain", "ml"),
    ("ceiling_compiled", "synthetic batches on the device, plain loop, torch.compile", "plain", "mlc"),
)
ROW_SPECS: tuple[RowSpec, ...] = tuple(
    RowSpec(name, adds, loader, _NEEDS_CUDA.get(name), *(f in flags for f in "wpmlc"))
    for name, adds, loader, flags in _ROWS
)
#: the ladder's row names in ladder order (what ``--rows`` and ``LadderConfig.rows`` take)
ROW_NAMES: tuple[str, ...] = tuple(s.name for s in ROW_SPECS)
SPEC_BY_NAME = {s.name: s for s in ROW_SPECS}
# rows that read the image folder itself (an HDF5 file cannot feed them)
FOLDER_ONLY_ROWS = tuple(s.name for s in ROW_SPECS if s.loader in ("naive", "folder", "dali"))


def parse_rows(text: str | Sequence[str]) -> list[str]:
    """Row names (comma-separated string or list) in ladder order.

    Raises:
        ValueError: an unknown or empty name; the message lists the valid ones.
    """
    names = [n.strip() for n in text.split(",")] if isinstance(text, str) else [str(n).strip() for n in text]
    if not names or any(not n for n in names):
        raise ValueError(f"--rows needs comma-separated row names; valid rows: {', '.join(ROW_NAMES)}")
    unknown = [n for n in names if n not in SPEC_BY_NAME]
    if unknown:
        raise ValueError(
            f"unknown row name(s) {', '.join(repr(n) for n in unknown)} in --rows; valid rows: {', '.join(ROW_NAMES)}"
        )
    return [n for n in ROW_NAMES if n in names]


# --------------------------------------------------------------------------------------------- naive data
class NaiveImageFolder(Dataset):
    """The input pipeline most tutorials start with, all on the CPU: PIL decode, random-resized-crop to
    ``size``, random flip, float32 CHW normalized by ImageNet's mean and std; items are ``(tensor, label)``
    from the class-per-subfolder folder ``root``."""

    def __init__(self, root: str | os.PathLike[str], size: int = 224) -> None:
        from lightning_gpuopt.data.folder import scan_image_folder

        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive int (pixels), got {size!r}")
        self.root = os.fspath(root)
        self.size = size
        self.classes, self.samples = scan_image_folder(self.root)
        self.mean = np.asarray(IMAGENET_MEAN, dtype=np.float32).reshape(3, 1, 1)
        self.std = np.asarray(IMAGENET_STD, dtype=np.float32).reshape(3, 1, 1)

    def __len__(self) -> int:
        return len(self.samples)

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this dataset for the worker-tuning cache."""
        return {
            "class": type(self).__name__,
            "root": os.path.abspath(self.root),
            "len": len(self),
            "size": self.size,
        }

    def _crop_box(self, w: int, h: int) -> tuple[float, float, float, float]:
        area = w * h
        for _ in range(10):
            target = area * random.uniform(0.08, 1.0)
            ratio = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = math.sqrt(target * ratio), math.sqrt(target / ratio)
            if cw <= w and ch <= h:
                left, top = random.uniform(0, w - cw), random.uniform(0, h - ch)
                return left, top, left + cw, top + ch
        short = min(w, h)  # fall back to the central square
        left, top = (w - short) / 2, (h - short) / 2
        return left, top, left + short, top + short

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        path, label = self.samples[index]
        with Image.open(path) as img:
            rgb = img.convert("RGB")
        out = rgb.resize((self.size, self.size), Image.Resampling.BILINEAR, box=self._crop_box(*rgb.size))
        if random.random() < 0.5:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        chw = np.asarray(out, dtype=np.float32).transpose(2, 0, 1) / 255.0
        return torch.from_numpy((chw - self.mean) / self.std), label


class DeviceBatches:
    """One batch already on the device, ``length`` times, its labels cycling through ``labels``.

    Example:
        >>> batches = DeviceBatches(torch.zeros(2, 3, 8, 8), torch.zeros(2, dtype=torch.long), length=3)
        >>> len(list(batches))
        3
    """

    def __init__(self, x: torch.Tensor, labels: torch.Tensor | Sequence[torch.Tensor], length: int) -> None:
        self.x, self.length = x, length
        self.labels = [labels] if isinstance(labels, torch.Tensor) else list(labels)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(self.length):
            yield self.x, self.labels[i % len(self.labels)]

    def __len__(self) -> int:
        return self.length


# ------------------------------------------------------------------------------------------------ config
@dataclass
class LadderConfig:
    """Settings of one ladder run: each field is the ``lightning-gpuopt bench`` flag of that name
    (docs/benchmarks.md, "Arguments"), ``num_workers`` is ``--workers``, ``time_budget_s`` ``--time-budget``;
    ``tb_dir`` is the TensorBoard ``save_dir`` (``None``: none), ``lr`` the SGD learning rate.

    Example:
        >>> config = LadderConfig("data/train", model="resnet50", rows=parse_rows("naive,+hdf5"))
        >>> rows = run_ladder(config)  # doctest: +SKIP
    """

    data: str | os.PathLike[str]
    model: str = "small"
    batch_size: int = 256
    image_size: int = 224
    rows: Sequence[str] = ROW_NAMES
    seconds: float = 10.0
    steps: int | None = None
    warmup: int = 5
    repeats: int = 3
    accelerator: str = "auto"
    num_workers: int | None = None
    tune_seconds: float = 10.0
    cache_dir: str | os.PathLike[str] = field(default_factory=default_cache_dir)
    tb_dir: str | os.PathLike[str] | None = None
    time_budget_s: float | None = None
    lr: float = 0.05

    def validate(self, check_data: bool = True) -> None:
        """Raise ``ValueError`` naming the flag of a bad setting (``check_data=False``: all but ``data``)."""
        from lightning_gpuopt.bench.models import MODEL_NAMES

        steps, workers, budget, acc = self.steps, self.num_workers, self.time_budget_s, self.accelerator
        batch, size = self.batch_size, self.image_size
        for ok, flag, value, must in (
            (self.model in MODEL_NAMES, "--model", self.model, f"one of {', '.join(MODEL_NAMES)}"),
            (is_int(batch) and batch >= 1, "--batch-size", batch, "an int >= 1"),
            (is_int(size) and size >= 8, "--image-size", size, "an int >= 8"),
            (self.warmup >= 0, "--warmup", self.warmup, ">= 0 steps"),
            (is_int(self.repeats) and self.repeats >= 1, "--repeats", self.repeats, "an int >= 1"),
            (self.seconds >= 0, "--seconds", self.seconds, ">= 0"),
            (steps is None or steps >= 2, "--steps", steps, ">= 2 (steps a repetition measures)"),
            (workers is None or workers >= 0, "--workers", workers, ">= 0"),
            (self.tune_seconds > 0, "--tune-seconds", self.tune_seconds, "> 0"),
            (budget is None or budget > 0, "--time-budget", budget, "> 0 s (leave it out for no budget)"),
            (acc in ("auto", "cpu", "gpu", "cuda"), "--accelerator", acc, "auto, cpu or gpu"),
        ):
            check_arg(ok, flag, value, must)
        if self.seconds == 0 and steps is None:
            raise ValueError("--seconds 0 turns the time box off, so give --steps N to bound each row")
        if acc in ("gpu", "cuda") and not torch.cuda.is_available():
            raise ValueError(
                "--accelerator gpu was asked for but no CUDA GPU is visible; use --accelerator auto"
            )
        self.rows = parse_rows(list(self.rows))
        if not check_data:
            return
        data = Path(self.data).expanduser()
        if not data.exists():
            raise FileNotFoundError(
                f"--data {str(data)!r} does not exist; give an image folder or an HDF5 file"
            )
        if data.is_file() and data.suffix.lower() not in (".h5", ".hdf5"):
            raise ValueError(
                f"--data {str(data)!r} is a file but not .h5/.hdf5; give an image folder or an HDF5 file"
            )
        if is_hdf5_path(data) and list(self.rows) != list(ROW_NAMES):
            folder_rows = [n for n in self.rows if n in FOLDER_ONLY_ROWS]
            if folder_rows:
                raise ValueError(
                    f"row(s) {', '.join(folder_rows)} read an image folder but --data is an HDF5 file; drop them "
                    f"from --rows or give an image folder (rows that read HDF5: "
                    f"{', '.join(n for n in ROW_NAMES if n not in FOLDER_ONLY_ROWS)})"
                )


def compile_asked(rows: Sequence[str]) -> bool:
    """Whether ``rows`` names a compiled row in a list shorter than the whole ladder (on a CPU they run
    only then).

    Example:
        >>> compile_asked(["naive", "+compile"]), compile_asked(ROW_NAMES)
        (True, False)
    """
    names = set(parse_rows(list(rows)))
    return names != set(ROW_NAMES) and any(SPEC_BY_NAME[n].compiled for n in names)


def ladder_device(accelerator: str) -> torch.device:
    """CUDA device 0 for ``"gpu"`` (and ``"auto"`` where CUDA is there), else the CPU."""
    if accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", 0)


def cannot_run(
    spec: RowSpec, device: torch.device, data_is_h5: bool = False, compile_named: bool = False
) -> tuple[str, str] | None:
    """``(status, reason)`` when row ``spec`` cannot run on ``device`` (``ladder_device``), the reason saying
    what would make it run; else ``None``. ``compile_named``: the compiled rows were named (``compile_asked``).

    Example:
        >>> cannot_run(SPEC_BY_NAME["+pinned"], torch.device("cpu"))[0]
        'cannot run'
    """
    from lightning_gpuopt import _imports

    cuda = device.type == "cuda"
    if data_is_h5 and spec.name in FOLDER_ONLY_ROWS:
        return CANNOT_RUN, "needs an image folder; --data is an HDF5 file: give --data an image folder"
    if spec.needs_cuda is not None and not cuda:
        where = (
            "drop --accelerator cpu (a CUDA GPU is visible)"
            if torch.cuda.is_available()
            else "run it on a machine with a CUDA GPU"
        )
        return CANNOT_RUN, f"{spec.needs_cuda}; {where}"
    if spec.compiled:
        return _cannot_compile(device, compile_named)
    if spec.loader == "dali" and not _imports._DALI_AVAILABLE:
        return CANNOT_RUN, "NVIDIA DALI is not installed (pip install 'lightning-gpuopt[dali]')"
    if (spec.loader == "hdf5" or (spec.loader == "best" and data_is_h5)) and not _imports._H5PY_AVAILABLE:
        return CANNOT_RUN, "h5py is not installed (pip install 'lightning-gpuopt[hdf5]')"
    return None


def _cannot_compile(device: torch.device, compile_named: bool) -> tuple[str, str] | None:
    import importlib.util

    if device.type != "cuda":
        if compile_named:
            return None
        return SKIPPED, (
            "torch.compile on a CPU builds C++ kernels for a minute or more; name the row to run it "
            "(--rows ...,+compile)"
        )
    from lightning_gpuopt.compute.compile import MIN_CAPABILITY

    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return CANNOT_RUN, (
            f"torch.compile's GPU kernels (Triton) need compute capability >= "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}, this GPU has {capability[0]}.{capability[1]}"
        )
    if importlib.util.find_spec("triton") is None:
        return CANNOT_RUN, "torch.compile's GPU kernels need Triton (pip install triton)"
    return None


def blocked_rows(config: LadderConfig) -> dict[str, tuple[str, str]]:
    """``{row: (status, reason)}`` for the rows of ``config.rows`` that cannot run here."""
    device = ladder_device(config.accelerator)
    h5 = is_hdf5_path(Path(config.data).expanduser())
    named = compile_asked(config.rows)
    found = {n: cannot_run(SPEC_BY_NAME[n], device, h5, named) for n in parse_rows(list(config.rows))}
    return {n: why for n, why in found.items() if why is not None}


def is_hdf5_path(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is an existing ``.h5``/``.hdf5`` file."""
    return Path(path).suffix.lower() in (".h5", ".hdf5") and Path(path).is_file()


def default_model() -> str:
    """``"resnet50"`` when torchvision is importable, else the built-in ``"small"``."""
    from lightning_gpuopt._imports import _TORCHVISION_AVAILABLE

    return "resnet50" if _TORCHVISION_AVAILABLE else "small"
