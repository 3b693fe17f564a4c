"""What the advisor judges: ``Evidence`` (what one window measured, every rank's timing under DDP) and
``RunConfig`` (how the run is configured). ``None`` means not measured or unknown: a rule that needs it stays
silent."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_gpuopt._checks import check_arg, is_number

__all__ = ["Evidence", "RankEvidence", "RunConfig", "field_of", "finite"]


def finite(value: Any) -> bool:
    """Whether ``value`` is a real, finite number (not a bool, not NaN)."""
    return is_number(value) and math.isfinite(value)


@dataclass(frozen=True)
class RankEvidence:
    """Every rank's ``step_ms``, ``data_wait_ms`` (inside the loader where timed) and ``allreduce_wait_ms``
    (median) over one window, index = global rank (gathered once a window under DDP)."""

    step_ms: tuple[float | None, ...]
    data_wait_ms: tuple[float | None, ...]
    allreduce_wait_ms: tuple[float | None, ...]

    @property
    def world_size(self) -> int:
        return len(self.step_ms)

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[float]]) -> RankEvidence:
        """From one ``(step_ms, data_wait_ms, allreduce_wait_ms)`` row a rank (NaN: not measured)."""
        cols = [tuple(float(r[i]) if finite(r[i]) else None for r in rows) for i in range(3)]
        return cls(*cols)

    @classmethod
    def from_dict(cls, d: Mapping[str, Sequence[float | None]]) -> RankEvidence:
        return cls(*(tuple(d.get(f.name, ())) for f in dataclasses.fields(cls)))


@dataclass
class Evidence:
    """Measurements of one window; ``None`` where not measured (docs/advisor.md lists the fields).

    A field named after a logged key holds that key's mean over the window (``field_of``).
    """

    step_ms: float | None = None
    data_wait_ms: float | None = None
    data_wait_frac: float | None = None
    loader_wait_frac: float | None = None
    gpu_blocked_frac: float | None = None
    samples_per_sec: float | None = None
    gpu_idle_frac: float | None = None
    gpu_util: float | None = None
    gpu_util_min: float | None = None
    sm_active: float | None = None
    sm_occupancy: float | None = None
    tensor_active: float | None = None
    mem_used_gb: float | None = None
    mem_total_gb: float | None = None
    cpu_main_pct: float | None = None
    cpu_workers_pct: float | None = None
    cpu_busy_frac: float | None = None
    cpu_cores: float | None = None
    read_mb_s: float | None = None
    step_idle_frac: float | None = None
    ceiling_frac: float | None = None
    host_syncs_per_step: float | None = None
    jpeg_util: float | None = None
    sync_sites: tuple[str, ...] | None = None
    grad_scale_start: float | None = None
    grad_scale: float | None = None
    grad_scale_falls: float | None = None
    grad_scale_window_falls: float | None = None
    grad_scale_steps: float | None = None
    ranks: RankEvidence | None = None

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, Any]) -> Evidence:
        """Build from logged keys (``"gpu/idle_frac"``...) or field names (``"gpu_idle_frac"``...); other keys
        are ignored. ``"ranks"`` takes a :class:`RankEvidence` or its dict, ``"sync_sites"`` a list."""
        kwargs: dict[str, Any] = {}
        for key, value in metrics.items():
            name = field_of(key)
            if name is not None and finite(value):
                kwargs[name] = float(value)
        sites = metrics.get("sync_sites")
        if isinstance(sites, (list, tuple)):
            kwargs["sync_sites"] = tuple(str(x) for x in sites)
        ranks = metrics.get("ranks")
        if isinstance(ranks, (RankEvidence, Mapping)):
            kwargs["ranks"] = ranks if isinstance(ranks, RankEvidence) else RankEvidence.from_dict(ranks)
        return cls(**kwargs)

    @classmethod
    def mean_of(cls, windows: Sequence[Mapping[str, Any]]) -> Evidence:
        """Average logged windows key by key (``gpu/util_min`` takes the minimum)."""
        values: dict[str, list[float]] = {}
        for w in windows:
            for key, value in w.items():
                if "/" in key and field_of(key) is not None and finite(value):
                    values.setdefault(key, []).append(float(value))
        merged = {k: (min(v) if k == "gpu/util_min" else sum(v) / len(v)) for k, v in values.items()}
        return cls.from_metrics(merged)

    def merged_with(self, other: Evidence) -> Evidence:
        """Fields of ``self``, with ``other`` filling those that are ``None``."""
        mine = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return Evidence(**{k: getattr(other, k) if v is None else v for k, v in mine.items()})

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of field names (``ranks`` as a dict of per-rank lists)."""
        return dataclasses.asdict(self)


_NUMBERS = frozenset(f.name for f in dataclasses.fields(Evidence)) - {"ranks", "sync_sites"}


def field_of(key: str) -> str | None:
    """The numeric :class:`Evidence` field of a logged key or field name; ``None`` for any other key.

    Example:
        >>> field_of("gpu/idle_frac"), field_of("host/cpu_cores"), field_of("gpu/power_w")
        ('gpu_idle_frac', 'cpu_cores', None)
    """
    group, _, name = key.rpartition("/")
    if group not in ("", "time", "throughput", "gpu", "host"):
        return None
    if name not in _NUMBERS and group == "gpu":
        name = f"gpu_{name}"
    return name if name in _NUMBERS else None


@dataclass
class RunConfig:
    """What the run is configured to do; ``None`` where unknown (docs/advisor.md lists the fields)."""

    device_type: str = "cpu"
    gpu_name: str | None = None
    capability: tuple[int, int] | None = None
    precision: str | None = None
    num_workers: int | None = None
    cpus: int | None = None
    processes_per_node: int = 1
    world_size: int = 1
    pin_memory: bool | None = None
    host_batches: bool | None = None
    batch_size: int | None = None
    backend: str | None = None
    decoder: str | None = None
    decode_threads: int | None = None
    cpu_decode_rate: float | None = None
    gpu_decode_rate: float | None = None
    conv_layers: int = 0
    conv_channels_last: int = 0
    input_channels_last: bool | None = None
    cudnn_benchmark: bool | None = None
    cudnn_deterministic: bool | None = None
    cudnn_allow_tf32: bool | None = None
    float32_matmul_precision: str | None = None
    mem_peak_gb: float | None = None
    mem_total_gb: float | None = None
    gpu_monitor: bool = False
    grad_scaler: bool | None = None
    unfused_optimizers: tuple[str, ...] | None = None
    gradient_clip_val: float | None = None
    cuda_graphs_skipped: str | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunConfig:
        """Build from a dict of field names; unknown keys raise ``TypeError`` naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        fix = f"valid fields: {sorted(names)}"
        check_arg(not unknown, "every key of d", unknown, "a RunConfig field", fix=fix, error=TypeError)
        kwargs = dict(d)
        if kwargs.get("capability") is not None:
            kwargs["capability"] = tuple(int(x) for x in kwargs["capability"])
        if kwargs.get("unfused_optimizers") is not None:  # a JSON round trip turns the tuple into a list
            kwargs["unfused_optimizers"] = tuple(str(x) for x in kwargs["unfused_optimizers"])
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict."""
        return dataclasses.asdict(self)
