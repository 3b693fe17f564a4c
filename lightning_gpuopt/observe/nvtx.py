"""NVTX ranges for Nsight Systems: training step, data wait, forward, backward, optimizer step, validation.

What appears on the timeline, and the ``nsys`` command that records only a capture window: docs/nvtx.md.
"""

from __future__ import annotations

import threading
from typing import Any, cast, get_args

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_gpuopt._checks import check_arg, check_bool, check_choice, check_int
from lightning_gpuopt._common import warn_once
from lightning_gpuopt.observe._lifecycle import Loop, ObserverCallback, TrainerLoop
from lightning_gpuopt.observe.nvtx_backends import DEFAULT_DOMAIN, BackendName, make_backend

__all__ = ["PHASE_COLORS", "NVTXRanges", "RangeStack", "add_module_ranges", "make_backend"]

# ARGB colors per phase, so the phases are told apart at a glance in the Nsight Systems timeline.
PHASE_COLORS: dict[str, int] = {
    "step": 0xFF76B900,  # NVIDIA green
    "data wait": 0xFFE53935,  # red: the GPU may be starving here
    "forward": 0xFF1E88E5,
    "zero_grad": 0xFF9E9E9E,
    "backward": 0xFF8E24AA,
    "optimizer step": 0xFFFB8C00,
    "validation": 0xFF00897B,
    "validation step": 0xFF26A69A,
    "module": 0xFF5C6BC0,
    "capture": 0xFFFFEB3B,
}

_BACKENDS: tuple[str, ...] = get_args(BackendName)


class RangeStack:
    """Push/pop NVTX ranges while remembering, per thread, which ones this object opened.

    Every entry is ``(kind, key)``; ``close(kind)`` pops down to and including the topmost entry of that kind,
    so a caller can always restore the balance a pop on the wrong thread or a missing pop would break.

    Args:
        backend: an object from ``make_backend``.

    Example:
        >>> ranges = RangeStack(make_backend("auto"))  # doctest: +SKIP
        >>> ranges.push("step 0", "step"); ranges.push("forward", "phase")  # doctest: +SKIP
        >>> ranges.close("step")  # pops "forward" and "step"  # doctest: +SKIP
        True
    """

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        #: False when the backend records nothing (see ``make_backend``).
        self.enabled: bool = getattr(backend, "enabled", True)
        self._local = threading.local()

    def _stack(self) -> list[tuple[str, Any]]:
        return self._local.__dict__.setdefault("stack", [])  # type: ignore[no-any-return]

    @property
    def depth(self) -> int:
        """Ranges this object holds open on the calling thread."""
        return len(self._stack())

    def is_open(self, kind: str) -> bool:
        return any(k == kind for k, _ in self._stack())

    def push(
        self, message: str, kind: str, key: Any = None, cache: bool = True, color: int | None = None
    ) -> None:
        """Open a range named ``message``; ``color`` defaults to ``PHASE_COLORS[kind]``.

        ``cache=False`` for names that are not repeated (``step 123``) so no per-name cache grows.
        """
        self.backend.push(
            message, PHASE_COLORS.get(kind, PHASE_COLORS["module"]) if color is None else color, cache
        )
        self._stack().append((kind, key))

    def close(self, kind: str, key: Any = None, match_key: bool = False) -> bool:
        """Pop down to and including the topmost ``kind`` entry (and ``key`` if ``match_key``).

        Returns False, popping nothing, when no such entry is open on this thread.
        """
        stack = self._stack()
        for i in range(len(stack) - 1, -1, -1):
            k, kk = stack[i]
            if k == kind and (not match_key or kk is key):
                while len(stack) > i:
                    stack.pop()
                    self.backend.pop()
                return True
        return False

    def close_all(self) -> int:
        """Pop every range this object opened on the calling thread; returns how many."""
        stack = self._stack()
        n = len(stack)
        while stack:
            stack.pop()
            self.backend.pop()
        return n

    def mark(self, message: str, kind: str = "capture") -> None:
        self.backend.mark(message, PHASE_COLORS.get(kind, PHASE_COLORS["module"]))


def add_module_ranges(root: nn.Module, depth: int, ranges: RangeStack) -> list[RemovableHandle]:
    """Wrap the forward of every submodule of ``root`` down to ``depth`` in a range named by its path.

    ``depth=1`` covers the direct children (``layer1``), ``depth=3`` reaches ``layer1.0.conv1``. The closing
    hook also runs when forward raises (``always_call``). Nothing is hooked when ``ranges`` records nothing:
    a module hook costs every forward call.

    Returns:
        the hook handles; call ``handle.remove()`` on each to undo.
    """
    handles: list[RemovableHandle] = []
    if not ranges.enabled:
        return handles
    for name, module in root.named_modules():
        if not name or name.count(".") >= depth:
            continue

        def pre_hook(mod: nn.Module, args: Any, _name: str = name) -> None:
            ranges.push(_name, "module", mod)

        def post_hook(mod: nn.Module, args: Any, output: Any) -> None:
            # pops this module's own entry (a no-op when on_exception already closed everything)
            ranges.close("module", key=mod, match_key=True)

        handles.append(module.register_forward_pre_hook(pre_hook))
        handles.append(module.register_forward_hook(post_hook, always_call=True))
    return handles


class NVTXRanges(ObserverCallback):
    """Named, nested NVTX ranges for each training step and its phases, for Nsight Systems.

    With ``start_step``/``stop_step`` it calls ``torch.cuda.profiler.start()``/``stop()`` around those steps
    (on a CPU run it only marks them). The layout and the ``nsys`` command: docs/nvtx.md. Without NVTX it
    warns once and does nothing.

    Args:
        module_depth: also wrap each submodule's forward down to this depth below ``module_root`` in a range
            named by its path (0 = off; 1 = ``layer1``; 3 = ``layer1.0.conv1``).
        module_root: dotted attribute path of the submodule of the LightningModule whose children are
            counted from depth 1 (``""`` = the LightningModule itself; ``"model"`` for ``ImageClassifier``).
        start_step: first ``global_step`` of the capture window (None = no window).
        stop_step: ``global_step`` at which capture stops (exclusive; required with ``start_step``).
        phases: emit forward/zero_grad/backward/optimizer step inside each step.
        data_wait: emit "data wait" between steps.
        validation: emit validation ranges.
        backend: ``"auto"``, ``"nvtx"`` or ``"torch"`` (see ``make_backend``).
        domain: NVTX domain name for the ``nvtx`` backend.

    Example:
        >>> ranges = NVTXRanges(module_depth=1, module_root="model", start_step=100, stop_step=110)
        >>> trainer = pl.Trainer(callbacks=[ranges])  # doctest: +SKIP
    """

    def __init__(
        self,
        module_depth: int = 0,
        module_root: str = "",
        start_step: int | None = None,
        stop_step: int | None = None,
        phases: bool = True,
        data_wait: bool = True,
        validation: bool = True,
        backend: BackendName = "auto",
        domain: str = DEFAULT_DOMAIN,
    ) -> None:
        check_int(module_depth, "module_depth", low=0, fix="0 turns module ranges off")
        check_arg(
            isinstance(module_root, str),
            "module_root",
            module_root,
            "a dotted attribute path str such as 'model'",
            error=TypeError,
        )
        check_int(start_step, "start_step", low=0, none_ok=True)
        check_int(stop_step, "stop_step", low=0, none_ok=True)
        check_arg(
            (start_step is None) == (stop_step is None),
            "start_step and stop_step",
            (start_step, stop_step),
            "both given or both None",
            fix="e.g. start_step=100, stop_step=110",
        )
        if start_step is not None and stop_step is not None:
            check_arg(
                stop_step > start_step, "stop_step", stop_step, f"greater than start_step ({start_step})"
            )
        for name, value in (("phases", phases), ("data_wait", data_wait), ("validation", validation)):
            check_bool(value, name)
        check_choice(backend, "backend", _BACKENDS)
        check_arg(isinstance(domain, str), "domain", domain, "a non-empty str", error=TypeError)
        check_arg(bool(domain), "domain", domain, "a non-empty str", fix=f"e.g. {DEFAULT_DOMAIN!r}")
        self.module_depth = module_depth
        self.module_root = module_root
        self.start_step = start_step
        self.stop_step = stop_step
        self.phases = phases
        self.data_wait = data_wait
        self.validation = validation
        self.backend = backend
        self.domain = domain
        #: the range stack in use between ``setup`` and ``teardown`` (None outside)
        self.ranges: RangeStack | None = None
        self._handles: list[RemovableHandle] = []
        self._capturing = False
        self._cuda_capture = False

    # ranges for every stage; module ranges once the model is configured (fit: at training or validation start)
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._begin(TrainerLoop(trainer, pl_module))

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._add_module_hooks(pl_module)

    on_predict_start = on_test_start

    def _begin(self, loop: Loop) -> None:
        if self.ranges is None:
            self.ranges = RangeStack(make_backend(self.backend, self.domain))
        self._capturing = False

    def _start(self, loop: Loop) -> None:
        self._add_module_hooks(loop.module)

    def _add_module_hooks(self, root_module: nn.Module) -> None:
        if self.module_depth == 0 or self._handles or self.ranges is None:
            return
        root: nn.Module | None = root_module
        if self.module_root:
            try:
                root = root_module.get_submodule(self.module_root)
            except AttributeError:
                root = None
        check_arg(
            root is not None,
            "module_root",
            self.module_root,
            f"the dotted attribute path of a submodule of {type(root_module).__name__}",
            fix="e.g. 'model'",
        )
        self._handles = add_module_ranges(cast(nn.Module, root), self.module_depth, self.ranges)

    def _close_everything(self) -> None:
        if self.ranges is not None:
            self.ranges.close_all()
        self._stop_capture()

    def _release(self) -> None:
        self._close_everything()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.ranges = None

    def _start_capture(self, loop: Loop) -> None:
        if self.start_step is None or self.stop_step is None or self._capturing or self.ranges is None:
            return
        step = loop.global_step
        if not self.start_step <= step < self.stop_step:
            return
        self._capturing = True
        self._cuda_capture = loop.device.type == "cuda"
        if self._cuda_capture:
            torch.cuda.profiler.start()
        else:
            warn_once(
                "NVTXRanges: start_step/stop_step call cudaProfilerStart/Stop, which needs a CUDA device; "
                "on this run the window is only marked in the NVTX timeline.",
            )
        self.ranges.mark(f"capture start (step {step})")

    def _stop_capture(self, loop: Loop | None = None) -> None:
        if not self._capturing:
            return
        self._capturing = False
        if self.ranges is not None:
            step = "" if loop is None else f" (step {loop.global_step})"
            self.ranges.mark(f"capture stop{step}")
        if self._cuda_capture:
            torch.cuda.profiler.stop()
            self._cuda_capture = False

    def _live(self) -> RangeStack | None:
        """The range stack where it records something: without a tool attached the hooks only run the capture
        window."""
        ranges = self.ranges
        return ranges if ranges is not None and ranges.enabled else None

    def _close(self, kind: str) -> None:
        if (ranges := self._live()) is not None:
            ranges.close(kind)

    def _phase(self, loop: Loop, name: str) -> None:
        ranges = self._live()
        if ranges is not None and self.phases and ranges.is_open("step"):
            ranges.close("phase")
            ranges.push(name, "phase", name, color=PHASE_COLORS[name])

    def _after_backward(self, loop: Loop) -> None:
        self._close("phase")

    def _open_data_wait(self) -> None:
        ranges = self._live()
        if ranges is not None and self.data_wait and not ranges.is_open("data wait"):
            ranges.push("data wait", "data wait")

    def _epoch_start(self, loop: Loop) -> None:
        # Creating the dataloader iterator (worker start-up) is part of waiting for the first batch.
        self._open_data_wait()

    def _batch_start(self, loop: Loop, batch: Any) -> None:
        self._close("data wait")
        # Leftovers of an interrupted batch (a batch skipped by returning -1 has no batch_end) are closed
        # before the new step opens, so steps never nest.
        self._close("step")
        self._start_capture(loop)
        if (ranges := self._live()) is not None:
            ranges.push(f"step {loop.global_step}", "step", cache=False)
            if self.phases:
                ranges.push("forward", "phase", "forward", color=PHASE_COLORS["forward"])

    def _batch_end(self, loop: Loop, batch: Any) -> None:
        self._close("step")
        if self.stop_step is not None and loop.global_step >= self.stop_step:
            self._stop_capture(loop)
        self._start_capture(loop)  # so the data wait before the first captured step is in the window
        self._open_data_wait()

    def _end(self, loop: Loop) -> None:
        self._close_everything()

    def _epoch_end(self, loop: Loop) -> None:
        # "step" is still open when a LightningModule.on_train_batch_start returned -1 (ends the epoch).
        self._close("step")
        self._close("data wait")

    def _validation_start(self, loop: Loop) -> None:
        self._add_module_hooks(loop.module)
        self._close("data wait")
        if (ranges := self._live()) is not None and self.validation:
            ranges.push("validation", "validation")

    def _validation_batch_start(self, loop: Loop, batch_idx: int) -> None:
        if (ranges := self._live()) is not None and self.validation:
            ranges.close("validation step")
            ranges.push(f"validation step {batch_idx}", "validation step", cache=False)

    def _validation_batch_end(self, loop: Loop) -> None:
        self._close("validation step")

    def _validation_end(self, loop: Loop, fitting: bool) -> None:
        """A validation run ends; inside fit (``fitting``) the wait for the next training batch starts."""
        self._close("validation")
        if fitting:
            self._open_data_wait()

    def __getstate__(self) -> dict[str, Any]:
        # picklable (spawn launchers): ranges and hook handles are per process and rebuilt in setup
        return {**self.__dict__, "ranges": None, "_handles": []}
