"""The before/after ladder, its ceilings, and the demo models and data (``lightning-gpuopt bench`` and ``demo``).

This package measures the product; the product (``data/``, ``compute/``, ``observe/``) never imports it. It
holds what the two commands use; what only the benchmark scripts use lives in ``benchmarks/``.

=================  ==========================================================================================
module             what it holds
=================  ==========================================================================================
``rows``           the ladder's rows (``ROW_SPECS``), ``LadderConfig``, the naive PIL dataset
``steady``         ``StepClock`` (a CUDA event at every batch end, warm-up past the compile and the
                   prefetch, then a fixed window), ``measure_loop``, ``summarize``
``meter``          ``first_fast_step`` (when a compile is over), ``compare`` (a difference beyond the noise)
``runner``         ``run_ladder``: each row several Lightning fits (plain loops for the ceilings) taking turns
``ceilings``       ``fill_ratios``: ratios turn by turn against the compiled ceiling where measured, and the
                   eager one
``report``         tables, results JSON, PNG chart, the recorded GPU ladder shipped with the package
``measure``        ``PlainLoop`` (the ceilings), ``write_results``, ``fit``, ``quiet_lightning``
``models``         ``ImageClassifier`` and the built-in ``SmallResNet``
``synthetic``      ``make_jpeg_folder``: ImageNet-shaped generated JPEGs
``demo``           ``run_demo``
``runs``           versioned run folders and output paths checked before work
=================  ==========================================================================================

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
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_gpuopt.bench' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from lightning_gpuopt.bench.models import ImageClassifier
    from lightning_gpuopt.bench.rows import LadderConfig
    from lightning_gpuopt.bench.runner import run_ladder
    from lightning_gpuopt.bench.synthetic import make_jpeg_folder
