"""CompileModel / should_compile: torch.compile of forward for a fit, and the rule deciding when it pays."""

from __future__ import annotations

import copy
import pickle
import warnings
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gpuopt._common import _warnings
from lightning_gpuopt._compat import cudagraph_skip_logger
from lightning_gpuopt.bench.models import ImageClassifier
from lightning_gpuopt.compute import _compile_cost
from lightning_gpuopt.compute import compile as compile_mod
from lightning_gpuopt.compute._cudagraphs import SkipWatch
from lightning_gpuopt.compute.channels_last import ChannelsLast, is_channels_last
from lightning_gpuopt.compute.compile import (
    BREAK_EVEN_SECONDS,
    COMPILE_SECONDS,
    COMPILE_STEP_SAVING,
    CompileDecision,
    CompileModel,
    choose_mode,
    should_compile,
)
from lightning_gpuopt.compute.preset import PRESET_DDP_KWARGS
from lightning_gpuopt.observe.advisor.config import collect_config
from tests._cli import own_cache  # noqa: F401 - the autouse fixture: measured compile costs stay in tmp_path
from tests._ddp import CloseProcessGroup
from tests._lightning import quiet_trainer
from tests.compute._models import convnet, mlp

H200 = {"device": "cuda", "capability": (9, 0)}


# --- the rule ------------------------------------------------------------------------------------------
def test_break_even_follows_from_the_constants():
    assert pytest.approx(COMPILE_SECONDS / COMPILE_STEP_SAVING) == BREAK_EVEN_SECONDS
    assert 290 <= BREAK_EVEN_SECONDS <= 310  # 45 s of compiling against 15% faster steps


@pytest.mark.parametrize(
    ("kwargs", "expected", "reason"),
    [
        ({"family": None, **H200}, False, "no convolution or attention"),
        ({"family": None, **H200}, False, "conv nets and transformers"),
        # a transformer: 35 s of compiling against 30% faster steps, a 117 s break-even
        ({"family": "transformer", **H200, "steps_left": 4_000, "step_seconds": 0.04}, True, "transformer's"),
        ({"family": "transformer", **H200, "steps_left": 2_000, "step_seconds": 0.04}, False, "117 s"),
        ({"family": "conv", **H200, "steps_left": 4_000, "step_seconds": 0.04}, False, "conv's 300 s"),
        ({"family": "transformer", **H200, "steps_left": 4_000, "step_seconds": 0.04}, True, ""),
        ({"family": "conv", "device": "cpu"}, False, "CUDA devices only"),
        ({"family": "conv", "device": "cuda", "capability": (6, 1)}, False, "below 7.0"),
        # steps known: eager time = steps * step time against the 300 s break-even
        ({"family": "conv", **H200, "steps_left": 50_000, "step_seconds": 0.04}, True, "2000 s"),
        ({"family": "conv", **H200, "steps_left": 5_000, "step_seconds": 0.04}, False, "200 s"),
        (
            {
                "family": "conv",
                "device": "cuda",
                "capability": (7, 0),
                "steps_left": 8_000,
                "step_seconds": 0.04,
            },
            True,
            "320 s",
        ),
        # steps known, step time not yet: time some steps first, unless max_time already rules it out
        ({"family": "conv", **H200, "steps_left": 5_000}, None, "time a few steps"),
        ({"family": "conv", **H200, "steps_left": 5_000, "time_left": 120.0}, False, "max_time"),
        # max_time caps a long step budget
        (
            {"family": "conv", **H200, "steps_left": 1e6, "step_seconds": 0.04, "time_left": 250.0},
            False,
            "250 s",
        ),
        # no set length: max_time decides, else the run is taken as long
        ({"family": "conv", **H200, "steps_left": float("inf"), "time_left": 3600.0}, True, "3600 s"),
        ({"family": "conv", **H200, "steps_left": float("inf"), "time_left": 200.0}, False, "200 s"),
        ({"family": "conv", **H200, "steps_left": float("inf")}, True, "no set length"),
        ({"family": "conv", **H200}, True, "no set length"),
    ],
)
def test_should_compile(kwargs, expected, reason):
    decision = should_compile(**kwargs)
    assert isinstance(decision, CompileDecision)
    assert decision.compile is expected
    assert reason in decision.reason


def test_should_compile_reads_the_capability_of_the_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (6, 0))
    assert should_compile(family="conv", device="cuda:0").compile is False
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert should_compile(family="conv", device="cuda:0").compile is True


# --- the callback on a real fit -----------------------------------------------------------------------------
def _data(n: int, batch_size: int, seed: int = 0, drop_last: bool = False) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    ds = TensorDataset(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g))
    return DataLoader(ds, batch_size=batch_size, drop_last=drop_last)


def _fit(model: pl.LightningModule, callbacks: list, train: DataLoader, val: DataLoader | None = None, **kw):
    trainer = quiet_trainer(accelerator="cpu", devices=1, callbacks=callbacks, num_sanity_val_steps=0, **kw)
    trainer.fit(model, train, val)
    return trainer


class _ForwardProbe(pl.Callback):
    """Records, at each training batch, whether forward is compiled."""

    def __init__(self) -> None:
        self.compiled: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.compiled.append("forward" in vars(pl_module))


def test_compiled_fit_matches_eager_and_restores_forward():
    torch.manual_seed(0)
    base = ImageClassifier(convnet(), lr=0.05)
    eager, compiled = copy.deepcopy(base), copy.deepcopy(base)
    _fit(eager, [], _data(24, 8), max_epochs=1)
    cb, probe = CompileModel(backend="aot_eager"), _ForwardProbe()
    _fit(compiled, [cb, probe], _data(24, 8), max_epochs=1)
    assert probe.compiled == [True, True, True]
    assert cb.compiled_calls == 3 and cb.eager_calls == 0
    assert cb.decision is not None and cb.decision.compile is True
    assert not cb.compiled and "forward" not in vars(compiled)  # the class's forward again
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def test_other_shapes_run_eagerly_with_one_warning():
    cb = CompileModel(backend="eager")
    model = ImageClassifier(convnet())
    with pytest.warns(UserWarning, match=r"drop_last=True") as record:
        # 20 = 2 x 8 + 4: each epoch ends with a partial batch; validation has its own shape
        _fit(model, [cb], _data(20, 8), _data(10, 6), max_epochs=2)
    assert sum("CompileModel" in str(w.message) for w in record) == 1
    # training: 2 x 2 compiled + 2 eager; validation: 2 x 1 compiled (6) + 2 eager (4)
    assert (cb.compiled_calls, cb.eager_calls) == (6, 4)


def test_training_step_without_forward_is_named():
    class Direct(ImageClassifier):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.model(x), y)  # bypasses forward

    cb = CompileModel(backend="eager")
    with pytest.warns(UserWarning, match=r"did not call forward"):
        _fit(Direct(convnet()), [cb], _data(8, 1), max_steps=17)
    assert cb.compiled_calls == 0


def test_forward_replaced_already_is_left_alone():
    model = ImageClassifier(convnet())
    own = model.forward
    model.forward = own  # type: ignore[method-assign]
    cb = CompileModel(backend="eager")
    with pytest.warns(UserWarning, match="already replaced"):
        _fit(model, [cb], _data(8, 4), max_steps=1)
    assert vars(model)["forward"] is own and cb.compiled_calls == 0


def test_auto_on_cpu_steps_aside_once():
    cb = CompileModel(when="auto")
    with pytest.warns(UserWarning, match=r"CUDA devices only"):
        _fit(ImageClassifier(convnet()), [cb], _data(8, 4), max_steps=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _fit(ImageClassifier(convnet()), [cb], _data(8, 4), max_steps=1)
    assert not [w for w in record if "CompileModel" in str(w.message)]
    assert not cb.compiled and cb.decision is None and cb.compiled_calls == 0


def test_validate_only_run_compiles_with_always():
    cb = CompileModel(backend="eager")
    trainer = quiet_trainer(accelerator="cpu", devices=1, callbacks=[cb])
    model = ImageClassifier(convnet())
    trainer.validate(model, _data(8, 4))
    assert cb.compiled_calls == 2 and "forward" not in vars(model)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="when must be 'always' or 'auto', got 'sometimes'"):
        CompileModel(when="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend"):
        CompileModel(backend="")
    with pytest.raises(TypeError, match="backend"):
        CompileModel(backend=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode must be None or one of"):
        CompileModel(mode="fast")


@pytest.mark.parametrize(
    ("kwargs", "mode", "reason"),
    [
        ({"family": "conv", "device": "cuda"}, "reduce-overhead", "a conv net on one CUDA device"),
        ({"family": "conv", "device": "cpu"}, "default", "need a CUDA device, not 'cpu'"),
        ({"family": "transformer", "device": "cuda"}, "default", "a transformer"),
        ({"family": None, "device": "cuda"}, "default", "not a conv net"),
        ({"family": "conv", "device": "cuda", "world_size": 2}, "default", "2 processes"),
        ({"family": "conv", "device": "cuda", "accumulate_grad_batches": 4}, "default", "batches=4"),
        ({"family": "conv", "device": "cuda", "automatic_optimization": False}, "default", "manual"),
        ({"family": "conv", "device": "cuda", "gpu_decoding": True}, "default", "nvJPEG"),
    ],
)
def test_choose_mode_takes_cuda_graphs_only_where_they_apply(kwargs, mode, reason):
    chosen, why = choose_mode(**kwargs)
    assert chosen == mode and reason in why


def test_mode_reaches_torch_compile_and_graphs_mark_every_step(monkeypatch):
    seen: list[dict] = []
    real = torch.compile

    def spy(fn, **kw):
        seen.append(kw)
        return real(fn, dynamic=False, backend="eager")  # the CPU cannot record CUDA graphs

    marks: list[int] = []
    monkeypatch.setattr(torch, "compile", spy)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    cb = CompileModel(mode="reduce-overhead")
    model = ImageClassifier(convnet())
    _fit(model, [cb], _data(8, 4), _data(8, 4), max_steps=3)
    assert seen and seen[0]["mode"] == "reduce-overhead" and cb.mode_used == "reduce-overhead"
    assert len(marks) == 5  # one a batch: 2 + 1 training, 2 validation after the first epoch
    assert cb.state_dict()["mode_reason"] == "CompileModel(mode='reduce-overhead')"


def test_outputs_under_cuda_graphs_are_copies_the_caller_may_keep(monkeypatch):
    returned: list[torch.Tensor] = []
    real = torch.compile

    def spy(fn, **kw):
        inner = real(fn, dynamic=False, backend="eager")

        def run(*a, **k):
            out = inner(*a, **k)
            returned.append(out)
            return out

        return run

    monkeypatch.setattr(torch, "compile", spy)
    for mode, copied in (("reduce-overhead", True), ("default", False)):
        returned.clear()
        cb = CompileModel(mode=mode)
        model = ImageClassifier(convnet())
        cb.setup(quiet_trainer(accelerator="cpu", devices=1), model, "validate")
        try:
            out = model(torch.randn(2, 3, 8, 8))
        finally:
            cb._uninstall()
        assert len(returned) == 1 and torch.equal(out, returned[0])
        assert (out.data_ptr() != returned[0].data_ptr()) is copied


def test_a_gradient_accumulation_schedule_keeps_cuda_graphs_off():
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    cb = CompileModel()
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device("cuda", 0)),
        world_size=1,
        accumulate_grad_batches=1,
        callbacks=[GradientAccumulationScheduler({0: 1, 4: 8})],
    )  # fmt: skip
    cb.setup(trainer, ImageClassifier(convnet()), "fit")  # type: ignore[arg-type]
    mode, why = choose_mode(family="conv", device=cb._run[0], world_size=cb._run[1],
                            accumulate_grad_batches=cb._run[2])  # fmt: skip
    assert mode == "default" and "accumulate_grad_batches=8" in why


@pytest.mark.parametrize(
    ("decoder", "mode"), [("gpu", "default"), ("cpu", "reduce-overhead"), (None, "reduce-overhead")]
)
def test_a_training_loader_decoding_with_nvjpeg_keeps_cuda_graphs_off(monkeypatch, decoder, mode):
    from lightning_gpuopt._common import FeedInfo

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    loader = SimpleNamespace(feed_info=FeedInfo(backend="dali", decoder=decoder))
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device("cuda", 0)),
        world_size=1,
        accumulate_grad_batches=1,
        callbacks=[], train_dataloader=loader,
    )  # fmt: skip
    cb, model = CompileModel(), ImageClassifier(convnet())
    cb.setup(trainer, model, "fit")  # type: ignore[arg-type]
    cb.on_train_start(trainer, model)  # type: ignore[arg-type]
    try:
        assert cb.compiled and cb.mode_used == mode
    finally:
        cb._uninstall()


def test_the_training_loaders_decoder_is_read_from_a_real_fit():
    from lightning_gpuopt._common import FeedInfo

    class Decoding(DataLoader):
        feed_info = FeedInfo(backend="dali", decoder="gpu")

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g))
    cb = CompileModel(backend="eager")
    _fit(ImageClassifier(convnet()), [cb], Decoding(data, batch_size=4), max_steps=1)
    assert cb._gpu_decoding is True

    class InProcess(DataLoader):  # the training process's own nvJPEG path keeps the graphs
        feed_info = FeedInfo(backend="folder", decoder="gpu")

    cb = CompileModel(backend="eager")
    _fit(ImageClassifier(convnet()), [cb], InProcess(data, batch_size=4), max_steps=1)
    assert cb._gpu_decoding is False


def test_mode_none_on_cpu_compiles_in_the_default_mode_and_marks_nothing(monkeypatch, caplog):
    marks: list[int] = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    seen: list[dict] = []
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or real(fn, backend="eager"))
    cb = CompileModel()
    _fit(ImageClassifier(convnet()), [cb], _data(8, 4), max_steps=2)
    assert seen[0]["mode"] == "default" and cb.mode_used == "default" and not marks
    assert "CUDA graphs need a CUDA device" in cb.mode_reason


def test_second_fit_state_dict_and_pickle():
    cb = CompileModel(backend="eager")
    model = ImageClassifier(convnet())
    _fit(model, [cb], _data(8, 4), max_steps=2)
    _fit(model, [cb], _data(8, 4), max_steps=2)
    assert cb.compiled_calls == 4 and not cb.compiled
    state = cb.state_dict()
    mode = {"mode": "default", "mode_reason": "backend='eager': modes are inductor's"}
    decided = {"when": "always", "compile": True, "reason": "when='always'", "step_seconds": None}
    graphs = {"cuda_graphs": False, "cuda_graphs_reason": "mode='default' records no CUDA graphs"}
    assert state == {**decided, **mode, **graphs}
    fresh = CompileModel()
    fresh.load_state_dict(state)
    clone = pickle.loads(pickle.dumps(cb))
    assert clone.when == "always" and clone.backend == "eager" and clone._wrapper is None
    assert repr(clone) == "CompileModel(when='always', backend='eager', mode=None)"


def test_pickle_while_compiled():
    cb = CompileModel(backend="eager")
    model = ImageClassifier(convnet())
    cb._install(model, CompileDecision(True, "test"))
    try:
        clone = pickle.loads(pickle.dumps(cb))
        assert clone._module is None and not clone.compiled
    finally:
        cb._uninstall()
    assert "forward" not in vars(model)


# --- "auto": timing eager batches, then deciding ------------------------------------------------------------
class _Clock:
    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def perf_counter(self) -> float:
        self.now += self.step  # every read advances one batch's time
        return self.now


def _fake_trainer(total_steps: float, broadcasts: list) -> SimpleNamespace:
    def broadcast(obj, src=0):
        broadcasts.append((obj, src))
        return obj

    strategy = SimpleNamespace(root_device=torch.device("cuda", 0), broadcast=broadcast)
    return SimpleNamespace(
        strategy=strategy,
        estimated_stepping_batches=total_steps,
        global_step=0,
        accumulate_grad_batches=1,
        callbacks=[],
    )


@pytest.mark.parametrize(
    ("total_steps", "batch_seconds", "compiles"), [(100_000, 0.01, True), (2_000, 0.01, False)]
)
def test_auto_times_eager_batches_then_decides(monkeypatch, total_steps, batch_seconds, compiles):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    # the clock is read twice (start and end of the timed window): each read advances 10 batches' time
    monkeypatch.setattr(
        compile_mod, "time", SimpleNamespace(perf_counter=_Clock(10 * batch_seconds).perf_counter)
    )
    broadcasts: list = []
    trainer = _fake_trainer(total_steps, broadcasts)
    cb = CompileModel(when="auto", backend="eager")
    model = ImageClassifier(convnet())
    cb.setup(trainer, model, "fit")
    cb.on_train_start(trainer, model)
    assert cb._timing and cb.decision is None
    try:
        for i in range(_compile_cost.WARMUP_BATCHES + _compile_cost.TIMED_BATCHES + 1):
            trainer.global_step = i
            cb.on_train_batch_start(trainer, model, None, i)
            if i < _compile_cost.WARMUP_BATCHES + _compile_cost.TIMED_BATCHES:
                assert not cb.compiled  # eager while timing
        assert cb.step_seconds == pytest.approx(batch_seconds)
        assert cb.decision is not None and cb.decision.compile is compiles
        assert cb.compiled is compiles
        assert len(broadcasts) == 1 and broadcasts[0][1] == 0  # rank zero's decision, once
        left = total_steps - (_compile_cost.WARMUP_BATCHES + _compile_cost.TIMED_BATCHES)
        assert cb.decision.eager_seconds == pytest.approx(left * batch_seconds)
    finally:
        cb.teardown(trainer, model, "fit")
    assert "forward" not in vars(model)


def test_the_break_even_comes_from_this_models_measured_cost_where_there_is_one():
    """The rule weighs the compile cost and saving measured for this model on this GPU in an earlier run;
    the family's figures from one H200 host stand in only until then, and the reason says which."""
    kw = {"family": "conv", **H200, "steps_left": 4_000, "step_seconds": 0.04}  # 160 s of eager training
    assumed = should_compile(**kw)
    assert assumed.compile is False and "assumed, ResNet-50's on one H200" in assumed.reason
    measured = should_compile(**kw, cost=(20.0, 0.25))  # an 80 s break-even: this model compiles fast
    assert measured.compile is True and "80 s break-even" in measured.reason
    assert "(20 s to compile, 25% of a step saved: measured for this model on this GPU)" in measured.reason
    slower = should_compile(**kw, cost=(20.0, -0.05))
    assert slower.compile is False and "compiled steps saved nothing" in slower.reason


def _scripted(marks: list[float]) -> SimpleNamespace:
    """A ``time`` whose ``perf_counter`` returns ``marks`` in turn."""
    it = iter(marks)
    return SimpleNamespace(perf_counter=lambda: next(it), time=lambda: 0.0)


@pytest.mark.parametrize(("compiled_step", "kept"), [(0.03, True), (0.05, False)])
def test_auto_measures_what_compiling_cost_and_keeps_it_for_the_next_fit(
    monkeypatch, tmp_path, compiled_step, kept
):
    """After compiling, the first compiled step and a window of later ones are timed against the eager step:
    the cost is kept in the cache and the next fit's decision weighs it; compiled steps measured slower than
    eager ones turn compiling off for the rest of the fit."""
    monkeypatch.setenv("LIGHTNING_GPUOPT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(compile_mod, "time", _scripted([0.0, 0.4]))  # eager: 10 batches of 40 ms
    first = _compile_cost.WARMUP_BATCHES + _compile_cost.TIMED_BATCHES  # the first compiled batch
    timed = _compile_cost.TIMED_BATCHES
    # the first compiled step takes 30.04 s (30 s compiling), then a window of `timed` compiled steps
    monkeypatch.setattr(
        _compile_cost, "time", _scripted([100.0, 130.04, 200.0, 200.0 + timed * compiled_step])
    )
    trainer = _fake_trainer(100_000, [])
    cb = CompileModel(when="auto", backend="eager")
    model = ImageClassifier(convnet())
    cb.setup(trainer, model, "fit")
    cb.on_train_start(trainer, model)
    assert "assumed" in (cb.decision.reason if cb.decision else "assumed")
    try:
        last = first + 1 + _compile_cost.WARMUP_BATCHES + timed
        for i in range(last + 1):
            cb.on_train_batch_start(trainer, model, None, i)
            if i == first:
                assert cb.compiled and "assumed, ResNet-50's on one H200" in cb.decision.reason
        assert cb.cost is not None and cb.cost.seconds == pytest.approx(30.0)
        assert cb.cost.saving == pytest.approx(1 - compiled_step / 0.04)
        assert cb.compiled is kept  # slower compiled steps: eager from here
        if not kept:
            assert "compiled steps measured slower" in cb.decision.reason
    finally:
        cb.teardown(trainer, model, "fit")
    key = _compile_cost.cost_key(model, torch.device("cuda", 0))
    assert _compile_cost.measured_cost(key) == pytest.approx((30.0, 1 - compiled_step / 0.04))
    again = CompileModel(when="auto", backend="eager")  # the next fit, on this GPU
    monkeypatch.setattr(compile_mod, "time", _scripted([0.0, 0.4]))
    monkeypatch.setattr(_compile_cost, "time", _scripted([0.0]))  # its first compiled batch is marked
    again.setup(trainer, model, "fit")
    again.on_train_start(trainer, model)
    try:
        for i in range(first + 1):
            again.on_train_batch_start(trainer, model, None, i)
        assert "measured for this model on this GPU" in again.decision.reason
        assert again.compiled is kept  # a model whose compiled steps were slower is not compiled again
    finally:
        again.teardown(trainer, model, "fit")


def test_auto_decides_at_train_start_without_a_set_length(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    trainer = _fake_trainer(float("inf"), [])
    cb = CompileModel(when="auto", backend="eager")
    model = ImageClassifier(convnet())
    cb.setup(trainer, model, "fit")
    cb.on_train_start(trainer, model)
    try:
        assert cb.compiled and not cb._timing and "no set length" in cb.decision.reason
    finally:
        cb.teardown(trainer, model, "fit")
    mlp_module = ImageClassifier(mlp())
    cb.setup(trainer, mlp_module, "fit")
    cb.on_train_start(trainer, mlp_module)
    assert not cb.compiled and "no convolution" in cb.decision.reason


# --- whether the compiled step replays CUDA graphs ----------------------------------------------------------
def test_skipped_cuda_graphs_are_named_with_torchs_reason_once():
    """The "cudagraphs" backend on the CPU: torch skips the graphs for a CPU device and says why; the callback
    reads that after the first compiled steps, warns once, and keeps it for the advisor."""
    torch.compiler.reset()  # earlier tests compiled the same forward up to dynamo's recompile limit
    _warnings().clear()
    compile_mod._GRAPH_RESULTS.clear()
    cb = CompileModel(backend="cudagraphs")
    model = ImageClassifier(convnet())
    with pytest.warns(UserWarning, match="CUDA graphs were skipped: cpu device") as record:
        trainer = _fit(model, [cb], _data(48, 8), max_steps=5)
    assert sum("CUDA graphs were skipped" in str(w.message) for w in record) == 1
    assert cb.cuda_graphs is False and cb.cuda_graphs_reason is not None
    assert cb.cuda_graphs_reason.startswith("cpu device (")  # torch's words, its lead-in dropped
    assert cb.cuda_graphs_skipped == cb.cuda_graphs_reason
    assert collect_config(trainer, model, False).cuda_graphs_skipped == cb.cuda_graphs_reason  # the advisor's
    assert cb.state_dict()["cuda_graphs"] is False
    # a second fit of the class reuses the compiled code, and torch says nothing again: the first one's finding
    again = CompileModel(backend="cudagraphs")
    _fit(ImageClassifier(convnet()), [again], _data(48, 8), max_steps=5)
    assert again.cuda_graphs is False and again.cuda_graphs_reason == cb.cuda_graphs_reason
    logger = cudagraph_skip_logger()
    assert logger is not None and not any(isinstance(h, SkipWatch) for h in logger.handlers)  # it left


def test_a_mode_without_cuda_graphs_says_so_without_a_warning():
    cb = CompileModel(backend="eager")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _fit(ImageClassifier(convnet()), [cb], _data(24, 8), max_steps=3)
    assert not [w for w in record if "CompileModel" in str(w.message)]
    assert cb.cuda_graphs is False and cb.cuda_graphs_reason == "mode='default' records no CUDA graphs"
    assert cb.cuda_graphs_skipped is None  # none were asked for: nothing skipped


def test_graphs_replay_where_torch_counted_no_skip(monkeypatch):
    """A graph mode whose compile recorded no skip replays the graphs (the backend swapped for eager: the CPU
    cannot record them)."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, dynamic=False, backend="eager"))
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: None)
    torch.compiler.reset()  # a compile under the watch, not a reuse of an earlier test's
    compile_mod._GRAPH_RESULTS.clear()
    cb = CompileModel(mode="reduce-overhead")
    _fit(ImageClassifier(convnet()), [cb], _data(48, 8), max_steps=2)  # shorter than the check
    assert cb.cuda_graphs is True and cb.cuda_graphs_reason is None and cb.cuda_graphs_skipped is None


@pytest.mark.slow
def test_inductor_reduce_overhead_on_the_cpu_counts_a_skip_without_a_reason():
    # inductor logs no reason for a graph without CUDA in it, but counts the skip: the device is named
    torch.compiler.reset()
    _warnings().clear()
    compile_mod._GRAPH_RESULTS.clear()
    cb = CompileModel(mode="reduce-overhead")
    with pytest.warns(UserWarning, match="CUDA graphs were skipped: the compiled step runs on 'cpu'"):
        _fit(ImageClassifier(mlp()), [cb], _data(48, 8), max_steps=4)
    assert cb.cuda_graphs is False and "CUDA device" in (cb.cuda_graphs_skipped or "")


# --- inductor on the CPU: a real compiled fit, a checkpoint loaded into an uncompiled module ---------------
@pytest.mark.slow
def test_inductor_fit_with_channels_last_checkpoint_loads_uncompiled(tmp_path):
    torch.manual_seed(0)
    cb = CompileModel()  # inductor: C++ kernels on the CPU
    model = ImageClassifier(convnet(), lr=0.05)
    trainer = _fit(
        model,
        [ChannelsLast(), cb],
        _data(32, 8, drop_last=True),
        _data(16, 8, seed=1),
        max_epochs=1,
        default_root_dir=tmp_path,
    )
    assert cb.compiled_calls == 4 + 2 and cb.eager_calls == 0  # 4 training, 2 validation batches
    assert is_channels_last(model)
    ckpt = tmp_path / "compiled.ckpt"
    trainer.save_checkpoint(ckpt)
    state = torch.load(ckpt, weights_only=False)["state_dict"]
    assert list(state) == list(model.state_dict())
    assert not any("_orig_mod" in k for k in state)

    plain = ImageClassifier.load_from_checkpoint(ckpt, model=convnet())
    plain.eval()
    model.eval()
    x = torch.randn(8, 3, 8, 8)
    with torch.inference_mode():  # as in validation: the graph compiled there serves this call
        reference = plain(x)
        cb._install(model, CompileDecision(True, "compare"))
        try:
            out = model(x.contiguous(memory_format=torch.channels_last))
        finally:
            cb._uninstall()
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-5)


# --- DDP ------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_compiled_forward_under_ddp_trains_like_eager():
    """Two gloo ranks with the preset's DDP settings: forward compiled inside DDP's forward trains the same
    weights as the eager run."""
    torch.manual_seed(0)
    initial = ImageClassifier(convnet(), lr=0.05, fused=False)

    def run(callbacks: list) -> ImageClassifier:
        model = copy.deepcopy(initial)
        trainer = quiet_trainer(
            accelerator="cpu",
            devices=2,
            strategy=DDPStrategy(start_method="spawn", **PRESET_DDP_KWARGS),
            max_steps=3,
            num_sanity_val_steps=0,
            callbacks=[ChannelsLast(), *callbacks, CloseProcessGroup()],
        )
        trainer.fit(model, _data(48, 8))
        return model

    eager = run([])
    compiled = run([CompileModel(backend="aot_eager")])
    assert (eager.model[0].weight - initial.model[0].weight).abs().max() > 1e-4  # it trained
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


# --- on a GPU ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_auto_times_a_short_run_and_stays_eager():
    cb = CompileModel(when="auto")
    model = ImageClassifier(convnet())
    trainer = quiet_trainer(accelerator="gpu", devices=1, max_steps=20, callbacks=[cb])
    trainer.fit(model, _data(64, 8))
    assert cb.step_seconds is not None and cb.step_seconds > 0
    assert cb.decision is not None and cb.decision.compile is False and "below" in cb.decision.reason
    assert cb.compiled_calls == 0


@pytest.mark.gpu
def test_gpu_cuda_graphs_train_and_validate_like_eager():
    """mode=None on one CUDA device compiles a conv net with CUDA graphs; 12 training steps (a last partial
    batch included, run eagerly) and two validations end on the eager run's weights."""
    torch.manual_seed(0)
    initial = ImageClassifier(convnet(), lr=0.05, fused=False)

    def run(callbacks: list) -> ImageClassifier:
        model = copy.deepcopy(initial)
        trainer = quiet_trainer(
            accelerator="gpu",
            devices=1,
            max_epochs=2,
            callbacks=callbacks,
            num_sanity_val_steps=0,
            deterministic=False,
        )
        trainer.fit(model, _data(52, 8), _data(20, 8, seed=1))
        return model.cpu()

    cb = CompileModel()
    graphs, eager = run([cb]), run([])
    assert cb.mode_used == "reduce-overhead" and "CUDA graphs" in (cb.mode_reason or "")
    assert cb.cuda_graphs is True and cb.cuda_graphs_skipped is None  # torch skipped none
    # an epoch: 6 full training batches and a partial one, 2 full validation batches and a partial one
    assert cb.compiled_calls == 12 + 2 * 2 and cb.eager_calls == 2 + 2
    for a, b in zip(graphs.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
def test_gpu_outputs_kept_across_cuda_graph_steps_stay_valid():
    """A module keeping its logits for the epoch's end (Lightning's documented pattern) reads them back
    intact after later steps replayed the graphs."""
    import torch.nn.functional as F

    class Keeps(ImageClassifier):
        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self(x)
            self.kept.append((logits.detach(), logits.detach().clone()))  # the second: an eager copy
            return F.cross_entropy(logits, y)

    model = Keeps(convnet())
    model.kept = []
    cb = CompileModel()
    trainer = quiet_trainer(accelerator="gpu", devices=1, max_steps=8, callbacks=[cb], num_sanity_val_steps=0)
    trainer.fit(model, _data(64, 8))
    assert cb.mode_used == "reduce-overhead" and len(model.kept) == 8
    for kept, copy_at_the_time in model.kept:  # read after every later step ran
        torch.testing.assert_close(kept, copy_at_the_time)


@pytest.mark.gpu
def test_gpu_an_input_changed_in_place_skips_cuda_graphs_and_is_named():
    """The pattern torch skips silently: forward normalizes its input in place."""

    class InPlace(ImageClassifier):
        def forward(self, x):
            return self.model(x.mul_(0.5))

    torch.compiler.reset()
    _warnings().clear()
    compile_mod._GRAPH_RESULTS.clear()
    cb = CompileModel()
    trainer = quiet_trainer(accelerator="gpu", devices=1, max_steps=5, callbacks=[cb], num_sanity_val_steps=0)
    with pytest.warns(UserWarning, match="CUDA graphs were skipped: mutated inputs"):
        trainer.fit(InPlace(convnet()), _data(64, 8))
    assert cb.mode_used == "reduce-overhead" and cb.cuda_graphs is False
    assert (cb.cuda_graphs_skipped or "").startswith(
        "mutated inputs"
    )  # torch's words (and its line, if found)
