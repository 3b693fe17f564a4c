"""A finding of the advisor: ``Verdict``, and the stable names of every kind it can raise."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["KINDS", "EvidenceValue", "Verdict", "sort_verdicts"]

#: Every verdict kind, in report order; logged as ``advisor/<kind>`` flags (stable names).
KINDS: tuple[str, ...] = (
    "input-bound",
    "host-bound",
    "straggler",
    "comm-bound",
    "pageable-copies",
    "launch-bound",
    "amp-host-sync",
    "fp16-overflow",
    "fp32-on-tensor-cores",
    "nchw-convolutions",
    "cudnn-benchmark-off",
    "memory-headroom",
    "gpu-metrics-missing",
)

EvidenceValue = float | int | str


@dataclass(frozen=True)
class Verdict:
    """One finding: what starves or slows the GPU, the figures it rests on, and the change that removes it.

    Example:
        >>> v = Verdict("input-bound", {"gpu_idle_frac": 0.4}, "Use more workers.", cause="too-few-workers")
        >>> v.label
        'input-bound (too-few-workers)'

    Attributes:
        kind: stable short name, one of :data:`KINDS`.
        evidence: the measured figures and configuration values the finding rests on.
        advice: the concrete change, in this package's terms.
        severity: ``"warning"`` (costs throughput now) or ``"info"`` (an opportunity or a blind spot).
        cause: refinement of ``input-bound`` and ``straggler`` (docs/advisor.md), else ``None``.
        gain: the most the fix can speed the run up (``1.6``: up to 1.6x the samples/s); ``None`` where no
            figure bounds it.
    """

    kind: str
    evidence: dict[str, EvidenceValue]
    advice: str
    severity: str = "warning"
    cause: str | None = None
    gain: float | None = None

    @property
    def label(self) -> str:
        """``kind`` or ``kind (cause)``."""
        return f"{self.kind} ({self.cause})" if self.cause else self.kind

    @property
    def gain_text(self) -> str:
        """``"up to 1.60x"``, or ``"gain not bounded by these figures"`` where ``gain`` is ``None``."""
        if self.gain is None:
            return "gain not bounded by these figures"
        digits = 2 if self.gain < 2 else 1 if self.gain < 10 else 0
        return f"up to {self.gain:.{digits}f}x"

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Verdict:
        """Inverse of :meth:`to_dict`."""
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


def sort_verdicts(verdicts: list[Verdict]) -> list[Verdict]:
    """Warnings first, then in :data:`KINDS` order."""
    order = {k: i for i, k in enumerate(KINDS)}
    return sorted(verdicts, key=lambda v: (v.severity != "warning", order.get(v.kind, len(order))))
