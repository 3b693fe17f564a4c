"""``torch.compile`` for a Lightning fit, when it pays: the ``CompileModel`` callback and the rule behind it.

Compiling makes a conv net's or a transformer's steps faster but costs tens of seconds first;
``should_compile`` is the pure rule that weighs the two, ``CompileModel`` applies it to a fit. It replaces
the ``LightningModule``'s ``forward`` with ``torch.compile(forward, dynamic=False)`` on the instance, as
``trainer.fit(torch.compile(model))`` does, and restores the class's ``forward`` at ``teardown``: the module
keeps its identity and its ``state_dict`` keys, and forward hooks (``ChannelsLast``) stay outside the compiled
code. Each mode is compiled for the first input shape it sees; other shapes run eagerly. ``choose_mode``
picks CUDA graphs (``"reduce-overhead"``) for a conv net on one CUDA device, and ``CompileModel`` says once
whether the step replays them (``compute._cudagraphs.SkipWatch``). docs/compute.md tells the whole story.
"""

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
from lightning_gpuopt._common import synchronize, warn_once
from lightning_gpuopt.compute import _model
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
#: Per family (``_model.family``): (seconds compiling costs, share of an eager step it saves), assumed for a
#: model not yet compiled on this GPU (a compiled run measures its own, ``_compile_cost``). Conv nets:
#: ResNet-50's figures (the smallest saving of the conv nets measured); transformers: the longer compile and
#: the smaller saving of ViT-B/16 and a GPT-2-small-shaped model (``docs/compute.md``), all on one H200.
COMPILE_COST: dict[str, tuple[float, float]] = {
    "conv": (COMPILE_SECONDS, COMPILE_STEP_SAVING),
    "transformer": (35.0, 0.30),
}
#: where each family's ``COMPILE_COST`` comes from, as a decision names it
_ASSUMED = {"conv": "ResNet-50's on one H200", "transformer": "ViT-B/16's and a GPT-2's on one H200"}
#: Lowest CUDA compute capability inductor generates GPU kernels for (Triton).
MIN_CAPABILITY = (7, 0)

#: ``torch.compile`` modes ``CompileModel(mode=...)`` accepts; ``None`` lets ``choose_mode`` pick.
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: the modes that record CUDA graphs
GRAPH_MODES = ("reduce-overhead", "max-autotune")

When = Literal["always", "auto"]
_WHEN = ("always", "auto")
# auto mode times batches [_WARMUP_BATCHES, _WARMUP_BATCHES + _TIMED_BATCHES): the first ones autotune
# cuDNN and fill the allocator's cache
_WARMUP_BATCHES = 5
_TIMED_BATCHES = 10
# compiled training steps after which the graphs are recorded (a warm-up run, then the recording) and any
# skip is counted
_GRAPH_CHECK_STEPS = 3
_LOGGED: set[str] = set()  # mode reasons already logged in this process
# (forward function, backend, mode) -> (cuda_graphs, cuda_graphs_reason) of its compile in this process: a
# later fit of the same class reuses that compiled code, and torch records its skips only when it compiles
_GRAPH_RESULTS: dict[tuple[Any, str, str], tuple[bool, str | None]] = {}


@dataclass(frozen=True)
class CompileDecision:
    """What ``should_compile`` decided, and why.

    Attributes:
        compile: ``True`` compile, ``False`` stay eager, ``None`` undecided: time a few eager steps and ask
            again with ``step_seconds``.
        reason: one sentence naming the deciding fact.
        eager_seconds: the estimated eager training time left, where it was estimated.
    """

    compile: bool | None
    reason: str
    eager_seconds: float | None = None


def _device_refusal(dev: torch.device, capability: tuple[int, int] | None) -> CompileDecision | None:
    """The rule's refusal for a device it never compiles on; ``None`` where it may."""
    if dev.type != "cuda":
        return CompileDecision(False, f"the rule compiles on CUDA devices only, not on {dev.type!r}")
    major_minor = capability if capability is not None else tuple(torch.cuda.get_device_capability(dev))
    if tuple(major_minor) < MIN_CAPABILITY:
        return CompileDecision(
            False, f"compute capability {major_minor[0]}.{major_minor[1]} is below 7.0 (no Triton kernels)"
        )
    return None


def should_compile(
    *,
    has_conv: bool | None = None,
    family: str | None = None,
    device: torch.device | str,
    capability: tuple[int, int] | None = None,
    steps_left: float | None = None,
    step_seconds: float | None = None,
    time_left: float | None = None,
    cost: tuple[float, float] | None = None,
) -> CompileDecision:
    """Whether compiling the model will shorten the run: the rule ``CompileModel(when="auto")`` applies.

    Compile when all hold:

    1. the model is of a family the rule has measured (``COMPILE_COST``): a conv net or a transformer
       (``_model.family``: attention layers make a transformer, else a convolution a conv net); other models
       are not judged,
    2. the device is CUDA with compute capability >= ``MIN_CAPABILITY`` (7.0),
    3. the eager training time left exceeds the family's break-even, compile seconds over the share of an
       eager step compiled steps save: a conv net 45 s / 0.15 = 300 s (``BREAK_EVEN_SECONDS``), a transformer
       35 s / 0.30 = 117 s. That time is ``steps_left * step_seconds`` when the run has a known length,
       capped by ``time_left`` (``Trainer(max_time=...)``); a run with neither (``max_epochs=-1``, an
       endless loader) is taken as long and compiled.

    Args:
        has_conv: the model has a ``Conv*d`` layer (a conv net); read when ``family`` is not given.
        family: ``"conv"``, ``"transformer"`` or ``None`` (not judged); wins over ``has_conv``.
        device: the training device.
        capability: the CUDA device's compute capability; ``None`` reads it from ``device``.
        steps_left: training batches left (``float("inf")`` or ``None``: unknown).
        step_seconds: seconds an eager training batch takes; needed when ``steps_left`` is finite.
        time_left: seconds left under ``max_time``, or ``None``.
        cost: ``(compile seconds, share of a step saved)`` measured for this model on this GPU in an earlier
            run (``_compile_cost.measured_cost``); ``None``: the family's ``COMPILE_COST``, assumed. The
            reason names which.

    Returns:
        A ``CompileDecision``; its ``compile`` is ``None`` when ``step_seconds`` is needed to decide.

    Example::

        should_compile(family="conv", device="cuda", capability=(9, 0), steps_left=50_000, step_seconds=0.04)
        # CompileDecision(compile=True, reason='... 2000 s of eager training ...', eager_seconds=2000.0)
    """
    if family is None and has_conv:
        family = "conv"
    if family not in COMPILE_COST:
        return CompileDecision(
            False,
            "the model has no convolution or attention layer: the rule judges conv nets and transformers",
        )
    refused = _device_refusal(torch.device(device), capability)
    if refused is not None:
        return refused
    compile_seconds, saving = cost if cost is not None else COMPILE_COST[family]
    source = "measured for this model on this GPU" if cost is not None else (
        f"assumed, {_ASSUMED[family]}: not yet measured for this model here"
    )  # fmt: skip
    figures = f" ({compile_seconds:.0f} s to compile, {saving:.0%} of a step saved: {source})"
    if saving <= 0:
        return CompileDecision(False, f"compiled steps saved nothing{figures}")
    return _by_length(family, compile_seconds / saving, figures, steps_left, step_seconds, time_left)


def _by_length(
    family: str,
    break_even: float,
    figures: str,
    steps_left: float | None,
    step_seconds: float | None,
    time_left: float | None,
) -> CompileDecision:
    """``should_compile``'s last test: the eager training left against the family's ``break_even``."""
    estimates: list[float] = []
    if steps_left is not None and steps_left != float("inf"):
        if step_seconds is None:
            if time_left is not None and time_left <= break_even:
                return _by_time(time_left, break_even)
            return CompileDecision(None, "the run's length depends on the eager step time: time a few steps")
        estimates.append(max(0.0, steps_left) * step_seconds)
    if time_left is not None:
        estimates.append(max(0.0, time_left))
    if not estimates:
        return CompileDecision(
            True, "the run has no set length (max_steps, max_epochs, max_time): taken as long"
        )
    eager = min(estimates)
    if eager > break_even:
        return CompileDecision(
            True,
            f"{eager:.0f} s of eager training left exceeds the {family}'s {break_even:.0f} s break-even{figures}",
            eager,
        )
    return CompileDecision(
        False,
        f"{eager:.0f} s of eager training left is below the {family}'s {break_even:.0f} s break-even{figures}",
        eager,
    )


def choose_mode(
    *,
    family: str | None,
    device: torch.device | str,
    world_size: int = 1,
    accumulate_grad_batches: int = 1,
    automatic_optimization: bool = True,
    gpu_decoding: bool = False,
) -> tuple[str, str]:
    """The ``torch.compile`` mode ``CompileModel(mode=None)`` compiles with, and why: ``(mode, reason)``.

    ``"reduce-overhead"`` (CUDA graphs) for a conv net on one CUDA device, optimized automatically with one
    optimizer step a batch; ``"default"`` otherwise: CPUs have no CUDA graphs, a transformer gains nothing
    measurable from them (``docs/compute.md``), several processes (DDP) and gradient accumulation keep
    gradients across graph replays, manual optimization steps the graphs where the rule cannot see, and a
    DALI loader decoding JPEGs with nvJPEG on the same GPU (``gpu_decoding``: a DALI loader's ``feed_info``
    decoder ``"gpu"``) fed a model replaying graphs more slowly than one launching its kernels
    (``docs/dali.md``).

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


def _by_time(time_left: float, break_even: float) -> CompileDecision:
    return CompileDecision(
        False,
        f"max_time leaves {time_left:.0f} s, below the {break_even:.0f} s break-even",
        max(0.0, time_left),
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
    """Compile the ``LightningModule``'s ``forward`` with ``torch.compile`` for the fit.

    With ``when="always"`` the forward is compiled at the start of training (and at the start of a
    ``validate``/``test``/``predict`` run), on any device inductor supports, the CPU included. With
    ``when="auto"`` ``should_compile`` decides: at the start of training when the run's length is set by
    ``max_time`` or unknown, else after timing training batches 5 to 15 eagerly (two device syncs), from the
    training batches left; the first 15 batches then run eagerly. Under DDP rank zero's decision is broadcast
    once. On a device other than CUDA ``"auto"`` warns once and steps aside.

    Write ``training_step`` to call ``self(x)``: only ``forward`` is compiled. If training finishes its first
    15 batches without calling it, a warning says so. Each mode is compiled for the first input shape it sees;
    batches of other shapes run eagerly (docs/compute.md). ``forward`` is restored at
    ``teardown``, so the module can be saved, copied and pickled as usual afterwards.

    Args:
        when: ``"always"`` compile; ``"auto"`` compile where ``should_compile`` says it pays.
        backend: ``torch.compile``'s backend; ``"inductor"`` generates the faster kernels, ``"aot_eager"``
            and ``"eager"`` help to tell a compile problem from a kernel problem.
        mode: ``torch.compile``'s mode (one of ``MODES``); ``None`` (default): ``choose_mode`` picks CUDA
            graphs (``"reduce-overhead"``) or the default mode for the run. With CUDA graphs the callback
            marks the start of every step (``torch.compiler.cudagraph_mark_step_begin``).

    Attributes:
        decision: the ``CompileDecision`` of the last run (``None`` before one, or while timing).
        compiled: whether ``forward`` is compiled now.
        step_seconds: the eager batch time ``"auto"`` measured, or ``None``.
        compiled_calls: ``forward`` calls that ran compiled.
        eager_calls: ``forward`` calls of another input shape that ran eagerly.
        mode_used: the mode ``forward`` was compiled with (``None`` before it is), and ``mode_reason``.
        cuda_graphs: whether the compiled training step replays CUDA graphs: known after its first three
            compiled steps (``None`` before, and where this torch does not count skips); ``False`` in a
            mode that records none.
        cuda_graphs_reason: why not, where ``cuda_graphs`` is ``False``: the reason torch gave for skipping
            them (``"mutated inputs (1 instances) at model.py:12"``), or the mode that records none.
        cost: what compiling cost and saved in this fit (``_compile_cost.MeasuredCost``: the first compiled
            training step against an eager one, then 10 compiled steps after 5 more; ``None`` until then).
            Kept in ``compile.json`` in the cache folder for the next fit's decision on this GPU; compiled
            steps measured slower than eager ones (``when="auto"``) turn compiling off for the rest of the fit.

    Logs one line (rank zero) naming the mode when it compiles with ``mode=None``, one with the decision of
    ``when="auto"`` (which names where its break-even comes from: measured for this model on this GPU, or
    assumed) and one with the measured cost. In a mode that records CUDA graphs (and with
    ``backend="cudagraphs"``) it says once whether the step replays them: a line where it does, a warning
    with torch's reason where torch skipped them.

    Example::

        trainer = Trainer(precision="16-mixed", callbacks=[ChannelsLast(), CompileModel(when="auto")])
        trainer.fit(model)   # convert to channels_last first, then compile (CompileModel starts later)

        # LightningCLI:
        # trainer:
        #   callbacks:
        #     - class_path: lightning_gpuopt.compute.compile.CompileModel
        #       init_args: {when: auto}
    """

    def __init__(self, when: When = "always", backend: str = "inductor", mode: str | None = None) -> None:
        super().__init__()
        check_arg(mode is None or mode in MODES, "mode", mode, f"None or one of {MODES}")
        check_arg(isinstance(when, str), "when", when, "'always' or 'auto'", error=TypeError)
        check_arg(when in _WHEN, "when", when, "'always' or 'auto'")
        for ok, error in ((isinstance(backend, str), TypeError), (bool(backend), ValueError)):
            check_arg(
                ok,
                "backend",
                backend,
                "a torch.compile backend name",
                fix="e.g. 'inductor', 'aot_eager' or 'eager'",
                error=error,
            )
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
        self._aside = False
        self._family: str | None = None
        self._module: pl.LightningModule | None = None
        self._wrapper: Callable[..., Any] | None = None
        self._shapes: dict[tuple[bool, bool, bool], tuple[Any, ...]] = {}
        self._warned_shape = False
        self._run: tuple[torch.device, int, int] = (torch.device("cpu"), 1, 1)  # set at setup
        self._gpu_decoding = False  # set at on_train_start
        self.cost: MeasuredCost | None = None
        self._meter: CostMeter | None = None
        self._cost_key: str | None = None

    # --- hooks -------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._timing = False
        self._batches = 0
        self._aside = False
        self._meter = None
        device = trainer.strategy.root_device
        accumulate = getattr(trainer, "accumulate_grad_batches", 1)
        for cb in getattr(trainer, "callbacks", None) or ():  # accumulation a scheduler turns on later
            if isinstance(cb, GradientAccumulationScheduler):
                accumulate = max([accumulate, *cb.scheduling.values()])
        self._run = (device, getattr(trainer, "world_size", 1), accumulate)
        if self.when == "auto" and device.type != "cuda":
            self._aside = True
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
        if self._aside or self.compiled:
            return
        self._cost_key = cost_key(pl_module, trainer.strategy.root_device)
        if self.when == "always":
            self._install(pl_module, CompileDecision(True, "when='always'"))
            self._meter = CostMeter(first=0, eager_step=None) if self.compiled else None
            return
        self._family = _model.family(pl_module)
        decision = should_compile(
            family=self._family,
            device=trainer.strategy.root_device,
            steps_left=self._batches_left(trainer),
            time_left=self._time_left(trainer),
            cost=measured_cost(self._cost_key),
        )
        if decision.compile is None:
            self._timing = True
            self.decision = None
        else:
            self._decide(pl_module, decision)
            self._meter = CostMeter(first=0, eager_step=None) if self.compiled else None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batches += 1
        self._mark_step()
        if self._watch is not None and self._train_compiled >= _GRAPH_CHECK_STEPS:
            self._graphs_checked()
        calls = self.compiled_calls + self.eager_calls
        if self._batches == _WARMUP_BATCHES + _TIMED_BATCHES + 1 and self.compiled and calls == 0:
            warn_once(
                f"CompileModel: {type(pl_module).__name__}.training_step did not call forward (self(x)) in "
                f"{self._batches - 1} batches, and only forward is compiled. Call self(x) in training_step."
            )
        index = self._batches - 1
        if self._meter is not None:
            self._meter_batch(trainer, pl_module, index)
        if not self._timing:
            return
        if index == _WARMUP_BATCHES:
            synchronize(pl_module.device)
            self._t0 = time.perf_counter()
        elif index == _WARMUP_BATCHES + _TIMED_BATCHES and self._t0 is not None:
            synchronize(pl_module.device)
            self.step_seconds = (time.perf_counter() - self._t0) / _TIMED_BATCHES
            self._timing = False
            decision = should_compile(
                family=self._family,  # read at on_train_start, which asked for timing
                device=trainer.strategy.root_device,
                steps_left=self._batches_left(trainer),
                step_seconds=self.step_seconds,
                time_left=self._time_left(trainer),
                cost=measured_cost(self._cost_key) if self._cost_key else None,
            )
            # every rank must run the same code: rank zero's timing decides
            self._decide(pl_module, trainer.strategy.broadcast(decision, src=0))
            if self.compiled:  # this batch is the first compiled one
                self._meter = CostMeter(first=index, eager_step=self.step_seconds)
                self._meter_batch(trainer, pl_module, index)

    def _meter_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, index: int) -> None:
        """Mark batch ``index`` for the cost measurement; once it is done, keep the cost for the next fit,
        say it, and (``when="auto"``) run eagerly from here where compiled steps were the slower."""
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
    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._mark_step()

    # evaluation steps of the other stages replay graphs the same way
    on_test_batch_start = on_predict_batch_start = on_validation_batch_start

    def _mark_step(self) -> None:
        # a new step for CUDA graph trees: the previous step's graph outputs may be overwritten from here
        if self.compiled and self._graphs:
            torch.compiler.cudagraph_mark_step_begin()

    @property
    def cuda_graphs_skipped(self) -> str | None:
        """torch's reason for not replaying the CUDA graphs the mode records, else ``None`` (they replay, it
        is not known yet, or the mode records none)."""
        return self.cuda_graphs_reason if self._graphs and self.cuda_graphs is False else None

    def _graphs_checked(self) -> None:
        """Read what torch recorded over the first compiled steps, and say it once."""
        watch, self._watch = self._watch, None
        if watch is None:
            return
        skips, key = watch.stop(), self._graphs_key
        if skips is None:  # this torch keeps no count (``_compat`` said so)
            return
        if not skips and not watch.compiled:
            # code an earlier fit compiled ran: torch counted its skips then, not now
            if key in _GRAPH_RESULTS:
                self.cuda_graphs, self.cuda_graphs_reason = _GRAPH_RESULTS[key]
            return
        self.cuda_graphs = not skips
        if key is not None:
            _GRAPH_RESULTS[key] = (self.cuda_graphs, None)
        if self.cuda_graphs:
            rank_zero_info(
                f"CompileModel: the compiled training step replays CUDA graphs (mode={self.mode_used!r})"
            )
            return
        device = self._run[0]
        if watch.reasons:
            self.cuda_graphs_reason = watch.reasons[0]
        elif device.type != "cuda":
            self.cuda_graphs_reason = (
                f"the compiled step runs on {device.type!r}, and CUDA graphs need a CUDA device"
            )
        else:
            self.cuda_graphs_reason = (
                f"torch counted {skips} skip(s) and logged no reason (TORCH_LOGS=cudagraphs shows it)"
            )
        if key is not None:
            _GRAPH_RESULTS[key] = (False, self.cuda_graphs_reason)
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

    # --- compiling ---------------------------------------------------------------------------------------
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
            self._watch = SkipWatch().start()  # torch compiles at the first calls: count from here

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
            self.mode_used, self.mode_reason = self.mode, f"CompileModel(mode={self.mode!r})"
            return self.mode
        if self.backend != "inductor":
            self.mode_used, self.mode_reason = "default", f"backend={self.backend!r}: modes are inductor's"
            return self.mode_used
        device, world, accumulate = self._run
        self.mode_used, self.mode_reason = choose_mode(
            family=_model.family(pl_module),
            device=device,
            world_size=world,
            accumulate_grad_batches=accumulate,
            automatic_optimization=pl_module.automatic_optimization,
            gpu_decoding=self._gpu_decoding,
        )
        if self.mode_reason not in _LOGGED:
            _LOGGED.add(self.mode_reason)
            rank_zero_info(
                f"CompileModel: mode={self.mode_used!r} ({self.mode_reason}); CompileModel(mode=...) sets it"
            )
        return self.mode_used

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

    # --- run length ----------------------------------------------------------------------------------------
    @staticmethod
    def _batches_left(trainer: pl.Trainer) -> float:
        total = float(trainer.estimated_stepping_batches)  # optimizer steps of the whole fit; inf if unknown
        return max(0.0, total - trainer.global_step) * trainer.accumulate_grad_batches

    @staticmethod
    def _time_left(trainer: pl.Trainer) -> float | None:
        for cb in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(cb, Timer):
                return cb.time_remaining("train")
        return None

    # --- state and pickling -------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        """The last decision, for the record; every fit decides again (fewer steps are left on resume)."""
        decision = self.decision
        return {
            "when": self.when,
            "compile": None if decision is None else decision.compile,
            "reason": None if decision is None else decision.reason,
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
