"""Convert an image folder to uint8 HDF5 once, then train from it with GPU-side augmentation.

python examples/hdf5_train.py                       # a generated folder, small model, CPU or GPU
python examples/hdf5_train.py --src data/train --out train_256.h5 --model resnet50 --size 224

Without ``--out`` the store (and the generated folder) live in a temporary folder removed at the end.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_gpuopt import HDF5ImageDataset, HDF5Options, OptimizedDataModule, convert_folder_to_hdf5
from lightning_gpuopt.bench.models import ImageClassifier
from lightning_gpuopt.bench.synthetic import make_jpeg_folder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--src", default=None, help="class-per-subfolder folder (default: generate one)")
    parser.add_argument("--out", default=None, help="HDF5 file, kept (default: a temporary one)")
    parser.add_argument("--model", default="small")
    parser.add_argument("--size", type=int, default=32, help="training crop; stored at size * 256 / 224")
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()

    # what is not asked for by name is written in a temporary folder, removed however the run ends
    with tempfile.TemporaryDirectory(prefix="lightning_gpuopt_example_") as tmp:
        work = Path(tmp)
        src = (
            Path(args.src)
            if args.src
            else make_jpeg_folder(work / "jpegs", num_images=512, num_classes=8, image_size=(96, 72))
        )
        out = Path(args.out) if args.out else work / f"train_{round(args.size * 256 / 224)}.h5"
        if not out.exists():
            res = convert_folder_to_hdf5(src, out, storage_size=round(args.size * 256 / 224))
            print(f"converted {res.num_images} images in {res.seconds:.1f} s -> {out}")
        train(out, args)


def train(out: Path, args: argparse.Namespace) -> None:
    ds = HDF5ImageDataset(out)
    print(ds)
    # a raw store is read by threads of the training process (no worker processes): HDF5Options sets them
    dm = OptimizedDataModule(
        out, backend="hdf5", batch_size=64, hdf5=HDF5Options(threads=2), image_size=args.size
    )
    model = ImageClassifier(args.model, num_classes=len(ds.classes))
    gpu = torch.cuda.is_available()
    trainer = pl.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        precision="16-mixed" if gpu else "32-true",
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(model.to(memory_format=torch.channels_last), datamodule=dm)


if __name__ == "__main__":
    main()
