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
    """Make Lightning's per-step SIGTERM check of ``trainer`` stop blocking the host: the flag is still
    broadcast every step, and read once its copy has arrived (a SIGTERM stops all ranks a step or two later);
    Lightning's SIGTERM handler then issues no broadcast of its own, which could hang the run mid-step.

    Returns:
        Whether the check was replaced (``False`` where this Lightning lacks the loop method: nothing changes).
    """
    if not _compat.replace_sigterm_check(trainer, _NonBlockingSigterm(trainer)):
        return False
    _compat.drop_sigterm_broadcast(trainer)  # the per-step check now carries rank zero's flag
    return True


def _sigterm_slots(device: torch.device) -> list[_Slot]:
    cuda = device.type == "cuda"
    slots = []
    for _ in range(_SIGTERM_SLOTS):
        host_in = torch.zeros(1, dtype=torch.int32, pin_memory=cuda)
        host_out = torch.zeros(1, dtype=torch.int32, pin_memory=cuda)
        dev = torch.zeros(1, dtype=torch.int32, device=device)
        slots.append((host_in, dev, host_out, torch.cuda.Event() if cuda else None))
    return slots


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
        # read every finished broadcast, oldest first, without waiting
        stop = False
        while self.pending:
            host_in, dev, host_out, event = self.slots[self.pending[0]]
            if event is not None and not event.query():
                break
            self.pending.pop(0)
            stop = stop or int(host_out[0]) == 1
        if stop:
            _stop_all_ranks()
        index = self.step % _SIGTERM_SLOTS
        self.step += 1
        host_in, dev, host_out, event = self.slots[index]
        if index in self.pending:  # the GPU is a whole ring behind: wait for this slot only
            if event is not None:
                event.synchronize()
            self.pending.remove(index)
            if int(host_out[0]) == 1:
                _stop_all_ranks()
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
