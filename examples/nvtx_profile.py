"""Profile a few training steps with Nsight Systems and NVTXRanges.

    nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop \\
        -t cuda,nvtx,osrt,cudnn,cublas -o nvtx_demo python examples/nvtx_profile.py

Open ``nvtx_demo.nsys-rep`` in Nsight Systems: the NVTX row of the main thread shows ``step N`` with
``forward`` (and the per-layer ranges), ``zero_grad``, ``backward`` and ``optimizer step`` inside, and
``data wait`` between steps. Only steps 10-14 are recorded (``start_step``/``stop_step``).

Runs without a GPU or nsys too (then the ranges go nowhere and the capture window is only marked).
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt import NVTXRanges
from lightning_gpuopt.bench.models import ImageClassifier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--module-depth", type=int, default=1, help="0 = no per-module ranges")
    args = parser.parse_args()

    images = torch.randn(args.batch_size * 4, 3, 32, 32)
    labels = torch.randint(0, 10, (len(images),))
    loader = DataLoader(TensorDataset(images, labels), batch_size=args.batch_size, shuffle=True)

    ranges = NVTXRanges(module_depth=args.module_depth, module_root="model", start_step=10, stop_step=15)
    trainer = pl.Trainer(
        max_steps=args.steps,
        callbacks=[ranges],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(ImageClassifier("small", num_classes=10), loader)


if __name__ == "__main__":
    main()
