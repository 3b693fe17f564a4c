"""The ladder's two ceilings and the ratios against them.

Both ceilings train the same model in a plain PyTorch loop on a batch already on the device:
``ceiling_eager`` as it is, ``ceiling_compiled`` through ``torch.compile``. A compiled model runs faster
than the eager one, so a row's share of the eager ceiling overstates how close it comes to what the device
can do. ``ratio_to_ceiling`` is therefore taken against the compiled ceiling where it was measured (else the
eager one), and ``ratio_to_eager_ceiling`` against the eager ceiling. ``fill_ratios`` is the pure function
that does it; ``ceiling_summary`` gives the run-level keys of the results JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

EAGER = "ceiling_eager"
COMPILED = "ceiling_compiled"
#: rows whose model is compiled: their warm-up covers the compile and they record ``compile_seconds``
COMPILED_ROWS = ("+compile", COMPILED)


def _measured(rows: Sequence[dict[str, Any]], name: str) -> float | None:
    row = next((r for r in rows if r.get("name") == name), None)
    if row is None or row.get("status", "ok") != "ok":
        return None
    value = row.get("samples_per_sec")
    return float(value) if value else None


def ceiling_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run-level keys: which ceiling the ratios use, both ceilings, and the compile times.

    Returns:
        ``{"ceiling": "ceiling_compiled" | "ceiling_eager" | None, "ceiling_samples_per_sec",
        "ceiling_eager_samples_per_sec", "ceiling_compiled_samples_per_sec", "compile_seconds"}``;
        ``compile_seconds`` maps each compiled row that measured it to its seconds from the first compiled
        step to the first fast step.

    Example:
        >>> rows = [{"name": "ceiling_eager", "samples_per_sec": 6176.0},
        ...         {"name": "ceiling_compiled", "samples_per_sec": 7309.0, "compile_seconds": 41.0}]
        >>> ceiling_summary(rows)["ceiling"]
        'ceiling_compiled'
    """
    eager, compiled = _measured(rows, EAGER), _measured(rows, COMPILED)
    name = COMPILED if compiled else (EAGER if eager else None)
    return {
        "ceiling": name,
        "ceiling_samples_per_sec": compiled or eager,
        "ceiling_eager_samples_per_sec": eager,
        "ceiling_compiled_samples_per_sec": compiled,
        "compile_seconds": {
            r["name"]: r["compile_seconds"] for r in rows if r.get("compile_seconds") is not None
        },
    }


def fill_ratios(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Set each row's ``ratio_to_ceiling`` (against the compiled ceiling where it was measured, else the eager
    one), ``ratio_to_eager_ceiling`` and ``speedup_vs_naive``; rows without ``samples_per_sec`` get ``None``.

    Returns:
        ``ceiling_summary(rows)``.

    Example:
        >>> rows = [{"name": "+channels_last", "samples_per_sec": 5518.0},
        ...         {"name": "ceiling_eager", "samples_per_sec": 6176.0},
        ...         {"name": "ceiling_compiled", "samples_per_sec": 7309.0}]
        >>> _ = fill_ratios(rows)
        >>> round(rows[0]["ratio_to_ceiling"], 3), round(rows[0]["ratio_to_eager_ceiling"], 3)
        (0.755, 0.893)
    """
    summary = ceiling_summary(rows)
    ceiling, eager = summary["ceiling_samples_per_sec"], summary["ceiling_eager_samples_per_sec"]
    naive = _measured(rows, "naive")
    for row in rows:
        sps = row.get("samples_per_sec")
        row["ratio_to_ceiling"] = sps / ceiling if sps and ceiling else None
        row["ratio_to_eager_ceiling"] = sps / eager if sps and eager else None
        row["speedup_vs_naive"] = sps / naive if sps and naive else None
    return summary
