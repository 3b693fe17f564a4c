"""What the advisor judges: ``Evidence`` (what one window measured, every rank's timing under DDP) and
``RunConfig`` (how the run is configured). Plain dataclasses; ``None`` means not measured or unknown, and a
rule that needs a missing value stays silent."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_gpuopt._checks import check_arg, is_number

__all__ = ["METRIC_FIELDS", "Evidence", "RankEvidence", "RunConfig", "finite"]

#: logged metric key (``GPUStatsMonitor`` and the advisor's own timer) -> :class:`Evidence` field
METRIC_FIELDS: dict[str, str] = {
    "time/step_ms": "step_ms",
    "time/data_wait_ms": "data_wait_ms",
    "time/data_wait_frac": "data_wait_frac",
    "time/loader_wait_frac": "loader_wait_frac",
    "time/gpu_blocked_frac": "gpu_blocked_frac",
    "throughput/samples_per_sec": "samples_per_sec",
    "gpu/idle_frac": "gpu_idle_frac",
    "gpu/util": "gpu_util",
    "gpu/util_min": "gpu_util_min",
    "gpu/sm_active": "sm_active",
    "gpu/sm_occupancy": "sm_occupancy",
    "gpu/tensor_active": "tensor_active",
    "gpu/mem_used_gb": "mem_used_gb",
    "gpu/mem_total_gb": "mem_total_gb",
    "host/cpu_main_pct": "cpu_main_pct",
    "host/cpu_workers_pct": "cpu_workers_pct",
    "host/cpu_busy_frac": "cpu_busy_frac",
    "host/cpu_cores": "cpu_cores",
    "host/read_mb_s": "read_mb_s",
    "gpu/step_idle_frac": "step_idle_frac",
    "gpu/ceiling_frac": "ceiling_frac",
    "gpu/host_syncs_per_step": "host_syncs_per_step",
    "gpu/jpeg_util": "jpeg_util",
}

# keys merged across windows by their minimum rather than their mean
_MIN_KEYS = frozenset({"gpu/util_min"})


def finite(value: Any) -> bool:
    """Whether ``value`` is a real, finite number (not a bool, not NaN)."""
    return is_number(value) and math.isfinite(value)


@dataclass(frozen=True)
class RankEvidence:
    """Every rank's timing over one window, index = global rank (gathered once a window under DDP).

    Attributes:
        step_ms: mean host time a training batch took, data wait included (ms).
        data_wait_ms: mean time the rank's loop waited for its next batch (ms): inside the loader's ``next()``
            where the loader keeps ``fetch_seconds``, else the whole gap between batches.
        allreduce_wait_ms: time from the rank's last gradient being ready to the end of its backward, median
            over the window's steps: the gradient all-reduce it waited for, on the GPU clock on CUDA, on the
            host clock on the CPU (ms). ``None`` where not measured.
    """

    step_ms: tuple[float | None, ...]
    data_wait_ms: tuple[float | None, ...]
    allreduce_wait_ms: tuple[float | None, ...]

    @property
    def world_size(self) -> int:
        return len(self.step_ms)

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[float]]) -> RankEvidence:
        """From one ``(step_ms, data_wait_ms, allreduce_wait_ms)`` row a rank (NaN: not measured)."""

        def col(i: int) -> tuple[float | None, ...]:
            return tuple(float(r[i]) if finite(r[i]) else None for r in rows)

        return cls(step_ms=col(0), data_wait_ms=col(1), allreduce_wait_ms=col(2))

    @classmethod
    def from_dict(cls, d: Mapping[str, Sequence[float | None]]) -> RankEvidence:
        return cls(
            step_ms=tuple(d.get("step_ms", ())),
            data_wait_ms=tuple(d.get("data_wait_ms", ())),
            allreduce_wait_ms=tuple(d.get("allreduce_wait_ms", ())),
        )


@dataclass
class Evidence:
    """Measurements of one window; ``None`` where not measured.

    Attributes:
        step_ms: mean host time a training batch took, data wait included (ms).
        data_wait_ms: mean host time between training batches (ms): the loader's ``next()`` plus any time the
            host was blocked behind the GPU there.
        data_wait_frac: ``data_wait_ms / step_ms`` (0-1).
        loader_wait_frac: share of the host's time spent inside the loader's ``next()`` (0-1), where the loader
            keeps ``fetch_seconds``.
        gpu_blocked_frac: share of the host's time blocked behind the GPU between batches (0-1).
        samples_per_sec: training samples per second.
        gpu_idle_frac: share of the GPU's wall time the training stream sat idle between steps (0-1), from CUDA
            events: the GPU-side measure of starvation.
        gpu_util: NVML GPU-Util, mean over the window (%): time a kernel was running.
        gpu_util_min: lowest GPU-Util sample of the window (%).
        sm_active / sm_occupancy / tensor_active: GPM SM activity, occupancy and tensor-pipe activity (%).
        mem_used_gb / mem_total_gb: NVML device memory used / total (GiB).
        cpu_main_pct: CPU use of the training process (%, 100 = one core busy).
        cpu_workers_pct: CPU time of the loader's workers (worker processes, DALI threads) together (%).
        cpu_busy_frac: share of the cores this process may use that were busy (0-1).
        cpu_cores: cores this process may use.
        read_mb_s: bytes the process and its children read from storage (page-cache misses), MB/s.
        step_idle_frac: share of the GPU's time idle inside steps (0-1): NVML's idle share less
            ``gpu_idle_frac``.
        ceiling_frac: the run's samples/s over the model's own rate on a batch kept on the device (0-1).
        host_syncs_per_step: synchronizing CUDA calls a step from the user's lines (the host-sync locator).
        jpeg_util: the hardware JPEG decoder's busy share (%, NVML).
        sync_sites: the host-sync locator's sentences for those lines (``"`model.py:42` synchronizes every
            step (`loss.item()`)"``), most frequent first; ``None`` where it did not run.
        grad_scale_start / grad_scale: the GradScaler's scale at the first read after warm-up and at the
            latest read (the advisor's own, at window ends: ``scale.ScaleWatch``).
        grad_scale_falls: times the scale fell between those reads, across the fit (each at least one step
            skipped for an fp16 overflow).
        grad_scale_window_falls: of those, the falls read in this window.
        grad_scale_steps: optimizer steps between the first and the latest read.
        ranks: every rank's timing under DDP, else ``None``.
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
        are ignored. ``"ranks"`` takes a :class:`RankEvidence` or its dict, ``"sync_sites"`` a list of
        sentences."""
        names = {f.name for f in dataclasses.fields(cls)} - {"ranks", "sync_sites"}
        kwargs: dict[str, Any] = {}
        for key, value in metrics.items():
            name = METRIC_FIELDS.get(key, key)
            if name in names and finite(value):
                kwargs[name] = float(value)
        sites = metrics.get("sync_sites")
        if isinstance(sites, (list, tuple)):
            kwargs["sync_sites"] = tuple(str(x) for x in sites)
        ranks = metrics.get("ranks")
        if isinstance(ranks, RankEvidence):
            kwargs["ranks"] = ranks
        elif isinstance(ranks, Mapping):
            kwargs["ranks"] = RankEvidence.from_dict(ranks)
        return cls(**kwargs)

    @classmethod
    def mean_of(cls, windows: Sequence[Mapping[str, Any]]) -> Evidence:
        """Average logged windows key by key (``gpu/util_min`` takes the minimum)."""
        values: dict[str, list[float]] = {}
        for w in windows:
            for key, value in w.items():
                if key in METRIC_FIELDS and finite(value):
                    values.setdefault(key, []).append(float(value))
        merged = {k: (min(v) if k in _MIN_KEYS else sum(v) / len(v)) for k, v in values.items()}
        return cls.from_metrics(merged)

    def merged_with(self, other: Evidence) -> Evidence:
        """Fields of ``self``, with ``other`` filling those that are ``None``."""
        return Evidence(
            **{
                f.name: getattr(self, f.name) if getattr(self, f.name) is not None else getattr(other, f.name)
                for f in dataclasses.fields(self)
            }
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of field names (``ranks`` as a dict of per-rank lists)."""
        return dataclasses.asdict(self)


@dataclass
class RunConfig:
    """What the run is configured to do; ``None`` where unknown (a rule that needs it then stays silent).

    Attributes:
        device_type: ``"cuda"``, ``"cpu"``...
        gpu_name: device name.
        capability: CUDA compute capability ``(major, minor)``.
        precision: Lightning precision string (``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``...).
        num_workers: loader worker processes per training process.
        cpus: CPU cores this process may use.
        processes_per_node: training processes sharing those cores (devices per node under DDP).
        world_size: training processes in the run.
        pin_memory: whether the loader pins its host batches.
        host_batches: whether batches start in host memory and are copied to the device each step.
        batch_size: samples per batch per process.
        backend: ``"folder"`` (JPEGs decoded on the CPU by worker processes), ``"hdf5"`` (decoded uint8),
            ``"dali"``, or ``None``.
        decoder: where JPEGs are decoded: ``"cpu"``, ``"gpu"`` (nvJPEG), or ``None``.
        decode_threads: the loader's threads (DALI's decoding pool, the HDF5 store's reading threads).
        cpu_decode_rate: images a second the DALI loader's CPU threads decoded its files at, measured when it
            chose its decoder, or ``None``.
        gpu_decode_rate: the same for nvJPEG on its GPU, or ``None``.
        conv_layers: 4-D convolution weights whose memory format is decidable (1x1 kernels are ambiguous).
        conv_channels_last: how many of those are channels_last.
        input_channels_last: whether the 4-D input batch is channels_last.
        cudnn_benchmark / cudnn_deterministic / cudnn_allow_tf32: ``torch.backends.cudnn`` flags.
        float32_matmul_precision: ``torch.get_float32_matmul_precision()``.
        mem_peak_gb: peak memory the caching allocator reserved (GiB).
        mem_total_gb: device memory (GiB).
        gpu_monitor: whether a ``GPUStatsMonitor`` is in the run.
        grad_scaler: whether the precision plugin steps the optimizers through an enabled ``GradScaler``.
        unfused_optimizers: class names of the optimizers ``GradScaler.step`` cannot hand the scale and inf flag
            to, so it reads ``found_inf`` on the host: a GPU sync every step. Empty: every optimizer scales on
            the device.
        gradient_clip_val: ``Trainer(gradient_clip_val=...)``; ``None`` when clipping is off.
        cuda_graphs_skipped: torch's reason for not replaying the CUDA graphs a ``CompileModel`` compiled the
            step to record (``CompileModel.cuda_graphs_skipped``); ``None`` where they replay, or none were
            asked for.
    """

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
        check_arg(
            not unknown,
            "every key of d",
            unknown,
            "a RunConfig field",
            fix=f"valid fields: {sorted(names)}",
            error=TypeError,
        )
        kwargs = dict(d)
        if kwargs.get("capability") is not None:
            kwargs["capability"] = tuple(int(x) for x in kwargs["capability"])
        if kwargs.get("unfused_optimizers") is not None:  # a JSON round trip turns the tuple into a list
            kwargs["unfused_optimizers"] = tuple(str(x) for x in kwargs["unfused_optimizers"])
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict."""
        return dataclasses.asdict(self)
