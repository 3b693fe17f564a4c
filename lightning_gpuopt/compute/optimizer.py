"""``FusedOptimizer``: switch the run's optimizers to their fused kernels, so ``16-mixed``'s GradScaler never
makes the host wait for the GPU, and give a fused SGD zeroed momentum buffers (docs/compute.md says why)."""

from __future__ import annotations

import inspect
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from typing_extensions import override

from lightning_gpuopt._common import warn_once
from lightning_gpuopt._compat import set_amp_scaling, supports_amp_scaling

__all__ = ["FUSED_OPTIMIZERS", "FusedOptimizer", "fuse_optimizer", "init_momentum_buffers", "is_fused"]

#: torch.optim classes with a fused kernel (``fused=True``) that takes the GradScaler's scale and inf flag.
FUSED_OPTIMIZERS: tuple[str, ...] = ("SGD", "Adam", "AdamW", "Adagrad")


#: Whether GradScaler steps an optimizer without a host sync (the optimizer unscales and skips on device).
is_fused = supports_amp_scaling


def init_momentum_buffers(optimizer: Any) -> int:
    """Give each parameter of a fused ``SGD`` with momentum a zero momentum buffer where it has none, so a
    first step the GradScaler skips leaves zeros rather than uninitialized memory; return how many were made.

    Call it after the model's final layout is set (``channels_last``) and before the first step.

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
    """Switch ``optimizer`` to its fused kernel in place, once a throwaway ``fused=True`` instance of its class
    over the same groups is accepted by torch; return ``None``, or why it was left alone.

    ``amp_scaling=False`` (no GradScaler, as ``bf16-mixed``) leaves it marked as not unscaling inside its
    step, so Lightning's gradient clipping still accepts it.
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
    for settings in (*inner.param_groups, inner.defaults):
        settings.update(fused=True, foreach=None)  # fused and foreach are exclusive
    set_amp_scaling(inner, amp_scaling and supports_amp_scaling(probe))
    return None


class FusedOptimizer(pl.Callback):
    """Run the Trainer's optimizers with their fused kernels (no per-step host sync under ``16-mixed``),
    switched at ``on_train_start``; a fused SGD with momentum gets zero buffers before its first step.

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
        for opt in (o for o in optimizers if not is_fused(o)):
            name = type(getattr(opt, "optimizer", opt)).__name__
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
        # once an optimizer: after every layout change, before its step
        inner = getattr(optimizer, "optimizer", optimizer)
        if id(inner) not in self._buffers_ready:
            self._buffers_ready.add(id(inner))
            init_momentum_buffers(inner)

    @override
    def state_dict(self) -> dict[str, Any]:
        """What was switched and skipped in the last fit (a resumed fit switches again)."""
        return {"fused": list(self.fused), "skipped": [list(s) for s in self.skipped]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.fused = list(state_dict.get("fused", []))
        self.skipped = [(str(a), str(b)) for a, b in state_dict.get("skipped", [])]
