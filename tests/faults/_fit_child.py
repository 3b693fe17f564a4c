"""A short Lightning fit on the CPU that prints where it is, for the fault cases to stop it at chosen points.

Run as ``python tests/faults/_fit_child.py DATA CASE_DIR [--on-corrupt skip]``: an ``OptimizedDataModule`` on
``DATA`` (an image folder or an HDF5 store) with two worker processes for the folder (``num_workers=2``) or
two reading threads for the store (``HDF5Options(threads=2)``), a tiny convolutional model, two
epochs. It prints ``@ setup``, ``@ train <step>``, ``@ val <epoch> <batch>`` and ``@ done`` (flushed) as it
goes. ``CASE_DIR`` is only carried on the command line, so the case's processes can be found by it.
"""

from __future__ import annotations

import argparse
import time


def mark(text: str) -> None:
    print(f"@ {text}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data")
    parser.add_argument("case_dir")
    parser.add_argument("--on-corrupt", default="raise")
    parser.add_argument("--step-seconds", type=float, default=0.02)
    args = parser.parse_args()

    import lightning.pytorch as pl
    import torch
    from torch import nn

    from lightning_gpuopt.data.datamodule import OptimizedDataModule

    class Marked(OptimizedDataModule):
        def setup(self, stage: str) -> None:
            super().setup(stage)
            mark("setup")

    class Tiny(pl.LightningModule):
        def __init__(self, classes: int) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Conv2d(3, 8, 3, stride=2),
                nn.ReLU(),
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
                nn.Linear(8, classes),
            )

        def training_step(self, batch, batch_idx):
            images, labels = batch
            time.sleep(args.step_seconds)  # a step long enough that the workers run ahead of it
            mark(f"train {self.global_step}")
            return nn.functional.cross_entropy(self.net(images), labels)

        def validation_step(self, batch, batch_idx):
            images, labels = batch
            mark(f"val {self.current_epoch} {batch_idx}")
            return nn.functional.cross_entropy(self.net(images), labels)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    from lightning_gpuopt.data.hdf5 import HDF5Options

    store = args.data.endswith((".h5", ".hdf5"))
    dm = Marked(
        args.data,
        args.data,
        batch_size=8,
        num_workers=0 if store else 2,
        hdf5=HDF5Options(threads=2) if store else None,
        image_size=32,
        on_corrupt=args.on_corrupt,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(Tiny(4), datamodule=dm)
    mark(f"done skipped={dm.num_skipped}")


if __name__ == "__main__":
    main()
