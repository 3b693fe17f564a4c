"""Runs the ladder (``bench.rows``) as a user measures a long fit: each row ``repeats`` short fits, the
rows taking turns and the ceilings first in every turn, each fit measured in its steady state
(``RowClock``, ``bench.steady``) past its warm-up and compile; docs/benchmarks.md says how.
"""

from __future__ import annotations

import gc
import hashlib
import os
import statistics
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_gpuopt._common import available_cpus, eval_resize_size
from lightning_gpuopt.bench.ceilings import COMPILED, EAGER, fill_ratios
from lightning_gpuopt.bench.measure import PlainLoop, fit
from lightning_gpuopt.bench.meter import (
    FAST_RUN,
    SETTLE_LIMIT_S,
    first_fast_step,
    joules_per_sample,
    window_means,
)
from lightning_gpuopt.bench.rows import (
    CANNOT_RUN,
    FAILED,
    OK,
    ROW_NAMES,
    SKIPPED,
    SPEC_BY_NAME,
    DeviceBatches,
    LadderConfig,
    NaiveImageFolder,
    RowSpec,
    cannot_run,
    compile_asked,
    is_hdf5_path,
    ladder_device,
)
from lightning_gpuopt.bench.steady import Measurement, StepClock, measure_loop, summarize

Progress = Callable[[str], None]

# when data rows tie within this fraction, prefer DALI, then HDF5: they leave the host CPU more idle
_BEST_TIE_FRAC = 0.03
_BACKEND_PREFERENCE = ("dali", "hdf5", "folder")
_ROW_OF_BACKEND = {"folder": "+uint8_gpu_aug", "hdf5": "+hdf5", "dali": "+dali"}
# label sets the synthetic batch cycles through: one batch with fixed labels would be fitted exactly, and its
# vanishing gradients are not the work a real step does
_LABEL_SETS = 8
# a row's keys that stay null until measured (or forever, ``whole_epochs``: kept for readers of older files)
_ROW_NONE_KEYS = (
    *(
        "reason",
        "samples_per_sec",
        "samples_per_sec_min",
        "samples_per_sec_max",
        "spread",
        "p50_ms",
        "p90_ms",
    ),
    *("ratio_to_ceiling", "ratio_to_ceiling_worst", "ratio_to_eager_ceiling", "speedup_vs_naive"),
    *("gpu_util_mean", "data_wait_frac", "joules_per_sample", "backend", "num_workers", "pin_memory"),
    *("compile_seconds", "steps_measured", "seconds_measured", "whole_epochs", "_steps"),
)
# the monitor's figures a row averages over its fits
_FIT_MEANS = ("gpu_util_mean", "data_wait_frac", "joules_per_sample")


def _no_h5py() -> str | None:
    """Why HDF5 rows cannot run here, or ``None`` when h5py is installed."""
    from lightning_gpuopt._imports import _H5PY_AVAILABLE

    return None if _H5PY_AVAILABLE else "h5py is not installed (pip install 'lightning-gpuopt[hdf5]')"


def _slug(index: int, name: str) -> str:
    return f"{index:02d}_{name.lstrip('+').replace('/', '_')}"


def prefetched_batches(loader: Any) -> int:
    """Batches ``loader`` can have ready before the model asks: its workers' prefetch, its reading threads'
    batches in flight, a DALI pipeline's queue, a batch staged on the GPU, and the one Lightning fetches ahead.

    Example:
        >>> prefetched_batches(DataLoader(range(8), num_workers=2, prefetch_factor=4))
        9
    """
    from lightning_gpuopt.data.loader import READS_PER_THREAD

    workers = getattr(loader, "num_workers", 0) or 0
    depth = workers * (getattr(loader, "prefetch_factor", None) or 2)
    depth += (getattr(loader, "read_threads", 0) or 0) * READS_PER_THREAD
    if getattr(getattr(loader, "feed_info", None), "backend", None) == "dali":
        from lightning_gpuopt.data.dali_pipeline import PREFETCH_QUEUE_DEPTH

        depth += PREFETCH_QUEUE_DEPTH
    if getattr(loader, "device_transform", None) is not None and getattr(loader, "pin_memory", False):
        depth += 1  # staged on the GPU one step ahead (a CUDA run)
    return depth + 1


class RowClock(StepClock):
    """``StepClock`` for one fit of a ladder row: the warm-up counted past the loader's prefetch and, with
    ``seconds``, the window's step count sized from the warm-up's last steps.

    Args:
        warmup: warm-up steps past the prefetch (``prefetched_batches``).
        steps: steps measured (the count to start from when ``seconds`` is given).
        seconds: the measuring time the step count is sized to (``steps`` then holds it, and
            ``warmup_step_s`` the step time it came from), or ``None``.
        max_steps: the most steps ``seconds`` may give (``None``: no cap).
        settle: a compiled model: wait for the step time to settle first.

    Example:
        >>> clock = RowClock(warmup=5, steps=2, seconds=3.0)
        >>> trainer = pl.Trainer(max_epochs=-1, callbacks=[clock])  # doctest: +SKIP
    """

    def __init__(
        self,
        warmup: int,
        steps: int,
        seconds: float | None = None,
        max_steps: int | None = None,
        settle: bool = False,
    ) -> None:
        super().__init__(warmup=warmup, steps=max(2, steps), settle=settle)
        self.past_prefetch = warmup
        self.seconds, self.max_steps = seconds, max_steps
        self.warmup_step_s: float | None = None
        self._ends: list[float] = []
        self._sized = seconds is None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.warmup = self.past_prefetch + prefetched_batches(trainer.train_dataloader)
        self._ends, self._sized, self.warmup_step_s = [], self.seconds is None, None
        super().on_train_start(trainer, pl_module)

    def _size(self, last: int) -> None:
        """Set ``steps`` from the mean of the last ``last`` warm-up step times."""
        self._sized = True
        n = min(last, len(self._ends) - 1)
        if n < 1 or self.seconds is None:
            return
        step_s = self.warmup_step_s = (self._ends[-1] - self._ends[-1 - n]) / n
        steps = int(self.seconds / step_s) if step_s > 0 else self.steps
        self.steps = max(2, min(steps, self.max_steps) if self.max_steps else steps)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._sized:
            self._ends.append(time.perf_counter())
            # the last warm-up step: the window opens at the next batch end
            if not self.settle and len(self._ends) == self.warmup:
                self._size(self.past_prefetch)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not self._sized and self.settle and self.compile_seconds is not None:
            # settled at this batch end: the window opens at a later one
            self._size(FAST_RUN)


class LadderRunner:
    """Runs the rows of a ``LadderConfig``; use ``run_ladder``."""

    def __init__(self, config: LadderConfig, progress: Progress | None = None) -> None:
        config.validate()
        self.cfg = config
        self.say: Progress = progress or (lambda _msg: None)
        self.data = Path(config.data).expanduser()
        self.data_is_h5 = is_hdf5_path(self.data)
        self.device = ladder_device(config.accelerator)
        self.cuda = self.device.type == "cuda"
        self.num_classes = self._count_classes()
        self.storage_size = eval_resize_size(config.image_size)
        self._naive_workers: int | None = config.num_workers
        self._dm_workers: dict[str, int] = {}
        self._h5_path: Path | None = self.data if self.data_is_h5 else None
        self._t_start = time.perf_counter()
        self._ceiling: float | None = None
        self._compile_asked = compile_asked(config.rows)
        self._compile_seen: list[float] = []  # compile seconds measured so far in this run

    # -- setup ----------------------------------------------------------------------------------------
    def _count_classes(self) -> int:
        if self.data_is_h5:
            if _no_h5py() is not None:
                return 1000  # only the ceilings can run; their logits count does not change the speed much
            from lightning_gpuopt.data.hdf5 import HDF5ImageDataset

            return max(len(HDF5ImageDataset(os.fspath(self.data)).classes), 2)
        from lightning_gpuopt.data.folder import scan_image_folder

        classes, samples = scan_image_folder(self.data)
        if len(samples) < self.cfg.batch_size:
            raise ValueError(
                f"--data {str(self.data)!r} holds {len(samples)} images, fewer than one batch "
                f"(--batch-size {self.cfg.batch_size}); lower --batch-size or use more images"
            )
        return max(len(classes), 2)

    def _trainer(
        self,
        row_index: int,
        spec: RowSpec,
        callbacks: list[pl.Callback],
        max_seconds: float | None,
        version: str,
    ) -> pl.Trainer:
        logger: Any = False
        if self.cfg.tb_dir is not None:
            from lightning.pytorch.loggers import TensorBoardLogger

            logger = TensorBoardLogger(
                os.fspath(self.cfg.tb_dir), name=_slug(row_index, spec.name), version=version
            )
        return pl.Trainer(
            accelerator="gpu" if self.cuda else "cpu",
            devices=1,
            precision=cast(Any, self._precision(spec)),
            max_epochs=-1,
            max_steps=-1,
            # a safety net only: the row's clock stops the fit long before
            max_time=None if max_seconds is None else timedelta(seconds=max_seconds),
            limit_val_batches=0,
            num_sanity_val_steps=0,
            logger=logger,
            log_every_n_steps=5,
            callbacks=callbacks,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )

    def _precision(self, spec: RowSpec) -> str:
        return "16-mixed" if spec.mixed and self.cuda else "32-true"

    def _monitor(self, spec: RowSpec) -> pl.Callback:
        from lightning_gpuopt.observe.gpu_stats import GPUStatsMonitor

        # the naive row makes about one step a second: short windows still give several after the warm-up
        window = 2 if spec.loader == "naive" and not spec.tuned_workers else 10
        return GPUStatsMonitor(log_every_n_steps=window, gpu=self.cuda)

    def _model(self) -> pl.LightningModule:
        from lightning_gpuopt.bench.models import ImageClassifier

        return ImageClassifier(self.cfg.model, num_classes=self.num_classes, lr=self.cfg.lr)

    def _tuned_naive_workers(self, dataset: Dataset) -> int:
        if self._naive_workers is not None:
            return self._naive_workers
        from lightning_gpuopt.data.tuning import tune_num_workers

        self.say(f"tuning DataLoader workers for the naive dataset ({self.cfg.tune_seconds:.0f} s budget)...")
        # PIL decode scales with cores; a coarse set of counts fits a short budget at large batch sizes
        cpus = available_cpus()
        candidates = sorted({max(1, cpus * k // 4) for k in (1, 2, 3, 4)})
        result = tune_num_workers(
            dataset,
            candidates=candidates,
            budget_s=self.cfg.tune_seconds,
            target_samples_per_sec=self._tune_target(),
            batch_size=self.cfg.batch_size,
            cache_dir=self.cfg.cache_dir,
        )
        n = int(result.best)
        src = "cached" if result.cached else f"measured in {result.seconds:.1f} s"
        self.say(f"  -> {n} workers ({src})")
        self._naive_workers = n
        return n

    def _tune_target(self) -> float | None:
        """What the fastest compute can consume (the plain-loop ceiling): the tuner stops once the loader,
        measured alone, delivers its headroom over that."""
        return self._ceiling if self._ceiling else None

    def _hdf5_file(self) -> tuple[Path | None, str | None]:
        if self._h5_path is not None:
            return self._h5_path, None
        why = _no_h5py()
        if why is not None:
            return None, why
        from lightning_gpuopt.data.convert import convert_folder_to_hdf5
        from lightning_gpuopt.data.hdf5 import HDF5ImageDataset

        src = self.data.resolve()
        digest = hashlib.sha1(f"{src}:{os.path.getmtime(src)}".encode()).hexdigest()[:10]
        out = Path(self.cfg.cache_dir).expanduser() / "hdf5" / f"{src.name}-{digest}-{self.storage_size}px.h5"
        cached = out.is_file()
        if cached:
            try:
                HDF5ImageDataset(out).close()
            except (ValueError, RuntimeError) as err:  # another format version, or damaged: convert again
                self.say(f"cached HDF5 copy {out} cannot be read by this version ({err}); converting again")
                out.unlink()
                cached = False
        if cached:
            self.say(f"using cached HDF5 copy {out}")
        else:
            out.parent.mkdir(parents=True, exist_ok=True)
            self.say(f"converting {src} to uint8 HDF5 ({self.storage_size}px) at {out} (once, cached)...")
            t0 = time.perf_counter()
            # the converter writes a temporary file and renames it when complete, so an interrupted
            # conversion never looks cached
            convert_folder_to_hdf5(os.fspath(src), os.fspath(out), self.storage_size, progress=False)
            self.say(
                f"  -> converted in {time.perf_counter() - t0:.1f} s ({out.stat().st_size / 2**20:.0f} MiB)"
            )
        self._h5_path = out
        return out, None

    def _best_backend(self, done: dict[str, dict[str, Any]]) -> str:
        measured = {
            b: done[r]["samples_per_sec"]
            for b, r in _ROW_OF_BACKEND.items()
            if r in done and done[r]["status"] == OK and done[r]["samples_per_sec"]
        }
        if measured:
            top = max(measured.values())
            for b in _BACKEND_PREFERENCE:
                if b in measured and measured[b] >= top * (1 - _BEST_TIE_FRAC):
                    return b
        # nothing measured in this run: HDF5 when it can be had, else the folder
        if self.data_is_h5:
            return "hdf5"
        return "hdf5" if _no_h5py() is None else "folder"

    # -- rows -----------------------------------------------------------------------------------------
    def cannot_run_reason(self, spec: RowSpec) -> tuple[str, str] | None:
        """``(status, reason)`` when ``spec`` cannot run here, else ``None`` (``rows.cannot_run``)."""
        return cannot_run(spec, self.device, self.data_is_h5, self._compile_asked)

    def _base_row(self, spec: RowSpec) -> dict[str, Any]:
        row: dict[str, Any] = dict.fromkeys(_ROW_NONE_KEYS)
        row.update(
            name=spec.name,
            adds=spec.adds,
            status=OK,
            windows=[],
            repeats=[],
            precision=self._precision(spec) if spec.loader != "plain" else None,
            channels_last=spec.channels_last,
            compiled=spec.compiled,
            batch_size=self.cfg.batch_size,
            _measured=[],
            _means={k: [] for k in _FIT_MEANS},
        )
        return row

    def _row_seconds(self, fits_left: int, pending_compiles: int = 0) -> float | None:
        """The next fit's measured seconds within the whole-run budget (the expected compile time of
        ``pending_compiles`` other compiled rows kept aside), or ``None`` when it is spent."""
        cfg = self.cfg
        per_fit = cfg.seconds / cfg.repeats
        if cfg.time_budget_s is None:
            return per_fit
        left = cfg.time_budget_s - (time.perf_counter() - self._t_start)
        if left < 5.0:
            return None
        # start-up and warm-up (up to the measured seconds for prefetching rows) take about half a fit
        share = 0.45 * max(0.0, left - pending_compiles * self._expected_compile()) / max(fits_left, 1)
        if per_fit == 0:
            return share
        return max(min(1.0, per_fit), min(per_fit, share))

    def _expected_compile(self) -> float:
        """The longest compile measured in this run, else ``COMPILE_SECONDS``."""
        from lightning_gpuopt.compute.compile import COMPILE_SECONDS

        return max(self._compile_seen, default=COMPILE_SECONDS)

    def _budget_short_of_compile(self, spec: RowSpec, row: dict[str, Any]) -> str | None:
        """Why a compiled row's first fit (a compile and its measuring) no longer fits the budget, or ``None``."""
        if not spec.compiled or row["compile_seconds"] is not None or self.cfg.time_budget_s is None:
            return None
        expected = self._expected_compile()
        left = self.cfg.time_budget_s - (time.perf_counter() - self._t_start)
        if left >= expected + 10.0:
            return None
        return (
            f"the time budget left ({left:.0f} s) is short of a compile (~{expected:.0f} s) and its measuring"
        )

    def _labels(self) -> list[torch.Tensor]:
        return [
            torch.randint(0, self.num_classes, (self.cfg.batch_size,), device=self.device)
            for _ in range(_LABEL_SETS)
        ]

    def run_plain(self, spec: RowSpec, row: dict[str, Any], seconds: float, rnd: int = 0) -> None:
        from lightning_gpuopt.bench.models import build_model

        cfg = self.cfg
        if spec.compiled:
            # each compiled row compiles afresh in this process (the on-disk caches stay)
            torch.compiler.reset()
        dtype = torch.float16 if self.cuda else None
        loop = PlainLoop(
            build_model(cfg.model, self.num_classes),
            batch_size=cfg.batch_size,
            image_size=cfg.image_size,
            num_classes=self.num_classes,
            dtype=dtype,
            device=self.device,
            lr=cfg.lr,
            label_sets=_LABEL_SETS,
            compile=spec.compiled,
        )
        # warm up step by step until the step time settles (after the compile, for a compiled model); the
        # settled steps size the row's window when it has no step count yet
        t0 = time.perf_counter()
        times: list[float] = []
        fast: int | None = None
        while fast is None or len(times) - fast < max(FAST_RUN, min(cfg.warmup, 3)):
            if time.perf_counter() - t0 > SETTLE_LIMIT_S:
                row.update(
                    status=FAILED, reason=f"the step time did not settle within {SETTLE_LIMIT_S:.0f} s"
                )
                return
            times.append(loop.timed_step())
            fast = first_fast_step(times)
        compiled_in = sum(times[:fast]) if spec.compiled else None
        if compiled_in is not None and row["compile_seconds"] is None:
            self._compile_seen.append(compiled_in)
            self.say(f"  compiled: {compiled_in:.1f} s from the first step to the first fast one")
        self.say(f"  warmed up in {time.perf_counter() - t0:.1f} s ({len(times)} steps)")
        steps = row["_steps"] or self._steps_for(seconds, statistics.fmean(times[fast:]))
        m = measure_loop(loop.step, self.device, cfg.warmup, steps, cfg.batch_size)
        self._add_repeat(row, rnd, replace(m, compile_seconds=compiled_in), steps)
        row["precision"] = "fp16 autocast" if dtype is not None else "fp32"
        row["backend"] = "synthetic (device)"
        del loop

    def _steps_for(self, seconds: float, step_s: float) -> int:
        """The window's step count for ``seconds`` at ``step_s`` a step, at most ``steps``."""
        cfg = self.cfg
        if cfg.seconds == 0 or step_s <= 0:
            return cfg.steps or 2
        steps = max(2, int(seconds / step_s))
        return min(steps, cfg.steps) if cfg.steps else steps

    def _loader_for(self, spec: RowSpec, row: dict[str, Any], done: dict[str, dict[str, Any]]) -> Any:
        """The row's DataLoader or data module; ``None`` with the row skipped when a dependency is missing."""
        cfg = self.cfg
        if spec.loader == "naive":
            from lightning_gpuopt.data.loader import PREFETCH_FACTOR

            dataset = NaiveImageFolder(self.data, size=cfg.image_size)
            workers = self._tuned_naive_workers(dataset) if spec.tuned_workers else 0
            row.update(backend="PIL float (CPU)", num_workers=workers, pin_memory=spec.pin_memory)
            return DataLoader(
                dataset,
                batch_size=cfg.batch_size,
                shuffle=True,
                num_workers=workers,
                pin_memory=spec.pin_memory,
                drop_last=True,
                persistent_workers=workers > 0,
                prefetch_factor=PREFETCH_FACTOR if workers > 0 else None,
            )
        if spec.loader == "device":
            mf = torch.channels_last if spec.channels_last else torch.contiguous_format
            x = torch.randn(cfg.batch_size, 3, cfg.image_size, cfg.image_size, device=self.device)
            row.update(backend="synthetic (device)", num_workers=0)
            return DeviceBatches(x.contiguous(memory_format=mf), self._labels(), 1_000_000)
        from lightning_gpuopt.data.datamodule import OptimizedDataModule
        from lightning_gpuopt.data.tuning import TuningConfig

        # the best backend is chosen once, in the row's first fit
        backend = spec.loader if spec.loader != "best" else row["backend"] or self._best_backend(done)
        source = self.data
        if backend == "hdf5":
            h5, why = self._hdf5_file()
            if h5 is None:
                row.update(status=SKIPPED, reason=why)
                return None
            source = h5
        # --workers counts DataLoader worker processes: the folder's; a raw store and DALI read on threads
        given = cfg.num_workers if cfg.num_workers is not None and backend == "folder" else "auto"
        dm_workers: int | str = self._dm_workers.get(backend, given)
        dm = OptimizedDataModule(
            train_dir=os.fspath(source),
            backend=backend,
            batch_size=cfg.batch_size,
            image_size=cfg.image_size,
            num_workers=dm_workers,
            tuning=TuningConfig(
                budget_s=cfg.tune_seconds,
                target_samples_per_sec=self._tune_target(),
                cache_dir=cfg.cache_dir,
            ),
        )
        row.update(backend=backend, num_workers=dm_workers if isinstance(dm_workers, int) else None)
        return dm

    @staticmethod
    def _add_repeat(row: dict[str, Any], turn: int, m: Measurement, steps: int) -> None:
        """Add turn ``turn``'s measurement (a window of ``steps``, the count later repetitions measure) and
        refresh the row's median, range and p50/p90."""
        row["_steps"] = row["_steps"] or steps
        row["_measured"].append((turn, m))
        (summary,) = summarize({row["name"]: [x for _, x in row["_measured"]]}, None)
        repeats = [
            {"turn": t, **{k: v for k, v in r.items() if k != "of_ceiling"}}
            for (t, _), r in zip(row["_measured"], summary["repeats"], strict=True)
        ]
        row.update(
            {k: summary[k] for k in ("samples_per_sec", "samples_per_sec_min", "samples_per_sec_max")},
            spread=summary["spread"],
            p50_ms=summary["p50_ms"],
            p90_ms=summary["p90_ms"],
            repeats=repeats,
            windows=[r["samples_per_sec"] for r in repeats],
            steps_measured=sum(r["steps"] for r in repeats),
            seconds_measured=sum(r["seconds"] for r in repeats),
        )
        if row["compile_seconds"] is None:
            row["compile_seconds"] = m.compile_seconds

    def run_fit(
        self,
        index: int,
        spec: RowSpec,
        row: dict[str, Any],
        seconds: float,
        done: dict[str, dict[str, Any]],
        rnd: int = 0,
    ) -> None:
        loader = self._loader_for(spec, row, done)
        if loader is None:
            return
        callbacks: list[pl.Callback] = []
        model = self._model()
        if spec.channels_last and spec.loader == "device":
            # the ceiling needs no package component: the model is simply made channels_last
            model = model.to(memory_format=torch.channels_last)
        elif spec.channels_last:
            from lightning_gpuopt.compute.channels_last import ChannelsLast

            callbacks.append(ChannelsLast())
        if spec.compiled:
            from lightning_gpuopt.compute.compile import CompileModel

            torch.compiler.reset()  # each compiled fit compiles afresh in this process
            callbacks.append(CompileModel())
        cfg = self.cfg
        warmup = max(cfg.warmup, 1)  # at least one: it pays for cuDNN autotuning and worker start-up
        if row["_steps"] is None and cfg.seconds > 0:
            # the row's first fit: the window's length from the warm-up's rate and this fit's share
            clock = RowClock(warmup, cfg.steps or 2, seconds, cfg.steps, settle=spec.compiled)
        else:
            clock = RowClock(warmup, row["_steps"] or cfg.steps or 2, settle=spec.compiled)
        monitor = self._monitor(spec)
        callbacks += [clock, monitor]
        safety = 3 * seconds + 120 if seconds > 0 else None
        if safety is not None and spec.compiled:
            safety += SETTLE_LIMIT_S
        trainer = self._trainer(index, spec, callbacks, safety, f"fit_{rnd}")
        with warnings.catch_warnings():
            # rows without TensorBoard keep the monitor's windows in its history on purpose
            warnings.filterwarnings("ignore", message=".*has no logger.*")
            if isinstance(loader, pl.LightningDataModule):
                fit(trainer, model, datamodule=loader)
                resolved = getattr(loader, "num_workers", None)
                if isinstance(resolved, int) and row["backend"]:
                    self._dm_workers[row["backend"]] = resolved
                    row["num_workers"] = resolved
                pinned = getattr(loader, "pin_memory", None)
                row["pin_memory"] = pinned if isinstance(pinned, bool) else None
            else:
                fit(trainer, model, train_dataloaders=loader)
        m = clock.measurement
        logged = self._record_fit(spec, row, rnd, clock, monitor, trainer)
        for lg in trainer.loggers:
            if logged:
                lg.log_metrics(logged, step=trainer.global_step)
            lg.finalize("success" if m is not None else "failed")
        del trainer, model, loader

    def _record_fit(
        self, spec: RowSpec, row: dict[str, Any], rnd: int, clock: RowClock, monitor: Any, trainer: pl.Trainer
    ) -> dict[str, float]:
        """Add a fit's measurement to its row (or the reason it has none); the figures to log for it."""
        m = clock.measurement
        if m is None:
            why = "the fit ended before the warm-up did (too few batches?)"
            if spec.compiled and clock.compile_seconds is None:
                why = "the fit ended before the step time settled after the compile"
            row.update(status=FAILED, reason=why)
            return {}
        if m.compile_seconds is not None and row["compile_seconds"] is None:
            self._compile_seen.append(m.compile_seconds)
            self.say(f"  compiled: {m.compile_seconds:.1f} s from the first step to the first fast one")
        self._add_repeat(row, rnd, m, clock.steps)
        history = getattr(monitor, "history", [])
        gpu, wait = window_means(history, trainer.global_step - m.steps)
        joules = joules_per_sample(history, trainer.global_step - m.steps, m.samples_per_sec)
        this_fit = {
            "gpu_util_mean": gpu if self.cuda else None,
            "data_wait_frac": wait,
            "joules_per_sample": joules,
        }
        for key, value in this_fit.items():
            if value is not None:
                row["_means"][key].append(value)
                row[key] = statistics.fmean(row["_means"][key])
        this_fit.update(samples_per_sec=m.samples_per_sec, p50_ms=m.p50_ms, p90_ms=m.p90_ms)
        return {f"bench/{k}": float(v) for k, v in this_fit.items() if v is not None}

    def _run_one(
        self,
        name: str,
        row: dict[str, Any],
        label: str,
        fits_left: int,
        done: dict[str, dict[str, Any]],
        rnd: int,
    ) -> bool:
        """One fit of row ``name``; ``False`` when the time budget is spent (nothing ran)."""
        spec = SPEC_BY_NAME[name]
        pending = sum(
            1
            for n, r in done.items()
            if n != name and SPEC_BY_NAME[n].compiled and r["status"] == OK and r["compile_seconds"] is None
        )
        seconds = self._row_seconds(fits_left, pending)
        if seconds is None:
            return False
        short = self._budget_short_of_compile(spec, row)
        if short is not None:
            row.update(status=SKIPPED, reason=short)
            self.say(f"{label} {name}: skipped: {short}")
            return True
        self.say(f"{label} {name}: {spec.adds} (measuring ~{seconds:.0f} s)...")
        try:
            if spec.loader == "plain":
                self.run_plain(spec, row, seconds, rnd)
            else:
                self.run_fit(ROW_NAMES.index(name), spec, row, seconds, done, rnd)
        except ModuleNotFoundError as err:
            row.update(status=CANNOT_RUN, reason=str(err).splitlines()[0])
        except (torch.cuda.OutOfMemoryError, RuntimeError, OSError, ValueError) as err:
            # one broken row must not hide the others; its reason is in the table and JSON
            row.update(status=FAILED, reason=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
            self.say("".join(traceback.format_exception(err)).rstrip())
        finally:
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()
        if name in (EAGER, COMPILED) and row["samples_per_sec"]:
            # the worker tuner's target: what the fastest model measured here consumes
            self._ceiling = max(self._ceiling or 0.0, row["samples_per_sec"])
        if row["status"] == OK and row["repeats"]:
            last = row["repeats"][-1]
            self.say(
                f"  -> {last['samples_per_sec']:,.1f} samples/s, step p50 {last['p50_ms']:.1f} ms, "
                f"p90 {last['p90_ms']:.1f} ms ({last['steps']} steps); row median "
                f"{row['samples_per_sec']:,.1f} [{row['samples_per_sec_min']:,.1f}-"
                f"{row['samples_per_sec_max']:,.1f}] over {len(row['repeats'])} fits"
            )
        else:
            self.say(f"  -> {row['status']}: {row['reason']}")
        return True

    def run(self) -> list[dict[str, Any]]:
        """The rows in ladder order, ratios filled in; where none of the rows asked for can run, nothing runs."""
        cfg = self.cfg
        selected = set(cfg.rows)
        asked = [n for n in cfg.rows if self.cannot_run_reason(SPEC_BY_NAME[n]) is None]
        if asked:
            # the ceilings the ratios need, only beside a row that runs
            selected.add(EAGER)
            if self.cuda or "+compile" in selected:
                # the ratios' ceiling wherever compiled rows can run (on a CPU, whenever +compile is asked for)
                selected.add(COMPILED)
        order = [n for n in (EAGER, COMPILED, "ceiling_lightning") if n in selected]
        order += [n for n in ROW_NAMES if n in selected and n not in order]
        if self.cuda:
            # every row and the ceiling alike pick their fastest cuDNN kernels (Trainer(benchmark=None)
            # keeps this process-wide value)
            torch.backends.cudnn.benchmark = True
        done: dict[str, dict[str, Any]] = {}
        rounds = cfg.repeats
        for name in order:
            row = done[name] = self._base_row(SPEC_BY_NAME[name])
            blocked = self.cannot_run_reason(SPEC_BY_NAME[name])
            if blocked is not None:
                row.update(status=blocked[0], reason=blocked[1])
                self.say(f"{name}: dropped ({blocked[0]}): {blocked[1]}")
        runnable = [n for n in order if done[n]["status"] == OK]
        if not asked:
            self.say("none of the rows asked for can run here: nothing is measured")
        spent = False
        for rnd in range(rounds):
            for i, name in enumerate(runnable):
                row = done[name]
                if row["status"] != OK or spent:
                    continue
                where = f"{i + 1}/{len(runnable)}"
                label = f"[{where}]" if rounds == 1 else f"[round {rnd + 1}/{rounds}, {where}]"
                fits_left = (rounds - rnd - 1) * len(runnable) + len(runnable) - i
                spent = not self._run_one(name, row, label, fits_left, done, rnd)
                if spent:
                    self.say(f"{label} time budget spent: the fits left are skipped")
        for name in runnable:
            if done[name]["status"] == OK and not done[name]["repeats"]:
                done[name].update(status=SKIPPED, reason="time budget spent")
        rows = [done[n] for n in ROW_NAMES if n in done]
        for row in rows:
            del row["_means"], row["_measured"], row["_steps"]
        fill_ratios(rows)
        return rows


def run_ladder(config: LadderConfig, progress: Progress | None = None) -> list[dict[str, Any]]:
    """Run the ladder and return its rows (the keys: docs/benchmarks.md, "Outputs").

    Args:
        config: what to run.
        progress: called with one line per phase (dataset work, each row); ``None`` is silent.
    """
    return LadderRunner(config, progress).run()
