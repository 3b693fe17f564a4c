"""What the benchmark scripts, ``lightning-gpuopt bench`` and ``lightning-gpuopt demo`` share.

Every benchmark writes one JSON file shaped the same way (``write_results``) so any reader can compare them,
and measures variants as ratios *in one run* against a ceiling measured in that same run
(``PlainLoop``, the ladder's ceilings). ``fit`` and ``quiet_lightning`` keep a command's output to its own
lines: no Lightning banners, and Ctrl-C reaches the caller as ``KeyboardInterrupt``.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import platform
import shlex
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_gpuopt._common import available_cpus, synchronize
from lightning_gpuopt.compute.optimizer import init_momentum_buffers

ROW_KEYS = ("name", "samples_per_sec", "ratio_to_ceiling", "gpu_util_mean", "data_wait_frac")

# Lightning's and torch's notices that say nothing about the run being measured: which accelerators exist,
# optional packages to install, a small demo dataset, and a torch-internal deprecation inside Lightning
_NOISE = (
    ".*does not have many workers.*",
    ".*Consider setting `persistent_workers=True`.*",
    ".*no `val_dataloader`.*",
    ".*smaller than the logging interval.*",
    ".*log_every_n_steps.*",
    ".*Total length of .* across ranks is zero.*",
    ".*LeafSpec.* is deprecated.*",
)


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Silence Lightning's banners ("GPU available", tips, model summary notes) and notices that do not
    concern the measurement, for the duration of the block; the logger level and warning filters are
    restored afterwards. Warnings about the run itself still show."""
    log = logging.getLogger("lightning.pytorch")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            for pattern in _NOISE:
                warnings.filterwarnings("ignore", message=pattern)
            yield
    finally:
        log.setLevel(level)


def fit(trainer: pl.Trainer, model: pl.LightningModule, **kwargs: Any) -> None:
    """``trainer.fit(model, **kwargs)``, with Ctrl-C raised to the caller as ``KeyboardInterrupt``.

    Lightning turns a Ctrl-C inside ``fit`` into ``sys.exit(1)`` after its graceful shutdown and leaves SIGINT
    ignored; a command then could neither tell an interruption from a failure nor be interrupted again. This
    restores the SIGINT handler and re-raises the interruption as what it is.
    """
    handler = signal.getsignal(signal.SIGINT)
    try:
        trainer.fit(model, **kwargs)
    except SystemExit:
        if trainer.interrupted:
            raise KeyboardInterrupt from None
        raise
    finally:
        if handler is not None and signal.getsignal(signal.SIGINT) != handler:
            with contextlib.suppress(ValueError):  # not the main thread: nothing was changed there
                signal.signal(signal.SIGINT, handler)


def machine_info() -> dict[str, Any]:
    """GPU name, driver, torch/lightning/CUDA versions and the CPUs this process may use."""
    import lightning

    info: dict[str, Any] = {
        "gpu": None,
        "gpu_count": 0,
        "driver": None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "lightning": lightning.__version__,
        "python": platform.python_version(),
        "cpus": available_cpus(),
        "platform": platform.platform(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        try:
            import pynvml

            pynvml.nvmlInit()
            info["driver"] = pynvml.nvmlSystemGetDriverVersion()
            pynvml.nvmlShutdown()
        except Exception:  # driver version is informative only
            info["driver"] = None
    return info


def command_line() -> str:
    """The command that is running, for the results file."""
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])


def write_results(path: str | os.PathLike[str], rows: Sequence[dict[str, Any]], **extra: Any) -> Path:
    """Write ``{"machine", "command", "date", "rows", **extra}`` as JSON; missing row keys become null.
    ``machine`` defaults to this one's (``machine_info``); a file merged from other machines' runs passes
    theirs."""
    full_rows = [{**{k: None for k in ROW_KEYS}, **row} for row in rows]
    doc = {
        "machine": extra.pop("machine", None) or machine_info(),
        "command": extra.pop("command", command_line()),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "rows": full_rows,
        **extra,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return path


class PlainLoop:
    """A plain PyTorch training loop on one batch already on the device, stepped by the caller: the ceilings.

    ``bench.steady.measure_loop(loop.step, ...)`` measures it; the ladder
    times its warm-up steps one by one (``timed_step``) to see when a compiled model's steps have become fast.

    Args:
        model: the model (moved to ``device``; trained in place).
        dtype: autocast dtype (``torch.float16`` uses a GradScaler), or ``None`` for full fp32/TF32.
        channels_last: convert model and batch to channels_last.
        fused: fused SGD (no per-step host sync under a GradScaler); ``None``: fused on CUDA, as
            ``ImageClassifier`` does, so the ceiling and the fed runs use the same optimizer.
        label_sets: the resident batch's labels cycle through this many random label tensors, so the loss
            does not collapse to zero as it would on one fixed batch (whose vanishing gradients are not the
            work a real step does).
        compile: run the model through ``torch.compile(model, dynamic=False)`` (inductor); the first steps
            compile it.

    Example:
        >>> from lightning_gpuopt.bench.models import build_model
        >>> loop = PlainLoop(build_model("small", 10), batch_size=8, image_size=32, dtype=None, device="cpu",
        ...                  num_classes=10)
        >>> loop.timed_step() > 0
        True
    """

    def __init__(
        self,
        model: nn.Module,
        batch_size: int,
        image_size: int = 224,
        num_classes: int = 1000,
        dtype: torch.dtype | None = torch.float16,
        channels_last: bool = True,
        device: str | torch.device = "cuda",
        lr: float = 0.01,
        fused: bool | None = None,
        label_sets: int = 1,
        compile: bool = False,
    ) -> None:
        self.device = device = torch.device(device)
        self.batch_size = batch_size
        self.dtype = dtype
        mf = torch.channels_last if channels_last else torch.contiguous_format
        model = model.to(device).to(memory_format=mf)  # type: ignore[call-overload]
        model.train()
        self.model: Callable[[torch.Tensor], torch.Tensor] = (
            torch.compile(model, dynamic=False) if compile else model
        )
        self.x = torch.randn(batch_size, 3, image_size, image_size, device=device).contiguous(
            memory_format=mf
        )
        self.ys = [
            torch.randint(0, num_classes, (batch_size,), device=device) for _ in range(max(1, label_sets))
        ]
        fused = device.type == "cuda" if fused is None else fused
        self.opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, fused=fused or None)
        init_momentum_buffers(self.opt)  # a first step the GradScaler skips keeps zero momentum
        self.scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        self.loss_fn = nn.CrossEntropyLoss()
        self._count = 0

    def step(self) -> None:
        """One training step (asynchronous on CUDA)."""
        xb, yb = self.x, self.ys[self._count % len(self.ys)]
        self._count += 1
        self.opt.zero_grad(set_to_none=True)
        dtype = self.dtype
        with torch.autocast(self.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = self.loss_fn(self.model(xb), yb)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()

    def timed_step(self) -> float:
        """Seconds of one step, the device synchronised before and after it."""
        synchronize(self.device)
        t0 = time.perf_counter()
        self.step()
        synchronize(self.device)
        return time.perf_counter() - t0


def cpu_seconds() -> float:
    """CPU seconds this process and its live children (loader workers) have used so far (psutil)."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += sum(child.cpu_times()[:2])
    return total
