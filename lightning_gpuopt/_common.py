"""Facts the whole package shares, each defined once."""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

#: torchvision's ImageNet normalization (``transforms.Normalize``), RGB order, on the 0..1 scale.
IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)

#: environment variable naming the folder where measured settings (worker counts, demo data) are cached.
CACHE_ENV = "LIGHTNING_GPUOPT_CACHE_DIR"


def available_cpus() -> int:
    """CPUs this process may run on (``os.sched_getaffinity``, which respects taskset and cgroup cpusets)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def eval_resize_size(image_size: int) -> int:
    """The shorter side torchvision's evaluation recipe resizes to before ``CenterCrop(image_size)``."""
    return round(image_size * 256 / 224)


def upsamples(source_px: int, target_px: int) -> bool:
    """Whether resizing a side of ``source_px`` pixels to ``target_px`` upsamples it."""
    return target_px > source_px


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """``override``, else ``$LIGHTNING_GPUOPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/lightning_gpuopt``
    (``~/.cache/lightning_gpuopt``)."""
    if override is not None:
        return Path(override).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "lightning_gpuopt")


def warn_once(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn once per process and message, on rank zero only, attributed to the user's line (the first caller
    outside this package, Lightning and torch)."""
    cache = _warnings()
    if message in cache:
        return
    cache.add(message)
    warn_at_user(message, category)


def info_once(message: str) -> None:
    """Log ``message`` at INFO level once per process, on rank zero only."""
    _warnings().info(message)


def warn_at_user(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn on rank zero only, attributed to the user's line as ``warn_once`` attributes it (every time)."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    if getattr(rank_zero_only, "rank", 0) == 0:
        warnings.warn(message, category=category, stacklevel=_user_level(sys._getframe(1)) + 1)


# package folders whose frames a warning is never attributed to (this package first)
_INTERNAL_PACKAGES = (
    "lightning_gpuopt",
    "lightning",
    "lightning_fabric",
    "pytorch_lightning",
    "lightning_utilities",
    "torch",
)


def package_dirs(names: Sequence[str]) -> tuple[str, ...]:
    """The folders (real paths, ending in a separator) of the importable packages ``names``."""
    import importlib.util

    dirs = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        for location in (spec.submodule_search_locations or ()) if spec is not None else ():
            dirs.append(os.path.join(os.path.realpath(location), ""))
    return tuple(dirs)


@functools.cache
def _internal_dirs() -> tuple[str, ...]:
    return package_dirs(_INTERNAL_PACKAGES)


def _user_level(frame: FrameType | None) -> int:
    """``stacklevel`` of the first frame outside ``_INTERNAL_PACKAGES``, else outside this package, else 1."""
    internal, own = _internal_dirs(), _internal_dirs()[:1]
    level, outside_own = 1, None
    while frame is not None:
        filename = frame.f_code.co_filename
        if not ("importlib" in filename and "_bootstrap" in filename):
            path = os.path.realpath(filename)
            if not path.startswith(internal):
                return level
            if outside_own is None and own and not path.startswith(own):
                outside_own = level
            level += 1
        frame = frame.f_back
    return outside_own or 1


@functools.cache
def _warnings() -> Any:
    from lightning.pytorch.utilities.rank_zero import WarningCache

    return WarningCache()


def format_table(rows: Iterable[Mapping[str, Any] | Sequence[Any]], columns: Sequence[str]) -> str:
    """The package's one fixed-width text table: a header, a rule of dashes, then a line a row (a mapping of
    cells by column name, or a sequence of cells in column order).

    Example:
        >>> print(format_table([{"row": "naive", "samples/s": 1234.5}, {"row": "hdf5"}], ["row", "samples/s"]))
        row    samples/s
        -----  ---------
        naive  1,234.5
        hdf5   -
    """

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 10 else f"{v:,.1f}"
        return str(v)

    body = [[cell(v) for v in ([r.get(c) for c in columns] if isinstance(r, Mapping) else r)] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(columns)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(cells, widths, strict=True)).rstrip()

    return "\n".join([line(columns), line(["-" * w for w in widths]), *(line(b) for b in body)])


@dataclass
class FeedInfo:
    """How a training loader feeds the GPU, as the ``BottleneckAdvisor`` reads it from a loader's (or its
    dataset's) ``feed_info``: ``backend`` (``"folder"``, ``"hdf5"``, ``"dali"``), ``decoder`` (``"cpu"``,
    ``"gpu"``: nvJPEG), ``threads`` (DALI's or the HDF5 store's CPU threads); ``None``: unknown or none."""

    backend: str | None = None
    num_workers: int | None = None
    pin_memory: bool | None = None
    batch_size: int | None = None
    host_batches: bool | None = None
    decoder: str | None = None
    threads: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: Name of the attribute a loader sets to the cumulative seconds its consumer spent inside ``next()``
#: (``GPUStatsMonitor`` reads it to tell time inside the loader from time blocked behind the GPU).
FETCH_SECONDS_ATTR = "fetch_seconds"


def synchronize(device: Any) -> None:
    """Wait for ``device``'s queued work (CUDA only)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
