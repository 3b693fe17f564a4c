"""What a ladder run leaves behind: its ratios to the two ceilings, taken turn by turn (docs/benchmarks.md,
"Two ceilings"), tables, results JSON and PNG chart, beside the recorded GPU ladder (``load_reference``). A
comparison of two rows whose ranges overlap is marked ``~`` (within the noise).
"""

from __future__ import annotations

import json
import os
import statistics
import textwrap
from collections.abc import Sequence
from dataclasses import asdict
from importlib import resources
from pathlib import Path
from typing import Any

from lightning_gpuopt._common import format_table
from lightning_gpuopt.bench.measure import write_results
from lightning_gpuopt.bench.rows import BUDGET_SPENT, OK, LadderConfig

#: the recorded ladder shipped with the package (an H200 run of ``benchmarks/ladder.py``'s predecessor; its
#: date and command: docs/benchmarks.md, "The ladder")
REFERENCE_FILE = "ladder_h200.json"
#: a row whose repetitions range over more than this fraction of their median is called noisy
NOISE_SPREAD = 0.25

TABLE_COLUMNS = (
    *("name", "samples_per_sec", "range", "joules_per_sample", "p50_ms", "p90_ms", "ratio_to_ceiling"),
    *("ratio_to_eager_ceiling", "speedup_vs_naive", "gpu_util_mean", "data_wait_frac", "backend"),
    *("num_workers", "precision", "status"),
)


def _num(value: float | None, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def _range(row: dict[str, Any]) -> str | None:
    lo, hi = row.get("samples_per_sec_min"), row.get("samples_per_sec_max")
    if lo is None or hi is None or len(row.get("windows") or []) < 2:
        return None
    return f"{_num(lo)}-{_num(hi)}"


def _rate(row: dict[str, Any], unit: str = "") -> str:
    rng = _range(row)
    return f"{_num(row.get('samples_per_sec'))}{unit}" + (f" [{rng}]" if rng else "")


EAGER, COMPILED = "ceiling_eager", "ceiling_compiled"


def _ran(row: dict[str, Any] | None) -> bool:
    return bool(row) and row.get("status", OK) == OK and bool(row.get("samples_per_sec"))  # type: ignore[union-attr]


def _ran_row(rows: Sequence[dict[str, Any]], name: str | None) -> dict[str, Any] | None:
    return next((r for r in rows if r.get("name") == name and _ran(r)), None)


def turn_ratios(row: dict[str, Any], ceiling: dict[str, Any] | None) -> list[float | None]:
    """Each of ``row``'s repetitions over the ceiling's of the same turn (``None`` where it has none).

    Example:
        >>> row = {"repeats": [{"turn": 0, "samples_per_sec": 90.0}, {"turn": 1, "samples_per_sec": 45.0}]}
        >>> ceiling = {"repeats": [{"turn": 0, "samples_per_sec": 100.0}, {"turn": 1, "samples_per_sec": 50.0}]}
        >>> turn_ratios(row, ceiling)
        [0.9, 0.9]
    """
    reps = (ceiling or {}).get("repeats") or ()
    base = {r["turn"]: r.get("samples_per_sec") for r in reps if r.get("turn") is not None}
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
    return (sps / ceiling["samples_per_sec"] if sps and ceiling else None), None


def ceiling_summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run-level keys: ``ceiling`` (the row the ratios use), ``ceiling_samples_per_sec``, each ceiling's
    samples/s, and ``compile_seconds`` (``{row: seconds}``).

    Example:
        >>> rows = [{"name": "ceiling_eager", "samples_per_sec": 6176.0},
        ...         {"name": "ceiling_compiled", "samples_per_sec": 7309.0, "compile_seconds": 41.0}]
        >>> ceiling_summary(rows)["ceiling"]
        'ceiling_compiled'
    """
    eager, compiled = (_ran_row(rows, n) for n in (EAGER, COMPILED))
    ceiling = compiled or eager
    return {
        "ceiling": ceiling["name"] if ceiling else None,
        "ceiling_samples_per_sec": ceiling["samples_per_sec"] if ceiling else None,
        "ceiling_eager_samples_per_sec": eager["samples_per_sec"] if eager else None,
        "ceiling_compiled_samples_per_sec": compiled["samples_per_sec"] if compiled else None,
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
    ceiling, eager, naive = (_ran_row(rows, n) for n in (summary["ceiling"], EAGER, "naive"))
    for row in rows:
        row["ratio_to_ceiling"], row["ratio_to_ceiling_worst"] = _ratio(row, ceiling, "ratio_to_ceiling")
        row["ratio_to_eager_ceiling"] = _ratio(row, eager, "ratio_to_eager_ceiling")[0]
        sps = row.get("samples_per_sec")
        row["speedup_vs_naive"] = sps / naive["samples_per_sec"] if sps and naive else None
    return summary


def compare(row: dict[str, Any], other: dict[str, Any]) -> float | None:
    """``row``'s median over ``other``'s, or ``None`` when either did not run or their ranges overlap (the
    difference is within the noise).

    Example:
        >>> compare({"samples_per_sec": 31, "samples_per_sec_min": 30, "samples_per_sec_max": 33},
        ...         {"samples_per_sec": 11, "samples_per_sec_min": 10, "samples_per_sec_max": 12})
        2.8181818181818183
    """
    a, b = row.get("samples_per_sec"), other.get("samples_per_sec")
    if not a or not b:
        return None
    a_lo, a_hi = row.get("samples_per_sec_min") or a, row.get("samples_per_sec_max") or a
    b_lo, b_hi = other.get("samples_per_sec_min") or b, other.get("samples_per_sec_max") or b
    if a_lo <= b_hi and b_lo <= a_hi:
        return None
    return float(a / b)


def ceiling_notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The lines under the ladder: the ceiling each ratio is taken against, and ``compile_note``."""
    summary = ceiling_summary(rows)
    eager = summary["ceiling_eager_samples_per_sec"]
    lines = []
    if summary["ceiling"] == "ceiling_compiled":
        line = f"ratio_to_ceiling: against ceiling_compiled ({_num(summary['ceiling_samples_per_sec'])} samples/s)"
        if eager:
            line += f"; ratio_to_eager_ceiling: against ceiling_eager ({_num(eager)} samples/s)"
        lines.append(line)
    elif eager:
        compiled = next((r for r in rows if r["name"] == "ceiling_compiled"), None)
        why = (
            "ceiling_compiled was not measured"
            if compiled is None
            else f"ceiling_compiled {compiled.get('status')}: {compiled.get('reason')}"
        )
        lines.append(
            f"ratio_to_ceiling and ratio_to_eager_ceiling: against ceiling_eager ({_num(eager)} samples/s); {why}"
        )
    compile_line = compile_note(rows)
    return [*lines, compile_line] if compile_line else lines


def compile_note(rows: Sequence[dict[str, Any]]) -> str | None:
    """The compile time of each compiled row that measured it, in one line; ``None`` when none did."""
    seconds = ceiling_summary(rows)["compile_seconds"]
    if not seconds:
        return None
    times = ", ".join(f"{name} {sec:.1f} s" for name, sec in seconds.items())
    return f"compile time (first compiled step to first fast step): {times}"


def budget_note(rows: Sequence[dict[str, Any]], repeats: int) -> str | None:
    """The rows the time budget cut short (fewer than ``repeats`` fits) or left out, in one line; else ``None``.

    Example:
        >>> budget_note([{"name": "naive", "status": "ok", "repeats": [{}]}], 3)
        'time budget spent: naive measured in 1 of 3 fits'
    """
    short = [
        f"{r['name']} measured in {len(r['repeats'])} of {repeats} fits"
        for r in rows
        if r.get("status") == OK and 0 < len(r.get("repeats") or ()) < repeats
    ]
    left_out = [r["name"] for r in rows if r.get("reason") == BUDGET_SPENT]
    if left_out:
        short.append(f"{', '.join(left_out)} not measured")
    return f"{BUDGET_SPENT}: {'; '.join(short)}" if short else None


def format_ladder_table(rows: Sequence[dict[str, Any]], notes: bool = True) -> str:
    """The ladder as a text table (rows that did not run show ``status: reason``), ``ceiling_notes`` under it."""
    shown = []
    for r in rows:
        s = dict(r, range=_range(r))
        if r.get("status") != OK:
            s["status"] = f"{r.get('status')}: {r.get('reason')}"
        shown.append(s)
    table = format_table(shown, TABLE_COLUMNS)
    return "\n".join([table, *ceiling_notes(rows)]) if notes else table


# ----------------------------------------------------------------------------------- this run vs recorded
def load_reference() -> dict[str, Any]:
    """The recorded GPU ladder shipped with the package: ``{"machine", "date", "config", "rows", ...}``."""
    return json.loads(resources.files("lightning_gpuopt.bench").joinpath(REFERENCE_FILE).read_text("utf-8"))


def reference_label(reference: dict[str, Any]) -> str:
    """One line saying what the recorded run was: GPU, model, batch, image size and date."""
    cfg = reference.get("config", {})
    gpu = reference.get("machine", {}).get("gpu") or "GPU"
    date = str(reference.get("date", ""))[:10]
    return (
        f"{gpu} recorded: {cfg.get('model')}, batch {cfg.get('batch_size')}, {cfg.get('image_size')} px"
        + (f", {date}" if date else "")
    )


def _ratio_cell(cell: tuple[float, bool] | None) -> str:
    return "-" if cell is None else f"{'~' if cell[1] else ''}{cell[0]:.1f}x"


def _vs(row: dict[str, Any], other: dict[str, Any] | None) -> tuple[float, bool] | None:
    """``row``'s median over ``other``'s and whether that is within the noise; ``None`` unless both ran."""
    if not (_ran(row) and _ran(other)):
        return None
    return row["samples_per_sec"] / other["samples_per_sec"], compare(row, other) is None  # type: ignore[arg-type, index]


def compare_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per row: ``x_naive`` and ``vs_above`` (the nearest row above that ran; not for ceilings), each
    ``(ratio, within_noise)`` or ``None``."""
    out = []
    naive = next((r for r in rows if r["name"] == "naive"), None)
    above: dict[str, Any] | None = None
    for r in rows:
        ceiling = r["name"].startswith("ceiling")
        x_naive = (1.0, False) if r is naive and _ran(r) else _vs(r, naive)
        vs_above = None if ceiling or r is naive else _vs(r, above)
        out.append({"name": r["name"], "x_naive": x_naive, "vs_above": vs_above})
        if _ran(r) and not ceiling:
            above = r
    return out


def format_comparison(rows: Sequence[dict[str, Any]], reference: dict[str, Any] | None) -> str:
    """This run's rows (samples/s [range], p50/p90 ms, x naive, vs the row above) and, right of ``|``, the
    recorded run's (samples/s, of its ceiling, x naive, GPU-Util)."""
    ref_rows = {r["name"]: r for r in (reference or {}).get("rows", [])}
    headers = ["row", "samples/s [range]", "p50 ms", "p90 ms", "x naive", "vs above"]
    if reference is not None:
        headers += ["|", "samples/s", "of ceiling", "x naive", "GPU-Util %"]
    body = []
    for r, cmp in zip(rows, compare_rows(rows), strict=True):
        ran = _ran(r)
        cells = [
            r["name"],
            _rate(r) if ran else str(r.get("status") or "-"),
            *(_num(r.get(k), ".1f") if ran else "-" for k in ("p50_ms", "p90_ms")),
            _ratio_cell(cmp["x_naive"]),
            _ratio_cell(cmp["vs_above"]),
        ]
        if reference is not None:
            ref = ref_rows.get(r["name"], {})
            cells += [
                "|",
                _num(ref.get("samples_per_sec")),
                _num(ref.get("ratio_to_ceiling"), ".2f"),
                _num(ref.get("speedup_vs_naive"), ".1f") + ("x" if ref.get("speedup_vs_naive") else ""),
                _num(ref.get("gpu_util_mean")),
            ]
        body.append(cells)
    return format_table(body, headers)


def noise_notes(rows: Sequence[dict[str, Any]], marks: bool = True) -> list[str]:
    """Which rows are noisy and (``marks``) what ``~`` means; empty when every row held steady."""
    noisy = [r["name"] for r in rows if _ran(r) and (r.get("spread") or 0.0) > NOISE_SPREAD]
    marked = marks and any(c[k] and c[k][1] for c in compare_rows(rows) for k in ("x_naive", "vs_above"))
    notes = []
    if noisy:
        notes.append(
            f"noise: {', '.join(noisy)} varied by more than {NOISE_SPREAD:.0%} between repetitions; "
            "their numbers are noise-level on this machine, so a second run can differ as much"
        )
    if marked:
        notes.append("~ marks a ratio within the noise: the two rows' ranges over their repetitions overlap")
    return notes


# ------------------------------------------------------------------------------------------------- files
def _bar_label(r: dict[str, Any]) -> str:
    if r.get("status") != OK:
        return textwrap.fill(f"{r.get('status')}: {r.get('reason')}", 60)
    parts = [_rate(r, "/s")]
    if r.get("ratio_to_ceiling") is not None:
        parts.append(f"{r['ratio_to_ceiling']:.2f} of ceiling")
    if r.get("speedup_vs_naive") is not None and r["name"] != "naive":
        parts.append(f"{r['speedup_vs_naive']:.1f}x naive")
    if r.get("gpu_util_mean") is not None:
        parts.append(f"GPU {r['gpu_util_mean']:.0f}%")
    return ", ".join(parts)


def _draw(ax: Any, rows: Sequence[dict[str, Any]], title: str) -> None:
    import numpy as np

    names = [r["name"] for r in rows]
    values = [r.get("samples_per_sec") or 0.0 for r in rows]
    lows = [v - (r.get("samples_per_sec_min") or v) for r, v in zip(rows, values, strict=True)]
    highs = [(r.get("samples_per_sec_max") or v) - v for r, v in zip(rows, values, strict=True)]
    colors = ["#9e9e9e" if n.startswith("ceiling") else "#1f77b4" for n in names]
    y = np.arange(len(rows))[::-1]
    xerr = [lows, highs] if any(lows) or any(highs) else None
    ax.barh(y, values, color=colors, xerr=xerr, error_kw={"elinewidth": 1, "capsize": 3})
    top = max([*(v + h for v, h in zip(values, highs, strict=True)), 1.0])
    for yi, r, v, h in zip(y, rows, values, highs, strict=True):
        ax.text(v + h + top * 0.01, yi, _bar_label(r), va="center", fontsize=8)
    ceiling = ceiling_summary(rows)["ceiling_samples_per_sec"]
    if ceiling:
        ax.axvline(ceiling, color="#d62728", linestyle="--", linewidth=1)
    ax.set_yticks(y)
    ax.set_yticklabels(names)
    ax.set_xlim(0, top * 1.05)
    ax.set_xlabel("training samples/s (higher is better)")
    ax.set_title(title, fontsize=10, loc="left")


def plot_ladder(
    rows: Sequence[dict[str, Any]],
    path: str | os.PathLike[str],
    title: str = "",
    reference: dict[str, Any] | None = None,
) -> Path:
    """Bars of samples/s per row with the repetitions' range, the recorded run below when ``reference`` is
    given; the image grows to hold every label.

    Raises:
        ModuleNotFoundError: matplotlib is missing (extra ``plot``).
    """
    from lightning_gpuopt._imports import require

    require("matplotlib")
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    panels = [(rows, title or "lightning-gpuopt ladder")]
    if reference is not None:
        panels.append((reference["rows"], reference_label(reference)))
    height = sum(0.42 * len(p[0]) + 1.2 for p in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, height), squeeze=False)
    for ax, (panel_rows, panel_title) in zip(axes[:, 0], panels, strict=True):
        _draw(ax, panel_rows, panel_title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # "tight" grows the saved image to every label, however long, instead of cutting it at the axes
    fig.savefig(path, dpi=120, bbox_inches="tight", pad_inches=0.2)
    plt.close(fig)
    return path


def write_outputs(
    rows: Sequence[dict[str, Any]],
    config: LadderConfig,
    json_path: str | os.PathLike[str],
    png_path: str | os.PathLike[str] | None,
    title: str = "",
    reference: dict[str, Any] | None = None,
    **extra: Any,
) -> tuple[Path, Path | None, str | None]:
    """Write the results JSON (``write_results`` with the config and ``ceiling_summary``) and, where
    matplotlib is installed, the PNG; returns ``(json, png or None, note)``."""
    png: Path | None = None
    note: str | None = None
    if png_path is not None:
        try:
            png = plot_ladder(rows, png_path, title, reference)
        except ModuleNotFoundError as err:
            note = f"PNG chart skipped: {err}"
    cfg = {k: (os.fspath(v) if isinstance(v, os.PathLike) else v) for k, v in asdict(config).items()}
    cfg["rows"] = list(config.rows)
    png_name = os.fspath(png) if png else None
    summary = ceiling_summary(rows)
    js = write_results(json_path, rows, benchmark="ladder", config=cfg, png=png_name, **summary, **extra)
    return js, png, note
