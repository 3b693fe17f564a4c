"""``torch.compile`` for a Lightning fit, when it pays: the ``CompileModel`` callback and the rule behind it
(``should_compile``, ``choose_mode``); docs/compute.md tells the whole story."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler, Timer
from lightning.pytorch.utilities import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from lightning_gpuopt._checks import check_arg
from lightning_gpuopt._common import info_once, synchronize, warn_once
from lightning_gpuopt.compute import _compile_cost, _model
from lightning_gpuopt.compute._compile_cost import CostMeter, MeasuredCost, cost_key, measured_cost, record
from lightning_gpuopt.compute._cudagraphs import SkipWatch

__all__ = [
    "BREAK_EVEN_SECONDS",
    "COMPILE_COST",
    "COMPILE_SECONDS",
    "COMPILE_STEP_SAVING",
    "GRAPH_MODES",
    "MIN_CAPABILITY",
    "CompileDecision",
    "CompileModel",
    "choose_mode",
    "should_compile",
]

#: Share of an eager training step's time that compiling a convolutional network saves.
COMPILE_STEP_SAVING = 0.15
#: Seconds ``torch.compile`` (inductor, default mode) spends before a conv net's first compiled step.
COMPILE_SECONDS = 45.0
#: Eager training time after which compiling has paid for itself: ``COMPILE_SECONDS / COMPILE_STEP_SAVING``.
BREAK_EVEN_SECONDS = COMPILE_SECONDS / COMPILE_STEP_SAVING
#: Per family: (seconds compiling costs, share of an eager step it saves), assumed for a model not yet
#: compiled on this GPU (ResNet-50's; ViT-B/16's and a GPT-2's, on one H200: ``docs/compute.md``).
COMPILE_COST: dict[str, tuple[float, float]] = {
    "conv": (COMPILE_SECONDS, COMPILE_STEP_SAVING),
    "transformer": (35.0, 0.30),
}
_ASSUMED = {"conv": "ResNet-50's on one H200", "transformer": "ViT-B/16's and a GPT-2's on one H200"}
#: Lowest CUDA compute capability inductor generates GPU kernels for (Triton).
MIN_CAPABILITY = (7, 0)

#: ``torch.compile`` modes ``CompileModel(mode=...)`` accepts; ``None`` lets ``choose_mode`` pick.
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: the modes that record CUDA graphs
GRAPH_MODES = ("reduce-overhead", "max-autotune")

When = Literal["always", "auto"]
# compiled training steps after which the graphs are recorded and any skip is counted
_GRAPH_CHECK_STEPS = 3
# (forward function, backend, mode) -> (cuda_graphs, reason) of its compile in this process: a later fit
# reuses that compiled code, and torch records its skips only when it compiles
_GRAPH_RESULTS: dict[Any, tuple[bool | None, str | None]] = {}


@dataclass(frozen=True)
class CompileDecision:
    """What ``should_compile`` decided (``compile``: ``None`` until eager steps are timed), why (``reason``),
    and the eager training time left it estimated (``eager_seconds``)."""

    compile: bool | None
    reason: str
    eager_seconds: float | None = None


def should_compile(
    *,
    family: str | None,
    device: torch.device | str,
    capability: tuple[int, int] | None = None,
    steps_left: float | None = None,
    step_seconds: float | None = None,
    time_left: float | None = None,
    cost: tuple[float, float] | None = None,
) -> CompileDecision:
    """Whether compiling the model will shorten the run: the rule ``CompileModel(when="auto")`` applies (a conv
    net or a transformer on CUDA >= 7.0 whose eager training time left exceeds the break-even; docs/compute.md).

    Args:
        family: ``"conv"``, ``"transformer"`` or ``None`` (not judged).
        device: the training device.
        capability: the CUDA device's compute capability; ``None`` reads it from ``device``.
        steps_left: training batches left (``float("inf")`` or ``None``: unknown).
        step_seconds: seconds an eager training batch takes; needed when ``steps_left`` is finite.
        time_left: seconds left under ``max_time``, or ``None``.
        cost: ``(compile seconds, share of a step saved)`` measured for this model on this GPU;
            ``None``: the family's ``COMPILE_COST``, assumed.

    Returns:
        A ``CompileDecision``; its ``compile`` is ``None`` when ``step_seconds`` is needed to decide.
    """
    if family not in COMPILE_COST:
        return CompileDecision(
            False,
            "the model has no convolution or attention layer: the rule judges conv nets and transformers",
        )
    dev = torch.device(device)
    if dev.type != "cuda":
        return CompileDecision(False, f"the rule compiles on CUDA devices only, not on {dev.type!r}")
    major, minor = capability if capability is not None else torch.cuda.get_device_capability(dev)
    if (major, minor) < MIN_CAPABILITY:
        return CompileDecision(False, f"compute capability {major}.{minor} is below 7.0 (no Triton kernels)")
    compile_seconds, saving = cost if cost is not None else COMPILE_COST[family]
    source = "measured for this model on this GPU" if cost is not None else (
        f"assumed, {_ASSUMED[family]}: not yet measured for this model here"
    )  # fmt: skip
    figures = f" ({compile_seconds:.0f} s to compile, {saving:.0%} of a step saved: {source})"
    if saving <= 0:
        return CompileDecision(False, f"compiled steps saved nothing{figures}")
    break_even = compile_seconds / saving
    estimates: list[float] = []
    if steps_left is not None and steps_left != float("inf"):
        if step_seconds is None:
            if time_left is not None and time_left <= break_even:
                why = f"max_time leaves {time_left:.0f} s, below the {break_even:.0f} s break-even"
                return CompileDecision(False, why, max(0.0, time_left))
            return CompileDecision(None, "the run's length depends on the eager step time: time a few steps")
        estimates.append(max(0.0, steps_left) * step_seconds)
    if time_left is not None:
        estimates.append(max(0.0, time_left))
    if not estimates:
        return CompileDecision(
            True, "the run has no set length (max_steps, max_epochs, max_time): taken as long"
        )
    eager = min(estimates)
    side = "exceeds" if eager > break_even else "is below"
    why = f"{eager:.0f} s of eager training left {side} the {family}'s {break_even:.0f} s break-even{figures}"
    return CompileDecision(eager > break_even, why, eager)


def choose_mode(
    *,
    family: str | None,
    device: torch.device | str,
    world_size: int = 1,
    accumulate_grad_batches: int = 1,
    automatic_optimization: bool = True,
    gpu_decoding: bool = False,
) -> tuple[str, str]:
    """The ``torch.compile`` mode ``CompileModel(mode=None)`` compiles with, and why: ``(mode, reason)``
    (``"reduce-overhead"``, CUDA graphs, where they apply; docs/compute.md).

    Example:
        >>> choose_mode(family="conv", device="cuda")[0], choose_mode(family="transformer", device="cuda")[0]
        ('reduce-overhead', 'default')
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return "default", f"CUDA graphs need a CUDA device, not {dev.type!r}"
    if family != "conv":
        return "default", f"{'a transformer' if family else 'not a conv net'}: compiled without CUDA graphs"
    if world_size > 1:
        return "default", f"{world_size} processes: CUDA graphs are used on one device"
    if accumulate_grad_batches > 1:
        return "default", f"accumulate_grad_batches={accumulate_grad_batches}: graphs need a step a batch"
    if not automatic_optimization:
        return "default", "manual optimization: CUDA graphs need Lightning's own optimizer steps"
    if gpu_decoding:
        return "default", "nvJPEG decodes the training batches on this GPU: compiled without CUDA graphs"
    return "reduce-overhead", (
        "a conv net on one CUDA device: CUDA graphs (mode='reduce-overhead') replay each step's kernels"
    )


def _signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    # what dynamo specializes a static graph on: each tensor's shape, strides, dtype and device
    found: list[Any] = []

    def record(t: torch.Tensor) -> torch.Tensor:
        found.append((tuple(t.shape), t.stride(), t.dtype, t.device))
        return t

    apply_to_collection((args, kwargs), torch.Tensor, record)
    return tuple(found)


class CompileModel(pl.Callback):
    """Compile the ``LightningModule``'s ``forward`` (call ``self(x)`` in ``training_step``) with
    ``torch.compile`` for the fit, for the first input shape each mode sees (docs/compute.md).

    Args:
        when: ``"always"`` compile; ``"auto"`` compile where ``should_compile`` says it pays.
        backend: ``torch.compile``'s backend (``"inductor"``; ``"aot_eager"`` or ``"eager"`` to tell a compile
            problem from a kernel problem).
        mode: ``torch.compile``'s mode (one of ``MODES``); ``None``: ``choose_mode`` picks.

    Example::

        trainer = Trainer(precision="16-mixed", callbacks=[ChannelsLast(), CompileModel(when="auto")])
    """

    def __init__(self, when: When = "always", backend: str = "inductor", mode: str | None = None) -> None:
        super().__init__()
        check_arg(mode is None or mode in MODES, "mode", mode, f"None or one of {MODES}")
        check_arg(isinstance(when, str), "when", when, "'always' or 'auto'", error=TypeError)
        check_arg(when in ("always", "auto"), "when", when, "'always' or 'auto'")
        must, fix = "a torch.compile backend name", "e.g. 'inductor', 'aot_eager' or 'eager'"
        check_arg(isinstance(backend, str), "backend", backend, must, fix, TypeError)
        check_arg(bool(backend), "backend", backend, must, fix)
        self.when: When = when
        self.backend = backend
        self.mode = mode
        self.mode_used: str | None = None
        self.mode_reason: str | None = None
        self.decision: CompileDecision | None = None
        self.compiled = False
        self.step_seconds: float | None = None
        self.compiled_calls = 0
        self.eager_calls = 0
        self.cuda_graphs: bool | None = None
        self.cuda_graphs_reason: str | None = None
        self._graphs = False  # the compiled forward records CUDA graphs (a graph mode, or their backend)
        self._graphs_key: tuple[Any, str, str] | None = None
        self._watch: SkipWatch | None = None
        self._train_compiled = 0  # compiled training calls since it was compiled
        self._timing = False
        self._batches = 0
        self._t0: float | None = None
        self._module: pl.LightningModule | None = None
        self._wrapper: Callable[..., Any] | None = None
        self._shapes: dict[tuple[bool, bool, bool], tuple[Any, ...]] = {}
        self._warned_shape = False
        self._run: tuple[torch.device, int, int] = (torch.device("cpu"), 1, 1)  # set at setup
        self._gpu_decoding = False  # set at on_train_start
        self.cost: MeasuredCost | None = None
        self._meter: CostMeter | None = None
        self._cost_key: str | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._timing = False
        self._batches = 0
        self._meter = None
        device = trainer.strategy.root_device
        accumulate = getattr(trainer, "accumulate_grad_batches", 1)
        for cb in getattr(trainer, "callbacks", None) or ():  # accumulation a scheduler turns on later
            if isinstance(cb, GradientAccumulationScheduler):
                accumulate = max([accumulate, *cb.scheduling.values()])
        self._run = (device, getattr(trainer, "world_size", 1), accumulate)
        if self.when == "auto" and device.type != "cuda":
            warn_once(
                f"CompileModel(when='auto'): the rule compiles on CUDA devices only; on {device.type!r} the "
                "callback does nothing. Use CompileModel() to compile anyway."
            )
            return
        if stage != "fit" and self.when == "always":
            self._install(pl_module, CompileDecision(True, "when='always'"))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        info = getattr(getattr(trainer, "train_dataloader", None), "feed_info", None)
        # DALI's nvJPEG beside graph replays was measured slower; the training process's own nvJPEG path
        # (``data.decode_gpu``) never makes the training thread wait, so it keeps the graphs
        self._gpu_decoding = (
            getattr(info, "decoder", None) == "gpu" and getattr(info, "backend", None) == "dali"
        )
        if self.compiled or (self.when == "auto" and self._run[0].type != "cuda"):
            return
        self._cost_key = cost_key(pl_module, trainer.strategy.root_device)
        if self.when == "always":
            self._install(pl_module, CompileDecision(True, "when='always'"))
        elif (decision := self._should_compile(trainer, pl_module)).compile is None:
            self._timing, self.decision = True, None  # decided once a few eager batches are timed
            return
        else:
            self._decide(pl_module, decision)
        self._meter = CostMeter(first=0, eager_step=None) if self.compiled else None

    def _should_compile(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, step_seconds: float | None = None
    ) -> CompileDecision:
        timers = [cb for cb in trainer.callbacks if isinstance(cb, Timer)]  # type: ignore[attr-defined]
        total = float(trainer.estimated_stepping_batches)  # optimizer steps of the whole fit; inf if unknown
        return should_compile(
            family=_model.family(pl_module),
            device=trainer.strategy.root_device,
            steps_left=max(0.0, total - trainer.global_step) * trainer.accumulate_grad_batches,
            step_seconds=step_seconds,
            time_left=timers[0].time_remaining("train") if timers else None,
            cost=measured_cost(self._cost_key) if self._cost_key else None,
        )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        warm, timed = _compile_cost.WARMUP_BATCHES, _compile_cost.TIMED_BATCHES
        self._batches += 1
        self._mark_step()
        if self._watch is not None and self._train_compiled >= _GRAPH_CHECK_STEPS:
            self._graphs_checked()
        calls = self.compiled_calls + self.eager_calls
        if self._batches == warm + timed + 1 and self.compiled and calls == 0:
            warn_once(
                f"CompileModel: {type(pl_module).__name__}.training_step did not call forward (self(x)) in "
                f"{self._batches - 1} batches, and only forward is compiled. Call self(x) in training_step."
            )
        index = self._batches - 1
        self._meter_batch(trainer, pl_module, index)
        if not self._timing:
            return
        if index == warm:
            synchronize(pl_module.device)
            self._t0 = time.perf_counter()
        elif index == warm + timed and self._t0 is not None:
            synchronize(pl_module.device)
            self.step_seconds = (time.perf_counter() - self._t0) / timed
            self._timing = False
            decision = self._should_compile(trainer, pl_module, self.step_seconds)
            # every rank must run the same code: rank zero's timing decides
            self._decide(pl_module, trainer.strategy.broadcast(decision, src=0))
            if self.compiled:  # this batch is the first compiled one
                self._meter = CostMeter(first=index, eager_step=self.step_seconds)
                self._meter_batch(trainer, pl_module, index)

    def _meter_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, index: int) -> None:
        """Mark batch ``index`` for the cost measurement; once measured, keep it, log it, act on it."""
        cost = self._meter.at_batch_start(index, pl_module.device) if self._meter is not None else None
        if cost is None:
            return
        self._meter, self.cost = None, cost
        device = trainer.strategy.root_device
        if self._cost_key is not None and device.type == "cuda" and getattr(trainer, "local_rank", 0) == 0:
            record(self._cost_key, cost)  # the rule judges CUDA runs only
        eager = f" against {cost.eager_step * 1e3:.1f} ms eager" if cost.eager_step else ""
        saved = f" ({cost.saving:.0%} saved)" if cost.saving is not None else ""
        rank_zero_info(
            f"CompileModel: compiling took {cost.seconds:.1f} s; a compiled step {cost.compiled_step * 1e3:.1f} ms"
            f"{eager}{saved}, measured; kept for the next fit's decision on this GPU"
        )
        slower = self.when == "auto" and cost.saving is not None and cost.saving < 0
        if self.when == "auto" and trainer.strategy.broadcast(slower, src=0):  # rank zero's, on every rank
            self._uninstall()
            self.decision = CompileDecision(
                False, f"compiled steps measured slower ({cost.saving:.0%} saved{eager}): eager from here"
            )

    @override
    def on_validation_batch_start(self, *args: Any, **kwargs: Any) -> None:
        self._mark_step()

    # evaluation steps of the other stages replay graphs the same way
    on_test_batch_start = on_predict_batch_start = on_validation_batch_start

    def _mark_step(self) -> None:
        # a new step for CUDA graph trees: the previous step's graph outputs may be overwritten from here
        if self.compiled and self._graphs:
            torch.compiler.cudagraph_mark_step_begin()

    @property
    def cuda_graphs_skipped(self) -> str | None:
        """torch's reason for not replaying the CUDA graphs the mode records, else ``None``."""
        return self.cuda_graphs_reason if self._graphs and self.cuda_graphs is False else None

    def _graphs_checked(self) -> None:
        """Read what torch recorded over the first compiled steps, and say it once."""
        watch, self._watch = self._watch, None
        skips = watch.stop() if watch is not None else None
        if watch is None or skips is None:  # none, or this torch keeps no count (``_compat`` said so)
            return
        key = self._graphs_key
        if not skips and not watch.compiled:
            # code an earlier fit compiled ran: torch counted its skips then, not now
            self.cuda_graphs, self.cuda_graphs_reason = _GRAPH_RESULTS.get(key, (None, None))
            return
        device = self._run[0].type
        reason = f"torch counted {skips} skip(s) and logged no reason (TORCH_LOGS=cudagraphs shows it)"
        if device != "cuda":
            reason = f"the compiled step runs on {device!r}, and CUDA graphs need a CUDA device"
        self.cuda_graphs = not skips
        self.cuda_graphs_reason = None if not skips else watch.reasons[0] if watch.reasons else reason
        _GRAPH_RESULTS[key] = (self.cuda_graphs, self.cuda_graphs_reason)
        if self.cuda_graphs:
            rank_zero_info(
                f"CompileModel: the compiled training step replays CUDA graphs (mode={self.mode_used!r})"
            )
            return
        warn_once(
            f"CompileModel: CUDA graphs were skipped: {self.cuda_graphs_reason}. The compiled step launches its "
            "kernels one by one; remove what torch names (an input changed in place inside forward, a CPU "
            "tensor in forward, varying input shapes) to have it replay them."
        )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._train_compiled:  # a run shorter than the check: what its compiled steps recorded
            self._graphs_checked()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._uninstall()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._uninstall()

    def _decide(self, pl_module: pl.LightningModule, decision: CompileDecision) -> None:
        self.decision = decision
        what = "compiling" if decision.compile else "eager"
        rank_zero_info(f"CompileModel(when='auto'): {what}: {decision.reason}")
        if decision.compile:
            self._install(pl_module, decision)

    def _install(self, pl_module: pl.LightningModule, decision: CompileDecision) -> None:
        self.decision = decision
        if self.compiled:
            return
        if "forward" in vars(pl_module):
            warn_once(
                f"CompileModel: {type(pl_module).__name__}.forward was already replaced on the instance (a "
                "compiled module passed to Trainer.fit, or another wrapper); the callback leaves it alone."
            )
            return
        original = pl_module.forward
        compile_mode = self._choose_mode(pl_module)
        compiled = torch.compile(original, dynamic=False, backend=self.backend, mode=compile_mode)
        graphs = self._graphs = compile_mode in GRAPH_MODES or self.backend == "cudagraphs"
        self._train_compiled = 0
        self.cuda_graphs = None if graphs else False
        self.cuda_graphs_reason = None if graphs else f"mode={compile_mode!r} records no CUDA graphs"
        if graphs:
            self._graphs_key = (getattr(original, "__func__", original), self.backend, compile_mode)
            self._watch = SkipWatch()  # torch compiles at the first calls: count from here

        def forward(*args: Any, **kwargs: Any) -> Any:
            # dynamo guards on these: one compiled graph each (training, validation under inference mode)
            mode = (pl_module.training, torch.is_grad_enabled(), torch.is_inference_mode_enabled())
            signature = _signature(args, kwargs)
            first = self._shapes.setdefault(mode, signature)
            if signature == first:
                self.compiled_calls += 1
                self._train_compiled += int(mode[0])
                out = compiled(*args, **kwargs)
                # CUDA graphs reuse their outputs' memory next step: hand out copies the caller may keep
                return apply_to_collection(out, torch.Tensor, torch.Tensor.clone) if graphs else out
            self.eager_calls += 1
            if pl_module.training and not self._warned_shape:
                self._warned_shape = True
                warn_once(
                    f"CompileModel: a training batch with input shapes {[s[0] for s in signature]} differs "
                    f"from the compiled {[s[0] for s in first]}; such batches run eagerly rather than "
                    "recompile. Use drop_last=True in the training DataLoader and a fixed image size."
                )
            return original(*args, **kwargs)

        pl_module.forward = forward  # type: ignore[method-assign]
        self._module, self._wrapper = pl_module, forward
        self._shapes = {}
        self.compiled = True

    def _choose_mode(self, pl_module: pl.LightningModule) -> str:
        if self.mode is not None:
            mode, reason = self.mode, f"CompileModel(mode={self.mode!r})"
        elif self.backend != "inductor":
            mode, reason = "default", f"backend={self.backend!r}: modes are inductor's"
        else:
            device, world, accumulate = self._run
            mode, reason = choose_mode(
                family=_model.family(pl_module),
                device=device,
                world_size=world,
                accumulate_grad_batches=accumulate,
                automatic_optimization=pl_module.automatic_optimization,
                gpu_decoding=self._gpu_decoding,
            )
            info_once(f"CompileModel: mode={mode!r} ({reason}); CompileModel(mode=...) sets it")
        self.mode_used, self.mode_reason = mode, reason
        return mode

    def _uninstall(self) -> None:
        if self._watch is not None:
            self._watch.stop()  # its handler leaves torch's logger; what is not known yet stays None
            self._watch = None
        module, wrapper = self._module, self._wrapper
        if module is not None and vars(module).get("forward") is wrapper:
            del module.forward  # the class's forward again
        self._module = self._wrapper = None
        self._shapes = {}
        self._timing = False
        self.compiled = False

    @override
    def state_dict(self) -> dict[str, Any]:
        """The last decision, for the record; every fit decides again."""
        return {
            "when": self.when,
            "compile": getattr(self.decision, "compile", None),
            "reason": getattr(self.decision, "reason", None),
            "step_seconds": self.step_seconds,
            "mode": self.mode_used,
            "mode_reason": self.mode_reason,
            "cuda_graphs": self.cuda_graphs,
            "cuda_graphs_reason": self.cuda_graphs_reason,
        }

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # the compiled function and the module belong to this process's fit
        state.update(_module=None, _wrapper=None, _shapes={}, compiled=False, _watch=None, _graphs_key=None)
        return state

    def __repr__(self) -> str:
        return f"{type(self).__name__}(when={self.when!r}, backend={self.backend!r}, mode={self.mode!r})"
