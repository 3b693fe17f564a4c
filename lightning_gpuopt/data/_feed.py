"""What an ``OptimizedDataModule`` says about each split's feed, and whether its training loader stages.

``feed_line`` is the one line a split gets (rank zero): what reads it, each count (DataLoader worker
processes, a raw store's reading threads, DALI's threads and decoder) with how it was chosen ("set by you",
"measured ...", "chosen from N cores a process, not measured", "derived from ..."), and for training whether
batches are staged on the GPU ahead of the step. ``overridden_batch_hooks`` finds the batch hooks of the
user's (Lightning's ``DataHooks``) that would see staged batches: where there is one, the training loader
does not stage, so each hook sees what Lightning's docs describe.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from lightning_gpuopt._common import available_cpus

#: Lightning's batch hooks a DataModule shares with the LightningModule (``DataHooks``): overridden, they run
#: on Lightning's path, so the training loader does not stage batches ahead of them.
TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


def overridden_batch_hooks(dm: pl.LightningDataModule, base: type) -> list[str]:
    """The batch hooks Lightning will call on ``dm``'s batches that are not ``base``'s (the package's
    DataModule class): ``dm``'s class's overrides of ``TRANSFER_HOOKS``, and its LightningModule's where the
    DataModule leaves the hook to it (Lightning calls a DataModule's hook when it overrides
    ``LightningDataModule``'s, else the module's).

    Example:
        >>> overridden_batch_hooks(MyData(), OptimizedDataModule)  # doctest: +SKIP
        ['MyData.on_before_batch_transfer']
    """
    found = [
        f"{type(dm).__name__}.{h}" for h in TRANSFER_HOOKS if getattr(type(dm), h) is not getattr(base, h)
    ]
    model = dm.trainer.lightning_module if dm.trainer is not None else None
    if model is None:
        return found
    for hook in TRANSFER_HOOKS:
        left = getattr(type(dm), hook) is getattr(pl.LightningDataModule, hook)
        if left and getattr(type(model), hook) is not getattr(pl.LightningModule, hook):
            found.append(f"{type(model).__name__}.{hook}")
    return found


def staging(loader: Any, hooks: list[str]) -> str:
    """Whether the training ``loader`` stages its batches on the GPU, and why not where it does not."""
    from lightning_gpuopt.data.loader import ContinuousDataLoader

    if not isinstance(loader, ContinuousDataLoader):
        return "not staged (not this package's training loader)"
    if loader.device_transform is None:
        return f"not staged: {', '.join(hooks)} overridden, so Lightning's batch hooks see each host batch"
    if not (loader.pin_memory and torch.cuda.is_available()):
        return "not staged: no CUDA device (Lightning's batch hooks see each host batch)"
    return "staged on the GPU ahead of each step (copied and augmented on a side stream)"


def feed_line(
    split: str, loader: Any, how: dict[str, str], *, hooks: list[str], dali: Any, processes: int
) -> str | None:
    """The setup line of ``split``'s ``loader`` (``None``: a loader that does not describe its feed);
    ``how`` says how each count of the DataModule's was chosen, ``hooks`` are the batch hooks of the user's
    (``overridden_batch_hooks``), ``dali`` the DataModule's ``DALIOptions``, ``processes`` the training
    processes of the node."""
    info = getattr(loader, "feed_info", None)
    if info is None:
        return None
    if info.host_batches is False:  # DALI: decoded on its threads or by nvJPEG, made on the device
        cpus = max(1, available_cpus() // max(1, processes))
        threads = "set by you: DALIOptions(threads=...)" if dali is not None and dali.threads else (
            f"chosen from {cpus} cores a process, not measured"
        )  # fmt: skip
        parts = [
            f"DALI, decoder={info.decoder!r} ({getattr(info, 'decoder_reason', None) or 'set'})",
            f"threads={info.threads} ({threads})",
            "no DataLoader worker processes; batches made on the device",
        ]
    else:
        dataset = getattr(loader, "dataset", None)
        source = {"folder": "image folder", "hdf5": "HDF5 store"}.get(info.backend or "", "")
        parts = [
            source or f"{type(dataset).__name__} (a dataset of yours)",
            f"num_workers={getattr(loader, 'num_workers', 0)} ({how.get('num_workers', 'set')})",
        ]
        if getattr(loader, "read_threads", 0):
            parts.append(f"reading threads={loader.read_threads} ({how.get('threads', 'set')})")
    if split == "train" and info.host_batches is not False:
        parts.append(staging(loader, hooks))
    return f"OptimizedDataModule: {split}: " + "; ".join(parts)
