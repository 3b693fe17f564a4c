"""``FusedOptimizer``: switch the run's optimizers to their fused kernels, so 16-mixed never syncs the host.

Under ``precision="16-mixed"`` Lightning steps every optimizer through a GradScaler. For an ordinary
optimizer the scaler reads the inf/NaN flag on the host (``found_inf.item()``) before ``optimizer.step()``:
the host waits for the GPU at every step, and whatever it does before the next step's first kernel leaves
the GPU idle. A fused optimizer (``fused=True``: ``SGD``, ``Adam``, ``AdamW``, ``Adagrad``) takes the scale
and the flag as device tensors and skips a bad step on the GPU, so the host runs ahead. The host work of
a fed pipeline then overlaps the GPU's step instead of following it (``docs/compute.md`` has the figures).

``fused=True`` in your ``configure_optimizers`` is the direct fix. This callback does it for optimizers you
do not construct yourself (a library's module, a LightningCLI ``optimizer:`` entry): at ``on_train_start``
(after ``configure_optimizers`` and after a checkpoint's optimizer state is restored) each optimizer whose
class takes ``fused`` is switched in place, after torch has validated the switch on a throwaway instance of
the same class with the same parameters and settings. The optimizer's state (momentum buffers, Adam moments)
is the same for both kernels and is kept. Optimizers that cannot be fused (other classes, parameters on a
device or dtype without fused kernels, ``differentiable=True``) are left alone and named in one warning;
so is everything when Lightning would refuse it: gradient clipping (``gradient_clip_val``) under a
mixed-precision plugin, whose ``clip_gradients`` rejects optimizers that unscale inside their step.

A fused ``SGD`` with momentum creates its momentum buffers uninitialized (``torch.empty_like``) at its first
step and fills them in the kernel; when the GradScaler skips that step (fp16's first steps often overflow
at the scaler's initial scale), the kernel returns first and the buffers keep whatever memory held, which
the next step reads as momentum: the weights turn to NaN and every later step is skipped. Before a fused
SGD's first step the callback gives each parameter a zero buffer (``init_momentum_buffers``), which with
``dampening=0`` makes the first applied step exactly torch's (buffer = gradient); an SGD with another
``dampening`` is left unfused under a GradScaler.
"""

from __future__ import annotations

import inspect
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from typing_extensions import override

from lightning_gpuopt._common import warn_once
from lightning_gpuopt._compat import supports_amp_scaling

__all__ = ["FUSED_OPTIMIZERS", "FusedOptimizer", "fuse_optimizer", "init_momentum_buffers", "is_fused"]

#: torch.optim classes with a fused kernel (``fused=True``) that takes the GradScaler's scale and inf flag.
FUSED_OPTIMIZERS: tuple[str, ...] = ("SGD", "Adam", "AdamW", "Adagrad")


def is_fused(optimizer: Any) -> bool:
    """Whether GradScaler steps ``optimizer`` without a host sync (the optimizer unscales and skips on device)."""
    return supports_amp_scaling(optimizer)


def _set_amp_scaling(optimizer: torch.optim.Optimizer, value: bool) -> None:
    # The flag GradScaler and Lightning read (``supports_amp_scaling``); ``__init__`` sets it for fused=True,
    # so an optimizer switched afterwards needs it set here.
    optimizer._step_supports_amp_scaling = value  # type: ignore[attr-defined]


def init_momentum_buffers(optimizer: Any) -> int:
    """Give each parameter of a fused ``SGD`` with momentum a zero momentum buffer where it has none; return
    how many were made (0 for any other optimizer, or once the buffers exist).

    Call it after the model's final layout is set (``channels_last``) and before the first step: a buffer
    takes its parameter's strides, as the gradients do. With ``dampening=0`` (SGD's default) the first step
    that applies then stores the gradient as the buffer, exactly as torch's first step does, and a first
    step the GradScaler skips leaves zeros instead of uninitialized memory.

    Example::

        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
        init_momentum_buffers(opt)   # before scaler.step(opt) is first called
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, torch.optim.SGD):
        return 0
    made = 0
    for group in (g for g in inner.param_groups if g.get("fused") and g.get("momentum", 0) != 0):
        for p in group["params"]:
            state = inner.state[p]
            if p.requires_grad and state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                made += 1
    return made


def fuse_optimizer(optimizer: torch.optim.Optimizer, amp_scaling: bool = True) -> str | None:
    """Switch ``optimizer`` to its fused kernel in place; return ``None``, or why it was left alone.

    torch validates the switch first: a throwaway optimizer of the same class is built over the same
    parameter groups with ``fused=True`` (no state, no step), which raises where fused kernels do not apply.
    ``amp_scaling=False`` (a run without a GradScaler, such as ``bf16-mixed``) keeps the optimizer marked as
    one that does not unscale inside its step, so Lightning's gradient clipping still accepts it.
    """
    inner: Any = getattr(optimizer, "optimizer", optimizer)
    cls = type(inner)
    if is_fused(inner) or (not amp_scaling and getattr(inner, "defaults", {}).get("fused")):
        return None
    if not isinstance(inner, torch.optim.Optimizer):
        return f"{cls.__name__} is not a torch.optim.Optimizer"
    try:
        accepted = set(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        accepted = set()
    if "fused" not in accepted or "fused" not in inner.defaults:
        return f"{cls.__name__} has no fused kernel (torch has them for {', '.join(FUSED_OPTIMIZERS)})"
    if (
        amp_scaling
        and isinstance(inner, torch.optim.SGD)
        and any(g.get("momentum", 0) != 0 and g.get("dampening", 0) != 0 for g in inner.param_groups)
    ):
        return (
            "SGD with dampening: a fused SGD's momentum is lost on a first step the GradScaler skips, and zero "
            "buffers reproduce torch's first step only with dampening=0"
        )
    groups = [{k: v for k, v in g.items() if k not in ("fused", "foreach")} for g in inner.param_groups]
    # only what __init__ takes (AdamW keeps a `decoupled_weight_decay` default it does not accept)
    defaults = {k: v for k, v in inner.defaults.items() if k in accepted and k not in ("fused", "foreach")}
    try:
        probe = cls(groups, **{**defaults, "fused": True})
    except (RuntimeError, ValueError, TypeError) as err:
        return f"{cls.__name__} cannot be fused here: {err}"
    for group in inner.param_groups:
        group["fused"] = True
        group["foreach"] = None  # fused and foreach are exclusive
    inner.defaults["fused"] = True
    inner.defaults["foreach"] = None
    _set_amp_scaling(inner, amp_scaling and supports_amp_scaling(probe))
    return None


class FusedOptimizer(pl.Callback):
    """Run the Trainer's optimizers with their fused kernels (no per-step host sync under ``16-mixed``).

    Add it to ``Trainer(callbacks=[...])`` (``fast_trainer_kwargs`` adds it when it picks ``"16-mixed"``, and
    ``"bf16-mixed"`` on CUDA). Without a GradScaler (``bf16-mixed``, ``32-true``) there is no host sync to
    remove: the fused kernel updates each parameter group in one launch, and gradient clipping keeps working.
    After fitting, ``fused`` lists the optimizers switched (class names) and ``skipped`` those left alone
    with the reason (also named in one warning). An optimizer already fused is kept; a fused SGD with momentum,
    switched here or constructed so, gets zero momentum buffers before its first step
    (``init_momentum_buffers``).

    Example::

        trainer = Trainer(precision="16-mixed", callbacks=[FusedOptimizer()])
        trainer.fit(model)   # configure_optimizers returned SGD(...); it steps with fused=True
    """

    def __init__(self) -> None:
        self.fused: list[str] = []
        self.skipped: list[tuple[str, str]] = []
        self._buffers_ready: set[int] = set()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.fused, self.skipped = [], []
        self._buffers_ready = set()
        optimizers = list(trainer.optimizers)
        clip = trainer.gradient_clip_val
        plugin = trainer.precision_plugin
        mixed = isinstance(plugin, MixedPrecision)
        scaled = mixed and getattr(plugin, "scaler", None) is not None
        # bf16-mixed: Lightning's MixedPrecision refuses to clip for an optimizer marked as unscaling itself
        amp_scaling = scaled or not mixed
        if clip and float(clip) > 0 and scaled:
            pending = [type(getattr(o, "optimizer", o)).__name__ for o in optimizers if not is_fused(o)]
            if pending:
                self.skipped = [(name, "gradient clipping under mixed precision") for name in pending]
                warn_once(
                    f"FusedOptimizer: left {', '.join(pending)} unfused: Lightning refuses gradient clipping "
                    f"(gradient_clip_val={clip}) with optimizers that unscale inside their step under mixed "
                    'precision. Drop clipping to fuse, or use precision="bf16-mixed" (no GradScaler, no sync).'
                )
            return
        for opt in optimizers:
            name = type(getattr(opt, "optimizer", opt)).__name__
            if is_fused(opt):
                continue
            why = fuse_optimizer(opt, amp_scaling=amp_scaling)
            if why is None:
                self.fused.append(name)
            else:
                self.skipped.append((name, why))
        if self.skipped:
            cost = " (the GradScaler syncs the host every step for these)" if scaled else ""
            which = "; ".join(f"{n}: {w}" for n, w in self.skipped)
            warn_once(f"FusedOptimizer: left unfused: {which}{cost}")

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)
        if (
            id(inner) not in self._buffers_ready
        ):  # once an optimizer: after every layout change, before its step
            self._buffers_ready.add(id(inner))
            init_momentum_buffers(inner)

    @override
    def state_dict(self) -> dict[str, Any]:
        """What was switched and skipped in the last fit (the switch itself is made again on resume)."""
        return {"fused": list(self.fused), "skipped": [list(s) for s in self.skipped]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.fused = list(state_dict.get("fused", []))
        self.skipped = [(str(a), str(b)) for a, b in state_dict.get("skipped", [])]
