"""Host cost of ``NVTXRanges`` per training step, without a profiler and without a GPU.

Drives the callback's hooks in the order Lightning 2.x calls them in one automatic-optimization step::

    on_train_batch_start -> training_step (forward) -> on_before_zero_grad -> on_before_backward
    -> on_after_backward -> on_before_optimizer_step -> (global_step += 1) -> on_train_batch_end

with a forward through a ResNet-50-shaped tree of pass-through modules (torchvision's layout: stem, 16
bottlenecks with a shared ReLU called three times, downsample branches, head: 158 leaf calls a step), so
module ranges cost what the hooks themselves cost and nothing else.

Two ways to call the hooks:

* ``direct``: the callback's methods are called directly (the callback's own cost).
* ``lightning``: through ``lightning.pytorch.trainer.call._call_callback_hooks`` on a real ``Trainer``, so
  Lightning's per-callback dispatch (profiler context, hook-name f-string) is included; the baseline is the
  same Trainer without the callback.

Two states of the ``nvtx`` package backend:

* ``idle``: no tool attached, the package hands out a ``DummyDomain`` (an unprofiled run).
* ``live``: a real ``nvtx.Domain`` whose C calls reach NVTX's no-op stubs: the callback's Python cost when a
  profiler is attached, minus what the profiler itself spends per call.

Each sample times ``--steps`` steps with ``time.perf_counter_ns``; configurations rotate inside every
repeat and the overhead is the median over repeats of (configuration - baseline of the same repeat).

    PYTHONPATH=. python benchmarks/cpu_nvtx_hooks.py --out benchmarks/results/nvtx_hooks_cpu.json
    PYTHONPATH=. python benchmarks/cpu_nvtx_hooks.py --quick      # few samples; writes to the temp folder

``--compare OLD.py`` also measures another version of the callback in the same repeats (rows
``compare:...``), which resolves a before/after difference on a loaded machine::

    git show HEAD~1:lightning_gpuopt/observe/nvtx.py > /tmp/nvtx_before.py
    PYTHONPATH=. python benchmarks/cpu_nvtx_hooks.py --compare /tmp/nvtx_before.py
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from _shared import quick_out  # noqa: E402
from lightning.pytorch.trainer import call  # noqa: E402
from lightning.pytorch.trainer.states import TrainerFn  # noqa: E402
from torch import nn  # noqa: E402

#: the step the overhead is expressed against: ResNet-50, batch 256, 16-mixed on one H200 (gpu_nvtx.py times it)
STEP_MS_H200 = 45.0


# ------------------------------------------------------------------------------- ResNet-50-shaped tree
class Bottleneck(nn.Module):
    def __init__(self, downsample: bool) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Identity(), nn.Identity()
        self.conv2, self.bn2 = nn.Identity(), nn.Identity()
        self.conv3, self.bn3 = nn.Identity(), nn.Identity()
        self.relu = nn.Identity()
        self.downsample = nn.Sequential(nn.Identity(), nn.Identity()) if downsample else None

    def forward(self, x: Any) -> Any:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        del identity  # shape only: no add, so the leaves stay pass-through
        return self.relu(out)


class ResNet50Shape(nn.Module):
    """torchvision's resnet50 module tree with pass-through leaves (126 leaf modules, 158 leaf calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1, self.relu, self.maxpool = (
            nn.Identity(),
            nn.Identity(),
            nn.Identity(),
            nn.Identity(),
        )
        for i, blocks in enumerate((3, 4, 6, 3), start=1):
            setattr(self, f"layer{i}", nn.Sequential(*[Bottleneck(b == 0) for b in range(blocks)]))
        self.avgpool, self.fc = nn.Identity(), nn.Identity()

    def forward(self, x: Any) -> Any:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x))


class Wrapper(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = ResNet50Shape()

    def forward(self, x: Any) -> Any:
        return self.model(x)


def count_calls(module: nn.Module, x: Any) -> tuple[int, int]:
    leaves = [m for m in module.modules() if not list(m.children())]
    calls = [0]
    handles = [m.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for m in leaves]
    module(x)
    for h in handles:
        h.remove()
    return len(leaves), calls[0]


# ------------------------------------------------------------------------------------------ drivers
def load_compare(path: str) -> Any:
    """Another version of nvtx.py (e.g. ``git show HEAD~1:lightning_gpuopt/observe/nvtx.py > old.py``)."""
    spec = importlib.util.spec_from_file_location("nvtx_compare", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--compare {path!r} is not a Python file; give the path of another nvtx.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.NVTXRanges


def make_callback(config: str, compare: Any = None) -> Any:
    from lightning_gpuopt.observe.nvtx import NVTXRanges

    if config.startswith("compare:"):
        NVTXRanges, config = compare, config.split(":", 1)[1]
    if config == "none":
        return None
    if config == "steps_only":
        cb = NVTXRanges(phases=False, backend="nvtx")
    elif config == "phases":
        cb = NVTXRanges(backend="nvtx")
    else:
        cb = NVTXRanges(module_depth=int(config[-1]), module_root="model", backend="nvtx")
    return cb


def live_domain(name: str) -> Any:
    """A real ``nvtx.Domain`` although no tool is attached: its C calls reach NVTX's no-op stubs."""
    import nvtx

    domain = object.__new__(nvtx.Domain)
    domain.handle = nvtx._lib.lib.DomainHandle(name)
    nvtx.Domain.__init__(domain, name)
    return domain


@contextlib.contextmanager
def backend_state(state: str) -> Iterator[None]:
    """``live``: ``nvtx.get_domain`` hands out ``live_domain`` while the callback builds its backend."""
    import nvtx

    if state != "live":
        yield
        return
    original = nvtx.get_domain
    nvtx.get_domain = live_domain
    try:
        yield
    finally:
        nvtx.get_domain = original


class Direct:
    """Calls the callback's hooks itself, with a stand-in trainer."""

    def __init__(self, cb: Any, module: Wrapper) -> None:
        self.cb, self.module = cb, module
        self.trainer = SimpleNamespace(
            global_step=0, state=SimpleNamespace(fn=TrainerFn.FITTING), sanity_checking=False
        )

    def start(self) -> None:
        if self.cb is not None:
            self.cb.setup(self.trainer, self.module, "fit")

    def begin(self) -> None:
        if self.cb is not None:
            self.cb.on_fit_start(self.trainer, self.module)
            self.cb.on_train_epoch_start(self.trainer, self.module)

    def run(self, steps: int, x: Any, opt: Any) -> int:
        cb, trainer, module = self.cb, self.trainer, self.module
        if cb is None:
            t0 = time.perf_counter_ns()
            for _ in range(steps):
                module(x)
                trainer.global_step += 1
            return time.perf_counter_ns() - t0
        batch = (x, x)
        t0 = time.perf_counter_ns()
        for i in range(steps):
            cb.on_train_batch_start(trainer, module, batch, i)
            loss = module(x)
            cb.on_before_zero_grad(trainer, module, opt)
            cb.on_before_backward(trainer, module, loss)
            cb.on_after_backward(trainer, module)
            cb.on_before_optimizer_step(trainer, module, opt)
            trainer.global_step += 1
            cb.on_train_batch_end(trainer, module, loss, batch, i)
        return time.perf_counter_ns() - t0

    def end(self) -> None:
        if self.cb is not None:
            self.cb.on_train_epoch_end(self.trainer, self.module)
            self.cb.teardown(self.trainer, self.module, "fit")


class ViaLightning(Direct):
    """Calls the hooks through Lightning's ``_call_callback_hooks`` on a real Trainer."""

    def __init__(self, cb: Any, module: Wrapper) -> None:
        super().__init__(cb, module)
        trainer = pl.Trainer(
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            callbacks=[] if cb is None else [cb],
        )
        trainer.strategy._lightning_module = module
        module.trainer = trainer
        trainer.state.fn = TrainerFn.FITTING
        self.trainer = trainer
        self._progress = (
            trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
        )

    def run(self, steps: int, x: Any, opt: Any) -> int:
        trainer, module, progress, hook = self.trainer, self.module, self._progress, call._call_callback_hooks
        batch = (x, x)
        t0 = time.perf_counter_ns()
        for i in range(steps):
            hook(trainer, "on_train_batch_start", batch, i)
            loss = module(x)
            hook(trainer, "on_before_zero_grad", opt)
            hook(trainer, "on_before_backward", loss)
            hook(trainer, "on_after_backward")
            hook(trainer, "on_before_optimizer_step", opt)
            progress.completed += 1  # what trainer.global_step reads
            hook(trainer, "on_train_batch_end", loss, batch, i)
        return time.perf_counter_ns() - t0


def measure(
    mode: str, state: str, configs: list[str], steps: int, repeats: int, compare: Any = None
) -> dict[str, dict[str, Any]]:
    x = torch.zeros(1)
    opt = object()
    drivers = {}
    for c in configs:
        module = Wrapper()
        cb = make_callback(c, compare)
        driver = (Direct if mode == "direct" else ViaLightning)(cb, module)
        with backend_state(state):
            driver.start()
        if cb is not None and (
            cb.ranges.backend.name != "nvtx" or cb.ranges.backend._live != (state == "live")
        ):
            raise RuntimeError(
                f"the callback's NVTX backend is not the {state} nvtx package one; is nvtx installed?"
            )
        driver.begin()
        driver.run(steps, x, opt)  # warm-up: attribute caches, registered strings
        drivers[c] = driver
    samples: dict[str, list[float]] = {c: [] for c in configs}
    gc.collect()
    gc.disable()
    try:
        for r in range(repeats):
            order = configs[r % len(configs) :] + configs[: r % len(configs)]
            for c in order:
                samples[c].append(drivers[c].run(steps, x, opt) / steps / 1000.0)  # µs per step
    finally:
        gc.enable()
    for d in drivers.values():
        if d.cb is not None:
            d.cb.ranges.close_all()  # balance check below needs an empty stack
            d.end()
    base = samples["none"]
    out = {}
    for c in configs:
        diffs = [s - b for s, b in zip(samples[c], base, strict=True)]
        q = statistics.quantiles(diffs, n=4) if len(diffs) >= 4 else [min(diffs), 0, max(diffs)]
        out[c] = {
            "step_us": statistics.median(samples[c]),
            "overhead_us": statistics.median(diffs),
            "overhead_iqr_us": q[2] - q[0],
        }
    return out


def main() -> int:
    from lightning_gpuopt._common import format_table
    from lightning_gpuopt.bench.measure import write_results

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/nvtx_hooks_cpu.json")
    p.add_argument("--steps", type=int, default=50, help="steps a sample")
    p.add_argument("--repeats", type=int, default=61, help="samples a configuration (median kept)")
    p.add_argument("--modes", default="direct,lightning")
    p.add_argument("--states", default="idle,live")
    p.add_argument("--label", default="", help="stored with the results (e.g. before/after)")
    p.add_argument(
        "--compare",
        default=None,
        help="path of another nvtx.py whose NVTXRanges is measured in the same repeats (rows 'compare:...')",
    )
    p.add_argument("--quick", action="store_true", help="few samples, to prove the script works")
    args = p.parse_args()
    args.out = quick_out(args.out, p.get_default("out"), args.quick)
    if args.quick:
        args.steps, args.repeats = 10, 3
    import logging
    import warnings

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_grad_enabled(False)
    leaves, calls = count_calls(ResNet50Shape(), torch.zeros(1))
    configs = ["none", "steps_only", "phases", "modules_depth1", "modules_depth2", "modules_depth3"]
    compare = load_compare(args.compare) if args.compare else None
    extra = [f"compare:{c}" for c in configs[1:]] if compare is not None else []
    rows = []
    for mode in args.modes.split(","):
        for state in args.states.split(","):
            res = measure(mode, state, configs + extra, args.steps, args.repeats, compare)
            for c in configs + extra:
                rows.append(
                    {
                        "name": f"{mode}/{state}/{c}",
                        "mode": mode,
                        "backend_state": state,
                        "config": c,
                        **res[c],
                        "pct_of_45ms_step": res[c]["overhead_us"] / (STEP_MS_H200 * 1000.0) * 100.0,
                    }
                )
            print(f"{mode}/{state} done", file=sys.stderr, flush=True)
    path = write_results(
        args.out,
        rows,
        benchmark="nvtx_hooks_cpu",
        label=args.label,
        compare=args.compare,
        quick=args.quick,
        steps_per_sample=args.steps,
        repeats=args.repeats,
        leaf_modules=leaves,
        leaf_calls_per_step=calls,
        reference_step_ms=STEP_MS_H200,
        nvtx_backend="nvtx",
        timer="time.perf_counter_ns, gc disabled while timing; overhead = median over repeats of (config - none)",
    )
    cols = ["name", "step_us", "overhead_us", "overhead_iqr_us", "pct_of_45ms_step"]
    print(f"{leaves} leaf modules, {calls} leaf calls a step; wrote {path}")
    print(format_table(rows, cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
