"""What compiling costs a model and saves it, measured in a compiled run (``CostMeter``) and kept in
``compile.json`` in the cache folder for the next run's decision on this GPU (docs/compute.md)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from lightning_gpuopt._common import cache_dir, synchronize

COST_FILE = "compile.json"
#: batches to warm up (cuDNN autotunes, graph trees record, the allocator settles), then timed: eager batches
#: for ``CompileModel(when="auto")``'s decision, compiled ones after the first for the cost
WARMUP_BATCHES, TIMED_BATCHES = 5, 10


@dataclass(frozen=True)
class MeasuredCost:
    """A compiled run's figures: ``seconds`` compiling cost, ``saving`` the share of an eager step a compiled
    one saved (negative: slower), and the ``compiled_step`` and ``eager_step`` times (seconds)."""

    seconds: float
    saving: float | None
    compiled_step: float
    eager_step: float | None


def cost_key(module: torch.nn.Module, device: torch.device) -> str:
    """A compile cost's key: the model's class and parameter count, the GPU, the torch version."""
    cuda = device.type == "cuda" and torch.cuda.is_available()
    info = {
        "model": f"{type(module).__module__}.{type(module).__qualname__}",
        "parameters": sum(p.numel() for p in module.parameters()),
        "device": torch.cuda.get_device_name(device) if cuda else device.type,
        "torch": torch.__version__,
    }
    return hashlib.sha1(json.dumps(info, sort_keys=True).encode()).hexdigest()[:16]


def _read() -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        data = json.loads((cache_dir() / COST_FILE).read_text())
        if isinstance(data, dict):
            return data
    return {}


def measured_cost(key: str) -> tuple[float, float] | None:
    """``(compile seconds, saving)`` measured for ``key`` in an earlier run, where both were measured."""
    entry: Any = _read().get(key)
    try:
        return float(entry["seconds"]), float(entry["saving"])
    except (TypeError, KeyError, ValueError):  # none kept, or a saving not measured (null)
        return None


def record(key: str, cost: MeasuredCost) -> None:
    """Keep ``cost`` under ``key`` for the next run (a folder that cannot be written keeps nothing)."""
    path = cache_dir() / COST_FILE
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read()
        data[key] = {"seconds": cost.seconds, "saving": cost.saving, "date": time.time()}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)  # whole: a reader never sees half a file


class CostMeter:
    """Times a run compiled from batch ``first``: that batch, then ``TIMED_BATCHES`` compiled batches after
    ``WARMUP_BATCHES`` more, each boundary after a device sync."""

    def __init__(self, first: int, eager_step: float | None) -> None:
        self.first, self.eager_step = first, eager_step
        start = first + 1 + WARMUP_BATCHES
        self._points = {first: 0, first + 1: 1, start: 2, start + TIMED_BATCHES: 3}
        self._marks: dict[int, float] = {}

    def at_batch_start(self, index: int, device: torch.device) -> MeasuredCost | None:
        """Mark batch ``index``'s start where it is a boundary; the figures once the last one is marked."""
        point = self._points.get(index)
        if point is None:
            return None
        synchronize(device)
        self._marks[point] = time.perf_counter()
        if point < 3:
            return None
        first_step = self._marks[1] - self._marks[0]
        compiled = (self._marks[3] - self._marks[2]) / TIMED_BATCHES
        eager = self.eager_step
        seconds = max(0.0, first_step - (eager if eager is not None else compiled))
        saving = 1.0 - compiled / eager if eager else None
        return MeasuredCost(seconds, saving, compiled, eager)
