"""Watch what the GPU does: NVML sampling, GPU-Util/data-wait monitor, NVTX ranges, bottleneck advisor."""
