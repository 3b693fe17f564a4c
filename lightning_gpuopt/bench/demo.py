"""``lightning-gpuopt demo``: a short monitored fit on generated JPEGs, then every ladder row that can run
here beside the recorded GPU ladder shipped with the package; each run writes a new ``<out>/version_<n>``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_gpuopt._checks import check_arg
from lightning_gpuopt._common import available_cpus, cache_dir, eval_resize_size
from lightning_gpuopt.bench.runs import check_output_folder, in_new_run

Say = Callable[[str], None]

NUM_CLASSES = 10
# the ladder's whole-run seconds, plus these a --ladder-seconds: a cap against a machine far slower than
# expected, not a target (start-ups dominate short rows); the rows it cuts short are named under the table
BUDGET_S, BUDGET_S_PER_SECOND = 60.0, 30.0


@dataclass
class DemoOptions:
    """Settings of ``lightning-gpuopt demo`` (each field is the flag of that name).

    Example:
        >>> run_demo(DemoOptions(out="runs/demo", ladder_seconds=2.0))  # doctest: +SKIP
    """

    out: str | os.PathLike[str] = "./gpuopt_runs/demo"
    steps: int = 40
    images: int = 256
    image_size: int = 32
    batch_size: int = 32
    workers: int | None = None
    ladder_seconds: float = 3.0
    accelerator: str = "auto"

    def validate(self) -> None:
        """Raise ``ValueError`` naming the flag for a bad value."""
        for ok, flag, value, must in (
            (self.steps >= 1, "--steps", self.steps, ">= 1"),
            (self.images >= 1, "--images", self.images, ">= 1"),
            (self.batch_size >= 1, "--batch-size", self.batch_size, ">= 1"),
            (self.image_size >= 16, "--image-size", self.image_size, ">= 16 pixels"),
            (self.workers is None or self.workers >= 0, "--workers", self.workers, ">= 0"),
            (self.ladder_seconds >= 0, "--ladder-seconds", self.ladder_seconds, ">= 0 (0 skips the ladder)"),
            (self.accelerator in ("auto", "cpu", "gpu"), "--accelerator", self.accelerator, "auto/cpu/gpu"),
        ):
            check_arg(ok, flag, value, must)
        if self.batch_size > self.images:
            raise ValueError(
                f"--batch-size {self.batch_size} is larger than --images {self.images}; lower it or add images"
            )


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def _machine(use_gpu: bool) -> str:
    import torch

    return torch.cuda.get_device_name(0) if use_gpu else f"{available_cpus()} CPUs"


def _fit(opts: DemoOptions, data: Path, run: Path, use_gpu: bool, workers: int, say: Say) -> Path:
    import lightning.pytorch as pl

    from lightning_gpuopt._imports import _TENSORBOARD_AVAILABLE
    from lightning_gpuopt.bench.measure import fit
    from lightning_gpuopt.bench.models import ImageClassifier
    from lightning_gpuopt.data.datamodule import OptimizedDataModule
    from lightning_gpuopt.observe.gpu_stats import GPUStatsMonitor

    logger: Any
    if _TENSORBOARD_AVAILABLE:
        from lightning.pytorch.loggers import TensorBoardLogger

        logger = TensorBoardLogger(save_dir=os.fspath(run), name="tensorboard", version="fit")
    else:
        from lightning.pytorch.loggers import CSVLogger

        say(
            "note: tensorboard is not installed, writing CSV logs (pip install 'lightning-gpuopt[tensorboard]')"
        )
        logger = CSVLogger(save_dir=os.fspath(run), name="csv", version="fit")
    interval = max(1, min(10, opts.steps // 8))
    monitor = GPUStatsMonitor(log_every_n_steps=interval, gpu=use_gpu)
    trainer = pl.Trainer(
        accelerator="gpu" if use_gpu else "cpu",
        devices=1,
        max_steps=opts.steps,
        precision="16-mixed" if use_gpu else "32-true",
        logger=logger,
        callbacks=[monitor],
        log_every_n_steps=interval,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
    )
    datamodule = OptimizedDataModule(
        train_dir=data, batch_size=opts.batch_size, num_workers=workers, image_size=opts.image_size
    )
    t0 = time.perf_counter()
    fit(trainer, ImageClassifier("small", num_classes=NUM_CLASSES), datamodule=datamodule)
    seconds = time.perf_counter() - t0
    s = monitor.summary()
    gpu = f"{s['gpu/util']:.0f} %" if "gpu/util" in s else "- (no GPU sampled)"
    say(f"fit: {trainer.global_step} steps of batch {opts.batch_size} in {seconds:.1f} s, GPUStatsMonitor on")
    say(
        f"  samples/s {_fmt(s.get('throughput/samples_per_sec'), ',.0f')}   "
        f"step time {_fmt(s.get('time/step_ms'), '.1f', ' ms')}   "
        f"data-wait fraction {_fmt(s.get('time/data_wait_frac'), '.2f')} (0 = never waits for data)   "
        f"GPU-Util {gpu}"
    )
    return Path(logger.log_dir)


def _notes(rows: list[dict[str, Any]], use_gpu: bool) -> list[str]:
    """What a CPU run cannot show, and the compiled rows this run skipped."""
    from lightning_gpuopt.bench.rows import CANNOT_RUN, SKIPPED, SPEC_BY_NAME

    notes = []
    if not use_gpu:
        gpu_rows = [
            r["name"] for r in rows if r["status"] == CANNOT_RUN and SPEC_BY_NAME[r["name"]].needs_cuda
        ]
        notes.append(
            f"a CPU cannot show: the GPU rows ({', '.join(gpu_rows)}), what 16-mixed and channels_last buy on "
            "tensor cores, or GPU-Util; and the 'GPU' augmentation runs here on the same CPU cores that train"
        )
    skipped = [r for r in rows if r["status"] == SKIPPED and SPEC_BY_NAME[r["name"]].compiled]
    if skipped:
        notes.append(f"skipped here: {', '.join(r['name'] for r in skipped)}: {skipped[0]['reason']}")
    return notes


def _ladder(
    opts: DemoOptions, data: Path, run: Path, use_gpu: bool, workers: int, say: Say
) -> tuple[list[dict[str, Any]], Any]:
    from lightning_gpuopt._imports import _TENSORBOARD_AVAILABLE
    from lightning_gpuopt.bench.rows import ROW_NAMES, LadderConfig
    from lightning_gpuopt.bench.runner import run_ladder

    config = LadderConfig(
        data=data,
        model="small",
        batch_size=opts.batch_size,
        image_size=opts.image_size,
        rows=ROW_NAMES,
        seconds=opts.ladder_seconds,
        steps=30,  # a few seconds of CPU steps at most, even where the warm-up ran faster than the window
        warmup=2,
        repeats=3,
        accelerator="gpu" if use_gpu else "cpu",
        num_workers=workers if workers > 0 else None,
        tune_seconds=min(5.0, 2 * opts.ladder_seconds),
        cache_dir=cache_dir(),
        tb_dir=run / "tensorboard" if _TENSORBOARD_AVAILABLE else None,
        time_budget_s=BUDGET_S + BUDGET_S_PER_SECOND * opts.ladder_seconds,
    )
    say("")
    say(
        f"ladder: each row adds one thing to the row above, on the same images; each row is measured in "
        f"{config.repeats} fits, the rows taking turns: a warm-up past what the loader prefetches, then the "
        f"steps of ~{opts.ladder_seconds / config.repeats:.1f} s timed at every batch end; shown as median "
        "[min-max] with p50/p90 step times"
    )
    return run_ladder(config, progress=lambda line: say(f"  {line}")), config


def run_demo(opts: DemoOptions, say: Say = print) -> Path:
    """Run the demo and return its run folder (``<out>/version_<n>``).

    Raises:
        ValueError: a bad option or an ``--out`` that cannot be written, before any work.
    """
    import torch

    opts.validate()
    check_output_folder(opts.out)
    use_gpu = torch.cuda.is_available() if opts.accelerator == "auto" else opts.accelerator == "gpu"
    if use_gpu and not torch.cuda.is_available():
        raise ValueError("--accelerator gpu was asked for but torch sees no CUDA GPU; use --accelerator cpu")
    return in_new_run(opts.out, lambda run: _run_in(run, opts, use_gpu, say))


def _run_in(run: Path, opts: DemoOptions, use_gpu: bool, say: Say) -> Path:
    from lightning_gpuopt.bench.measure import quiet_lightning
    from lightning_gpuopt.bench.synthetic import cached_jpeg_folder

    say(f"lightning-gpuopt demo on {_machine(use_gpu)}; this run writes to {run}")
    # images as large as the rows store them (their evaluation resize), so that no row upsamples them
    short = eval_resize_size(opts.image_size)
    size = (round(short * 1.25), short)
    data = cached_jpeg_folder(cache_dir() / "demo", opts.images, NUM_CLASSES, size, progress=say)
    workers = opts.workers if opts.workers is not None else min(4, available_cpus() - 1)
    with quiet_lightning():
        log_dir = _fit(opts, data, run, use_gpu, workers, say)
        if opts.ladder_seconds > 0:
            rows, config = _ladder(opts, data, run, use_gpu, workers, say)
    if opts.ladder_seconds > 0:
        _report(rows, config, run, opts, use_gpu, say)
    say(f"logs: {log_dir}")
    if (run / "tensorboard").is_dir():
        say(f"open them with: tensorboard --logdir {run / 'tensorboard'}")
    else:
        say(f"metrics table: {log_dir / 'metrics.csv'}")
    return run


def _report(
    rows: list[dict[str, Any]], config: Any, run: Path, opts: DemoOptions, use_gpu: bool, say: Say
) -> None:
    """The ladder beside the recorded one, its notes, and the files it was written to."""
    from lightning_gpuopt.bench import report

    reference = report.load_reference()
    title = f"this run: small ResNet, batch {opts.batch_size}, {opts.image_size} px on {_machine(use_gpu)}"
    _, png, note = report.write_outputs(
        rows, config, run / "ladder.json", run / "ladder.png", title, reference
    )
    say("")
    say(report.format_comparison(rows, reference))
    precision = "16-mixed where a row adds it" if use_gpu else "32-true: a CPU has no 16-mixed"
    say(f"left: {title} ({precision}). right of |: {report.reference_label(reference)}")
    notes = [*_notes(rows, use_gpu), report.compile_note(rows), report.budget_note(rows, config.repeats)]
    for line in [*filter(None, notes), *report.noise_notes(rows)]:
        say(line)
    say(f"ladder results: {run / 'ladder.json'}" + (f", chart: {png}" if png else f" ({note})"))
