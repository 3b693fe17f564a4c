import time
import warnings
from types import SimpleNamespace

import pytest

from lightning_gpuopt.observe import nvml
from lightning_gpuopt.observe.nvml import (
    GPU_KEYS,
    NVMLSampler,
    normalize_uuid,
    nvml_device_index,
)
from tests.observe import fake_pynvml
from tests.observe.fake_pynvml import UUIDS, install


def test_index_is_matched_by_uuid_whatever_cuda_visible_devices_says(monkeypatch):
    # torch numbers the visible devices from 0; NVML all of them: the UUID is the name both share
    fake = install(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setattr(nvml, "_torch_device_uuid", lambda i: {0: UUIDS[3], 1: UUIDS[2]}[i])
    assert nvml_device_index("cuda:0") == 3
    assert nvml_device_index(1) == 2
    assert fake.refcount == 0 and fake.init_calls == 2  # every init is matched by a shutdown


def test_index_refuses_mig_a_cpu_device_and_what_it_cannot_match(monkeypatch):
    fake = install(monkeypatch)
    monkeypatch.setattr(nvml, "_torch_device_uuid", lambda i: "MIG-5c6a0a3f-0000")
    with pytest.raises(ValueError, match="MIG"):
        nvml_device_index(0)
    monkeypatch.setattr(nvml, "_torch_device_uuid", lambda i: "GPU-ffffffff-0000")
    with pytest.raises(ValueError, match=r"no NVML device has the UUID of CUDA device 0.*nvml_index"):
        nvml_device_index(0)
    assert fake.refcount == 0
    monkeypatch.setattr(nvml, "_torch_device_uuid", lambda i: None)
    with pytest.raises(ValueError, match="nvml_index"):
        nvml_device_index(0)
    with pytest.raises(ValueError, match="CUDA device"):
        nvml_device_index("cpu")


def test_sampler_windows_follow_the_load(monkeypatch):
    fake = install(monkeypatch, sample_every_s=0.01)
    fake.set(1, util=90.0, mem_util=40.0)
    sampler = NVMLSampler(1, period_s=0.02).start()
    try:
        assert sampler.running and sampler.uses_sample_buffer and sampler.gpm_active
        time.sleep(0.4)
        busy = sampler.window()
        fake.set(1, util=0.0, mem_util=0.0)
        time.sleep(0.2)  # the thread reads the samples taken before the switch ...
        sampler.window()  # ... into this window
        time.sleep(0.4)
        idle = sampler.window()
    finally:
        sampler.stop()
    assert not sampler.running
    assert fake.refcount == 0 and fake.gpm_allocated == 0  # NVML shut down, GPM buffers freed
    assert set(busy) == set(GPU_KEYS)
    assert busy["gpu/util"] == pytest.approx(90.0) and busy["gpu/util_min"] == pytest.approx(90.0)
    assert busy["gpu/mem_util"] == pytest.approx(40.0)
    assert busy["gpu/power_w"] == pytest.approx(250.0, rel=1e-3)  # the energy counter's mJ over the window
    assert busy["gpu/mem_used_gb"] == pytest.approx(10.0) and busy["gpu/mem_total_gb"] == pytest.approx(80.0)
    assert busy["gpu/temp_c"] == 45 and busy["gpu/sm_clock_mhz"] == 1980
    assert busy["gpu/sm_active"] == pytest.approx(71.0)
    assert busy["gpu/tensor_active"] == pytest.approx(69.0)
    assert busy["gpu/sm_occupancy"] == pytest.approx(10.0)
    # a window that starts after the switch holds only samples taken after it
    assert idle["gpu/util"] == 0.0 and idle["gpu/util_min"] == 0.0


def test_window_mean_and_min_over_the_window(monkeypatch):
    fake = install(monkeypatch, sample_every_s=0.01)
    clock = SimpleNamespace(now=1000.0)
    # the driver takes its samples on a clock the test moves: 0.1 s at 100%, then 0.1 s at 0%
    monkeypatch.setattr(fake_pynvml, "time", SimpleNamespace(monotonic=lambda: clock.now))
    sampler = NVMLSampler(0, period_s=100.0, gpm=False).start()  # thread samples once, then waits
    try:
        while "gpu/power_w" not in sampler.window():  # the thread's one reading: a window ends there
            time.sleep(0.01)
        fake.set(0, util=100.0)
        clock.now += 0.1
        fake.set(0, util=0.0)
        clock.now += 0.1
        sampler.sample_once()
        w = sampler.window()
        # no new sample since: the next window repeats the latest values instead of going blank
        clock.now += 0.1
        sampler.sample_once()
        again = sampler.window()
    finally:
        sampler.stop()
    assert 30.0 < w["gpu/util"] < 70.0
    assert w["gpu/util_min"] == 0.0
    assert "gpu/sm_active" not in w
    # power: the energy counter over the microseconds between the two readings (coarse, but there)
    assert again["gpu/util"] == 0.0 and again["gpu/power_w"] > 0


def test_fallback_to_polling_when_the_buffer_does_not_answer(monkeypatch):
    fake = install(monkeypatch, buffer=False)
    fake.set(0, util=55.0, mem_util=12.0)
    with NVMLSampler(0, period_s=100.0, gpm=False) as sampler:
        assert not sampler.uses_sample_buffer
        sampler.sample_once()
        w = sampler.window()
    assert w["gpu/util"] == 55.0 and w["gpu/mem_util"] == 12.0


def test_no_gpm_warns_once_and_goes_on(monkeypatch):
    fake = install(monkeypatch)
    for g in fake.gpus:
        g.gpm = False
    monkeypatch.setattr(nvml, "_GPM_WARNED", set())
    with pytest.warns(RuntimeWarning, match="GPM"), NVMLSampler(3, period_s=100.0) as sampler:
        assert not sampler.gpm_active
        time.sleep(0.05)
        sampler.sample_once()
        w = sampler.window()
    assert "gpu/util" in w and "gpu/sm_active" not in w
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second sampler on the same device stays quiet
        NVMLSampler(3, period_s=100.0).start().stop()


def test_missing_library_raises_and_releases(monkeypatch):
    fake = install(monkeypatch, library=False)
    import pynvml

    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        NVMLSampler(0).start()
    assert fake.refcount == 0


def test_sampler_stops_twice_and_validates(monkeypatch):
    install(monkeypatch)
    sampler = NVMLSampler(0, period_s=0.05).start()
    sampler.stop()
    sampler.stop()  # idempotent
    assert not sampler.running
    with pytest.raises(ValueError, match="period_s"):
        NVMLSampler(0, period_s=0)
    with pytest.raises(ValueError, match="index"):
        NVMLSampler(-1)


def test_window_shorter_than_the_driver_sample_period_still_reports_util(monkeypatch):
    # the driver buffer holds no sample yet (it fills every ~1/6 s on real GPUs): the first, short window
    # falls back to the driver's current reading instead of leaving gpu/util out
    fake = install(monkeypatch, sample_every_s=1000.0)
    fake.set(0, util=55.0, mem_util=20.0)
    sampler = NVMLSampler(0, period_s=100.0, gpm=False).start()
    try:
        with sampler._lock:
            sampler._stats.pop("gpu/util", None)
            sampler._latest.pop("gpu/util", None)
        window = sampler.window()
    finally:
        sampler.stop()
    assert window["gpu/util"] == pytest.approx(55.0) and window["gpu/util_min"] == pytest.approx(55.0)


def test_normalize_uuid_makes_torch_and_nvml_spellings_equal():
    bare = UUIDS[1].removeprefix("GPU-")
    assert normalize_uuid(UUIDS[1]) == normalize_uuid(bare) == bare
    assert normalize_uuid(UUIDS[1].upper().encode()) == bare  # bytes (older pynvml) and case
    assert normalize_uuid("MIG-ABC-1") == "MIG-abc-1"
    assert normalize_uuid("MIG-abc-1") != normalize_uuid("abc-1")


def test_torch_uuid_without_the_gpu_prefix_still_maps(monkeypatch):
    # torch spells the UUID bare; NVML with "GPU-": the monitor must still find its own GPU
    install(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(nvml, "_torch_device_uuid", lambda i: UUIDS[3].removeprefix("GPU-").upper())
    assert nvml_device_index(0) == 3
    with NVMLSampler(3, period_s=100.0, gpm=False) as sampler:
        assert sampler.uuid == normalize_uuid(UUIDS[3].removeprefix("GPU-"))


def test_power_is_the_energy_counter_over_the_window(monkeypatch):
    # a burst the power polls would miss: 500 W for the window, 100 W only at the moment of the reading
    fake = install(monkeypatch)
    fake.set(0, power_mw=500_000)
    sampler = NVMLSampler(0, period_s=100.0, gpm=False).start()  # thread samples once, then waits
    try:
        assert sampler.energy_counter
        time.sleep(0.1)
        fake.set(0, power_mw=100_000)
        sampler.sample_once()
        burst = sampler.window()
        time.sleep(0.05)
        sampler.sample_once()
        calm = sampler.window()
        same = sampler.window()  # no reading since: the latest window's power stands
    finally:
        sampler.stop()
    assert burst["gpu/power_w"] > 400.0  # a mean of the two polls would say 300
    assert calm["gpu/power_w"] == pytest.approx(100.0, rel=0.01)
    assert same["gpu/power_w"] == calm["gpu/power_w"]


def test_decoder_engines_are_read_where_nvml_answers(monkeypatch):
    fake = install(monkeypatch)
    fake.set(0, jpeg_util=98.0, dec_util=7.0)
    with NVMLSampler(0, period_s=100.0, gpm=False) as sampler:
        sampler.sample_once()
        w = sampler.window()
    assert w["gpu/jpeg_util"] == pytest.approx(98.0) and w["gpu/video_dec_util"] == pytest.approx(7.0)


def test_missing_functions_leave_their_keys_out_and_power_falls_back_to_polls(monkeypatch):
    import tests.observe.fake_pynvml as fp

    fake = install(
        monkeypatch,
        missing=("nvmlDeviceGetJpgUtilization",),  # an older nvidia-ml-py
        fails={
            "nvmlDeviceGetDecoderUtilization": fp.NVMLError_FunctionNotFound,  # an older driver
            "nvmlDeviceGetTotalEnergyConsumption": fp.NVMLError_NotSupported,  # a GPU without the counter
        },
    )
    fake.set(0, power_mw=200_000)
    with NVMLSampler(0, period_s=100.0, gpm=False) as sampler:
        time.sleep(0.05)  # the thread's own first reading
        sampler.window()
        sampler.sample_once()
        fake.set(0, power_mw=300_000)
        sampler.sample_once()
        w = sampler.window()
        asked = set(sampler._unsupported)
    assert not sampler.energy_counter
    assert w["gpu/power_w"] == pytest.approx(250.0)  # the mean of the two polls
    assert "gpu/jpeg_util" not in w and "gpu/video_dec_util" not in w and "gpu/util" in w
    assert asked >= {"gpu/jpeg_util", "gpu/video_dec_util", "gpu/energy_mj"}  # never asked again
