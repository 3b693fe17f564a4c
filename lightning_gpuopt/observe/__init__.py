"""Watch what the GPU does: NVML sampling, stream idle time from CUDA events, host timing and CPU use
(``GPUStatsMonitor``), NVTX ranges for Nsight Systems, and the bottleneck advisor."""
