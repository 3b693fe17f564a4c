"""``FabricObserver``: the monitor, the advisor and NVTX ranges in a Lightning Fabric loop, on the CPU.

The example of docs/fabric.md is run as the page shows it (read from the page, so the two cannot drift).
"""

from __future__ import annotations

import csv
import re
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.nn import functional as F

from lightning_gpuopt import BottleneckAdvisor, GPUStatsMonitor, NVTXRanges
from lightning_gpuopt._common import _warnings
from lightning_gpuopt.data.loader import HostDataLoader
from lightning_gpuopt.observe import nvtx as nvtx_module
from lightning_gpuopt.observe.fabric import FabricObserver
from lightning_gpuopt.observe.host_cpu import CPU_KEYS
from lightning_gpuopt.observe.timing import CPU_WAIT_NOTE, HOST_KEYS, LOADER_KEY
from tests.observe.advisor_cases import SleepyImages, TinyClassifier, cpu_trainer

DOC = Path(__file__).resolve().parents[2] / "docs" / "fabric.md"
HOST = {*HOST_KEYS, *CPU_KEYS} if Path("/proc/self/stat").exists() else set(HOST_KEYS)
BUSY = "host/cpu_busy_frac"


@pytest.fixture(autouse=True)
def _fresh_warnings():
    """Warn-once is per process; each test starts as a fresh process would."""
    _warnings().clear()


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call; a Lightning logger, so a Trainer and a Fabric both take it."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))

    def monitor_rows(self) -> list[tuple[int | None, set[str]]]:
        """Each monitor row's step and keys, less the cores' busy share: that one is absent from a window
        in which the kernel's CPU counters did not tick (a window shorter than a clock tick)."""
        return [(step, set(m) - {BUSY}) for step, m in self.rows if "time/step_ms" in m]

    def busy_rows(self) -> int:
        return sum(BUSY in m for _, m in self.rows)


class TinyNet(nn.Module):
    """``TinyClassifier``'s network as a plain module (a LightningModule's own hooks would join fabric.call)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.head = nn.Linear(8 * 4 * 4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(F.adaptive_avg_pool2d(F.relu(self.conv(x)), 4), 1))


def _loader(delay_s: float = 0.0, n: int = 32) -> HostDataLoader:
    """Batches of 4 from a map-style dataset; keeps ``fetch_seconds`` (which the Trainer callbacks read)."""
    return HostDataLoader(SleepyImages(n, delay_s=delay_s), batch_size=4)


def _fabric_fit(
    observer: FabricObserver, loader: Any, steps: int, logger: Any = None, timed: bool = True
) -> Fabric:
    """A plain Fabric loop of ``steps`` batches calling the observer through ``fabric.call``."""
    fabric = Fabric(accelerator="cpu", devices=1, loggers=logger, callbacks=[observer])
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    batches = fabric.setup_dataloaders(loader)
    fabric.call("on_train_start", fabric=fabric, model=model, optimizers=optimizer)
    done = 0
    while done < steps:
        for batch in observer.timed(batches) if timed else batches:
            fabric.call("on_train_batch_start", batch=batch)
            x, y = batch
            loss = F.cross_entropy(model(x), y)
            fabric.call("on_before_backward")
            fabric.backward(loss)
            fabric.call("on_after_backward")
            fabric.call("on_before_optimizer_step")
            optimizer.step()
            fabric.call("on_before_zero_grad")
            optimizer.zero_grad()
            done += 1
            fabric.call("on_train_batch_end", batch=batch)
            if done == steps:
                break
    fabric.call("on_train_end")
    return fabric


def _docs_example() -> str:
    found = re.search(
        r"<!-- fabric-example:start -->\n```python\n(.*?)```\n<!-- fabric-example:end -->",
        DOC.read_text(),
        re.S,
    )
    assert found, f"{DOC} lost its marked example"
    return found.group(1)


def test_docs_example_runs_on_cpu(tmp_path, monkeypatch, caplog):
    """The monitor's one warning on a CPU also says what ``time/data_wait_frac`` holds there (the batch's
    transfer work runs on the training CPU), so a high data wait beside a small loader wait reads right."""
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "fabric_example"}
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("INFO"):
        warnings.simplefilter("always")
        exec(compile(_docs_example(), str(DOC), "exec"), namespace)
    said = [str(w.message) for w in caught if "GPUStatsMonitor" in str(w.message)]
    assert said == [
        "GPUStatsMonitor: the training device is 'cpu', not CUDA, so there is no GPU to measure; logging host "
        f"metrics only (pass gpu=False to silence this). {CPU_WAIT_NOTE}"
    ]
    monitor, advisor = namespace["monitor"], namespace["advisor"]
    assert len(monitor.history) == 6  # 12 steps in windows of 2
    assert advisor.windows >= 2 and "BottleneckAdvisor after" in caplog.text
    with open(tmp_path / "logs" / "lightning_logs" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    logged = [r for r in rows if r["time/step_ms"]]
    assert [int(r["step"]) for r in logged] == [1, 3, 5, 7, 9, 11]
    assert HOST | {LOADER_KEY} <= set(rows[0]) and not any(k.startswith("gpu/") for k in rows[0])
    assert all(float(r["throughput/samples_per_sec"]) > 0 for r in logged)
    assert [r for r in rows if r["advisor/input-bound"]], "the advisor logged no flags"


def test_monitor_rows_reach_fabrics_loggers_as_a_trainers(tmp_path):
    """The same monitor in a Trainer fit and in a Fabric loop: the same windows, keys and logger steps."""
    under_trainer = RecordingLogger()
    trainer_monitor = GPUStatsMonitor(log_every_n_steps=3, gpu=False)
    cpu_trainer(tmp_path, [trainer_monitor], steps=8, logger=under_trainer).fit(TinyClassifier(), _loader())
    under_fabric = RecordingLogger()
    fabric_monitor = GPUStatsMonitor(log_every_n_steps=3, gpu=False)
    _fabric_fit(FabricObserver(fabric_monitor), _loader(), steps=8, logger=under_fabric)
    expected = [(step, (HOST - {BUSY}) | {LOADER_KEY}) for step in (2, 5, 7)]
    assert under_trainer.monitor_rows() == expected
    assert under_fabric.monitor_rows() == expected
    if BUSY in HOST:  # the busy share comes through both, in the windows long enough to see a tick
        assert under_trainer.busy_rows() >= 1 and under_fabric.busy_rows() >= 1
    assert [w["step"] for w in fabric_monitor.history] == [2.0, 5.0, 7.0]
    assert all(0 < w[LOADER_KEY] <= w["time/data_wait_frac"] + 0.05 for w in fabric_monitor.history)
    # a loop that does not iterate through observer.timed: the data wait is still timed, the part inside the
    # loader is not guessed; without a logger the monitor says so once, at the user's line
    bare = GPUStatsMonitor(log_every_n_steps=3, gpu=False)
    with pytest.warns(UserWarning, match=r"^GPUStatsMonitor: the Fabric has no logger") as said:
        _fabric_fit(FabricObserver(bare), _loader(), steps=3, timed=False)
    assert said[0].filename == __file__
    assert len(bare.history) == 1 and LOADER_KEY not in bare.history[0]
    assert bare.history[0]["throughput/samples_per_sec"] > 0


def test_advisor_names_a_slow_loader_in_a_fabric_loop(tmp_path, caplog):
    advisor = BottleneckAdvisor(warmup_steps=2, window_steps=4, min_windows=2)
    logger = RecordingLogger()
    with caplog.at_level("INFO"):
        _fabric_fit(FabricObserver(advisor), _loader(delay_s=0.02, n=64), steps=14, logger=logger)
    assert advisor.windows == 3
    assert [(v.kind, v.cause) for v in advisor.verdicts] == [("input-bound", "too-few-workers")]
    assert advisor.verdicts[0].evidence["num_workers"] == 0  # read from the loader passed
    assert all(h["evidence"]["loader_wait_frac"] > 0.1 for h in advisor.history)
    assert advisor.config is not None and advisor.config.precision == "32-true"
    flags = [(step, m["advisor/input-bound"]) for step, m in logger.rows if "advisor/input-bound" in m]
    assert flags == [(6, 0.0), (10, 1.0), (14, 1.0)]
    assert "BottleneckAdvisor after 3 window(s)" in caplog.text and "too-few-workers" in caplog.text


class _ListBackend:
    """Records the NVTX calls (the range logic above it is what is tested)."""

    name = "list"
    enabled = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.threads: set[int] = set()

    def push(self, message: str, color: int, cache: bool = True) -> None:
        self.calls.append(("push", message))
        self.threads.add(threading.get_ident())

    def pop(self) -> None:
        self.calls.append(("pop", ""))

    def mark(self, message: str, color: int) -> None:
        self.calls.append(("mark", message))


def _tree(calls: list[tuple[str, str]]) -> list[str]:
    """Each pushed range as its path of enclosing names; fails on a pop without a push."""
    stack: list[str] = []
    paths = []
    for kind, message in calls:
        if kind == "push":
            stack.append(message)
            paths.append("/".join(stack))
        elif kind == "pop":
            assert stack, "a pop without a push"
            stack.pop()
    assert not stack, f"left open: {stack}"
    return paths


def test_nvtx_ranges_in_a_fabric_loop_balance_and_nest(monkeypatch):
    backend = _ListBackend()
    monkeypatch.setattr(nvtx_module, "make_backend", lambda *args, **kwargs: backend)
    ranges = NVTXRanges(module_depth=1)
    _fabric_fit(FabricObserver(ranges), _loader(n=8), steps=2)
    assert _tree(backend.calls) == [
        "data wait",
        "step 0",
        "step 0/forward",
        "step 0/forward/conv",
        "step 0/forward/head",
        "step 0/backward",
        "step 0/optimizer step",
        "step 0/zero_grad",
        "data wait",
        "step 1",
        "step 1/forward",
        "step 1/forward/conv",
        "step 1/forward/head",
        "step 1/backward",
        "step 1/optimizer step",
        "step 1/zero_grad",
        "data wait",  # after the last step, closed at on_train_end
    ]
    assert ranges.ranges is None  # released at on_train_end, module hooks removed with it


def test_validation_inside_the_loop_is_not_data_wait(monkeypatch):
    backend = _ListBackend()
    monkeypatch.setattr(nvtx_module, "make_backend", lambda *args, **kwargs: backend)
    monitor = GPUStatsMonitor(log_every_n_steps=2, gpu=False)
    observer = FabricObserver(monitor, NVTXRanges())
    observer.on_train_start(Fabric(accelerator="cpu", devices=1), nn.Linear(2, 2))
    batch = torch.zeros(4, 2)
    observer.on_train_batch_start(batch)
    observer.on_train_batch_end(batch)
    observer.on_validation_start()
    for i in range(2):
        observer.on_validation_batch_start(i)
        threading.Event().wait(0.05)  # validation work
        observer.on_validation_batch_end()
    observer.on_validation_end()
    observer.on_train_batch_start(batch)
    observer.on_train_batch_end(batch)
    observer.on_train_end()
    assert monitor.history[0]["time/data_wait_ms"] < 25.0  # the 100 ms of validation are not in it
    assert _tree(backend.calls)[:6] == [
        "data wait",
        "step 0",
        "step 0/forward",
        "data wait",  # closed where validation starts
        "validation",
        "validation/validation step 0",
    ]


def test_exception_releases_everything_and_calls_need_a_start(monkeypatch):
    monkeypatch.setattr(nvtx_module, "make_backend", lambda *args, **kwargs: _ListBackend())
    monitor, ranges = GPUStatsMonitor(gpu=False), NVTXRanges(module_depth=1)
    observer = FabricObserver(monitor, ranges)
    model = TinyNet()
    observer.on_train_start(Fabric(accelerator="cpu", devices=1), model)
    observer.on_train_batch_start(torch.zeros(2, 3, 16, 16))
    assert model.conv._forward_pre_hooks and ranges.ranges is not None and ranges.ranges.depth == 2
    observer.on_exception(RuntimeError("boom"))
    assert observer.loop is None and ranges.ranges is None and not model.conv._forward_pre_hooks
    assert monitor.history == []  # no last window after a failure
    with pytest.raises(RuntimeError, match=r"on_train_batch_end was called before on_train_start"):
        observer.on_train_batch_end(torch.zeros(2))


def test_state_dict_holds_the_step_and_each_observers_state():
    monitor, advisor = GPUStatsMonitor(log_every_n_steps=2, gpu=False), BottleneckAdvisor(verbose=False)
    observer = FabricObserver(monitor, advisor)
    fabric = Fabric(accelerator="cpu", devices=1)
    observer.on_train_start(fabric, nn.Linear(2, 2))
    for _ in range(4):
        observer.on_train_batch_start(torch.zeros(1, 2))
        observer.on_train_batch_end(torch.zeros(1, 2))
    state = observer.state_dict()
    assert state["step"] == 4 and state["GPUStatsMonitor"]["last_logged_step"] == 4
    assert set(state) == {"step", "GPUStatsMonitor", "BottleneckAdvisor"}
    observer.on_train_end()
    resumed = FabricObserver(GPUStatsMonitor(log_every_n_steps=2, gpu=False))
    resumed.on_train_start(fabric, nn.Linear(2, 2))
    resumed.load_state_dict(state)
    resumed.on_train_batch_start(torch.zeros(1, 2))
    resumed.on_train_batch_end(torch.zeros(1, 2))
    assert resumed.loop is not None and resumed.loop.step == 5
    resumed.on_exception()


def test_bad_input_is_refused_before_any_work():
    with pytest.raises(TypeError, match=r"FabricObserver's observers must be GPUStatsMonitor"):
        FabricObserver(GPUStatsMonitor(), "advisor")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"at most one of each kind"):
        FabricObserver(GPUStatsMonitor(), GPUStatsMonitor())
    observer = FabricObserver(GPUStatsMonitor(gpu=False))
    fabric = Fabric(accelerator="cpu", devices=1)
    with pytest.raises(TypeError, match=r"^fabric must be the lightning.fabric.Fabric"):
        observer.on_train_start(None, nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"^model must be the torch.nn.Module"):
        observer.on_train_start(fabric, "model")  # type: ignore[arg-type]
    assert observer.loop is None and observer.monitor is not None and observer.monitor.history == []
    with pytest.raises(RuntimeError, match=r"^FabricObserver.timed was called before on_train_start"):
        next(observer.timed(_loader(n=8)))
    observer.on_train_start(fabric, nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"^step must be"):
        observer.on_train_batch_end(torch.zeros(1), step=-1)
    observer.on_exception()
