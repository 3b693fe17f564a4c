"""A quiet ``pl.Trainer`` for tests: no logger, progress bar, model summary or checkpoints unless asked."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

QUIET = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
}


def quiet_trainer(**kwargs: Any) -> pl.Trainer:
    """``pl.Trainer(**kwargs)`` with ``QUIET``'s settings where ``kwargs`` does not set them."""
    return pl.Trainer(**{**QUIET, **kwargs})
