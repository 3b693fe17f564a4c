"""``gpu/ceiling_frac`` against the plain-loop ceiling measured separately, on one GPU.

Three fits of one ``UserClassifier`` (torchvision's ResNet-50, its own SGD) through
``Trainer(**fast_trainer_kwargs(model, compile=...))`` with a ``GPUStatsMonitor``, each fed differently:

    fed        one uint8 batch kept on the GPU (the loop costs what Lightning's own step costs)
    starved    the same batches from a loader that sleeps ``--starve`` x the eager ceiling's step time a batch
    compiled   the fed run with the model compiled (``CompileModel``)

Each fit's ``monitor_ceiling_frac`` is the monitor's ``gpu/ceiling_frac``: the mean of its windows that end
inside the clock's measured steps and after the second window (the first window holds the warm-up; the
replay runs at its end; the host-sync locator is off, so nothing else changes the measured steps). Its
``separate_ceiling_frac`` is the same fit's rate (``StepClock``, the GPU's clock) over the plain PyTorch loop
on a resident batch (``_zoo.compiled_ceiling``: eager for fed and starved, compiled for compiled), the
ceiling of the same turn. The fits and both ceilings take turns ``--repeats`` times; a row holds medians.
``pass`` is whether the two figures agree within ``--tolerance``.

    python3 benchmarks/ceiling_frac.py                 # one H200: sized to finish within 8 minutes
    python3 benchmarks/ceiling_frac.py --quick         # CPU smoke run (small model, no compile)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from _shared import add_common, device_of, free, measured_fit, resident, results_path, say
from _zoo import UserClassifier, compiled_ceiling, measure_ceiling

from lightning_gpuopt._common import format_table
from lightning_gpuopt.bench.measure import write_results
from lightning_gpuopt.bench.steady import Measurement, summarize, take_turns
from lightning_gpuopt.observe.gpu_stats import GPUStatsMonitor

RUNS = ("fed", "starved", "compiled")
CEILING_OF = {"fed": "ceiling_eager", "starved": "ceiling_eager", "compiled": "ceiling_compiled"}


class Slowed:
    """``batches`` with ``delay()`` seconds of host sleep before each batch: a loader slower than the model."""

    def __init__(self, batches: Any, delay: Callable[[], float]) -> None:
        self.batches, self.delay = batches, delay

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        seconds = self.delay()
        for batch in self.batches:
            time.sleep(seconds)
            yield batch


def monitor_frac(monitor: GPUStatsMonitor, first_step: int) -> float | None:
    """Mean ``gpu/ceiling_frac`` of the monitor's windows logged at or after ``first_step``."""
    values = [
        w["gpu/ceiling_frac"] for w in monitor.history if w["step"] >= first_step and "gpu/ceiling_frac" in w
    ]
    return statistics.fmean(values) if values else None


def run(args: argparse.Namespace) -> dict[str, list[Measurement | BaseException]]:
    """The three fits and the two ceilings, taking turns."""
    model = UserClassifier(args.arch, num_classes=100)
    kinds = (("ceiling_eager", False), ("ceiling_compiled", True))[: 2 if args.compile else 1]
    ceilings = {
        name: compiled_ceiling(args.arch, args.batch_size, args.image_size, 100, args.device, compile=c)[0]
        for name, c in kinds
    }
    eager_ms: list[float] = []

    def ceiling(name: str) -> Callable[[], Measurement]:
        def go() -> Measurement:
            m = measure_ceiling(ceilings[name], 10, args.steps)
            if name == "ceiling_eager":
                eager_ms.append(m.seconds * 1000.0 / m.steps)
            return m

        return go

    def fit(name: str) -> Callable[[], Measurement]:
        def go() -> Measurement:
            batches = resident(args.batch_size, args.image_size, args.device, classes=100)
            loader = (
                Slowed(batches, lambda: args.starve * eager_ms[-1] / 1000.0) if name == "starved" else batches
            )
            monitor = GPUStatsMonitor(log_every_n_steps=args.window, ceiling=True, sync_steps=0)
            m = measured_fit(model, args.warmup, args.steps, device=args.device, callbacks=[monitor],
                             compile=args.compile and name == "compiled", train_dataloaders=loader)  # fmt: skip
            frac = monitor_frac(monitor, max(2 * args.window, args.warmup + args.window) - 1)
            ceiling = monitor.last_ceiling
            free()
            return dataclasses.replace(m, extra={
                **m.extra, "monitor_ceiling_frac": frac,
                "monitor_ceiling_per_sec": ceiling.samples_per_sec if ceiling else None,
                "monitor_replay_seconds": ceiling.seconds if ceiling else None})  # fmt: skip

        return go

    variants = {name: ceiling(name) for name in ceilings}
    variants.update({name: fit(name) for name in args.runs})
    return take_turns(variants, args.repeats, on_result=say)


def rows_of(results: dict[str, list[Measurement | BaseException]], tolerance: float) -> list[dict[str, Any]]:
    """A row a fit (ratios to its own ceiling, turn by turn) and a row a ceiling."""
    rows = []
    for name in [n for n in results if n in RUNS]:
        base = CEILING_OF[name] if CEILING_OF[name] in results else "ceiling_eager"
        row = summarize({base: results[base], name: results[name]}, base)[1]
        fracs = [
            r["monitor_ceiling_frac"] for r in row["repeats"] if r.get("monitor_ceiling_frac") is not None
        ]
        monitor = statistics.median(fracs) if fracs else None
        separate = row["of_ceiling"]
        diff = None if monitor is None or separate is None else monitor - separate
        row.update(ratio_to_ceiling=separate, ceiling=base, monitor_ceiling_frac=monitor,
                   separate_ceiling_frac=separate, difference=diff,
                   **{"pass": None if diff is None else abs(diff) <= tolerance})  # fmt: skip
        rows.append(row)
    ceilings = {k: v for k, v in results.items() if k in CEILING_OF.values()}
    return rows + summarize(ceilings, None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(p, warmup=40, steps=200)
    p.add_argument("--arch", default="resnet50")
    # the GPU's work, not the host's launches, sets the step time at this size (at batch 128 and 160 px the
    # loop is launch-bound and every figure moves with the host's CPU)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--runs", default=",".join(RUNS), help="comma-separated: " + ", ".join(RUNS))
    p.add_argument("--window", type=int, default=20, help="the monitor's window (steps)")
    p.add_argument("--starve", type=float, default=2.0, help="loader sleep a batch, x the eager step time")
    p.add_argument("--tolerance", type=float, default=0.03, help="largest |monitor - separate| that passes")
    args = p.parse_args(argv)
    args.runs = [r for r in args.runs.split(",") if r]
    if unknown := sorted(set(args.runs) - set(RUNS)):
        p.error(f"--runs: unknown {unknown}; choose from {', '.join(RUNS)}")
    args.device = device_of(args)
    # compiling on a CPU takes minutes: there the compiled row runs eager, held against the eager ceiling
    args.compile = args.device == "cuda"
    if args.quick:
        args.arch, args.batch_size, args.image_size, args.window = "small", 4, 32, 2
        args.warmup, args.steps, args.repeats = 2, 6, 1
    path = results_path(args.out, "ceiling-frac", args.quick)
    t0 = time.perf_counter()
    rows = rows_of(run(args), args.tolerance)
    write_results(path, rows, settings=vars(args), seconds=time.perf_counter() - t0, quick=args.quick)
    table = [{"row": r["name"], "samples/s": r["samples_per_sec"] and f"{r['samples_per_sec']:,.0f}",
              "monitor": r.get("monitor_ceiling_frac"), "separate": r.get("separate_ceiling_frac"),
              "difference": r.get("difference"), "pass": r.get("pass"), "error": r["error"]} for r in rows]  # fmt: skip
    for row in table:
        row.update({k: f"{row[k]:.3f}" for k in ("monitor", "separate", "difference") if row[k] is not None})
    print(format_table(table, ["row", "samples/s", "monitor", "separate", "difference", "pass", "error"]))
    print(f"wrote {path} in {time.perf_counter() - t0:.0f} s")
    return 0 if all(r["error"] is None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
