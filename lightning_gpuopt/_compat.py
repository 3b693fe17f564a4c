"""The private torch and Lightning internals the package relies on, each behind one function that falls back
to public behaviour, warning once, where one is missing; ``missing_internals()`` lists those missing."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_gpuopt._common import warn_once

#: torch releases these internals were checked against (``tests/test_compat.py`` checks the installed one).
TESTED_TORCH = ">=2.4,<2.14"


# ``module:object.attribute``; what each is used for: the docstring of the function below that uses it
_INTERNALS: tuple[str, ...] = (
    "torch.utils.data:DataLoader._index_sampler",
    "torch.utils.data:DataLoader._auto_collation",
    "torch.utils.data:DataLoader._iterator",
    "torch.utils.data.dataloader:_MultiProcessingDataLoaderIter._shutdown_workers",
    "torch:UntypedStorage._new_shared",
    "torch.optim:SGD._step_supports_amp_scaling",
    "torch.cpu:_is_avx512_bf16_supported",
    "torch.cpu:_is_amx_tile_supported",
    "lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop._broadcast_sigterm_tensor",
    "torch:ops.aten._upsample_bilinear2d_aa.out",
    "lightning.pytorch.trainer.connectors.signal_connector:_SignalConnector._sigterm_notifier_fn",
    "torch.amp:GradScaler._get_scale_async",
    "torch._utils:ExceptionWrapper",
    "torch._dynamo.utils:counters",
    "torch._inductor.cudagraph_utils:cudagraphs_log",
)
# attributes ``__init__`` sets: looked up on an instance
_INSTANCES: dict[str, Callable[[], Any]] = {
    "torch.utils.data:DataLoader._iterator": lambda: DataLoader([]),  # type: ignore[arg-type]
    "torch.optim:SGD._step_supports_amp_scaling": lambda: torch.optim.SGD(
        [torch.zeros(1, requires_grad=True)], lr=0.1, fused=True
    ),
}


def missing_internals() -> list[str]:
    """Every relied-on internal this torch or Lightning lacks (empty on a tested one)."""
    missing = []
    for path in _INTERNALS:
        module, _, names = path.partition(":")
        *owner, attribute = names.split(".")
        try:
            target: Any = importlib.import_module(module)
            for name in owner:
                target = getattr(target, name)
            found = hasattr(_INSTANCES[path]() if path in _INSTANCES else target, attribute)
        except (ImportError, AttributeError, RuntimeError, TypeError, ValueError):
            found = False
        if not found:
            missing.append(path)
    return missing


def _fallback(what: str) -> None:
    warn_once(
        f"lightning-gpuopt: this torch ({torch.__version__}) lacks {what}; falling back to slower public "
        f"behaviour. lightning-gpuopt was checked against torch {TESTED_TORCH}."
    )


def repeat_index_sampler(loader: DataLoader, wrap: Any) -> Any:
    """For ``ContinuousDataLoader._index_sampler``: ``wrap(batch_sampler)`` under automatic batching, else
    DataLoader's own index sampler."""
    sampler = DataLoader._index_sampler.fget(loader)  # type: ignore[attr-defined]
    if getattr(loader, "_auto_collation", False) and sampler is loader.batch_sampler:
        return wrap(sampler)
    return sampler


def persistent_iterator(loader: DataLoader) -> Any:
    """The iterator ``persistent_workers=True`` keeps alive between epochs, or ``None``."""
    return getattr(loader, "_iterator", None)


def drop_persistent_iterator(loader: DataLoader) -> None:
    """Drop the iterator ``persistent_workers=True`` keeps, so its workers shut down."""
    if hasattr(loader, "_iterator"):
        loader._iterator = None  # type: ignore[attr-defined]


def shutdown_workers(iterator: Any) -> None:
    """Stop a multi-process DataLoader iterator's workers now rather than at garbage collection."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()


def worker_error_message(text: str, error: type[BaseException]) -> str | None:
    """The message an exception of type ``error`` had in a DataLoader worker, read from the text
    ``torch._utils.ExceptionWrapper.reraise`` re-raises it with; ``None`` for any other text."""
    if not text.startswith(f"Caught {error.__name__} "):
        return None
    module = error.__module__
    name = error.__qualname__ if module in ("builtins", "__main__") else f"{module}.{error.__qualname__}"
    last = text.rstrip().rpartition("\n")[2]
    return last[len(name) + 2 :] if last.startswith(f"{name}: ") else None


def shared_uint8(numel: int) -> torch.Tensor:
    """A flat uint8 tensor in shared memory (as ``default_collate`` allocates inside a worker)."""
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
    if new_shared is None:
        _fallback("UntypedStorage._new_shared (batches are copied once more)")
        return torch.empty(numel, dtype=torch.uint8)
    return torch.empty(0, dtype=torch.uint8).set_(new_shared(numel))


def resize_rgb_uint8(pixels: Any, height: int, width: int) -> Any:
    """Antialiased bilinear resize of a uint8 ``(H, W, 3)`` numpy image to ``(height, width, 3)``, written
    interleaved by ``F.interpolate(..., antialias=True)``'s kernel."""
    from torch.nn import functional as F

    nchw = torch.from_numpy(pixels).permute(2, 0, 1).unsqueeze(0)  # a channels_last view of the pixels
    out_overload = getattr(getattr(torch.ops.aten, "_upsample_bilinear2d_aa", None), "out", None)
    if out_overload is None:
        _fallback("aten._upsample_bilinear2d_aa.out (each resize is copied once more)")
        resized = F.interpolate(nchw, (height, width), mode="bilinear", antialias=True, align_corners=False)
        return resized[0].permute(1, 2, 0).contiguous().numpy()
    out = torch.empty((height, width, 3), dtype=torch.uint8)
    out_overload(nchw, [height, width], False, None, None, out=out.permute(2, 0, 1).unsqueeze(0))
    return out.numpy()


def supports_amp_scaling(optimizer: Any) -> bool:
    """Whether ``GradScaler.step`` hands the scale to ``optimizer`` (fused) instead of syncing the host."""
    inner = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer wraps the torch optimizer
    return bool(getattr(inner, "_step_supports_amp_scaling", False))


def set_amp_scaling(optimizer: Any, value: bool) -> None:
    """Mark ``optimizer`` as unscaling inside its step, as ``__init__`` does for ``fused=True``."""
    optimizer._step_supports_amp_scaling = value


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX); ``False`` where torch cannot tell."""
    names = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(p()) for p in (getattr(torch.cpu, n, None) for n in names) if callable(p))


def replace_sigterm_check(trainer: Any, check: Callable[[], None]) -> bool:
    """Make ``trainer``'s training loop call ``check()`` where Lightning broadcasts rank zero's SIGTERM flag at
    every step; return whether it was replaced (``False``, warning once, where the loop lacks the method)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if loop is None or not callable(getattr(type(loop), "_broadcast_sigterm_tensor", None)):
        _fallback("Lightning's _TrainingEpochLoop._broadcast_sigterm_tensor (DDP keeps a host sync per step)")
        return False
    loop._broadcast_sigterm_tensor = check
    return True


class _SigtermNotifier:
    """Lightning's SIGTERM notifier without its broadcast: it forwards the signal and sets the flag."""

    def __init__(self, connector: Any) -> None:
        self.connector = connector

    def __call__(self, signum: Any, frame: Any) -> None:
        connector = self.connector
        if not connector.received_sigterm:
            launcher = getattr(connector.trainer.strategy, "launcher", None)
            if launcher is not None:
                launcher.kill(signum)
        connector.received_sigterm = True


def drop_sigterm_broadcast(trainer: Any) -> bool:
    """Take the broadcast out of the SIGTERM handler Lightning registered for ``trainer``'s fit: issued from a
    signal handler mid-step it can hang the run, and the per-step check carries the flag; return whether it
    was taken out (``False``, warning once where Lightning lacks the handler)."""
    import signal
    import threading

    connector = getattr(trainer, "_signal_connector", None)
    notifier = getattr(type(connector), "_sigterm_notifier_fn", None) if connector is not None else None
    if notifier is None or threading.current_thread() is not threading.main_thread():
        _fallback("Lightning's _SignalConnector._sigterm_notifier_fn (its SIGTERM handler broadcasts)")
        return False
    handlers = getattr(signal.getsignal(signal.SIGTERM), "signal_handlers", None)
    if not isinstance(handlers, list):
        return False  # no handler of Lightning's registered (Windows): nothing broadcasts
    for i, handler in enumerate(handlers):
        if getattr(handler, "__func__", None) is notifier and getattr(handler, "__self__", None) is connector:
            handlers[i] = _SigtermNotifier(connector)
            return True
    return False


def async_scale_reader(scaler: Any) -> Callable[[], Any] | None:
    """``scaler``'s ``_get_scale_async`` (its scale without a host sync), or ``None`` where torch lacks it."""
    get = getattr(scaler, "_get_scale_async", None)
    return get if callable(get) else None


def _dynamo_counter(group: str, name: str) -> int | None:
    try:
        counters: Any = importlib.import_module("torch._dynamo.utils").counters
    except (ImportError, AttributeError):
        counters = None
    if counters is None:
        _fallback("torch._dynamo.utils.counters (whether compiled steps replay CUDA graphs is not known)")
        return None
    return int(counters[group][name])


def cudagraph_skip_count() -> int | None:
    """How often torch has skipped CUDA graphs in this process, or ``None`` where it keeps no such count."""
    return _dynamo_counter("inductor", "cudagraph_skips")


def compiled_frame_count() -> int | None:
    """How many frames dynamo has compiled in this process, or ``None`` where it keeps no such count."""
    return _dynamo_counter("frames", "ok")


def cudagraph_skip_logger() -> logging.Logger | None:
    """The logger torch writes each CUDA graph skip's reason to, or ``None`` where it has none known."""
    try:
        utils = importlib.import_module("torch._inductor.cudagraph_utils")
    except ImportError:
        return None
    # the name torch gives it, then the one of older releases
    logs = (getattr(utils, name, None) for name in ("cudagraphs_log", "perf_hint_log"))
    return next((log for log in logs if isinstance(log, logging.Logger)), None)
