"""``StreamPriority``: train on a high-priority CUDA stream, so pipeline work on the same GPU yields to it.

When something else runs kernels on the training GPU at the same time -- DALI decoding and augmenting the
next batches (``OptimizedDataModule(backend="dali")``), or ``ContinuousDataLoader`` augmenting the next
batch on its side stream -- the GPU's block scheduler shares the SMs between the two streams. Stream
priorities are a hint to that scheduler: when both streams have blocks waiting, the higher priority's go
first (running blocks are not preempted). Putting the model on a high-priority stream lets the pipeline fill
the gaps instead of slowing every layer a little.

Measured on one H200 (``benchmarks/results/dali_h200.json``, ResNet-50 16-mixed + channels_last, batch 256,
DALI decoding 500x375 JPEGs on the same GPU, ratios to the plain loop on a resident batch in the same run):
the model beside a DALI pipeline whose batches are discarded 0.907 -> 0.940 with the model on a high-priority
stream; Lightning fed by DALI 0.868 / 0.897 (two runs) -> 0.918. Where the SMs have little pipeline work to
give back it did not help: DALI with every JPEG on the hardware decoder 0.911 -> 0.903
(``session2/dali_focus_h200.json``), JPEGs decoded on the CPU (``decoder="cpu"``) 0.951 -> 0.924
(``session3_run1/dali_focus_h200.json``).

Lightning runs the whole fit on the thread's current stream; this callback makes a new stream of the
requested priority current on the root device in ``setup`` (after waiting for the work already queued on
the previous one) and restores the previous stream at ``teardown`` or on an exception, after making it wait
for the fit's work. On a CPU run it warns once and steps aside.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import WarningCache

__all__ = ["StreamPriority"]

_warning_cache = WarningCache()


def priority_range() -> tuple[int, int]:
    """``(lowest, highest)`` CUDA stream priorities of this build (numerically: highest is the smaller)."""
    query = getattr(torch.cuda.Stream, "priority_range", None)  # a static method; absent on CPU builds
    if query is None:
        return 0, -1
    lo, hi = query()
    return int(lo), int(hi)


class StreamPriority(pl.Callback):
    """Run the fit (training, validation, batch transfers) on a CUDA stream of high priority.

    Args:
        priority: ``"high"`` (the highest priority this CUDA build offers, ``torch.cuda.Stream.priority_range``),
            or an int in CUDA's convention: lower is higher, ``0`` the default; out-of-range values are clamped
            by CUDA.

    Use it when data-pipeline kernels share the GPU with the model (DALI's GPU decoding, GPU augmentation on a
    side stream). It does not make the model's own kernels faster.
    """

    def __init__(self, priority: int | str = "high") -> None:
        if isinstance(priority, bool) or not isinstance(priority, (int, str)):
            raise TypeError(f"priority must be 'high' or an int, got {priority!r}")
        if isinstance(priority, str) and priority != "high":
            raise ValueError(
                f"priority must be 'high' or an int (lower is higher, 0 = default), got {priority!r}"
            )
        self.priority = priority
        self.active = False
        self.stream_priority: int | None = None
        self._stream: torch.cuda.Stream | None = None
        self._previous: torch.cuda.Stream | None = None

    def _resolve(self) -> int:
        if self.priority == "high":
            return priority_range()[1]
        return int(self.priority)

    # --- hooks -------------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        device = trainer.strategy.root_device
        if device.type != "cuda":
            _warning_cache.warn(
                f"StreamPriority: stream priorities exist on CUDA devices only; on {device.type!r} the callback "
                "does nothing. Remove it to silence this warning."
            )
            return
        if self.active:  # a second setup (e.g. fit then test on one Trainer) keeps the stream it made
            return
        previous = torch.cuda.current_stream(device)
        stream = torch.cuda.Stream(device, priority=self._resolve())
        stream.wait_stream(previous)  # whatever was queued before the fit runs first
        torch.cuda.set_stream(stream)
        self._previous, self._stream = previous, stream
        self.stream_priority = int(stream.priority)
        self.active = True

    def _restore(self) -> None:
        if not self.active or self._stream is None or self._previous is None:
            return
        self._previous.wait_stream(self._stream)  # later work on the old stream sees the fit's results
        torch.cuda.set_stream(self._previous)
        self.active = False
        self._stream = self._previous = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._restore()

    def state_dict(self) -> dict[str, Any]:
        """Nothing to resume: the stream is made again by ``setup``; the setting is reported for the record."""
        return {"priority": self.priority}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(priority={self.priority!r})"
