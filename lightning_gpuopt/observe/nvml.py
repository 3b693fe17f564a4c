"""NVML access: map a torch CUDA device to its NVML index, and sample the GPU on a background thread.

``pynvml`` (extra ``nvml``) is imported where it is used, never at module import.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from types import ModuleType
from typing import Any

import torch

from lightning_gpuopt._checks import check_arg, check_bool, check_float, check_int
from lightning_gpuopt._common import warn_at_user
from lightning_gpuopt._imports import require

__all__ = [
    "GPM_KEYS",
    "GPU_KEYS",
    "NVMLSampler",
    "normalize_uuid",
    "nvml_device_index",
]

#: Keys NVMLSampler.window() computes from GPM sample pairs (Hopper and newer).
GPM_KEYS: tuple[str, ...] = ("gpu/sm_active", "gpu/sm_occupancy", "gpu/tensor_active")
#: Keys NVMLSampler.window() can return, in a fixed order (the monitor's all-ranks gather relies on it).
GPU_KEYS: tuple[str, ...] = (
    "gpu/util",
    "gpu/util_min",
    "gpu/mem_util",
    "gpu/mem_used_gb",
    "gpu/mem_total_gb",
    "gpu/power_w",
    "gpu/temp_c",
    "gpu/sm_clock_mhz",
    *GPM_KEYS,
    "gpu/jpeg_util",  # the hardware JPEG decoder (NVJPG)
    "gpu/video_dec_util",  # the video decoder (NVDEC)
)

_GB = 1024**3
_ENERGY = "gpu/energy_mj"  # the energy counter's readings, turned into gpu/power_w at window ends
_GPM_PAIR_S = 0.2  # shortest time between the two GPM samples of a pair (NVML needs > 100 ms)
_GPM_WARNED: set[int] = set()  # say "no GPM" once a device and process, not once a fit


def normalize_uuid(uuid: Any) -> str:
    """A GPU UUID in one spelling (bare, lower case), so torch's and NVML's (``GPU-`` prefix) compare equal.

    A MIG identifier keeps its ``MIG-`` prefix, since it names an instance, not a GPU.

    Example:
        >>> normalize_uuid("GPU-A1B2C3D4-0000") == normalize_uuid("a1b2c3d4-0000")
        True
    """
    text = (uuid.decode() if isinstance(uuid, bytes) else str(uuid)).strip()
    if text[:4].upper() == "GPU-":
        text = text[4:]
    elif text[:4].upper() == "MIG-":
        return "MIG-" + text[4:].lower()
    return text.lower()


def _torch_device_uuid(index: int) -> str | None:
    """UUID of torch's CUDA device ``index`` as torch spells it, or None when torch cannot tell."""
    if not torch.cuda.is_available():
        return None
    try:
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    except (RuntimeError, AssertionError):
        return None
    return None if uuid is None else str(uuid)


def nvml_device_index(device: torch.device | int | str | None = None) -> int:
    """Return the NVML index of torch's CUDA ``device`` (default: the current device), matched by UUID.

    torch numbers the devices ``CUDA_VISIBLE_DEVICES`` leaves visible, NVML all of them: the device's UUID
    is the one name both share (never the local rank).

    Raises:
        ValueError: for a non-CUDA device, a MIG instance, or a device NVML does not list.
    """
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
    check_arg(device.type == "cuda", "device", device, "a CUDA device", fix="NVML numbers GPUs only")
    torch_index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = _torch_device_uuid(torch_index)
    if uuid is None:
        raise ValueError(
            f"torch cannot tell the UUID of CUDA device {torch_index}; pass the NVML index (nvml_index)"
        )
    wanted = normalize_uuid(uuid)
    if wanted.startswith("MIG-"):
        raise ValueError(
            f"CUDA device {torch_index} is a MIG instance; GPUStatsMonitor/NVMLSampler do not support MIG "
            "(NVML reports utilisation per physical GPU only)"
        )
    pynvml = require("pynvml")
    pynvml.nvmlInit()  # reference counted by NVML: safe when a sampler already holds it
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            if normalize_uuid(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))) == wanted:
                return i
    finally:
        pynvml.nvmlShutdown()
    raise ValueError(f"no NVML device has the UUID of CUDA device {torch_index} ({uuid}); pass nvml_index")


class _Stat:
    """Running sum/count/min/max, weighted (GPM pairs are weighted by their duration)."""

    __slots__ = ("max", "min", "total", "weight")

    def __init__(self) -> None:
        self.total = 0.0
        self.weight = 0.0
        self.min = math.inf
        self.max = -math.inf

    def add(self, value: float, weight: float = 1.0) -> None:
        self.total += value * weight
        self.weight += weight
        self.min = min(self.min, value)
        self.max = max(self.max, value)

    @property
    def mean(self) -> float:
        return self.total / self.weight if self.weight > 0 else math.nan


class NVMLSampler:
    """Sample one GPU through NVML on a daemon thread; ``window()`` returns aggregates since the last call.

    How each key is measured: docs/gpu_stats.md. A window without a new sample repeats the latest one.
    ``uuid`` is the sampled GPU's UUID in ``normalize_uuid`` form (set by ``start``).

    Args:
        index: NVML device index (see ``nvml_device_index``).
        period_s: polling period of the thread in seconds.
        gpm: read GPM metrics when the device supports them.

    Example:
        >>> with NVMLSampler(nvml_device_index("cuda:0"), period_s=0.1) as sampler:  # doctest: +SKIP
        ...     train_for_a_while()
        ...     print(sampler.window()["gpu/util"])
    """

    def __init__(self, index: int, period_s: float = 0.1, gpm: bool = True) -> None:
        check_int(index, "index", low=0, what="(an NVML device index)")
        check_float(period_s, "period_s", low=0, low_open=True, what="(seconds)")
        check_bool(gpm, "gpm")
        self.index = index
        self.period_s = float(period_s)
        self.gpm = gpm
        self.gpm_active = False
        self.uses_sample_buffer = False
        self.energy_counter = False
        self.error: BaseException | None = None  # an unexpected error that stopped the thread
        self.uuid: str | None = None
        self._pynvml: Any = None  # the module while started
        self._handle: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._stats: dict[str, _Stat] = {}
        self._latest: dict[str, float] = {}
        self._last_ts: dict[int, int] = {}
        self._unsupported: set[str] = set()
        self._gpm_samples: list[Any] = []
        self._gpm_prev_t = 0.0
        self._mem_total_gb = math.nan
        # the energy counter's (monotonic seconds, mJ): the last reading before the window, the latest one
        self._energy_mark: tuple[float, float] | None = None
        self._energy_last: tuple[float, float] | None = None
        self._energy_power: float | None = None  # the latest window's power from the counter

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> NVMLSampler:
        """Initialise NVML, probe what the device answers, and start the thread.

        Raises:
            ModuleNotFoundError: ``pynvml`` is missing (extra ``nvml``).
            pynvml.NVMLError: NVML cannot be initialised (no driver) or the index is invalid.
        """
        if self._thread is not None:
            return self
        pynvml = require("pynvml")
        pynvml.nvmlInit()
        try:
            self._pynvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
            with contextlib.suppress(pynvml.NVMLError):  # informative only
                self.uuid = normalize_uuid(pynvml.nvmlDeviceGetUUID(self._handle))
            self._mem_total_gb = pynvml.nvmlDeviceGetMemoryInfo(self._handle).total / _GB
            self.uses_sample_buffer = self._probe_sample_buffer()
            self._energy_mark = self._energy_last = self._read_energy()
            self.energy_counter = _ENERGY not in self._unsupported
            if self.gpm:
                self._start_gpm()
        except BaseException:
            self._release()
            raise
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"NVMLSampler-{self.index}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop and join the thread, free GPM buffers and shut NVML down. Safe to call twice."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._release()

    def _free_gpm(self, pynvml: ModuleType) -> None:
        for sample in self._gpm_samples:
            with contextlib.suppress(pynvml.NVMLError):  # freeing is best effort at shutdown
                pynvml.nvmlGpmSampleFree(sample)
        self._gpm_samples = []
        self.gpm_active = False

    def _release(self) -> None:
        pynvml = self._pynvml
        if pynvml is None:
            return
        self._free_gpm(pynvml)
        with contextlib.suppress(pynvml.NVMLError):  # already shut down elsewhere: nothing left to release
            pynvml.nvmlShutdown()
        self._pynvml = None
        self._handle = None

    def __enter__(self) -> NVMLSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _probe_sample_buffer(self) -> bool:
        pynvml = self._pynvml
        ok = True
        for kind in (pynvml.NVML_GPU_UTILIZATION_SAMPLES, pynvml.NVML_MEMORY_UTILIZATION_SAMPLES):
            try:
                _, samples = pynvml.nvmlDeviceGetSamples(self._handle, kind, 0)
                # history before start() does not belong to any window
                self._last_ts[kind] = max((int(s.timeStamp) for s in samples), default=0)
            except pynvml.NVMLError_NotFound:
                self._last_ts[kind] = 0  # empty buffer: supported, nothing yet
            except pynvml.NVMLError:
                ok = False
        return ok

    def _start_gpm(self) -> None:
        pynvml = self._pynvml
        try:
            support = pynvml.nvmlGpmQueryDeviceSupport(self._handle)
            if not support.isSupportedDevice:
                raise RuntimeError("the device does not support GPM (it needs Hopper or newer)")
            self._gpm_samples = [pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()]
            pynvml.nvmlGpmSampleGet(self._handle, self._gpm_samples[0])
            self._gpm_prev_t = time.monotonic()
            self.gpm_active = True
        except (pynvml.NVMLError, RuntimeError, AttributeError) as err:
            self._gpm_off(err)

    def _gpm_off(self, err: BaseException) -> None:
        if self._pynvml is not None:
            self._free_gpm(self._pynvml)
        if self.index in _GPM_WARNED:
            return
        _GPM_WARNED.add(self.index)
        warn_at_user(
            f"NVML GPM metrics ({', '.join(GPM_KEYS)}) are not available on NVML "
            f"device {self.index}: {err}. Continuing without them.",
            RuntimeWarning,
        )

    def _run(self) -> None:
        try:
            while True:
                self.sample_once()
                if self._stop.wait(self.period_s):
                    break
        except Exception as err:  # never take the training process down; report through .error
            self.error = err

    def _poll(self, key: str, fn: Any) -> float | None:
        if key in self._unsupported:
            return None
        pynvml = self._pynvml
        never = (
            pynvml.NVMLError_NotSupported,
            pynvml.NVMLError_NoPermission,
            getattr(pynvml, "NVMLError_FunctionNotFound", pynvml.NVMLError_NotSupported),  # an older driver
            AttributeError,  # an older nvidia-ml-py without the function
        )
        try:
            return float(fn())
        except never:
            self._unsupported.add(key)  # this device never reports it: stop asking
        except pynvml.NVMLError:
            pass  # transient: skip this tick
        return None

    def _read_energy(self) -> tuple[float, float] | None:
        """``(monotonic seconds, mJ)`` of the energy counter now, or None (no counter, or a failed read)."""
        pynvml, h = self._pynvml, self._handle
        before = time.monotonic()
        value = self._poll(_ENERGY, lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(h))
        return None if value is None else ((before + time.monotonic()) / 2, value)

    def _buffered(self, kind: int) -> list[float]:
        pynvml = self._pynvml
        try:
            value_type, samples = pynvml.nvmlDeviceGetSamples(self._handle, kind, self._last_ts[kind])
        except pynvml.NVMLError:  # NVMLError_NotFound: no new sample since the last timestamp
            return []
        last = self._last_ts[kind]
        new = [s for s in samples if int(s.timeStamp) > last]
        self._last_ts[kind] = max((int(s.timeStamp) for s in new), default=last)
        # utilisation samples are unsigned ints (a 64-bit type's low bits hold the same small number)
        field = "dVal" if value_type == pynvml.NVML_VALUE_TYPE_DOUBLE else "uiVal"
        return [float(getattr(s.sampleValue, field)) for s in new]

    def sample_once(self) -> None:
        """Take one round of readings (the thread calls this every ``period_s``)."""
        pynvml = self._pynvml
        if pynvml is None:
            return
        h = self._handle
        readings: list[tuple[str, float, float]] = []
        if self.uses_sample_buffer:
            readings += [("gpu/util", v, 1.0) for v in self._buffered(pynvml.NVML_GPU_UTILIZATION_SAMPLES)]
            readings += [
                ("gpu/mem_util", v, 1.0) for v in self._buffered(pynvml.NVML_MEMORY_UTILIZATION_SAMPLES)
            ]
        else:
            rates = self._poll_rates()
            if rates is not None:
                readings += [("gpu/util", rates[0], 1.0), ("gpu/mem_util", rates[1], 1.0)]
        energy = self._read_energy()
        polled = {
            "gpu/mem_used_gb": lambda: pynvml.nvmlDeviceGetMemoryInfo(h).used / _GB,
            "gpu/power_w": lambda: pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
            "gpu/temp_c": lambda: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
            "gpu/sm_clock_mhz": lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
            "gpu/jpeg_util": lambda: pynvml.nvmlDeviceGetJpgUtilization(h)[0],
            "gpu/video_dec_util": lambda: pynvml.nvmlDeviceGetDecoderUtilization(h)[0],
        }
        if _ENERGY not in self._unsupported:
            del polled["gpu/power_w"]  # the counter gives the window's power
        for key, fn in polled.items():
            value = self._poll(key, fn)
            if value is not None:
                readings.append((key, value, 1.0))
        if self.gpm_active:
            readings += self._gpm_pair()
        with self._lock:
            for key, value, weight in readings:
                self._stats.setdefault(key, _Stat()).add(value, weight)
                self._latest[key] = value
            if energy is not None:
                self._energy_last = energy

    def _poll_rates(self) -> tuple[float, float] | None:
        pynvml = self._pynvml
        try:
            rates = pynvml.nvmlDeviceGetUtilizationRates(self._handle)
        except pynvml.NVMLError:
            return None
        return float(rates.gpu), float(rates.memory)

    def _gpm_pair(self) -> list[tuple[str, float, float]]:
        pynvml = self._pynvml
        now = time.monotonic()
        dt = now - self._gpm_prev_t
        if dt < _GPM_PAIR_S:
            return []
        first, second = self._gpm_samples
        # in GPM_KEYS order
        metric_ids = (
            pynvml.NVML_GPM_METRIC_SM_UTIL,
            pynvml.NVML_GPM_METRIC_SM_OCCUPANCY,
            pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
        )
        try:
            pynvml.nvmlGpmSampleGet(self._handle, second)
            query = pynvml.c_nvmlGpmMetricsGet_t()
            query.version = pynvml.NVML_GPM_METRICS_GET_VERSION
            query.numMetrics = len(metric_ids)
            query.sample1 = first
            query.sample2 = second
            for i, metric_id in enumerate(metric_ids):
                query.metrics[i].metricId = metric_id
            pynvml.nvmlGpmMetricsGet(query)
        except pynvml.NVMLError as err:
            self._gpm_off(err)
            return []
        # the newer sample starts the next pair
        self._gpm_samples = [second, first]
        self._gpm_prev_t = now
        out = []
        for i, key in enumerate(GPM_KEYS):
            metric = query.metrics[i]
            if int(metric.nvmlReturn) == pynvml.NVML_SUCCESS and math.isfinite(metric.value):
                out.append((key, float(metric.value), dt))
        return out

    def window(self) -> dict[str, float]:
        """Aggregates since the previous call (or since ``start``), then start a new window."""
        with self._lock:
            stats, self._stats = self._stats, {}
            latest = dict(self._latest)
            mark, last = self._energy_mark, self._energy_last
            self._energy_mark = last
        out = {key: stat.max if key == "gpu/mem_used_gb" else stat.mean for key, stat in stats.items()}
        if "gpu/util" in stats:
            out["gpu/util_min"] = stats["gpu/util"].min
        for key, value in latest.items():  # a window without a new sample repeats the latest one
            out.setdefault(key, value)
        out.setdefault("gpu/util_min", out.get("gpu/util", math.nan))
        if "gpu/util" not in out and self._pynvml is not None:
            # a window shorter than the driver's sampling period (the first one) has no buffered sample yet
            rates = self._poll_rates()
            if rates is not None:
                out["gpu/util"] = out["gpu/util_min"] = rates[0]
                out.setdefault("gpu/mem_util", rates[1])
        power = self._power_from_energy(mark, last)
        if power is not None:
            out["gpu/power_w"] = power
        if math.isfinite(self._mem_total_gb):
            out["gpu/mem_total_gb"] = self._mem_total_gb
        return {k: out[k] for k in GPU_KEYS if k in out and not math.isnan(out[k])}

    def _power_from_energy(
        self, mark: tuple[float, float] | None, last: tuple[float, float] | None
    ) -> float | None:
        """Mean watts between two energy readings; the previous window's where no newer one came."""
        if mark is not None and last is not None and last[0] > mark[0] and last[1] >= mark[1]:
            self._energy_power = (last[1] - mark[1]) / 1000.0 / (last[0] - mark[0])
        return self._energy_power
