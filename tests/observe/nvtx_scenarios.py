"""Short CPU (or CUDA) fits with ``NVTXRanges``, run in a subprocess under the NVTX injection recorder.

``python -m tests.observe.nvtx_scenarios [--backend auto|nvtx|torch] [--accelerator cpu|cuda] NAME...``

Each scenario is announced by an NVTX mark in the domain ``scenario`` (default domain for the torch
backend) so the recording can be split per scenario. Failures that a scenario provokes on purpose are
caught here; anything else makes the process exit non-zero.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt.observe.nvtx import NVTXRanges, make_backend


class Boom(nn.Module):
    """ReLU that raises ``exc`` on its next forward when armed."""

    def __init__(self) -> None:
        super().__init__()
        self.exc: BaseException | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exc is not None:
            exc, self.exc = self.exc, None
            raise exc
        return F.relu(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), Boom())
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class Module(pl.LightningModule):
    def __init__(self, **faults: Any) -> None:
        super().__init__()
        self.net = Net()
        self.faults = faults  # batch index -> fault, per kind

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        return -1 if self.faults.get("end_epoch_at") == batch_idx else None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        x, y = batch
        if self.faults.get("step_raises_at") == batch_idx:
            raise self.faults["exc"]
        if self.faults.get("module_raises_at") == batch_idx:
            self.net.body[1].exc = self.faults["exc"]
        loss = F.cross_entropy(self.net(x), y)
        if self.faults.get("none_at") == batch_idx:
            return None
        if self.faults.get("inf_at") == batch_idx:
            loss = loss * float("inf")
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RaiseInHook(pl.Callback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        if trainer.global_step == self.at:
            raise RuntimeError("callback failed on purpose")


def loader(n: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(n * 4, 8, generator=g), torch.randint(0, 2, (n * 4,), generator=g))
    return DataLoader(ds, batch_size=4)


def fit(
    cb: NVTXRanges,
    accelerator: str,
    train_batches: int = 4,
    val_batches: int = 0,
    callbacks: tuple[pl.Callback, ...] = (),
    module: Module | None = None,
    **trainer_kwargs: Any,
) -> pl.Trainer:
    kwargs: dict[str, Any] = {
        "accelerator": accelerator,
        "devices": 1,
        "max_epochs": 1,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": val_batches,
    }
    kwargs.update(trainer_kwargs)
    trainer = pl.Trainer(callbacks=[cb, *callbacks], **kwargs)
    val = loader(max(val_batches, 1)) if val_batches else None
    trainer.fit(module or Module(), loader(train_batches), val)
    return trainer


def _expect_failure(kind: type[BaseException], run: Callable[[], Any]) -> None:
    try:
        run()
    except kind:
        return
    raise SystemExit(f"expected {kind.__name__}")


def scenarios(backend: str, acc: str, mark: Callable[[str], None]) -> dict[str, Callable[[], Any]]:
    def nv(**kw: Any) -> NVTXRanges:
        return NVTXRanges(backend=backend, **kw)  # type: ignore[arg-type]

    def inf_scaler() -> None:
        scaler = torch.amp.GradScaler(acc, init_scale=2.0**8)
        fit(nv(), acc, plugins=[MixedPrecision("16-mixed", acc, scaler=scaler)], module=Module(inf_at=1))
        if scaler.get_scale() < 2.0**8:  # the inf step was skipped and the scale backed off
            mark("scaler skipped a step")

    return {
        "basic": lambda: fit(nv(), acc, val_batches=2, val_check_interval=2, num_sanity_val_steps=1),
        "accumulate": lambda: fit(nv(), acc, accumulate_grad_batches=2),
        "modules": lambda: fit(nv(module_depth=2, module_root="net"), acc, train_batches=2, val_batches=1),
        "max_steps": lambda: fit(nv(), acc, train_batches=8, max_steps=3),
        "end_epoch": lambda: fit(nv(), acc, module=Module(end_epoch_at=2)),
        "skip_none": lambda: fit(nv(), acc, module=Module(none_at=1)),
        "inf_scaler": inf_scaler,
        "capture": lambda: fit(nv(start_step=1, stop_step=3), acc, train_batches=5),
        "error_step": lambda: _expect_failure(
            ValueError, lambda: fit(nv(), acc, module=Module(step_raises_at=1, exc=ValueError("boom")))
        ),
        "error_callback": lambda: _expect_failure(
            RuntimeError, lambda: fit(nv(), acc, callbacks=(RaiseInHook(1),))
        ),
        "error_module": lambda: _expect_failure(
            ValueError,
            lambda: fit(
                nv(module_depth=2, module_root="net"),
                acc,
                module=Module(module_raises_at=1, exc=ValueError("boom")),
            ),
        ),
        # Lightning turns KeyboardInterrupt into on_exception + sys.exit(1) (no teardown hook).
        "interrupt_step": lambda: _expect_failure(
            SystemExit, lambda: fit(nv(), acc, module=Module(step_raises_at=1, exc=KeyboardInterrupt()))
        ),
        "interrupt_module": lambda: _expect_failure(
            SystemExit,
            lambda: fit(
                nv(module_depth=2, module_root="net"),
                acc,
                module=Module(module_raises_at=1, exc=KeyboardInterrupt()),
            ),
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("names", nargs="*")
    args = parser.parse_args(argv)
    # Keep stderr to what the test reads: Lightning's tips and PossibleUserWarnings are noise here.
    warnings.filterwarnings("ignore", message="^(?!NVTXRanges)")
    marker = make_backend(args.backend, "scenario")

    def mark(msg: str) -> None:
        marker.mark(msg, 0xFFFFFFFF)

    table = scenarios(args.backend, args.accelerator, mark)
    for name in args.names or list(table):
        mark(f"scenario {name}")
        table[name]()
    mark("scenario end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
