"""The rules: one function a verdict kind, each reading one window's ``Evidence`` and the ``RunConfig``;
``diagnose`` runs them all. Starvation is judged once (``Context.starved``, docs/advisor.md)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lightning_gpuopt._checks import check_arg, check_float, check_int, is_int
from lightning_gpuopt.observe.advisor import advice
from lightning_gpuopt.observe.advisor.evidence import Evidence, RankEvidence, RunConfig
from lightning_gpuopt.observe.advisor.verdict import KINDS, NEEDS, EvidenceValue, Verdict, sort_verdicts

__all__ = ["NEEDS", "RULES", "AdvisorThresholds", "Context", "diagnose", "unmet_needs"]


@dataclass(frozen=True)
class AdvisorThresholds:
    """The numbers the rules compare against; docs/advisor.md lists each, its default and the rule using it.

    Example:
        >>> strict = AdvisorThresholds(gpu_idle_frac=0.05, input_wait_frac=0.05)
    """

    gpu_idle_frac: float = 0.10
    loader_share: float = 0.5
    input_wait_frac: float = 0.10
    input_wait_min_ms: float = 2.0
    gpu_busy_util: float = 90.0
    few_workers_frac: float = 0.5
    cores_full_frac: float = 0.9
    launch_util: float = 70.0
    launch_sm_active: float = 25.0
    small_batch: int = 16
    headroom_mem_frac: float = 0.30
    tensor_core_capability: tuple[int, int] = (7, 0)
    channels_last_frac: float = 0.5
    host_sync_wait_frac: float = 0.02
    host_sync_busy_util: float = 97.0
    rank_wait_frac: float = 0.10
    rank_wait_min_ms: float = 2.0
    store_read_mb_s: float = 10.0
    fp16_scale_floor: float = 1.0
    fp16_scale_falls: int = 3
    jpeg_busy_util: float = 90.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            name, value = f.name, getattr(self, f.name)
            if name.endswith("_frac") or name == "loader_share":
                check_float(value, name, low=0, high=1, what="(a fraction)", fix="e.g. 0.1 for 10%")
            elif name.endswith(("_util", "_sm_active")):
                check_float(value, name, low=0, high=100, what="(%)")
            elif name.endswith("_ms"):
                check_float(value, name, low=0, what="(ms)")
        check_float(self.store_read_mb_s, "store_read_mb_s", low=0, what="(MB/s)")
        check_int(self.small_batch, "small_batch", low=0, what="(samples)")
        check_float(self.fp16_scale_floor, "fp16_scale_floor", low=0, what="(a GradScaler scale)")
        check_int(self.fp16_scale_falls, "fp16_scale_falls", low=1, what="(backoffs a window)")
        cap = self.tensor_core_capability
        must = "a (major, minor) tuple of ints >= 0"
        ok_type = isinstance(cap, tuple) and len(cap) == 2 and all(is_int(v) for v in cap)
        check_arg(ok_type, "tensor_core_capability", cap, must, fix="e.g. (7, 0)", error=TypeError)
        check_arg(min(cap) >= 0, "tensor_core_capability", cap, must, fix="e.g. (7, 0)")


def _r(x: float, nd: int = 3) -> float:
    return round(float(x), nd)


def _digits(name: str) -> int:
    """Decimals a figure is reported with: percentages and MB/s 1; ms, GiB, rates and cores 2; shares 3."""
    if name.endswith(("_util", "_util_min", "_active", "_pct", "_mb_s")):
        return 1
    return 2 if name.endswith(("_ms", "_gb", "_per_sec", "_cores")) else 3


_MAX_GAIN = 100.0


def gain_of_frac(frac: float | None) -> float | None:
    """The speed-up from removing a share ``frac`` (0-1) of the time: ``1 / (1 - frac)``."""
    if frac is None or frac < 0:
        return None
    return min(1.0 / (1.0 - frac), _MAX_GAIN) if frac < 1 else _MAX_GAIN


def gain_of_ceiling(ceiling_frac: float | None) -> float | None:
    """The speed-up to the model's own ceiling: ``1 / ceiling_frac`` (at least 1)."""
    if ceiling_frac is None or ceiling_frac <= 0:
        return None
    return min(max(1.0 / ceiling_frac, 1.0), _MAX_GAIN)


_FAMILIES = {
    "fp32": ("32", "fp32"),
    "fp64": ("64", "fp64"),
    "half": ("16", "bf16", "fp16", "half", "transformer-engine"),
}


@dataclass
class Context:
    """One window's evidence and configuration, with the facts several rules share worked out once."""

    ev: Evidence
    cfg: RunConfig
    t: AdvisorThresholds

    def __post_init__(self) -> None:
        ev, t = self.ev, self.t
        self.cuda = self.cfg.device_type == "cuda"
        self.gpu_busy = ev.gpu_util is not None and ev.gpu_util >= t.gpu_busy_util
        self.small_batch = self.cfg.batch_size is not None and self.cfg.batch_size <= t.small_batch
        self.small_kernels = ev.sm_active is not None and ev.sm_active < t.launch_sm_active
        procs = max(1, self.cfg.processes_per_node)
        self.cores_per_process = max(1, self.cfg.cpus // procs) if self.cfg.cpus else None
        self.cores_full = None if ev.cpu_busy_frac is None else ev.cpu_busy_frac >= t.cores_full_frac
        precision = str(self.cfg.precision).lower()
        self.family = next((f for f, starts in _FAMILIES.items() if precision.startswith(starts)), None)
        # the host's wait for data: inside the loader where it says so, else the whole gap between batches
        self.wait = ev.loader_wait_frac if ev.loader_wait_frac is not None else ev.data_wait_frac
        self.starved = self._starved()

    def _starved(self) -> str | None:
        """``"input"`` (the loader starves the GPU), ``"host"`` (the host does) or ``None``."""
        ev, t, wait = self.ev, self.t, self.wait
        if self.cuda and ev.gpu_idle_frac is not None:
            if ev.gpu_idle_frac < t.gpu_idle_frac or wait is None:
                return None
            return "input" if wait >= t.loader_share * ev.gpu_idle_frac else "host"
        long_enough = ev.data_wait_ms is None or ev.data_wait_ms >= t.input_wait_min_ms
        if wait is not None and wait >= t.input_wait_frac and long_enough and not self.gpu_busy:
            return "input"
        return None

    def gain(self, frac: float | None) -> float | None:
        """The gain to the model's ceiling where it is measured, else from removing ``frac`` of the time."""
        return gain_of_ceiling(self.ev.ceiling_frac) or gain_of_frac(frac)

    @property
    def compute_severity(self) -> str:
        """Compute verdicts are an opportunity, not the bottleneck, while the loader starves the GPU."""
        return "info" if self.starved == "input" else "warning"

    def figures(self, *names: str) -> dict[str, EvidenceValue]:
        """The known ``names``: the evidence's measured figures (rounded, ``_digits``), else the configuration's
        settings; unknown ones left out."""
        out: dict[str, EvidenceValue] = {}
        for name in names:
            measured = hasattr(self.ev, name)
            value = getattr(self.ev if measured else self.cfg, name)
            if value is None:
                continue
            if measured:
                out[name] = _r(value, _digits(name))
            else:
                out[name] = value if isinstance(value, (int, float, str)) else str(value)
        return out


def _input_cause(c: Context) -> str:
    if c.ev.jpeg_util is not None and c.ev.jpeg_util >= c.t.jpeg_busy_util:
        return "jpeg-engine"  # measured: the hardware decoder is full, whatever the loader's settings
    w, cpp, cfg = c.cfg.num_workers, c.cores_per_process, c.cfg
    if w is None and cfg.backend == "folder" and cfg.decode_threads is not None:
        w = cfg.decode_threads  # a folder decoded by reading threads: each thread takes a worker's place
    if cfg.backend == "hdf5" and c.ev.read_mb_s is not None:
        # measured: a store read from the disk is bound by it, one served from the page cache is not
        return "store-bound" if c.ev.read_mb_s >= c.t.store_read_mb_s else "slow-loader"
    if w is not None and cpp is not None and w > cpp:
        return "too-many-workers"
    if w is not None and cpp is not None and (w == 0 or w < cpp * c.t.few_workers_frac):
        return "too-few-workers"
    backend_cause = {"dali": "dali-bound", "folder": "decode-bound"}.get(str(cfg.backend))
    if backend_cause is None and cfg.backend == "hdf5" and w is None:
        return "store-bound"  # a store read by threads of the training process
    return backend_cause or "slow-loader"


def _waited(c: Context, wait: float) -> str:
    """What the input-bound advice opens with: the figures the verdict rests on."""
    ev = c.ev
    waits = f"waits for data {wait:.0%} of each step"
    if ev.loader_wait_frac is not None and ev.data_wait_frac is not None:
        waits += f" ({ev.loader_wait_frac:.0%} inside the loader)"
    if ev.gpu_idle_frac is not None:
        return f"The GPU sits idle {ev.gpu_idle_frac:.0%} of the time between steps while the loop {waits}. "
    if not c.cuda:
        return f"On this {c.cfg.device_type or 'CPU'} run the verdict rests on host figures only: the loop {waits}. "
    busy = f" while the GPU is busy {ev.gpu_util:.0f}% of the time" if ev.gpu_util is not None else ""
    return f"The loop {waits}{busy}. "


def input_bound(c: Context) -> Verdict | None:
    """The loader does not deliver batches as fast as the GPU trains."""
    if c.starved != "input" or c.wait is None:
        return None
    ev, cfg = c.ev, c.cfg
    figs = c.figures(
        *("gpu_idle_frac", "loader_wait_frac", "data_wait_frac", "ceiling_frac", "data_wait_ms", "step_ms"),
        *("samples_per_sec", "gpu_util", "sm_active", "tensor_active", "cpu_busy_frac", "cpu_workers_pct"),
        *("cpu_main_pct", "cpu_cores", "num_workers", "cpus"),
    )
    if cfg.cpus is not None:
        figs["processes_per_node"] = cfg.processes_per_node
    figs.update(c.figures("backend", "batch_size"))
    cause = _input_cause(c)
    extra = {"dali-bound": ("decoder", "decode_threads"), "jpeg-engine": ("jpeg_util", "decoder")}
    figs.update(c.figures(*extra.get(cause, ())))
    if cause == "store-bound" and cfg.decode_threads is not None:
        figs["read_threads"] = cfg.decode_threads
    if cfg.backend == "hdf5":
        figs.update(c.figures("read_mb_s"))
    # the headline figure is the logged time/data_wait_frac; the loader's own share, where known, beside it
    wait = ev.data_wait_frac if ev.data_wait_frac is not None else c.wait
    head = _waited(c, wait) + advice.cpu_sentence(ev, cfg, c.t.cores_full_frac)
    text = head + advice.input_bound(cause, ev, cfg, c.cores_per_process, c.cores_full)
    gain = c.gain(ev.gpu_idle_frac if ev.gpu_idle_frac is not None else wait)
    return Verdict("input-bound", figs, text, "warning", cause, gain)


def host_bound(c: Context) -> Verdict | None:
    """The GPU idles between steps while the loader is quick: the host itself is late."""
    if c.starved != "host" or c.ev.gpu_idle_frac is None:
        return None
    figs = c.figures(
        *("gpu_idle_frac", "loader_wait_frac", "data_wait_frac", "gpu_blocked_frac", "ceiling_frac"),
        *("step_ms", "gpu_util", "sm_active", "cpu_main_pct", "batch_size", "cuda_graphs_skipped"),
    )
    text = advice.host_bound(c.ev, c.cfg, c.ev.gpu_idle_frac, c.wait, c.small_batch or c.small_kernels)
    return Verdict("host-bound", figs, text, gain=c.gain(c.ev.gpu_idle_frac))


def _rank_waits(c: Context) -> tuple[RankEvidence, list[float], float] | None:
    """The ranks, every rank's all-reduce wait and the mean step time, when every rank measured both."""
    ranks = c.ev.ranks
    if ranks is None:
        return None
    waits = [w for w in ranks.allreduce_wait_ms if w is not None]
    steps = [s for s in ranks.step_ms if s is not None and s > 0]
    if len(waits) < ranks.world_size or len(steps) < ranks.world_size:
        return None
    return ranks, waits, sum(steps) / len(steps)


def _rank_figures(ranks: RankEvidence) -> dict[str, EvidenceValue]:
    def joined(values: tuple[float | None, ...]) -> str:
        return ",".join("-" if v is None else f"{v:.1f}" for v in values)

    return {
        "world_size": ranks.world_size,
        "step_ms_per_rank": joined(ranks.step_ms),
        "allreduce_wait_ms_per_rank": joined(ranks.allreduce_wait_ms),
        "data_wait_ms_per_rank": joined(ranks.data_wait_ms),
    }


def _long_wait(ms: float, step: float, t: AdvisorThresholds) -> bool:
    return ms >= t.rank_wait_frac * step and ms >= t.rank_wait_min_ms


def straggler(c: Context) -> Verdict | None:
    """Under DDP, one rank is late and the others wait for it in the gradient all-reduce."""
    measured = _rank_waits(c)
    if measured is None or not _long_wait(max(measured[1]) - min(measured[1]), measured[2], c.t):
        return None
    ranks, waits, step = measured
    late = waits.index(min(waits))  # the rank nobody waits for is the one everybody waits for
    others = [w for r, w in enumerate(waits) if r != late]
    late_ms = sum(others) / len(others) - waits[late]
    data = ranks.data_wait_ms
    cause = "compute"
    if all(d is not None for d in data):
        rest = [float(d) for r, d in enumerate(data) if r != late]  # type: ignore[arg-type]
        if float(data[late]) - sum(rest) / len(rest) >= 0.5 * late_ms:  # type: ignore[arg-type]
            cause = "loader"
    figs: dict[str, EvidenceValue] = {
        "straggler_rank": late,
        "late_ms": _r(late_ms, 2),
        **_rank_figures(ranks),
    }
    text = (
        f"Rank {late} is late: the other ranks wait {late_ms:.1f} ms a step ({late_ms / step:.0%} of the step) "
        f"in the gradient all-reduce for it (all-reduce wait per rank: {', '.join(f'{w:.1f}' for w in waits)} "
        "ms), so every GPU trains at its pace. "
    )
    loader = (
        "It waits longer for its batches than the others: its loader is slower. Look for uneven shards "
        "(samples of varying size or cost), too few workers for its share of the cores (cores / processes "
        "per node), or a slower disk or network path for that rank."
    )
    compute = (
        "Its own step is slower: check its GPU (nvidia-smi: clocks, temperature, power cap, another process "
        "on it), its CPU and NUMA affinity, and whether its samples cost more (variable sequence lengths: "
        "batch them by length)."
    )
    text += loader if cause == "loader" else compute
    return Verdict("straggler", figs, text, "warning", cause, gain_of_frac(late_ms / step))


def comm_bound(c: Context) -> Verdict | None:
    """Under DDP, every rank waits for the gradient all-reduce, none much longer: communication is exposed."""
    measured = _rank_waits(c)
    if measured is None:
        return None
    ranks, waits, step = measured
    least = min(waits)
    # a straggler comes first: the waits left once it is fixed tell whether the network is slow
    if not _long_wait(least, step, c.t) or _long_wait(max(waits) - least, step, c.t):
        return None
    figs: dict[str, EvidenceValue] = {"least_allreduce_wait_ms": _r(least, 2), "wait_frac": _r(least / step)}
    figs.update(_rank_figures(ranks))
    text = (
        f"Every one of the {ranks.world_size} ranks waits at least {least:.1f} ms a step ({least / step:.0%} of "
        "the step) for the gradient all-reduce: communication is not hidden behind compute. Grow the batch per "
        "GPU or accumulate gradients (Trainer(accumulate_grad_batches=k)); compress gradients (DDPStrategy("
        "ddp_comm_hook=default_hooks.bf16_compress_hook or fp16_compress_hook)); try DDPStrategy(static_graph="
        "True, gradient_as_bucket_view=True) or another bucket_cap_mb; check the interconnect (nvidia-smi topo -m)."
    )
    return Verdict("comm-bound", figs, text, gain=gain_of_frac(least / step))


def pageable_copies(c: Context) -> Verdict | None:
    """Host batches copied from pageable memory: the copy waits for the GPU."""
    cfg = c.cfg
    host = cfg.host_batches if cfg.host_batches is not None else (cfg.num_workers or 0) > 0 or None
    if not (cfg.pin_memory is False and host and cfg.backend != "dali"):
        return None
    figs: dict[str, EvidenceValue] = {"pin_memory": "False"}
    figs.update(c.figures("data_wait_frac", "gpu_blocked_frac", "num_workers", "batch_size"))
    text = (
        "Batches are copied to the GPU from pageable host memory: the copy is synchronous and waits for the "
        "GPU's queued work, so loading and compute stop overlapping. Set DataLoader(pin_memory=True); "
        "OptimizedDataModule(pin_memory=None) turns it on for CUDA runs."
    )
    return Verdict("pageable-copies", figs, text, gain=c.gain(c.ev.data_wait_frac))


def launch_bound(c: Context) -> Verdict | None:
    """Low GPU-Util or SM activity without starving between steps: kernels too small or launched too slowly."""
    if c.ev.gpu_util is None or c.starved is not None:
        return None
    util, ev, t = float(c.ev.gpu_util), c.ev, c.t
    # the locator named lines of the user's that make the GPU wait inside steps
    syncing = bool(ev.sync_sites) and (ev.step_idle_frac or 0.0) >= t.gpu_idle_frac
    small_batch = c.small_batch and util < t.gpu_busy_util
    if not (util < t.launch_util or c.small_kernels or small_batch or syncing):
        return None
    figs = c.figures(
        *("gpu_util", "sm_active", "tensor_active", "gpu_util_min", "gpu_idle_frac", "step_idle_frac"),
        *("ceiling_frac", "host_syncs_per_step", "step_ms", "data_wait_frac", "samples_per_sec"),
        *("batch_size", "cuda_graphs_skipped"),
    )
    idle = None if ev.step_idle_frac is None else ev.step_idle_frac + (ev.gpu_idle_frac or 0.0)
    # the replay runs the same training_step, its syncs and launches included: the GPU's idle share inside
    # and between steps bounds the fix; the ceiling only where that share is not measured
    gain = gain_of_frac(idle) or gain_of_ceiling(ev.ceiling_frac)
    return Verdict("launch-bound", figs, advice.launch_bound(ev, c.cfg, util), gain=gain)


def amp_host_sync(c: Context) -> Verdict | None:
    """An unfused optimizer under a GradScaler: ``found_inf`` read on the host every step."""
    cfg, ev, t = c.cfg, c.ev, c.t
    if not cfg.unfused_optimizers:
        return None
    clip = cfg.gradient_clip_val if cfg.gradient_clip_val and cfg.gradient_clip_val > 0 else None
    figs: dict[str, EvidenceValue] = {
        "precision": str(cfg.precision),
        "optimizers": ",".join(cfg.unfused_optimizers),
    }
    if clip is not None:
        figs["gradient_clip_val"] = float(clip)
    figs.update(c.figures("gpu_idle_frac", "step_ms", "data_wait_frac", "gpu_util", "sm_active"))
    # the sync idles the GPU inside the step (after the optimizer's sync) as well as between steps, so any
    # of GPU idle, a GPU-Util short of saturation, or host work to expose makes it costly
    costly = (
        (ev.gpu_idle_frac is not None and ev.gpu_idle_frac >= t.host_sync_wait_frac)
        or (ev.gpu_util is not None and ev.gpu_util < t.host_sync_busy_util)
        or (ev.data_wait_frac is not None and ev.data_wait_frac >= t.host_sync_wait_frac)
    )
    text = advice.amp_host_sync(cfg.unfused_optimizers, cfg.precision, clip, cfg.capability)
    # the replayed ceiling steps through the same GradScaler, sync included: only the idle share bounds it
    gain = gain_of_frac(ev.step_idle_frac)
    return Verdict("amp-host-sync", figs, text, "warning" if costly else "info", gain=gain)


def fp16_overflow(c: Context) -> Verdict | None:
    """fp16 mixed precision whose GradScaler keeps backing off: the model overflows fp16, steps skipped."""
    cfg, ev, t = c.cfg, c.ev, c.t
    fp16 = str(cfg.precision).lower().startswith(("16", "fp16"))
    if not (fp16 and ev.grad_scale is not None):
        return None
    window = int(ev.grad_scale_window_falls or 0)
    low = ev.grad_scale < t.fp16_scale_floor
    if not (low or window >= t.fp16_scale_falls):
        return None
    start = ev.grad_scale_start if ev.grad_scale_start is not None else ev.grad_scale
    falls, steps = int(ev.grad_scale_falls or 0), int(ev.grad_scale_steps or 0)
    # 6 significant digits: a scale of 2**16 stays whole, one of 2**-10 readable
    figs: dict[str, EvidenceValue] = {
        "precision": str(cfg.precision),
        "grad_scale_start": float(f"{start:.6g}"),
        "grad_scale_end": float(f"{ev.grad_scale:.6g}"),
        "scale_falls": falls,
        "window_falls": window,
        "steps_observed": steps,
    }
    if cfg.capability is not None:
        figs["capability"] = f"{cfg.capability[0]}.{cfg.capability[1]}"
    text = advice.fp16_overflow(start, ev.grad_scale, falls, steps, low, t.fp16_scale_floor, cfg.capability)
    return Verdict("fp16-overflow", figs, text, "warning")


def fp32_on_tensor_cores(c: Context) -> Verdict | None:
    """Full precision on a GPU with tensor cores."""
    cap = c.cfg.capability
    if not (c.family in ("fp32", "fp64") and cap is not None and cap >= c.t.tensor_core_capability):
        return None
    figs: dict[str, EvidenceValue] = {"precision": str(c.cfg.precision), "capability": f"{cap[0]}.{cap[1]}"}
    if c.cfg.gpu_name:
        figs["gpu"] = c.cfg.gpu_name
    figs.update(c.figures("float32_matmul_precision", "tensor_active"))
    bf16 = ' (or "bf16-mixed", no loss scaling needed on this GPU)' if cap >= (8, 0) else ""
    text = (
        "Full-precision math leaves this GPU's tensor cores idle or slow. Train in "
        f'Trainer(precision="16-mixed"){bf16}; `Trainer(**fast_trainer_kwargs())` sets it with the rest, or pick '
        "it with choose_precision()."
    )
    if bf16 and c.cfg.float32_matmul_precision == "highest":
        text += ' To stay in fp32, at least allow TF32: torch.set_float32_matmul_precision("high").'
    return Verdict("fp32-on-tensor-cores", figs, text, c.compute_severity)


def nchw_convolutions(c: Context) -> Verdict | None:
    """Convolutions in NCHW under tensor-core math: cuDNN transposes around its NHWC kernels."""
    cfg, cap = c.cfg, c.cfg.capability
    tensor_core_math = c.family == "half" or (
        c.family == "fp32" and cap is not None and cap >= (8, 0) and cfg.cudnn_allow_tf32 is not False
    )
    if not (cfg.conv_layers > 0 and tensor_core_math):
        return None
    frac = cfg.conv_channels_last / cfg.conv_layers
    if (cap is not None and cap < c.t.tensor_core_capability) or frac >= c.t.channels_last_frac:
        return None
    figs: dict[str, EvidenceValue] = {
        "conv_layers": cfg.conv_layers,
        "conv_channels_last_frac": _r(frac),
        "precision": str(cfg.precision),
    }
    if cfg.input_channels_last is not None:
        figs["input_channels_last"] = str(cfg.input_channels_last)
    text = (
        f"{cfg.conv_layers - cfg.conv_channels_last} of {cfg.conv_layers} convolutions keep NCHW weights, so cuDNN "
        "transposes around its tensor-core (NHWC) kernels. Add ChannelsLast() to the Trainer's callbacks (or call "
        "apply_channels_last(model)); OptimizedDataModule and GPUAugment already deliver channels_last batches."
    )
    return Verdict("nchw-convolutions", figs, text, c.compute_severity)


def cudnn_benchmark_off(c: Context) -> Verdict | None:
    """cuDNN picks convolution algorithms by heuristics."""
    cfg = c.cfg
    if not (cfg.conv_layers > 0 and cfg.cudnn_benchmark is False and not cfg.cudnn_deterministic):
        return None
    figs: dict[str, EvidenceValue] = {"cudnn_benchmark": "False", "conv_layers": cfg.conv_layers}
    text = (
        "cuDNN uses heuristics instead of timing its convolution algorithms. With fixed input shapes set "
        "Trainer(benchmark=True) (part of fast_trainer_kwargs())."
    )
    return Verdict("cudnn-benchmark-off", figs, text, "info")


def memory_headroom(c: Context) -> Verdict | None:
    """Little device memory used while the GPU is not saturated: the batch could grow."""
    ev, cfg, t = c.ev, c.cfg, c.t
    used, total = cfg.mem_peak_gb, cfg.mem_total_gb
    if used is None or total is None:
        used, total = ev.mem_used_gb, ev.mem_total_gb
    if not (ev.gpu_util is not None and c.starved != "input" and not (c.gpu_busy and not c.small_kernels)):
        return None
    if used is None or not total or used / total >= t.headroom_mem_frac:
        return None
    mem_frac = used / total
    factor = 2 ** max(1, math.floor(math.log2(0.8 / max(mem_frac, 1e-3))))
    figs: dict[str, EvidenceValue] = {
        "mem_used_gb": _r(used, 2),
        "mem_total_gb": _r(total, 2),
        "mem_frac": _r(mem_frac),
    }
    figs.update(c.figures("gpu_util", "sm_active", "tensor_active", "batch_size"))
    bs = (
        f"batch_size={cfg.batch_size} could grow about {factor}x"
        if cfg.batch_size
        else "the batch could grow"
    )
    text = (
        f"Peak memory is {mem_frac:.0%} of {total:.0f} GiB while the GPU is not saturated: {bs} (scale the "
        "learning rate with it); Lightning's Tuner(trainer).scale_batch_size finds the largest batch that fits."
    )
    return Verdict("memory-headroom", figs, text, "info")


def gpu_metrics_missing(c: Context) -> Verdict | None:
    """A CUDA run without any GPU-side figure: the GPU rules are blind."""
    if c.ev.gpu_util is not None or c.ev.gpu_idle_frac is not None:
        return None
    figs: dict[str, EvidenceValue] = {"gpu_monitor": str(c.cfg.gpu_monitor)}
    text = (
        "No GPU-side figure measured (GPU idle share, GPU-Util), so starvation is judged from host timing only "
        "and launch-bound and memory verdicts cannot be made: add GPUStatsMonitor() to the Trainer's callbacks "
        "(GPU-Util needs nvidia-ml-py)."
    )
    if c.cfg.gpu_monitor:
        text = (
            "GPUStatsMonitor is in the run but logged no GPU figure for this window (NVML unavailable for this "
            "device, or a fixed window_steps shorter than the monitor's window)."
        )
    return Verdict("gpu-metrics-missing", figs, text, "info")


#: every rule, named after the verdict kind it raises, in ``KINDS`` order
RULES: tuple[Callable[[Context], Verdict | None], ...] = tuple(globals()[k.replace("-", "_")] for k in KINDS)
_NEED_WORDS = {"cuda": "a CUDA device", "ranks": "several processes", "scaler": "a GradScaler (16-mixed)"}


def unmet_needs(cuda: bool, world_size: int, grad_scaler: bool) -> dict[str, str]:
    """The kinds a run of this device, process count and precision can never raise, each with what it lacks."""
    have = {"cuda": cuda, "ranks": world_size > 1, "scaler": grad_scaler}
    missing = {kind: [_NEED_WORDS[n] for n in needs if not have[n]] for kind, needs in NEEDS.items()}
    return {kind: " and ".join(words) for kind, words in missing.items() if words}


def diagnose(
    evidence: Evidence | Mapping[str, Any],
    config: RunConfig | Mapping[str, Any],
    thresholds: AdvisorThresholds | None = None,
) -> list[Verdict]:
    """Classify one window of a run.

    Args:
        evidence: :class:`Evidence`, or a dict of logged keys (``"gpu/idle_frac"``, ``"time/data_wait_frac"``,
            ``"gpu/util"``...) or field names.
        config: :class:`RunConfig` or a dict of its fields.
        thresholds: the rules' numbers; defaults to :class:`AdvisorThresholds`.

    Returns:
        Verdicts, warnings first, then in ``KINDS`` order. An empty list means nothing to fix was found.

    Example:
        >>> window = {"gpu/idle_frac": 0.4, "time/loader_wait_frac": 0.35, "gpu/util": 55.0}
        >>> [v.label for v in diagnose(window,
        ...                            {"device_type": "cuda", "cpus": 16, "num_workers": 2})]
        ['input-bound (too-few-workers)']
    """
    ev = evidence if isinstance(evidence, Evidence) else Evidence.from_metrics(evidence)
    cfg = config if isinstance(config, RunConfig) else RunConfig.from_dict(config)
    c = Context(ev, cfg, thresholds or AdvisorThresholds())
    # a rule runs only where the run has what NEEDS lists for its kind
    absent = unmet_needs(c.cuda, ev.ranks.world_size if ev.ranks else 1, bool(cfg.grad_scaler))
    ready = [rule for kind, rule in zip(KINDS, RULES, strict=True) if kind not in absent]
    return sort_verdicts([v for rule in ready if (v := rule(c)) is not None])
