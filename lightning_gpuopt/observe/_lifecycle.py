"""``Loop``, the training loop as the observers see it (a Trainer's or ``FabricObserver``'s), and
``ObserverCallback``, the one adapter from Lightning's hooks to the observers' event methods."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from typing_extensions import override

from lightning_gpuopt.observe.timing import loader_fetch_seconds

__all__ = ["Loop", "ObserverCallback", "TrainerLoop"]


def first_loader(loaders: Any) -> Any:
    """The first loader of a loader, a list/tuple or a dict of them; ``None`` when there is none."""
    if isinstance(loaders, Mapping):
        return next(iter(loaders.values()), None)
    if isinstance(loaders, (list, tuple)):
        return loaders[0] if loaders else None
    return loaders


class TrainerLoop:
    """A ``Loop`` read from a running Trainer through its public attributes (those fixed for a fit, once)."""

    name = "Trainer"
    logger_fix = "add one (e.g. `Trainer(logger=TensorBoardLogger('logs'))`)"

    def __init__(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.trainer = trainer
        self.module: nn.Module = pl_module
        self.device: torch.device = trainer.strategy.root_device
        self.loggers: Sequence[Any] = trainer.loggers
        self.is_global_zero = trainer.is_global_zero
        self.world_size = int(trainer.world_size)
        self.processes_per_node = max(1, int(trainer.num_devices))
        # a public Trainer attribute that type stubs do not declare
        self.log_every_n_steps: int | None = int(getattr(trainer, "log_every_n_steps", 50))
        self.callbacks: Sequence[Any] = getattr(trainer, "callbacks", [])
        self.precision: str | None = str(trainer.precision)
        self.precision_plugin = getattr(trainer, "precision_plugin", None)
        self.gradient_clip_val: float | None = getattr(trainer, "gradient_clip_val", None)

    @property
    def global_step(self) -> int:
        return self.trainer.global_step

    @property
    def train_loaders(self) -> Any:
        return getattr(self.trainer, "train_dataloader", None)

    def fetch_seconds(self) -> float | None:
        return loader_fetch_seconds(self.train_loaders)  # None for no loader too

    @property
    def batches_per_epoch(self) -> int | None:
        batches = self.trainer.num_training_batches  # inf: a loader without a length, or not known yet
        return int(batches) if math.isfinite(batches) and batches > 0 else None

    @property
    def steps_per_epoch(self) -> int | None:
        batches, accumulate = self.batches_per_epoch, max(int(self.trainer.accumulate_grad_batches), 1)
        return None if batches is None else math.ceil(batches / accumulate)

    @property
    def optimizers(self) -> Sequence[Any] | None:
        return getattr(self.trainer, "optimizers", None)  # configured after setup

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.trainer.strategy.all_gather(tensor)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        # straight to each logger (as Lightning's LearningRateMonitor does): `pl_module.log` from a callback would
        # only be flushed on the Trainer's own interval
        for logger in self.trainer.loggers:
            logger.log_metrics(dict(metrics), step=step)


class FabricLoop:
    """The ``observe._lifecycle.Loop`` of a Fabric training loop."""

    name = "Fabric"
    logger_fix = "pass one to the Fabric (e.g. `Fabric(loggers=CSVLogger('logs'))`)"
    log_every_n_steps: int | None = None  # Fabric has no logging interval of its own
    gradient_clip_val: float | None = None  # Fabric clips where the loop calls fabric.clip_gradients

    def __init__(
        self,
        fabric: Any,
        model: nn.Module,
        optimizers: Sequence[Any] | None,
        timed: Mapping[int, Any],
        observers: Sequence[Any],
    ) -> None:
        from lightning.fabric.wrappers import is_wrapped

        self.fabric = fabric
        inner = getattr(model, "module", None)  # fabric.setup's wrapper holds the user's module there
        self.module = inner if is_wrapped(model) and isinstance(inner, nn.Module) else model
        self.optimizers = list(optimizers) if optimizers is not None else None
        self.callbacks = observers
        self.device = torch.device(fabric.device)
        self.loggers: Sequence[Any] = list(fabric.loggers)
        self.is_global_zero = bool(fabric.is_global_zero)
        self.world_size = int(fabric.world_size)
        devices = getattr(fabric.strategy, "parallel_devices", None)
        self.processes_per_node = max(1, len(devices)) if isinstance(devices, (list, tuple)) else 1
        self.precision_plugin = getattr(fabric.strategy, "precision", None)
        precision = getattr(self.precision_plugin, "precision", None)
        self.precision = str(precision) if precision is not None else None
        self._timed = timed  # the observer's: loaders iterated through FabricObserver.timed, by id
        self._loaders: tuple[tuple[int, ...], Any] = ((), None)  # the same object while the loaders stay
        #: optimizer steps taken so far (``FabricObserver.on_train_batch_end`` moves it on)
        self.step = 0

    @property
    def global_step(self) -> int:
        return self.step

    @property
    def train_loaders(self) -> Any:
        keys = tuple(self._timed)
        if self._loaders[0] != keys:
            loaders = [t.loader for t in self._timed.values()]
            self._loaders = (keys, loaders[0] if len(loaders) == 1 else (loaders or None))
        return self._loaders[1]

    def fetch_seconds(self) -> float | None:
        return sum(t.fetch_seconds for t in self._timed.values()) if self._timed else None

    @property
    def batches_per_epoch(self) -> int | None:
        try:
            return len(first_loader(self.train_loaders)) or None
        except TypeError:  # no loader, or an iterable one without a length
            return None

    # the loop reports its steps, not how they relate to batches: one step a batch is assumed here
    steps_per_epoch = batches_per_epoch

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.fabric.all_gather(tensor)  # type: ignore[no-any-return]

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.fabric.log_dict(dict(metrics), step=step)


#: The training loop as the observers see it: a Trainer's or a Fabric loop's.
Loop: TypeAlias = TrainerLoop | FabricLoop


def _relay(event: str, *picked: int, const: str | None = None) -> Any:
    """A Lightning hook that calls ``event(TrainerLoop, *its arguments at picked[, const])``."""

    def hook(self: Any, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        extra = [args[i] for i in picked] + ([const] if const is not None else [])
        getattr(self, event)(self._loop(trainer, pl_module), *extra)

    return hook


class ObserverCallback(Callback):
    """The one adapter from Lightning's hooks to an observer's event methods (it overrides those it needs).

    ``_release`` runs at ``teardown`` and at ``on_exception`` (Lightning calls ``on_exception`` but not
    ``teardown`` when fit raises), so it must be safe to call more than once.
    """

    _trainer_loop: TrainerLoop | None = None

    def _loop(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> TrainerLoop:
        """The ``TrainerLoop`` of this run, read once (dropped at ``teardown``)."""
        loop = self._trainer_loop
        if loop is None or loop.trainer is not trainer or loop.module is not pl_module:
            loop = self._trainer_loop = TrainerLoop(trainer, pl_module)
        return loop

    def _begin(self, loop: Loop) -> None:
        """A fit begins (before the model is configured)."""

    def _start(self, loop: Loop) -> None:
        """Training starts (after setup and any sanity check)."""

    def _epoch_start(self, loop: Loop) -> None: ...

    def _batch_start(self, loop: Loop, batch: Any) -> None: ...

    def _phase(self, loop: Loop, name: str) -> None:
        """A phase of the step starts: ``"zero_grad"``, ``"backward"`` or ``"optimizer step"``."""

    def _after_backward(self, loop: Loop) -> None: ...

    def _batch_end(self, loop: Loop, batch: Any) -> None: ...

    def _epoch_end(self, loop: Loop) -> None: ...

    def _end(self, loop: Loop) -> None:
        """Training ends."""

    def _validation_start(self, loop: Loop) -> None: ...

    def _validation_batch_start(self, loop: Loop, batch_idx: int) -> None: ...

    def _validation_batch_end(self, loop: Loop) -> None: ...

    def _validation_end(self, loop: Loop, fitting: bool) -> None:
        """A validation run ends; ``fitting``: inside fit, so training resumes."""

    def _release(self) -> None:
        """Free what ``_begin`` acquired (threads, NVML handles, CUDA events, hooks)."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._begin(self._loop(trainer, pl_module))

    # Lightning passes each hook's arguments by position: ``_relay`` picks the ones the event takes
    on_train_start = _relay("_start")
    on_train_epoch_start = _relay("_epoch_start")
    on_train_batch_start = _relay("_batch_start", 0)
    on_before_zero_grad = _relay("_phase", const="zero_grad")
    on_before_backward = _relay("_phase", const="backward")
    on_after_backward = _relay("_after_backward")
    on_before_optimizer_step = _relay("_phase", const="optimizer step")
    on_train_batch_end = _relay("_batch_end", 1)
    on_train_epoch_end = _relay("_epoch_end")
    on_train_end = _relay("_end")
    on_validation_start = _relay("_validation_start")
    on_validation_batch_start = _relay("_validation_batch_start", 1)
    on_validation_batch_end = _relay("_validation_batch_end")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking
        self._validation_end(self._loop(trainer, pl_module), fitting)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer_loop = None
        self._release()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._trainer_loop = None
        self._release()
