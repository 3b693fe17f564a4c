"""The ladder, its ceilings, and the demo's model and data (``lightning-gpuopt bench`` and ``demo``).

This package measures the product; the product never imports it. ``rows`` holds the ladder's rows and
settings, ``runner`` runs them (``steady`` measures), ``report`` takes the ratios and writes what a run leaves
behind, ``demo`` is the demo's work.

Example:
    >>> from lightning_gpuopt.bench import LadderConfig, run_ladder
    >>> rows = run_ladder(LadderConfig("data/train", model="resnet50"))  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "LadderConfig": "lightning_gpuopt.bench.rows",
    "run_ladder": "lightning_gpuopt.bench.runner",
    "ImageClassifier": "lightning_gpuopt.bench.models",
    "make_jpeg_folder": "lightning_gpuopt.bench.synthetic",
}

__all__ = ["ImageClassifier", "LadderConfig", "make_jpeg_folder", "run_ladder"]


def __getattr__(name: str) -> Any:
    # imported on first use: ``bench.runs`` and ``bench.rows`` load without torch's training stack
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lightning_gpuopt.bench' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(_EXPORTS[name]), name)  # pdoc reads __dict__
    return value


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from lightning_gpuopt.bench.models import ImageClassifier
    from lightning_gpuopt.bench.rows import LadderConfig
    from lightning_gpuopt.bench.runner import run_ladder
    from lightning_gpuopt.bench.synthetic import make_jpeg_folder
