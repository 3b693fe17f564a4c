"""Train a classifier fed by the DALI backend (GPU decoding when CUDA is there, a CPU pipeline otherwise).

python examples/dali_train.py --data /tmp/gpuopt_data/demo_dali   # generates a small folder first
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch

from lightning_gpuopt.bench.models import ImageClassifier
from lightning_gpuopt.bench.synthetic import make_jpeg_folder
from lightning_gpuopt.data.datamodule import OptimizedDataModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="/tmp/gpuopt_data/demo_dali")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    root = make_jpeg_folder(
        args.data, num_images=2048 if gpu else 128, num_classes=10, image_size=(500, 375) if gpu else (96, 72)
    )
    dm = OptimizedDataModule(
        train_dir=root,
        val_dir=root,
        backend="dali",
        batch_size=128 if gpu else 16,
        image_size=224 if gpu else 64,
    )
    model = ImageClassifier("resnet18" if gpu else "small", num_classes=10).to(
        memory_format=torch.channels_last
    )
    trainer = pl.Trainer(
        accelerator="auto",
        devices=1,
        precision="16-mixed" if gpu else "32-true",
        max_epochs=args.epochs,
        limit_train_batches=None if gpu else 4,
        limit_val_batches=None if gpu else 2,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, datamodule=dm)
    print({k: float(v) for k, v in trainer.callback_metrics.items()})


if __name__ == "__main__":
    main()
