"""torch.compile on one GPU: both ceilings, the fed rows eager and compiled, the feed's own headroom.

Every model row trains ResNet-50 (batch 256, 224 px) with fp16 autocast + channels_last and fused SGD; the
fits go through ``Trainer(**fast_trainer_kwargs(model, compile=False|True))``:

- ``ceiling_compiled``, ``ceiling_eager``: a plain PyTorch loop on a batch resident on the GPU, the model
  ``torch.compile``d (default mode, ``dynamic=False``) or as it is. ``ceiling_compiled`` runs first (a cold
  compile) and is the ``ratio_to_ceiling`` of every row; ``ratio_to_eager_ceiling`` is against the other.
- ``naive``: the ladder's naive row (``lightning_gpuopt.bench.rows``): ``NaiveImageFolder`` (PIL decode,
  crop, float normalize on the CPU), 0 workers, fp32, NCHW, a plain Trainer; a few short windows.
- ``lightning_eager``, ``lightning+compile``: Lightning on float batches already on the GPU (augmentation
  off); ``lightning+compile+gpu_aug``: the same compiled fit on uint8 canvases already on the GPU
  (``data.layout`` canvas and meta) through ``OptimizedDataModule``'s own ``on_after_batch_transfer``
  (``GPUAugment``: crop, flip, normalize). ``aug_cost = 1 - rate(gpu_aug) / rate(lightning+compile)``.
- ``hdf5``, ``hdf5+compile``: ``OptimizedDataModule(backend="hdf5")`` (``num_workers="auto"``: the store read
  by ``READ_THREADS`` threads of the training process straight into pinned memory) on a uint8 store
  converted from generated 500x375 JPEGs; ``dali``: ``backend="dali"`` with ``DALIOptions(decoder="cpu")``;
  ``dali+compile``: DALI with the library's default decoder (the run prints which one it chose), and
  ``dali_cpu+compile`` / ``dali_gpu+compile`` for the decoders the default did not choose, time permitting.
- ``loader_hdf5``, ``loader_dali_cpu``, ``loader_dali_gpu``: the DataModule's training loader iterated alone
  (``loader_hdf5_threads_<n>``: the store read by ``n`` threads),
  no model, each batch made ready on the GPU (HDF5: pinned host batches staged and augmented on the GPU by
  the loader itself; DALI: decoded on CPU threads or with nvJPEG). Their ``ratio_to_ceiling`` is the feed's
  headroom over the compiled model.
- ``small_4096``, ``small_8192``: eager ``fast_trainer_kwargs`` fits from the HDF5 store (its default) of
  4,096 and 8,192 images, several whole epochs; ``samples_per_sec`` over the epochs after the first, and
  ``boundary_stall_s``: the median over epoch boundaries of (first batch of epoch k+1 done - epoch k done -
  the median step inside an epoch).

Throughput is the median of timed windows after warm-up. ``compile_s`` is a compiled row's first step minus
its eager counterpart's first step (cuDNN autotuning happens in both); each is also printed on a line of its
own. The summary holds ``aug_cost``, the small-dataset figures, the decoder DALI's default chose, what
``should_compile``'s constants are made of (``step_saving``, ``compile_s``, break-even) and ``targets_met``:
``hdf5+compile`` >= 7,000 img/s and >= 0.95 of the compiled ceiling, ``dali+compile`` >= 0.93 of it,
``hdf5+compile`` >= 28x ``naive``, each loader >= 1.3x the compiled ceiling, ``aug_cost`` <= 0.03, and the
eager ``hdf5`` / ``dali`` rows no more than 2% under 0.967 / 0.986 of the eager ceiling.

A time budget (``--budget-s``) skips a row whose expected cost no longer fits (skipped rows stay in the
results with the reason); the results file is rewritten after every row, so an interrupted run leaves what
it measured.

Run on the GPU machine (one command; the default budget of 470 s keeps it under 9 minutes)::

    PYTHONPATH=. python3 benchmarks/gpu_compile.py --out $OUT

Quick check on a CPU (tiny model and images, inductor's C++ kernels; under a minute with a warm cache)::

    PYTHONPATH=. python3 benchmarks/gpu_compile.py --quick --out /tmp/compile_quick
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Generator
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from _shared import QUIET_FIT  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_gpuopt._common import FETCH_SECONDS_ATTR, eval_resize_size, format_table  # noqa: E402
from lightning_gpuopt.bench.ceilings import fill_ratios  # noqa: E402
from lightning_gpuopt.bench.measure import fit, quiet_lightning, write_results  # noqa: E402
from lightning_gpuopt.bench.models import ImageClassifier, build_model  # noqa: E402
from lightning_gpuopt.compute.channels_last import apply_channels_last  # noqa: E402
from lightning_gpuopt.compute.compile import COMPILE_SECONDS, CompileModel, should_compile  # noqa: E402
from lightning_gpuopt.compute.precision import configure_backends  # noqa: E402
from lightning_gpuopt.compute.preset import fast_trainer_kwargs  # noqa: E402
from lightning_gpuopt.data.datamodule import OptimizedDataModule  # noqa: E402

COLUMNS = [
    "name",
    "samples_per_sec",
    "ratio_to_ceiling",
    "ratio_to_eager_ceiling",
    "compile_s",
    "data_wait_frac",
    "decoder",
]
#: the order rows are shown in (they run in another: the targets' rows first)
ORDER = (
    "ceiling_eager",
    "ceiling_compiled",
    "naive",
    "lightning_eager",
    "lightning+compile",
    "lightning+compile+gpu_aug",
    "hdf5",
    "dali",
    "hdf5+compile",
    "dali+compile",
    "dali_cpu+compile",
    "dali_gpu+compile",
    "loader_hdf5",
    "loader_hdf5_threads_1",
    "loader_hdf5_threads_2",
    "loader_hdf5_threads_8",
    "loader_dali_cpu",
    "loader_dali_gpu",
)
# the eager ceiling's share the HDF5 and DALI (decoder="cpu") rows are held to, within 2%
EAGER_REFERENCE = {"hdf5": 0.967, "dali": 0.986}
# errors that end one row and not the run (the reason goes into the results)
ROW_ERRORS = (RuntimeError, OSError, ValueError, TypeError, ImportError)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class _Cfg:
    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        quick = args.quick
        self.device = device
        self.model = "small" if quick else "resnet50"
        self.classes = 10 if quick else 1000
        self.batch = 8 if quick else 256
        self.image = 32 if quick else 224
        self.warmup = 2 if quick else 10
        self.windows = 3
        self.window_steps = 3 if quick else 20
        self.amp = torch.float16 if device.type == "cuda" else torch.bfloat16
        self.precision = "16-mixed" if device.type == "cuda" else "bf16-mixed"
        self.images = 96 if quick else 8192
        self.jpeg_size = (64, 48) if quick else (500, 375)
        self.storage = eval_resize_size(self.image)
        self.workers: int | str = "auto"  # the HDF5 store's reading threads: the library's default
        self.thread_sweep = (1,) if quick else (1, 2, 8)  # loader_hdf5_threads_<n>
        # the naive row makes about one step a second on the GPU machine: a short look is enough
        self.naive_warmup, self.naive_window_steps = (1, 2) if quick else (2, 4)
        # the loader alone: warm-up batches, then windows of this many batches (1.5 epochs of 8,192 images)
        self.loader_warmup, self.loader_steps = (2, 4) if quick else (16, 48)
        # small datasets: image counts (16 and 32 steps an epoch at batch 256) and whole epochs each
        self.small_images = (self.images // 2, self.images)
        self.small_epochs = 4 if quick else 6

    @property
    def steps(self) -> int:
        return self.warmup + self.windows * self.window_steps


class _Budget:
    """Seconds left for the run, and the expected cost of what is still to run."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.t0 = time.perf_counter()
        self.compiles: list[float] = []  # compile seconds measured in this run

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def compile_s(self) -> float:
        """What the next compile is expected to cost: the last one measured here (inductor's caches make a
        later compile of the same graph no slower), else ``COMPILE_SECONDS``."""
        return self.compiles[-1] if self.compiles else COMPILE_SECONDS

    def max_time(self) -> timedelta:
        """A fit's safety net: it stops at the budget's end (the rows take their windows well before)."""
        return timedelta(seconds=max(10.0, self.left()))


# --- the ceiling: a plain loop --------------------------------------------------------------------------
def plain_row(name: str, cfg: _Cfg, compiled: bool) -> dict[str, Any]:
    """The plain loop of ``plain_loop_throughput`` with the first step and the windows timed apart."""
    device = cfg.device
    torch.manual_seed(0)
    model = apply_channels_last(build_model(cfg.model, cfg.classes).to(device))
    x = torch.randn(cfg.batch, 3, cfg.image, cfg.image, device=device).contiguous(
        memory_format=torch.channels_last
    )
    ys = [torch.randint(0, cfg.classes, (cfg.batch,), device=device) for _ in range(8)]
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp == torch.float16)
    loss_fn = nn.CrossEntropyLoss()
    run = torch.compile(model, dynamic=False) if compiled else model
    count = 0

    def step() -> None:
        nonlocal count
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=cfg.amp):
            loss = loss_fn(run(x), ys[count % len(ys)])
        count += 1
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    model.train()
    _sync(device)
    t0 = time.perf_counter()
    step()
    _sync(device)
    first = time.perf_counter() - t0
    for _ in range(cfg.warmup):
        step()
    rates = []
    for _ in range(cfg.windows):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(cfg.window_steps):
            step()
        _sync(device)
        rates.append(cfg.window_steps * cfg.batch / (time.perf_counter() - t0))
    return {
        "name": name,
        "samples_per_sec": statistics.median(rates),
        "windows": rates,
        "first_step_s": first,
        "compiled": compiled,
    }


# --- through Lightning ----------------------------------------------------------------------------------
class _SameBatch(Dataset):
    """One batch on the GPU at every index (``batch_size=None``: the DataLoader passes it untouched)."""

    def __init__(self, x: torch.Tensor, ys: list[torch.Tensor], n: int, meta: torch.Tensor | None = None):
        self.x, self.ys, self.n, self.meta = x, ys, n, meta

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        y = self.ys[index % len(self.ys)]
        return (self.x, y) if self.meta is None else (self.x, y, self.meta)

    def __len__(self) -> int:
        return self.n


class _Windows(pl.Callback):
    """The first batch's wall time, then samples/s in windows after warm-up (device syncs at the edges), and
    the share of each window the loop spent waiting inside the loader (its ``fetch_seconds``)."""

    def __init__(self, batch: int, warmup: int, window_steps: int, windows: int) -> None:
        self.batch, self.warmup, self.window_steps, self.windows = batch, warmup, window_steps, windows
        self.first: float | None = None
        self.rates: list[float] = []
        self.waits: list[float] = []
        self._t0 = 0.0
        self._fetch0: float | None = None
        self._done = 0  # batches finished, across epochs

    @property
    def steps(self) -> int:
        return 1 + self.warmup + self.windows * self.window_steps

    def _now(self, pl_module: pl.LightningModule) -> float:
        _sync(pl_module.device)
        return time.perf_counter()

    @staticmethod
    def _fetch(trainer: pl.Trainer) -> float | None:
        value = getattr(trainer.train_dataloader, FETCH_SECONDS_ATTR, None)
        return float(value) if isinstance(value, (int, float)) else None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int
    ) -> None:
        timed = self._done - self.warmup - 1  # batches 0 .. warmup are the first and the warm-up
        if self._done == 0 or (timed >= 0 and timed % self.window_steps == 0):
            self._t0 = self._now(pl_module)
            self._fetch0 = self._fetch(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, out: Any, batch: Any, i: int
    ) -> None:
        self._done += 1
        if self._done == 1:
            self.first = self._now(pl_module) - self._t0
        timed = self._done - self.warmup - 1
        if timed > 0 and timed % self.window_steps == 0:
            seconds = self._now(pl_module) - self._t0
            self.rates.append(self.window_steps * self.batch / seconds)
            fetch = self._fetch(trainer)
            if fetch is not None and self._fetch0 is not None:
                self.waits.append((fetch - self._fetch0) / seconds)


def _trainer_kwargs(
    cfg: _Cfg, budget: _Budget, net: nn.Module, compiled: bool, callbacks: list[pl.Callback], **kw: Any
) -> dict[str, Any]:
    """``fast_trainer_kwargs`` for one benchmark fit (a fresh compile for a compiled one)."""
    if compiled:
        torch.compiler.reset()  # each compiled fit compiles afresh (inductor's on-disk caches stay)
    kwargs = fast_trainer_kwargs(
        net,
        cfg.device,
        compile=compiled,
        callbacks=callbacks,
        accelerator="gpu" if cfg.device.type == "cuda" else "cpu",
        devices=1,
        **QUIET_FIT,
        max_time=budget.max_time(),
        **kw,
    )
    if cfg.device.type != "cuda":
        kwargs["precision"] = cfg.precision  # the CPU check exercises the mixed-precision path too
    return kwargs


def _row_of(name: str, windows: _Windows, trainer: pl.Trainer) -> dict[str, Any]:
    comp = next((c for c in trainer.callbacks if isinstance(c, CompileModel)), None)  # type: ignore[attr-defined]
    feed = getattr(trainer.train_dataloader, "feed_info", None)
    return {
        "name": name,
        "samples_per_sec": statistics.median(windows.rates) if windows.rates else None,
        "windows": windows.rates,
        "first_step_s": windows.first,
        "data_wait_frac": statistics.fmean(windows.waits) if windows.waits else None,
        "compiled": bool(comp and comp.compiled_calls),
        "compiled_calls": comp.compiled_calls if comp else 0,
        "eager_calls": comp.eager_calls if comp else 0,
        "precision": str(trainer.precision),
        "decoder": getattr(feed, "decoder", None),
    }


def lightning_row(
    name: str,
    cfg: _Cfg,
    budget: _Budget,
    compiled: bool,
    datamodule: pl.LightningDataModule | None = None,
) -> dict[str, Any]:
    """A ``fast_trainer_kwargs`` fit on float batches resident on the GPU, or fed by ``datamodule``."""
    device = cfg.device
    torch.manual_seed(0)
    net = build_model(cfg.model, cfg.classes)  # a fed run's labels (< 100) fit in these classes
    module = ImageClassifier(net, lr=0.01)
    windows = _Windows(cfg.batch, cfg.warmup, cfg.window_steps, cfg.windows)
    trainer = pl.Trainer(**_trainer_kwargs(cfg, budget, net, compiled, [windows], max_steps=windows.steps))
    with quiet_lightning():
        if datamodule is None:
            x = torch.randn(cfg.batch, 3, cfg.image, cfg.image, device=device).contiguous(
                memory_format=torch.channels_last
            )
            ys = [torch.randint(0, cfg.classes, (cfg.batch,), device=device) for _ in range(8)]
            fit(
                trainer,
                module,
                train_dataloaders=DataLoader(_SameBatch(x, ys, windows.steps), batch_size=None),
            )
        else:
            fit(trainer, module, datamodule=datamodule)
    return _row_of(name, windows, trainer)


class _ResidentCanvases(OptimizedDataModule):
    """``OptimizedDataModule`` whose training batches are uint8 canvases already on the GPU: of the feed,
    only its device-side step (``on_after_batch_transfer``: ``GPUAugment``) runs."""

    def __init__(self, cfg: _Cfg, length: int) -> None:
        from lightning_gpuopt.data import layout

        super().__init__(batch_size=cfg.batch, num_workers=0, image_size=cfg.image, storage_size=cfg.storage)
        device, n = cfg.device, cfg.batch
        height, width = layout.canvas_shape(cfg.storage)
        canvas = torch.randint(0, 256, (n, height, width, 3), dtype=torch.uint8, device=device)
        # the generated JPEGs' shape, upright and (a quarter of them) portrait, as the store keeps them
        w, h = layout.resized_size(*cfg.jpeg_size, cfg.storage)
        rows = [[h, w, 0] if i % 4 else [h, w, 1] for i in range(n)]
        meta = torch.tensor(rows, dtype=torch.int32, device=device)
        ys = [torch.randint(0, cfg.classes, (n,), device=device) for _ in range(8)]
        # at least a batch of samples: setup() checks the training set holds one
        self.batches = _SameBatch(canvas, ys, max(length, cfg.batch), meta)

    def train_dataset(self) -> Dataset:
        return self.batches

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.batches, batch_size=None)


def aug_row(name: str, cfg: _Cfg, budget: _Budget) -> dict[str, Any]:
    """``lightning+compile`` with the GPU augmentation on: canvases on the GPU through the DataModule's hook."""
    torch.manual_seed(0)
    net = build_model(cfg.model, cfg.classes)
    windows = _Windows(cfg.batch, cfg.warmup, cfg.window_steps, cfg.windows)
    trainer = pl.Trainer(**_trainer_kwargs(cfg, budget, net, True, [windows], max_steps=windows.steps))
    with quiet_lightning():
        fit(trainer, ImageClassifier(net, lr=0.01), datamodule=_ResidentCanvases(cfg, windows.steps))
    return {**_row_of(name, windows, trainer), "gpu_aug": True}


def naive_row(cfg: _Cfg, budget: _Budget, jpegs: Path) -> dict[str, Any]:
    """The ladder's ``naive`` row: PIL decode and float normalize on the CPU, 0 workers, fp32, NCHW."""
    from lightning_gpuopt.bench.rows import SPEC_BY_NAME, NaiveImageFolder

    spec = SPEC_BY_NAME["naive"]
    torch.manual_seed(0)
    loader = DataLoader(
        NaiveImageFolder(jpegs, size=cfg.image),
        batch_size=cfg.batch,
        shuffle=True,
        num_workers=0,
        pin_memory=spec.pin_memory,
        drop_last=True,
    )
    windows = _Windows(cfg.batch, cfg.naive_warmup, cfg.naive_window_steps, cfg.windows)
    trainer = pl.Trainer(
        accelerator="gpu" if cfg.device.type == "cuda" else "cpu",
        devices=1,
        precision="32-true",
        max_steps=windows.steps,
        max_time=budget.max_time(),
        callbacks=[windows],
        **QUIET_FIT,
    )
    with quiet_lightning():
        fit(trainer, ImageClassifier(cfg.model, num_classes=cfg.classes, lr=0.01), train_dataloaders=loader)
    return {**_row_of("naive", windows, trainer), "adds": spec.adds}


# --- the feed alone ---------------------------------------------------------------------------------------
def loader_row(name: str, cfg: _Cfg, dm: OptimizedDataModule) -> dict[str, Any]:
    """The DataModule's training loader alone: each batch ready on the device (augmented), no model."""
    from lightning_gpuopt.data.loader import StagedBatch

    dm.setup("fit")
    loader = dm.train_dataloader()

    def endless() -> Generator[Any, None, None]:
        while True:
            yield from loader  # one epoch an iter(); the loaders keep prefetching across them

    batches = endless()

    def take() -> None:
        batch = next(batches)
        if not isinstance(batch, StagedBatch) and len(batch) == 3:
            # host batches that were not staged (a CPU run): the DataModule's training transform, here
            images, _, meta = batch
            dm.gpu_augment(images.to(cfg.device, non_blocking=True), meta.to(cfg.device), train=True)

    rates = []
    try:
        for _ in range(cfg.loader_warmup):
            take()
        for _ in range(cfg.windows):
            _sync(cfg.device)
            t0 = time.perf_counter()
            for _ in range(cfg.loader_steps):
                take()
            _sync(cfg.device)
            rates.append(cfg.loader_steps * cfg.batch / (time.perf_counter() - t0))
    finally:
        batches.close()
        close = getattr(loader, "close", None)
        if callable(close):
            close()  # the workers or the DALI pipeline
        dm.teardown("fit")
    feed = getattr(loader, "feed_info", None)
    return {
        "name": name,
        "samples_per_sec": statistics.median(rates),
        "windows": rates,
        "decoder": getattr(feed, "decoder", None),
        "num_workers": getattr(feed, "num_workers", None),
        "threads": getattr(feed, "threads", None),
        "loader_alone": True,
    }


# --- small datasets ---------------------------------------------------------------------------------------
class _EpochClock(pl.Callback):
    """Device-synced times at the end of each epoch's first batch and at each epoch's end (two syncs an
    epoch)."""

    def __init__(self) -> None:
        self.first_done: list[float] = []
        self.epoch_done: list[float] = []
        self.batches = 0

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, out: Any, batch: Any, i: int
    ) -> None:
        if i == 0:
            _sync(pl_module.device)
            self.first_done.append(time.perf_counter())

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _sync(pl_module.device)
        self.epoch_done.append(time.perf_counter())
        self.batches = int(trainer.num_training_batches)


def epoch_figures(
    first_done: list[float], epoch_done: list[float], batches: int, batch: int
) -> dict[str, Any]:
    """Samples/s over the epochs after the first, and the stall at each epoch boundary.

    A boundary's stall is (first batch of epoch k+1 done) - (epoch k done) - the median step inside an epoch
    (an epoch's time after its first batch, over its other batches; epochs after the first).

    Example:
        >>> figures = epoch_figures([0.5, 2.7, 4.9], [2.0, 4.2, 6.4], batches=4, batch=10)
        >>> round(figures["samples_per_sec"], 1), [round(s, 2) for s in figures["stalls_s"]]
        (18.2, [0.2, 0.2])
    """
    epochs = min(len(first_done), len(epoch_done))
    if epochs < 2 or batches < 2:
        return {"samples_per_sec": None, "step_s": None, "stalls_s": [], "boundary_stall_s": None}
    inside = [(epoch_done[e] - first_done[e]) / (batches - 1) for e in range(1, epochs)]
    step = statistics.median(inside)
    stalls = [first_done[k + 1] - epoch_done[k] - step for k in range(epochs - 1)]
    return {
        "samples_per_sec": (epochs - 1) * batches * batch / (epoch_done[epochs - 1] - epoch_done[0]),
        "step_s": step,
        "stalls_s": stalls,
        "boundary_stall_s": statistics.median(stalls),
    }


def small_row(name: str, cfg: _Cfg, budget: _Budget, store: Path, images: int) -> dict[str, Any]:
    """Whole epochs of an eager ``fast_trainer_kwargs`` fit from an HDF5 store (the library's default feed)."""
    torch.manual_seed(0)
    net = build_model(cfg.model, cfg.classes)
    clock = _EpochClock()
    kwargs = _trainer_kwargs(cfg, budget, net, False, [clock], max_epochs=cfg.small_epochs)
    trainer = pl.Trainer(**kwargs)
    with quiet_lightning():
        fit(trainer, ImageClassifier(net, lr=0.01), datamodule=_datamodule(cfg, "hdf5", store))
    figures = epoch_figures(clock.first_done, clock.epoch_done, clock.batches, cfg.batch)
    return {
        "name": name,
        **figures,
        "images": images,
        "steps_per_epoch": clock.batches,
        "epochs": len(clock.epoch_done),
        "epoch_seconds": [b - a for a, b in zip(clock.epoch_done[:-1], clock.epoch_done[1:], strict=True)],
    }


# --- data -------------------------------------------------------------------------------------------------
def _jpegs(cfg: _Cfg, data_root: Path, images: int) -> Path:
    from lightning_gpuopt.bench.synthetic import make_jpeg_folder

    return make_jpeg_folder(
        data_root / f"jpeg_{images}_{cfg.jpeg_size[0]}x{cfg.jpeg_size[1]}",
        num_images=images,
        num_classes=min(100, cfg.classes),
        image_size=cfg.jpeg_size,
    )


def _store(cfg: _Cfg, jpegs: Path) -> tuple[Path, dict[str, Any]]:
    from _shared import hdf5_store

    store = jpegs.parent / f"{jpegs.name}_{cfg.storage}.h5"
    return store, hdf5_store(jpegs, store, cfg.storage)


def _datamodule(
    cfg: _Cfg, backend: str, data: Path, decoder: str | None = None, workers: int | str | None = None
) -> OptimizedDataModule:
    """The HDF5 store (``workers`` reading threads, default ``cfg.workers``), or DALI (``decoder=None``: the
    library's default)."""
    kw: dict[str, Any] = {"backend": backend, "batch_size": cfg.batch, "image_size": cfg.image}
    if backend == "hdf5":
        kw.update(num_workers=cfg.workers if workers is None else workers, storage_size=cfg.storage)
    elif decoder is not None:
        from lightning_gpuopt.data.dali import DALIOptions

        kw.update(dali=DALIOptions(decoder=decoder))
    return OptimizedDataModule(str(data), **kw)


# --- results ----------------------------------------------------------------------------------------------
def _rate(by_name: dict[str, dict[str, Any]], name: str) -> float | None:
    value = by_name.get(name, {}).get("samples_per_sec")
    return float(value) if value else None


def _at_least(value: float | None, bound: float) -> bool | None:
    return None if value is None else value >= bound


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Fill every row's ratios (``fill_ratios``: ``ratio_to_ceiling`` against ``ceiling_compiled``) and return
    the run's figures: ``aug_cost``, the small-dataset ratio, eager/compiled speedups and ``targets_met``
    (``None`` where a row is missing).

    Example:
        >>> rows = [{"name": "ceiling_eager", "samples_per_sec": 6000.0},
        ...         {"name": "ceiling_compiled", "samples_per_sec": 7400.0},
        ...         {"name": "hdf5+compile", "samples_per_sec": 7100.0}]
        >>> summarize(rows)["targets_met"]["hdf5+compile >= 0.95 of ceiling_compiled"]
        True
    """
    fill_ratios(rows)
    by_name = {r["name"]: r for r in rows}
    out: dict[str, Any] = {}
    on, off = _rate(by_name, "lightning+compile+gpu_aug"), _rate(by_name, "lightning+compile")
    out["aug_cost"] = 1 - on / off if on and off else None
    small = sorted((r for r in rows if r["name"].startswith("small_")), key=lambda r: r.get("images") or 0)
    if len(small) == 2 and small[0].get("samples_per_sec") and small[1].get("samples_per_sec"):
        out["small_rate_ratio"] = small[0]["samples_per_sec"] / small[1]["samples_per_sec"]
        out["small_boundary_stall_s"] = {r["name"]: r.get("boundary_stall_s") for r in small}
    ceiling = _rate(by_name, "ceiling_compiled")
    for eager, compiled in (("ceiling_eager", "ceiling_compiled"), ("lightning_eager", "lightning+compile")):
        e, c = _rate(by_name, eager), _rate(by_name, compiled)
        if e and c:
            prefix = eager.split("_")[0]
            saving = 1 - e / c  # share of an eager step's time the compiled step saves
            out[f"{prefix}_speedup"], out[f"{prefix}_step_saving"] = c / e, saving
            compile_s = by_name[compiled].get("compile_s")
            if compile_s is not None and saving > 0:
                out[f"{prefix}_break_even_s"] = compile_s / saving

    def ratio(name: str) -> float | None:
        return by_name.get(name, {}).get("ratio_to_ceiling")

    hdf5, naive = _rate(by_name, "hdf5+compile"), _rate(by_name, "naive")
    targets: dict[str, bool | None] = {
        "hdf5+compile >= 7000 img/s": _at_least(hdf5, 7000.0),
        "hdf5+compile >= 0.95 of ceiling_compiled": _at_least(ratio("hdf5+compile"), 0.95),
        "dali+compile >= 0.93 of ceiling_compiled": _at_least(ratio("dali+compile"), 0.93),
        "hdf5+compile >= 28x naive": _at_least(hdf5 / naive if hdf5 and naive else None, 28.0),
        "aug_cost <= 0.03": None if out["aug_cost"] is None else out["aug_cost"] <= 0.03,
    }
    for name in ("loader_hdf5", "loader_dali_cpu", "loader_dali_gpu"):
        targets[f"{name} >= 1.3x ceiling_compiled"] = _at_least(ratio(name), 1.3) if ceiling else None
    for name, reference in EAGER_REFERENCE.items():
        eager_ratio = by_name.get(name, {}).get("ratio_to_eager_ceiling")
        targets[f"{name} >= 0.98 x {reference} of ceiling_eager"] = _at_least(eager_ratio, 0.98 * reference)
    out["targets_met"] = targets
    return out


def _ordered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(rows, key=lambda r: (rank.get(r["name"], len(ORDER)), r.get("images") or 0))


# --- main -------------------------------------------------------------------------------------------------
class _Run:
    """The rows run so far, the budget, and the results file rewritten after every row."""

    def __init__(self, args: argparse.Namespace, cfg: _Cfg, path: Path) -> None:
        self.args, self.cfg, self.path = args, cfg, path
        self.budget = _Budget(args.budget_s)
        self.rows: list[dict[str, Any]] = []
        self.notes: dict[str, Any] = {}
        self.last: list[dict[str, Any]] = []  # the rows as last written

    def row(self, name: str, expected_s: float, make: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """Run ``make`` for row ``name`` when ``expected_s`` still fits the budget; record it either way."""
        if self.args.rows and name not in self.args.rows.split(","):
            return None  # not asked for (--rows)
        left = self.budget.left()
        if left < expected_s:
            why = f"time budget: {left:.0f} s left, the row needs about {expected_s:.0f} s"
            self.skip(name, why)
            return None
        print(f"[{self.budget.elapsed():5.0f} s] {name}...", flush=True)
        t0 = time.perf_counter()
        try:
            row = make()
        except ROW_ERRORS as err:
            traceback.print_exc()
            self.skip(name, f"failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
            return None
        finally:
            _free()
        row["row_seconds"] = time.perf_counter() - t0
        self.rows.append(row)
        sps = row.get("samples_per_sec")
        print(f"  -> {sps:,.1f} samples/s" if sps else "  -> no rate", flush=True)
        self.save()
        return row

    def skip(self, name: str, why: str) -> None:
        if self.args.rows and name not in self.args.rows.split(","):
            return None
        print(f"  {name}: skipped ({why})", flush=True)
        self.rows.append({"name": name, "samples_per_sec": None, "skipped": why})
        self.save()
        return None

    def compiled(self, name: str, expected_eager_s: float, make: Callable[[], dict[str, Any]]) -> None:
        """A compiled row: its first step (the compile in it) is printed and kept for the budget."""
        row = self.row(name, self.budget.compile_s() + expected_eager_s, make)
        if row is not None and row.get("first_step_s") is not None:
            self.budget.compiles.append(row["first_step_s"])
            print(f"compile time: {name}: first step {row['first_step_s']:.1f} s", flush=True)

    def save(self) -> dict[str, Any]:
        rows = _ordered([dict(r) for r in self.rows])
        first = {r["name"]: r.get("first_step_s") for r in rows}
        for r in rows:
            if r.get("compiled") and r.get("first_step_s") is not None:
                # minus the eager counterpart's first step (cuDNN autotuning, allocations), where measured
                base = first.get("ceiling_eager" if r["name"].startswith("ceiling") else "lightning_eager")
                r["compile_s"] = r["first_step_s"] - (base or 0.0)
        summary = summarize(rows)
        summary["skipped_rows"] = [r["name"] for r in rows if r.get("skipped")]
        summary["compile_seconds"] = {
            r["name"]: r["compile_s"] for r in rows if r.get("compile_s") is not None
        }
        for r in rows:
            sps = r.get("samples_per_sec")
            r["step_ms"] = 1000 * self.cfg.batch / sps if sps else None
            r.setdefault("gpu_util_mean", None)
            r.setdefault("data_wait_frac", None)
        write_results(
            self.path,
            rows,
            benchmark="gpu_compile",
            model=self.cfg.model,
            batch_size=self.cfg.batch,
            image_size=self.cfg.image,
            device=str(self.cfg.device),
            quick=self.args.quick,
            summary={**summary, **self.notes},
            total_seconds=self.budget.elapsed(),
        )
        self.last = rows
        return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for compile_<gpu>.json (or a .json path)")
    p.add_argument("--quick", action="store_true", help="tiny CPU run proving the script end to end")
    p.add_argument("--data-root", default="/tmp/gpuopt_data", help="where the generated JPEGs and stores go")
    p.add_argument("--no-fed", action="store_true", help="only the rows without a data pipeline")
    p.add_argument("--rows", default="", help="comma-separated rows to run (default: every row)")
    p.add_argument(
        "--budget-s", type=float, default=470.0, help="rows whose expected cost no longer fits are skipped"
    )
    args = p.parse_args()

    cuda = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    cfg = _Cfg(args, device)
    if cuda:
        configure_backends(tf32=True, cudnn_benchmark=True)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    out = Path(args.out)
    gpu = torch.cuda.get_device_name(0).split()[-1].lower() if cuda else "cpu"
    run = _Run(args, cfg, out / f"compile_{gpu}.json" if out.suffix != ".json" else out)
    budget = run.budget
    eager_fit = 15.0 if cuda else 5.0  # a fit's start-up, warm-up and windows, eager

    run.compiled("ceiling_compiled", 10.0, lambda: plain_row("ceiling_compiled", cfg, True))
    run.row("ceiling_eager", 10.0, lambda: plain_row("ceiling_eager", cfg, False))
    run.row("lightning_eager", eager_fit, lambda: lightning_row("lightning_eager", cfg, budget, False))

    dali = importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.dali")
    h5py = importlib.util.find_spec("h5py") is not None
    data_root = Path(args.data_root)
    jpegs = store = None
    if not args.no_fed:
        t0 = time.perf_counter()
        jpegs = _jpegs(cfg, data_root, cfg.images)
        run.notes["jpeg_seconds"] = time.perf_counter() - t0
        if h5py:
            store, run.notes["store"] = _store(cfg, jpegs)
    fed = "" if jpegs is not None else "--no-fed"
    # fed_row runs the lambdas below only when their data exists
    jpegs, store = cast(Path, jpegs), cast(Path, store)

    def fed_row(name: str, backend: str, expected: float, make: Callable[[], dict[str, Any]]) -> None:
        why = fed or ("" if backend != "hdf5" or store else "h5py is not installed")
        why = why or ("" if backend != "dali" or dali else "nvidia.dali is not installed")
        if why:
            run.skip(name, why)
        elif name.endswith("+compile"):
            run.compiled(name, expected, make)
        else:
            run.row(name, expected, make)

    # the targets' rows first: a run cut short by its budget still answers them
    fed_row(
        "hdf5+compile",
        "hdf5",
        eager_fit,
        lambda: lightning_row("hdf5+compile", cfg, budget, True, _datamodule(cfg, "hdf5", store)),
    )
    fed_row(
        "dali+compile",
        "dali",
        eager_fit,
        lambda: lightning_row("dali+compile", cfg, budget, True, _datamodule(cfg, "dali", jpegs)),
    )
    chosen = next((r.get("decoder") for r in run.rows if r["name"] == "dali+compile"), None)
    if chosen is not None:
        run.notes["dali_default_decoder"] = chosen
        print(f"DALI's default decoder here: {chosen}", flush=True)
    naive_s = 25.0 if cuda else 5.0
    if jpegs is None:
        run.skip("naive", fed)
    else:
        run.row("naive", naive_s, lambda: naive_row(cfg, budget, jpegs))
    fed_row(
        "hdf5",
        "hdf5",
        eager_fit,
        lambda: lightning_row("hdf5", cfg, budget, False, _datamodule(cfg, "hdf5", store)),
    )
    fed_row(
        "dali",
        "dali",
        eager_fit,
        lambda: lightning_row("dali", cfg, budget, False, _datamodule(cfg, "dali", jpegs, "cpu")),
    )
    loader_s = 15.0 if cuda else 3.0
    fed_row(
        "loader_hdf5",
        "hdf5",
        loader_s,
        lambda: loader_row("loader_hdf5", cfg, _datamodule(cfg, "hdf5", store)),
    )
    for decoder in ("cpu", "gpu"):
        name = f"loader_dali_{decoder}"
        if decoder == "gpu" and not cuda:
            run.skip(name, "nvJPEG needs a CUDA GPU")
            continue

        def alone(n: str = name, d: str = decoder) -> dict[str, Any]:
            return loader_row(n, cfg, _datamodule(cfg, "dali", jpegs, d))

        fed_row(name, "dali", loader_s, alone)
    run.compiled(
        "lightning+compile", eager_fit, lambda: lightning_row("lightning+compile", cfg, budget, True)
    )
    run.compiled(
        "lightning+compile+gpu_aug", eager_fit, lambda: aug_row("lightning+compile+gpu_aug", cfg, budget)
    )
    for images in cfg.small_images:
        name = f"small_{images}"
        if fed or not store:
            run.skip(name, fed or "h5py is not installed")
            continue

        def small(n: str = name, i: int = images) -> dict[str, Any]:
            # the larger set is the fed rows' store; the smaller one is generated and converted in the row
            path = store if i == cfg.images else _store(cfg, _jpegs(cfg, data_root, i))[0]
            return small_row(n, cfg, budget, path, i)

        run.row(name, 30.0 if cuda else 8.0, small)
    # the decoders the default did not choose, as far as time allows
    for decoder in ("cpu", "gpu"):
        if decoder == chosen or (decoder == "gpu" and not cuda) or fed or not dali:
            continue
        name = f"dali_{decoder}+compile"

        def forced(n: str = name, d: str = decoder) -> dict[str, Any]:
            return lightning_row(n, cfg, budget, True, _datamodule(cfg, "dali", jpegs, d))

        fed_row(name, "dali", eager_fit, forced)
    # the HDF5 store read by other thread counts than the default, as far as time allows
    for threads in cfg.thread_sweep:

        def swept(n: int = threads) -> dict[str, Any]:
            name = f"loader_hdf5_threads_{n}"
            return loader_row(name, cfg, _datamodule(cfg, "hdf5", store, workers=n))

        fed_row(f"loader_hdf5_threads_{threads}", "hdf5", loader_s, swept)

    summary = run.save()
    rows = run.last
    if cuda:
        e = _rate({r["name"]: r for r in rows}, "lightning_eager")
        if e:
            # the rule's answer for an ImageNet epoch (5,005 steps at batch 256) and for 90 of them
            for epochs in (1, 90):
                d = should_compile(
                    has_conv=True, device=device, steps_left=5005 * epochs, step_seconds=cfg.batch / e
                )
                run.notes[f"rule_imagenet_{epochs}_epochs"] = {"compile": d.compile, "reason": d.reason}
            summary = run.save()
    for k, v in summary.items():
        if k not in ("targets_met", "compile_seconds"):
            print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    for name, seconds in summary["compile_seconds"].items():
        print(f"compile time: {name}: {seconds:.1f} s")
    for target, met in summary["targets_met"].items():
        print(f"target {target}: {met}")
    print(f"total: {budget.elapsed():.0f} s; results: {run.path}")
    print(format_table(rows, COLUMNS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
