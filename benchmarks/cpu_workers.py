"""num_workers on this CPU machine: 0 vs tuned vs a sweep, through Lightning's Trainer (small model, small images).

The same measurement as ``benchmarks/gpu_workers.py`` with CPU-sized defaults: the built-in small ResNet,
fp32, 32x32 crops of 64x48 JPEGs, batch 32, a sweep over 1..CPUs workers. On a CPU the model and the
workers share the same cores, so more workers can only help as far as decoding, not compute, is the limit.

    PYTHONPATH=. python benchmarks/cpu_workers.py --out benchmarks/results/workers_cpu.json
    PYTHONPATH=. python benchmarks/cpu_workers.py --quick      # tiny: proves the script works
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_workers import main

from lightning_gpuopt._common import available_cpus

CPU_DEFAULTS = dict(
    data="/tmp/gpuopt_data/cpu_2048_64x48",
    images=2048,
    classes=10,
    image_wh=(64, 48),
    model="small",
    batch_size=32,
    image_size=32,
    steps=15,
    warmup=3,
    zero_steps=10,
    sweep=",".join(str(n) for n in sorted({1, 2, max(1, available_cpus() // 2), available_cpus()})),
    tune_budget=10.0,
    budget=400.0,
)

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:], defaults=CPU_DEFAULTS, out="benchmarks/results/workers_cpu.json"))
