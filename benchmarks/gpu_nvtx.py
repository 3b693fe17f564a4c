"""What NVTXRanges costs: ResNet-50 fp16-mixed + channels_last through Lightning on GPU-resident batches.

Run on a GPU machine (where the ``nvtx`` package is missing, ``torch.cuda.nvtx`` is the backend), with the
NVTX injection recorder built by ``tools/build_nvtx_recorder.sh``:

    PYTHONPATH=. python3 benchmarks/gpu_nvtx.py --recorder .nvtxrec/librecorder.so --out $OUT/nvtx_h200.json

Rows: the plain-loop ceiling, Lightning without ranges (``off``), with step/phase ranges (``steps``,
the default ``NVTXRanges()``) and with per-module forward ranges at depth 1, 2 and 3 below the ResNet.
``off`` and ``steps`` run as ``--pairs`` adjacent pairs in ABBA order (off,steps / steps,off / ...), so a
drift hits both sides alike and no side always runs first. Each pair gives a ratio steps/off; the overhead
is 1 - the median ratio, with a distribution-free confidence interval of that median from the order
statistics of the pair ratios (``overhead_ci``; 87.5% for 7 pairs) and the run-to-run spread of ``off``
itself. Target: step ranges cost <= 1% of step time; ``targets...resolved`` says whether the
interval lies wholly on one side of 1% (else the measurement cannot tell, whatever the median says).
The host cost alone, without GPU noise, is in ``benchmarks/cpu_nvtx_hooks.py``.

With ``--recorder``, two short runs happen under the NVTX injection recorder in subprocesses: the CPU test
scenarios (``tests/observe/nvtx_scenarios.py``) on this device, and a short ResNet-50 fit with module
ranges and a capture window. The JSON keeps, per run, the range counts, nesting depth, the first lines of
the range tree, capture marks and any imbalance found (``problems`` must be empty).

``--quick`` runs a tiny CPU-sized version to prove the script works (written to the temp folder unless
``--out`` is given). The whole run stays in ``--budget-s``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

T0 = time.perf_counter()
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # tests.observe.nvtx_events parses the recordings
    sys.path.insert(0, str(REPO))
from _shared import quick_out  # noqa: E402

OVERHEAD_TARGET = 0.01
CI_LEVEL = 0.8  # asked-for coverage of the median's interval; the exact coverage is stored with it


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


class DeviceBatches:
    """The same on-device batch ``n`` times: Lightning sees a loader that never waits."""

    def __init__(self, x: Any, y: Any, n: int) -> None:
        self.x, self.y, self.n = x, y, n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        for _ in range(self.n):
            yield self.x, self.y


def median_ci(values: list[float], level: float = CI_LEVEL) -> tuple[float, float, float]:
    """Distribution-free interval of the median: order statistics ``k`` and ``n+1-k``; (low, high, coverage).

    ``k`` is the largest with P(Binomial(n, 1/2) < k) <= (1 - level) / 2; 7 values give k=2 (87.5%).
    """
    from math import comb

    xs = sorted(values)
    n = len(xs)
    alpha_half = (1.0 - level) / 2.0
    k = 1
    while k < (n + 1) // 2 and sum(comb(n, i) for i in range(k + 1)) / 2**n <= alpha_half:
        k += 1
    below = sum(comb(n, i) for i in range(k)) / 2**n
    return xs[k - 1], xs[n - k], 1.0 - 2.0 * below


def make_setup(quick: bool, batch_size: int) -> dict[str, Any]:
    import torch

    from lightning_gpuopt.bench.models import build_model

    cuda = torch.cuda.is_available() and not quick
    device = torch.device("cuda" if cuda else "cpu")
    image, classes = (224, 1000) if not quick else (32, 10)
    model = build_model("resnet50" if not quick else "small", num_classes=classes)
    mf = torch.channels_last if cuda else torch.contiguous_format
    x = torch.randn(batch_size, 3, image, image, device=device).contiguous(memory_format=mf)
    y = torch.randint(0, classes, (batch_size,), device=device)
    return {
        "cuda": cuda,
        "device": device,
        "model": model,
        "x": x,
        "y": y,
        "image": image,
        "classes": classes,
    }


def lightning_fit(
    setup: dict[str, Any], callbacks: list[Any], steps: int, warmup: int, val_batches: int = 0
) -> float | None:
    import lightning.pytorch as pl

    from lightning_gpuopt.bench.measure import ThroughputMeter
    from lightning_gpuopt.bench.models import ImageClassifier

    meter = ThroughputMeter(warmup=warmup)
    trainer = pl.Trainer(
        accelerator="gpu" if setup["cuda"] else "cpu",
        devices=1,
        precision="16-mixed" if setup["cuda"] else "32-true",
        max_steps=warmup + steps,
        limit_val_batches=val_batches,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[meter, *callbacks],
    )
    module = ImageClassifier(setup["model"])
    batches = DeviceBatches(setup["x"], setup["y"], warmup + steps)
    val = DeviceBatches(setup["x"], setup["y"], max(val_batches, 1)) if val_batches else None
    trainer.fit(module, batches, val)
    return meter.samples_per_sec


def record_child(quick: bool, backend: str = "auto") -> int:
    """Runs under the recorder: the CPU test scenarios on this device, then a short ResNet fit."""
    import warnings

    from lightning_gpuopt.observe.nvtx import NVTXRanges, make_backend
    from tests.observe import nvtx_scenarios

    warnings.filterwarnings("ignore")
    setup = make_setup(quick, 8 if quick else 64)
    acc = "cuda" if setup["cuda"] else "cpu"
    nvtx_scenarios.main(
        ["--accelerator", acc, "--backend", backend]
    )  # marks "scenario NAME" ... "scenario end"
    marker = make_backend(backend, "scenario")  # type: ignore[arg-type]
    marker.mark("scenario resnet_fit", 0xFFFFFFFF)
    cb = NVTXRanges(module_depth=2, module_root="model", start_step=2, stop_step=4, backend=backend)  # type: ignore[arg-type]
    lightning_fit(setup, [cb], steps=4, warmup=2, val_batches=2)
    marker.mark("scenario end", 0xFFFFFFFF)
    return 0


def record_backends(args: argparse.Namespace) -> dict[str, Any]:
    """The recorder runs, one per NVTX backend this machine has: ``nvtx`` package and ``torch.cuda.nvtx``."""
    import importlib.util

    import torch

    lib = Path(args.recorder)
    if not lib.exists():
        return {"error": f"{lib} not found; build it with tools/build_nvtx_recorder.sh"}
    out: dict[str, Any] = {}
    names = ["nvtx"] if importlib.util.find_spec("nvtx") else []
    names += ["torch"] if torch.cuda.is_available() else []  # torch.cuda.nvtx needs a CUDA build and driver
    for name in names:
        say(
            f"recording the test scenarios and a short ResNet fit, backend {name}, under the injection recorder"
        )
        child = [sys.executable, str(Path(__file__).resolve()), "--record-child", "--record-backend", name]
        out[name] = recorded_run(child + (["--quick"] if args.quick else []), lib, timeout=150)
    if not names:
        out["error"] = "neither the nvtx package nor a CUDA torch here"
    return out


def recorded_run(cmd: list[str], recorder: Path, timeout: float) -> dict[str, Any]:
    """Run ``cmd`` under the recorder; summarise the ranges it emitted, per scenario when it has them."""
    from tests.observe import nvtx_events as ne

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "events.tsv"
        env = {
            **os.environ,
            **ne.recorder_env(recorder, out),
            "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        events = ne.read_events(out) if out.exists() else []
    # the nvtx package uses our domain; torch.cuda.nvtx only has the default one ("-")
    domain = (
        "lightning_gpuopt"
        if any(e.kind == "domain" and e.domain == "lightning_gpuopt" for e in events)
        else "-"
    )
    result: dict[str, Any] = {
        "returncode": proc.returncode,
        "seconds": round(time.perf_counter() - t0, 1),
        "injection_loaded": any(e.kind == "init" for e in events),
        "domain": domain,
        "backend": "nvtx" if domain != "-" else "torch.cuda.nvtx",
        "events": len(events),
    }
    if proc.returncode != 0:
        result["stderr_tail"] = proc.stderr[-2000:]
    parts = ne.split_scenarios(events)
    parts.pop("end", None)
    result["scenarios"] = {name: ne.summary(ne.replay(evs, domain)) for name, evs in parts.items()}
    result["problems"] = sum(len(s["problems"]) for s in result["scenarios"].values())  # type: ignore[arg-type]
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/nvtx_h200.json", help="results JSON path")
    p.add_argument("--recorder", default=None, help="librecorder.so from tools/build_nvtx_recorder.sh")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=25, help="measured steps a row")
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--pairs", type=int, default=7, help="off/steps pairs, ABBA order")
    p.add_argument("--depths", default="1,2,3", help="module_depth rows")
    p.add_argument("--budget-s", type=float, default=75.0, help="whole-script wall-clock budget")
    p.add_argument("--quick", action="store_true", help="tiny CPU-sized run to prove the script works")
    p.add_argument("--record-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--record-backend", default="auto", help=argparse.SUPPRESS)
    p.add_argument(
        "--record-only",
        action="store_true",
        help="only the recorder runs, once per backend present (nvtx package, torch.cuda.nvtx); needs --recorder",
    )
    args = p.parse_args()
    args.out = quick_out(args.out, p.get_default("out"), args.quick)
    if args.record_child:
        return record_child(args.quick, args.record_backend)
    if args.record_only:
        from lightning_gpuopt.bench.measure import write_results

        if not args.recorder:
            p.error("--record-only needs --recorder")
        recorders = record_backends(args)
        rows = []
        for name, rec in recorders.items():
            if not isinstance(rec, dict):
                continue
            fit = rec.get("scenarios", {}).get("resnet_fit", {})
            rows.append(
                {
                    "name": f"recorder, backend {name}",
                    "returncode": rec.get("returncode"),
                    "backend_seen": rec.get("backend"),
                    "events": rec.get("events"),
                    "scenarios": len(rec.get("scenarios", {})),
                    "problems": rec.get("problems"),
                    "resnet_fit_pushes": fit.get("pushes"),
                    "resnet_fit_marks": fit.get("marks"),
                }
            )
        path = write_results(
            args.out,
            rows,
            benchmark="nvtx_recorder",
            quick=args.quick,
            recorders=recorders,
        )
        say(f"wrote {path}")
        from lightning_gpuopt._common import format_table

        print(format_table(rows, ["name", "returncode", "backend_seen", "events", "scenarios", "problems"]))
        bad = [r for r in rows if r["returncode"] != 0 or r["problems"]]
        return 1 if bad or not rows else 0

    import logging
    import warnings

    import torch

    from lightning_gpuopt._common import format_table
    from lightning_gpuopt.bench.measure import plain_loop_throughput, write_results
    from lightning_gpuopt.observe.nvtx import NVTXRanges, make_backend

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    if args.quick:
        args.batch_size, args.steps, args.warmup, args.pairs = 4, 3, 1, 2
        args.budget_s = max(
            args.budget_s, 150.0
        )  # a loaded 2-core CPU is slow; this mode only proves it works
    depths = [int(d) for d in args.depths.split(",") if d]
    setup = make_setup(args.quick, args.batch_size)
    backend = make_backend().name
    say(f"device {setup['device']}, batch {args.batch_size}, NVTX backend here: {backend}")

    ceiling = plain_loop_throughput(
        setup["model"],
        args.batch_size,
        image_size=setup["image"],
        num_classes=setup["classes"],
        steps=args.steps,
        warmup=args.warmup,
        dtype=torch.float16 if setup["cuda"] else None,
        channels_last=setup["cuda"],
        device=setup["device"],
    )
    say(f"ceiling {ceiling:,.1f} samples/s")

    # Leave time for the recorded runs (imports of torch + lightning in two subprocesses).
    reserve = 22.0 if args.recorder else 0.0
    measured: dict[str, list[float]] = {"off": [], "steps": []}
    pairs: list[dict[str, Any]] = []  # per pair: off, steps, ratio, order

    def fit(name: str, make_callbacks: Any) -> float | None:
        sps = lightning_fit(setup, make_callbacks(), args.steps, args.warmup)
        if sps is not None:
            measured.setdefault(name, []).append(sps)
        say(f"{name}: {sps or 0:,.1f} samples/s")
        return sps

    def run_pair(i: int) -> None:
        order = ["off", "steps"] if i % 2 == 0 else ["steps", "off"]  # ABBA: neither side always first
        got = {n: fit(n, (lambda: []) if n == "off" else (lambda: [NVTXRanges()])) for n in order}
        if got["off"] and got["steps"]:
            pairs.append(
                {"off": got["off"], "steps": got["steps"], "ratio": got["steps"] / got["off"], "order": order}
            )

    # A pair costs two fits; stop starting pairs when one more would not fit (the depth rows go after the
    # first two pairs, so a short budget loses repeats, never the rows).
    fit_s = 0.0
    skipped: list[str] = []
    for i in range(args.pairs):
        if i == 2:
            for d in depths:
                fit(f"modules_depth{d}", lambda d=d: [NVTXRanges(module_depth=d, module_root="model")])
        t_pair = time.perf_counter()
        if pairs and time.perf_counter() - T0 + fit_s > args.budget_s - reserve:
            skipped.append(f"pair {i + 1}")
            continue
        run_pair(i)
        fit_s = max(fit_s, time.perf_counter() - t_pair)
    if args.pairs <= 2:
        for d in depths:
            fit(f"modules_depth{d}", lambda d=d: [NVTXRanges(module_depth=d, module_root="model")])

    ratios = [pr["ratio"] for pr in pairs]
    ratio = statistics.median(ratios)
    overhead = 1.0 - ratio
    lo_ratio, hi_ratio, coverage = median_ci(ratios)
    ci = (1.0 - hi_ratio, 1.0 - lo_ratio)
    off = statistics.median(measured["off"])
    off_spread = (max(measured["off"]) - min(measured["off"])) / off
    rows: list[dict[str, Any]] = [
        {
            "name": "plain_loop_ceiling",
            "samples_per_sec": ceiling,
            "ratio_to_ceiling": 1.0,
            "ratio_to_off": None,
        }
    ]
    for name, values in measured.items():
        sps = statistics.median(values)
        rows.append(
            {
                "name": name,
                "samples_per_sec": sps,
                "ratio_to_ceiling": sps / ceiling,
                # "steps" is the median of the paired ratios, the others against the median "off"
                "ratio_to_off": ratio if name == "steps" else sps / off,
                "step_ms": 1000.0 * args.batch_size / sps,
                "runs": values,
                "data_wait_frac": None,
            }
        )
    if ci[1] <= OVERHEAD_TARGET:
        verdict = "<= target, resolved"
    elif ci[0] > OVERHEAD_TARGET:
        verdict = "> target, resolved"
    else:
        verdict = "not resolved: the interval contains the target"
    overhead_stats = {
        "pairs": pairs,
        "pair_overheads": [1.0 - r for r in ratios],
        "median": overhead,
        "ci": list(ci),
        "ci_coverage": coverage,
        "min": 1.0 - max(ratios),
        "max": 1.0 - min(ratios),
        "off_spread": off_spread,
        "verdict": verdict,
    }
    targets = {
        "step_ranges_overhead": {
            "target_max": OVERHEAD_TARGET,
            "measured": overhead,
            "ci": list(ci),
            "passed": overhead <= OVERHEAD_TARGET,
            "resolved": ci[1] <= OVERHEAD_TARGET or ci[0] > OVERHEAD_TARGET,
        }
    }

    recorder: dict[str, Any] | None = None
    if args.recorder:
        lib = Path(args.recorder)
        if not lib.exists():
            recorder = {"error": f"{lib} not found; build it with tools/build_nvtx_recorder.sh"}
        else:
            say("recording the test scenarios and a short ResNet fit under the NVTX injection recorder ...")
            child = [sys.executable, str(Path(__file__).resolve()), "--record-child"] + (
                ["--quick"] if args.quick else []
            )
            recorder = recorded_run(child, lib, timeout=150)

    path = write_results(
        args.out,
        rows,
        benchmark="nvtx_overhead",
        quick=args.quick,
        batch_size=args.batch_size,
        measured_steps=args.steps,
        nvtx_backend=backend,
        overhead_steps_vs_off=overhead,
        overhead=overhead_stats,
        targets=targets,
        skipped=skipped,
        recorder=recorder,
        elapsed_s=round(time.perf_counter() - T0, 1),
    )
    say(f"wrote {path}")
    if recorder and "scenarios" in recorder:
        fit = recorder["scenarios"].get("resnet_fit", {})
        print(
            f"recorder ({recorder['backend']}): rc={recorder['returncode']} scenarios={len(recorder['scenarios'])} "
            f"problems={recorder['problems']}; resnet fit pushes={fit.get('pushes')} marks={fit.get('marks')}"
        )
        print("resnet range counts:", json.dumps(fit.get("counts", {}))[:400])
    print(
        f"step-range overhead {overhead * 100:.2f}% median of {len(pairs)} pairs, "
        f"{coverage * 100:.1f}% CI [{ci[0] * 100:.2f}%, {ci[1] * 100:.2f}%], pairs "
        f"[{overhead_stats['min'] * 100:.2f}% .. {overhead_stats['max'] * 100:.2f}%], off spread "
        f"{off_spread * 100:.1f}% (target <= {OVERHEAD_TARGET * 100:.0f}%: {verdict})"
    )
    print(format_table(rows, ["name", "samples_per_sec", "ratio_to_ceiling", "ratio_to_off", "step_ms"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
