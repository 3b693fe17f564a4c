"""Subclass OptimizedDataModule with your own dataset; get tuned, pinned, uint8-to-GPU batches.

Your dataset only decodes to uint8 HWC at a fixed size; the DataModule batches it as uint8, pins it (on
CUDA), tunes num_workers, and on the device crops, flips, normalizes and converts to channels_last.

    python examples/subclass_datamodule.py            # CPU: a few steps on generated JPEGs
    python examples/subclass_datamodule.py --gpu      # CUDA, fp16-mixed
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from lightning_gpuopt import OptimizedDataModule, TuningConfig
from lightning_gpuopt.bench.models import ImageClassifier
from lightning_gpuopt.bench.synthetic import make_jpeg_folder


class CsvImageDataset(Dataset):
    """Images listed in a CSV-like index (``path,label`` lines): the kind of dataset people write.

    Returns ``(uint8 HxWx3 array, int)`` of a fixed size. No ToTensor, no Normalize: those happen on the GPU.
    """

    def __init__(self, index_file: str, size: int) -> None:
        self.size = size
        self.items = []
        for line in Path(index_file).read_text().splitlines():
            path, label = line.rsplit(",", 1)
            self.items.append((path, int(label)))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        path, label = self.items[i]
        with Image.open(path) as img:
            img = img.convert("RGB").resize((self.size, self.size), Image.BILINEAR)
            return np.asarray(img), label


class MyData(OptimizedDataModule):
    """Two index files -> train/val datasets; every other argument goes to OptimizedDataModule."""

    def __init__(self, train_index: str, val_index: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.train_index, self.val_index = train_index, val_index

    def train_dataset(self) -> Dataset:
        return CsvImageDataset(self.train_index, self.storage_size)

    def val_dataset(self) -> Dataset:
        return CsvImageDataset(self.val_index, self.storage_size)


def write_index(folder: Path, out: Path, start: int, stop: int) -> str:
    files = sorted(folder.glob("class_*/*.jpg"))[start:stop]
    out.write_text("\n".join(f"{f},{int(f.parent.name.split('_')[1])}" for f in files))
    return str(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="train on CUDA with fp16-mixed")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    # the generated images and their index files, removed however the run ends
    with tempfile.TemporaryDirectory(prefix="gpuopt_example_") as tmp:
        train(Path(tmp), args)


def train(work: Path, args: argparse.Namespace) -> None:
    folder = make_jpeg_folder(work / "images", num_images=320, num_classes=4, image_size=(96, 72))
    dm = MyData(
        write_index(folder, work / "train.csv", 0, 256),
        write_index(folder, work / "val.csv", 256, 320),
        batch_size=32,
        image_size=48,  # the model sees 48x48 crops of 55x55 stored squares
        num_workers="auto",  # measured in setup(), cached for the next run
        tuning=TuningConfig(budget_s=5.0),
    )
    model = ImageClassifier("small", num_classes=4)
    trainer = pl.Trainer(
        accelerator="cuda" if args.gpu else "cpu",
        devices=1,
        precision="16-mixed" if args.gpu else "32-true",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, datamodule=dm)
    loader = trainer.train_dataloader
    print(
        f"num_workers={dm.num_workers} pin_memory={loader.pin_memory} persistent={loader.persistent_workers} "
        f"val/acc={float(trainer.callback_metrics.get('val/acc', float('nan'))):.2f}"
    )


if __name__ == "__main__":
    main()
