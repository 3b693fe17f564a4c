"""The fastest compute settings for this machine in one line: ``Trainer(**fast_trainer_kwargs(model))``.

Prints what the preset chose, then trains a few steps. Runs on a CPU (tiny sizes) and on a GPU::

    python examples/compute_preset.py            # small ResNet, 32x32 images
    python examples/compute_preset.py --model resnet50 --image-size 224 --batch-size 256   # on a GPU
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt import choose_precision, fast_trainer_kwargs
from lightning_gpuopt.bench.models import ImageClassifier


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="small", help="small, resnet18 or resnet50 (needs torchvision)")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()

    model = ImageClassifier(args.model, num_classes=10)
    x = torch.randn(args.batch_size * 4, 3, args.image_size, args.image_size)
    y = torch.randint(0, 10, (len(x),))
    data = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True)

    print(f"choose_precision(model) -> {choose_precision(model=model)!r}")
    kwargs = fast_trainer_kwargs(model, max_steps=args.steps, logger=False, enable_checkpointing=False)
    print("Trainer kwargs:", {k: v for k, v in kwargs.items() if k != "callbacks"})
    print("callbacks:", [type(c).__name__ for c in kwargs["callbacks"]])
    print("TF32 matmul precision:", torch.get_float32_matmul_precision())

    # the one line
    trainer = pl.Trainer(**kwargs)
    trainer.fit(model, data)


if __name__ == "__main__":
    main()
