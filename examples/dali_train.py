"""Train a classifier fed by the DALI backend (GPU decoding when CUDA is there, a CPU pipeline otherwise).

python examples/dali_train.py                      # generates a small folder in a temporary one
python examples/dali_train.py --data data/demo_dali   # generates it there (kept), or reuses it
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_gpuopt.bench.models import ImageClassifier
from lightning_gpuopt.bench.synthetic import make_jpeg_folder
from lightning_gpuopt.data.datamodule import OptimizedDataModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=None, help="folder to generate into, kept (default: temporary)")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    if args.data is not None:
        train(Path(args.data), args.epochs)
        return
    with tempfile.TemporaryDirectory(prefix="gpuopt_example_") as tmp:  # removed however the run ends
        train(Path(tmp) / "demo_dali", args.epochs)


def train(data: Path, epochs: int) -> None:
    gpu = torch.cuda.is_available()
    root = make_jpeg_folder(
        data, num_images=2048 if gpu else 128, num_classes=10, image_size=(500, 375) if gpu else (96, 72)
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
        max_epochs=epochs,
        limit_train_batches=None if gpu else 4,
        limit_val_batches=None if gpu else 2,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, datamodule=dm)
    print({k: float(v) for k, v in trainer.callback_metrics.items()})


if __name__ == "__main__":
    main()
