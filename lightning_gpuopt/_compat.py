"""The private torch internals the package relies on, each behind one function, probed once.

Everything else in the package uses public torch and Lightning API only. ``missing_internals()`` lists the
internals this torch lacks; ``tests/test_compat.py`` fails when it is not empty, so a torch release that
renames one is noticed before a user is. Where an internal is missing at run time, the function falls
back to public behaviour (slower or less precise, never wrong) and warns once naming the torch version.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_gpuopt._common import warn_once

#: torch releases these internals were checked against (``tests/test_compat.py`` checks the installed one).
TESTED_TORCH = ">=2.4,<2.14"

# (owner, attribute): what each is used for
_INTERNALS: dict[tuple[str, str], str] = {
    ("torch.utils.data.DataLoader", "_index_sampler"): "ContinuousDataLoader repeats the batch sampler",
    ("torch.utils.data.DataLoader", "_auto_collation"): "ContinuousDataLoader repeats the batch sampler",
    ("torch.utils.data.DataLoader", "_iterator"): "ContinuousDataLoader.close() drops the persistent workers",
    ("torch.utils.data.dataloader._MultiProcessingDataLoaderIter", "_shutdown_workers"): (
        "worker tuning stops each candidate's workers at once"
    ),
    ("torch.UntypedStorage", "_new_shared"): "the uint8 collate allocates batches in shared memory",
    ("torch.optim.SGD", "_step_supports_amp_scaling"): "GradScaler skips its host sync for fused optimizers",
    ("torch.cpu", "_is_avx512_bf16_supported"): "bf16 is chosen on CPUs with native bf16",
}


def _resolve(owner: str) -> Any:
    import importlib

    parts = owner.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(owner)


def _has(owner: str, attribute: str) -> bool:
    try:
        target = _resolve(owner)
    except (ImportError, AttributeError):
        return False
    if attribute == "_step_supports_amp_scaling":
        # set on instances in __init__ (fused=True); the class itself does not carry it
        return "_step_supports_amp_scaling" in _source_of(target)
    if attribute in ("_iterator", "_auto_collation") and isinstance(target, type):
        return attribute in _source_of(target) or hasattr(target, attribute)
    return hasattr(target, attribute)


def _source_of(obj: Any) -> str:
    import inspect

    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def missing_internals() -> list[str]:
    """``owner.attribute`` of every relied-on internal this torch lacks (empty on a tested torch)."""
    return [f"{owner}.{attr}" for (owner, attr) in _INTERNALS if not _has(owner, attr)]


def _fallback(what: str) -> None:
    warn_once(
        f"lightning-gpuopt: this torch ({torch.__version__}) lacks {what}; falling back to slower public "
        f"behaviour. lightning-gpuopt was checked against torch {TESTED_TORCH}."
    )


def repeat_index_sampler(loader: DataLoader, wrap: Any) -> Any:
    """The index sampler ``loader``'s iterators should read: ``wrap(batch_sampler)`` under automatic
    batching, else DataLoader's own. Called from a ``DataLoader`` subclass's ``_index_sampler``."""
    sampler = DataLoader._index_sampler.fget(loader)  # type: ignore[attr-defined]
    if getattr(loader, "_auto_collation", False) and sampler is loader.batch_sampler:
        return wrap(sampler)
    return sampler


def persistent_iterator(loader: DataLoader) -> Any:
    """The iterator ``persistent_workers=True`` keeps alive between epochs, or ``None``."""
    return getattr(loader, "_iterator", None)


def drop_persistent_iterator(loader: DataLoader) -> None:
    """Drop the iterator ``persistent_workers=True`` keeps, so its workers shut down and the next
    ``iter()`` starts afresh."""
    if hasattr(loader, "_iterator"):
        loader._iterator = None  # type: ignore[attr-defined]


def shutdown_workers(iterator: Any) -> None:
    """Stop a multi-process DataLoader iterator's workers now rather than at garbage collection."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()


def shared_uint8(numel: int) -> torch.Tensor:
    """A flat uint8 tensor in shared memory (as ``default_collate`` allocates inside a worker), so a batch
    reaches the main process without another copy; ordinary memory where torch lacks the call."""
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
    if new_shared is None:
        _fallback("UntypedStorage._new_shared (batches are copied once more)")
        return torch.empty(numel, dtype=torch.uint8)
    return torch.empty(0, dtype=torch.uint8).set_(new_shared(numel))


def supports_amp_scaling(optimizer: Any) -> bool:
    """Whether ``GradScaler.step`` hands the scale to ``optimizer`` (fused kernels) instead of reading
    ``found_inf`` on the host: the attribute ``GradScaler`` itself checks."""
    inner = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer wraps the torch optimizer
    return bool(getattr(inner, "_step_supports_amp_scaling", False))


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX); ``False`` where torch cannot tell."""
    probes = [
        getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    ]
    return any(bool(p()) for p in probes if callable(p))


_INTERNALS[
    ("lightning.pytorch.loops.training_epoch_loop._TrainingEpochLoop", "_broadcast_sigterm_tensor")
] = "under DDP the SIGTERM check runs every step without blocking the host"

_INTERNALS[("multiprocessing.process._current_process", "_config")] = (
    "a DataLoader worker ending on SIGTERM removes the temporary folder multiprocessing made for it"
)


def multiprocessing_tempdir() -> str | None:
    """The ``pymp-*`` folder ``multiprocessing`` made for this process (or inherited), else ``None``."""
    import multiprocessing

    config = getattr(multiprocessing.current_process(), "_config", None)
    return config.get("tempdir") if isinstance(config, dict) else None


_SIGTERM_SLOTS = 4


def nonblocking_sigterm_check(trainer: Any) -> bool:
    """Make Lightning's per-step SIGTERM check of ``trainer`` stop blocking the host.

    Under DDP, Lightning's training loop broadcasts rank zero's SIGTERM flag at the start of every step and
    reads it back with ``.item()``: a host-device synchronisation each step, so the host cannot queue the next
    step while the GPU runs the current one, and every rank waits for the slowest at that point. This
    replacement still broadcasts the flag every step (every rank issues the same collectives in the same
    order), into one of a few reused device/pinned-host buffers, and reads each result once its copy has
    completed, without waiting: a SIGTERM stops all ranks a step or two later than before. Only this trainer's
    loop is changed.

    Returns:
        Whether the check was replaced (``False`` where this Lightning lacks the loop method: nothing changes).
    """
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if loop is None or not callable(getattr(type(loop), "_broadcast_sigterm_tensor", None)):
        _fallback("Lightning's _TrainingEpochLoop._broadcast_sigterm_tensor (DDP keeps a host sync per step)")
        return False
    loop._broadcast_sigterm_tensor = _NonBlockingSigterm(trainer)
    return True


def _sigterm_slots(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]]:
    cuda = device.type == "cuda"
    slots = []
    for _ in range(_SIGTERM_SLOTS):
        host_in = torch.zeros(1, dtype=torch.int32, pin_memory=cuda)
        host_out = torch.zeros(1, dtype=torch.int32, pin_memory=cuda)
        dev = torch.zeros(1, dtype=torch.int32, device=device)
        slots.append((host_in, dev, host_out, torch.cuda.Event() if cuda else None))
    return slots


class _NonBlockingSigterm:
    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.slots: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]] | None = None
        self.step = 0
        self.pending: list[int] = []

    def __call__(self) -> None:
        import contextlib

        import torch.distributed as dist
        from lightning.pytorch.utilities.exceptions import SIGTERMException

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
            with contextlib.suppress(Exception):
                dist.barrier()
            raise SIGTERMException()
        index = self.step % _SIGTERM_SLOTS
        self.step += 1
        host_in, dev, host_out, event = self.slots[index]
        if index in self.pending:  # the GPU is a whole ring behind: wait for this slot only
            if event is not None:
                event.synchronize()
            self.pending.remove(index)
            if int(host_out[0]) == 1:
                with contextlib.suppress(Exception):
                    dist.barrier()
                raise SIGTERMException()
        host_in[0] = 1 if getattr(self.trainer, "received_sigterm", False) else 0
        dev.copy_(host_in, non_blocking=True)
        dist.broadcast(dev, src=0)
        host_out.copy_(dev, non_blocking=True)
        if event is not None:
            event.record()
        self.pending.append(index)
