"""Pick ``num_workers`` by measuring a DataLoader within a time budget, and remember the answer
(docs/worker_tuning.md): ``tune_num_workers``, and ``WorkerTuner`` for loaders of your own."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader, Dataset, RandomSampler
from typing_extensions import override

from lightning_gpuopt import _compat
from lightning_gpuopt._checks import check_arg, check_bool, check_float, is_int
from lightning_gpuopt._common import CACHE_ENV as CACHE_ENV  # importable here, beside the cache it names
from lightning_gpuopt._common import available_cpus, format_table, warn_once
from lightning_gpuopt._common import cache_dir as _cache_folder
from lightning_gpuopt.data._lifetime import worker_folder
from lightning_gpuopt.data._tuning_cache import _cached_problem, _read_cache, _write_cache
from lightning_gpuopt.data.loader import (
    PREFETCH_FACTOR,
    BatchReader,
    HostDataLoader,
    WholeBatches,
    reads_in_workers,
)

#: batches are measured at most this large: smaller batches arrive often enough for the rate to settle soon.
MEASURE_BATCH_SIZE = 64
CACHE_FILE = "workers.json"
# bump when what is measured changes, so old cache entries are not reused
_CACHE_VERSION = 4

#: measured alone, a loader must deliver this multiple of the model's rate to keep up in training.
TARGET_HEADROOM = 2.0
#: the largest share of an epoch (at the best rate so far) the measurement may take.
EPOCH_SHARE = 0.25
#: seconds of measuring the epoch share never cuts below.
MIN_BUDGET_S = 2.0
#: a count's measurement ends once its second half's rate is within this share of its first half's.
STEADY_TOLERANCE = 0.1
#: counts in a row without improvement that end the measurement.
PATIENCE = 2


@dataclass(frozen=True)
class TuningConfig:
    """How ``OptimizedDataModule(num_workers="auto")`` measures its loaders (``tune_num_workers``).

    Args:
        budget_s: seconds the measurement may take (worker start-up and shutdown included).
        target_samples_per_sec: what your model consumes (samples/s); measuring stops once the loader
            delivers ``TARGET_HEADROOM`` times that. ``None``: find the loader's own plateau.
        cache_dir: folder of the result cache (default ``$LIGHTNING_GPUOPT_CACHE_DIR`` or
            ``~/.cache/lightning_gpuopt``).

    Example:
        >>> TuningConfig(budget_s=10.0, target_samples_per_sec=3000.0)
        TuningConfig(budget_s=10.0, target_samples_per_sec=3000.0, cache_dir=None)
    """

    budget_s: float = 30.0
    target_samples_per_sec: float | None = None
    cache_dir: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        _check_tuning("tuning.", self.budget_s, self.target_samples_per_sec, self.cache_dir)


def default_candidates(max_workers: int) -> list[int]:
    """Ascending worker counts to try: 1, 2, 4, 6, 8, 12, 16, 24, 32, ... up to and including ``max_workers``."""
    max_workers = max(1, int(max_workers))
    out = {1, max_workers}
    v = 2
    while v < max_workers:
        out.add(v)
        if v >= 4 and v + v // 2 < max_workers:
            out.add(v + v // 2)
        v *= 2
    return sorted(out)


def default_cache_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """``<cache_dir>/workers.json`` (default folder: ``_common.cache_dir()``)."""
    return _cache_folder(cache_dir) / CACHE_FILE


def dataset_fingerprint(dataset: Any) -> dict[str, Any]:
    """What identifies a dataset for the cache: its own ``fingerprint()``, else class, length, path and mtime."""
    fp = getattr(dataset, "fingerprint", None)
    if callable(fp):
        with contextlib.suppress(Exception):  # a user fingerprint that fails falls back to the generic one
            return dict(fp())
    out: dict[str, Any] = {"class": f"{type(dataset).__module__}.{type(dataset).__qualname__}"}
    with contextlib.suppress(TypeError):
        out["len"] = len(dataset)
    for attr in ("root", "path", "filename", "file"):
        value = getattr(dataset, attr, None)
        if isinstance(value, (str, os.PathLike)):
            out[attr] = os.path.abspath(os.fspath(value))
            with contextlib.suppress(OSError):
                out["mtime"] = os.path.getmtime(value)
            break
    return out


@dataclass
class TuningResult:
    """What ``tune_num_workers`` found (its fields: docs/worker_tuning.md).

    Attributes:
        best: the chosen ``num_workers``.
        table: one row per measured count; empty where nothing was measured.
        seconds: total wall time of the tuning.
        cached: True when the answer came from the cache.
        stop_reason: why measuring stopped, or why nothing was measured.
        key: the cache key.
    """

    best: int
    table: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    cached: bool = False
    stop_reason: str = ""
    key: str | None = None

    def format_table(self) -> str:
        """The table as fixed-width text with the choice marked (one line where nothing was measured)."""
        if not self.table:
            return f"num_workers={self.best} ({self.stop_reason})"
        rows = [{**r, "chosen": "<-" if r["num_workers"] == self.best else ""} for r in self.table]
        columns = ["num_workers", "samples_per_sec", "startup_s", "batches", "until", "chosen"]
        head = format_table([{"until": "", **r} for r in rows], columns)
        src = "cached" if self.cached else f"measured in {self.seconds:.1f} s, stopped: {self.stop_reason}"
        return f"{head}\nnum_workers={self.best} ({src})"

    def how(self) -> str:
        """How ``best`` was chosen, as the setup line says it."""
        if not self.table:
            return self.stop_reason
        counts = ", ".join(str(r["num_workers"]) for r in self.table)
        if self.cached:
            return f"measured earlier over {counts} (cached)"
        return f"measured over {counts} in {self.seconds:.1f} s"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def endless_sampler(dataset: Any, batch_size: int) -> RandomSampler:
    """Random order, repeated: a small dataset does not run out while it is measured."""
    return RandomSampler(dataset, replacement=False, num_samples=max(len(dataset), batch_size * 100_000))


def tune_num_workers(
    loader: Callable[[int], Iterable[Any]] | Dataset,
    candidates: Sequence[int] | None = None,
    budget_s: float = 30.0,
    target_samples_per_sec: float | None = None,
    tolerance: float = 0.05,
    *,
    batch_size: int = 64,
    max_workers: int | None = None,
    cache: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_key: dict[str, Any] | None = None,
    headroom: float = TARGET_HEADROOM,
    progress: Callable[[str], None] | None = None,
) -> TuningResult:
    """Measure loader throughput for candidate ``num_workers`` and return the smallest good one.

    How it measures and when it stops: docs/worker_tuning.md.

    Args:
        loader: ``make_loader(num_workers) -> iterable of batches`` (one pass over its ``dataset`` ends a
            count's measurement), or a map-style dataset.
        candidates: worker counts to try (default ``default_candidates(max_workers)``).
        budget_s: wall-clock budget for all measurements (worker start-up and shutdown included).
        target_samples_per_sec: what the model consumes; ``headroom`` times that ends the search.
        tolerance: relative slack when comparing throughputs (0.05 = 5%).
        batch_size: batch size when ``loader`` is a dataset.
        max_workers: the largest default candidate (default: CPUs available to this process).
        cache: read and write the result cache.
        cache_dir: folder of the cache file.
        cache_key: extra key values beside the data's fingerprint, batch size and CPUs.
        headroom: how much faster than ``target_samples_per_sec`` the loader must be measured alone.
        progress: called with a line as each count starts.

    Returns:
        ``TuningResult``.

    Raises:
        ValueError: a bad argument, or a loader that yields no batch.
    """
    _check_tuning("", budget_s, target_samples_per_sec, cache_dir, tolerance)
    check_float(headroom, "headroom", low=1, what="(a multiple of the target)")
    goal = target_samples_per_sec * headroom if target_samples_per_sec is not None else None
    cpus = available_cpus()
    if candidates is None:
        candidates = default_candidates(max_workers if max_workers is not None else cpus)
    cands = sorted({int(c) for c in candidates})
    check_arg(bool(cands) and cands[0] >= 0, "candidates", list(candidates), "non-negative worker counts")
    if isinstance(loader, Dataset) or not callable(loader):
        loader = loader_factory(loader, batch_size)
    probe: Any = loader(cands[0])  # a DataLoader is cheap to build; it is not iterated
    data = getattr(probe, "dataset", None)
    size = getattr(probe, "batch_size", None)
    key_info = {"dataset": dataset_fingerprint(data if data is not None else probe), "batch_size": size}
    key_info.update(cpus=cpus, candidates=cands, target=goal, tolerance=tolerance, version=_CACHE_VERSION)
    key_info.update(cache_key or {})
    key = hashlib.sha1(json.dumps(key_info, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = default_cache_path(cache_dir)
    cached = _from_cache(path, key, cands) if cache else None
    if cached is not None:
        return cached
    t_start = time.perf_counter()
    pass_batches = _pass_batches(data, size, bool(getattr(probe, "drop_last", False)))
    table, stop_reason = _measure_counts(
        loader, cands, budget_s, _pass_batches(data, 1), pass_batches, tolerance, goal, progress
    )
    best = _smallest_good(table, goal, tolerance)
    result = TuningResult(best, table, time.perf_counter() - t_start, False, stop_reason, key)
    if cache:
        entry = {"best": best, "table": table, "stop_reason": stop_reason, "key_info": key_info}
        _write_cache(path, key, {**entry, "date": time.time()})
    return result


def _smallest_good(table: list[dict[str, Any]], goal: float | None, tolerance: float) -> int:
    top = max(r["samples_per_sec"] for r in table)
    threshold = goal if goal is not None and top >= goal else top * (1 - tolerance)
    return int(min(r["num_workers"] for r in table if r["samples_per_sec"] >= threshold))


def _from_cache(path: Path, key: str, cands: list[int]) -> TuningResult | None:
    hit = _read_cache(path).get(key)
    if hit is None:
        return None
    problem = _cached_problem(hit, cands)
    if problem is not None:
        warn_once(f"ignoring the entry {key} of the worker-tuning cache {path} ({problem}); measuring again")
        return None
    reason = str(hit.get("stop_reason", ""))
    return TuningResult(int(hit["best"]), hit["table"], 0.0, True, reason, key)


def _check_tuning(prefix: str, budget_s: Any, target: Any, cache_dir: Any, tolerance: Any = 0.05) -> None:
    check_float(budget_s, prefix + "budget_s", low=0, low_open=True, what="(seconds)")
    what, fix = "(your model's samples/s)", "None measures up to the loader's plateau"
    name = prefix + "target_samples_per_sec"
    check_float(target, name, low=0, low_open=True, none_ok=True, what=what, fix=fix)
    ok = cache_dir is None or isinstance(cache_dir, (str, os.PathLike))
    check_arg(ok, prefix + "cache_dir", cache_dir, "None or a folder path", error=TypeError)
    check_float(tolerance, "tolerance", low=0, high=1, high_open=True, what="(0.05 = 5%)")


def loader_factory(
    dataset: Any,
    batch_size: int,
    *,
    threads: bool = False,
    pin_memory: bool = False,
    collate_fn: Callable[[Any], Any] | None = None,
    **worker_kwargs: Any,
) -> Callable[[int], DataLoader]:
    """``n -> loader`` reading ``dataset`` in endless random order on ``n`` worker processes, or with
    ``threads`` on ``n`` reading threads of this process (docs/worker_tuning.md).

    Args:
        dataset: the map-style dataset (a ``BatchReader`` with ``threads``).
        batch_size: samples a batch.
        threads: measure reading threads (``HostDataLoader(read_threads=n)``; 0: read in the loop).
        pin_memory: pin the batches, as training does.
        collate_fn: the loaders' collate function (None: torch's default).
        **worker_kwargs: more ``DataLoader`` arguments of a loader with workers (e.g. ``worker_init_fn``).
    """
    data = WholeBatches(dataset) if reads_in_workers(dataset) and not threads else dataset

    def make(n: int) -> DataLoader:
        kwargs: dict[str, Any] = {"pin_memory": pin_memory, "collate_fn": collate_fn}
        if threads:
            kwargs["read_threads"] = n
        elif n:
            kwargs.update(num_workers=n, prefetch_factor=PREFETCH_FACTOR, **worker_kwargs)
        loader = HostDataLoader if threads else DataLoader
        return loader(data, batch_size=batch_size, sampler=endless_sampler(dataset, batch_size), **kwargs)

    return make


def unmeasured_workers(
    dataset: Any, *, batch_size: int, min_batches: int, local_world_size: int = 1
) -> tuple[int, str] | None:
    """The worker processes ``num_workers="auto"`` gives ``dataset`` without measuring, and how they were
    chosen; None: they are measured. A folder or JPEG store gets one a CPU, a raw store none, a split of
    fewer than ``min_batches`` batches one a batch.

    Example:
        >>> unmeasured_workers(list(range(30)), batch_size=32, min_batches=8)
        (0, '1 batch, under 8: one worker a batch, not measured')
    """
    cpus = max(1, available_cpus() // max(1, local_world_size))
    batches = _pass_batches(dataset, batch_size)
    if isinstance(dataset, BatchReader):
        if not reads_in_workers(dataset):
            return 0, "a raw store has none: threads of the training process read it"
        readers = min(int(getattr(dataset, "auto_readers", cpus)), cpus)
        if batches is None or batches >= readers:
            return readers, f"one a CPU: chosen from {cpus} cores a process, not measured"
        why = " a pass: a worker a batch at most"
    elif batches is None or batches >= min_batches:
        return None
    else:
        why = f", under {min_batches}: one worker a batch"
    plural = "es" if batches != 1 else ""  # a worker a batch at most, none for one batch
    return (min(cpus, batches) if batches > 1 else 0), f"{batches} batch{plural}{why}, not measured"


def _measure_workers(
    dataset: Any,
    batch_size: int,
    *,
    trainer: pl.Trainer | None = None,
    loader_kwargs: dict[str, Any] | None = None,
    cache_key: dict[str, Any] | None = None,
    **kwargs: Any,
) -> TuningResult:
    """``tune_num_workers`` of ``dataset`` read as training reads it, batches of at most ``MEASURE_BATCH_SIZE``,
    ``max_workers`` the CPUs a local process; under a ``trainer`` each node takes its local rank zero's count."""
    local = max(1, trainer.num_devices) if trainer is not None else 1
    kwargs.setdefault("max_workers", max(1, available_cpus() // local))
    make = loader_factory(dataset, min(batch_size, MEASURE_BATCH_SIZE), **(loader_kwargs or {}))
    key = {"local_world_size": local, "train_batch_size": batch_size, **(cache_key or {})}
    result = tune_num_workers(loader=make, cache_key=key, **kwargs)
    result.best = _node_best(trainer, result.best)
    return result


def _node_best(trainer: pl.Trainer | None, best: int) -> int:
    """The count local rank zero of this rank's node chose (one ``all_gather``; every rank must call it)."""
    if trainer is None or trainer.world_size <= 1:
        return best
    row = torch.tensor([trainer.node_rank, trainer.local_rank, best], device=trainer.strategy.root_device)
    rows = trainer.strategy.all_gather(row).reshape(-1, 3).tolist()
    return next((int(b) for node, local, b in rows if node == trainer.node_rank and local == 0), best)


class WorkerTuner(pl.Callback):
    """At ``on_train_start``, tune ``num_workers`` of your own training ``DataLoader`` (docs/worker_tuning.md).

    Args:
        budget_s: tuning budget in seconds (per loader).
        candidates: worker counts to try (default 1, 2, 4, 6, 8, 12, ... up to the CPUs per local rank).
        target_samples_per_sec: what your model consumes (samples/s).
        tolerance: the smallest count within this fraction of the best wins.
        apply: set the tuned count on the loader (False: only measure and log).
        cache: use the result cache; ``cache_dir`` overrides its folder.

    Example:
        >>> trainer = pl.Trainer(callbacks=[WorkerTuner(budget_s=20.0)])  # doctest: +SKIP
        >>> trainer.fit(model, train_dataloaders=DataLoader(ds, batch_size=256, num_workers=2))  # doctest: +SKIP
    """

    def __init__(
        self,
        budget_s: float = 30.0,
        candidates: Sequence[int] | None = None,
        target_samples_per_sec: float | None = None,
        tolerance: float = 0.05,
        apply: bool = True,
        cache: bool = True,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        _check_tuning("", budget_s, target_samples_per_sec, cache_dir, tolerance)
        must = "None or a non-empty sequence of worker counts (ints >= 0)"
        ok = candidates is None or isinstance(candidates, Sequence)
        check_arg(ok, "candidates", candidates, must, error=TypeError)
        counts = [] if candidates is None or isinstance(candidates, str) else candidates
        ok = candidates is None or (bool(counts) and all(is_int(c) and c >= 0 for c in counts))
        check_arg(ok, "candidates", candidates, must)
        check_bool(apply, "apply")
        check_bool(cache, "cache")
        self.budget_s = budget_s
        self.candidates = list(candidates) if candidates is not None else None
        self.target_samples_per_sec = target_samples_per_sec
        self.tolerance = tolerance
        self.apply = apply
        self.cache = cache
        self.cache_dir = cache_dir
        self.results: list[TuningResult] = []
        self.num_workers: int | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        flat: list[DataLoader] = []
        apply_to_collection(trainer.train_dataloader, DataLoader, flat.append)
        if not flat:
            warn_once("WorkerTuner: the training loader is not a torch DataLoader; nothing to tune")
            return
        self.results = []
        # the measured loaders read and collate as this one does
        kept = ("pin_memory", "collate_fn", "worker_init_fn", "multiprocessing_context")
        for loader in flat:
            result = _measure_workers(
                loader.dataset,
                loader.batch_size or 1,
                trainer=trainer,
                loader_kwargs={k: getattr(loader, k) for k in kept},
                candidates=self.candidates,
                budget_s=self.budget_s,
                target_samples_per_sec=self.target_samples_per_sec,
                tolerance=self.tolerance,
                cache=self.cache,
                cache_dir=self.cache_dir,
                progress=lambda line: rank_zero_info(f"WorkerTuner: {line}"),
            )
            self.num_workers = best = result.best
            self.results.append(result)
            rank_zero_info(f"WorkerTuner: {type(loader.dataset).__name__}\n{result.format_table()}")
            if self.apply and best != loader.num_workers:
                loader.num_workers = best
                loader.prefetch_factor = (loader.prefetch_factor or PREFETCH_FACTOR) if best else None
        last = self.results[-1]
        metrics = {"tuning/num_workers": float(last.best)}
        for row in last.table:
            if row["num_workers"] == last.best:
                metrics["tuning/samples_per_sec"] = float(row["samples_per_sec"])
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


# ----------------------------------------------------------------- measuring
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
    """Whether the second half's rate is within ``tolerance`` of the first's (split at a multiple of ``group``)."""
    k = len(times) - 1
    half = (k // group // 2) * group
    first, second = times[half] - times[0], times[k] - times[half]
    if half <= 0 or first <= 0 or second <= 0:
        return False
    r1, r2 = samples[half] / first, (samples[k] - samples[half]) / second
    return abs(r1 - r2) <= tolerance * max(r1, r2)


def _measure(
    loader: Iterable[Any], warmup_batches: int, deadline: Callable[[float], float], max_batches: int | None
) -> tuple[float, float, int, str]:
    """``(samples_per_sec, startup_s, measured_batches, until)`` of ``loader`` after ``warmup_batches``,
    until steady, ``max_batches`` (one pass) or ``deadline(rate so far)``; ``until`` says which."""
    t0 = time.perf_counter()
    remove_folder: Callable[[], Any] = lambda: None  # noqa: E731 - what a plain DataLoader's workers left
    if isinstance(loader, DataLoader) and loader.num_workers and not isinstance(loader, HostDataLoader):
        it, remove_folder = worker_folder(loader, lambda: iter(loader))
    else:
        it = iter(loader)  # a HostDataLoader keeps its workers' folder itself
    startup, delivered, group, until = None, 0, max(2, warmup_batches), "one pass"
    # each measured batch's arrival time (the first is the origin) and the samples since the origin then
    times: list[float] = []
    samples: list[int] = []
    try:
        for i, batch in enumerate(it):
            now = time.perf_counter()
            startup = now - t0 if startup is None else startup
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
            if k >= 2 * group and k % group == 0 and _steady(times, samples, group, STEADY_TOLERANCE):
                until = "steady"
            elif now >= until_s:
                until = "slot"
            if until != "one pass" or last:
                break
        end = time.perf_counter()
    finally:
        # shuts worker processes down now rather than at garbage collection (counted in the slot)
        _compat.shutdown_workers(it)
        del it
        remove_folder()
    if startup is None:
        return 0.0, 0.0, 0, "no batch"
    if len(times) > 1 and end > times[0]:
        return samples[-1] / (end - times[0]), startup, len(times) - 1, until
    # too slow (or too little data) to measure after warm-up: the pessimistic overall rate
    return delivered / (end - t0) if end > t0 else 0.0, startup, 0, until


def _pass_batches(dataset: Any, batch_size: Any, drop_last: bool = False) -> int | None:
    """Batches in one pass over ``dataset`` (None: not known)."""
    if not is_int(batch_size) or batch_size < 1:
        return None
    try:
        n = len(dataset)
    except TypeError:
        return None
    return n // batch_size if drop_last else math.ceil(n / batch_size)


def _measure_counts(
    make_loader: Callable[[int], Iterable[Any]],
    cands: Sequence[int],
    budget_s: float,
    samples_per_pass: int | None,
    pass_batches: int | None,
    tolerance: float,
    goal: float | None,
    progress: Callable[[str], None] | None,
) -> tuple[list[dict[str, Any]], str]:
    """Measure ``cands`` in order, each in its share of the budget left; the table and why it stopped."""

    def allowed_s(best_sps: float) -> float:  # budget_s, cut to the epoch share once a rate is known
        if not samples_per_pass or best_sps <= 0:
            return budget_s
        return min(budget_s, max(MIN_BUDGET_S, EPOCH_SHARE * samples_per_pass / best_sps))

    t_start = time.perf_counter()
    table: list[dict[str, Any]] = []
    best_sps, since_improved = 0.0, 0
    for i, n in enumerate(cands):
        if table and time.perf_counter() - t_start >= 0.95 * allowed_s(best_sps):
            return table, "budget"
        if progress is not None:
            progress(f"measuring num_workers={n} ({i + 1} of {len(cands)}) ...")
        t_c, left = time.perf_counter(), len(cands) - i

        def deadline(rate: float, t_c: float = t_c, left: int = left, best: float = best_sps) -> float:
            # its share of the budget left (cut once its own rate shortens the epoch), less time to join
            return t_c + 0.85 * max(0.0, allowed_s(max(best, rate)) - (t_c - t_start)) / left

        sps, startup, batches, until = _measure(make_loader(n), max(1, n), deadline, pass_batches)
        if until == "no batch":
            raise ValueError(
                f"the loader built with num_workers={n} yielded no batch, so nothing could be measured; "
                "give a dataset of at least one batch"
            )
        row = {"num_workers": n, "samples_per_sec": sps, "startup_s": startup, "batches": batches}
        table.append({**row, "until": until, "seconds": time.perf_counter() - t_c})
        if goal is not None and sps >= goal:
            return table, "target reached"
        since_improved = 0 if sps > best_sps * (1 + tolerance) else since_improved + 1
        best_sps = max(best_sps, sps)
        if since_improved >= PATIENCE:
            return table, "no improvement"
    return table, "all candidates"
