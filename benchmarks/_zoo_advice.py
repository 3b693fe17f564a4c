"""The monitor, NVTX ranges and the advisor on a model of the zoo (``models.py --advise``).

After a model's turns, three short fits of the same user's module (``_zoo.ZooModule``, its compiled forward
kept), each with ``GPUStatsMonitor`` first, ``NVTXRanges`` and ``BottleneckAdvisor`` judging the monitor's
windows after one of warm-up:

    healthy   the preset on the model's batch kept on the GPU: no warning may be raised
    starved   the preset fed by the same batch from a loader that waits ``STARVE`` times the preset's
              median step before each batch (on the training thread, as a slow loader's host work does):
              ``input-bound``
    fp32      a plain ``Trainer(precision="32-true")`` on the resident batch: ``fp32-on-tensor-cores``

Each scenario's verdicts, whether the expected one is among them (``pass``; null where it rests on GPU
readings and the run has no GPU), the monitor's means and the step times go into the model's row under
``advisor``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from _shared import free, measured_fit

from lightning_gpuopt import BottleneckAdvisor, GPUStatsMonitor, NVTXRanges
from lightning_gpuopt.bench.rows import DeviceBatches

#: the starved loader's wait before each batch, in preset median steps: the GPU idles about 2/3 of the time
STARVE = 2.0


@dataclass(frozen=True)
class Scenario:
    """One fit of a zoo model with one known problem; ``expected``: the verdict kind (``None``: no warning)."""

    name: str
    expected: str | None
    preset: bool = True
    precision: str | None = None
    starve: bool = False
    gpu_only: bool = True  # the verdict rests on GPU readings: a CPU run only shows the scenario runs


SCENARIOS = (
    Scenario("healthy", None, gpu_only=False),
    Scenario("starved", "input-bound", starve=True, gpu_only=False),
    Scenario("fp32", "fp32-on-tensor-cores", preset=False, precision="32-true"),
)


class SlowBatches(DeviceBatches):
    """``DeviceBatches`` that wait ``delay_s`` before handing over each batch (a loader slower than the model)."""

    def __init__(self, x: torch.Tensor, labels: list[torch.Tensor], length: int, delay_s: float) -> None:
        super().__init__(x, labels, length)
        self.delay_s = delay_s

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in super().__iter__():
            time.sleep(self.delay_s)
            yield batch


def judge(sc: Scenario, raised: list[Any], cuda: bool) -> bool | None:
    """Whether the scenario got what it should: no warning when healthy, else its verdict among those raised."""
    if sc.gpu_only and not cuda:
        return None
    if sc.expected is None:
        return not [v for v in raised if v.severity == "warning"]
    return any(v.kind == sc.expected for v in raised)


def advise(
    module: pl.LightningModule,
    x: torch.Tensor,
    ys: list[torch.Tensor],
    step_ms: float | None,
    *,
    device: str,
    window: int,
    run: dict[str, Any],
    length: int,
) -> dict[str, Any]:
    """The three scenarios on ``module``: each a fit of two warm-up windows (the compile rule's eager steps
    and its compile) and three judged ``window``-step windows.

    ``step_ms`` is the preset's median step (the starved loader waits ``STARVE`` of them; ``None``: the
    healthy fit's, measured first); ``run`` holds the model's long-run ``Trainer`` arguments and ``length``
    its loader's batches an epoch (the preset judges that run; the fit is stopped after the windows)."""
    cuda = device == "cuda"
    out: dict[str, Any] = {}
    for sc in SCENARIOS:
        monitor = GPUStatsMonitor(log_every_n_steps=window, sample_period_s=0.05, ceiling=cuda)
        advisor = BottleneckAdvisor(warmup_steps=2 * window, window_steps=None, min_windows=2, verbose=False)
        callbacks: list[pl.Callback] = [monitor, NVTXRanges(), advisor]  # monitor first: its windows in time
        wait_ms = step_ms or out.get("healthy", {}).get("p50_ms") or 0.0  # a failed healthy fit: no wait
        delay = STARVE * wait_ms / 1000 if sc.starve else 0.0
        loader = SlowBatches(x, ys, length, delay) if sc.starve else DeviceBatches(x, ys, length=length)
        trainer = {**run, **({} if sc.preset else {"precision": sc.precision})}
        if cuda:
            torch.cuda.reset_peak_memory_stats()  # memory-headroom reads this scenario's peak
        t0 = time.perf_counter()
        try:
            m = measured_fit(module, 2 * window, 3 * window, device=device, preset=sc.preset, compile=None,
                             callbacks=callbacks, trainer=trainer, train_dataloaders=loader)  # fmt: skip
        except Exception as err:  # a scenario that fails is recorded; the others still run
            out[sc.name] = {"error": f"{type(err).__name__}: {str(err)[:300]}", "pass": False}
            continue
        finally:
            free()
        raised = advisor.verdicts
        means = monitor.summary()
        out[sc.name] = {
            "expected": sc.expected or "no warning",
            "got": [v.label for v in raised],
            "pass": judge(sc, raised, cuda),
            "samples_per_sec": m.samples_per_sec, "p50_ms": m.p50_ms, "p90_ms": m.p90_ms,
            "loader_delay_ms": round(delay * 1000, 2),
            "gpu_util_mean": means.get("gpu/util"), "gpu_idle_frac": means.get("gpu/idle_frac"),
            "data_wait_frac": means.get("time/data_wait_frac"), "ceiling_frac": means.get("gpu/ceiling_frac"),
            "verdicts": [v.to_dict() for v in raised],
            "seconds": round(time.perf_counter() - t0, 1),
        }  # fmt: skip
        print(f"  advise {sc.name:8s} pass={out[sc.name]['pass']} got={out[sc.name]['got']}", flush=True)
    return out
