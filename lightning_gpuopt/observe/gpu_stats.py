"""``GPUStatsMonitor``: log GPU-Util (NVML), SM activity (GPM), data-wait and samples/s to every logger."""

from __future__ import annotations

import math
import time
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from lightning_gpuopt.observe.nvml import GPU_KEYS, NVMLSampler, nvml_device_index
from lightning_gpuopt.observe.timing import HOST_KEYS, StepTimer, batch_size_of

__all__ = ["METRIC_KEYS", "GPUStatsMonitor"]

METRIC_KEYS: tuple[str, ...] = GPU_KEYS + HOST_KEYS


def _trainer_interval(trainer: pl.Trainer) -> int:
    # a public Trainer attribute that type stubs do not declare
    return int(getattr(trainer, "log_every_n_steps", 50))


class GPUStatsMonitor(Callback):
    """Log what the GPU does and whether it waits for data, once every logging window.

    Add it to a Trainer: ``Trainer(callbacks=[GPUStatsMonitor()])``. Every ``log_every_n_steps`` optimizer
    steps it sends one row of metrics to every logger the Trainer has (TensorBoard, CSV, W&B, MLflow, ...).
    GPU metrics come from NVML, sampled on a background thread; host metrics come from ``time.perf_counter``
    around each training batch. Nothing synchronises the GPU or talks across ranks per step.

    Args:
        sample_period_s: NVML polling period of the background thread, in seconds.
        log_every_n_steps: logging window in optimizer steps; ``None`` uses the Trainer's ``log_every_n_steps``.
        gpu: sample the GPU through NVML; ``False`` logs host metrics only (and never warns).
        gpm: also read GPM metrics (SM activity/occupancy, tensor activity) where the GPU has them (Hopper+).
        all_ranks: under DDP, also gather every rank's window (one small ``all_gather`` per window) and log
            each under a ``/rank{r}`` suffix. Without it, the logged values are global rank 0's own device.
        nvml_index: NVML device to sample instead of the one mapped from the Trainer's device (rarely
            needed: the mapping already follows ``CUDA_VISIBLE_DEVICES`` and device UUIDs).

    Logged keys (one value per window; a GPU key is absent where the GPU or driver does not report it):

    ========================== ====== ==================================================================
    key                        unit   meaning
    ========================== ====== ==================================================================
    gpu/util                   %      NVML GPU-Util, mean over the window (driver sample buffer)
    gpu/util_min               %      lowest GPU-Util sample in the window
    gpu/mem_util               %      memory-controller utilisation, mean
    gpu/mem_used_gb            GiB    device memory used (all processes), peak in the window
    gpu/mem_total_gb           GiB    device memory total
    gpu/power_w                W      board power draw, mean
    gpu/temp_c                 °C     GPU temperature, mean
    gpu/sm_clock_mhz           MHz    SM clock, mean
    gpu/sm_active              %      GPM: share of SMs busy, time-weighted mean (Hopper+)
    gpu/sm_occupancy           %      GPM: resident warps vs the maximum, mean (Hopper+)
    gpu/tensor_active          %      GPM: share of time tensor cores were busy, mean (Hopper+)
    time/step_ms               ms     host wall time a training step, data wait included, mean
    time/data_wait_ms          ms     end of one training batch to the start of the next, mean
    time/data_wait_frac        0..1   data wait / step time over the window
    throughput/samples_per_sec 1/s    samples (leading batch dimension) / step time
    ========================== ====== ==================================================================

    With ``all_ranks=True`` each key is also logged as ``<key>/rank{r}`` for every global rank ``r``.

    Attributes:
        history: every window, keys as logged plus ``"step"`` (the logger step), oldest first.
        last_window: the latest entry of ``history`` (empty before the first window).
    """

    def __init__(
        self,
        sample_period_s: float = 0.1,
        log_every_n_steps: int | None = None,
        gpu: bool = True,
        gpm: bool = True,
        all_ranks: bool = False,
        nvml_index: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(sample_period_s, (int, float)) or not sample_period_s > 0:
            raise ValueError(f"sample_period_s must be a number of seconds > 0, got {sample_period_s!r}")
        if log_every_n_steps is not None and (
            not isinstance(log_every_n_steps, int)
            or isinstance(log_every_n_steps, bool)
            or log_every_n_steps < 1
        ):
            raise ValueError(
                f"log_every_n_steps must be an int >= 1 or None (use the Trainer's), got {log_every_n_steps!r}"
            )
        if nvml_index is not None and (not isinstance(nvml_index, int) or nvml_index < 0):
            raise ValueError(f"nvml_index must be an NVML device index >= 0 or None, got {nvml_index!r}")
        for name, value in (("gpu", gpu), ("gpm", gpm), ("all_ranks", all_ranks)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        self.sample_period_s = float(sample_period_s)
        self.log_every_n_steps = log_every_n_steps
        self.gpu = gpu
        self.gpm = gpm
        self.all_ranks = all_ranks
        self.nvml_index = nvml_index
        self.history: list[dict[str, float]] = []
        self.last_window: dict[str, float] = {}
        self._sampler: NVMLSampler | None = None
        self._timer = StepTimer()
        self._last_logged_step = 0
        self._warned = False

    @property
    def state_key(self) -> str:
        return self._generate_state_key(log_every_n_steps=self.log_every_n_steps, all_ranks=self.all_ranks)

    @property
    def sampler(self) -> NVMLSampler | None:
        """The running NVML sampler, or None (CPU run, no NVML, ``gpu=False`` or not set up)."""
        return self._sampler

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_sampler"] = None  # a thread does not pickle; a copy starts without one
        return state

    # ------------------------------------------------------------------------------------------ resources
    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            rank_zero_warn(f"GPUStatsMonitor: {message} Logging host-side metrics only (time/, throughput/).")

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._timer = StepTimer()
        self._last_logged_step = 0  # a new fit counts from its own first step (a resume restores it later)
        if not self.gpu or self._sampler is not None:
            return
        device = trainer.strategy.root_device
        if device.type != "cuda" and self.nvml_index is None:
            self._warn_once(
                f"the training device is {device.type!r}, not CUDA, so there is no GPU to sample (pass gpu=False "
                "to silence this)."
            )
            return
        try:
            index = self.nvml_index if self.nvml_index is not None else nvml_device_index(device)
            self._sampler = NVMLSampler(index, self.sample_period_s, gpm=self.gpm).start()
        except ModuleNotFoundError:
            self._warn_once(
                "NVML bindings are not installed: `pip install 'lightning-gpuopt[nvml]'` (package nvidia-ml-py)."
            )
        except ValueError as err:  # MIG or an unmatched CUDA_VISIBLE_DEVICES entry
            self._warn_once(f"cannot map {device} to an NVML device: {err}.")
        except Exception as err:
            # pynvml.NVMLError (e.g. NVMLError_LibraryNotFound: no libnvidia-ml.so.1 in this container)
            self._warn_once(
                f"NVML could not be used ({type(err).__name__}: {err}); is the NVIDIA driver visible to this process?"
            )

    def _stop_sampler(self) -> None:
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.stop()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_sampler()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._stop_sampler()

    # ------------------------------------------------------------------------------------------ timing
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._sampler is not None:
            self._sampler.window()  # drop setup/sanity-check time from the first window

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the first batch's wait is the DataLoader starting up and fetching: count it from here
        self._timer.mark(time.perf_counter())

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # validation inside fit is not time spent waiting for training data
        self._timer.mark(time.perf_counter())

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._timer.batch_start(time.perf_counter())

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._timer.batch_end(time.perf_counter(), batch_size_of(batch))
        step = trainer.global_step
        if step > self._last_logged_step and step % self._interval(trainer) == 0:
            self._log_window(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the last, possibly shorter window; global_step is the same on every rank, so a gather stays matched
        if trainer.global_step > self._last_logged_step:
            self._log_window(trainer, pl_module)

    # ------------------------------------------------------------------------------------------ logging
    def _interval(self, trainer: pl.Trainer) -> int:
        if self.log_every_n_steps is not None:
            return self.log_every_n_steps
        # log_every_n_steps=0 turns Trainer logging off; windows still reach `history` every 50 steps
        return _trainer_interval(trainer) or 50

    def _log_window(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_logged_step = trainer.global_step
        metrics = self._timer.window()
        if self._sampler is not None:
            metrics = {**self._sampler.window(), **metrics}
        if self.all_ranks and trainer.world_size > 1:
            metrics = self._gather(pl_module, metrics)
        if not metrics:
            return
        # Lightning logs the batch that made optimizer step k at step k-1 (before its counter moves on), so
        # our rows land on the same step as the LightningModule's own `self.log` values.
        log_step = max(trainer.global_step - 1, 0)
        self.last_window = {**metrics, "step": float(log_step)}
        self.history.append(self.last_window)
        if trainer.is_global_zero and (self.log_every_n_steps is not None or _trainer_interval(trainer) != 0):
            # straight to each logger (as Lightning's LearningRateMonitor does): `pl_module.log` from a callback
            # would only be flushed on the Trainer's own interval, not ours
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=log_step)

    def _gather(self, pl_module: pl.LightningModule, metrics: dict[str, float]) -> dict[str, float]:
        values = torch.tensor([metrics.get(k, math.nan) for k in METRIC_KEYS], dtype=torch.float64)
        gathered = cast(torch.Tensor, pl_module.all_gather(values.to(pl_module.device)))
        gathered = gathered.reshape(-1, len(METRIC_KEYS)).cpu()
        out = dict(metrics)
        for rank, row in enumerate(gathered.tolist()):
            for key, value in zip(METRIC_KEYS, row, strict=True):
                if not math.isnan(value):
                    out[f"{key}/rank{rank}"] = value
        return out

    def summary(self) -> dict[str, float]:
        """Mean of each key over ``history``, skipping the first (warm-up) window when there are several."""
        windows = self.history[1:] if len(self.history) > 1 else self.history
        out: dict[str, float] = {}
        for key in METRIC_KEYS:
            values = [w[key] for w in windows if key in w]
            if values:
                out[key] = sum(values) / len(values)
        return out

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "sample_period_s": self.sample_period_s,
            "log_every_n_steps": self.log_every_n_steps,
            "all_ranks": self.all_ranks,
            "last_logged_step": self._last_logged_step,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # configuration comes from __init__; only the position of the logging window is resumed
        self._last_logged_step = int(state_dict.get("last_logged_step", 0))
