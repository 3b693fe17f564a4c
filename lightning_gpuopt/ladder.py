"""The before/after ladder behind ``lightning-gpuopt bench``.

The same model is trained through Lightning's ``Trainer`` under a ladder of settings, each row adding one
thing to the row above it, from a naive input pipeline to the full stack, plus two ceiling rows that feed
the model synthetic batches already on the device:

=================  ======================================================================================
row                what it adds
=================  ======================================================================================
``naive``          plain ``DataLoader`` over PIL decode + random-resized-crop + float CHW normalize on the
                   CPU; 0 workers, fp32 (``32-true``), NCHW, pageable memory
``+workers``       the worker count ``tune_num_workers`` measures for that dataset
``+pinned``        ``pin_memory=True`` (needs a CUDA device)
``+uint8_gpu_aug`` ``OptimizedDataModule`` folder backend: uint8 HWC batches, crop/flip/normalize on the GPU
``+hdf5``          the same images as a uint8 HDF5 file (converted once, cached)
``+dali``          ``OptimizedDataModule(backend="dali")``: decode on the GPU (needs DALI and CUDA)
``+16-mixed``      ``precision="16-mixed"`` on the best data backend measured above (needs CUDA)
``+channels_last`` ``ChannelsLast`` callback: the full stack
``ceiling_lightning`` synthetic batches already on the device, through Lightning (16-mixed + channels_last)
``ceiling_plain``  ``plain_loop_throughput``: the same model in a plain PyTorch loop; the ratio's ceiling
=================  ======================================================================================

A row that cannot run on this machine (no GPU, no DALI, an HDF5 file given to a folder row) or whose
component is missing stays in the results with ``status`` and ``reason`` saying why; nothing is faked.

Every row is time-boxed: after a warm-up (``warmup`` steps or half the row's seconds, whichever comes first)
it is measured for ``seconds`` (or ``steps`` measured steps, whichever comes first).
"""

from __future__ import annotations

import gc
import hashlib
import importlib
import math
import os
import random
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt.benchmarking import ThroughputMeter, format_table, plain_loop_throughput, write_results

Progress = Callable[[str], None]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# status values of a row
OK = "ok"
CANNOT_RUN = "cannot run"
SKIPPED = "skipped"
FAILED = "failed"


@dataclass(frozen=True)
class RowSpec:
    """What one ladder row runs.

    Attributes:
        name: row name (as given to ``--rows``).
        adds: one line: what this row adds to the row above.
        loader: ``"naive"`` (``NaiveImageFolder`` + ``DataLoader``), ``"folder"``, ``"hdf5"``, ``"dali"``
            (``OptimizedDataModule`` backends), ``"best"`` (the fastest data backend measured in this run),
            ``"device"`` (synthetic batches on the device, through Lightning) or ``"plain"`` (plain loop).
        tuned_workers: use the tuned worker count (else 0; only for ``loader="naive"``).
        pin_memory: pin host batches (only for ``loader="naive"``; the data module pins on CUDA itself).
        mixed: ``16-mixed`` precision (fp32 ``32-true`` otherwise).
        channels_last: ``ChannelsLast`` on the model.
        needs_cuda: why the row means nothing without a CUDA GPU (``None``: it runs on a CPU too).
    """

    name: str
    adds: str
    loader: str
    tuned_workers: bool = False
    pin_memory: bool = False
    mixed: bool = False
    channels_last: bool = False
    needs_cuda: str | None = None


ROW_SPECS: tuple[RowSpec, ...] = (
    RowSpec("naive", "DataLoader, PIL decode + float normalize on CPU, 0 workers, fp32, NCHW", "naive"),
    RowSpec("+workers", "tuned DataLoader workers", "naive", tuned_workers=True),
    RowSpec(
        "+pinned",
        "pin_memory=True",
        "naive",
        tuned_workers=True,
        pin_memory=True,
        needs_cuda="pinned memory only speeds up copies to a CUDA GPU; none in this run",
    ),
    RowSpec("+uint8_gpu_aug", "OptimizedDataModule: uint8 batches, crop/flip/normalize on GPU", "folder"),
    RowSpec("+hdf5", "uint8 HDF5 file instead of JPEG decode", "hdf5"),
    RowSpec(
        "+dali",
        "DALI: JPEG decode on the GPU (instead of HDF5)",
        "dali",
        needs_cuda="DALI decodes on a CUDA GPU; none in this run",
    ),
    RowSpec(
        "+16-mixed",
        "precision='16-mixed' (best data backend)",
        "best",
        mixed=True,
        needs_cuda="16-mixed needs a CUDA GPU (on a CPU Lightning falls back to bf16, slower there)",
    ),
    RowSpec("+channels_last", "ChannelsLast model: the full stack", "best", mixed=True, channels_last=True),
    RowSpec(
        "ceiling_lightning",
        "synthetic batches on the device, Lightning",
        "device",
        mixed=True,
        channels_last=True,
    ),
    RowSpec(
        "ceiling_plain",
        "synthetic batches on the device, plain loop",
        "plain",
        mixed=True,
        channels_last=True,
    ),
)
ROW_NAMES: tuple[str, ...] = tuple(s.name for s in ROW_SPECS)
_SPEC_BY_NAME = {s.name: s for s in ROW_SPECS}
# rows that read the image folder itself (an HDF5 file cannot feed them)
FOLDER_ONLY_ROWS: tuple[str, ...] = tuple(
    s.name for s in ROW_SPECS if s.loader in ("naive", "folder", "dali")
)
# when data rows tie within this fraction, prefer the earlier backend (DALI then HDF5: the order of what
# fed ResNet-50 best in plain-loop measurements on an H200, DEVICE.md)
_BEST_TIE_FRAC = 0.03
_BACKEND_PREFERENCE = ("dali", "hdf5", "folder")
_ROW_OF_BACKEND = {"folder": "+uint8_gpu_aug", "hdf5": "+hdf5", "dali": "+dali"}


def parse_rows(text: str | Sequence[str]) -> list[str]:
    """Validate row names (comma-separated string or list) and return them in ladder order.

    Raises:
        ValueError: an unknown or empty name; the message lists the valid ones.
    """
    names = [n.strip() for n in text.split(",")] if isinstance(text, str) else [str(n).strip() for n in text]
    if not names or any(not n for n in names):
        raise ValueError(f"--rows needs comma-separated row names; valid rows: {', '.join(ROW_NAMES)}")
    unknown = [n for n in names if n not in _SPEC_BY_NAME]
    if unknown:
        raise ValueError(
            f"unknown row name(s) {', '.join(repr(n) for n in unknown)} in --rows; valid rows: {', '.join(ROW_NAMES)}"
        )
    return [n for n in ROW_NAMES if n in names]


# --------------------------------------------------------------------------------------------- naive data
class NaiveImageFolder(Dataset):
    """The input pipeline most tutorials start with, all on the CPU in the loader process.

    Per image: PIL decode of the full JPEG, random-resized-crop (scale 0.08-1, ratio 3/4-4/3) resampled to
    ``size x size``, random horizontal flip, then float32 CHW in [0, 1] normalized by ``mean``/``std``
    (what ``ToTensor`` + ``Normalize`` do). It returns ``(float32 CHW tensor, label)``.

    Args:
        root: class-per-subfolder image folder.
        size: output side in pixels.
        mean: per-channel mean in [0, 1] units.
        std: per-channel std in [0, 1] units.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        size: int = 224,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
    ) -> None:
        from lightning_gpuopt.data.folder import scan_image_folder

        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive int (pixels), got {size!r}")
        self.root = os.fspath(root)
        self.size = size
        self.classes, self.samples = scan_image_folder(self.root)
        self.mean = np.asarray(mean, dtype=np.float32).reshape(3, 1, 1)
        self.std = np.asarray(std, dtype=np.float32).reshape(3, 1, 1)

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


class _DeviceBatches:
    """The same batch, already on the device, ``length`` times (the Lightning ceiling's loader)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, length: int) -> None:
        self.x, self.y, self.length = x, y, length

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(self.length):
            yield self.x, self.y

    def __len__(self) -> int:
        return self.length


# ------------------------------------------------------------------------------------------------ config
@dataclass
class LadderConfig:
    """Settings of one ladder run (see ``lightning-gpuopt bench --help``).

    Attributes:
        data: class-per-subfolder image folder, or a ``.h5``/``.hdf5`` file (then only rows that can read
            HDF5 run; folder rows say why not).
        model: ``"small"``, ``"resnet18"`` or ``"resnet50"``.
        batch_size: samples a step.
        image_size: training crop side in pixels.
        rows: row names in ladder order (``parse_rows``); ``ceiling_plain`` is always measured (ratios).
        seconds: measured seconds a row (``0``: no time box, ``steps`` must be set).
        steps: measured steps a row at most (``None``: only ``seconds``).
        warmup: warm-up steps before measuring (cut short after half the row's seconds).
        accelerator: ``"auto"``, ``"cpu"`` or ``"gpu"``.
        num_workers: DataLoader workers for tuned rows; ``None`` measures them (``tune_num_workers``).
        tune_seconds: time budget for each worker tuning.
        cache_dir: where HDF5 conversions are cached.
        tb_dir: TensorBoard ``save_dir`` (one run a row, ``name=<NN>_<row>``); ``None``: no TensorBoard.
        time_budget_s: whole-run budget; rows shrink their seconds to fit and are skipped when it is spent.
        lr: SGD learning rate.
    """

    data: str | os.PathLike[str]
    model: str = "small"
    batch_size: int = 256
    image_size: int = 224
    rows: Sequence[str] = ROW_NAMES
    seconds: float = 10.0
    steps: int | None = None
    warmup: int = 5
    accelerator: str = "auto"
    num_workers: int | None = None
    tune_seconds: float = 10.0
    cache_dir: str | os.PathLike[str] = field(default_factory=lambda: default_cache_dir())
    tb_dir: str | os.PathLike[str] | None = None
    time_budget_s: float | None = None
    lr: float = 0.05

    def validate(self) -> None:
        """Raise ``ValueError`` naming the argument for a bad setting."""
        from lightning_gpuopt.models import MODEL_NAMES

        if self.model not in MODEL_NAMES:
            raise ValueError(f"--model {self.model!r} is unknown; choose one of {', '.join(MODEL_NAMES)}")
        for name, value, low in (("--batch-size", self.batch_size, 1), ("--image-size", self.image_size, 8)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0 steps, got {self.warmup}")
        if self.seconds < 0:
            raise ValueError(f"--seconds must be >= 0, got {self.seconds}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.seconds == 0 and self.steps is None:
            raise ValueError("--seconds 0 turns the time box off, so give --steps N to bound each row")
        if self.num_workers is not None and self.num_workers < 0:
            raise ValueError(f"--workers must be >= 0, got {self.num_workers}")
        if self.tune_seconds <= 0:
            raise ValueError(f"--tune-seconds must be > 0, got {self.tune_seconds}")
        if self.accelerator not in ("auto", "cpu", "gpu", "cuda"):
            raise ValueError(f"--accelerator must be auto, cpu or gpu, got {self.accelerator!r}")
        if self.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
            raise ValueError(
                "--accelerator gpu was asked for but no CUDA GPU is visible; use --accelerator auto"
            )
        self.rows = parse_rows(list(self.rows))
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


def default_cache_dir() -> Path:
    """``$LIGHTNING_GPUOPT_CACHE`` or ``~/.cache/lightning_gpuopt``."""
    env = os.environ.get("LIGHTNING_GPUOPT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lightning_gpuopt"


def is_hdf5_path(path: str | os.PathLike[str]) -> bool:
    return Path(path).suffix.lower() in (".h5", ".hdf5") and Path(path).is_file()


def default_model() -> str:
    """``"resnet50"`` when torchvision is importable, else the built-in ``"small"``."""
    from lightning_gpuopt._imports import _TORCHVISION_AVAILABLE

    return "resnet50" if _TORCHVISION_AVAILABLE else "small"


# ----------------------------------------------------------------------------------------------- helpers
def _component(module: str, attr: str, label: str) -> tuple[Any, str | None]:
    """``(object, None)`` or ``(None, reason)`` when the package module (or a dependency of it) is missing."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is not None and (err.name == module or module.startswith(err.name + ".")):
            return None, f"{label} ({module}) not available"
        return None, f"{label} needs {err.name!r}, which is not installed"
    obj = getattr(mod, attr, None)
    if obj is None:
        return None, f"{label} ({module}.{attr}) not available"
    return obj, None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _RowMeter(ThroughputMeter):
    """``ThroughputMeter`` with a time box (host clock; one device sync at each end of the window).

    Warm-up lasts ``warmup`` steps (at least one: it pays for cuDNN autotuning and worker start-up), cut
    short after ``warmup_seconds``. The fit stops after ``seconds`` of measuring or ``max_steps`` measured
    steps.

    With ``align_epochs`` (rows whose DataLoader workers prefetch) the window starts at an epoch start and
    ends at an epoch end: batches the workers buffered while the model was still starting up would
    otherwise be counted as if the pipeline had produced them inside the window, overstating a data-bound
    row. At an epoch boundary the buffer is empty, so whole epochs measure what the pipeline sustains. When
    an epoch is too long for that (start after ``warmup_seconds``, end after ``seconds + warmup_seconds``) the window is
    cut mid-epoch and ``aligned`` says so.
    """

    def __init__(
        self,
        warmup: int,
        warmup_seconds: float,
        seconds: float,
        max_steps: int | None,
        align_epochs: bool = False,
    ) -> None:
        super().__init__(warmup=warmup)
        self.warmup_seconds = warmup_seconds
        self.box_seconds = seconds
        self.max_steps = max_steps
        self.align_epochs = align_epochs
        self.aligned = False
        self.start_step: int | None = None
        self.measured_steps = 0
        self._fit_t0 = 0.0

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, aligned: bool) -> None:
        _sync(pl_module.device)
        self._t0 = time.perf_counter()
        self.start_step = trainer.global_step
        self.aligned = aligned

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_t0 = time.perf_counter()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # called before the epoch's iterator exists: nothing of this epoch is buffered yet
        if self.align_epochs and self._t0 is None and trainer.global_step >= max(self.warmup, 1):
            self._start(trainer, pl_module, aligned=True)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._t0 is not None:
            return
        step = trainer.global_step
        warm_steps = step >= max(self.warmup, 1)
        warm_time = step >= 1 and time.perf_counter() - self._fit_t0 >= self.warmup_seconds
        if (warm_steps and not self.align_epochs) or warm_time:
            self._start(trainer, pl_module, aligned=False)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._t0 is None:
            return
        self.measured_steps += 1
        elapsed = time.perf_counter() - self._t0
        if self.max_steps is not None and self.measured_steps >= self.max_steps:
            self.aligned = False
            trainer.should_stop = True
        elif self.box_seconds > 0 and elapsed >= self.box_seconds:
            epoch_end = batch_idx + 1 >= trainer.num_training_batches
            if not self.aligned or epoch_end or elapsed >= self.box_seconds + self.warmup_seconds:
                self.aligned = self.aligned and epoch_end
                trainer.should_stop = True


def _window_means(
    history: Sequence[dict[str, float]], start_step: int | None
) -> tuple[float | None, float | None]:
    """Mean ``gpu/util`` and ``time/data_wait_frac`` over monitor windows logged after the warm-up."""
    rows = [h for h in history if start_step is None or h.get("step", 0) > start_step] or list(history)

    def mean(key: str) -> float | None:
        vals = [float(h[key]) for h in rows if h.get(key) is not None and math.isfinite(float(h[key]))]
        return float(np.mean(vals)) if vals else None

    return mean("gpu/util"), mean("time/data_wait_frac")


def _slug(index: int, name: str) -> str:
    return f"{index:02d}_{name.lstrip('+').replace('/', '_')}"


# ------------------------------------------------------------------------------------------------ runner
class LadderRunner:
    """Runs the rows of a ``LadderConfig``; use ``run_ladder``."""

    def __init__(self, config: LadderConfig, progress: Progress | None = None) -> None:
        config.validate()
        self.cfg = config
        self.say: Progress = progress or (lambda _msg: None)
        self.data = Path(config.data).expanduser()
        self.data_is_h5 = is_hdf5_path(self.data)
        if config.accelerator == "auto":
            self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        else:
            self.device = torch.device("cpu") if config.accelerator == "cpu" else torch.device("cuda", 0)
        self.cuda = self.device.type == "cuda"
        self.num_classes = self._count_classes()
        self.storage_size = round(config.image_size * 256 / 224)
        self._naive_workers: int | None = config.num_workers
        self._dm_workers: dict[str, int] = {}
        self._h5_path: Path | None = self.data if self.data_is_h5 else None
        self._t_start = time.perf_counter()
        self._ceiling: float | None = None

    # -- setup ----------------------------------------------------------------------------------------
    def _count_classes(self) -> int:
        if self.data_is_h5:
            cls, _ = _component("lightning_gpuopt.data.hdf5", "HDF5ImageDataset", "HDF5 dataset")
            if cls is None:
                return 1000  # only the ceilings can run; their logits count does not change the speed much
            return max(len(cls(os.fspath(self.data)).classes), 2)
        from lightning_gpuopt.data.folder import scan_image_folder

        classes, samples = scan_image_folder(self.data)
        if len(samples) < self.cfg.batch_size:
            raise ValueError(
                f"--data {str(self.data)!r} holds {len(samples)} images, fewer than one batch "
                f"(--batch-size {self.cfg.batch_size}); lower --batch-size or use more images"
            )
        return max(len(classes), 2)

    def _trainer(
        self, row_index: int, spec: RowSpec, callbacks: list[pl.Callback], max_seconds: float | None
    ) -> pl.Trainer:
        logger: Any = False
        if self.cfg.tb_dir is not None:
            from lightning.pytorch.loggers import TensorBoardLogger

            logger = TensorBoardLogger(
                os.fspath(self.cfg.tb_dir), name=_slug(row_index, spec.name), version=""
            )
        return pl.Trainer(
            accelerator="gpu" if self.cuda else "cpu",
            devices=1,
            precision=cast(Any, self._precision(spec)),
            max_epochs=-1,
            max_steps=-1,
            # a safety net only: the row's meter stops the fit long before
            max_time=None if max_seconds is None else timedelta(seconds=max_seconds),
            limit_val_batches=0,
            num_sanity_val_steps=0,
            logger=logger,
            log_every_n_steps=5,
            callbacks=callbacks,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )

    def _precision(self, spec: RowSpec) -> str:
        return "16-mixed" if spec.mixed and self.cuda else "32-true"

    def _monitor(self, spec: RowSpec) -> tuple[pl.Callback | None, str | None]:
        cls, why = _component("lightning_gpuopt.observe.gpu_stats", "GPUStatsMonitor", "GPUStatsMonitor")
        if cls is None:
            return None, why
        # the naive row makes about one step a second: short windows still give several after the warm-up
        window = 2 if spec.loader == "naive" and not spec.tuned_workers else 10
        return cls(log_every_n_steps=window, gpu=self.cuda), None

    def _model(self) -> pl.LightningModule:
        from lightning_gpuopt.models import ImageClassifier

        return ImageClassifier(self.cfg.model, num_classes=self.num_classes, lr=self.cfg.lr)

    def _tuned_naive_workers(self, dataset: Dataset) -> tuple[int | None, str | None]:
        if self._naive_workers is not None:
            return self._naive_workers, None
        tune, why = _component("lightning_gpuopt.data.tuning", "tune_num_workers", "worker tuner")
        if tune is None:
            return None, why
        self.say(f"tuning DataLoader workers for the naive dataset ({self.cfg.tune_seconds:.0f} s budget)...")
        # PIL decode scales with cores; a coarse set of counts fits a short budget at large batch sizes
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        candidates = sorted({max(1, cpus * k // 4) for k in (1, 2, 3, 4)})
        result = tune(
            dataset,
            candidates=candidates,
            budget_s=self.cfg.tune_seconds,
            target_samples_per_sec=self._tune_target(),
            batch_size=self.cfg.batch_size,
            loader_kwargs={"drop_last": True},
            cache_dir=self.cfg.cache_dir,
        )
        n = int(result.best)
        src = "cached" if result.cached else f"measured in {result.seconds:.1f} s"
        self.say(f"  -> {n} workers ({src})")
        self._naive_workers = n
        return n, None

    def _tune_target(self) -> float | None:
        """What the fastest compute can consume (the plain-loop ceiling): the tuner stops once the loader,
        measured alone, delivers its headroom (2x) over that."""
        return self._ceiling if self._ceiling else None

    def _hdf5_file(self) -> tuple[Path | None, str | None]:
        if self._h5_path is not None:
            return self._h5_path, None
        convert, why = _component("lightning_gpuopt.data.hdf5", "convert_folder_to_hdf5", "HDF5 converter")
        if convert is None:
            return None, why
        src = self.data.resolve()
        digest = hashlib.sha1(f"{src}:{os.path.getmtime(src)}".encode()).hexdigest()[:10]
        out = Path(self.cfg.cache_dir).expanduser() / "hdf5" / f"{src.name}-{digest}-{self.storage_size}px.h5"
        if out.is_file():
            self.say(f"using cached HDF5 copy {out}")
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            self.say(f"converting {src} to uint8 HDF5 ({self.storage_size}px) at {out} (once, cached)...")
            t0 = time.perf_counter()
            # the converter writes a temporary file and renames it when complete, so an interrupted
            # conversion never looks cached; it draws its own progress bar on stderr
            convert(os.fspath(src), os.fspath(out), size=self.storage_size, progress=True)
            self.say(
                f"  -> converted in {time.perf_counter() - t0:.1f} s ({out.stat().st_size / 2**20:.0f} MiB)"
            )
        self._h5_path = out
        return out, None

    def _best_backend(self, done: dict[str, dict[str, Any]]) -> str:
        measured = {
            b: done[r]["samples_per_sec"]
            for b, r in _ROW_OF_BACKEND.items()
            if r in done and done[r]["status"] == OK and done[r]["samples_per_sec"]
        }
        if measured:
            top = max(measured.values())
            for b in _BACKEND_PREFERENCE:
                if b in measured and measured[b] >= top * (1 - _BEST_TIE_FRAC):
                    return b
        # nothing measured in this run: HDF5 when it can be had, else the folder
        if self.data_is_h5:
            return "hdf5"
        _, why = _component("lightning_gpuopt.data.hdf5", "convert_folder_to_hdf5", "HDF5 converter")
        return "hdf5" if why is None else "folder"

    # -- rows -----------------------------------------------------------------------------------------
    def cannot_run_reason(self, spec: RowSpec) -> tuple[str, str] | None:
        """``(status, reason)`` when ``spec`` cannot run here, else ``None``."""
        if self.data_is_h5 and spec.name in FOLDER_ONLY_ROWS:
            return CANNOT_RUN, "needs an image folder; --data is an HDF5 file"
        if spec.needs_cuda is not None and not self.cuda:
            return CANNOT_RUN, spec.needs_cuda
        if spec.loader == "dali":
            from lightning_gpuopt._imports import _DALI_AVAILABLE

            if not _DALI_AVAILABLE:
                return CANNOT_RUN, "NVIDIA DALI is not installed (pip install 'lightning-gpuopt[dali]')"
        return None

    def _base_row(self, spec: RowSpec) -> dict[str, Any]:
        return {
            "name": spec.name,
            "adds": spec.adds,
            "status": OK,
            "reason": None,
            "samples_per_sec": None,
            "ratio_to_ceiling": None,
            "speedup_vs_naive": None,
            "gpu_util_mean": None,
            "data_wait_frac": None,
            "backend": None,
            "num_workers": None,
            "pin_memory": None,
            "precision": self._precision(spec) if spec.loader != "plain" else None,
            "channels_last": spec.channels_last,
            "batch_size": self.cfg.batch_size,
            "steps_measured": None,
            "seconds_measured": None,
            "whole_epochs": None,
        }

    def _row_seconds(self, rows_left: int) -> float | None:
        """This row's measured seconds within the whole-run budget, or ``None`` when it is spent."""
        if self.cfg.time_budget_s is None:
            return self.cfg.seconds
        left = self.cfg.time_budget_s - (time.perf_counter() - self._t_start)
        if left < 5.0:
            return None
        # start-up and warm-up (up to the measured seconds for prefetching rows) take about half a row
        share = 0.45 * left / max(rows_left, 1)
        return max(1.0, min(self.cfg.seconds, share)) if self.cfg.seconds > 0 else share

    def run_plain(self, row: dict[str, Any], seconds: float) -> None:
        from lightning_gpuopt.models import build_model

        model = build_model(self.cfg.model, self.num_classes)
        dtype = torch.float16 if self.cuda else None
        kwargs: dict[str, Any] = dict(
            batch_size=self.cfg.batch_size,
            image_size=self.cfg.image_size,
            num_classes=self.num_classes,
            dtype=dtype,
            channels_last=True,
            device=self.device,
            lr=self.cfg.lr,
        )
        # calibrate how many steps fit in the time box, then measure
        t0 = time.perf_counter()
        plain_loop_throughput(model, steps=2, warmup=max(1, min(self.cfg.warmup, 3)), **kwargs)
        rate = plain_loop_throughput(model, steps=3, warmup=0, **kwargs)
        self.say(f"  calibrated in {time.perf_counter() - t0:.1f} s")
        steps = max(3, int(rate * (seconds or 1.0) / self.cfg.batch_size)) if seconds > 0 else 3
        if self.cfg.steps is not None:
            steps = min(steps, self.cfg.steps) if seconds > 0 else self.cfg.steps
        t0 = time.perf_counter()
        row["samples_per_sec"] = plain_loop_throughput(model, steps=steps, warmup=1, **kwargs)
        row["seconds_measured"] = time.perf_counter() - t0
        row["steps_measured"] = steps
        row["precision"] = "fp16 autocast" if dtype is not None else "fp32"
        row["backend"] = "synthetic (device)"
        del model

    def _loader_for(
        self, spec: RowSpec, row: dict[str, Any], done: dict[str, dict[str, Any]]
    ) -> tuple[Any, str | None]:
        """``(dataloader_or_datamodule, None)`` or ``(None, reason)`` when a component is missing."""
        cfg = self.cfg
        if spec.loader == "naive":
            dataset = NaiveImageFolder(self.data, size=cfg.image_size)
            workers = 0
            if spec.tuned_workers:
                n, why = self._tuned_naive_workers(dataset)
                if n is None:
                    return None, why
                workers = n
            row.update(backend="PIL float (CPU)", num_workers=workers, pin_memory=spec.pin_memory)
            return DataLoader(
                dataset,
                batch_size=cfg.batch_size,
                shuffle=True,
                num_workers=workers,
                pin_memory=spec.pin_memory,
                drop_last=True,
                persistent_workers=workers > 0,
                prefetch_factor=4 if workers > 0 else None,
            ), None
        if spec.loader == "device":
            mf = torch.channels_last if spec.channels_last else torch.contiguous_format
            x = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size, device=self.device)
            x = x.contiguous(memory_format=mf)
            y = torch.randint(0, self.num_classes, (cfg.batch_size,), device=self.device)
            row.update(backend="synthetic (device)", num_workers=0)
            return _DeviceBatches(x, y, 1_000_000), None
        dm_cls, why = _component(
            "lightning_gpuopt.data.datamodule", "OptimizedDataModule", "OptimizedDataModule"
        )
        if dm_cls is None:
            return None, why
        backend = spec.loader if spec.loader != "best" else self._best_backend(done)
        source = self.data
        if backend == "hdf5":
            h5, why = self._hdf5_file()
            if h5 is None:
                return None, why
            source = h5
        elif backend == "dali":
            _, why = _component("lightning_gpuopt.data.dali", "build_dali_loader", "DALI loader")
            if why is not None:
                return None, why
        dm_workers: int | str = self._dm_workers.get(
            backend, cfg.num_workers if cfg.num_workers is not None else "auto"
        )
        dm = dm_cls(
            train_dir=os.fspath(source),
            backend=backend,
            batch_size=cfg.batch_size,
            image_size=cfg.image_size,
            num_workers=dm_workers,
            tune_budget_s=cfg.tune_seconds,
            tune_target_samples_per_sec=self._tune_target(),
            tune_cache_dir=cfg.cache_dir,
        )
        row.update(backend=backend, num_workers=dm_workers if isinstance(dm_workers, int) else None)
        return dm, None

    def run_fit(
        self, index: int, spec: RowSpec, row: dict[str, Any], seconds: float, done: dict[str, dict[str, Any]]
    ) -> None:
        loader, why = self._loader_for(spec, row, done)
        if loader is None:
            row.update(status=SKIPPED, reason=why)
            return
        callbacks: list[pl.Callback] = []
        if spec.channels_last and spec.loader != "device":
            cl_cls, why = _component("lightning_gpuopt.compute.channels_last", "ChannelsLast", "ChannelsLast")
            if cl_cls is None:
                row.update(status=SKIPPED, reason=why)
                return
            callbacks.append(cl_cls())
        model = self._model()
        if spec.channels_last and spec.loader == "device":
            # the ceiling needs no package component: the model is simply made channels_last
            model = model.to(memory_format=torch.channels_last)
        # a prefetching loader must be measured over whole epochs (see _RowMeter); the others need no
        # long warm-up, which keeps the naive row (about a step a second on ImageNet JPEGs) short
        buffered = spec.loader not in ("naive", "device") or bool(row["num_workers"])
        warmup_cap = max(seconds, 1.0) if buffered else max(seconds / 2, 1.0)
        meter = _RowMeter(self.cfg.warmup, warmup_cap, seconds, self.cfg.steps, align_epochs=buffered)
        monitor, monitor_why = self._monitor(spec)
        callbacks += [meter] + ([monitor] if monitor is not None else [])
        safety = 3 * (warmup_cap + seconds) + 120 if seconds > 0 else None
        trainer = self._trainer(index, spec, callbacks, safety)
        with warnings.catch_warnings():
            # the naive rows are meant to have few workers; Lightning's hint would only repeat the table
            warnings.filterwarnings("ignore", message=".*does not have many workers.*")
            warnings.filterwarnings("ignore", message=".*Consider setting `persistent_workers=True`.*")
            # rows train only: no validation loop, and short rows may end before a logging interval
            warnings.filterwarnings("ignore", message=".*no `val_dataloader`.*")
            warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")
            if isinstance(loader, pl.LightningDataModule):
                trainer.fit(model, datamodule=loader)
                resolved = getattr(loader, "num_workers", None)
                if isinstance(resolved, int) and row["backend"]:
                    self._dm_workers[row["backend"]] = resolved
                    row["num_workers"] = resolved
                row["pin_memory"] = (
                    getattr(loader, "pin_memory", None)
                    if isinstance(getattr(loader, "pin_memory", None), bool)
                    else None
                )
            else:
                trainer.fit(model, train_dataloaders=loader)
        row["samples_per_sec"] = meter.samples_per_sec
        row["seconds_measured"] = meter.seconds
        row["steps_measured"] = meter.measured_steps
        row["whole_epochs"] = meter.aligned if buffered else None
        if meter.samples_per_sec is None:
            row.update(status=FAILED, reason="the fit ended before the warm-up did (too few batches?)")
        if monitor is not None:
            gpu, wait = _window_means(getattr(monitor, "history", []), meter.start_step)
            row["gpu_util_mean"] = gpu if self.cuda else None
            row["data_wait_frac"] = wait
        elif monitor_why:
            row["monitor"] = f"skipped: {monitor_why}"
        for lg in trainer.loggers:
            lg.log_metrics(
                {
                    f"bench/{k}": float(row[k])
                    for k in ("samples_per_sec", "gpu_util_mean", "data_wait_frac")
                    if row[k] is not None
                },
                step=trainer.global_step,
            )
            lg.finalize("success")
        del trainer, model, loader

    def run(self) -> list[dict[str, Any]]:
        """Run the selected rows (ceilings first) and return them in ladder order, ratios filled in."""
        cfg = self.cfg
        selected = list(cfg.rows)
        order: list[str] = [
            n for n in ("ceiling_plain", "ceiling_lightning") if n in selected or n == "ceiling_plain"
        ]
        order += [n for n in ROW_NAMES if n in selected and n not in order]
        if self.cuda:
            # every row and the ceiling alike pick their fastest cuDNN kernels (Trainer(benchmark=None)
            # keeps this session value)
            torch.backends.cudnn.benchmark = True
        done: dict[str, dict[str, Any]] = {}
        for i, name in enumerate(order):
            spec = _SPEC_BY_NAME[name]
            index = ROW_NAMES.index(name)
            row = self._base_row(spec)
            done[name] = row
            blocked = self.cannot_run_reason(spec)
            if blocked is not None:
                row.update(status=blocked[0], reason=blocked[1])
                self.say(f"[{i + 1}/{len(order)}] {name}: {blocked[0]}: {blocked[1]}")
                continue
            seconds = self._row_seconds(len(order) - i)
            if seconds is None:
                row.update(status=SKIPPED, reason="time budget spent")
                self.say(f"[{i + 1}/{len(order)}] {name}: skipped: time budget spent")
                continue
            self.say(f"[{i + 1}/{len(order)}] {name}: {spec.adds} (measuring ~{seconds:.0f} s)...")
            try:
                if spec.loader == "plain":
                    self.run_plain(row, seconds)
                else:
                    self.run_fit(index, spec, row, seconds, done)
            except (torch.cuda.OutOfMemoryError, RuntimeError, OSError, ValueError) as err:
                # one broken row must not hide the others; its reason is in the table and JSON
                row.update(status=FAILED, reason=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
                self.say("".join(traceback.format_exception(err)).rstrip())
            finally:
                gc.collect()
                if self.cuda:
                    torch.cuda.empty_cache()
            if name == "ceiling_plain":
                self._ceiling = row["samples_per_sec"]
            if row["status"] == OK:
                self.say(f"  -> {row['samples_per_sec']:,.1f} samples/s ({row['steps_measured']} steps)")
            else:
                self.say(f"  -> {row['status']}: {row['reason']}")
        rows = [done[n] for n in ROW_NAMES if n in done]
        ceiling = done["ceiling_plain"]["samples_per_sec"]
        naive = done.get("naive", {}).get("samples_per_sec")
        for row in rows:
            sps = row["samples_per_sec"]
            if sps is not None:
                row["ratio_to_ceiling"] = sps / ceiling if ceiling else None
                row["speedup_vs_naive"] = sps / naive if naive else None
        return rows


def run_ladder(config: LadderConfig, progress: Progress | None = None) -> list[dict[str, Any]]:
    """Run the ladder and return its rows (dicts with the ``write_results`` row keys and more).

    Args:
        config: what to run.
        progress: called with one line per phase (dataset work, each row); ``None`` is silent.
    """
    return LadderRunner(config, progress).run()


TABLE_COLUMNS = (
    "name",
    "samples_per_sec",
    "ratio_to_ceiling",
    "speedup_vs_naive",
    "gpu_util_mean",
    "data_wait_frac",
    "backend",
    "num_workers",
    "precision",
    "status",
)


def format_ladder_table(rows: Sequence[dict[str, Any]]) -> str:
    """The ladder as a text table; rows that did not run show ``status: reason``."""
    shown = []
    for r in rows:
        s = dict(r)
        if r.get("status") != OK:
            s["status"] = f"{r.get('status')}: {r.get('reason')}"
        shown.append(s)
    return format_table(shown, TABLE_COLUMNS)


def format_ladder_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The ladder as a Markdown table (for README/docs), rows that did not run say why."""

    def num(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = [
        "| row | adds | samples/s | of ceiling | x naive | GPU-Util % | data-wait | status |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        status = "ok" if r.get("status") == OK else f"{r.get('status')}: {r.get('reason')}"
        lines.append(
            f"| `{r['name']}` | {r.get('adds', '')} | {num(r.get('samples_per_sec'), ',.0f')} | "
            f"{num(r.get('ratio_to_ceiling'), '.3f')} | {num(r.get('speedup_vs_naive'), '.1f')} | "
            f"{num(r.get('gpu_util_mean'), '.1f')} | {num(r.get('data_wait_frac'), '.3f')} | {status} |"
        )
    return "\n".join(lines)


def write_ladder_json(
    path: str | os.PathLike[str], rows: Sequence[dict[str, Any]], config: LadderConfig, **extra: Any
) -> Path:
    """``write_results`` with the ladder's config and the ceiling it measured."""
    ceiling = next((r["samples_per_sec"] for r in rows if r["name"] == "ceiling_plain"), None)
    cfg = asdict(config)
    cfg = {k: (os.fspath(v) if isinstance(v, os.PathLike) else v) for k, v in cfg.items()}
    cfg["rows"] = list(config.rows)
    return write_results(path, rows, benchmark="ladder", config=cfg, ceiling_samples_per_sec=ceiling, **extra)


def plot_ladder(rows: Sequence[dict[str, Any]], path: str | os.PathLike[str], title: str = "") -> Path:
    """Horizontal bar chart of samples/s per row (ratio to the ceiling and speed-up in the labels).

    Raises:
        ModuleNotFoundError: matplotlib is missing (extra ``plot``).
    """
    from lightning_gpuopt._imports import require

    require("matplotlib")
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    names = [r["name"] for r in rows]
    values = [r["samples_per_sec"] or 0.0 for r in rows]
    ceiling = next((r["samples_per_sec"] for r in rows if r["name"] == "ceiling_plain"), None)
    colors = ["#9e9e9e" if r["name"].startswith("ceiling") else "#1f77b4" for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.6))
    y = np.arange(len(rows))[::-1]
    ax.barh(y, values, color=colors)
    top = max([*values, 1.0])
    for yi, r, v in zip(y, rows, values, strict=True):
        if r.get("status") != OK:
            label = f"{r.get('status')}: {r.get('reason')}"
        else:
            parts = [f"{v:,.0f}/s"]
            if r.get("ratio_to_ceiling") is not None:
                parts.append(f"{r['ratio_to_ceiling']:.2f} of ceiling")
            if r.get("speedup_vs_naive") is not None and r["name"] != "naive":
                parts.append(f"{r['speedup_vs_naive']:.1f}x naive")
            if r.get("gpu_util_mean") is not None:
                parts.append(f"GPU {r['gpu_util_mean']:.0f}%")
            label = ", ".join(parts)
        ax.text(v + top * 0.01, yi, label[:90], va="center", fontsize=8)
    if ceiling:
        ax.axvline(ceiling, color="#d62728", linestyle="--", linewidth=1)
    ax.set_yticks(y)
    ax.set_yticklabels(names)
    ax.set_xlim(0, top * 1.75)
    ax.set_xlabel("training samples/s (higher is better)")
    ax.set_title(title or "lightning-gpuopt ladder", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_outputs(
    rows: Sequence[dict[str, Any]],
    config: LadderConfig,
    json_path: str | os.PathLike[str],
    png_path: str | os.PathLike[str] | None,
    title: str = "",
    **extra: Any,
) -> tuple[Path, Path | None, str | None]:
    """Write the JSON and (when matplotlib is installed) the PNG; returns ``(json, png or None, note)``."""
    png: Path | None = None
    note: str | None = None
    if png_path is not None:
        try:
            png = plot_ladder(rows, png_path, title)
        except ModuleNotFoundError as err:
            note = f"PNG chart skipped: {err}"
    js = write_ladder_json(json_path, rows, config, png=os.fspath(png) if png else None, **extra)
    return js, png, note
