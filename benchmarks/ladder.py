"""The ladder on one GPU: naive -> full stack -> compiled, ResNet-50 on 8,192 ImageNet-sized JPEGs, one run.

``lightning-gpuopt bench`` (``lightning_gpuopt.bench.run_ladder``) with the recorded settings: each row
``--repeats`` short Lightning fits, the rows taking turns (median and range), both ceilings (the plain loop eager and
compiled) in the same run, ``ratio_to_ceiling`` against the compiled one; a compiled row's warm-up covers
its compile. The whole run stays inside ``--budget-s`` (two compiles included): rows shrink their measuring
time to fit, then are skipped. Writes the JSON, a PNG and a Markdown table beside it, TensorBoard runs under
``tb_ladder/`` beside it, and prints the targets and the table last.

Targets: the compiled full stack (``+compile``) >= 0.95 of the compiled ceiling, the eager full stack
(``+channels_last``) >= 0.95 of the eager ceiling and >= 20x the naive row, mean GPU-Util >= 97% over the
optimized rows. ``lightning_gpuopt/bench/ladder_h200.json`` ships a recording (``demo`` prints it beside a
CPU run): copy a new one there to update it.

    python3 benchmarks/ladder.py                              # one H200: about 6 minutes
    python3 benchmarks/ladder.py --quick --rows naive,+hdf5   # CPU smoke run (small model, 32 px)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _shared import results_path

T0 = time.perf_counter()
OPTIMIZED_ROWS = ("+uint8_gpu_aug", "+hdf5", "+dali", "+16-mixed", "+channels_last", "+compile")
TARGETS = {
    "compiled_stack_ratio_to_ceiling": 0.95,
    "full_stack_ratio_to_eager_ceiling": 0.95,
    "full_stack_speedup_vs_naive": 20.0,
    "optimized_gpu_util_mean": 97.0,
}


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def check_targets(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each target with its measured value and pass/fail (``None`` where the row did not run)."""
    by = {r["name"]: r for r in rows}
    full, compiled = by.get("+channels_last", {}), by.get("+compile", {})
    utils = [by[n]["gpu_util_mean"] for n in OPTIMIZED_ROWS if by.get(n, {}).get("gpu_util_mean") is not None]
    compiled_ceiling = by.get("ceiling_compiled", {}).get("status") == "ok"
    measured = {
        # against the compiled ceiling only: a ratio to the eager one would flatter the compiled row
        "compiled_stack_ratio_to_ceiling": compiled.get("ratio_to_ceiling") if compiled_ceiling else None,
        "full_stack_ratio_to_eager_ceiling": full.get("ratio_to_eager_ceiling"),
        "full_stack_speedup_vs_naive": full.get("speedup_vs_naive"),
        "optimized_gpu_util_mean": sum(utils) / len(utils) if utils else None,
    }
    return {
        k: {"target": TARGETS[k], "measured": v, "passed": None if v is None else v >= TARGETS[k]}
        for k, v in measured.items()
    }


def config_of(args: argparse.Namespace, out: Path) -> tuple[Any, dict[str, Any]]:
    """The ladder's ``LadderConfig`` and the generated data's size; makes the JPEG folder once."""
    from lightning_gpuopt.bench import rows
    from lightning_gpuopt.bench.synthetic import make_jpeg_folder

    if args.quick:
        data, size = (
            out.parent / "quick_ladder_jpegs",
            dict(num_images=64, num_classes=4, image_size=(64, 48)),
        )
        model, batch, image_size, seconds, warmup = "small", 8, 32, 1.0, 1
    else:
        data, size = Path(args.data), dict(num_images=args.images, num_classes=100)
        model, batch, image_size, seconds, warmup = (
            args.model,
            args.batch_size,
            224,
            args.seconds,
            args.warmup,
        )
    say(f"dataset {data} ({size['num_images']} images; generated once, reused when present)")
    make_jpeg_folder(data, **size)  # type: ignore[arg-type]
    config = rows.LadderConfig(
        data=data, model=model, batch_size=batch, image_size=image_size,
        # the whole ladder by default; on a CPU it leaves the compiled rows out unless --rows names them
        rows=rows.parse_rows(args.rows) if args.rows else rows.ROW_NAMES, seconds=seconds, warmup=warmup,
        repeats=min(args.repeats, 2) if args.quick else args.repeats,
        tune_seconds=args.tune_seconds, cache_dir=data.parent / "cache", tb_dir=out.parent / "tb_ladder",
        time_budget_s=max(10.0, args.budget_s - (time.perf_counter() - T0) - 8.0),  # 8 s: the outputs
    )  # fmt: skip
    return config, size


def format_ladder_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The ladder as a Markdown table (for README/docs), rows that did not run say why; ``ceiling_notes``
    below it."""
    from lightning_gpuopt.bench import report

    lines = [
        "| row | adds | samples/s | range | J/sample | p50 ms | p90 ms | of ceiling | of eager ceiling | x naive "
        "| GPU-Util % | data-wait | status |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        status = "ok" if r.get("status") == report.OK else f"{r.get('status')}: {r.get('reason')}"
        lines.append(
            f"| `{r['name']}` | {r.get('adds', '')} | {report._num(r.get('samples_per_sec'))} | {report._range(r) or '-'} | "
            f"{report._num(r.get('joules_per_sample'), '.3g')} | "
            f"{report._num(r.get('p50_ms'), '.1f')} | {report._num(r.get('p90_ms'), '.1f')} | {report._num(r.get('ratio_to_ceiling'), '.3f')} | "
            f"{report._num(r.get('ratio_to_eager_ceiling'), '.3f')} | "
            f"{report._num(r.get('speedup_vs_naive'), '.1f')} | {report._num(r.get('gpu_util_mean'), '.1f')} | "
            f"{report._num(r.get('data_wait_frac'), '.3f')} | {status} |"
        )
    notes = report.ceiling_notes(rows)
    return "\n".join([*lines, *(["", *notes] if notes else [])])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="results JSON (default results/<date>-ladder-<gpu>.json)")
    p.add_argument("--data", default="/tmp/gpuopt_data/imagenet_8192", help="JPEG folder (made if absent)")
    p.add_argument("--images", type=int, default=8192)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds a row (shrunk to fit)")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="fits a row, the rows taking turns")
    p.add_argument("--tune-seconds", type=float, default=10.0)
    p.add_argument("--rows", default=None, help="comma-separated rows (default all)")
    p.add_argument("--budget-s", type=float, default=360.0, help="whole-run budget (two compiles included)")
    p.add_argument("--quick", action="store_true", help="a CPU smoke run: small model, tiny images")
    args = p.parse_args(argv)
    import torch

    from lightning_gpuopt.bench import report
    from lightning_gpuopt.bench.measure import command_line, quiet_lightning
    from lightning_gpuopt.bench.runner import run_ladder

    out = results_path(args.out, "ladder", args.quick)
    config, size = config_of(args, out)
    with quiet_lightning():
        results = run_ladder(config, progress=say)
    targets = check_targets(results)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    title = f"{config.model}, batch {config.batch_size}, {config.image_size}px, {size['num_images']} JPEGs"
    title += f" on {gpu}"
    js, png, note = report.write_outputs(
        results,
        config,
        out,
        out.with_suffix(".png"),
        title,
        command=command_line(),
        targets=targets,
        quick=args.quick,
    )
    out.with_suffix(".md").write_text(f"{title}\n\n{format_ladder_markdown(results)}\n")
    say(note or f"wrote {js}" + (f" and {png}" if png else "") + f"; TensorBoard runs in {config.tb_dir}")
    for k, t in targets.items():
        verdict = "n/a" if t["passed"] is None else ("PASS" if t["passed"] else "MISS")
        shown = "-" if t["measured"] is None else f"{t['measured']:.3f}"
        print(f"target {k}: {shown} (>= {t['target']}) {verdict}")
    print(report.format_ladder_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
