"""Compute: what precision, memory layout, TF32 and the preset each buy a user's model, data held constant.

Every row fits ``UserClassifier`` (torchvision's ResNet-50, its own SGD) on one batch kept on the GPU, so
the data pipeline costs nothing and only the compute settings differ:

    fp32                     Trainer(precision="32-true"), TF32 off
    tf32                     the same, TF32 on
    16-mixed                 Trainer(precision="16-mixed"), NCHW
    16-mixed+channels_last   the same with the ChannelsLast callback
    bf16-mixed+channels_last
    preset                   Trainer(**fast_trainer_kwargs(model)): precision, channels_last, fused SGD, TF32
    ceiling                  a plain PyTorch loop (fp16 autocast, channels_last, fused SGD) on the same batch

The rows take turns ``--repeats`` times; each repetition is one fit measured by ``StepClock``. Ratios are to
the ceiling of the same turn. ``preset_to_best`` is the preset's median over the best manual row's.

    python3 benchmarks/compute.py                 # one H200: about 5 minutes
    python3 benchmarks/compute.py --quick         # CPU smoke run (fp16 becomes bf16; the row names stay)
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _shared import add_common, add_model, chosen_rows, free, measured_fit, report, resident, results_path, say, take_turns
from _zoo import UserClassifier, compiled_ceiling, measure_ceiling

from lightning_gpuopt import ChannelsLast
from lightning_gpuopt.bench.steady import Measurement

#: row -> (precision, channels_last, tf32); ``None`` precision: the preset chooses
ROWS: dict[str, tuple[str | None, bool, bool]] = {
    "fp32": ("32-true", False, False),
    "tf32": ("32-true", False, True),
    "16-mixed": ("16-mixed", False, True),
    "16-mixed+channels_last": ("16-mixed", True, True),
    "bf16-mixed+channels_last": ("bf16-mixed", True, True),
    "preset": (None, True, True),
}


@contextlib.contextmanager
def tf32(on: bool) -> Iterator[None]:
    """TF32 for fp32 matmuls and convolutions on or off for the block, restored after it."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("high" if on else "highest")
    torch.backends.cudnn.allow_tf32 = on
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn


def row_variant(name: str, args: argparse.Namespace) -> Callable[[], Measurement]:
    """One fit of the row's settings on a float channels_last (or NCHW) batch kept on the device."""
    precision, channels_last, tf32_on = ROWS[name]
    if args.device == "cpu" and precision == "16-mixed":
        precision = "bf16-mixed"  # CPU autocast has no fp16

    def run() -> Measurement:
        model = UserClassifier(args.arch, num_classes=10)
        batches = resident(args.batch_size, args.image_size, args.device, uint8=False)
        if not channels_last:
            batches.x = batches.x.contiguous()
        trainer: dict[str, Any] = {"benchmark": args.device == "cuda"}
        if precision is not None:
            trainer["precision"] = precision
        with tf32(tf32_on):
            m = measured_fit(
                model, args.warmup, args.steps, device=args.device, preset=precision is None, trainer=trainer,
                callbacks=[ChannelsLast()] if channels_last and precision else (), train_dataloaders=batches,
            )  # fmt: skip
        free()
        return m

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common(p, warmup=20, steps=100)
    add_model(p, ROWS)
    args = p.parse_args(argv)
    rows = chosen_rows(p, args, ROWS)
    t0 = time.perf_counter()
    torch.backends.cudnn.benchmark = args.device == "cuda"  # the ceiling as the fits: Trainer(benchmark=True)
    loop, _ = compiled_ceiling(args.arch, args.batch_size, args.image_size, 10, args.device, compile=False)
    variants = {"ceiling": lambda: measure_ceiling(loop, args.warmup, args.steps)}
    variants |= {name: row_variant(name, args) for name in rows}
    results = take_turns(variants, args.repeats, on_result=say)
    table = report(results_path(args.out, "compute", args.quick), results, "ceiling", quick=args.quick,
                   settings=vars(args), **summary(results), seconds=time.perf_counter() - t0)  # fmt: skip
    return 0 if all(r["error"] is None for r in table) else 1


def summary(results: dict[str, list[Measurement | BaseException]]) -> dict[str, Any]:
    """``preset_to_best``: the preset's median rate over the best manual row's, and which row that is."""
    import statistics

    rates = {
        name: statistics.median(m.samples_per_sec or 0.0 for m in ms if isinstance(m, Measurement))
        for name, ms in results.items()
        if name != "ceiling" and any(isinstance(m, Measurement) for m in ms)
    }
    manual = {k: v for k, v in rates.items() if k != "preset"}
    if "preset" not in rates or not manual:
        return {"preset_to_best": None, "best_row": None}
    best = max(manual, key=lambda k: manual[k])
    return {"preset_to_best": rates["preset"] / manual[best], "best_row": best}


if __name__ == "__main__":
    sys.exit(main())
