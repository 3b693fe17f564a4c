"""``NonBlockingStepChecks``: DDP training steps whose SIGTERM check never makes the host wait for the GPU
(docs/multi_gpu.md)."""

from __future__ import annotations

import contextlib
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_gpuopt import _compat

__all__ = ["NonBlockingStepChecks", "nonblocking_sigterm_check"]

# broadcasts in flight at once: the host may run this many steps ahead of the GPU before it waits
_SIGTERM_SLOTS = 4

_Slot = tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]  # host in, device, host out, CUDA event


def nonblocking_sigterm_check(trainer: Any) -> bool:
    """Make Lightning's per-step SIGTERM check of ``trainer`` stop blocking the host (docs/multi_gpu.md); its
    SIGTERM handler then issues no broadcast of its own, which could hang the run mid-step.

    Returns:
        Whether the check was replaced (``False`` where this Lightning lacks the loop method: nothing changes).
    """
    if not _compat.replace_sigterm_check(trainer, _NonBlockingSigterm(trainer)):
        return False
    _compat.drop_sigterm_broadcast(trainer)  # the per-step check now carries rank zero's flag
    return True


def _sigterm_slots(device: torch.device) -> list[_Slot]:
    cuda = device.type == "cuda"
    host = [torch.zeros(2, 1, dtype=torch.int32, pin_memory=cuda) for _ in range(_SIGTERM_SLOTS)]
    dev = [torch.zeros(1, dtype=torch.int32, device=device) for _ in range(_SIGTERM_SLOTS)]
    return [(h[0], d, h[1], torch.cuda.Event() if cuda else None) for h, d in zip(host, dev, strict=True)]


def _stop_all_ranks() -> None:
    import torch.distributed as dist
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    with contextlib.suppress(Exception):
        dist.barrier()
    raise SIGTERMException()


class _NonBlockingSigterm:
    """The replacement for ``_TrainingEpochLoop._broadcast_sigterm_tensor``, called at every step's start."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.slots: list[_Slot] | None = None
        self.step = 0
        self.pending: list[int] = []

    def __call__(self) -> None:
        import torch.distributed as dist

        if self.slots is None:
            self.slots = _sigterm_slots(self.trainer.strategy.root_device)
        index = self.step % _SIGTERM_SLOTS
        self.step += 1
        # read every finished broadcast, oldest first; wait only where the GPU is a whole ring behind (the
        # oldest is the slot this step reuses)
        while self.pending:
            oldest = self.pending[0]
            host_out, event = self.slots[oldest][2:]
            if event is not None:
                if oldest != index and not event.query():
                    break
                event.synchronize()
            self.pending.pop(0)
            if int(host_out[0]) == 1:
                _stop_all_ranks()
        host_in, dev, host_out, event = self.slots[index]
        host_in[0] = 1 if getattr(self.trainer, "received_sigterm", False) else 0
        dev.copy_(host_in, non_blocking=True)
        dist.broadcast(dev, src=0)
        host_out.copy_(dev, non_blocking=True)
        if event is not None:
            event.record()
        self.pending.append(index)


class NonBlockingStepChecks(pl.Callback):
    """Remove the per-step host synchronisation of Lightning's DDP training loop
    (``nonblocking_sigterm_check`` at ``on_train_start`` of a run on more than one device).

    Attributes:
        active: whether the check was replaced in the current (or last) fit.

    Example::

        trainer = Trainer(devices=2, strategy="ddp", callbacks=[NonBlockingStepChecks()])
    """

    def __init__(self) -> None:
        self.active = False

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.active = trainer.world_size > 1 and nonblocking_sigterm_check(trainer)
