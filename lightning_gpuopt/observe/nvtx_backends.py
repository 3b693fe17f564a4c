"""Where ``NVTXRanges`` sends its ranges: the ``nvtx`` package, ``torch.cuda.nvtx``, or nowhere.

``make_backend`` picks one; every backend has ``push(message, color, cache)``, ``pop()``, ``mark()``,
``prepare(message, color)`` + ``push_prepared(token)`` for fixed names, and ``enabled`` (False when nothing
can be recorded, so callers skip their per-step work).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from lightning_gpuopt._common import warn_once
from lightning_gpuopt._imports import require

__all__ = ["DEFAULT_DOMAIN", "BackendName", "make_backend"]

DEFAULT_DOMAIN = "lightning_gpuopt"

BackendName = Literal["auto", "nvtx", "torch"]


def _noop(*args: Any) -> None:
    pass


class _NullBackend:
    """NVTX unavailable: every call does nothing."""

    name = "none"
    enabled = False  # nothing is recorded, so callers may skip their bookkeeping

    def prepare(self, message: str, color: int) -> Any:
        return None

    push_prepared = staticmethod(_noop)

    def push(self, message: str, color: int, cache: bool = True) -> None:
        pass

    def pop(self) -> None:
        pass

    def mark(self, message: str, color: int) -> None:
        pass


class _NvtxPackageBackend:
    """The ``nvtx`` package: own domain, ARGB colors, registered strings for the fixed names."""

    name = "nvtx"

    def __init__(self, domain: str) -> None:
        nvtx = require("nvtx")
        self._domain = nvtx.get_domain(domain)
        # Without an attached tool nvtx hands out a DummyDomain whose calls do nothing; skip building
        # attributes for it so an unprofiled run pays almost nothing.
        self._live = isinstance(self._domain, nvtx.Domain)
        # Fixed for the process: a tool is attached (NVTX_INJECTION64_PATH) before the first NVTX call or never.
        self.enabled = self._live
        self._attrs: dict[str, Any] = {}
        self._uncached: dict[int, Any] = {}  # color -> reused attributes for numbered names
        # Bound once: one attribute lookup less per call on the hot path.
        self.push_prepared = self._domain.push_range if self._live else _noop
        if self._live:
            self.pop = self._domain.pop_range  # type: ignore[method-assign]
        # Domain.get_registered_string is an unbounded lru_cache; numbered names ("step 123") go through
        # the uncached function so a long run does not grow a cache entry per step.
        method = type(self._domain).get_registered_string
        self._register_uncached = getattr(method, "__wrapped__", method)

    def _attributes(self, message: str, color: int, cache: bool) -> Any:
        if cache:
            attrs = self._attrs.get(message)
            if attrs is None:
                attrs = self._attrs[message] = self._domain.get_event_attributes(message=message, color=color)
            return attrs
        # One attributes object per color is reused: NVTX reads it during the push/mark call only.
        attrs = self._uncached.get(color)
        if attrs is None:
            attrs = self._uncached[color] = self._domain.get_event_attributes(color=color)
        attrs.message = self._register_uncached(self._domain, message)
        return attrs

    def prepare(self, message: str, color: int) -> Any:
        """The registered string and color of a fixed name, resolved once, for ``push_prepared``."""
        return self._attributes(message, color, True) if self._live else None

    def push(self, message: str, color: int, cache: bool = True) -> None:
        if self._live:
            self._domain.push_range(self._attributes(message, color, cache))

    def pop(self) -> None:
        if self._live:
            self._domain.pop_range()

    def mark(self, message: str, color: int) -> None:
        if self._live:
            self._domain.mark(self._attributes(message, color, cache=False))


class _TorchBackend:
    """``torch.cuda.nvtx``: default domain, no colors (CUDA builds of torch only)."""

    name = "torch"
    enabled = True  # whether a tool listens is not visible from here

    def __init__(self) -> None:
        self._nvtx = torch.cuda.nvtx
        self.push_prepared = self._nvtx.range_push
        self.pop = self._nvtx.range_pop  # type: ignore[method-assign]

    def prepare(self, message: str, color: int) -> Any:
        return message

    def push(self, message: str, color: int, cache: bool = True) -> None:
        self._nvtx.range_push(message)

    def pop(self) -> None:
        self._nvtx.range_pop()

    def mark(self, message: str, color: int) -> None:
        self._nvtx.mark(message)


def _torch_has_nvtx() -> bool:
    # CUDA (and ROCm) builds of torch carry NVTX; a CPU build's torch.cuda.nvtx only raises.
    return torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None


def make_backend(backend: BackendName = "auto", domain: str = DEFAULT_DOMAIN) -> Any:
    """Return the object that emits NVTX calls: ``push(message, color, cache)``, ``pop()``, ``mark()``.

    Backends also have ``prepare(message, color) -> token`` and ``push_prepared(token)`` (a fixed name
    resolved once) and ``enabled``: False when nothing can be recorded (no tool attached to the ``nvtx``
    package, or no backend at all), so ``NVTXRanges`` skips its per-step work.

    Args:
        backend: ``"auto"`` (the ``nvtx`` package if installed, else ``torch.cuda.nvtx`` on a CUDA build of
            torch, else a no-op after one warning), ``"nvtx"`` (raises ``ModuleNotFoundError`` naming the
            extra when missing) or ``"torch"`` (warns once and does nothing on a CPU build of torch).
        domain: NVTX domain of the ``nvtx`` backend (``torch.cuda.nvtx`` has only the default domain).
    """
    if backend == "nvtx":
        return _NvtxPackageBackend(domain)
    if backend == "auto":
        try:
            return _NvtxPackageBackend(domain)
        except ModuleNotFoundError:
            pass
    if _torch_has_nvtx():
        return _TorchBackend()
    warn_once(
        "NVTXRanges: no NVTX backend, so no ranges are emitted. Install the `nvtx` package "
        "(`pip install 'lightning-gpuopt[nvtx]'`) or use a CUDA build of torch.",
    )
    return _NullBackend()
