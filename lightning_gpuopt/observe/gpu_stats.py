"""``GPUStatsMonitor``: whether the GPU works or waits, and for what, logged once a window to every logger."""

from __future__ import annotations

import math
import time
from typing import Any, cast

import torch
from typing_extensions import override

from lightning_gpuopt._checks import check_bool, check_float, check_int
from lightning_gpuopt._common import info_once, warn_once
from lightning_gpuopt.observe._lifecycle import Loop, ObserverCallback
from lightning_gpuopt.observe.ceiling import (
    CEILING_KEY,
    CEILING_RATE_KEY,
    Ceiling,
    ReplayCeiling,
    ceiling_frac,
)
from lightning_gpuopt.observe.gpu_idle import BLOCKED_KEY, IDLE_KEY, StreamIdleMeter
from lightning_gpuopt.observe.host_cpu import CPU_KEYS, HostCPUReader
from lightning_gpuopt.observe.host_sync import SYNCS_KEY, SyncLocator, SyncSite, user_sites
from lightning_gpuopt.observe.nvml import GPU_KEYS, NVMLSampler, nvml_device_index
from lightning_gpuopt.observe.timing import CPU_WAIT_NOTE, HOST_KEYS, LOADER_KEY, StepTimer, batch_size_of

__all__ = ["JOULES_KEY", "METRIC_KEYS", "STEP_IDLE_KEY", "GPUStatsMonitor"]

#: Key of the GPU's idle share inside steps: NVML's idle share less the idle share between steps.
STEP_IDLE_KEY = "gpu/step_idle_frac"
#: Key of the energy the GPU drew per trained sample: its mean power over the samples trained a second.
JOULES_KEY = "gpu/joules_per_sample"

#: Every key the monitor can log, in a fixed order (the ``all_ranks`` gather relies on it).
METRIC_KEYS: tuple[str, ...] = (
    *GPU_KEYS,
    JOULES_KEY,
    IDLE_KEY,
    STEP_IDLE_KEY,
    CEILING_KEY,
    CEILING_RATE_KEY,
    SYNCS_KEY,
    *HOST_KEYS,
    LOADER_KEY,
    BLOCKED_KEY,
    *CPU_KEYS,
)


class GPUStatsMonitor(ObserverCallback):
    """Log whether the GPU works or waits, and why, once every logging window.

    Every window it sends one row of ``METRIC_KEYS`` to every logger and appends it to ``history``; nothing
    synchronises the GPU per step. Sources, keys, units, the ceiling replay and the host-sync locator:
    docs/gpu_stats.md. In a Fabric loop it runs through ``FabricObserver`` (docs/fabric.md).

    Args:
        sample_period_s: NVML polling period of the background thread, in seconds.
        log_every_n_steps: window length in optimizer steps; ``None`` uses the Trainer's
            ``log_every_n_steps`` (50 in a Fabric loop), shortened to one epoch's steps.
        gpu: measure the GPU (NVML and CUDA events); ``False`` measures the host only and never warns.
        gpm: also read GPM metrics (SM activity/occupancy, tensor activity) where the GPU has them (Hopper+).
        all_ranks: under DDP, also gather every rank's window and log it under a ``/rank{r}`` suffix.
        nvml_index: NVML device to sample instead of the one mapped from the Trainer's device.
        ceiling: replay ``training_step`` once a fit to measure ``gpu/ceiling_frac`` (one process only).
        ceiling_steps: replayed steps timed for the ceiling (after three untimed ones).
        sync_steps: training steps the host-sync locator watches (``0``: never run it).
        sync_idle_frac: ``gpu/step_idle_frac`` of a window from which the locator runs.

    Attributes:
        history: this fit's windows, keys as logged plus ``"step"`` (the logger step), oldest first.
        last_window: the latest entry of ``history`` (empty before the first window).

    Example:
        >>> from lightning.pytorch.loggers import TensorBoardLogger
        >>> monitor = GPUStatsMonitor(log_every_n_steps=20)
        >>> trainer = pl.Trainer(callbacks=[monitor], logger=TensorBoardLogger("logs"))  # doctest: +SKIP
        >>> trainer.fit(model)  # doctest: +SKIP
        >>> monitor.summary()["gpu/idle_frac"]  # doctest: +SKIP
    """

    def __init__(
        self,
        sample_period_s: float = 0.1,
        log_every_n_steps: int | None = None,
        gpu: bool = True,
        gpm: bool = True,
        all_ranks: bool = False,
        nvml_index: int | None = None,
        ceiling: bool = False,
        ceiling_steps: int = 16,
        sync_steps: int = 5,
        sync_idle_frac: float = 0.10,
    ) -> None:
        super().__init__()
        check_float(
            sample_period_s, "sample_period_s", low=0, low_open=True, what="(seconds)", fix="e.g. 0.1"
        )
        check_int(
            log_every_n_steps,
            "log_every_n_steps",
            low=1,
            none_ok=True,
            what="(optimizer steps)",
            fix="None uses the Trainer's log_every_n_steps",
        )
        check_int(nvml_index, "nvml_index", low=0, none_ok=True, what="(an NVML device index)")
        check_int(ceiling_steps, "ceiling_steps", low=2, what="(replayed steps timed)")
        check_int(sync_steps, "sync_steps", low=0, what="(training steps the sync locator watches; 0: never)")
        check_float(sync_idle_frac, "sync_idle_frac", low=0, high=1, what="(a fraction)", fix="e.g. 0.1")
        for name, value in (("gpu", gpu), ("gpm", gpm), ("all_ranks", all_ranks), ("ceiling", ceiling)):
            check_bool(value, name)
        self.sample_period_s = float(sample_period_s)
        self.log_every_n_steps = log_every_n_steps
        self.gpu = gpu
        self.gpm = gpm
        self.all_ranks = all_ranks
        self.nvml_index = nvml_index
        self.ceiling = ceiling
        self.ceiling_steps = ceiling_steps
        self.sync_steps = sync_steps
        self.sync_idle_frac = float(sync_idle_frac)
        #: the running NVML sampler, or None
        self.sampler: NVMLSampler | None = None
        #: the CUDA-event timeline behind ``gpu/idle_frac``, or None
        self.idle_meter: StreamIdleMeter | None = None
        self._cpu: HostCPUReader | None = None
        self._locator: SyncLocator | None = None
        self._steps_per_epoch: int | None = None
        self._new_fit()

    def _new_fit(self) -> None:
        """Start a fit's windows afresh: a reused monitor reports each fit on its own."""
        self.history: list[dict[str, float]] = []
        self.last_window: dict[str, float] = {}
        #: the latest replayed ceiling of this fit (None where it is not measured)
        self.last_ceiling: Ceiling | None = None
        #: host time ``(start, end)`` of the monitor's latest work of its own (the replay), for the advisor
        self.pause: tuple[float, float] | None = None
        #: the host-sync locator's latest sites in this fit, most frequent first
        self.host_syncs: list[SyncSite] = []
        self._timer = StepTimer()
        self._fetch: tuple[int, float] | None = None  # (id of the loader object, its fetch_seconds)
        self._last_logged_step = 0
        self._ceiling_ok = self._ceiling_due = False
        self._locate: str | None = None  # None: not yet; "due": from the next window's end; "done"
        self._syncs_per_step: float | None = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(log_every_n_steps=self.log_every_n_steps, all_ranks=self.all_ranks)

    def __getstate__(self) -> dict[str, Any]:
        # a thread, CUDA events and a reader bound to this process do not pickle; a copy starts without them
        return {**self.__dict__, "sampler": None, "idle_meter": None, "_cpu": None}

    def _begin(self, loop: Loop) -> None:
        self._new_fit()
        self._ceiling_ok = self._ceiling_due = self.ceiling and loop.world_size == 1
        if self.ceiling and loop.world_size > 1:
            warn_once(
                "GPUStatsMonitor: gpu/ceiling_frac is not measured: the run has several processes, and the "
                "replay measures a single-process run's ceiling (pass ceiling=False to silence this)."
            )
        if not (self.sync_steps and self.gpu and loop.device.type == "cuda"):
            self._locate = "done"
        if not loop.loggers:
            warn_once(
                f"GPUStatsMonitor: the {loop.name} has no logger, so the metrics are kept in "
                f"`GPUStatsMonitor.history` and not logged; {loop.logger_fix} to see them."
            )
        reader = HostCPUReader()
        self._cpu = reader if reader.available else None
        if not self.gpu:
            if loop.device.type == "cpu":
                info_once(f"GPUStatsMonitor: {CPU_WAIT_NOTE}")
            return
        device = loop.device
        if device.type == "cuda":
            self.idle_meter = StreamIdleMeter(device)
        if self.sampler is None:
            self._start_sampler(device)

    def locate_syncs(self) -> None:
        """Run the host-sync locator from the end of the next window (CUDA runs)."""
        if self.sync_steps:
            self._locate = "due"

    def _stop_locator(self) -> None:
        locator, self._locator = self._locator, None
        if locator is None:
            return
        self.host_syncs = locator.stop()
        mine = user_sites(self.host_syncs)
        self._syncs_per_step = sum(s.count for s in mine) / locator.steps if locator.steps else None

    def measure_ceiling(self) -> None:
        """Measure the ceiling again at the end of the next window (where this fit measures it)."""
        self._ceiling_due = self._ceiling_ok

    def _measure_ceiling(self, loop: Loop, batch: Any) -> None:
        """Replay a few steps on a copy of ``batch``; the replay's time is left out of the next window."""
        self._ceiling_due = False
        why = ReplayCeiling.unsupported(loop.module, loop.optimizers)
        if why is not None:
            warn_once(f"GPUStatsMonitor: gpu/ceiling_frac is not measured: {why}.")
            return
        start = time.perf_counter()
        try:
            replay = ReplayCeiling(self.ceiling_steps)
            optimizers = list(loop.optimizers or ())
            result = replay.measure(
                loop.module, optimizers, batch, loop.precision_plugin, loop.device, loop.global_step
            )
        except Exception as err:  # the training state is restored; the run goes on without the figure
            warn_once(
                f"GPUStatsMonitor: gpu/ceiling_frac is not measured: replaying training_step raised "
                f"{type(err).__name__}: {err}. Training continues unchanged (pass ceiling=False to skip it)."
            )
            result = None
        if result is not None:
            self.last_ceiling = result
        self.pause = (start, time.perf_counter())
        self._restart()  # the replay is none of the next window's time

    def _start_sampler(self, device: torch.device) -> None:
        if device.type != "cuda" and self.nvml_index is None:
            warn_once(
                f"GPUStatsMonitor: the training device is {device.type!r}, not CUDA, so there is no GPU to "
                "measure; logging host metrics only (pass gpu=False to silence this)."
                + (f" {CPU_WAIT_NOTE}" if device.type == "cpu" else "")
            )
            return
        why = ""
        try:
            index = self.nvml_index if self.nvml_index is not None else nvml_device_index(device)
            self.sampler = NVMLSampler(index, self.sample_period_s, gpm=self.gpm).start()
        except ModuleNotFoundError:
            why = "NVML bindings are not installed: `pip install 'lightning-gpuopt[nvml]'` (package nvidia-ml-py)."
        except ValueError as err:  # MIG, or a device NVML does not list
            why = f"cannot map {device} to an NVML device: {err}."
        except Exception as err:
            # pynvml.NVMLError (e.g. NVMLError_LibraryNotFound: no libnvidia-ml.so.1 in this container)
            why = f"NVML could not be used ({type(err).__name__}: {err}); is the NVIDIA driver visible to this process?"
        if why:
            warn_once(f"GPUStatsMonitor: {why} Logging without the NVML metrics (gpu/util, power, ...).")

    def _release(self) -> None:
        self._stop_locator()
        if self.sampler is not None:
            self.sampler.stop()  # safe to call twice
        self.sampler = self.idle_meter = self._cpu = None

    def _mark(self) -> None:
        t = time.perf_counter()
        self._timer.mark(t)
        if self.idle_meter is not None:
            self.idle_meter.mark(t)

    def _restart(self) -> None:
        """Data wait, GPU idle, GPU-Util and CPU use count from now."""
        self._mark()
        if self.sampler is not None:
            self.sampler.window()
        if self._cpu is not None:
            self._cpu.read()

    def _start(self, loop: Loop) -> None:
        self._restart()  # setup and the sanity check are none of the first window
        self._read_loader_wait(loop)  # the baseline: earlier use of the loader is not this fit's

    def _epoch_start(self, loop: Loop) -> None:
        self._steps_per_epoch = loop.steps_per_epoch
        # the first batch's wait is the DataLoader starting up and fetching: count it from here
        self._mark()

    def _validation_end(self, loop: Loop, fitting: bool) -> None:
        self._mark()  # validation is not waiting for data

    def _batch_start(self, loop: Loop, batch: Any) -> None:
        t = time.perf_counter()
        self._timer.batch_start(t)
        if self.idle_meter is not None:
            self.idle_meter.step_start(t)

    def _batch_end(self, loop: Loop, batch: Any) -> None:
        t = time.perf_counter()
        if self.idle_meter is not None:
            self.idle_meter.step_end(t)
        self._timer.batch_end(t, batch_size_of(batch))
        if self._locator is not None:
            self._locator.step()
            if self._locator.steps >= self.sync_steps:
                self._stop_locator()
        step = loop.global_step
        if step > self._last_logged_step and step % self._interval(loop) == 0:
            self._stop_locator()  # the window's end and the replay synchronize: not the user's
            self._log_window(loop)
            if self._ceiling_due:
                self._measure_ceiling(loop, batch)
            if self._locate == "due":
                self._locate = "done"
                locator = SyncLocator()
                self._locator = locator if locator.start() else None

    def _end(self, loop: Loop) -> None:
        # the last, possibly shorter window; global_step is the same on every rank, so a gather stays matched
        if loop.global_step > self._last_logged_step:
            self._log_window(loop, last=True)

    def _interval(self, loop: Loop) -> int:
        if self.log_every_n_steps is not None:
            return self.log_every_n_steps
        # log_every_n_steps=0 turns Trainer logging off; windows still reach `history` every 50 steps
        interval = loop.log_every_n_steps or 50
        # epochs shorter than the interval would otherwise give one window for several epochs
        return min(interval, self._steps_per_epoch or interval)

    def _read_loader_wait(self, loop: Loop) -> float | None:
        """Seconds spent inside the training loader's ``next()`` since the previous call; None if unknown."""
        loaders = loop.train_loaders
        total = loop.fetch_seconds()
        if total is None:
            self._fetch = None
            return None
        previous, self._fetch = self._fetch, (id(loaders), total)
        if previous is None:
            return None
        if previous[0] != id(loaders) or total < previous[1]:
            return total  # a reloaded loader counts from its start
        return total - previous[1]

    def _log_window(self, loop: Loop, last: bool = False) -> None:
        self._last_logged_step = loop.global_step
        loader_s = self._read_loader_wait(loop)
        if loader_s is not None:
            self._timer.add_loader_wait(loader_s)
        metrics = self._timer.window()
        if self.idle_meter is not None:
            # the last window waits for the GPU to finish: one wait per fit, after the last step
            metrics.update(self.idle_meter.window(wait=last))
        if self._cpu is not None:
            metrics.update(self._cpu.window())
        if self.sampler is not None:
            metrics.update(self.sampler.window())
        self._derived(metrics)
        metrics = {k: metrics[k] for k in METRIC_KEYS if k in metrics}
        if self.all_ranks and loop.world_size > 1:
            metrics = self._gather(loop, metrics)
        if not metrics:
            return
        # Lightning logs the batch that made optimizer step k at step k-1 (before its counter moves on), so
        # our rows land on the same step as the LightningModule's own `self.log` values.
        log_step = max(loop.global_step - 1, 0)
        self.last_window = {**metrics, "step": float(log_step)}
        self.history.append(self.last_window)
        if loop.is_global_zero and (self.log_every_n_steps is not None or loop.log_every_n_steps != 0):
            loop.log_metrics(metrics, log_step)

    def _derived(self, metrics: dict[str, float]) -> None:
        power, rate = metrics.get("gpu/power_w"), metrics.get("throughput/samples_per_sec")
        if power is not None and rate:
            metrics[JOULES_KEY] = power / rate
        if self.last_ceiling is not None:
            frac = ceiling_frac(metrics.get("throughput/samples_per_sec"), self.last_ceiling.samples_per_sec)
            if frac is not None:
                metrics[CEILING_KEY] = frac
                metrics[CEILING_RATE_KEY] = self.last_ceiling.samples_per_sec
        util, idle = metrics.get("gpu/util"), metrics.get(IDLE_KEY)
        if util is not None and idle is not None:
            metrics[STEP_IDLE_KEY] = min(max(1.0 - util / 100.0 - idle, 0.0), 1.0)
            # the first window holds the warm-up; a later one whose GPU waits inside steps gets the locator
            if self._locate is None and self.history and metrics[STEP_IDLE_KEY] >= self.sync_idle_frac:
                self._locate = "due"
        if self._syncs_per_step is not None:
            metrics[SYNCS_KEY], self._syncs_per_step = self._syncs_per_step, None

    def _gather(self, loop: Loop, metrics: dict[str, float]) -> dict[str, float]:
        values = torch.tensor([metrics.get(k, math.nan) for k in METRIC_KEYS], dtype=torch.float64)
        gathered = cast(torch.Tensor, loop.all_gather(values.to(loop.device)))
        gathered = gathered.reshape(-1, len(METRIC_KEYS)).cpu()
        out = dict(metrics)
        for rank, row in enumerate(gathered.tolist()):
            for key, value in zip(METRIC_KEYS, row, strict=True):
                if not math.isnan(value):
                    out[f"{key}/rank{rank}"] = value
        return out

    def summary(self) -> dict[str, float]:
        """Mean of each key over this fit's windows after the first (warm-up) one; empty with one window."""
        out: dict[str, float] = {}
        for key in METRIC_KEYS:
            values = [w[key] for w in self.history[1:] if key in w]
            if values:
                out[key] = sum(values) / len(values)
        return out

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_logged_step": self._last_logged_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # configuration comes from __init__; only the position of the logging window is resumed
        self._last_logged_step = int(state_dict.get("last_logged_step", 0))
