"""The run's own ceiling: ``ReplayCeiling`` replays a few training steps on a copy of a batch the run just
trained on and puts the training state back; the run's samples/s over that rate is ``gpu/ceiling_frac``.
What a replayed step does, restores and costs: docs/gpu_stats.md."""

from __future__ import annotations

import copy
import itertools
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from lightning_gpuopt._checks import check_int
from lightning_gpuopt._common import synchronize
from lightning_gpuopt.observe.timing import batch_size_of

__all__ = ["CEILING_KEY", "CEILING_RATE_KEY", "Ceiling", "ReplayCeiling", "ceiling_frac"]

#: Key of the run's samples/s over the replayed ceiling's (``GPUStatsMonitor``).
CEILING_KEY = "gpu/ceiling_frac"
#: Key of the replayed ceiling's samples/s.
CEILING_RATE_KEY = "throughput/ceiling_samples_per_sec"


def ceiling_frac(samples_per_sec: float | None, ceiling_per_sec: float | None) -> float | None:
    """``samples_per_sec / ceiling_per_sec``; ``None`` where either is unknown or not positive.

    Example:
        >>> ceiling_frac(620.0, 1000.0)
        0.62
    """
    if not samples_per_sec or not ceiling_per_sec or samples_per_sec <= 0 or ceiling_per_sec <= 0:
        return None
    return samples_per_sec / ceiling_per_sec


@dataclass(frozen=True)
class Ceiling:
    """One replay: ``samples_per_sec`` is the batch size over the median of the timed ``step_ms``."""

    samples_per_sec: float
    step_ms: tuple[float, ...]
    batch_size: int
    seconds: float
    on_device: bool


class _Saved:
    """Everything a replayed step changes, copied (``restore`` puts it back in place)."""

    def __init__(
        self, module: nn.Module, optimizers: Sequence[Any], scaler: Any, device: torch.device
    ) -> None:
        self.params = [p for p in module.parameters()]
        self.buffers = [b for b in module.buffers()]
        states = [v for opt in optimizers for s in opt.state.values() for v in s.values()]
        tensors = (self.params + self.buffers) * 2 + [v for v in states if isinstance(v, torch.Tensor)]
        need = sum(t.numel() * t.element_size() for t in tensors)  # weights and grads, optimizer state
        self.on_device = device.type != "cuda" or torch.cuda.mem_get_info(device)[0] > 2 * need
        where = device if self.on_device else torch.device("cpu")

        def keep(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(where, copy=True)

        with torch.no_grad():
            self.weights = [keep(t) for t in self.params + self.buffers]
            self.grads = [keep(p.grad) if p.grad is not None else None for p in self.params]
            self.opt_state = [
                {
                    p: {k: keep(v) if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in s.items()}
                    for p, s in opt.state.items()
                }
                for opt in optimizers
            ]
        self.optimizers = list(optimizers)
        self.scaler = scaler
        self.scaler_state = scaler.state_dict() if scaler is not None and scaler.is_enabled() else None
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.device = device

    def restore(self) -> None:
        with torch.no_grad():
            for t, saved in zip(self.params + self.buffers, self.weights, strict=True):
                t.copy_(saved)
            for p, g in zip(self.params, self.grads, strict=True):
                p.grad = None if g is None else g.to(p.device)
            for opt, saved_state in zip(self.optimizers, self.opt_state, strict=True):
                for p in [p for p in opt.state if p not in saved_state]:
                    del opt.state[p]  # state the replay created
                for p, s in saved_state.items():
                    live = opt.state[p]
                    for k, v in s.items():
                        cur = live.get(k)
                        if isinstance(v, torch.Tensor) and getattr(cur, "shape", None) == v.shape:
                            cur.copy_(v)
                        else:
                            live[k] = v.to(p.device) if isinstance(v, torch.Tensor) else v
        if self.scaler_state is not None:
            self.scaler.load_state_dict(self.scaler_state)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.device)


@contextmanager
def _no_logging(module: nn.Module) -> Iterator[None]:
    """``module.log`` and ``module.log_dict`` do nothing inside (a replayed step logs nothing)."""
    patched = [name for name in ("log", "log_dict") if callable(getattr(module, name, None))]
    for name in patched:
        setattr(module, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for name in patched:
            module.__dict__.pop(name, None)


class ReplayCeiling:
    """Measure a module's training rate on one batch kept on the device, leaving its training state as it was.

    Args:
        steps: replayed steps timed.
        warmup: replayed steps before the timed ones (not timed).

    Example:
        >>> import lightning.pytorch as pl
        >>> class Tiny(pl.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layer = nn.Linear(4, 1)
        ...     def training_step(self, batch, batch_idx):
        ...         return self.layer(batch).square().mean()
        >>> model = Tiny()
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> before = model.layer.weight.clone()
        >>> c = ReplayCeiling(steps=3, warmup=1).measure(model, [opt], torch.randn(8, 4))
        >>> c.batch_size, len(c.step_ms), torch.equal(model.layer.weight, before)
        (8, 3, True)
    """

    def __init__(self, steps: int = 16, warmup: int = 3) -> None:
        check_int(steps, "steps", low=2, what="(replayed steps timed)")
        check_int(warmup, "warmup", low=0, what="(replayed steps before the timed ones)")
        self.steps = steps
        self.warmup = warmup

    @staticmethod
    def unsupported(module: nn.Module, optimizers: Sequence[Any] | None) -> str | None:
        """Why ``module`` cannot be replayed, else ``None``."""
        if not callable(getattr(module, "training_step", None)):
            return "the module has no training_step to replay"
        if getattr(module, "automatic_optimization", True) is False:
            return "the module optimizes manually (automatic_optimization=False)"
        if not optimizers:
            return "the run has no optimizer"
        return None

    def measure(
        self,
        module: nn.Module,
        optimizers: Sequence[Any],
        batch: Any,
        precision_plugin: Any = None,
        device: torch.device | str = "cpu",
        batch_idx: int = 0,
    ) -> Ceiling | None:
        """Replay ``warmup + steps`` training steps of ``module`` on a copy of ``batch`` (on ``device``), through
        the precision plugin's ``forward_context`` and ``scaler``; ``None`` when a step returned no loss."""
        # a Fabric optimizer steps through the precision plugin itself: the replay steps the one it wraps
        optimizers = [getattr(opt, "optimizer", opt) for opt in optimizers]
        size = batch_size_of(batch)
        dev = torch.device(device)
        scaler = getattr(precision_plugin, "scaler", None)
        forward = getattr(precision_plugin, "forward_context", None)
        t0 = time.perf_counter()
        # a copy whose tensors own their memory: a loader may reuse the buffers it handed out
        batch = apply_to_collection(batch, torch.Tensor, lambda t: t.detach().clone())
        saved = _Saved(module, optimizers, scaler, dev)
        try:
            with _no_logging(module):
                marks: list[Any] = []
                for i in range(self.warmup + self.steps):
                    if i >= self.warmup:
                        marks.append(self._mark(dev))
                    if not self._step(module, optimizers, batch, forward, scaler, batch_idx):
                        return None
                marks.append(self._mark(dev))
                step_ms = self._elapsed(marks, dev)
        finally:
            saved.restore()
        median_ms = statistics.median(step_ms)
        rate = size / (median_ms / 1000.0) if median_ms > 0 and size else 0.0
        return Ceiling(rate, tuple(step_ms), size, time.perf_counter() - t0, saved.on_device)

    @staticmethod
    def _step(module: nn.Module, optimizers: Sequence[Any], batch: Any, forward: Any, scaler: Any,
              batch_idx: int) -> bool:  # fmt: skip
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        with forward() if forward is not None else nullcontext():
            loss = module.training_step(batch, batch_idx)  # type: ignore[operator]
        loss = loss.get("loss") if isinstance(loss, dict) else loss
        if not isinstance(loss, torch.Tensor):
            return False
        if scaler is not None and scaler.is_enabled():
            scaler.scale(loss).backward()
            for opt in optimizers:
                scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            for opt in optimizers:
                opt.step()
        return True

    @staticmethod
    def _mark(device: torch.device) -> Any:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            return event
        return time.perf_counter()

    @staticmethod
    def _elapsed(marks: list[Any], device: torch.device) -> list[float]:
        if device.type == "cuda":
            synchronize(device)
            return [a.elapsed_time(b) for a, b in itertools.pairwise(marks)]
        return [(b - a) * 1000.0 for a, b in itertools.pairwise(marks)]
