"""Helpers for the CPU DDP tests (gloo, ``ddp_spawn``)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch


class CloseProcessGroup(pl.Callback):
    """Destroy the process group in each spawned rank at the end of its fit.

    Lightning leaves the group to the interpreter's exit in ``ddp_spawn`` children; gloo's worker threads can
    then still be alive when the process tears down, and the child aborts ("terminate called without an
    active exception", SIGABRT) although the fit itself succeeded. The teardown hook runs after the
    strategy's teardown, when no collective is left.
    """

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
