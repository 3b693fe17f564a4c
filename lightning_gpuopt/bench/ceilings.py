"""The ladder's two ceilings (``ceiling_eager``, ``ceiling_compiled``) and the ratios against them, taken
turn by turn: each repetition of a row over the ceiling's repetition of the same turn (docs/benchmarks.md,
"Two ceilings").
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

EAGER = "ceiling_eager"
COMPILED = "ceiling_compiled"
#: rows whose model is compiled: their warm-up covers the compile and they record ``compile_seconds``
COMPILED_ROWS = ("+compile", COMPILED)


def _ceiling_row(rows: Sequence[dict[str, Any]], name: str) -> dict[str, Any] | None:
    row = next((r for r in rows if r.get("name") == name), None)
    if row is None or row.get("status", "ok") != "ok" or not row.get("samples_per_sec"):
        return None
    return row


def _measured(rows: Sequence[dict[str, Any]], name: str) -> float | None:
    row = _ceiling_row(rows, name)
    return None if row is None else float(row["samples_per_sec"])


def _by_turn(row: dict[str, Any]) -> dict[int, float]:
    return {
        int(r["turn"]): float(r["samples_per_sec"])
        for r in row.get("repeats") or ()
        if r.get("turn") is not None and r.get("samples_per_sec")
    }


def turn_ratios(row: dict[str, Any], ceiling: dict[str, Any] | None) -> list[float | None]:
    """Each of ``row``'s repetitions over the ceiling's of the same turn (``None`` where it has none).

    Example:
        >>> row = {"repeats": [{"turn": 0, "samples_per_sec": 90.0}, {"turn": 1, "samples_per_sec": 45.0}]}
        >>> ceiling = {"repeats": [{"turn": 0, "samples_per_sec": 100.0}, {"turn": 1, "samples_per_sec": 50.0}]}
        >>> turn_ratios(row, ceiling)
        [0.9, 0.9]
    """
    base = _by_turn(ceiling) if ceiling else {}
    out: list[float | None] = []
    for r in row.get("repeats") or ():
        c, sps = base.get(r.get("turn", -1)), r.get("samples_per_sec")
        out.append(sps / c if sps and c else None)
    return out


def _ratio(
    row: dict[str, Any], ceiling: dict[str, Any] | None, key: str
) -> tuple[float | None, float | None]:
    """The median and worst turn of the row's ``key`` ratio (else of the medians), set on each repetition."""
    ratios = turn_ratios(row, ceiling)
    for rep, ratio in zip(row.get("repeats") or (), ratios, strict=True):
        rep[key] = ratio
    measured = [x for x in ratios if x is not None]
    if measured:
        return statistics.median(measured), min(measured)
    sps = row.get("samples_per_sec")
    c = ceiling.get("samples_per_sec") if ceiling else None
    return (sps / c if sps and c else None), None


def ceiling_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run-level keys: ``ceiling`` (the row the ratios use), ``ceiling_samples_per_sec``, each ceiling's
    samples/s, and ``compile_seconds`` (``{row: seconds}``).

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
    """Set each row's ``ratio_to_ceiling`` (and ``_worst``), ``ratio_to_eager_ceiling`` and
    ``speedup_vs_naive``, and each repetition's two ratios.

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
    ceiling = _ceiling_row(rows, summary["ceiling"]) if summary["ceiling"] else None
    eager = _ceiling_row(rows, EAGER)
    naive = _measured(rows, "naive")
    for row in rows:
        sps = row.get("samples_per_sec")
        if not sps:
            row.update(ratio_to_ceiling=None, ratio_to_ceiling_worst=None, ratio_to_eager_ceiling=None)
            row["speedup_vs_naive"] = None
            continue
        row["ratio_to_ceiling"], row["ratio_to_ceiling_worst"] = _ratio(row, ceiling, "ratio_to_ceiling")
        row["ratio_to_eager_ceiling"] = _ratio(row, eager, "ratio_to_eager_ceiling")[0]
        row["speedup_vs_naive"] = sps / naive if naive else None
    return summary
