"""Where ``NVTXRanges`` sends its ranges: the ``nvtx`` package, ``torch.cuda.nvtx``, or nowhere.

Every backend has ``push(message, color, cache)``, ``pop()``, ``mark(message, color)`` and ``enabled``
(False when nothing can be recorded, so callers skip their per-step work).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from lightning_gpuopt._common import warn_once
from lightning_gpuopt._imports import require

__all__ = ["DEFAULT_DOMAIN", "BackendName", "make_backend"]

DEFAULT_DOMAIN = "lightning_gpuopt"

BackendName = Literal["auto", "nvtx", "torch"]


class _NullBackend:
    """NVTX unavailable: every call does nothing."""

    enabled = False
    push = pop = mark = staticmethod(lambda *args: None)


class _NvtxPackageBackend:
    """The ``nvtx`` package: own domain, ARGB colors, registered strings for the fixed names."""

    def __init__(self, domain: str) -> None:
        nvtx = require("nvtx")
        self._domain = nvtx.get_domain(domain)
        # Without an attached tool nvtx hands out a DummyDomain that records nothing. Whether a tool is
        # attached (NVTX_INJECTION64_PATH) is fixed before the first NVTX call of the process.
        self.enabled = isinstance(self._domain, nvtx.Domain)
        self._attrs: dict[str, Any] = {}
        self._uncached: dict[int, Any] = {}  # color -> reused attributes for numbered names
        # Domain.get_registered_string is an unbounded lru_cache: numbered names ("step 123") go through the
        # uncached function so a long run does not grow a cache entry per step.
        method = type(self._domain).get_registered_string
        self._register_uncached = getattr(method, "__wrapped__", method)

    def _attributes(self, message: str, color: int, cache: bool) -> Any:
        if cache:
            attrs = self._attrs.get(message)
            if attrs is None:
                attrs = self._attrs[message] = self._domain.get_event_attributes(message=message, color=color)
            return attrs
        # one attributes object per color is reused: NVTX reads it during the push/mark call only
        attrs = self._uncached.get(color)
        if attrs is None:
            attrs = self._uncached[color] = self._domain.get_event_attributes(color=color)
        attrs.message = self._register_uncached(self._domain, message)
        return attrs

    def push(self, message: str, color: int, cache: bool = True) -> None:
        if self.enabled:
            self._domain.push_range(self._attributes(message, color, cache))

    def pop(self) -> None:
        if self.enabled:
            self._domain.pop_range()

    def mark(self, message: str, color: int) -> None:
        if self.enabled:
            self._domain.mark(self._attributes(message, color, cache=False))


class _TorchBackend:
    """``torch.cuda.nvtx``: default domain, no colors (CUDA builds of torch only)."""

    enabled = True  # whether a tool listens is not visible from here

    def push(self, message: str, color: int, cache: bool = True) -> None:
        torch.cuda.nvtx.range_push(message)

    def pop(self) -> None:
        torch.cuda.nvtx.range_pop()

    def mark(self, message: str, color: int) -> None:
        torch.cuda.nvtx.mark(message)


def make_backend(backend: BackendName = "auto", domain: str = DEFAULT_DOMAIN) -> Any:
    """Return the object that emits NVTX calls (``push``, ``pop``, ``mark``, ``enabled``).

    Args:
        backend: ``"auto"`` (the ``nvtx`` package if installed, else ``torch.cuda.nvtx`` on a CUDA build of
            torch, else a no-op after one warning), ``"nvtx"`` (raises ``ModuleNotFoundError`` naming the
            extra when missing) or ``"torch"`` (warns once and does nothing on a CPU build of torch).
        domain: NVTX domain of the ``nvtx`` backend.
    """
    if backend == "nvtx":
        return _NvtxPackageBackend(domain)
    if backend == "auto":
        try:
            return _NvtxPackageBackend(domain)
        except ModuleNotFoundError:
            pass
    # CUDA (and ROCm) builds of torch carry NVTX; a CPU build's torch.cuda.nvtx only raises
    if torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None:
        return _TorchBackend()
    warn_once(
        "NVTXRanges: no NVTX backend, so no ranges are emitted. Install the `nvtx` package "
        "(`pip install 'lightning-gpuopt[nvtx]'`) or use a CUDA build of torch.",
    )
    return _NullBackend()
