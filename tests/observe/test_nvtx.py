"""NVTXRanges, observed the way a profiler observes it.

The short fits run in a subprocess with ``NVTX_INJECTION64_PATH`` pointing at a recorder built from
``nvtx_recorder.c``: the real NVTX v3 client inside the ``nvtx`` package (or ``torch.cuda.nvtx`` on the GPU
machine) loads it and reports every push, pop, mark and registered string, which the tests replay per thread.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_gpuopt.observe.nvtx import PHASE_COLORS, NVTXRanges, RangeStack, add_module_ranges
from tests._lightning import quiet_trainer
from tests.observe import nvtx_events as ne
from tests.observe.nvtx_scenarios import Module, Net, loader

REPO = Path(__file__).resolve().parents[2]
DOMAIN = "lightning_gpuopt"
STEP = ["  forward", "  zero_grad", "  backward", "  optimizer step"]


@pytest.fixture(scope="module")
def recorder_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prebuilt = os.environ.get(
        "NVTX_RECORDER_LIB"
    )  # a recorder built elsewhere, for a host without a compiler
    if prebuilt:
        return Path(prebuilt).resolve()
    try:
        lib = ne.build_recorder(tmp_path_factory.mktemp("nvtxrec"))
    except subprocess.CalledProcessError as err:  # a compiler that cannot build a shared object
        pytest.skip(f"cannot build the NVTX recorder: {err.stderr[-500:]}")
    if lib is None:
        pytest.skip("no C compiler (cc/gcc/clang) to build the NVTX injection recorder")
    return lib


def run_recorded(
    lib: Path, out: Path, args: list[str], prelude: str = "", timeout: float = 600
) -> tuple[subprocess.CompletedProcess[str], list[ne.Event]]:
    env = {**os.environ, **ne.recorder_env(lib, out), "PYTHONPATH": str(REPO)}
    code = f"{prelude}\nimport sys\nfrom tests.observe.nvtx_scenarios import main\nsys.exit(main({args!r}))"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    events = ne.read_events(out) if out.exists() else []
    return proc, events


@pytest.fixture(scope="module")
def recorded(recorder_lib: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[ne.Event]]:
    """Every scenario of nvtx_scenarios.py in one CPU subprocess (imports cost more than the fits)."""
    pytest.importorskip("nvtx")
    out = tmp_path_factory.mktemp("rec") / "events.tsv"
    proc, events = run_recorded(recorder_lib, out, [])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert any(e.kind == "init" for e in events), "the nvtx package never loaded the injection library"
    return ne.split_scenarios(events)


def tree(recorded: dict[str, list[ne.Event]], name: str) -> ne.Tree:
    return ne.replay(recorded[name], DOMAIN)


# ------------------------------------------------------------------------------------------ order
def test_basic_fit_order_and_nesting(recorded: dict[str, list[ne.Event]]) -> None:
    t = tree(recorded, "basic")
    val = ["validation", "  validation step 0", "  validation step 1"]
    expected = [
        *["validation", "  validation step 0"],  # sanity check
        *["data wait", "step 0", *STEP, "data wait", "step 1", *STEP, "data wait"],
        *[*val, "data wait", "step 2", *STEP, "data wait", "step 3", *STEP, "data wait", *val, "data wait"],
    ]
    assert ne.outline(t) == expected
    assert t.problems == []
    assert len({tid for tid, _, _ in t.lines}) == 1
    # one color per phase, as the timeline shows them
    for name in ("step", "data wait", "forward", "zero_grad", "backward", "optimizer step", "validation"):
        assert t.colors[name] == f"{PHASE_COLORS[name]:08x}", name
    # fixed names are registered once and then reused
    registered = [e.message for e in recorded["basic"] if e.kind == "string" and e.domain == DOMAIN]
    for name in ("forward", "backward", "data wait", "optimizer step"):
        assert registered.count(name) == 1, name


def test_gradient_accumulation_skips_optimizer_ranges(recorded: dict[str, list[ne.Event]]) -> None:
    t = tree(recorded, "accumulate")
    first = ["step {n}", "  forward", "  zero_grad", "  backward"]  # zero_grad before the first micro-batch
    last = ["step {n}", "  forward", "  backward", "  optimizer step"]
    expected = ["data wait"]
    for n in (0, 1):
        expected += (
            [x.format(n=n) for x in first] + ["data wait"] + [x.format(n=n) for x in last] + ["data wait"]
        )
    assert ne.outline(t) == expected
    assert t.problems == []


def test_module_ranges_nest_inside_forward_and_validation(recorded: dict[str, list[ne.Event]]) -> None:
    t = tree(recorded, "modules")
    modules = ["    body", "      body.0", "      body.1", "    head"]
    step = ["  forward", *modules, "  zero_grad", "  backward", "  optimizer step"]
    val = ["validation", "  validation step 0", *modules]
    assert ne.outline(t) == [
        "data wait",
        "step 0",
        *step,
        "data wait",
        "step 1",
        *step,
        "data wait",
        *val,
        "data wait",
    ]


def test_capture_window_marks(recorded: dict[str, list[ne.Event]]) -> None:
    t = tree(recorded, "capture")
    lines = ne.outline(t)
    marks = {msg: idx for idx, msg in t.marks}
    # started after step 0 closed, before the data wait that precedes step 1
    start = marks["capture start (step 1)"]
    assert lines[start - 1] == "  optimizer step" and lines[start : start + 2] == ["data wait", "step 1"]
    # stopped after the batch that brought global_step to stop_step=3
    stop = marks["capture stop (step 3)"]
    assert lines[stop - 5] == "step 2" and lines[stop] == "data wait"
    assert len(marks) == 2 and t.problems == []


# ---------------------------------------------------------------------------------------- balance
@pytest.mark.parametrize(
    ("name", "last_open"),
    [
        ("max_steps", None),
        ("end_epoch", "step 2"),
        ("skip_none", None),
        ("inf_scaler", None),
        ("error_step", "step 1"),
        ("error_callback", "  backward"),
        ("error_module", "      body.1"),
        ("interrupt_step", "step 1"),
        ("interrupt_module", "      body.1"),
    ],
)
def test_ranges_balance_on_every_way_out(
    recorded: dict[str, list[ne.Event]], name: str, last_open: str | None
) -> None:
    t = tree(recorded, name)
    assert t.lines, "scenario emitted no ranges"
    assert t.problems == []  # every push popped, on the thread that pushed it
    if last_open is not None:
        # the failure really happened with these ranges open, so the balance is the callback's doing
        lines = ne.outline(t)
        assert last_open in lines[-3:], lines[-6:]


def test_max_steps_mid_epoch_stops_after_three_steps(recorded: dict[str, list[ne.Event]]) -> None:
    steps = [m for m in ne.outline(tree(recorded, "max_steps")) if m.startswith("step")]
    assert steps == ["step 0", "step 1", "step 2"]


def test_gradscaler_skip_keeps_ranges(recorded: dict[str, list[ne.Event]]) -> None:
    marks = [e.message for e in recorded["inf_scaler"] if e.kind == "mark" and e.domain == "scenario"]
    assert "scaler skipped a step" in marks  # the inf step was really skipped by the GradScaler
    assert ne.outline(tree(recorded, "inf_scaler")).count("  optimizer step") == 4


def test_no_backend_warns_once_and_emits_nothing(recorder_lib: Path, tmp_path: Path) -> None:
    if hasattr(torch._C, "_nvtx"):
        pytest.skip("torch.cuda.nvtx is a working backend in this build")
    out = tmp_path / "events.tsv"
    proc, events = run_recorded(
        recorder_lib, out, ["basic", "accumulate"], prelude="import sys; sys.modules['nvtx'] = None"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("NVTXRanges: no NVTX backend") == 1, proc.stderr[-3000:]
    assert [e for e in events if e.kind in ("push", "pop")] == []


@pytest.mark.gpu
def test_torch_backend_on_cuda_is_recorded(recorder_lib: Path, tmp_path: Path) -> None:
    out = tmp_path / "events.tsv"
    proc, events = run_recorded(
        recorder_lib, out, ["--backend", "torch", "--accelerator", "cuda", "basic", "capture", "error_module"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    per = ne.split_scenarios(events)
    basic = ne.replay(per["basic"], "-")  # torch.cuda.nvtx pushes into the default domain
    assert basic.problems == [] and basic.lines
    assert [m for m in ne.outline(basic) if m.startswith("step")] == ["step 0", "step 1", "step 2", "step 3"]
    assert ne.replay(per["error_module"], "-").problems == []
    assert len(ne.replay(per["capture"], "-").marks) == 2


# ------------------------------------------------------------------------------ in-process behaviour
class ListBackend:
    """Records calls at the NVTX boundary (the thing under test is the stack logic above it)."""

    name = "list"

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, str]] = []

    def push(self, message: str, color: int, cache: bool = True) -> None:
        self.calls.append(("push", threading.get_ident(), message))

    def pop(self) -> None:
        self.calls.append(("pop", threading.get_ident(), ""))

    def mark(self, message: str, color: int) -> None:
        self.calls.append(("mark", threading.get_ident(), message))


def test_range_stack_is_per_thread() -> None:
    backend = ListBackend()
    ranges = RangeStack(backend)
    ranges.push("outer", "step")
    other = threading.Thread(target=lambda: ranges.push("theirs", "module"))
    other.start()
    other.join()
    ranges.push("inner", "phase")
    assert ranges.close("step") is True  # pops inner and outer, never the other thread's range
    assert ranges.close("step") is False
    assert [c[0] for c in backend.calls if c[1] == threading.get_ident()] == ["push", "push", "pop", "pop"]
    assert ranges.depth == 0


def test_add_module_ranges_depth_and_exception() -> None:
    backend = ListBackend()
    ranges = RangeStack(backend)
    net = Net()
    handles = add_module_ranges(net, 1, ranges)
    net(torch.randn(2, 8))
    assert [c[2] for c in backend.calls if c[0] == "push"] == ["body", "head"]
    net.body[1].exc = ValueError("boom")
    with pytest.raises(ValueError):
        net(torch.randn(2, 8))
    assert ranges.depth == 0  # always_call hook popped "body" although forward raised
    for h in handles:
        h.remove()
    assert not net.body._forward_hooks and not net.body._forward_pre_hooks


def _trainer(cb: NVTXRanges, **kw: Any) -> pl.Trainer:
    return quiet_trainer(
        accelerator="cpu",
        max_epochs=1,
        callbacks=[cb],
        **kw,
    )


def test_module_hooks_removed_after_fit_and_after_failure() -> None:
    cb = NVTXRanges(module_depth=2, module_root="net")
    model = Module()
    _trainer(cb, limit_train_batches=2).fit(model, loader(2))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    failing = Module(step_raises_at=1, exc=ValueError("boom"))
    with pytest.raises(ValueError):
        _trainer(cb).fit(failing, loader(3))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in failing.modules())
    assert cb.ranges is None


def test_state_dict_pickle_and_second_fit() -> None:
    cb = NVTXRanges(module_depth=1, module_root="net", start_step=1, stop_step=2)
    model = Module()
    _trainer(cb, limit_train_batches=3).fit(model, loader(3))
    clone = pickle.loads(pickle.dumps(cb))
    assert clone.module_depth == 1 and clone.stop_step == 2
    clone.load_state_dict(cb.state_dict())
    _trainer(clone, limit_train_batches=2).fit(model, loader(2))
    assert all(not m._forward_hooks for m in model.modules())


@pytest.mark.parametrize(
    ("kwargs", "match", "error"),
    [
        ({"module_depth": -1}, "module_depth", ValueError),
        ({"module_depth": True}, "module_depth", TypeError),
        ({"start_step": 3}, "start_step and stop_step", ValueError),
        ({"start_step": 5, "stop_step": 5}, "stop_step", ValueError),
        ({"start_step": -1, "stop_step": 5}, "start_step", ValueError),
        ({"backend": "nsys"}, "backend", ValueError),
        ({"domain": ""}, "domain", ValueError),
        ({"phases": "no"}, "phases must be True or False, got 'no'", TypeError),
    ],
)
def test_invalid_arguments(kwargs: dict[str, Any], match: str, error: type[Exception]) -> None:
    with pytest.raises(error, match=match):
        NVTXRanges(**kwargs)


def test_unknown_module_root_names_the_argument() -> None:
    with pytest.raises(ValueError, match=r"module_root must be .*, got 'nope'"):
        _trainer(NVTXRanges(module_depth=1, module_root="nope"), limit_train_batches=1).fit(
            Module(), loader(1)
        )


class _Probe(pl.Callback):
    """Looks at NVTXRanges from inside a fit: hooks on the wrapped modules, open ranges, capture state."""

    def __init__(self, cb: NVTXRanges) -> None:
        self.cb = cb
        self.seen: list[tuple[int, int, bool]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        hooked = sum(len(m._forward_pre_hooks) for m in pl_module.net.modules())
        assert self.cb.ranges is not None
        self.seen.append((hooked, self.cb.ranges.depth, self.cb._capturing))


def test_idle_backend_skips_bookkeeping_but_keeps_the_capture_window() -> None:
    # In this process no NVTX tool is attached: the nvtx package hands out a DummyDomain that records nothing.
    pytest.importorskip("nvtx")
    cb = NVTXRanges(module_depth=2, module_root="net", start_step=1, stop_step=2, backend="nvtx")
    probe = _Probe(cb)
    trainer = _trainer(cb, limit_train_batches=4)
    trainer.callbacks.append(probe)
    trainer.fit(Module(), loader(4))
    # no module hooks (they would slow every forward), no ranges held, but the window still opened and closed
    assert [(h, d) for h, d, _ in probe.seen] == [(0, 0)] * 4
    assert [c for _, _, c in probe.seen] == [True, False, False, False]
    assert not cb._capturing


def test_disabled_backend_adds_no_module_hooks() -> None:
    backend = ListBackend()
    backend.enabled = False  # type: ignore[attr-defined]
    net = Net()
    assert add_module_ranges(net, 2, RangeStack(backend)) == []
    assert all(not m._forward_pre_hooks for m in net.modules())


def test_module_post_hook_pops_only_its_own_range() -> None:
    backend = ListBackend()
    ranges = RangeStack(backend)
    net = Net()
    add_module_ranges(net, 1, ranges)
    ranges.push("step 0", "step")
    # runs before the module's own post hook, so "body" is not on top when that one pops
    net.body.register_forward_hook(lambda *_: ranges.push("left open", "phase"), prepend=True)
    net(torch.randn(2, 8))
    # the fallback popped down to "body", taking "left open" with it
    assert ranges.depth == 1 and ranges.is_open("step")
    assert [c[0] for c in backend.calls] == ["push", "push", "push", "pop", "pop", "push", "pop"]
