"""Where DALI's JPEG decoding should run next to ResNet-50 on one GPU: CPU threads, nvJPEG, or both.

For each decoding set-up, in one run: the pipeline alone (no model; samples/s after a warm-up), and a plain
PyTorch ResNet-50 fp16 + channels_last loop fed by it (hand-written, no Lightning), against the ceiling (the
same loop on a resident batch, measured first and again last). Set-ups, as ``DALIOptions``: every JPEG on
nvJPEG (``decoder="gpu"``, the default), every JPEG on N CPU threads (``decoder="cpu"``, N = the CPUs less
two, less one, and all of them), and two pipelines side by side (a CPU-decoding one and an nvJPEG one over
disjoint halves of the file list) whose batches are concatenated each step.

``--compiled`` feeds each set-up to the model compiled (``torch.compile``, compiled once for every set-up)
and to the eager one, and its set-ups add two pipelines over disjoint slices of the files taking turns by
whole batches (one batch in ``k`` from nvJPEG, the rest from CPU threads). Each set-up is profiled for a
few steps once: the kernel and copy time a step spends on CUDA streams other than the model's (the
pipeline's GPU work), with the largest items. ``--repeats N`` goes over the set-ups N times in alternating
order and reports medians.

    PYTHONPATH=. python3 benchmarks/gpu_dali_decode.py --out $OUT/dali_decode_h200.json
    PYTHONPATH=. python3 benchmarks/gpu_dali_decode.py --compiled --repeats 3 --out $OUT/dali_decode_compiled_h200.json
    PYTHONPATH=. python3 benchmarks/gpu_dali_decode.py --quick      # CPU pipelines, tiny images and model
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_gpuopt._common import available_cpus, format_table
from lightning_gpuopt.bench.measure import PlainLoop, write_results
from lightning_gpuopt.bench.models import build_model
from lightning_gpuopt.data.dali import DALILoader, DALIOptions
from lightning_gpuopt.data.folder import scan_image_folder

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts beside this one, however it is run
from _shared import quick_out
from gpu_dali import jpeg_data

T0 = time.perf_counter()


def forever(loader: DALILoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    while True:
        yield from loader


def make_feed(
    files: list[str], labels: list[int], batch: int, common: dict[str, Any], setup: dict[str, Any]
) -> tuple[Callable[[], tuple[torch.Tensor, torch.Tensor]], Callable[[], None]]:
    """A ``next batch`` callable for one set-up, and its close function.

    ``setup`` holds ``options`` (one pipeline) or ``parts``: ``(share of the batch, DALIOptions)`` pairs.
    """
    if "alternate" in setup:
        return _alternate(files, labels, batch, common, *setup["alternate"])
    parts = setup.get("parts")
    if not parts:
        loader = DALILoader(files, labels, batch_size=batch, options=setup["options"], **common)
        it = forever(loader)
        return (lambda: next(it)), loader.close
    # two pipelines over disjoint slices of the list (file i goes to part i % len(parts)), each with its
    # share of the batch; every step concatenates one batch of each
    loaders = []
    for j, (share_of_batch, options) in enumerate(parts):
        sub = slice(j, None, len(parts))
        loaders.append(
            DALILoader(
                files[sub], labels[sub], batch_size=round(batch * share_of_batch), options=options, **common
            )
        )
    its = [forever(ld) for ld in loaders]

    def feed() -> tuple[torch.Tensor, torch.Tensor]:
        got = [next(it) for it in its]
        x = torch.cat([g[0] for g in got]).contiguous(memory_format=torch.channels_last)
        return x, torch.cat([g[1] for g in got])

    def close() -> None:
        for ld in loaders:
            ld.close()

    return feed, close


def _alternate(
    files: list[str],
    labels: list[int],
    batch: int,
    common: dict[str, Any],
    every: int,
    gpu: DALIOptions,
    cpu: DALIOptions,
) -> tuple[Callable[[], tuple[torch.Tensor, torch.Tensor]], Callable[[], None]]:
    """Two pipelines taking turns by whole batches: file ``i`` with ``i % every == 0`` and one batch in
    ``every`` from ``gpu``, the rest from ``cpu``."""
    gpu_loader = DALILoader(files[::every], labels[::every], batch_size=batch, options=gpu, **common)
    keep = [i for i in range(len(files)) if i % every]
    cpu_loader = DALILoader(
        [files[i] for i in keep], [labels[i] for i in keep], batch_size=batch, options=cpu, **common
    )
    its = (forever(gpu_loader), forever(cpu_loader))
    count = [0]

    def feed() -> tuple[torch.Tensor, torch.Tensor]:
        count[0] += 1
        return next(its[0] if count[0] % every == 0 else its[1])

    def close() -> None:
        gpu_loader.close()
        cpu_loader.close()

    return feed, close


def side_stream_kernels(loop: Any, steps: int) -> dict[str, Any]:
    """Kernel time a step on CUDA streams other than the model's (the one with the most kernel time)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            loop.step()
        torch.cuda.synchronize()
    per_stream: dict[int, float] = {}
    names: dict[tuple[int, str], float] = {}
    for ev in prof.profiler.kineto_results.events():
        if ev.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        stream, ms = ev.device_resource_id(), ev.duration_ns() / 1e6
        per_stream[stream] = per_stream.get(stream, 0.0) + ms
        names[(stream, ev.name()[:60])] = names.get((stream, ev.name()[:60]), 0.0) + ms
    if not per_stream:
        return {}
    model_stream = max(per_stream, key=per_stream.__getitem__)
    side = {k: v for k, v in names.items() if k[0] != model_stream}
    top = sorted(side.items(), key=lambda kv: -kv[1])[:6]
    return {
        "model_stream_ms_per_step": per_stream[model_stream] / steps,
        "side_streams_ms_per_step": sum(v for s, v in per_stream.items() if s != model_stream) / steps,
        "side_top_ms_per_step": {f"{s}:{n}": v / steps for (s, n), v in top},
    }


def _describe(setup: dict[str, Any]) -> dict[str, Any]:
    """The set-up as plain values for the results file."""
    if "alternate" in setup:
        every, gpu, cpu = setup["alternate"]
        return {"alternate_every": every, "gpu_threads": gpu.threads, "cpu_threads": cpu.threads}
    if "parts" in setup:
        return {
            "parts": [
                {"share": share, "decoder": o.decoder, "threads": o.threads} for share, o in setup["parts"]
            ]
        }
    return {"decoder": setup["options"].decoder, "threads": setup["options"].threads}


def _suffix(model: str) -> str:
    """The results keys' suffix for a model fed (``""``: the one model of an eager-only run)."""
    return f"_{model}" if model else ""


def _ceiling_name(model: str, what: str) -> str:
    return " ".join(part for part in ("ceiling", model, what) if part)


def alone(feed: Callable[[], Any], batch: int, warmup: int, batches: int, device: torch.device) -> float:
    for _ in range(warmup):
        feed()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(batches):
        feed()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return batches * batch / (time.perf_counter() - t0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", help="results JSON (default benchmarks/results/dali_decode[_compiled]_h200.json)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny CPU run that proves the script works")
    parser.add_argument(
        "--compiled", action="store_true", help="feed the compiled model (and the eager one); its set-ups"
    )
    parser.add_argument("--repeats", type=int, default=1, help="rounds over the set-ups, alternating order")
    parser.add_argument(
        "--models",
        default="compiled,eager",
        help="with --compiled: the models fed, from compiled, graphs (torch.compile mode "
        "'reduce-overhead': CUDA graphs) and eager",
    )
    parser.add_argument(
        "--only", default="", help="only the set-ups whose name holds one of these (comma list)"
    )
    parser.add_argument("--data-root", default="/tmp/gpuopt_data")
    parser.add_argument("--budget-s", type=float, default=240.0)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats: {args.repeats}; give 1 or more rounds")
    kinds: dict[str, bool | str] = {"compiled": True, "graphs": "reduce-overhead", "eager": False}
    models = [m for m in args.models.split(",") if m] if args.compiled else [""]
    unknown = set(models) - set(kinds) - {""}
    if unknown:
        parser.error(f"--models: unknown {sorted(unknown)}; choose from {sorted(kinds)}")
    default_out = f"benchmarks/results/dali_decode{'_compiled' if args.compiled else ''}_h200.json"
    args.out = quick_out(args.out or default_out, default_out, args.quick)
    gpu = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    cores = available_cpus()  # the set-ups are checked before any data or model is made
    setups = compiled_setups(cores, gpu) if args.compiled else eager_setups(cores, gpu)
    if args.only:
        setups = [(n, s) for n, s in setups if any(part in n for part in args.only.split(","))]
        if not setups:
            parser.error(
                f"--only {args.only!r} matches no set-up; names start with 'CPU decoding', 'nvJPEG', 'turns'"
            )
    root = jpeg_data(args.data_root, gpu)  # the same data as gpu_dali.py
    if gpu:
        torch.backends.cudnn.benchmark = True
        model_name, num_classes, batch, image_size = "resnet50", 100, 256, 224
        steps, warmup, alone_warmup, alone_batches = 80, 20, 20, 60
    else:
        model_name, num_classes, batch, image_size = "small", 4, 8, 32
        steps, warmup, alone_warmup, alone_batches = 2, 1, 1, 2
    _, samples = scan_image_folder(root)
    files, labels = [p for p, _ in samples], [y for _, y in samples]
    common = {
        "image_size": image_size,
        "train": True,
        "device": device,
        "dtype": torch.float16 if gpu else torch.float32,
    }

    def make_loop(compiled: bool | str) -> PlainLoop:
        loop = PlainLoop(
            build_model(model_name, num_classes), batch, image_size=image_size, num_classes=num_classes,
            dtype=torch.float16 if gpu else None, device=device, compile=compiled,
        )  # fmt: skip
        if gpu:  # the resident batch in the dtype the pipelines deliver: one compiled graph for both
            loop.x = loop.x.half()
        return loop

    # one loop a model for every set-up: a compiled model compiles once
    loops = {m: make_loop(kinds.get(m, False)) for m in models}

    def measure(loop: PlainLoop, feed: Callable[[], Any] | None, first_warmup: int = 0) -> float:
        loop.feed = feed
        for _ in range(warmup + first_warmup):
            loop.step()
        return loop.throughput(steps)

    ceilings = {k: measure(loop, None, first_warmup=10) for k, loop in loops.items()}
    print(f"[{time.perf_counter() - T0:.0f}s] ceilings {ceilings}", flush=True)
    results: dict[str, dict[str, Any]] = {
        name: {"alone": [], "fed": {k: [] for k in loops}} for name, _ in setups
    }
    for rep in range(args.repeats):
        for name, setup in setups if rep % 2 == 0 else setups[::-1]:
            if time.perf_counter() - T0 > args.budget_s:
                continue
            feed, close = make_feed(files, labels, batch, common, setup)
            got = results[name]
            got["alone"].append(alone(feed, batch, alone_warmup, alone_batches, device))
            for k, loop in loops.items():
                got["fed"][k].append(measure(loop, feed))
            if rep == 0 and gpu:
                got.update(side_stream_kernels(next(iter(loops.values())), steps=10))
            close()
            fed = ", ".join(f"{k} {v[-1] / ceilings[k]:.3f}" for k, v in got["fed"].items())
            print(
                f"[{time.perf_counter() - T0:.0f}s] {name}: alone {got['alone'][-1]:.0f}/s, fed {fed}",
                flush=True,
            )
    rows: list[dict[str, Any]] = [
        {"name": _ceiling_name(k, "(plain loop, batch on GPU)"), "samples_per_sec": v,
         "ratio_to_ceiling": 1.0} for k, v in ceilings.items()
    ]  # fmt: skip
    for name, setup in setups:
        got = results[name]
        if not got["alone"]:
            rows.append({"name": f"{name} (skipped: time budget)"})
            continue
        rate = statistics.median(got["alone"])
        row: dict[str, Any] = {"name": name, "setup": _describe(setup), "alone_samples_per_sec": rate}
        for k, fed in got["fed"].items():
            key = _suffix(k)
            row[f"alone_ratio{key}"] = rate / ceilings[k]
            row[f"samples_per_sec{key}"] = statistics.median(fed)
            row[f"ratio_to_ceiling{key}"] = statistics.median(fed) / ceilings[k]
            row[f"runs_ratio_to_ceiling{key}"] = [round(v / ceilings[k], 4) for v in fed]
        first = _suffix(next(iter(got["fed"])))  # the first model's figures under the plain keys too
        row["samples_per_sec"] = row[f"samples_per_sec{first}"]
        row["ratio_to_ceiling"] = row[f"ratio_to_ceiling{first}"]
        row.update({k: v for k, v in got.items() if k not in ("alone", "fed")})
        rows.append(row)
    for k, loop in loops.items():
        end = measure(loop, None)
        rows.append({"name": _ceiling_name(k, "again (end of run)"), "samples_per_sec": end,
                     "ratio_to_ceiling": end / ceilings[k]})  # fmt: skip
    write_results(
        args.out, rows, benchmark="gpu_dali_decode", quick=args.quick, model=model_name, batch_size=batch,
        image_size=image_size, dataset={"images": len(files)}, seconds=time.perf_counter() - T0,
        compiled=args.compiled, repeats=args.repeats,
    )  # fmt: skip
    columns = ["name", "samples_per_sec", "alone_samples_per_sec"] + [
        f"ratio_to_ceiling{_suffix(k)}" for k in loops
    ]
    print(format_table(rows, columns))
    return 0


def eager_setups(cores: int, gpu: bool) -> list[tuple[str, dict[str, Any]]]:
    """nvJPEG, CPU threads (the CPUs less two, less one, all), and two pipelines concatenated each step."""
    cpu_threads = sorted({max(1, cores - 2), max(1, cores - 1), cores}) if gpu else [2]
    split_threads = max(1, cores - 4)
    return [
        ("nvJPEG, 8 threads", {"options": DALIOptions(decoder="gpu", threads=8)}),
        *[
            (f"CPU decoding, {n} threads", {"options": DALIOptions(decoder="cpu", threads=n)})
            for n in cpu_threads
        ],
        (
            f"two pipelines: CPU 3/4 ({split_threads} threads) + nvJPEG 1/4 (2 threads)",
            {
                "parts": [
                    (0.75, DALIOptions(decoder="cpu", threads=split_threads)),
                    (0.25, DALIOptions(threads=2)),
                ]
            },
        ),
        (
            f"two pipelines: CPU 1/2 ({split_threads} threads) + nvJPEG 1/2 (2 threads)",
            {
                "parts": [
                    (0.5, DALIOptions(decoder="cpu", threads=split_threads)),
                    (0.5, DALIOptions(threads=2)),
                ]
            },
        ),
    ]


def compiled_setups(cores: int, gpu: bool) -> list[tuple[str, dict[str, Any]]]:
    """CPU threads, nvJPEG, and the two taking turns by whole batches (nvJPEG one batch in ``k``)."""
    cpu_n = max(1, cores - 2)
    setups: list[tuple[str, dict[str, Any]]] = [
        (f"CPU decoding, {cpu_n} threads", {"options": DALIOptions(decoder="cpu", threads=cpu_n)}),
    ]
    if gpu:  # nvJPEG needs a GPU
        setups.append(("nvJPEG, 8 threads", {"options": DALIOptions(decoder="gpu", threads=8)}))
    for every, nv_threads, cpu_threads in (
        (2, 4, cores - 4),
        (2, 2, cores - 3),
        (3, 2, cores - 3),
        (4, 2, cores - 3),
    ):
        nv = DALIOptions(decoder="gpu" if gpu else "cpu", threads=max(1, nv_threads if gpu else 1))
        cpu = DALIOptions(decoder="cpu", threads=max(1, cpu_threads))
        name = f"turns: nvJPEG 1 batch in {every} ({nv.threads} threads) + CPU {cpu.threads} threads"
        if name not in dict(setups):  # few CPUs (--quick) give the same set-up twice
            setups.append((name, {"alternate": (every, nv, cpu)}))
    return setups


if __name__ == "__main__":
    raise SystemExit(main())
