"""The ladder's two ceilings and the ratios against them.

Both ceilings train the same model in a plain PyTorch loop on a batch already on the device:
``ceiling_eager`` as it is, ``ceiling_compiled`` through ``torch.compile``. A compiled model runs faster
than the eager one, so a row's share of the eager ceiling overstates how close it comes to what the device
can do. ``ratio_to_ceiling`` is therefore taken against the compiled ceiling where it was measured (else the
eager one), and ``ratio_to_eager_ceiling`` against the eager ceiling.

The ceilings are measured every turn, before the other rows of that turn, so a ratio is taken turn by turn:
each repetition of a row against the ceiling's repetition of the same turn (``repeats[i]["turn"]``), and the
row's ratio is the median of those, ``ratio_to_ceiling_worst`` the lowest. Where no turn of a row has a
ceiling beside it (rows without ``repeats``, a ceiling that stopped early) the ratio is of the two medians.
``fill_ratios`` is the pure function that does it; ``ceiling_summary`` gives the run-level keys of the results
JSON.
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
    """Each of ``row``'s repetitions over the ceiling's repetition of the same turn (``None`` where the
    ceiling has none).

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
    """The row's ``key`` ratio (median turn by turn, else of the medians) and its worst turn; each repetition
    gets its own ``key``."""
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
    one) with ``ratio_to_ceiling_worst``, ``ratio_to_eager_ceiling`` and ``speedup_vs_naive`` (of the
    medians), and each repetition's two ratios; rows without ``samples_per_sec`` get ``None``.

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
