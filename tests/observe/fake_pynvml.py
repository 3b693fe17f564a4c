"""A stand-in for the ``pynvml`` module (nvidia-ml-py) with plausible answers, for CPU tests.

Only NVML's boundary is faked: the code under test imports it as ``pynvml`` (tests put it in ``sys.modules``).
The driver's utilisation sample buffer is imitated: a new sample every ``sample_every_s`` of wall time, valued
at the ``util`` set when it was taken, and ``nvmlDeviceGetSamples`` returns the ones newer than the timestamp
asked for (``NVMLError_NotFound`` when there are none), as the real driver does. The energy counter
(``nvmlDeviceGetTotalEnergyConsumption``, mJ) grows at the ``power_mw`` set at each moment. ``missing`` names
functions the module lacks (an older nvidia-ml-py: ``AttributeError``), ``fails`` maps a function's name to
the error it raises (``NVMLError_NotSupported`` from a GPU without the engine, ``NVMLError_FunctionNotFound``
from an older driver).
"""

from __future__ import annotations

import threading
import time
import types
from dataclasses import dataclass, field


class NVMLError(Exception):
    value = 999

    def __init__(self, value: int | None = None) -> None:
        super().__init__(value)
        if value is not None:
            self.value = value


def _error(name: str, code: int) -> type[NVMLError]:
    return type(f"NVMLError_{name}", (NVMLError,), {"value": code})


NVMLError_Uninitialized = _error("Uninitialized", 1)
NVMLError_NotSupported = _error("NotSupported", 3)
NVMLError_NoPermission = _error("NoPermission", 4)
NVMLError_NotFound = _error("NotFound", 6)
NVMLError_LibraryNotFound = _error("LibraryNotFound", 12)
NVMLError_FunctionNotFound = _error("FunctionNotFound", 13)


@dataclass
class FakeGPU:
    uuid: str
    util: float = 0.0
    mem_util: float = 0.0
    mem_used: int = 10 * 1024**3
    mem_total: int = 80 * 1024**3
    power_mw: int = 250_000
    temp_c: int = 45
    sm_clock: int = 1980
    gpm: bool = True
    sm_active: float = 71.0
    sm_occupancy: float = 10.0
    tensor_active: float = 69.0
    jpeg_util: float = 0.0
    dec_util: float = 0.0
    samples: list[tuple[int, float, float]] = field(default_factory=list)  # (ts_us, util, mem_util)
    last_gen: float = 0.0
    energy_mj: float = 1.0e9  # since the driver loaded
    energy_t: float = field(default_factory=time.monotonic)

    def energy(self) -> float:
        """The counter now (mJ, unrounded: a window of a test lasts milliseconds): it grew at the power drawn
        since the last look."""
        now = time.monotonic()
        self.energy_mj += self.power_mw * (now - self.energy_t)
        self.energy_t = now
        return self.energy_mj


class _Obj(types.SimpleNamespace):
    pass


class _Value:
    def __init__(self, v: float) -> None:
        self.uiVal = int(v)
        self.dVal = float(v)


class _Sample:
    def __init__(self, ts: int, v: float) -> None:
        self.timeStamp = ts
        self.sampleValue = _Value(v)


class _Metric:
    def __init__(self) -> None:
        self.metricId = 0
        self.nvmlReturn = 0
        self.value = 0.0


class FakeNVML:
    """State of the fake driver; ``module()`` returns the ``pynvml``-like module backed by it."""

    def __init__(
        self,
        uuids: list[str],
        *,
        library: bool = True,
        buffer: bool = True,
        sample_every_s: float = 0.01,
        missing: tuple[str, ...] = (),
        fails: dict[str, type[NVMLError]] | None = None,
    ):
        self.gpus = [FakeGPU(u) for u in uuids]
        self.missing = missing
        self.fails = dict(fails or {})
        self.library = library
        self.buffer = buffer
        self.sample_every_s = sample_every_s
        self.refcount = 0
        self.init_calls = 0
        self.gpm_allocated = 0
        self.lock = threading.Lock()

    # helpers for tests
    def set(self, index: int, **values: float) -> None:
        with self.lock:
            self._generate(self.gpus[index])
            self.gpus[index].energy()  # the counter grew at the old power until now
            for k, v in values.items():
                setattr(self.gpus[index], k, v)

    def _generate(self, gpu: FakeGPU) -> None:
        now = time.monotonic()
        if gpu.last_gen == 0.0:
            gpu.last_gen = now
            return
        while now - gpu.last_gen >= self.sample_every_s:
            gpu.last_gen += self.sample_every_s
            gpu.samples.append((int(gpu.last_gen * 1e6), gpu.util, gpu.mem_util))
        del gpu.samples[:-200]  # the driver keeps a bounded history

    def _failing(self, fn):  # type: ignore[no-untyped-def]
        error = self.fails[fn.__name__]

        def failing(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise error()

        failing.__name__ = fn.__name__
        return failing

    def module(self) -> types.ModuleType:
        m = types.ModuleType("pynvml")
        fake = self
        consts = {
            "NVML_SUCCESS": 0,
            "NVML_GPU_UTILIZATION_SAMPLES": 1,
            "NVML_MEMORY_UTILIZATION_SAMPLES": 2,
            "NVML_VALUE_TYPE_DOUBLE": 0,
            "NVML_VALUE_TYPE_UNSIGNED_INT": 1,
            "NVML_VALUE_TYPE_UNSIGNED_LONG": 2,
            "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG": 3,
            "NVML_VALUE_TYPE_SIGNED_LONG_LONG": 4,
            "NVML_TEMPERATURE_GPU": 0,
            "NVML_CLOCK_SM": 1,
            "NVML_GPM_METRIC_SM_UTIL": 2,
            "NVML_GPM_METRIC_SM_OCCUPANCY": 3,
            "NVML_GPM_METRIC_ANY_TENSOR_UTIL": 5,
            "NVML_GPM_METRICS_GET_VERSION": 1,
        }
        for k, v in consts.items():
            setattr(m, k, v)
        for cls in (
            NVMLError,
            NVMLError_Uninitialized,
            NVMLError_NotSupported,
            NVMLError_NoPermission,
            NVMLError_NotFound,
            NVMLError_LibraryNotFound,
            NVMLError_FunctionNotFound,
        ):
            setattr(m, cls.__name__, cls)

        def check() -> None:
            if fake.refcount <= 0:
                raise NVMLError_Uninitialized()

        def gpu(handle: _Obj) -> FakeGPU:
            check()
            return fake.gpus[handle.index]

        def nvmlInit() -> None:
            if not fake.library:
                raise NVMLError_LibraryNotFound()
            fake.refcount += 1
            fake.init_calls += 1

        def nvmlShutdown() -> None:
            check()
            fake.refcount -= 1

        def nvmlDeviceGetCount() -> int:
            check()
            return len(fake.gpus)

        def nvmlDeviceGetHandleByIndex(i: int) -> _Obj:
            check()
            if not 0 <= i < len(fake.gpus):
                raise NVMLError(2)  # NVML_ERROR_INVALID_ARGUMENT
            return _Obj(index=i)

        def nvmlDeviceGetHandleByUUID(uuid: str | bytes) -> _Obj:
            check()
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            for i, g in enumerate(fake.gpus):
                if g.uuid == uuid:
                    return _Obj(index=i)
            raise NVMLError_NotFound()

        def nvmlDeviceGetIndex(h: _Obj) -> int:
            check()
            return h.index

        def nvmlDeviceGetUUID(h: _Obj) -> str:
            return gpu(h).uuid

        def nvmlDeviceGetMemoryInfo(h: _Obj) -> _Obj:
            g = gpu(h)
            return _Obj(total=g.mem_total, used=g.mem_used, free=g.mem_total - g.mem_used)

        def nvmlDeviceGetPowerUsage(h: _Obj) -> int:
            return gpu(h).power_mw

        def nvmlDeviceGetTotalEnergyConsumption(h: _Obj) -> float:
            g = gpu(h)
            with fake.lock:
                return g.energy()

        def nvmlDeviceGetJpgUtilization(h: _Obj) -> list[int]:
            return [int(gpu(h).jpeg_util), 166_666]  # [%, sampling period in us]

        def nvmlDeviceGetDecoderUtilization(h: _Obj) -> list[int]:
            return [int(gpu(h).dec_util), 166_666]

        def nvmlDeviceGetTemperature(h: _Obj, sensor: int) -> int:
            return gpu(h).temp_c

        def nvmlDeviceGetClockInfo(h: _Obj, kind: int) -> int:
            return gpu(h).sm_clock

        def nvmlDeviceGetUtilizationRates(h: _Obj) -> _Obj:
            g = gpu(h)
            return _Obj(gpu=int(g.util), memory=int(g.mem_util))

        def nvmlDeviceGetSamples(h: _Obj, kind: int, last_ts: int) -> tuple[int, list[_Sample]]:
            g = gpu(h)
            if not fake.buffer:
                raise NVMLError_NotSupported()
            with fake.lock:
                fake._generate(g)
                col = 1 if kind == 1 else 2
                out = [_Sample(s[0], s[col]) for s in g.samples if s[0] > last_ts]
            if not out:
                raise NVMLError_NotFound()
            return 1, out

        def nvmlGpmQueryDeviceSupport(h: _Obj) -> _Obj:
            return _Obj(version=1, isSupportedDevice=int(gpu(h).gpm))

        def nvmlGpmSampleAlloc() -> _Obj:
            check()
            fake.gpm_allocated += 1
            return _Obj(t=None, index=None)

        def nvmlGpmSampleFree(s: _Obj) -> None:
            fake.gpm_allocated -= 1

        def nvmlGpmSampleGet(h: _Obj, s: _Obj) -> _Obj:
            gpu(h)
            s.t = time.monotonic()
            s.index = h.index
            return s

        class c_nvmlGpmMetricsGet_t:  # named as in pynvml
            def __init__(self) -> None:
                self.version = 0
                self.numMetrics = 0
                self.sample1: _Obj | None = None
                self.sample2: _Obj | None = None
                self.metrics = [_Metric() for _ in range(8)]

        def nvmlGpmMetricsGet(q: c_nvmlGpmMetricsGet_t) -> c_nvmlGpmMetricsGet_t:
            check()
            if q.version != 1 or q.sample1 is None or q.sample2 is None or q.sample1.t is None:
                raise NVMLError(2)
            g = fake.gpus[q.sample2.index]
            values = {2: g.sm_active, 3: g.sm_occupancy, 5: g.tensor_active}
            for metric in q.metrics[: q.numMetrics]:
                metric.value = values.get(metric.metricId, 0.0)
                metric.nvmlReturn = 0 if metric.metricId in values else 3
            return q

        for fn in (
            nvmlInit,
            nvmlShutdown,
            nvmlDeviceGetCount,
            nvmlDeviceGetHandleByIndex,
            nvmlDeviceGetHandleByUUID,
            nvmlDeviceGetIndex,
            nvmlDeviceGetUUID,
            nvmlDeviceGetMemoryInfo,
            nvmlDeviceGetPowerUsage,
            nvmlDeviceGetTotalEnergyConsumption,
            nvmlDeviceGetJpgUtilization,
            nvmlDeviceGetDecoderUtilization,
            nvmlDeviceGetTemperature,
            nvmlDeviceGetClockInfo,
            nvmlDeviceGetUtilizationRates,
            nvmlDeviceGetSamples,
            nvmlGpmQueryDeviceSupport,
            nvmlGpmSampleAlloc,
            nvmlGpmSampleFree,
            nvmlGpmSampleGet,
            nvmlGpmMetricsGet,
        ):
            if fn.__name__ not in fake.missing:
                setattr(m, fn.__name__, fake._failing(fn) if fn.__name__ in fake.fails else fn)
        m.c_nvmlGpmMetricsGet_t = c_nvmlGpmMetricsGet_t  # type: ignore[attr-defined]
        return m


UUIDS = [
    "GPU-11111111-aaaa-bbbb-cccc-000000000000",
    "GPU-22222222-aaaa-bbbb-cccc-000000000001",
    "GPU-22223333-aaaa-bbbb-cccc-000000000002",
    "GPU-44444444-aaaa-bbbb-cccc-000000000003",
]


def install(monkeypatch, **kwargs) -> FakeNVML:  # type: ignore[no-untyped-def]
    """Put a fake ``pynvml`` with four GPUs into ``sys.modules`` for this test."""
    import sys

    fake = FakeNVML(list(UUIDS), **kwargs)
    monkeypatch.setitem(sys.modules, "pynvml", fake.module())
    return fake
