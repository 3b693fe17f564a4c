"""The two-GPU DDP report: scaling of each feed, the correctness checks, and whether the targets hold.

``gpu_ddp_scaling.py`` writes it after its run as ``ddp_<gpu>x2.json`` (``ddp_cpu.json`` under ``--quick``);
this script rebuilds it from the two results files::

    python3 benchmarks/ddp_report.py --scaling $OUT/ddp_scaling_h200x2.json \\
        --checks $OUT/ddp_checks_h200x2.json --out $OUT/ddp_h200x2.json

The report holds ``"date"``, ``"machine"``, ``"command"``, ``"checks"`` (``gpu_ddp.py``'s named true/false
checks, or null when no checks file was given: ``"checks_note"`` says so), ``"scaling"``:

- ``plain_ddp``: plain PyTorch DDP on 2 GPUs / the plain loop on 1 GPU,
- ``synthetic``: ``Trainer(**fast_trainer_kwargs(model, devices=2, strategy="ddp"))`` on batches resident
  on the GPUs / the plain loop on 1 GPU,
- ``hdf5``, ``dali``: the same preset fed by ``OptimizedDataModule`` on 2 GPUs / on 1 GPU,
- ``plain_ddp_minus_synthetic``: what Lightning with the preset loses against plain DDP,
- ``synthetic_vs_lightning_1gpu``: the preset on 2 GPUs / the preset on 1 GPU,

``"targets_met"`` (true, false, or null where a figure is missing) and the scaling run's rows without their
per-step lists.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: the 2-GPU row / the 1-GPU row each scaling figure divides
SCALING_PAIRS = {
    "plain_ddp": ("plain_ddp", "plain_1gpu"),
    "synthetic": ("lightning_preset", "plain_1gpu"),
    "hdf5": ("hdf5_ddp", "hdf5_1gpu"),
    "dali": ("dali_ddp", "dali_1gpu"),
    "synthetic_vs_lightning_1gpu": ("lightning_preset", "lightning_1gpu"),
}
#: each feed's least scaling, and the most the preset may lose against plain DDP
MIN_SCALING = 1.9
MAX_LOSS_TO_PLAIN_DDP = 0.02
#: row keys left out of the report (the scaling results file keeps them)
BULKY_ROW_KEYS = ("raw", "runs_detail")


def _rate(rows: list[dict[str, Any]], name: str) -> float | None:
    row = next((r for r in rows if r.get("name") == name), None)
    value = None if row is None else row.get("samples_per_sec")
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def scaling_of(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Each figure of ``SCALING_PAIRS`` from the rows' ``samples_per_sec`` (None where a row is missing)."""
    out: dict[str, float | None] = {}
    for key, (two, one) in SCALING_PAIRS.items():
        a, b = _rate(rows, two), _rate(rows, one)
        out[key] = a / b if a is not None and b is not None else None
    plain, synthetic = out["plain_ddp"], out["synthetic"]
    out["plain_ddp_minus_synthetic"] = (
        plain - synthetic if plain is not None and synthetic is not None else None
    )
    return out


def targets_of(scaling: dict[str, float | None], checks: dict[str, bool] | None) -> dict[str, bool | None]:
    """The issue's targets: each feed >= ``MIN_SCALING``, the preset within ``MAX_LOSS_TO_PLAIN_DDP`` of
    plain DDP, every check true."""

    def at_least(value: float | None, bound: float) -> bool | None:
        return None if value is None else value >= bound

    loss = scaling.get("plain_ddp_minus_synthetic")
    return {
        f"synthetic >= {MIN_SCALING}": at_least(scaling.get("synthetic"), MIN_SCALING),
        f"plain_ddp - synthetic <= {MAX_LOSS_TO_PLAIN_DDP}": None
        if loss is None
        else loss <= MAX_LOSS_TO_PLAIN_DDP,
        f"hdf5 >= {MIN_SCALING}": at_least(scaling.get("hdf5"), MIN_SCALING),
        f"dali >= {MIN_SCALING}": at_least(scaling.get("dali"), MIN_SCALING),
        "checks all true": None if not checks else all(checks.values()),
    }


def read_checks(path: str | Path) -> dict[str, Any]:
    """``gpu_ddp.py``'s results file: its ``checks`` (a flat map of names to booleans) and its machine.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: it is not JSON, or holds no flat map of booleans under ``"checks"``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--checks {path}: no such file; run benchmarks/gpu_ddp.py --out first")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"--checks {path}: not JSON ({err}); pass gpu_ddp.py's results file") from None
    checks = doc.get("checks") if isinstance(doc, dict) else None
    if not isinstance(checks, dict) or not checks or not all(isinstance(v, bool) for v in checks.values()):
        raise ValueError(
            f"--checks {path}: no map of named true/false checks; pass gpu_ddp.py's results file"
        )
    return {"checks": checks, "machine": doc.get("machine") or {}}


def build_report(
    scaling_doc: dict[str, Any], checks_path: str | Path | None, checks_doc: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The report's keys besides ``machine``, ``command``, ``date`` and ``rows`` (``write_results`` adds
    those): ``checks``, ``checks_note``, ``scaling``, ``targets_met``, the run's settings."""
    rows = scaling_doc.get("rows") or []
    if checks_path is not None and checks_doc is None:
        checks_doc = read_checks(checks_path)
    checks = checks_doc["checks"] if checks_doc else None
    if checks_doc is None:
        note = "no --checks file given: run benchmarks/gpu_ddp.py and pass its results with --checks"
    else:
        failed = sorted(k for k, v in checks_doc["checks"].items() if not v)
        note = f"from {Path(str(checks_path)).name}: " + (f"failed {failed}" if failed else "all true")
        theirs, ours = checks_doc["machine"].get("gpu"), (scaling_doc.get("machine") or {}).get("gpu")
        if theirs != ours:
            note += f"; the checks ran on {theirs!r}, the scaling rows on {ours!r}"
    scaling = scaling_of(rows)
    return {
        "checks": checks,
        "checks_note": note,
        "all_checks_passed": None if checks is None else all(checks.values()),
        "scaling": scaling,
        "targets_met": targets_of(scaling, checks),
        "settings": {
            k: scaling_doc.get(k)
            for k in ("model", "batch_size_per_gpu", "image_size", "warmup_steps", "timed_steps", "repeats")
        },
        "scaling_results": scaling_doc.get("results_file"),
    }


def report_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows without their per-step lists."""
    return [{k: v for k, v in r.items() if k not in BULKY_ROW_KEYS} for r in rows]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scaling", required=True, help="gpu_ddp_scaling.py's ddp_scaling_<gpu>x2.json")
    p.add_argument("--checks", help="gpu_ddp.py's ddp_checks_<gpu>x2.json (omitted: checks null)")
    p.add_argument("--out", required=True, help="the report's path (ddp_<gpu>x2.json)")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from lightning_gpuopt.bench.measure import command_line, write_results

    scaling_path = Path(args.scaling)
    if not scaling_path.is_file():
        p.error(f"--scaling {scaling_path}: no such file; run benchmarks/gpu_ddp_scaling.py first")
    try:
        scaling_doc = json.loads(scaling_path.read_text())
        report = build_report(scaling_doc, args.checks)
    except (ValueError, FileNotFoundError) as err:
        p.error(str(err))
    # the measurement's machine, date and command; this command is kept beside them
    measured = {k: scaling_doc[k] for k in ("machine", "date", "command") if k in scaling_doc}
    rows = report_rows(scaling_doc.get("rows") or [])
    path = write_results(args.out, rows, **measured, **report, rebuilt_by=command_line())
    for key, value in report["scaling"].items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    for key, ok in report["targets_met"].items():
        print(f"{'-' if ok is None else 'PASS' if ok else 'FAIL'}  {key}")
    print(f"{report['checks_note']}\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
