"""What the benchmark scripts and the two commands share: one results JSON shape (``write_results``), the
plain-loop ceiling (``PlainLoop``), and fits whose output is the command's own (``fit``, ``quiet_lightning``).
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
    """Silence Lightning's banners and the notices that do not concern the measurement, inside the block."""
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
    """``trainer.fit(model, **kwargs)``, with Ctrl-C raised to the caller as ``KeyboardInterrupt`` (Lightning
    turns it into ``sys.exit(1)`` and leaves SIGINT ignored; the handler is restored)."""
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
    """Write ``{"machine", "command", "date", "rows", **extra}`` as JSON; missing ``ROW_KEYS`` become null and
    ``machine`` defaults to this one's."""
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
    """A plain PyTorch training loop on one channels_last batch already on the device (the ceilings): SGD
    with momentum (fused on CUDA, as ``ImageClassifier``'s), autocast to ``dtype`` (``torch.float16`` with a
    GradScaler; ``None``: fp32), the labels cycling through ``label_sets`` random sets so that the loss does not
    collapse, and ``compile``: ``torch.compile(model, dynamic=False)``, compiled by the first steps.

    Example:
        >>> from lightning_gpuopt.bench.models import build_model
        >>> loop = PlainLoop(build_model("small", 10), batch_size=8, image_size=32, dtype=None, device="cpu")
        >>> loop.timed_step() > 0
        True
    """

    def __init__(
        self,
        model: nn.Module,
        batch_size: int,
        image_size: int = 224,
        num_classes: int = 10,
        dtype: torch.dtype | None = torch.float16,
        device: str | torch.device = "cuda",
        lr: float = 0.01,
        label_sets: int = 1,
        compile: bool = False,
    ) -> None:
        self.device = device = torch.device(device)
        self.dtype = dtype
        model = model.to(device).to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        model.train()
        self.model: Callable[[torch.Tensor], torch.Tensor] = (
            torch.compile(model, dynamic=False) if compile else model
        )
        x = torch.randn(batch_size, 3, image_size, image_size, device=device)
        self.x = x.contiguous(memory_format=torch.channels_last)
        self.ys = [
            torch.randint(0, num_classes, (batch_size,), device=device) for _ in range(max(1, label_sets))
        ]
        fused = device.type == "cuda" or None
        self.opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, fused=fused)
        init_momentum_buffers(self.opt)  # a first step the GradScaler skips keeps zero momentum
        self.scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
        self._count = 0

    def step(self) -> None:
        """One training step (asynchronous on CUDA)."""
        yb = self.ys[self._count % len(self.ys)]
        self._count += 1
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(
            self.device.type, dtype=self.dtype or torch.float32, enabled=self.dtype is not None
        ):
            loss = nn.functional.cross_entropy(self.model(self.x), yb)
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
