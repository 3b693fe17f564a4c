"""``FabricObserver``: ``GPUStatsMonitor``, ``BottleneckAdvisor`` and ``NVTXRanges`` in a Lightning Fabric loop."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import SimpleNamespace
from typing import Any

from torch import nn

from lightning_gpuopt._checks import check_arg, check_int
from lightning_gpuopt.data.loader import timed_batches
from lightning_gpuopt.observe._lifecycle import FabricLoop
from lightning_gpuopt.observe.advisor.callback import BottleneckAdvisor
from lightning_gpuopt.observe.gpu_stats import GPUStatsMonitor
from lightning_gpuopt.observe.nvtx import NVTXRanges

__all__ = ["FabricLoop", "FabricObserver"]

_KINDS = (GPUStatsMonitor, BottleneckAdvisor, NVTXRanges)


class FabricObserver:
    """Run ``GPUStatsMonitor``, ``BottleneckAdvisor`` and ``NVTXRanges`` in a Lightning Fabric training loop.

    Register it with Fabric (``Fabric(callbacks=[observer])``), call ``on_train_start``,
    ``on_train_batch_start``, ``on_train_batch_end`` and ``on_train_end`` through ``fabric.call`` where the
    loop is, and iterate the training loader through ``timed`` (which times the wait inside its ``next()``).
    The whole loop, what the other hooks add and how steps are counted: docs/fabric.md. Rows go to
    ``fabric.log_dict(metrics, step=step - 1)``.

    Args:
        *observers: at most one each of ``GPUStatsMonitor``, ``BottleneckAdvisor`` and ``NVTXRanges``. Their
            results are read on them as under a Trainer (``monitor.history``, ``advisor.verdicts``).

    Example:
        >>> from lightning_gpuopt import BottleneckAdvisor, GPUStatsMonitor
        >>> monitor, advisor = GPUStatsMonitor(log_every_n_steps=20), BottleneckAdvisor()
        >>> observer = FabricObserver(monitor, advisor)
        >>> fabric = Fabric(loggers=CSVLogger("logs"), callbacks=[observer])  # doctest: +SKIP
        >>> fabric.call("on_train_start", fabric=fabric, model=model, optimizers=optimizer)  # doctest: +SKIP
        >>> for batch in observer.timed(loader):  # doctest: +SKIP
        ...     fabric.call("on_train_batch_start", batch=batch)
        ...     train_step(batch)
        ...     fabric.call("on_train_batch_end", batch=batch)
        >>> fabric.call("on_train_end")  # doctest: +SKIP
        >>> [v.label for v in advisor.verdicts]  # after training  # doctest: +SKIP
        ['input-bound (too-few-workers)']
    """

    def __init__(self, *observers: GPUStatsMonitor | BottleneckAdvisor | NVTXRanges) -> None:
        seen: dict[type, Any] = {}
        what, must = (
            "FabricObserver's observers",
            "GPUStatsMonitor, BottleneckAdvisor or NVTXRanges instances",
        )
        for obs in observers:
            kind, name = next((k for k in _KINDS if isinstance(obs, k)), None), type(obs).__name__
            fix = "e.g. FabricObserver(GPUStatsMonitor(), BottleneckAdvisor())"
            check_arg(kind is not None, what, name, must, fix=fix, error=TypeError)
            fix = "use one FabricObserver per monitor"
            check_arg(kind not in seen, what, f"two {name}", "at most one of each kind", fix=fix)
            seen[kind] = obs  # type: ignore[index]
        self.monitor: GPUStatsMonitor | None = seen.get(GPUStatsMonitor)
        self.advisor: BottleneckAdvisor | None = seen.get(BottleneckAdvisor)
        self.ranges: NVTXRanges | None = seen.get(NVTXRanges)
        # events that start something reach the monitor first (the advisor reads its windows), events that end
        # something close the NVTX ranges first
        self._starts = [o for o in (self.monitor, self.advisor, self.ranges) if o is not None]
        self._ends = [o for o in (self.ranges, self.monitor, self.advisor) if o is not None]
        #: the running loop between ``on_train_start`` and ``on_train_end`` (None outside)
        self.loop: FabricLoop | None = None
        self._timed: dict[int, SimpleNamespace] = {}  # loaders iterated through timed, by id

    def _running(self, hook: str) -> FabricLoop:
        loop = self.loop
        if loop is None:
            raise RuntimeError(
                f"FabricObserver.{hook} was called before on_train_start; call "
                "on_train_start(fabric, model, optimizers) once before the first batch"
            )
        return loop

    def _each(self, event: str, *args: Any, hook: str = "", ends: bool = False) -> None:
        """Call ``event(loop, *args)`` on every observer; with ``hook``, outside training is an error."""
        loop = self._running(hook) if hook else self.loop
        if loop is None:
            return
        for obs in self._ends if ends else self._starts:
            getattr(obs, event)(loop, *args)

    def on_train_start(self, fabric: Any, model: nn.Module, optimizers: Any = None) -> None:
        """Training starts: acquire what the observers need; the first data wait counts from here.

        Args:
            fabric: the ``lightning.fabric.Fabric`` running the loop (launched).
            model: the model being trained (as ``fabric.setup`` returned it, or the module itself).
            optimizers: the optimizer, or a list of them (for the advisor's mixed-precision checks).
        """
        from lightning.fabric import Fabric

        must = "the lightning.fabric.Fabric running the loop"
        fix = "fabric.call('on_train_start', fabric=fabric, model=model, optimizers=optimizer)"
        check_arg(isinstance(fabric, Fabric), "fabric", type(fabric).__name__, must, fix=fix, error=TypeError)
        must, fix = "the torch.nn.Module being trained", "pass the model fabric.setup returned"
        check_arg(isinstance(model, nn.Module), "model", type(model).__name__, must, fix=fix, error=TypeError)
        if optimizers is not None and not isinstance(optimizers, (list, tuple)):
            optimizers = [optimizers]
        if self.loop is not None:  # a loop that ended without on_train_end
            self._release()
        self._timed = {}  # a new run counts its loaders' time from zero
        self.loop = FabricLoop(fabric, model, optimizers, self._timed, self._starts)
        try:
            self._each("_begin")
            self._each("_start")
        except BaseException:
            self._release()
            raise
        self.on_train_epoch_start()

    def timed(self, loader: Any) -> Iterator[Any]:
        """Iterate ``loader`` (as ``fabric.setup_dataloaders`` returned it) for one epoch, timing its ``next()``.

        Call it after ``on_train_start``, once an epoch: ``for batch in observer.timed(loader)``.
        """
        loop = self._running("timed")
        timed = self._timed.get(id(loader))
        if timed is None or timed.loader is not loader:
            timed = self._timed[id(loader)] = SimpleNamespace(loader=loader, fetch_seconds=0.0)
            if self.monitor is not None:
                self.monitor._read_loader_wait(loop)  # its time inside next() counts from here
            if self.advisor is not None and self.advisor._batches == 0:
                self.advisor._fit_epochs(loop.batches_per_epoch)  # the epoch's length is known from here
        self.on_train_epoch_start()
        yield from timed_batches(timed, iter(loader))

    def on_train_epoch_start(self) -> None:
        """The next batch's data wait counts from now (an epoch starts after other work)."""
        self._each("_epoch_start", hook="on_train_epoch_start")

    def on_train_batch_start(self, batch: Any) -> None:
        """A training step starts; ``batch`` is the batch it trains on (already on the device)."""
        self._each("_batch_start", batch, hook="on_train_batch_start")

    def on_before_zero_grad(self) -> None:
        """NVTX: the step's "zero_grad" phase starts."""
        self._each("_phase", "zero_grad")

    def on_before_backward(self) -> None:
        """NVTX: the step's "backward" phase starts."""
        self._each("_phase", "backward")

    def on_after_backward(self) -> None:
        """Backward returned (under DDP, after the gradient all-reduce): NVTX phase end, all-reduce timing."""
        self._each("_after_backward", ends=True)

    def on_before_optimizer_step(self) -> None:
        """NVTX: the step's "optimizer step" phase starts."""
        self._each("_phase", "optimizer step")

    def on_train_batch_end(self, batch: Any, step: int | None = None) -> None:
        """The training step has queued its work; a window that ends here is logged.

        Args:
            batch: the batch the step trained on (its leading dimension counts the samples).
            step: optimizer steps taken so far, this one included; ``None`` counts one step a batch. Pass it
                under gradient accumulation (it then stays the same for the batches of one step).
        """
        loop = self._running("on_train_batch_end")
        check_int(step, "step", low=0, none_ok=True, what="(optimizer steps taken so far)")
        loop.step = loop.step + 1 if step is None else step
        self._each("_batch_end", batch, hook="on_train_batch_end", ends=True)

    def on_train_end(self) -> None:
        """Training ends: the last window is logged, the advisor prints its summary, everything is released."""
        self._running("on_train_end")
        try:
            self._each("_end", ends=True)
        finally:
            self._release()

    def on_exception(self, exception: BaseException | None = None) -> None:
        """The loop raised: release everything (threads, CUDA events, hooks, open ranges), log nothing more."""
        self._release()

    # outside training (between on_train_end and the next on_train_start) these do nothing
    def on_validation_start(self) -> None:
        """A validation run inside training starts (NVTX "validation"; its time is not data wait)."""
        self._each("_validation_start")

    def on_validation_batch_start(self, batch_idx: int) -> None:
        """NVTX: "validation step {batch_idx}" starts."""
        self._each("_validation_batch_start", batch_idx)

    def on_validation_batch_end(self) -> None:
        self._each("_validation_batch_end", ends=True)

    def on_validation_end(self) -> None:
        """The validation run ends; the next batch's data wait counts from now."""
        self._each("_validation_end", True, ends=True)

    def _release(self) -> None:
        self.loop = None
        for obs in self._ends:
            obs._release()

    def state_dict(self) -> dict[str, Any]:
        """The step count and each observer's ``state_dict`` by its class name (for ``fabric.save``)."""
        step = self.loop.step if self.loop is not None else 0
        return {"step": step, **{type(obs).__name__: obs.state_dict() for obs in self._starts}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` saved; call it after ``on_train_start`` when a loop resumes."""
        self._running("load_state_dict").step = int(state_dict.get("step", 0))
        for obs in self._starts:
            if type(obs).__name__ in state_dict:
                obs.load_state_dict(dict(state_dict[type(obs).__name__]))
