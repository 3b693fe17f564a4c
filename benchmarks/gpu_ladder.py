"""The H200 ladder: naive -> full stack -> compiled for ResNet-50 on 8,192 ImageNet-sized JPEGs, one run.

Run on the GPU machine (package not installed, no network):

    PYTHONPATH=. python3 benchmarks/gpu_ladder.py --out $OUT/ladder_h200.json

Writes the JSON (``write_results`` shape, with the targets checked), ``ladder_h200.png`` and a Markdown
table ``ladder_h200.md`` beside it, TensorBoard runs under ``tb_ladder/`` beside it, and prints the table
last, then which ceiling the ratios use and the compile time line (seconds from the first compiled step to
the first fast step, for ``ceiling_compiled`` and ``+compile``). Each row is measured in three windows
(median and range); a compiled row's warm-up covers its compile. Two ceilings are measured in the run:
``ceiling_eager`` (the plain loop) and ``ceiling_compiled`` (the same loop, ``torch.compile``d), and
``ratio_to_ceiling`` is against the compiled one. The whole run stays inside ``--budget-s`` (default 360 s,
two compiles included): rows shrink their measuring time to fit while the compiles' expected seconds are
kept for the compiled rows, and rows are skipped once it is spent.
``--quick`` runs a tiny CPU-sized ladder (small model, 32 px images) to prove the script works; on a CPU
the compiled rows run only when named (``--quick --rows naive,+compile``).

Targets: the compiled full stack (``+compile``) >= 0.95 of the compiled ceiling, the eager full stack
(``+channels_last``) >= 0.95 of the eager ceiling and >= 20x the naive row, mean GPU-Util >= 97% in the
optimized rows (``+uint8_gpu_aug`` and below).

The JSON this writes is what ``lightning_gpuopt/bench/ladder_h200.json`` ships (``demo`` prints it beside a
CPU run): copy a new recording there to update it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

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


def check_targets(rows: list[dict]) -> dict:
    """Each target with its measured value and pass/fail (``None`` when the row did not run)."""
    by = {r["name"]: r for r in rows}
    full, compiled = by.get("+channels_last", {}), by.get("+compile", {})
    utils = [
        by[n]["gpu_util_mean"] for n in OPTIMIZED_ROWS if n in by and by[n].get("gpu_util_mean") is not None
    ]
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", default=None, help="results JSON path (default benchmarks/results/ladder_h200.json)"
    )
    p.add_argument(
        "--data", default="/tmp/gpuopt_data/imagenet_8192", help="generated JPEG folder (made if absent)"
    )
    p.add_argument("--images", type=int, default=8192)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument(
        "--seconds", type=float, default=8.0, help="measured seconds a row (shrunk to fit the budget)"
    )
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--tune-seconds", type=float, default=10.0)
    p.add_argument("--rows", default=None, help="comma-separated rows (default all)")
    p.add_argument(
        "--budget-s", type=float, default=360.0, help="whole-script wall-clock budget (two compiles included)"
    )
    p.add_argument("--quick", action="store_true", help="tiny CPU-sized run to prove the script works")
    args = p.parse_args()

    import torch

    from lightning_gpuopt.bench import report, rows
    from lightning_gpuopt.bench.measure import command_line, quiet_lightning
    from lightning_gpuopt.bench.runner import run_ladder
    from lightning_gpuopt.bench.synthetic import make_jpeg_folder

    default_out = (
        "/tmp/gpuopt_quick/ladder_quick.json" if args.quick else "benchmarks/results/ladder_h200.json"
    )
    out = Path(args.out or default_out)
    if args.quick:
        data = out.parent / "quick_ladder_jpegs"
        size = dict(num_images=64, num_classes=4, image_size=(64, 48))
        model, batch, image_size, seconds, warmup = "small", 8, 32, 1.0, 1
    else:
        data = Path(args.data)
        size = dict(num_images=args.images, num_classes=100)
        model, batch, image_size, seconds, warmup = (
            args.model,
            args.batch_size,
            224,
            args.seconds,
            args.warmup,
        )
    say(f"dataset {data} ({size['num_images']} images; generated once, reused when present)...")
    make_jpeg_folder(data, **size)  # type: ignore[arg-type]
    say("dataset ready")

    reserve = 8.0  # writing the JSON, PNG and table
    config = rows.LadderConfig(
        data=data,
        model=model,
        batch_size=batch,
        image_size=image_size,
        # the whole ladder by default; on a CPU it leaves the compiled rows out unless --rows names them
        rows=rows.parse_rows(args.rows) if args.rows else rows.ROW_NAMES,
        seconds=seconds,
        warmup=warmup,
        tune_seconds=args.tune_seconds,
        cache_dir=data.parent / "cache",
        tb_dir=out.parent / "tb_ladder",
        time_budget_s=max(10.0, args.budget_s - (time.perf_counter() - T0) - reserve),
    )
    with quiet_lightning():
        results = run_ladder(config, progress=say)
    targets = check_targets(results)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    title = f"{model}, batch {batch}, {image_size}px, {size['num_images']} JPEGs on {gpu}"
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
    md = out.with_suffix(".md")
    md.write_text(
        f"{title}\n\n{report.format_ladder_markdown(results)}\n"
    )  # the ceiling and compile lines too
    if note:
        say(note)
    say(f"wrote {js}" + (f" and {png}" if png else "") + f"; TensorBoard runs in {config.tb_dir}")
    for k, t in targets.items():
        m = t["measured"]
        verdict = "n/a" if t["passed"] is None else ("PASS" if t["passed"] else "MISS")
        print(f"target {k}: {'-' if m is None else f'{m:.3f}'} (>= {t['target']}) {verdict}")
    # the table, then the ratios' ceiling and the compile time line
    print(report.format_ladder_table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
