"""Say what starves the GPU and what to change.

``diagnose(evidence, config)`` is the pure expert system: measured figures of one window (data-wait fraction,
step time, GPU-Util, SM activity, memory) plus the run's configuration (workers, CPUs, pin_memory, precision,
GradScaler and optimizers, memory format of the convolutions, cudnn.benchmark) in, a list of :class:`Verdict` out. ``BottleneckAdvisor``
adapts it to Lightning: it gathers the configuration through public API, reads the measurements the
``GPUStatsMonitor`` already takes (or times the host side itself), and raises a verdict only when it held for
``min_windows`` consecutive windows after warm-up, clearing it only after ``clear_windows`` windows without it.

The verdict kinds, their thresholds and advice are tabulated in ``docs/advisor.md``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from lightning_gpuopt.compute.optimizer import FUSED_OPTIMIZERS, is_fused
from lightning_gpuopt.observe.timing import StepTimer, batch_size_of

__all__ = [
    "KINDS",
    "AdvisorThresholds",
    "BottleneckAdvisor",
    "Evidence",
    "Hysteresis",
    "RunConfig",
    "Verdict",
    "diagnose",
    "format_summary",
]

#: Every verdict kind the advisor can raise, in report order. Stable names: they are logged as
#: ``advisor/<kind>`` flags and may be matched on by users.
KINDS: tuple[str, ...] = (
    "input-bound",
    "pageable-copies",
    "launch-bound",
    "amp-host-sync",
    "fp32-on-tensor-cores",
    "nchw-convolutions",
    "cudnn-benchmark-off",
    "memory-headroom",
    "gpu-metrics-missing",
)

#: Causes of an ``input-bound`` verdict (``Verdict.cause``).
INPUT_CAUSES: tuple[str, ...] = ("too-many-workers", "too-few-workers", "decode-bound", "slow-loader")

EvidenceValue = float | int | str


@dataclass(frozen=True)
class Verdict:
    """One finding.

    Attributes:
        kind: stable short name, one of :data:`KINDS`.
        evidence: the measured figures and configuration values the finding rests on.
        advice: the concrete change, in this package's terms.
        severity: ``"warning"`` (costs throughput now) or ``"info"`` (an opportunity or a blind spot).
        cause: refinement of the kind (``input-bound``: one of :data:`INPUT_CAUSES`), else ``None``.
    """

    kind: str
    evidence: dict[str, EvidenceValue]
    advice: str
    severity: str = "warning"
    cause: str | None = None

    @property
    def label(self) -> str:
        """``kind`` or ``kind (cause)``."""
        return f"{self.kind} ({self.cause})" if self.cause else self.kind

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Verdict:
        """Inverse of :meth:`to_dict`."""
        return cls(
            kind=str(d["kind"]),
            evidence=dict(d.get("evidence", {})),
            advice=str(d.get("advice", "")),
            severity=str(d.get("severity", "warning")),
            cause=d.get("cause"),
        )


# logged metric key -> Evidence field
_METRIC_FIELDS: dict[str, str] = {
    "time/step_ms": "step_ms",
    "time/data_wait_ms": "data_wait_ms",
    "time/data_wait_frac": "data_wait_frac",
    "throughput/samples_per_sec": "samples_per_sec",
    "gpu/util": "gpu_util",
    "gpu/util_min": "gpu_util_min",
    "gpu/sm_active": "sm_active",
    "gpu/sm_occupancy": "sm_occupancy",
    "gpu/tensor_active": "tensor_active",
    "gpu/mem_used_gb": "mem_used_gb",
    "gpu/mem_total_gb": "mem_total_gb",
}


@dataclass
class Evidence:
    """Measurements of one window; ``None`` where not measured.

    Attributes:
        step_ms: mean host time a training batch took, data wait included (ms).
        data_wait_ms: mean time the loop waited for the next batch (ms).
        data_wait_frac: ``data_wait_ms / step_ms`` (0-1).
        samples_per_sec: training samples per second.
        gpu_util: NVML GPU-Util, mean over the window (%): time a kernel was running.
        gpu_util_min: lowest GPU-Util sample of the window (%).
        sm_active / sm_occupancy / tensor_active: GPM SM activity, occupancy and tensor-pipe activity (%).
        mem_used_gb / mem_total_gb: NVML device memory used / total (GiB, as the monitor logs them).
    """

    step_ms: float | None = None
    data_wait_ms: float | None = None
    data_wait_frac: float | None = None
    samples_per_sec: float | None = None
    gpu_util: float | None = None
    gpu_util_min: float | None = None
    sm_active: float | None = None
    sm_occupancy: float | None = None
    tensor_active: float | None = None
    mem_used_gb: float | None = None
    mem_total_gb: float | None = None

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, Any]) -> Evidence:
        """Build from logged keys (``"gpu/util"``...) or field names (``"gpu_util"``...); others are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, float] = {}
        for key, value in metrics.items():
            name = _METRIC_FIELDS.get(key, key)
            if name in names and _finite(value):
                kwargs[name] = float(value)
        return cls(**kwargs)

    @classmethod
    def mean_of(cls, windows: Sequence[Mapping[str, Any]]) -> Evidence:
        """Average logged windows key by key (``gpu/util_min`` takes the minimum)."""
        sums: dict[str, list[float]] = {}
        for w in windows:
            for key, value in w.items():
                if key in _METRIC_FIELDS and _finite(value):
                    sums.setdefault(key, []).append(float(value))
        merged = {k: (min(v) if k == "gpu/util_min" else sum(v) / len(v)) for k, v in sums.items()}
        return cls.from_metrics(merged)

    def merged_with(self, other: Evidence) -> Evidence:
        """Fields of ``self``, with ``other`` filling those that are ``None``."""
        return Evidence(
            **{
                f.name: getattr(self, f.name) if getattr(self, f.name) is not None else getattr(other, f.name)
                for f in dataclasses.fields(self)
            }
        )

    def to_dict(self) -> dict[str, float | None]:
        """Plain dict of field names."""
        return dataclasses.asdict(self)


@dataclass
class RunConfig:
    """What the run is configured to do; ``None`` where unknown (a rule that needs it then stays silent).

    Attributes:
        device_type: ``"cuda"``, ``"cpu"``...
        gpu_name: device name.
        capability: CUDA compute capability ``(major, minor)``.
        precision: Lightning precision string (``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``...).
        num_workers: DataLoader workers per process.
        cpus: CPU cores this process may use (``os.sched_getaffinity``).
        processes_per_node: training processes sharing those cores (devices per node under DDP).
        pin_memory: whether the DataLoader pins its batches.
        host_batches: whether batches start in host memory and are copied to the device each step.
        batch_size: samples per batch per process.
        backend: ``"folder"`` (JPEG/PNG decoded by PIL), ``"hdf5"`` (decoded uint8), ``"dali"`` or ``None``.
        dali_decoder: with ``backend="dali"``: ``"gpu"`` (nvJPEG) or ``"cpu"`` (DALI's CPU threads).
        dali_threads: with ``backend="dali"``: DALI's CPU threads per process.
        conv_layers: 4-D convolution weights whose memory format is decidable (1x1 kernels are ambiguous).
        conv_channels_last: how many of those are channels_last.
        input_channels_last: whether the 4-D input batch is channels_last.
        cudnn_benchmark / cudnn_deterministic / cudnn_allow_tf32: ``torch.backends.cudnn`` flags.
        float32_matmul_precision: ``torch.get_float32_matmul_precision()``.
        mem_peak_gb: peak memory the caching allocator reserved (GiB).
        mem_total_gb: device memory (GiB).
        gpu_monitor: whether a ``GPUStatsMonitor`` is in the run.
        grad_scaler: whether the precision plugin steps the optimizers through an enabled ``GradScaler``.
        unfused_optimizers: class names of the optimizers that cannot take the GradScaler's ``grad_scale`` /
            ``found_inf`` in their step (no ``_step_supports_amp_scaling``): ``GradScaler.step`` then reads
            ``found_inf`` on the host, a GPU sync every step. Empty: every optimizer scales on the device.
        gradient_clip_val: ``Trainer(gradient_clip_val=...)``; ``None`` when clipping is off.
    """

    device_type: str = "cpu"
    gpu_name: str | None = None
    capability: tuple[int, int] | None = None
    precision: str | None = None
    num_workers: int | None = None
    cpus: int | None = None
    processes_per_node: int = 1
    pin_memory: bool | None = None
    host_batches: bool | None = None
    batch_size: int | None = None
    backend: str | None = None
    dali_decoder: str | None = None
    dali_threads: int | None = None
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

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RunConfig:
        """Build from a dict of field names; unknown keys raise ``TypeError`` naming them."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise TypeError(f"unknown RunConfig field(s) {unknown}; valid fields: {sorted(names)}")
        kwargs = dict(d)
        if kwargs.get("capability") is not None:
            kwargs["capability"] = tuple(int(x) for x in kwargs["capability"])
        if kwargs.get("unfused_optimizers") is not None:  # a JSON round trip turns the tuple into a list
            kwargs["unfused_optimizers"] = tuple(str(x) for x in kwargs["unfused_optimizers"])
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class AdvisorThresholds:
    """The numbers the rules compare against (documented in ``docs/advisor.md``).

    Attributes:
        input_wait_frac: data-wait fraction of the step from which the run is input-bound.
        input_wait_min_ms: and the wait must be at least this long (ms), so loop overhead of tiny steps is not
            mistaken for a slow loader.
        gpu_busy_util: GPU-Util (%) at or above which the GPU counts as busy: a host wait then overlaps GPU
            work and is not a bottleneck.
        few_workers_frac: fewer workers than this fraction of the process's cores is "too few".
        launch_util: GPU-Util (%) below which a run that does not wait for data is launch/host-bound.
        launch_sm_active: SM activity (%) below which kernels are too small to fill the GPU.
        small_batch: batch size up to which GPU-Util under ``gpu_busy_util`` counts as launch-bound.
        headroom_mem_frac: peak memory fraction below which the batch could grow.
        tensor_core_capability: compute capability from which fp16 tensor cores exist.
        channels_last_frac: fraction of convolutions that must be channels_last.
        host_sync_wait_frac: data-wait fraction from which a per-step host sync (``amp-host-sync``) counts as
            costly: there is host work before each step that the sync keeps from overlapping GPU work.
        host_sync_busy_util: GPU-Util (%) below which a per-step host sync counts as costly. Higher than
            ``gpu_busy_util``: on the H200 an unfused optimizer on GPU-resident batches read 92.4% GPU-Util
            while training 9% slower than the fused run's 98.8% (``benchmarks/results/advisor_h200.json``).
    """

    input_wait_frac: float = 0.10
    input_wait_min_ms: float = 2.0
    gpu_busy_util: float = 90.0
    few_workers_frac: float = 0.5
    launch_util: float = 70.0
    launch_sm_active: float = 25.0
    small_batch: int = 16
    headroom_mem_frac: float = 0.30
    tensor_core_capability: tuple[int, int] = (7, 0)
    channels_last_frac: float = 0.5
    host_sync_wait_frac: float = 0.02
    host_sync_busy_util: float = 97.0


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _r(x: float, nd: int = 3) -> float:
    return round(float(x), nd)


def _precision_family(precision: str | None) -> str | None:
    """``"fp32"``, ``"fp64"``, ``"half"`` (fp16/bf16, mixed or true) or ``None``."""
    if precision is None:
        return None
    p = str(precision).lower()
    if p.startswith(("32", "fp32")):
        return "fp32"
    if p.startswith(("64", "fp64")):
        return "fp64"
    if p.startswith(("16", "bf16", "fp16", "half", "transformer-engine")):
        return "half"
    return None


def _half_advice(capability: tuple[int, int] | None) -> str:
    bf16 = capability is not None and capability >= (8, 0)
    alt = ' (or "bf16-mixed", no loss scaling needed on this GPU)' if bf16 else ""
    return f'Trainer(precision="16-mixed"){alt}; `Trainer(**fast_trainer_kwargs())` sets it with the rest'


#: torch optimizers with a fused CUDA step that takes the GradScaler's ``grad_scale``/``found_inf`` itself.

_AMP_SYNC_MEASURED = (
    "Measured on an H200 (benchmarks/results/pipeline_diag_h200.json, ResNet-50 16-mixed + channels_last "
    "through Lightning fed from HDF5): unfused SGD 0.762 of the ceiling, fused 0.973; a plain PyTorch loop "
    "on a GPU-resident batch 5,736 img/s unfused against 6,150 fused."
)


def _amp_sync_advice(
    names: Sequence[str], precision: str | None, clip: float | None, cap: tuple[int, int] | None
) -> str:
    listed = ", ".join(names)
    head = (
        f"The optimizer{'s' if len(names) > 1 else ''} {listed} cannot skip an inf/NaN step on the device, so "
        f"under {precision or 'fp16 mixed precision'} GradScaler.step reads found_inf with .item(): the host "
        "waits for the GPU every step, and fetching the next batch, Lightning's hooks and the next launches "
        "leave the GPU idle."
    )
    if clip is not None:
        if cap is not None and cap >= (8, 0):
            bf16 = (
                f'Use Trainer(precision="bf16-mixed") instead: compute capability {cap[0]}.{cap[1]} has '
                "bf16 tensor cores, bf16 needs no GradScaler (no sync) and clipping keeps working"
            )
        elif cap is not None:
            bf16 = (
                f"bf16 is not fast on compute capability {cap[0]}.{cap[1]} (bf16-mixed needs >= 8.0), so "
                "choose between clipping and the sync"
            )
        else:
            bf16 = (
                'On compute capability >= 8.0 use Trainer(precision="bf16-mixed") instead: no GradScaler, '
                "no sync, and clipping keeps working"
            )
        return (
            f"{head} The fused optimizers that avoid it are not an option as configured: with "
            f"gradient_clip_val={clip:g}, Lightning refuses gradient clipping under 16-mixed for optimizers "
            f"that unscale inside their step (it raises RuntimeError). {bf16}; or drop gradient_clip_val and "
            f"construct the optimizer with fused=True; or accept the sync. {_AMP_SYNC_MEASURED}"
        )
    fusable = [n for n in names if n in FUSED_OPTIMIZERS]
    others = [n for n in names if n not in FUSED_OPTIMIZERS]
    example = fusable[0] if fusable else "SGD"
    momentum = ", momentum=0.9" if example == "SGD" else ""
    line = f"`torch.optim.{example}(self.parameters(), lr=lr{momentum}, fused=True)`"
    how = (
        "in configure_optimizers: the GradScaler then hands it grad_scale and found_inf and the inf/NaN step "
        "is skipped on the device (ImageClassifier does this by default on CUDA)."
    )
    if fusable:
        advice = (
            f"{head} Construct the optimizer with fused=True ({', '.join(FUSED_OPTIMIZERS)} have it on CUDA), "
            f"e.g. {line} {how} Where you do not construct it yourself, add FusedOptimizer() to the Trainer's "
            "callbacks (fast_trainer_kwargs adds it under 16-mixed): it switches them in place."
        )
        if others:
            advice += f" {', '.join(others)} has no fused step: switch it to one of those too."
    else:
        advice = (
            f"{head} {listed} has no fused step: switch to one that has ({', '.join(FUSED_OPTIMIZERS)}) with "
            f'fused=True, e.g. {line} {how} Or train in precision="bf16-mixed" on compute capability >= 8.0 '
            "(no GradScaler)."
        )
    return f"{advice} {_AMP_SYNC_MEASURED}"


def diagnose(
    evidence: Evidence | Mapping[str, Any],
    config: RunConfig | Mapping[str, Any],
    thresholds: AdvisorThresholds | None = None,
) -> list[Verdict]:
    """Classify one window of a run.

    Args:
        evidence: :class:`Evidence`, or a dict of logged keys (``"time/data_wait_frac"``, ``"gpu/util"``...).
        config: :class:`RunConfig` or a dict of its fields.
        thresholds: the rules' numbers; defaults to :class:`AdvisorThresholds`.

    Returns:
        Verdicts, warnings first, then in :data:`KINDS` order. An empty list means nothing to fix was found.
    """
    ev = evidence if isinstance(evidence, Evidence) else Evidence.from_metrics(evidence)
    cfg = config if isinstance(config, RunConfig) else RunConfig.from_dict(config)
    t = thresholds or AdvisorThresholds()
    out: list[Verdict] = []

    cuda = cfg.device_type == "cuda"
    gpu_known = ev.gpu_util is not None
    gpu_busy = gpu_known and ev.gpu_util >= t.gpu_busy_util  # type: ignore[operator]
    procs = max(1, cfg.processes_per_node)
    cpp = max(1, cfg.cpus // procs) if cfg.cpus else None
    family = _precision_family(cfg.precision)
    cap = cfg.capability

    def gpu_figures() -> dict[str, EvidenceValue]:
        figs: dict[str, EvidenceValue] = {}
        for name in ("gpu_util", "sm_active", "tensor_active"):
            v = getattr(ev, name)
            if v is not None:
                figs[name] = _r(v, 1)
        return figs

    # ---- input-bound --------------------------------------------------------------------------------------
    wf = ev.data_wait_frac
    input_bound = (
        wf is not None
        and wf >= t.input_wait_frac
        and (ev.data_wait_ms is None or ev.data_wait_ms >= t.input_wait_min_ms)
        and not gpu_busy
    )
    if input_bound and wf is not None:
        w = cfg.num_workers
        figs: dict[str, EvidenceValue] = {"data_wait_frac": _r(wf)}
        for name in ("data_wait_ms", "step_ms", "samples_per_sec"):
            if getattr(ev, name) is not None:
                figs[name] = _r(getattr(ev, name), 2)
        figs.update(gpu_figures())
        if w is not None:
            figs["num_workers"] = w
        if cfg.cpus is not None:
            figs["cpus"] = cfg.cpus
            figs["processes_per_node"] = procs
        if cfg.backend is not None:
            figs["backend"] = cfg.backend
        if cfg.batch_size is not None:
            figs["batch_size"] = cfg.batch_size
        head = f"The loop waits for data {wf:.0%} of each step"
        head += f" while the GPU is busy {ev.gpu_util:.0f}% of the time. " if gpu_known else ". "
        suggest = max(1, (cpp or 2) - 1)
        if w is not None and cpp is not None and w > cpp:
            cause = "too-many-workers"
            advice = (
                f"{head}{w} workers x {procs} process(es) oversubscribe {cfg.cpus} cores, so workers and the "
                f'training loop compete. Use OptimizedDataModule(num_workers="auto") (it measures) or at most '
                f"num_workers={suggest}."
            )
        elif w is not None and cpp is not None and (w == 0 or w < cpp * t.few_workers_frac):
            cause = "too-few-workers"
            advice = (
                f"{head}num_workers={w} uses few of the {cpp} cores this process has. Use "
                f'OptimizedDataModule(num_workers="auto") (it measures the loader and picks the count) or '
                f"DataLoader(num_workers={suggest}, persistent_workers=True)."
            )
            if cfg.backend == "folder":
                advice += (
                    ' JPEG decoding is what the workers spend their time on: backend="hdf5" (after '
                    '`lightning-gpuopt convert`) or backend="dali" removes most of it.'
                )
        elif cfg.backend == "dali":
            cause = "dali-bound"
            for name in ("dali_decoder", "dali_threads"):
                if getattr(cfg, name) is not None:
                    figs[name] = getattr(cfg, name)
            threads = f"{cfg.dali_threads} " if cfg.dali_threads else ""
            if cfg.dali_decoder == "cpu":
                advice = (
                    f"{head}DALI's {threads}CPU threads decode JPEGs more slowly than the GPU trains "
                    '(decoder="cpu"). Decode with nvJPEG (dali_kwargs={"decoder": "gpu"}), run on a '
                    'host with more cores per GPU, or store decoded uint8 once (backend="hdf5").'
                )
            else:
                advice = (
                    f"{head}The DALI pipeline (nvJPEG) does not keep up: give it more CPU threads "
                    "(num_workers), a deeper dali_kwargs prefetch_queue_depth, or the hardware decoder "
                    '(hw_decoder_load=1.0); with many cores per GPU try dali_kwargs={"decoder": "cpu"}, or store '
                    'decoded uint8 once (backend="hdf5").'
                )
        elif cfg.backend == "folder":
            cause = "decode-bound"
            advice = (
                f"{head}{w if w is not None else 'The'} workers on {cpp if cpp else 'the'} cores cannot decode "
                "JPEGs as fast as the GPU trains. Store decoded uint8 images once with `lightning-gpuopt "
                'convert` and read them with OptimizedDataModule(backend="hdf5"), or decode on the GPU with '
                'backend="dali".'
            )
        else:
            cause = "slow-loader"
            advice = (
                f"{head}The loader does not keep up. Profile the dataset's __getitem__; move augmentation to "
                'the GPU (GPUAugment); try OptimizedDataModule(num_workers="auto") and a decoded store '
                '(backend="hdf5") or GPU decoding (backend="dali").'
            )
        if cuda and cfg.pin_memory is False and cfg.host_batches is not False:
            advice += " Part of this wait can be the pageable host-to-GPU copy waiting for the GPU (see pageable-copies)."
        out.append(Verdict("input-bound", figs, advice, "warning", cause))

    # ---- pageable-copies ----------------------------------------------------------------------------------
    host = cfg.host_batches if cfg.host_batches is not None else (cfg.num_workers or 0) > 0 or None
    if cuda and cfg.pin_memory is False and host and cfg.backend != "dali":
        figs = {"pin_memory": "False"}
        if wf is not None:
            figs["data_wait_frac"] = _r(wf)
        if cfg.num_workers is not None:
            figs["num_workers"] = cfg.num_workers
        if cfg.batch_size is not None:
            figs["batch_size"] = cfg.batch_size
        out.append(
            Verdict(
                "pageable-copies",
                figs,
                "Batches are copied to the GPU from pageable host memory: the copy is synchronous and waits "
                "for the GPU's queued work, so loading and compute stop overlapping. Set "
                "DataLoader(pin_memory=True); OptimizedDataModule(pin_memory=None) turns it on for CUDA runs.",
                "warning",
            )
        )

    # ---- launch-bound -------------------------------------------------------------------------------------
    if cuda and gpu_known and not input_bound:
        util = float(ev.gpu_util)  # type: ignore[arg-type]
        small_kernels = ev.sm_active is not None and ev.sm_active < t.launch_sm_active
        small_batch = (
            cfg.batch_size is not None and cfg.batch_size <= t.small_batch and util < t.gpu_busy_util
        )
        if util < t.launch_util or small_kernels or small_batch:
            figs = gpu_figures()
            if ev.gpu_util_min is not None:
                figs["gpu_util_min"] = _r(ev.gpu_util_min, 1)
            for name in ("step_ms", "data_wait_frac", "samples_per_sec"):
                if getattr(ev, name) is not None:
                    figs[name] = _r(getattr(ev, name), 3)
            if cfg.batch_size is not None:
                figs["batch_size"] = cfg.batch_size
            why = (
                f"GPU-Util {util:.0f}%"
                + (f", SM activity {ev.sm_active:.0f}%" if ev.sm_active is not None else "")
                + (f" at {ev.step_ms:.1f} ms a step" if ev.step_ms is not None else "")
                + " without waiting for data: the GPU runs short kernels and idles while Python launches the "
                "next ones (or while the host synchronizes)."
            )
            grow = f"Grow the batch (batch_size={cfg.batch_size})" if cfg.batch_size else "Grow the batch"
            out.append(
                Verdict(
                    "launch-bound",
                    figs,
                    f"{why} {grow} so each kernel does more work; remove per-step host syncs (.item(), .cpu(), "
                    "printing tensors, self.log(..., sync_dist=True) every step); torch.compile(model) fuses "
                    'kernels and mode="reduce-overhead" replays them as CUDA graphs.',
                    "warning",
                )
            )

    # ---- amp-host-sync ------------------------------------------------------------------------------------
    unfused = cfg.unfused_optimizers
    if cuda and cfg.grad_scaler and unfused:
        clip = cfg.gradient_clip_val if cfg.gradient_clip_val and cfg.gradient_clip_val > 0 else None
        figs = {"precision": str(cfg.precision), "optimizers": ",".join(unfused)}
        if clip is not None:
            figs["gradient_clip_val"] = float(clip)
        for name in ("step_ms", "data_wait_frac"):
            if getattr(ev, name) is not None:
                figs[name] = _r(getattr(ev, name), 3)
        for name in ("gpu_util", "sm_active"):
            if getattr(ev, name) is not None:
                figs[name] = _r(getattr(ev, name), 1)
        # the sync costs what the host does between steps: GPU idle, or host work (the batch fetch) to expose
        costly = (gpu_known and float(ev.gpu_util) < t.host_sync_busy_util) or (  # type: ignore[arg-type]
            wf is not None and wf >= t.host_sync_wait_frac
        )
        out.append(
            Verdict(
                "amp-host-sync",
                figs,
                _amp_sync_advice(unfused, cfg.precision, clip, cap),
                "warning" if costly else "info",
            )
        )

    compute_severity = "info" if input_bound else "warning"

    # ---- fp32-on-tensor-cores -----------------------------------------------------------------------------
    if cuda and family in ("fp32", "fp64") and cap is not None and cap >= t.tensor_core_capability:
        figs = {"precision": str(cfg.precision), "capability": f"{cap[0]}.{cap[1]}"}
        if cfg.gpu_name:
            figs["gpu"] = cfg.gpu_name
        if cfg.float32_matmul_precision is not None:
            figs["float32_matmul_precision"] = cfg.float32_matmul_precision
        if ev.tensor_active is not None:
            figs["tensor_active"] = _r(ev.tensor_active, 1)
        advice = (
            f"Full-precision math leaves this GPU's tensor cores idle or slow. Train in {_half_advice(cap)}"
            " or pick it with choose_precision()."
        )
        if cap >= (8, 0) and cfg.float32_matmul_precision == "highest":
            advice += ' To stay in fp32, at least allow TF32: torch.set_float32_matmul_precision("high").'
        out.append(Verdict("fp32-on-tensor-cores", figs, advice, compute_severity))

    # ---- nchw-convolutions --------------------------------------------------------------------------------
    tensor_core_math = family == "half" or (
        family == "fp32" and cap is not None and cap >= (8, 0) and cfg.cudnn_allow_tf32 is not False
    )
    if cuda and cfg.conv_layers > 0 and tensor_core_math and (cap is None or cap >= t.tensor_core_capability):
        frac = cfg.conv_channels_last / cfg.conv_layers
        if frac < t.channels_last_frac:
            figs = {
                "conv_layers": cfg.conv_layers,
                "conv_channels_last_frac": _r(frac),
                "precision": str(cfg.precision),
            }
            if cfg.input_channels_last is not None:
                figs["input_channels_last"] = str(cfg.input_channels_last)
            out.append(
                Verdict(
                    "nchw-convolutions",
                    figs,
                    f"{cfg.conv_layers - cfg.conv_channels_last} of {cfg.conv_layers} convolutions keep NCHW "
                    "weights, so cuDNN transposes around its tensor-core (NHWC) kernels. Add ChannelsLast() to "
                    "the Trainer's callbacks (or call apply_channels_last(model)); OptimizedDataModule and "
                    "GPUAugment already deliver channels_last batches.",
                    compute_severity,
                )
            )

    # ---- cudnn-benchmark-off ------------------------------------------------------------------------------
    if cuda and cfg.conv_layers > 0 and cfg.cudnn_benchmark is False and not cfg.cudnn_deterministic:
        out.append(
            Verdict(
                "cudnn-benchmark-off",
                {"cudnn_benchmark": "False", "conv_layers": cfg.conv_layers},
                "cuDNN uses heuristics instead of timing its convolution algorithms. With fixed input shapes "
                "set Trainer(benchmark=True) (part of fast_trainer_kwargs()).",
                "info",
            )
        )

    # ---- memory-headroom ----------------------------------------------------------------------------------
    used, total = cfg.mem_peak_gb, cfg.mem_total_gb
    if used is None or total is None:
        used, total = ev.mem_used_gb, ev.mem_total_gb
    saturated = gpu_busy and (ev.sm_active is None or ev.sm_active >= t.launch_sm_active)
    if cuda and gpu_known and not input_bound and not saturated and used is not None and total:
        mem_frac = used / total
        if mem_frac < t.headroom_mem_frac:
            factor = 2 ** max(1, math.floor(math.log2(0.8 / max(mem_frac, 1e-3))))
            figs = {"mem_used_gb": _r(used, 2), "mem_total_gb": _r(total, 2), "mem_frac": _r(mem_frac)}
            figs.update(gpu_figures())
            if cfg.batch_size is not None:
                figs["batch_size"] = cfg.batch_size
            bs = (
                f"batch_size={cfg.batch_size} could grow about {factor}x"
                if cfg.batch_size
                else "the batch could grow"
            )
            out.append(
                Verdict(
                    "memory-headroom",
                    figs,
                    f"Peak memory is {mem_frac:.0%} of {total:.0f} GiB while the GPU is not saturated: {bs} "
                    "(scale the learning rate with it); Lightning's Tuner(trainer).scale_batch_size finds the "
                    "largest batch that fits.",
                    "info",
                )
            )

    # ---- gpu-metrics-missing ------------------------------------------------------------------------------
    if cuda and not gpu_known:
        advice = (
            "No GPU-Util measured, so launch-bound and memory verdicts cannot be made: add GPUStatsMonitor() "
            "to the Trainer's callbacks (needs nvidia-ml-py)."
            if not cfg.gpu_monitor
            else "GPUStatsMonitor is in the run but logged no GPU-Util for this window (NVML unavailable for "
            "this device, or a fixed window_steps shorter than the monitor's window)."
        )
        out.append(Verdict("gpu-metrics-missing", {"gpu_monitor": str(cfg.gpu_monitor)}, advice, "info"))

    order = {k: i for i, k in enumerate(KINDS)}
    out.sort(key=lambda v: (v.severity != "warning", order.get(v.kind, len(order))))
    return out


class Hysteresis:
    """Keeps a verdict list that does not flap.

    A kind is raised after it was diagnosed in ``raise_after`` consecutive windows and cleared after it was
    absent from ``clear_after`` consecutive windows. A raised verdict's evidence and advice follow the
    latest window that diagnosed it.
    """

    def __init__(self, raise_after: int = 2, clear_after: int = 2) -> None:
        if raise_after < 1 or clear_after < 1:
            raise ValueError("raise_after and clear_after must be >= 1")
        self.raise_after = raise_after
        self.clear_after = clear_after
        self.on: dict[str, int] = {}
        self.off: dict[str, int] = {}
        self.active: dict[str, Verdict] = {}
        self.windows = 0

    def update(self, verdicts: Iterable[Verdict]) -> bool:
        """Feed one window's verdicts; returns whether the set of raised kinds changed."""
        self.windows += 1
        seen = {v.kind: v for v in verdicts}
        before = set(self.active)
        for kind in set(self.on) | set(self.off) | set(seen) | set(self.active):
            if kind in seen:
                self.on[kind] = self.on.get(kind, 0) + 1
                self.off[kind] = 0
                if kind in self.active or self.on[kind] >= self.raise_after:
                    self.active[kind] = seen[kind]
            else:
                self.off[kind] = self.off.get(kind, 0) + 1
                self.on[kind] = 0
                if kind in self.active and self.off[kind] >= self.clear_after:
                    del self.active[kind]
        return set(self.active) != before

    @property
    def verdicts(self) -> list[Verdict]:
        """Raised verdicts, warnings first, then in :data:`KINDS` order."""
        order = {k: i for i, k in enumerate(KINDS)}
        return sorted(self.active.values(), key=lambda v: (v.severity != "warning", order.get(v.kind, 99)))

    def state_dict(self) -> dict[str, Any]:
        return {
            "on": dict(self.on),
            "off": dict(self.off),
            "active": [v.to_dict() for v in self.active.values()],
            "windows": self.windows,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.on = {str(k): int(v) for k, v in state.get("on", {}).items()}
        self.off = {str(k): int(v) for k, v in state.get("off", {}).items()}
        self.active = {d["kind"]: Verdict.from_dict(d) for d in state.get("active", [])}
        self.windows = int(state.get("windows", 0))


def format_summary(verdicts: Sequence[Verdict], windows: int, window_steps: int, warmup_steps: int) -> str:
    """Concise multi-line text: one line a verdict with its evidence, then the advice."""
    if windows == 0:
        return (
            f"BottleneckAdvisor: no verdict - the run ended before the first window after {warmup_steps} "
            "warm-up steps was over."
        )
    head = f"BottleneckAdvisor after {windows} window(s) of {window_steps} steps:"
    if not verdicts:
        return f"{head} no bottleneck found."
    lines = [head]
    for v in verdicts:
        figs = ", ".join(f"{k}={val}" for k, val in v.evidence.items())
        lines.append(f"  [{v.severity}] {v.label}: {figs}")
        lines.append(f"      -> {v.advice}")
    return "\n".join(lines)


def _markdown(verdicts: Sequence[Verdict], windows: int, step: int) -> str:
    if not verdicts:
        return f"**No bottleneck found** (window {windows}, step {step})."
    rows = ["| severity | verdict | evidence | advice |", "|---|---|---|---|"]
    for v in verdicts:
        figs = "<br>".join(f"{k}={val}" for k, val in v.evidence.items())
        rows.append(f"| {v.severity} | {v.label} | {figs} | {v.advice.replace('|', '/')} |")
    return f"Window {windows}, step {step}:\n\n" + "\n".join(rows)


# --------------------------------------------------------------------------------------------------------------
# Gathering the configuration of a Lightning run (public API only)
# --------------------------------------------------------------------------------------------------------------


def _cpu_count() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS/Windows have no affinity call
        return os.cpu_count()


def _unwrap_dataset(ds: Any) -> Any:
    # torch Subset / wrappers keep the real dataset in .dataset
    for _ in range(5):
        inner = getattr(ds, "dataset", None)
        if inner is None or inner is ds:
            break
        ds = inner
    return ds


def _dataset_backend(ds: Any) -> str | None:
    ds = _unwrap_dataset(ds)
    name = type(ds).__name__.lower()
    if "hdf5" in name or "h5" in name:
        return "hdf5"
    if "folder" in name:
        return "folder"
    samples = getattr(ds, "samples", None) or getattr(ds, "imgs", None)
    if isinstance(samples, Sequence) and samples:
        first = samples[0]
        path = first[0] if isinstance(first, (tuple, list)) else first
        if isinstance(path, (str, os.PathLike)) and str(path).lower().endswith(
            (".jpg", ".jpeg", ".png", ".bmp", ".webp")
        ):
            return "folder"
    return None


def _any_tensor(obj: Any, depth: int = 0) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if depth > 3:
        return None
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        for item in obj:
            t = _any_tensor(item, depth + 1)
            if t is not None:
                return t
    return None


def _image_tensor(batch: Any) -> torch.Tensor | None:
    items = list(batch.values()) if isinstance(batch, Mapping) else batch
    if isinstance(items, torch.Tensor):
        items = [items]
    if isinstance(items, (list, tuple)):
        for item in items:
            # floating only: a uint8 NHWC batch still to be normalized on the device says nothing yet
            if isinstance(item, torch.Tensor) and item.dim() == 4 and item.is_floating_point():
                return item
    return None


def _distinct_memory_format(t: torch.Tensor) -> bool | None:
    """True if channels_last, False if NCHW, None if the strides cannot tell (e.g. 1x1 kernels, C == 1)."""
    cl = t.is_contiguous(memory_format=torch.channels_last)
    nchw = t.is_contiguous()
    if cl == nchw:
        return None
    return cl


def conv_memory_formats(model: nn.Module) -> tuple[int, int]:
    """``(decidable 4-D conv weights, of which channels_last)`` of ``model``; metadata only, no GPU work."""
    total = cl = 0
    for m in model.modules():
        if isinstance(m, nn.Conv2d) and m.weight.dim() == 4:
            fmt = _distinct_memory_format(m.weight)
            if fmt is None:
                continue
            total += 1
            cl += int(fmt)
    return total, cl


def _loader_facts(trainer: pl.Trainer) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    loader = trainer.train_dataloader
    if isinstance(loader, Mapping):
        loader = next(iter(loader.values()), None)
    elif isinstance(loader, (list, tuple)):
        loader = loader[0] if loader else None
    if loader is None:
        return facts
    if "dali" in type(loader).__name__.lower():
        facts.update(backend="dali", host_batches=False)
        kwargs = getattr(loader, "pipeline_kwargs", None)  # DALILoader's; other DALI wrappers: unknown
        if isinstance(kwargs, Mapping):
            facts["dali_decoder"] = str(kwargs.get("decoder", "gpu"))
            if isinstance(kwargs.get("num_threads"), int):
                facts["dali_threads"] = int(kwargs["num_threads"])
    if isinstance(loader, torch.utils.data.DataLoader):
        facts["num_workers"] = loader.num_workers
        facts["pin_memory"] = bool(loader.pin_memory)
        bs = loader.batch_size
        if bs is None and loader.batch_sampler is not None:
            bs = getattr(loader.batch_sampler, "batch_size", None)
        if bs is not None:
            facts["batch_size"] = int(bs)
        facts["backend"] = _dataset_backend(loader.dataset)
        if loader.num_workers > 0:
            facts["host_batches"] = True  # CUDA tensors cannot come out of worker processes
        else:
            facts["host_batches"] = _dataset_on_host(loader.dataset)
    dm = getattr(trainer, "datamodule", None)  # set by Lightning in fit(); documented, not typed
    backend = getattr(dm, "backend", None) if dm is not None else None
    if isinstance(backend, str) and backend in ("folder", "hdf5", "dali"):
        facts["backend"] = backend
    elif backend == "auto":
        src = getattr(dm, "train_dir", None)
        if src is not None:
            facts["backend"] = "hdf5" if str(src).lower().endswith((".h5", ".hdf5")) else "folder"
    if facts.get("backend") == "dali":
        facts["host_batches"] = False
    return facts


def _dataset_on_host(ds: Any) -> bool | None:
    """Whether a map-style dataset's items live in host memory (looks at one item; None if it cannot tell)."""
    inner = _unwrap_dataset(ds)
    tensors = getattr(inner, "tensors", None)  # TensorDataset: no item fetch needed
    if isinstance(tensors, (list, tuple)) and tensors and isinstance(tensors[0], torch.Tensor):
        return tensors[0].device.type == "cpu"
    if isinstance(ds, torch.utils.data.IterableDataset) or not hasattr(ds, "__getitem__"):
        return None
    try:
        item = ds[0]
    except Exception:  # an unusual dataset: the rule that needs this stays silent
        return None
    t = _any_tensor(item)
    if t is None:
        return True  # numpy arrays / PIL images are host memory
    return t.device.type == "cpu"


def amp_facts(trainer: Any) -> dict[str, Any]:
    """``grad_scaler``, ``unfused_optimizers`` and ``gradient_clip_val`` of a run; host attributes only, no sync.

    Reads ``trainer.precision_plugin.scaler`` (Lightning's ``MixedPrecision`` and ``FSDPPrecision`` keep their
    ``GradScaler`` there; other plugins have none), ``trainer.optimizers`` and ``trainer.gradient_clip_val``.
    An optimizer counts as unfused when it lacks ``_step_supports_amp_scaling``: the attribute
    ``GradScaler.step`` itself checks to decide between the device-side path and ``found_inf.item()``.
    """
    facts: dict[str, Any] = {}
    plugin = getattr(trainer, "precision_plugin", None)
    if plugin is not None:
        scaler = getattr(plugin, "scaler", None)
        is_enabled = getattr(scaler, "is_enabled", None)
        facts["grad_scaler"] = bool(is_enabled()) if callable(is_enabled) else scaler is not None
    optimizers = getattr(trainer, "optimizers", None)
    if isinstance(optimizers, (list, tuple)):
        facts["unfused_optimizers"] = tuple(
            type(getattr(opt, "optimizer", opt)).__name__ for opt in optimizers if not is_fused(opt)
        )
    clip: Any = getattr(trainer, "gradient_clip_val", None)
    facts["gradient_clip_val"] = float(clip) if _finite(clip) and clip > 0 else None
    return facts


def collect_config(trainer: pl.Trainer, pl_module: pl.LightningModule, gpu_monitor: bool) -> RunConfig:
    """Read the run's configuration through public Lightning and torch API; no GPU work, no sync."""
    device = trainer.strategy.root_device
    cfg = RunConfig(device_type=device.type, gpu_monitor=gpu_monitor)
    cfg.precision = str(trainer.precision)
    cfg.cpus = _cpu_count()
    cfg.processes_per_node = max(1, int(trainer.num_devices))
    for key, value in _loader_facts(trainer).items():
        setattr(cfg, key, value)
    for key, value in amp_facts(trainer).items():
        setattr(cfg, key, value)
    cfg.conv_layers, cfg.conv_channels_last = conv_memory_formats(pl_module)
    cfg.cudnn_benchmark = bool(torch.backends.cudnn.benchmark)
    cfg.cudnn_deterministic = bool(torch.backends.cudnn.deterministic)
    cfg.cudnn_allow_tf32 = bool(torch.backends.cudnn.allow_tf32)
    cfg.float32_matmul_precision = torch.get_float32_matmul_precision()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        cfg.gpu_name = props.name
        cfg.capability = (props.major, props.minor)
        cfg.mem_total_gb = props.total_memory / 2**30
        # allocator bookkeeping on the host: no sync
        cfg.mem_peak_gb = torch.cuda.max_memory_reserved(device) / 2**30
    return cfg


_DEFAULT_WINDOW = 20


def _find_monitor(trainer: pl.Trainer) -> Any | None:
    for cb in trainer.callbacks:  # type: ignore[attr-defined]
        if type(cb).__name__ == "GPUStatsMonitor" or (hasattr(cb, "history") and hasattr(cb, "last_window")):
            return cb
    return None


class BottleneckAdvisor(Callback):
    """Tell which part of the pipeline starves the GPU and what to change.

    After ``warmup_steps`` training batches it evaluates one window at a time: the host side (step time, data
    wait, samples/s, timed by the advisor itself) and, when a ``GPUStatsMonitor`` is among the callbacks, the GPU
    side (GPU-Util, SM activity, memory) from the monitor's ``history``, together with the run's configuration.
    By default (``window_steps=None``) its windows are the monitor's logging windows, so both sides cover the
    same steps; without a monitor a window is 20 batches.
    A verdict is raised after ``min_windows`` consecutive windows diagnose it and cleared after
    ``clear_windows`` windows without it. ``advisor.verdicts`` holds the raised :class:`Verdict` objects.

    Logged (to every logger, at each window, rank zero):

    ========================== ====== ======================================================
    key                        unit   meaning
    ========================== ====== ======================================================
    ``advisor/<kind>``         0/1    1 while verdict ``<kind>`` (one of :data:`KINDS`) is raised
    ``advisor/num_warnings``   count  raised verdicts of severity ``warning``
    ``advisor/summary``        text   markdown table, TensorBoardLogger only (on change and at the end)
    ========================== ====== ======================================================

    At the end of fit, rank zero prints a concise summary (``rank_zero_info``; ``verbose=False`` silences it).

    Args:
        warmup_steps: training batches ignored first (worker start-up, cuDNN autotuning, allocator growth).
            Following a monitor, warm-up ends with the first monitor window that closes at or after it.
        window_steps: training batches a window spans; ``None`` follows the ``GPUStatsMonitor``'s windows
            (20 batches when there is no monitor).
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
        for name, value, low in (
            ("warmup_steps", warmup_steps, 0),
            ("window_steps", 20 if window_steps is None else window_steps, 1),
            ("min_windows", min_windows, 1),
            ("clear_windows", clear_windows, 1),
        ):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if thresholds is not None and not isinstance(thresholds, AdvisorThresholds):
            raise TypeError("thresholds must be an AdvisorThresholds instance")
        self.warmup_steps = warmup_steps
        self.window_steps = window_steps
        self.min_windows = min_windows
        self.clear_windows = clear_windows
        self.thresholds = thresholds or AdvisorThresholds()
        self.verbose = verbose
        self._filter = Hysteresis(min_windows, clear_windows)
        self.history: list[dict[str, Any]] = []
        self.config: RunConfig | None = None
        self._reset_run()

    # -- state -----------------------------------------------------------------------------------------------
    def _reset_run(self) -> None:
        self._timer: Any = None
        self._monitor: Any = None
        self._batches = 0
        self._follow = False  # windows are the monitor's
        self._warm = False  # warm-up is over
        self._seen = 0  # monitor history entries already accounted for
        self._warm_seen = 0  # monitor history length when warm-up ended
        self._window_len = (
            self.window_steps or _DEFAULT_WINDOW
        )  # batches in the latest window (for the summary)
        self._last_eval_batch = 0
        self._probe_input = True

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
        return format_summary(self.verdicts, self.windows, self._window_len, self.warmup_steps)

    def state_dict(self) -> dict[str, Any]:
        return {"filter": self._filter.state_dict(), "history": list(self.history[-100:])}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._filter.load_state_dict(state_dict.get("filter", {}))
        self.history = list(state_dict.get("history", []))

    # -- hooks -----------------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            # a new fit is a new run; a checkpoint restore (load_state_dict) comes after this and wins
            self._filter = Hysteresis(self.min_windows, self.clear_windows)
            self.history = []
            self.config = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset_run()
        self._timer = StepTimer()
        self._monitor = _find_monitor(trainer)
        self._seen = self._warm_seen = len(self._monitor_history())  # entries of an earlier fit are not ours
        self._follow = self.window_steps is None and self._monitor is not None
        self._warm = self.warmup_steps == 0
        self.config = collect_config(trainer, pl_module, gpu_monitor=self._monitor is not None)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._timer is not None:
            # the first batch's wait is the loader starting up: counted from here, as the monitor does
            self._timer.mark(time.perf_counter())

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._timer is not None:
            # validation inside fit is not time spent waiting for training data
            self._timer.mark(time.perf_counter())

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._timer is None:
            return
        self._timer.batch_start(time.perf_counter())
        if self._probe_input and self._batches >= self.warmup_steps:
            # memory format of the batch is stride metadata: no GPU work
            x = _image_tensor(batch)
            if x is not None and self.config is not None:
                fmt = _distinct_memory_format(x)
                if fmt is not None:
                    self.config.input_channels_last = fmt
            self._probe_input = False

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._timer is None:
            return
        self._timer.batch_end(time.perf_counter(), batch_size_of(batch))
        self._batches += 1
        if self._follow:
            history = self._monitor_history()
            if len(history) < self._seen:  # the monitor's history was reset
                self._seen = 0
            if len(history) == self._seen:
                return
            new, self._seen = history[self._seen :], len(history)
            if self._warm:
                self._evaluate(trainer, pl_module, Evidence.mean_of(new))
            elif self._batches >= self.warmup_steps:
                self._warm = True
                self._timer.window()  # discard warm-up; the next monitor window is the first one judged
                self._last_eval_batch = self._batches
            return
        if not self._warm and self._batches >= self.warmup_steps:
            self._warm = True
            self._timer.window()
            self._seen = self._warm_seen = len(self._monitor_history())
            self._last_eval_batch = self._batches
        elif self._warm and (self._batches - self.warmup_steps) % self._window_len == 0:
            self._evaluate(trainer, pl_module, self._gpu_evidence())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._timer is None:
            return
        if trainer.is_global_zero:
            self._log_text(trainer)
            if self.verbose:
                rank_zero_info(self.summary())
        self._timer = None
        self._monitor = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._timer = None
        self._monitor = None

    # -- work ------------------------------------------------------------------------------------------------
    def _monitor_history(self) -> list[Mapping[str, Any]]:
        history = getattr(self._monitor, "history", None) if self._monitor is not None else None
        return [h for h in history or [] if isinstance(h, Mapping)]

    def _gpu_evidence(self) -> Evidence:
        """Monitor windows logged since the last evaluation (fixed ``window_steps`` mode)."""
        history = self._monitor_history()
        if len(history) < self._seen:
            self._seen = self._warm_seen = 0
        fresh, self._seen = history[self._seen :], len(history)
        if not fresh and len(history) > self._warm_seen:
            # the monitor logs less often than the advisor evaluates: its latest post-warm-up window stands
            fresh = [history[-1]]
        return Evidence.mean_of(fresh)

    def _evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule, gpu: Evidence) -> None:
        step = trainer.global_step
        self._window_len, self._last_eval_batch = self._batches - self._last_eval_batch, self._batches
        host = Evidence.from_metrics(self._timer.window())
        # host figures from our own timer cover exactly this window; the monitor adds the GPU side (and the
        # host side only if ours is empty)
        evidence = host.merged_with(gpu)
        cfg = self.config or collect_config(trainer, pl_module, self._monitor is not None)
        # what can change during fit (ChannelsLast applied late, allocator peak) is re-read: metadata only
        cfg.conv_layers, cfg.conv_channels_last = conv_memory_formats(pl_module)
        cfg.cudnn_benchmark = bool(torch.backends.cudnn.benchmark)
        if cfg.device_type == "cuda":
            cfg.mem_peak_gb = torch.cuda.max_memory_reserved(trainer.strategy.root_device) / 2**30
        self.config = cfg
        found = diagnose(evidence, cfg, self.thresholds)
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
        if len(self.history) > 1000:
            del self.history[: len(self.history) - 1000]
        if trainer.is_global_zero:
            self._log_flags(trainer, step)
            if changed:
                self._log_text(trainer)

    def _log_flags(self, trainer: pl.Trainer, step: int) -> None:
        raised = {v.kind for v in self.verdicts}
        flags: dict[str, float] = {f"advisor/{k}": float(k in raised) for k in KINDS}
        flags["advisor/num_warnings"] = float(sum(v.severity == "warning" for v in self.verdicts))
        for logger in trainer.loggers:
            logger.log_metrics(flags, step=step)

    def _log_text(self, trainer: pl.Trainer) -> None:
        from lightning.pytorch.loggers import TensorBoardLogger

        if self.windows == 0:
            return
        text = _markdown(self.verdicts, self.windows, trainer.global_step)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text("advisor/summary", text, global_step=trainer.global_step)
