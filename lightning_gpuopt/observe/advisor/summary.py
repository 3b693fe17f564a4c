"""Verdicts that do not flap (``Hysteresis``) and the text a run ends with (``format_summary``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lightning_gpuopt._checks import check_int
from lightning_gpuopt.observe.advisor.verdict import Verdict, sort_verdicts

__all__ = ["Hysteresis", "ceiling_sentence", "format_summary", "markdown"]


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


def ceiling_sentence(ceiling_frac: float | None) -> str:
    """``"this run trains at 0.62 of its own ceiling ..."``; empty where the ceiling was not measured."""
    if ceiling_frac is None:
        return ""
    replay = "the model replayed on a batch kept on the device"
    if ceiling_frac >= 1.0:  # the loop around the step costs nothing the replay can tell apart
        return f"this run trains at its own ceiling ({ceiling_frac:.2f} of {replay})."
    return f"this run trains at {ceiling_frac:.2f} of its own ceiling ({replay})."


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
    ceiling = ceiling_sentence(ceiling_frac)
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
