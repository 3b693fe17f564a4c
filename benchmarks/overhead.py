"""Overhead: what watching a fit costs it (GPUStatsMonitor, NVTXRanges, BottleneckAdvisor).

Every row fits one ``UserClassifier`` (torchvision's ResNet-50, its own SGD) through
``Trainer(**fast_trainer_kwargs(model))`` on a uint8 batch kept on the GPU, so nothing but the callbacks
differs from the ``off`` row, and a host sync or a slow hook shows in full:

    off                      no callback of ours
    monitor                  GPUStatsMonitor()
    nvtx                     NVTXRanges(): step and phase ranges (no profiler attached)
    nvtx_modules_depth2      NVTXRanges(module_depth=2): a range around every module two levels down
    monitor+advisor          GPUStatsMonitor() and BottleneckAdvisor(), as the advisor is meant to run
    ceiling                  the plain PyTorch loop on the same batch, for scale

The rows take turns ``--repeats`` times; each repetition is one fit measured by ``StepClock``. Ratios are to
``off`` of the same turn: ``1 - ratio`` is the overhead. ``--tensorboard DIR`` also writes one monitored fit
whose first half is fed from the host with 60 ms of loading a batch and whose second half from the GPU,
for a TensorBoard picture of a starved and a fed GPU.

    python3 benchmarks/overhead.py                # one H200: about 4 minutes
    python3 benchmarks/overhead.py --quick        # CPU smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from _shared import add_common, add_model, chosen_rows, free, measured_fit, report, resident, results_path, say, take_turns
from _zoo import UserClassifier, compiled_ceiling, measure_ceiling

from lightning_gpuopt import BottleneckAdvisor, GPUStatsMonitor, NVTXRanges
from lightning_gpuopt.bench.steady import Measurement

#: row -> the callbacks it adds
ROWS: dict[str, Callable[[], list[Any]]] = {
    "off": list,
    "monitor": lambda: [GPUStatsMonitor()],
    "nvtx": lambda: [NVTXRanges()],
    "nvtx_modules_depth2": lambda: [NVTXRanges(module_depth=2, module_root="model")],
    "monitor+advisor": lambda: [GPUStatsMonitor(), BottleneckAdvisor(verbose=False)],
}


class HalfStarved:
    """``steps`` batches: the first half copied from the host after ``delay_s`` each, then the GPU's own."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, steps: int, delay_s: float) -> None:
        self.x, self.y, self.steps, self.delay_s = x, y, steps, delay_s
        self.host = (x.cpu(), y.cpu())

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(self.steps):
            if i < self.steps // 2:
                time.sleep(self.delay_s)  # stands in for decoding on the host
                yield self.host
            else:
                yield self.x, self.y


def tensorboard_run(args: argparse.Namespace, folder: Path) -> str:
    """One monitored fit, half starved and half fed, logged to TensorBoard under ``folder``."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_gpuopt import fast_trainer_kwargs
    from lightning_gpuopt.bench.measure import quiet_lightning

    model = UserClassifier(args.arch, num_classes=10)
    batches = resident(args.batch_size, args.image_size, args.device)
    steps, every = (8, 2) if args.quick else (160, 5)
    logger = TensorBoardLogger(save_dir=str(folder), name="overhead")
    monitor = GPUStatsMonitor(log_every_n_steps=every)
    kwargs = fast_trainer_kwargs(model, args.device, compile=False, max_steps=steps, logger=logger,
                                 log_every_n_steps=every, callbacks=[monitor],
                                 accelerator="gpu" if args.device == "cuda" else "cpu", devices=1,
                                 enable_progress_bar=False, enable_model_summary=False,
                                 enable_checkpointing=False)  # fmt: skip
    loader = HalfStarved(batches.x, batches.labels[0], steps, 0.02 if args.quick else 0.06)
    with quiet_lightning():
        pl.Trainer(**kwargs).fit(model, train_dataloaders=loader)
    return str(logger.log_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common(p, warmup=20, steps=150, repeats=5)
    add_model(p, ROWS)
    p.add_argument("--tensorboard", default=None, help="folder for the half-starved monitored fit")
    args = p.parse_args(argv)
    rows = chosen_rows(p, args, ROWS)
    t0 = time.perf_counter()
    model = UserClassifier(args.arch, num_classes=10)
    batches = resident(args.batch_size, args.image_size, args.device)
    loop, _ = compiled_ceiling(args.arch, args.batch_size, args.image_size, 10, args.device, compile=False)

    def variant(name: str) -> Callable[[], Measurement]:
        def go() -> Measurement:
            m = measured_fit(model, args.warmup, args.steps, device=args.device, callbacks=ROWS[name](),
                             train_dataloaders=batches)  # fmt: skip
            free()
            return m

        return go

    variants = {name: variant(name) for name in dict.fromkeys(["off", *rows])}
    variants["ceiling"] = lambda: measure_ceiling(loop, args.warmup, args.steps)
    results = take_turns(variants, args.repeats, on_result=say)
    tb = tensorboard_run(args, Path(args.tensorboard)) if args.tensorboard else None
    table = report(results_path(args.out, "overhead", args.quick), results, "off", label="of off",
                   quick=args.quick, settings=vars(args), tensorboard_log_dir=tb,
                   seconds=time.perf_counter() - t0)  # fmt: skip
    for row in table:
        if row["name"] not in ("off", "ceiling") and row["of_ceiling"] is not None:
            print(f"{row['name']}: overhead {100 * (1 - row['of_ceiling']):+.2f}% (median of the turns)")
    return 0 if all(r["error"] is None for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
