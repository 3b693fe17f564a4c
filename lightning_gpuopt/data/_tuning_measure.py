"""How ``tune_num_workers`` measures: each worker count in turn (``_measure_counts``), one count at a time
(``_measure``: warm-up, then samples/s until the rate is steady, one pass over the data ends or the count's
time is up)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_gpuopt import _compat
from lightning_gpuopt._checks import is_int
from lightning_gpuopt.data._lifetime import worker_folder
from lightning_gpuopt.data.loader import HostDataLoader


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_len(batch[0])
    if isinstance(batch, dict) and batch:
        return _batch_len(next(iter(batch.values())))
    try:
        return len(batch)
    except TypeError:
        return 1


def _steady(times: Sequence[float], samples: Sequence[int], group: int, tolerance: float) -> bool:
    """Whether the rate of the measured batches' second half is within ``tolerance`` of the first half's;
    the halves split at a multiple of ``group`` (batches arrive in rounds of one per worker)."""
    k = len(times) - 1
    half = (k // group // 2) * group
    first, second = times[half] - times[0], times[k] - times[half]
    if half <= 0 or first <= 0 or second <= 0:
        return False
    r1, r2 = samples[half] / first, (samples[k] - samples[half]) / second
    return abs(r1 - r2) <= tolerance * max(r1, r2)


def _measure(
    loader: Iterable[Any],
    warmup_batches: int,
    deadline: Callable[[float], float],
    max_batches: int | None,
    steady: float,
) -> tuple[float, float, int, str]:
    """Iterate ``loader``: skip ``warmup_batches`` (workers starting, first round of batches), then count
    samples until the rate is steady (``_steady`` within ``steady``), the loader has given ``max_batches``
    batches (one pass over the data) or ends, or ``deadline(rate so far)`` (a ``time.perf_counter()``
    instant) passes, whichever comes first. Returns ``(samples_per_sec, startup_s, measured_batches,
    until)``, ``until`` one of ``"steady"``, ``"one pass"``, ``"slot"``, ``"no batch"`` (the loader yielded
    nothing)."""
    t0 = time.perf_counter()
    remove_folder: Callable[[], Any] = lambda: None  # noqa: E731 - what a plain DataLoader's workers left
    if isinstance(loader, DataLoader) and loader.num_workers and not isinstance(loader, HostDataLoader):
        it, remove_folder = worker_folder(loader, lambda: iter(loader))
    else:
        it = iter(loader)  # a HostDataLoader keeps its workers' folder itself
    startup = None
    delivered = 0  # every sample, warm-up included
    times: list[float] = []  # arrival time of each measured batch; the first is the origin
    samples: list[int] = []  # samples delivered since the origin, at each of them
    group = max(2, warmup_batches)
    until = "one pass"
    end = t0
    try:
        for i, batch in enumerate(it):
            now = time.perf_counter()
            if startup is None:
                startup = now - t0
            size = _batch_len(batch)
            delivered += size
            last = max_batches is not None and i + 1 >= max_batches
            if times and now > times[0]:
                until_s = deadline(samples[-1] / (now - times[0]))
            else:
                until_s = deadline(delivered / (now - t0) if now > t0 else 0.0)
            # warm-up may eat at most ~60% of the slot, so something is left to measure
            if i < warmup_batches and not last and now - t0 < 0.6 * (until_s - t0):
                continue
            times.append(now)
            samples.append(samples[-1] + size if samples else 0)
            k = len(times) - 1
            if k >= 2 * group and k % group == 0 and _steady(times, samples, group, steady):
                until = "steady"
                break
            if now >= until_s:
                until = "slot"
                break
            if last:
                break
        end = time.perf_counter()
    finally:
        # shuts worker processes down now rather than at garbage collection (counted in the slot)
        _compat.shutdown_workers(it)
        del it
        remove_folder()
    if startup is None:
        return 0.0, 0.0, 0, "no batch"
    measured = len(times) - 1
    if measured > 0 and end > times[0]:
        return samples[-1] / (end - times[0]), startup, measured, until
    # too slow (or too little data) to measure after warm-up: the pessimistic overall rate
    total = end - t0
    return delivered / total if total > 0 else 0.0, startup, 0, until


def _pass_batches(dataset: Any, batch_size: Any, drop_last: bool = False) -> int | None:
    """Batches in one pass over ``dataset`` (None: not known, e.g. an iterable dataset)."""
    if not is_int(batch_size) or batch_size < 1:
        return None
    try:
        n = len(dataset)
    except TypeError:
        return None
    return n // batch_size if drop_last else math.ceil(n / batch_size)


@dataclass
class _Plan:
    """How ``_measure_counts`` spends its time and when it stops (``tune_num_workers``'s arguments)."""

    budget_s: float
    epoch_share: float | None
    min_budget_s: float
    samples_per_pass: int | None
    tolerance: float
    patience: int
    goal: float | None
    progress: Callable[[str], None] | None = None
    steady: float = 0.1

    def allowed_s(self, best_sps: float) -> float:
        """The whole measurement's budget: ``budget_s``, cut to the epoch share once a rate is known."""
        if self.epoch_share is None or not self.samples_per_pass or best_sps <= 0:
            return self.budget_s
        share = self.epoch_share * self.samples_per_pass / best_sps
        return min(self.budget_s, max(self.min_budget_s, share))


def _measure_counts(
    make_loader: Callable[[int], Iterable[Any]], cands: Sequence[int], plan: _Plan, pass_batches: int | None
) -> tuple[list[dict[str, Any]], str]:
    """Measure ``cands`` in order, each in its share of what is left of the budget, until the budget is
    spent, a count reaches ``plan.goal`` or ``plan.patience`` counts in a row fail to beat the best by more
    than ``plan.tolerance``. Returns the table (a row a count) and why measuring stopped."""
    t_start = time.perf_counter()
    table: list[dict[str, Any]] = []
    best_sps, since_improved = 0.0, 0
    for i, n in enumerate(cands):
        allowed = plan.allowed_s(best_sps)
        if allowed - (time.perf_counter() - t_start) <= 0.05 * allowed and table:
            return table, "budget"
        if plan.progress is not None:
            plan.progress(f"measuring num_workers={n} ({i + 1} of {len(cands)}) ...")
        t_c, left = time.perf_counter(), len(cands) - i

        def deadline(rate: float, t_c: float = t_c, left: int = left, best: float = best_sps) -> float:
            """This count's end: its share of what is left of the budget, cut once its own rate shortens
            the epoch estimate; the slot covers shutdown too, so a little of it is left for joining."""
            return t_c + 0.85 * max(0.0, plan.allowed_s(max(best, rate)) - (t_c - t_start)) / left

        sps, startup, batches, until = _measure(
            make_loader(n), max(1, n), deadline, max_batches=pass_batches, steady=plan.steady
        )
        if until == "no batch":
            raise ValueError(
                f"the loader built with num_workers={n} yielded no batch, so nothing could be measured; "
                "give a dataset of at least one batch"
            )
        row = {"num_workers": n, "samples_per_sec": sps, "startup_s": startup, "batches": batches}
        table.append({**row, "until": until, "seconds": time.perf_counter() - t_c})
        if plan.goal is not None and sps >= plan.goal:
            return table, "target reached"
        since_improved = 0 if sps > best_sps * (1 + plan.tolerance) else since_improved + 1
        best_sps = max(best_sps, sps)
        if since_improved >= plan.patience:
            return table, "no improvement"
    return table, "all candidates"
