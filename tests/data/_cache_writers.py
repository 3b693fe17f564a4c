"""What a process of the worker-tuning cache test runs (a light module: spawned processes import it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_gpuopt.data import _tuning_cache


def write_entries(path: Path, writer: int, count: int, start: Any) -> None:
    """Wait for ``start``, then write ``count`` entries ``w<writer>-<i>`` into the cache at ``path``."""
    start.wait(60)
    for i in range(count):
        _tuning_cache._write_cache(path, f"w{writer}-{i}", {"best": 1, "table": []})
