"""``NVMLSampler`` on a real GPU: GPU-Util reads busy during a matmul loop and idle during a sleep."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.gpu


def _busy_for(a: torch.Tensor, seconds: float) -> None:
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        for _ in range(8):
            torch.matmul(a, a, out=a).clamp_(-1, 1)
        torch.cuda.synchronize(a.device)


def test_gpu_util_reads_busy_then_idle() -> None:
    pytest.importorskip("pynvml")
    from lightning_gpuopt.observe.nvml import NVMLSampler, nvml_device_index

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    with NVMLSampler(nvml_device_index(a.device), period_s=0.1) as sampler:
        _busy_for(a, 1.0)  # clocks up; not part of the window
        sampler.window()
        _busy_for(a, 3.0)
        busy = sampler.window()
        time.sleep(1.0)  # the driver's utilisation average falls
        sampler.window()
        time.sleep(3.0)
        idle = sampler.window()
        gpm = sampler.gpm_active  # stop() clears it
    # measured on an H200 (2026-11-29): 98% busy (SM active 94.8%), 0% idle
    assert busy["gpu/util"] >= 90.0, busy
    assert idle["gpu/util"] <= 10.0, idle
    if gpm:
        assert busy["gpu/sm_active"] > 50.0 > idle.get("gpu/sm_active", 0.0), (busy, idle)
