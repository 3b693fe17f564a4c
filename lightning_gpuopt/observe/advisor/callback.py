"""``BottleneckAdvisor``: the Lightning callback that feeds ``diagnose`` one window at a time."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from lightning.fabric.loggers import TensorBoardLogger  # Lightning's (lightning.pytorch) derives from it
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_gpuopt._checks import check_arg, check_bool, check_int
from lightning_gpuopt._common import FeedInfo, info_once, warn_at_user
from lightning_gpuopt.observe._lifecycle import Loop, ObserverCallback, first_loader
from lightning_gpuopt.observe.advisor.config import (
    describe_feed,
    distinct_memory_format,
    image_tensor,
    loop_config,
)
from lightning_gpuopt.observe.advisor.evidence import Evidence, RunConfig
from lightning_gpuopt.observe.advisor.ranks import AllReduceWaitTimer, gather_ranks
from lightning_gpuopt.observe.advisor.rules import AdvisorThresholds, diagnose, unmet_needs
from lightning_gpuopt.observe.advisor.scale import ScaleWatch
from lightning_gpuopt.observe.advisor.verdict import KINDS, Hysteresis, Verdict, format_summary, markdown
from lightning_gpuopt.observe.gpu_stats import GPUStatsMonitor
from lightning_gpuopt.observe.host_sync import user_sites
from lightning_gpuopt.observe.timing import StepTimer, batch_size_of

__all__ = ["BottleneckAdvisor"]

_DEFAULT_WINDOW = 20
_MIN_WINDOW = 2  # a shorter window is one batch's noise
_HISTORY = 1000


class BottleneckAdvisor(ObserverCallback):
    """Tell which part of the pipeline starves or slows the GPU, and what to change.

    After warm-up it judges the run one window at a time from its own host timing, a ``GPUStatsMonitor``
    among the callbacks (put it first), every rank's all-reduce wait under DDP and the run's configuration;
    ``verdicts`` holds the raised :class:`Verdict` objects. It logs ``advisor/<kind>`` flags and prints a
    summary at the end of fit; docs/advisor.md lists the kinds, their rules, thresholds and logged keys.

    Example:
        >>> from lightning_gpuopt import GPUStatsMonitor
        >>> advisor = BottleneckAdvisor(warmup_steps=20)
        >>> trainer = pl.Trainer(callbacks=[GPUStatsMonitor(), advisor])  # doctest: +SKIP
        >>> trainer.fit(model, datamodule=dm)  # doctest: +SKIP
        >>> [v.label for v in advisor.verdicts]  # doctest: +SKIP
        ['input-bound (decode-bound)']

    Args:
        warmup_steps: training batches ignored first (at most half an epoch).
        window_steps: training batches a window spans (at most half an epoch); ``None`` follows the
            ``GPUStatsMonitor``'s windows (20 batches when there is no monitor).
        min_windows: consecutive windows a verdict must hold before it is raised.
        clear_windows: consecutive windows without it before a raised verdict is cleared.
        thresholds: numbers the rules use (:class:`AdvisorThresholds`).
        verbose: print the summary at the end of fit.
    """

    def __init__(
        self,
        warmup_steps: int = 20,
        window_steps: int | None = None,
        min_windows: int = 2,
        clear_windows: int = 2,
        thresholds: AdvisorThresholds | None = None,
        verbose: bool = True,
    ) -> None:
        check_int(warmup_steps, "warmup_steps", low=0, what="(training batches)")
        follow = "None follows the GPUStatsMonitor's windows"
        check_int(window_steps, "window_steps", low=1, none_ok=True, what="(training batches)", fix=follow)
        check_int(min_windows, "min_windows", low=1)
        check_int(clear_windows, "clear_windows", low=1)
        ok = thresholds is None or isinstance(thresholds, AdvisorThresholds)
        must, fix = "an AdvisorThresholds instance or None", "e.g. AdvisorThresholds(gpu_idle_frac=0.05)"
        check_arg(ok, "thresholds", thresholds, must, fix=fix, error=TypeError)
        check_bool(verbose, "verbose")
        self.warmup_steps = warmup_steps
        self.window_steps = window_steps
        self.min_windows = min_windows
        self.clear_windows = clear_windows
        self.thresholds = thresholds or AdvisorThresholds()
        self.verbose = verbose
        self._filter = Hysteresis(min_windows, clear_windows)
        self.history: list[dict[str, Any]] = []
        self.config: RunConfig | None = None
        self._said_no_logger = False
        self._reduce: AllReduceWaitTimer | None = None
        self._scale: ScaleWatch | None = None
        self._timer: StepTimer | None = None
        self._monitor: GPUStatsMonitor | None = None
        self._reset_run()

    def _reset_run(self) -> None:
        self._release()
        self._batches = 0
        self._follow = False  # windows are the monitor's
        self._seen = 0  # monitor history entries already accounted for
        self._warm_seen = 0  # monitor history length when warm-up ended
        self._fit_epochs(None)
        self._last_eval_batch = 0
        self._probe_input = True
        self._input_channels_last: bool | None = None
        self._feed: tuple[int, FeedInfo] | None = None  # (id of the loader, its description)
        self._fetch_s: float | None = None  # the loader's fetch_seconds at the window's start
        #: the latest judged window's ``gpu/ceiling_frac`` (None where the monitor did not measure it)
        self.ceiling_frac: float | None = None
        self._flags: tuple[str, ...] = KINDS  # the kinds this fit can raise, logged as advisor/<kind>

    @property
    def verdicts(self) -> list[Verdict]:
        """Raised verdicts, warnings first; empty when nothing to fix was found (or not enough evidence yet)."""
        return self._filter.verdicts

    @property
    def windows(self) -> int:
        """Windows evaluated so far."""
        return self._filter.windows

    def summary(self) -> str:
        """The concise text printed at the end of fit."""
        return format_summary(self.verdicts, self.windows, self._window_len, self._warmup, self.ceiling_frac)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"filter": self._filter.state_dict(), "history": list(self.history[-100:])}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._filter.load_state_dict(state_dict.get("filter", {}))
        self.history = list(state_dict.get("history", []))

    def __getstate__(self) -> dict[str, Any]:
        # hooks and CUDA events do not pickle; a copy starts without them
        return {**self.__dict__, "_reduce": None, "_scale": None}

    def _begin(self, loop: Loop) -> None:
        """A fit begins: a new run (a checkpoint restore, ``load_state_dict``, comes after this and wins)."""
        self._filter = Hysteresis(self.min_windows, self.clear_windows)
        self.history = []
        self.config = None
        if not loop.loggers and not self._said_no_logger:
            self._said_no_logger = True
            where = "printed at the end of fit and kept" if self.verbose else "kept"
            warn_at_user(
                f"BottleneckAdvisor: the {loop.name} has no logger, so its verdicts are not logged; they are "
                f"{where} in `advisor.verdicts`. Pass a logger to the {loop.name} to see advisor/<kind> flags."
            )

    def _start(self, loop: Loop) -> None:
        """Training starts: windows, warm-up and the monitor to follow are settled for this fit."""
        self._reset_run()
        self._timer = StepTimer()
        self._monitor = next((cb for cb in loop.callbacks if isinstance(cb, GPUStatsMonitor)), None)
        self._seen = self._warm_seen = len(self._monitor_history())  # entries of an earlier fit are not ours
        self._follow = self.window_steps is None and self._monitor is not None
        self._fit_epochs(loop.batches_per_epoch)
        # the GradScaler's scale, read at window ends (fp16-overflow); from here where there is no warm-up
        self._scale = ScaleWatch.of(loop.precision_plugin, loop.device)
        if self._warm and self._scale is not None:
            self._scale.sample(loop.global_step)
        if loop.world_size > 1:
            self._reduce = AllReduceWaitTimer(loop.device)
            if not self._reduce.attach(loop.module):
                self._reduce = None
        self._settle_flags(loop)

    def _settle_flags(self, loop: Loop) -> None:
        """Log flags only for the kinds this run can raise; say once which are left out, and why."""
        absent = unmet_needs(loop.device.type == "cuda", loop.world_size, self._scale is not None)
        self._flags = tuple(k for k in KINDS if k not in absent)
        if not absent or not loop.loggers or not loop.is_global_zero:
            return
        by_need: dict[str, list[str]] = {}
        for kind, need in absent.items():
            by_need.setdefault(need, []).append(kind)
        left = "; ".join(f"{', '.join(kinds)} (need {need})" for need, kinds in by_need.items())
        logged = ", ".join(f"advisor/{k}" for k in self._flags)
        info_once(
            f"BottleneckAdvisor: logging {logged} and advisor/num_warnings; the flags of the kinds this run "
            f"cannot raise are left out rather than logged as a constant 0: {left}."
        )

    def _fit_epochs(self, per_epoch: int | None) -> None:
        """Where an epoch is short, a window of half an epoch (at least 2 batches), warm-up at most as long."""
        self._window, self._warmup = self.window_steps or _DEFAULT_WINDOW, self.warmup_steps
        if per_epoch is not None:
            self._window = min(self._window, max(_MIN_WINDOW, per_epoch // 2))
            self._warmup = min(self._warmup, per_epoch // 2)
        self._window_len = self._window  # batches in the latest window (for the summary)
        self._warm = self._warmup == 0

    def _epoch_start(self, loop: Loop) -> None:
        """The next batch's wait counts from now (the first batch's wait is the loader starting up)."""
        if self._timer is not None:
            self._timer.mark(time.perf_counter())

    def _validation_end(self, loop: Loop, fitting: bool) -> None:
        self._epoch_start(loop)  # validation inside fit is not time spent waiting for training data

    def _paused(self) -> tuple[float, float] | None:
        """The monitor's latest pause for its own work (the ceiling's replay), left out of our timing."""
        pause = getattr(self._monitor, "pause", None)
        return pause if isinstance(pause, tuple) else None

    def _batch_start(self, loop: Loop, batch: Any) -> None:
        if self._timer is None:
            return
        pause = self._paused()
        last_end = self._timer._prev_end
        if pause is not None and last_end is not None and pause[1] > last_end:
            self._timer.mark(pause[1])  # the wait for this batch counts from the pause's end
        self._timer.batch_start(time.perf_counter())
        if self._probe_input and self._batches >= self._warmup:
            # memory format of the batch is stride metadata: no GPU work
            x = image_tensor(batch)
            if x is not None:
                self._input_channels_last = distinct_memory_format(x)
            self._probe_input = False

    def _after_backward(self, loop: Loop) -> None:
        if self._reduce is not None:
            self._reduce.backward_end()

    def _batch_end(self, loop: Loop, batch: Any) -> None:
        if self._timer is None:
            return
        t, pause, started = time.perf_counter(), self._paused(), self._timer._start
        if pause is not None and started is not None and pause[0] >= started:
            t -= pause[1] - pause[0]  # the monitor paused inside this batch's end: not the step's time
        self._timer.batch_end(t, batch_size_of(batch))
        self._batches += 1
        if self._follow:
            new = self._fresh_windows()
            if new and self._warm:
                self._evaluate(loop, Evidence.mean_of(new))
            elif new and self._batches >= self._warmup:
                self._end_warmup(loop)
            return
        if not self._warm and self._batches >= self._warmup:
            self._end_warmup(loop)
            self._seen = self._warm_seen = len(self._monitor_history())
        elif self._warm and (self._batches - self._warmup) % self._window == 0:
            self._evaluate(loop, Evidence.mean_of(self._fresh_windows()))

    def _end(self, loop: Loop) -> None:
        """Training ends: the configuration of a run too short for a window, the summary, the release."""
        if self._timer is None:
            return
        if self.config is None:  # a run too short for a window still shows what it was configured to do
            self.config = self._config(loop)
        if loop.is_global_zero:
            self._log_text(loop)
            if self.verbose:
                rank_zero_info(self.summary())
        self._release()

    def _release(self) -> None:
        self._timer = None
        self._monitor = None
        if self._scale is not None:
            self._scale.release()
            self._scale = None
        if self._reduce is not None:
            self._reduce.detach()
            self._reduce = None

    def _end_warmup(self, loop: Loop) -> None:
        self._warm = True
        if self._timer is not None:
            self._timer.window()  # discard warm-up; the next window is the first one judged
        if self._reduce is not None:
            self._reduce.window()
        self._last_eval_batch = self._batches
        self._fetch_s = loop.fetch_seconds()
        if self._scale is not None:
            self._scale.sample(loop.global_step)  # the scale the judged windows start from

    def _monitor_history(self) -> list[Mapping[str, Any]]:
        history = self._monitor.history if self._monitor is not None else []
        return [h for h in history if isinstance(h, Mapping)]

    def _fresh_windows(self) -> list[Mapping[str, Any]]:
        """Monitor windows logged since the last call (all of them where its history was reset)."""
        history = self._monitor_history()
        if len(history) < self._seen:
            self._seen = self._warm_seen = 0
        fresh, self._seen = history[self._seen :], len(history)
        if not fresh and not self._follow and len(history) > self._warm_seen:
            # the monitor logs less often than the advisor evaluates: its latest post-warm-up window stands
            fresh = [history[-1]]
        return fresh

    def _host_evidence(self, loop: Loop) -> Evidence:
        """This window's host timing from the advisor's own timer, plus the share spent inside the loader."""
        if self._timer is None:
            return Evidence()
        steps = self._timer.steps
        metrics: dict[str, Any] = dict(self._timer.window())
        fetch, start = loop.fetch_seconds(), self._fetch_s
        self._fetch_s = fetch
        step_ms = metrics.get("time/step_ms")
        if fetch is not None and start is not None and step_ms and steps:
            metrics["time/loader_wait_frac"] = max(0.0, fetch - start) / (steps * step_ms / 1000.0)
        return Evidence.from_metrics(metrics)

    def _config(self, loop: Loop) -> RunConfig:
        """The configuration as it is now (the loader's description computed once per loader)."""
        loader = first_loader(loop.train_loaders)
        if self._feed is None or self._feed[0] != id(loader):
            self._feed = (id(loader), describe_feed(loader) if loader is not None else FeedInfo())
        cfg = loop_config(loop, self._monitor is not None, feed=self._feed[1])
        cfg.input_channels_last = self._input_channels_last
        return cfg

    def _evaluate(self, loop: Loop, gpu: Evidence) -> None:
        step = loop.global_step
        self._window_len, self._last_eval_batch = self._batches - self._last_eval_batch, self._batches
        # host figures from our own timer cover exactly this window; the monitor adds the GPU side (and the
        # host side only where ours is empty)
        evidence = self._host_evidence(loop).merged_with(gpu)
        if self._scale is not None:
            self._scale.sample(step)
            evidence = evidence.merged_with(self._scale.evidence())
        syncs = getattr(self._monitor, "host_syncs", None)
        if syncs:
            evidence.sync_sites = tuple(s.describe() for s in user_sites(syncs)) or None
        self.ceiling_frac = evidence.ceiling_frac
        if loop.world_size > 1:
            wait = self._reduce.window() if self._reduce is not None else None
            # the loader's own wait where it is timed: a fast rank's host can block behind its GPU (waiting in
            # the all-reduce) in the batch copy, which the whole data wait would count as waiting for data
            data_ms = evidence.data_wait_ms
            if evidence.loader_wait_frac is not None and evidence.step_ms is not None:
                data_ms = evidence.loader_wait_frac * evidence.step_ms
            evidence.ranks = gather_ranks(loop, evidence.step_ms, data_ms, wait)
        self.config = self._config(loop)
        found = diagnose(evidence, self.config, self.thresholds)
        changed = self._filter.update(found)
        self.history.append(
            {
                "window": self.windows,
                "step": step,
                "evidence": evidence.to_dict(),
                "diagnosed": [v.kind for v in found],
                "raised": [v.kind for v in self.verdicts],
            }
        )
        del self.history[:-_HISTORY]
        if loop.is_global_zero:
            self._log_flags(loop, step)
            if changed:
                self._log_text(loop)

    def _log_flags(self, loop: Loop, step: int) -> None:
        raised = {v.kind for v in self.verdicts}
        flags: dict[str, float] = {f"advisor/{k}": float(k in raised) for k in self._flags}
        flags["advisor/num_warnings"] = float(sum(v.severity == "warning" for v in self.verdicts))
        loop.log_metrics(flags, step)

    def _log_text(self, loop: Loop) -> None:
        if self.windows == 0:
            return
        text = markdown(self.verdicts, self.windows, loop.global_step)
        for logger in loop.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("advisor/summary", text, global_step=loop.global_step)
