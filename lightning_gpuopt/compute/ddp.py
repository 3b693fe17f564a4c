"""``NonBlockingStepChecks``: DDP training steps that never make the host wait for the GPU.

Under DDP, Lightning's training loop broadcasts rank zero's SIGTERM flag at the start of every step and reads
it back on the host, a host-device synchronisation per step: the host cannot queue step ``k + 1`` while the
GPU runs step ``k``, so each step's launch time shows as GPU idle time and every rank waits for the slowest
at that point. This callback keeps the check (every rank still broadcasts every step) but reads each result
once it has arrived, without waiting (``lightning_gpuopt._compat.nonblocking_sigterm_check``); a SIGTERM then
stops all ranks one or two steps later. On one device it does nothing. ``fast_trainer_kwargs`` adds it.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_gpuopt import _compat


class NonBlockingStepChecks(pl.Callback):
    """Remove the per-step host synchronisation of Lightning's DDP training loop.

    Example::

        trainer = Trainer(devices=2, strategy="ddp", callbacks=[NonBlockingStepChecks()])
    """

    def __init__(self) -> None:
        self.active = False

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.active = trainer.world_size > 1 and _compat.nonblocking_sigterm_check(trainer)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {}
