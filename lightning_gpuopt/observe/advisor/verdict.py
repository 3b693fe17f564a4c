"""A finding of the advisor (``Verdict``), the stable names of every kind it can raise, verdicts that do not
flap (``Hysteresis``) and the text a run ends with (``format_summary``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_gpuopt._checks import check_int

__all__ = [
    "KINDS",
    "NEEDS",
    "EvidenceValue",
    "Hysteresis",
    "Verdict",
    "format_summary",
    "markdown",
    "sort_verdicts",
]

#: What a run must have for the rule of each kind to raise it (``KINDS`` order): ``"cuda"`` (a CUDA device),
#: ``"ranks"`` (several processes) or ``"scaler"`` (an enabled GradScaler).
NEEDS: dict[str, tuple[str, ...]] = {
    "input-bound": (),
    "host-bound": ("cuda",),  # judged from gpu/idle_frac, which CUDA events measure
    "straggler": ("ranks",),
    "comm-bound": ("ranks",),
    "pageable-copies": ("cuda",),
    "launch-bound": ("cuda",),
    "amp-host-sync": ("cuda", "scaler"),
    "fp16-overflow": ("scaler",),
    "fp32-on-tensor-cores": ("cuda",),
    "nchw-convolutions": ("cuda",),
    "cudnn-benchmark-off": ("cuda",),
    "memory-headroom": ("cuda",),
    "gpu-metrics-missing": ("cuda",),
}
#: Every verdict kind, in report order: the stable names of the ``advisor/<kind>`` flags.
KINDS: tuple[str, ...] = tuple(NEEDS)

EvidenceValue = float | int | str


@dataclass(frozen=True)
class Verdict:
    """One finding: what starves or slows the GPU, the figures it rests on, and the change that removes it.

    Its fields are described in docs/advisor.md (Verdicts, Gains).

    Example:
        >>> v = Verdict("input-bound", {"gpu_idle_frac": 0.4}, "Use more workers.", cause="too-few-workers")
        >>> v.label
        'input-bound (too-few-workers)'
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


class Hysteresis:
    """Keeps a verdict list that does not flap.

    A kind is raised after it was diagnosed in ``raise_after`` consecutive windows and cleared after it was
    absent from ``clear_after`` consecutive windows. A raised verdict's evidence and advice follow the
    latest window that diagnosed it.

    Example:
        >>> h = Hysteresis(raise_after=2, clear_after=2)
        >>> v = Verdict("input-bound", {}, "advice")
        >>> h.update([v]), h.update([v]), [x.kind for x in h.verdicts]
        (False, True, ['input-bound'])
    """

    def __init__(self, raise_after: int = 2, clear_after: int = 2) -> None:
        check_int(raise_after, "raise_after", low=1, what="(windows)")
        check_int(clear_after, "clear_after", low=1, what="(windows)")
        self.raise_after = raise_after
        self.clear_after = clear_after
        self.on: dict[str, int] = {}
        self.off: dict[str, int] = {}
        self.active: dict[str, Verdict] = {}
        self.windows = 0

    def update(self, verdicts: Iterable[Verdict]) -> bool:
        """Feed one window's verdicts; returns whether the set of raised kinds changed."""
        self.windows += 1
        seen = {v.kind: v for v in verdicts}
        before = set(self.active)
        for kind in set(self.on) | set(self.off) | set(seen) | set(self.active):
            if kind in seen:
                self.on[kind] = self.on.get(kind, 0) + 1
                self.off[kind] = 0
                if kind in self.active or self.on[kind] >= self.raise_after:
                    self.active[kind] = seen[kind]
            else:
                self.off[kind] = self.off.get(kind, 0) + 1
                self.on[kind] = 0
                if kind in self.active and self.off[kind] >= self.clear_after:
                    del self.active[kind]
        return set(self.active) != before

    @property
    def verdicts(self) -> list[Verdict]:
        """Raised verdicts, warnings first, then in ``KINDS`` order."""
        return sort_verdicts(list(self.active.values()))

    def state_dict(self) -> dict[str, Any]:
        return {
            "on": dict(self.on),
            "off": dict(self.off),
            "active": [v.to_dict() for v in self.active.values()],
            "windows": self.windows,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.on = {str(k): int(v) for k, v in state.get("on", {}).items()}
        self.off = {str(k): int(v) for k, v in state.get("off", {}).items()}
        self.active = {d["kind"]: Verdict.from_dict(d) for d in state.get("active", [])}
        self.windows = int(state.get("windows", 0))


def format_summary(
    verdicts: Sequence[Verdict],
    windows: int,
    window_steps: int,
    warmup_steps: int,
    ceiling_frac: float | None = None,
) -> str:
    """Concise multi-line text: the run's share of its ceiling where measured, then one line a verdict with
    the gain its fix is worth at most and its evidence, then the advice."""
    if windows == 0:
        return (
            f"BottleneckAdvisor: no verdict - the run ended before the first window after {warmup_steps} "
            "warm-up steps was over."
        )
    head = f"BottleneckAdvisor after {windows} window(s) of {window_steps} steps:"
    ceiling, replay = "", "the model replayed on a batch kept on the device"
    if ceiling_frac is not None and ceiling_frac >= 1.0:  # the loop costs nothing the replay tells apart
        ceiling = f"this run trains at its own ceiling ({ceiling_frac:.2f} of {replay})."
    elif ceiling_frac is not None:
        ceiling = f"this run trains at {ceiling_frac:.2f} of its own ceiling ({replay})."
    if not verdicts:
        return f"{head} no bottleneck found" + (f"; {ceiling}" if ceiling else ".")
    lines = [head] + ([f"  {ceiling[0].upper()}{ceiling[1:]}"] if ceiling else [])
    for v in verdicts:
        figs = ", ".join(f"{k}={val}" for k, val in v.evidence.items())
        gain = f" {v.gain_text};" if v.severity == "warning" else ""
        lines.append(f"  [{v.severity}] {v.label}:{gain} {figs}")
        lines.append(f"      -> {v.advice}")
    return "\n".join(lines)


def markdown(verdicts: Sequence[Verdict], windows: int, step: int) -> str:
    """A markdown table of ``verdicts`` (the TensorBoard text summary)."""
    if not verdicts:
        return f"**No bottleneck found** (window {windows}, step {step})."
    rows = ["| severity | verdict | gain | evidence | advice |", "|---|---|---|---|---|"]
    for v in verdicts:
        figs = "<br>".join(f"{k}={val}" for k, val in v.evidence.items())
        gain = v.gain_text if v.severity == "warning" else ""
        rows.append(f"| {v.severity} | {v.label} | {gain} | {figs} | {v.advice.replace('|', '/')} |")
    return f"Window {windows}, step {step}:\n\n" + "\n".join(rows)
