"""One long-lived Python process, as a notebook is: fit + validate four times on each backend, checking after
each call what the process still has running and what is left in its ``TMPDIR``.

Run as ``python tests/faults/_notebook_child.py DATA BACKENDS``. ``DATA`` holds ``good`` (JPEGs), ``folder``
(the same and one file that is not a JPEG), ``raw.h5`` and ``jpeg.h5`` (stores of ``good``). ``BACKENDS`` is a
comma-separated list of ``folder`` (``on_corrupt="skip"``: the DataModule's skip folder, worker processes),
``hdf5`` (the raw store: reading threads), ``jpeg`` (the JPEG store: worker processes), ``dali`` (DALI's CPU
pipeline) and ``bad`` (``on_corrupt="raise"``: each fit stops on the bad file). Each check is printed as one
JSON line ``{"backend", "round", "call", "children", "left", "error"}``: the child processes still alive after
a grace period (polled), the entries of ``TMPDIR`` and, for a call that raised, its message. ``@ done`` ends
the run.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROUNDS = 4
#: seconds a child process may take to end after a call returned (polled, not slept)
GRACE_S = 10.0


def alive_children() -> list[str]:
    import psutil

    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{child.pid}: {' '.join(child.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            continue
    return out


def settled() -> tuple[list[str], list[str]]:
    """The children alive and the entries of ``TMPDIR``, polled until both are empty or ``GRACE_S`` passed."""
    tmp = Path(tempfile.gettempdir())
    deadline = time.monotonic() + GRACE_S
    while True:
        children, left = alive_children(), sorted(p.name for p in tmp.iterdir())
        if (not children and not left) or time.monotonic() > deadline:
            return children, left
        time.sleep(0.05)


def main() -> None:
    data, backends = Path(sys.argv[1]), sys.argv[2].split(",")

    import lightning.pytorch as pl
    import torch
    from torch import nn

    from lightning_gpuopt import DALIOptions, HDF5Options, OptimizedDataModule

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 3))

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    sources = {"folder": "folder", "bad": "folder", "hdf5": "raw.h5", "jpeg": "jpeg.h5", "dali": "good"}
    for backend in backends:
        path = str(data / sources[backend])
        bad = backend == "bad"
        # a fit that stops on the bad file reads every image (validation takes them all); others a few batches
        limits = {} if bad else {"limit_train_batches": 2, "limit_val_batches": 2}
        for round_ in range(ROUNDS):
            dm = OptimizedDataModule(
                path,
                path,
                backend={"bad": "folder", "jpeg": "hdf5", "hdf5": "hdf5"}.get(backend, backend),
                batch_size=4,
                # worker processes where the backend has them; the raw store's and DALI's threads in their
                # own options (num_workers means worker processes only)
                num_workers={"hdf5": 0, "dali": "auto"}.get(backend, 1),
                **({"dali": DALIOptions(threads=1)} if backend == "dali" else {}),
                **({"hdf5": HDF5Options(threads=1)} if backend == "hdf5" else {}),
                image_size=16,
                on_corrupt="skip" if backend == "folder" else "raise",
            )
            for call in ("fit", "validate"):
                trainer = pl.Trainer(
                    accelerator="cpu",
                    max_epochs=1,
                    num_sanity_val_steps=0,
                    logger=False,
                    enable_checkpointing=False,
                    enable_progress_bar=False,
                    enable_model_summary=False,
                    **limits,
                )
                error = None
                try:
                    getattr(trainer, call)(Tiny(), datamodule=dm)
                except Exception as err:  # the bad image's; anything else is reported by the case too
                    error = f"{type(err).__name__}: {err}"
                children, left = settled()
                row = {"backend": backend, "round": round_, "call": call, "children": children, "left": left}
                print(json.dumps({**row, "error": error}), flush=True)
                if bad:
                    break  # the fit stopped: nothing to validate
    print("@ done", flush=True)


if __name__ == "__main__":
    main()
