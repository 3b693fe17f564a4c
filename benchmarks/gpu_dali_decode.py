"""Where DALI's JPEG decoding should run next to ResNet-50 on one GPU: CPU threads, nvJPEG, or both.

For each decoding set-up, in one run: the pipeline alone (no model; samples/s after a warm-up), and a plain
PyTorch ResNet-50 fp16 + channels_last loop fed by it (hand-written, no Lightning), against the ceiling (the
same loop on a resident batch, measured first and again last). Set-ups, as ``DALIOptions``: every JPEG on
nvJPEG (``decoder="gpu"``, the default), every JPEG on N CPU threads (``decoder="cpu"``, N = the CPUs less
two, less one, and all of them), and two pipelines side by side (a CPU-decoding one and an nvJPEG one over
disjoint halves of the file list) whose batches are concatenated each step.

    PYTHONPATH=. python3 benchmarks/gpu_dali_decode.py --out $OUT/dali_decode_h200.json
    PYTHONPATH=. python3 benchmarks/gpu_dali_decode.py --quick      # CPU pipelines, tiny images and model
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_gpuopt._common import available_cpus, format_table
from lightning_gpuopt.bench.measure import plain_loop_throughput, write_results
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


def _describe(setup: dict[str, Any]) -> dict[str, Any]:
    """The set-up as plain values for the results file."""
    if "parts" in setup:
        return {
            "parts": [
                {"share": share, "decoder": o.decoder, "threads": o.threads} for share, o in setup["parts"]
            ]
        }
    return {"decoder": setup["options"].decoder, "threads": setup["options"].threads}


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
    parser.add_argument("--out", default="benchmarks/results/dali_decode_h200.json")
    parser.add_argument("--quick", action="store_true", help="tiny CPU run that proves the script works")
    parser.add_argument("--data-root", default="/tmp/gpuopt_data")
    parser.add_argument("--budget-s", type=float, default=240.0)
    args = parser.parse_args()
    args.out = quick_out(args.out, parser.get_default("out"), args.quick)
    gpu = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
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

    def ceiling() -> float:
        return plain_loop_throughput(
            build_model(model_name, num_classes), batch, image_size=image_size, num_classes=num_classes,
            dtype=torch.float16 if gpu else None, device=device, steps=steps, warmup=warmup,
        )  # fmt: skip

    ceil = ceiling()
    print(f"[{time.perf_counter() - T0:.0f}s] ceiling {ceil:.0f}/s", flush=True)
    cores = available_cpus()
    cpu_threads = sorted({max(1, cores - 2), max(1, cores - 1), cores}) if gpu else [2]
    split_threads = max(1, cores - 4)
    setups: list[tuple[str, dict[str, Any]]] = [
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
    rows: list[dict[str, Any]] = [
        {"name": "ceiling (plain loop, batch on GPU)", "samples_per_sec": ceil, "ratio_to_ceiling": 1.0}
    ]
    for name, setup in setups:
        if time.perf_counter() - T0 > args.budget_s:
            rows.append({"name": f"{name} (skipped: time budget)"})
            continue
        feed, close = make_feed(files, labels, batch, common, setup)
        rate = alone(feed, batch, alone_warmup, alone_batches, device)
        fed = plain_loop_throughput(
            build_model(model_name, num_classes), batch, image_size=image_size, num_classes=num_classes,
            dtype=torch.float16 if gpu else None, device=device, steps=steps, warmup=warmup, feed=feed,
        )  # fmt: skip
        close()
        row = {
            "name": name,
            "alone_samples_per_sec": rate,
            "alone_ratio": rate / ceil,
            "samples_per_sec": fed,
            "ratio_to_ceiling": fed / ceil,
            "setup": _describe(setup),
        }
        rows.append(row)
        print(f"[{time.perf_counter() - T0:.0f}s] {name}: alone {rate:.0f}/s ({rate / ceil:.2f}x), "
              f"fed {fed / ceil:.3f}", flush=True)  # fmt: skip
    end = ceiling()
    rows.append(
        {"name": "ceiling again (end of run)", "samples_per_sec": end, "ratio_to_ceiling": end / ceil}
    )
    write_results(
        args.out, rows, benchmark="gpu_dali_decode", quick=args.quick, model=model_name, batch_size=batch,
        image_size=image_size, dataset={"images": len(files)}, seconds=time.perf_counter() - T0,
    )  # fmt: skip
    print(format_table(rows, ["name", "alone_ratio", "samples_per_sec", "ratio_to_ceiling"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
