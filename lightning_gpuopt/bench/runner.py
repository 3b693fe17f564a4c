"""Runs the ladder (``bench.rows``): each row ``repeats`` short fits, the rows taking turns, the ceilings
first, each fit measured past its warm-up and compile (docs/benchmarks.md).
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
from lightning_gpuopt.bench.measure import PlainLoop, fit
from lightning_gpuopt.bench.report import COMPILED, EAGER, fill_ratios
from lightning_gpuopt.bench.rows import (
    BUDGET_SPENT,
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
from lightning_gpuopt.bench.steady import (
    FAST_RUN,
    SETTLE_LIMIT_S,
    Measurement,
    StepClock,
    first_fast_step,
    joules_per_sample,
    measure_loop,
    summarize,
    window_means,
)

Progress = Callable[[str], None]

# when data rows tie within this fraction, prefer DALI, then HDF5: they leave the host CPU more idle
_BEST_TIE_FRAC = 0.03
_BACKEND_PREFERENCE = ("dali", "hdf5", "folder")
_ROW_OF_BACKEND = {"folder": "+uint8_gpu_aug", "hdf5": "+hdf5", "dali": "+dali"}
# label sets the synthetic batch cycles through: one batch with fixed labels would be fitted exactly, and its
# vanishing gradients are not the work a real step does
_LABEL_SETS = 8
# the figures a row takes from ``summarize`` over its fits
_SUMMARY_KEYS = (
    *("samples_per_sec", "samples_per_sec_min", "samples_per_sec_max"),
    *("spread", "p50_ms", "p90_ms"),
)
# a row's keys that stay null until measured
_ROW_NONE_KEYS = (
    "reason",
    *_SUMMARY_KEYS,
    *("ratio_to_ceiling", "ratio_to_ceiling_worst", "ratio_to_eager_ceiling", "speedup_vs_naive"),
    *("gpu_util_mean", "data_wait_frac", "joules_per_sample", "backend", "num_workers", "pin_memory"),
    *("compile_seconds", "steps_measured", "seconds_measured", "_steps"),
)
# the monitor's figures a row averages over its fits
_FIT_MEANS = ("gpu_util_mean", "data_wait_frac", "joules_per_sample")


def _no_h5py() -> str | None:
    from lightning_gpuopt._imports import _H5PY_AVAILABLE

    return None if _H5PY_AVAILABLE else "h5py is not installed (pip install 'lightning-gpuopt[hdf5]')"


def _window_steps(seconds: float | None, step_s: float, steps: int, cap: int | None) -> int:
    """Steps that take ``seconds`` at ``step_s`` a step (at least 2, at most ``cap``); ``steps`` without a time."""
    if not seconds or step_s <= 0:
        return steps
    n = max(2, int(seconds / step_s))
    return min(n, cap) if cap else n


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
    """``StepClock`` for one fit of a ladder row: ``warmup`` steps past the loader's prefetch
    (``prefetched_batches``) and, with ``seconds``, a window of the steps that take that long at the warm-up's
    rate (at most ``max_steps``); ``settle``: a compiled model, sized once its step time settles.

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
        self._sized = True
        n = min(last, len(self._ends) - 1)
        if n < 1 or self.seconds is None:
            return
        self.warmup_step_s = (self._ends[-1] - self._ends[-1 - n]) / n
        self.steps = _window_steps(self.seconds, self.warmup_step_s, self.steps, self.max_steps)

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
        # what the fastest model measured here consumes: the worker tuner stops once a loader has headroom over it
        self._ceiling: float | None = None
        self._compile_asked = compile_asked(config.rows)

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
        self, spec: RowSpec, callbacks: list[pl.Callback], max_seconds: float | None, version: str
    ) -> pl.Trainer:
        logger: Any = False
        if self.cfg.tb_dir is not None:
            from lightning.pytorch.loggers import TensorBoardLogger

            slug = f"{ROW_NAMES.index(spec.name):02d}_{spec.name.lstrip('+').replace('/', '_')}"
            logger = TensorBoardLogger(os.fspath(self.cfg.tb_dir), name=slug, version=version)
        return pl.Trainer(
            accelerator="gpu" if self.cuda else "cpu",
            devices=1,
            precision=cast(Any, self._precision(spec)),
            max_epochs=-1,
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
            target_samples_per_sec=self._ceiling,
            batch_size=self.cfg.batch_size,
            cache_dir=self.cfg.cache_dir,
        )
        self._naive_workers = int(result.best)
        src = "cached" if result.cached else f"measured in {result.seconds:.1f} s"
        self.say(f"  -> {self._naive_workers} workers ({src})")
        return self._naive_workers

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
        try:
            HDF5ImageDataset(out).close()
            self.say(f"using cached HDF5 copy {out}")
        except (FileNotFoundError, ValueError, RuntimeError) as err:
            if out.is_file():  # another format version, or damaged: convert again
                self.say(f"cached HDF5 copy {out} cannot be read by this version ({err}); converting again")
                out.unlink()
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
        return "hdf5" if self.data_is_h5 or _no_h5py() is None else "folder"

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

    def _row_seconds(self, fits_left: int) -> float | None:
        """The next fit's measured seconds within the whole-run budget, or ``None`` when it is spent."""
        cfg = self.cfg
        per_fit = cfg.seconds / cfg.repeats
        if cfg.time_budget_s is None:
            return per_fit
        left = cfg.time_budget_s - (time.perf_counter() - self._t_start)
        if left < 5.0:
            return None
        # start-up and warm-up (up to the measured seconds for prefetching rows) take about half a fit
        share = 0.45 * left / max(fits_left, 1)
        if per_fit == 0:
            return share
        return max(min(1.0, per_fit), min(per_fit, share))

    def run_plain(self, spec: RowSpec, row: dict[str, Any], seconds: float, rnd: int = 0) -> None:
        from lightning_gpuopt.bench.models import build_model

        cfg = self.cfg
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
                why = f"the step time did not settle within {SETTLE_LIMIT_S:.0f} s"
                row.update(status=FAILED, reason=why)
                return
            times.append(loop.timed_step())
            fast = first_fast_step(times)
        self.say(f"  warmed up in {time.perf_counter() - t0:.1f} s ({len(times)} steps)")
        step_s = statistics.fmean(times[fast:])
        steps = row["_steps"] or _window_steps(
            seconds if cfg.seconds else None, step_s, cfg.steps or 2, cfg.steps
        )
        m = measure_loop(loop.step, self.device, cfg.warmup, steps, cfg.batch_size)
        compiled_in = sum(times[:fast]) if spec.compiled else None
        self._add_repeat(row, rnd, replace(m, compile_seconds=compiled_in), steps)
        row.update(precision="fp16 autocast" if dtype is not None else "fp32", backend="synthetic (device)")

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
            ys = [
                torch.randint(0, self.num_classes, x.shape[:1], device=self.device)
                for _ in range(_LABEL_SETS)
            ]
            row.update(backend="synthetic (device)", num_workers=0)
            return DeviceBatches(x.contiguous(memory_format=mf), ys, 1_000_000)
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
                target_samples_per_sec=self._ceiling,
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
            {k: summary[k] for k in _SUMMARY_KEYS},
            repeats=repeats,
            windows=[r["samples_per_sec"] for r in repeats],
            steps_measured=sum(r["steps"] for r in repeats),
            seconds_measured=sum(r["seconds"] for r in repeats),
        )
        if row["compile_seconds"] is None:
            row["compile_seconds"] = m.compile_seconds

    def run_fit(
        self,
        spec: RowSpec,
        row: dict[str, Any],
        seconds: float,
        done: dict[str, dict[str, Any]],
        rnd: int = 0,
    ) -> None:
        """One fit of a row trained through Lightning; its measurement (or why it has none) goes to ``row``."""
        loader = self._loader_for(spec, row, done)
        if loader is None:
            return
        from lightning_gpuopt.bench.models import ImageClassifier
        from lightning_gpuopt.observe.gpu_stats import GPUStatsMonitor

        callbacks: list[pl.Callback] = []
        model = ImageClassifier(self.cfg.model, num_classes=self.num_classes, lr=self.cfg.lr)
        if spec.channels_last and spec.loader == "device":
            # the ceiling needs no package component: the model is simply made channels_last
            model = model.to(memory_format=torch.channels_last)
        elif spec.channels_last:
            from lightning_gpuopt.compute.channels_last import ChannelsLast

            callbacks.append(ChannelsLast())
        if spec.compiled:
            from lightning_gpuopt.compute.compile import CompileModel

            callbacks.append(CompileModel())
        cfg = self.cfg
        # the row's first fit sizes the window from its warm-up; at least one warm-up step: it pays for cuDNN
        # autotuning and worker start-up
        sized = seconds if row["_steps"] is None and cfg.seconds > 0 else None
        clock = RowClock(max(cfg.warmup, 1), row["_steps"] or cfg.steps or 2, sized, cfg.steps, spec.compiled)
        # the naive row makes about one step a second: short windows still give several after the warm-up
        monitor = GPUStatsMonitor(log_every_n_steps=2 if spec.name == "naive" else 10, gpu=self.cuda)
        safety = 3 * seconds + 120 + (SETTLE_LIMIT_S if spec.compiled else 0) if seconds > 0 else None
        trainer = self._trainer(spec, [*callbacks, clock, monitor], safety, f"fit_{rnd}")
        with warnings.catch_warnings():
            # rows without TensorBoard keep the monitor's windows in its history on purpose
            warnings.filterwarnings("ignore", message=".*has no logger.*")
            if isinstance(loader, pl.LightningDataModule):
                fit(trainer, model, datamodule=loader)
                resolved = getattr(loader, "num_workers", None)
                if isinstance(resolved, int) and row["backend"]:
                    self._dm_workers[row["backend"]] = row["num_workers"] = resolved
                pinned = getattr(loader, "pin_memory", None)
                row["pin_memory"] = pinned if isinstance(pinned, bool) else None
            else:
                fit(trainer, model, train_dataloaders=loader)
        logged = self._record_fit(spec, row, rnd, clock, monitor, trainer)
        for lg in trainer.loggers:
            if logged:
                lg.log_metrics(logged, step=trainer.global_step)
            lg.finalize("success" if clock.measurement is not None else "failed")

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
        self._add_repeat(row, rnd, m, clock.steps)
        history = getattr(monitor, "history", [])
        gpu, wait = window_means(history, trainer.global_step - m.steps)
        joules = joules_per_sample(history, trainer.global_step - m.steps, m.samples_per_sec)
        this_fit = dict(zip(_FIT_MEANS, (gpu if self.cuda else None, wait, joules), strict=True))
        for key, value in this_fit.items():
            if value is not None:
                row["_means"][key].append(value)
                row[key] = statistics.fmean(row["_means"][key])
        this_fit.update(samples_per_sec=m.samples_per_sec, p50_ms=m.p50_ms, p90_ms=m.p90_ms)
        return {f"bench/{k}": float(v) for k, v in this_fit.items() if v is not None}

    def _run_one(
        self, name: str, row: dict[str, Any], seconds: float, done: dict[str, dict[str, Any]], rnd: int
    ) -> None:
        """One fit of row ``name``; a row that raises is marked failed with its reason, and the ladder goes on."""
        spec = SPEC_BY_NAME[name]
        compiled = row["compile_seconds"]
        try:
            if spec.compiled:
                torch.compiler.reset()  # each compiled fit compiles afresh in this process (on-disk caches stay)
            if spec.loader == "plain":
                self.run_plain(spec, row, seconds, rnd)
            else:
                self.run_fit(spec, row, seconds, done, rnd)
        except ModuleNotFoundError as err:
            row.update(status=CANNOT_RUN, reason=str(err).splitlines()[0])
        except (torch.cuda.OutOfMemoryError, RuntimeError, OSError, ValueError) as err:
            row.update(status=FAILED, reason=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
            self.say("".join(traceback.format_exception(err)).rstrip())
        finally:
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()
        if compiled is None and row["compile_seconds"] is not None:
            self.say(f"  compiled: {row['compile_seconds']:.1f} s from the first step to the first fast one")
        if name in (EAGER, COMPILED) and row["samples_per_sec"]:
            self._ceiling = max(self._ceiling or 0.0, row["samples_per_sec"])
        if row["status"] != OK or not row["repeats"]:
            self.say(f"  -> {row['status']}: {row['reason']}")
            return
        last = row["repeats"][-1]
        self.say(
            f"  -> {last['samples_per_sec']:,.1f} samples/s, step p50 {last['p50_ms']:.1f} ms, "
            f"p90 {last['p90_ms']:.1f} ms ({last['steps']} steps); row median "
            f"{row['samples_per_sec']:,.1f} [{row['samples_per_sec_min']:,.1f}-"
            f"{row['samples_per_sec_max']:,.1f}] over {len(row['repeats'])} fits"
        )

    def _plan(self) -> dict[str, dict[str, Any]]:
        """A row for each row to run, in running order (the ceilings first), those that cannot run saying why."""
        selected = set(self.cfg.rows)
        asked = [n for n in selected if self.cannot_run_reason(SPEC_BY_NAME[n]) is None]
        if asked:
            # the ceilings the ratios need, only beside a row that runs; the compiled one wherever compiled
            # rows can run (on a CPU, whenever +compile is asked for)
            selected.add(EAGER)
            if self.cuda or "+compile" in selected:
                selected.add(COMPILED)
        order = [n for n in (EAGER, COMPILED, "ceiling_lightning") if n in selected]
        order += [n for n in ROW_NAMES if n in selected and n not in order]
        done: dict[str, dict[str, Any]] = {}
        for name in order:
            row = done[name] = self._base_row(SPEC_BY_NAME[name])
            blocked = self.cannot_run_reason(SPEC_BY_NAME[name])
            if blocked is not None:
                row.update(status=blocked[0], reason=blocked[1])
                self.say(f"{name}: dropped ({blocked[0]}): {blocked[1]}")
        if not asked:
            self.say("none of the rows asked for can run here: nothing is measured")
        return done

    def run(self) -> list[dict[str, Any]]:
        """The rows in ladder order, ratios filled in; where none of the rows asked for can run, nothing runs."""
        done = self._plan()
        if self.cuda:
            # every row and the ceiling alike pick their fastest cuDNN kernels (Trainer(benchmark=None)
            # keeps this process-wide value)
            torch.backends.cudnn.benchmark = True
        rounds = self.cfg.repeats
        runnable = [n for n, r in done.items() if r["status"] == OK]
        fits = [(rnd, i, name) for rnd in range(rounds) for i, name in enumerate(runnable)]
        for k, (rnd, i, name) in enumerate(fits):
            if done[name]["status"] != OK:
                continue
            where = f"{i + 1}/{len(runnable)}"
            label = f"[{where}]" if rounds == 1 else f"[round {rnd + 1}/{rounds}, {where}]"
            seconds = self._row_seconds(len(fits) - k)
            if seconds is None:
                self.say(f"{label} time budget spent: the fits left are skipped")
                break
            self.say(f"{label} {name}: {SPEC_BY_NAME[name].adds} (measuring ~{seconds:.0f} s)...")
            self._run_one(name, done[name], seconds, done, rnd)
        for row in done.values():
            if row["status"] == OK and not row["repeats"]:
                row.update(status=SKIPPED, reason=BUDGET_SPENT)
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
