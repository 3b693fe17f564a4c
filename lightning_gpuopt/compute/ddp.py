"""``NonBlockingStepChecks``: DDP training steps that never make the host wait for the GPU.

Under DDP, Lightning's training loop broadcasts rank zero's SIGTERM flag at the start of every step and reads
it back on the host, a host-device synchronisation per step: the host cannot queue step ``k + 1`` while the
GPU runs step ``k``, so each step's launch time shows as GPU idle time and every rank waits for the slowest
at that point. ``nonblocking_sigterm_check`` keeps the check (every rank still broadcasts every step) but
reads each result once it has arrived, without waiting; a SIGTERM then stops all ranks one or two steps
later. The callback applies it to a fit; on one device it does nothing. ``fast_trainer_kwargs`` adds it.
"""

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
    """Make Lightning's per-step SIGTERM check of ``trainer`` stop blocking the host.

    Lightning broadcasts rank zero's SIGTERM flag at the start of every step and reads it back with
    ``.item()``. The replacement still broadcasts the flag every step (every rank issues the same collectives
    in the same order), into one of a few reused device/pinned-host buffers, and reads each result once its
    copy has completed, without waiting: a SIGTERM stops all ranks a step or two later than before. Only this
    trainer's loop is changed. Lightning's SIGTERM handler then issues no broadcast of its own (one issued
    from a signal handler, mid-step, can meet the other rank inside the gradient all-reduce and hang the
    run); it still forwards the signal to the launched ranks and sets the flag the check broadcasts.

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
    """Remove the per-step host synchronisation of Lightning's DDP training loop.

    At ``on_train_start`` of a run on more than one device, ``nonblocking_sigterm_check`` replaces the
    trainer's per-step SIGTERM check.

    Attributes:
        active: whether the check was replaced in the current (or last) fit.

    Logs nothing.

    Example::

        trainer = Trainer(devices=2, strategy="ddp", callbacks=[NonBlockingStepChecks()])
    """

    def __init__(self) -> None:
        self.active = False

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.active = trainer.world_size > 1 and nonblocking_sigterm_check(trainer)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {}
