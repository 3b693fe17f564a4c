"""``ReleasingCallback``: a callback that releases what it acquired when fit ends, also when it raised."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

__all__ = ["ReleasingCallback"]


class ReleasingCallback(Callback):
    """Calls ``_release()`` at ``teardown`` and at ``on_exception``.

    Lightning 2.x calls ``on_exception`` but not the callbacks' ``teardown`` when fit raises (also on
    ``KeyboardInterrupt``), so both hooks release. ``_release`` must be safe to call more than once.
    """

    def _release(self) -> None:
        """Free what ``setup`` acquired (threads, NVML handles, CUDA events, hooks)."""

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._release()
