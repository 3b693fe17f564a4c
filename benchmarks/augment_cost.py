"""What ``GPUAugment`` costs a training step: milliseconds a batch, antialiased and plain, train and eval.

A batch of uint8 canvases (``layout.canvas_shape(storage)``, 341x256 landscape images) already on the device
is cropped, resized to ``image_size``, flipped and normalized, timed with CUDA events (wall clock on a CPU)
over ``--iters`` calls after a warm-up. Each row is one configuration; ``ratio_to_plain`` compares a row
with the plain-bilinear row of the same mode, measured in the same run.

    python benchmarks/augment_cost.py                        # batch 256, 224 px from 256 px stores
    python benchmarks/augment_cost.py --device cpu --batch 16 --iters 3

Writes ``benchmarks/results/augment_cost_<gpu name|cpu>.json`` (``--out`` to change the folder).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lightning_gpuopt._common import available_cpus, format_table
from lightning_gpuopt.data import layout
from lightning_gpuopt.data.transforms import GPUAugment


def time_augment(aug: GPUAugment, canvas: torch.Tensor, meta: torch.Tensor, train: bool, iters: int) -> float:
    """Mean milliseconds of ``aug(canvas, meta, train)`` over ``iters`` calls after three warm-up calls."""
    for _ in range(3):
        aug(canvas, meta, train=train)
    if canvas.is_cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            aug(canvas, meta, train=train)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        aug(canvas, meta, train=train)
    return (time.perf_counter() - t0) * 1e3 / iters


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--storage", type=int, default=256, help="shorter side of the stored images")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA GPU; pass --device cpu")
    device = torch.device(args.device)
    ch, cw = layout.canvas_shape(args.storage)
    g = torch.Generator(device=device).manual_seed(0)
    canvas = torch.randint(0, 256, (args.batch, ch, cw, 3), dtype=torch.uint8, device=device, generator=g)
    w = min(cw, round(args.storage * 4 / 3))
    meta = torch.tensor([[ch, w, 0]] * args.batch, dtype=torch.int32, device=device)
    meta[1::2, 2] = 1  # half of them portrait (stored transposed)
    rows: list[dict[str, Any]] = []
    for dtype in (torch.bfloat16, torch.float32):
        for train in (True, False):
            plain_ms = None
            for antialias in (False, True):
                aug = GPUAugment(args.image_size, output_dtype=dtype, antialias=antialias)
                ms = time_augment(aug, canvas, meta, train, args.iters)
                plain_ms = ms if not antialias else plain_ms
                rows.append(
                    {
                        "name": f"{'train' if train else 'eval'}_{'antialias' if antialias else 'plain'}_"
                        f"{str(dtype).removeprefix('torch.')}",
                        "ms_per_batch": ms,
                        "band": aug.band((ch, cw), train),
                        "ratio_to_plain": ms / plain_ms if plain_ms else None,
                        "samples_per_sec": args.batch / ms * 1e3,
                    }
                )
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    tag = "cpu" if gpu is None else gpu.lower().replace("nvidia ", "").split()[0]
    doc = {
        "machine": {
            "gpu": gpu,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cpus": available_cpus(),
            "platform": platform.platform(),
        },
        "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "config": {
            "batch": args.batch,
            "image_size": args.image_size,
            "canvas": [ch, cw],
            "iters": args.iters,
        },
        "rows": rows,
    }
    path = Path(args.out) / f"augment_cost_{tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(
        f"{path}\n{format_table(rows, ['name', 'ms_per_batch', 'band', 'ratio_to_plain', 'samples_per_sec'])}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
