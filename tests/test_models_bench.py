"""benchmarks/models.py: its --quick CPU run on two stand-ins (the search, the turns, the preset read back,
the JSON), the configurations each --search tries, and the zoo's stand-ins and plain loop."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_benchmarks import load


def modules() -> tuple[Any, Any]:
    """The script and the ``_zoo`` it imports (one module, so its classes are the script's)."""
    models = load("models.py")
    return models, importlib.import_module("_zoo")


ROW_KEYS = {
    "name", "family", "batch_size", "search", "ceiling_samples_per_sec", "ceiling_config", "ceiling_p50_ms",
    "ceiling_p90_ms", "ceiling_spread", "preset_samples_per_sec", "preset_config", "preset_p50_ms",
    "preset_p90_ms", "preset_spread", "ratio", "ratio_worst", "target_met", "repeats", "ceiling_grad_scale",
}  # fmt: skip
PRESET_KEYS = {"precision", "channels_last", "compile", "compile_mode", "optimizers", "fused", "callbacks"}


@pytest.fixture
def one_thread(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    monkeypatch.setenv("LIGHTNING_GPUOPT_CACHE_DIR", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_quick_run_writes_a_row_a_model(tmp_path: Path, one_thread: Any) -> None:
    models = load("models.py")
    out = tmp_path / "models.json"
    assert models.main(["--quick", "--models", "resnet50,gpt2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {"machine", "command", "date", "rows", "target", "min_ratio"} <= set(doc)
    assert doc["complete"] is True and doc["models_left"] == []
    rows = {r["name"]: r for r in doc["rows"]}
    assert list(rows) == ["resnet50", "gpt2"]
    for row in rows.values():
        assert set(row) >= ROW_KEYS, ROW_KEYS - set(row)
        assert row["error"] is None and row["repeats"] == 2
        ceiling, preset = row["ceiling_samples_per_sec"], row["preset_samples_per_sec"]
        assert ceiling > 0 and preset > 0
        assert row["ratio"] == pytest.approx(preset / ceiling) and row["ratio_to_ceiling"] == row["ratio"]
        assert row["ceiling_min"] <= ceiling <= row["ceiling_max"] and row["ceiling_p50_ms"] > 0
        assert len(row["ceiling_repeats"]) == len(row["preset_repeats"]) == 2
        # the ceiling is the search's fastest configuration; on a CPU the search runs eager
        fastest = max((s for s in row["search"] if s["samples_per_sec"]), key=lambda s: s["samples_per_sec"])
        assert row["ceiling_config"]["name"] == fastest["config"]["name"]
        assert all(s["config"]["compile"] == "eager" for s in row["search"]) and row["search_note"]
        assert set(row["preset_config"]) >= PRESET_KEYS, row["preset_config"]
        assert row["preset_config"]["compile"] is False  # CompileModel(when="auto") compiles on CUDA only
    # the user's optimizers, as the preset left them: SGD for the conv net, AdamW for the LM
    assert rows["resnet50"]["preset_config"]["optimizers"] == ["SGD"]
    assert rows["gpt2"]["preset_config"]["optimizers"] == ["AdamW"]
    assert rows["resnet50"]["preset_config"]["channels_last"] is True
    assert rows["gpt2"]["preset_config"]["channels_last"] is False
    assert rows["gpt2"]["ceiling_tokens_per_sec"] == pytest.approx(
        32 * rows["gpt2"]["ceiling_samples_per_sec"]
    )


def test_each_finished_model_is_written_before_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    models = load("models.py")
    out = tmp_path / "models.json"

    def row(name: str, args: Any) -> dict[str, Any]:
        if name == "gpt2":  # a run stopped by its time limit during the second model
            raise KeyboardInterrupt
        return {"name": name, "ratio": 0.95, "error": None}

    monkeypatch.setattr(models, "model_row", row)
    with pytest.raises(KeyboardInterrupt):
        models.main(["--quick", "--models", "resnet50,gpt2", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert [r["name"] for r in doc["rows"]] == ["resnet50"]
    assert doc["complete"] is False and doc["models_left"] == ["gpt2"] and doc["min_ratio"] == 0.95


def test_update_keeps_the_rows_of_models_not_run(tmp_path: Path) -> None:
    models = load("models.py")
    path = tmp_path / "m.json"
    path.write_text(
        json.dumps({"rows": [{"name": "gpt2", "ratio": 0.9}, {"name": "vit_b_16", "ratio": 1.0}]})
    )
    assert models.kept_rows(path, ["gpt2"]) == [{"name": "vit_b_16", "ratio": 1.0}]
    assert models.kept_rows(tmp_path / "none.json", ["gpt2"]) == []


def test_an_out_file_that_is_not_results_is_named_before_any_work(tmp_path: Path) -> None:
    models = load("models.py")
    for text in ("{not json", '["a list"]', '{"rows": 3}'):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ValueError, match=r"bad\.json is not a results file .*pass another path or remove it"):
            models.kept_rows(bad, ["gpt2"])
        with pytest.raises(ValueError, match="bad.json is not a results file"):  # --advise-only reads it first
            models.main(["--quick", "--models", "gpt2", "--advise-only", "--out", str(bad)])
        assert bad.read_text() == text  # left as it was


def test_search_configurations() -> None:
    models, zoo = modules()
    config = zoo.Config
    twin = config("default", "fp16", True, True)
    quick, note = models.search_configs(zoo.ZOO["resnet50"], "quick", twin, "cuda")
    names = ["eager:bf16:cl", "default:bf16:cl", "reduce-overhead:bf16:cl", "default:fp16:cl"]
    assert [c.name for c in quick] == names
    assert note is None
    lm, _ = models.search_configs(zoo.ZOO["gpt2"], "quick", config("eager", "bf16", False, False), "cuda")
    assert [c.name for c in lm] == ["eager:bf16", "default:bf16", "reduce-overhead:bf16", "eager:bf16:unfused"]
    full, _ = models.search_configs(zoo.ZOO["convnext_tiny"], "full", twin, "cuda")
    assert len(full) == 5 * 2 * 2 + 4 and {c.compile for c in full} == set(zoo.COMPILE_MODES)
    full_lm, _ = models.search_configs(zoo.ZOO["gpt2"], "full", twin, "cuda")
    assert not any(c.channels_last for c in full_lm if c != twin)
    cpu, note = models.search_configs(zoo.ZOO["resnet50"], "quick", twin, "cpu")
    assert {c.compile for c in cpu} == {"eager"} and "CPU" in note
    named, _ = models.search_configs(zoo.ZOO["resnet50"], "max-autotune:fp16:cl,eager:bf16", twin, "cpu")
    assert [c.name for c in named] == ["max-autotune:fp16:cl", "eager:bf16"]  # named: run as named


def test_config_names_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    models, zoo = modules()
    for name in ("eager:bf16", "default:fp16:cl", "max-autotune-no-cudagraphs:bf16:cl:unfused", "eager:fp32"):
        assert zoo.Config.parse(name).name == name
    for bad in ("default", "jit:bf16", "default:int8", "default:bf16:nhwc"):
        with pytest.raises(ValueError, match="mode:dtype"):
            zoo.Config.parse(bad)
    with pytest.raises(SystemExit):
        models.parse_args(["--search", "fast"])
    assert "--search" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        models.parse_args(["--models", "resnet50,bert"])
    assert "unknown ['bert']" in capsys.readouterr().err


def test_a_compile_past_its_deadline_is_stopped() -> None:
    import time

    models = load("models.py")
    with pytest.raises(TimeoutError, match="--compile-timeout"), models.deadline(0.05, "compiling x"):
        time.sleep(2)
    with models.deadline(0, "no limit"):
        time.sleep(0.01)


@pytest.mark.parametrize("name", ["resnet50", "vit_b_16", "convnext_tiny", "efficientnet_b0", "fcn_resnet50",
                                  "gpt2"])  # fmt: skip
def test_each_stand_in_trains_a_step(name: str) -> None:
    zoo = modules()[1]
    spec = zoo.ZOO[name]
    x, ys = zoo.batches(spec, True, "cpu")
    module = zoo.ZooModule(spec, quick=True)
    loss = zoo.task_loss(module(x), ys[0])
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in module.parameters() if p.requires_grad)
    expected = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[spec.optimizer]
    assert type(module.configure_optimizers()) is expected
    loop = zoo.ZooLoop(spec, zoo.Config("eager", "fp32", spec.images), "cpu", quick=True)
    assert loop.warm(2) > 0 and loop.x.shape == x.shape


def test_full_models_name_what_to_install() -> None:
    zoo = modules()[1]
    for name, module in (("resnet50", "torchvision"), ("gpt2", "transformers")):
        if importlib.util.find_spec(module) is None:
            with pytest.raises(ModuleNotFoundError, match=f"pip install.*{module}|{module}.*pip install"):
                zoo.ZOO[name].make(quick=False)


def test_zoo_examples_run() -> None:
    zoo = modules()[1]
    results = [doctest.DocTestRunner().run(t) for t in doctest.DocTestFinder().find(zoo, zoo.__name__)]
    assert sum(r.attempted for r in results) >= 4 and sum(r.failed for r in results) == 0


def test_the_preset_twin_is_what_the_preset_picks_on_a_cpu() -> None:
    models, zoo = modules()
    from lightning_gpuopt import choose_precision

    for name, channels_last in (("resnet50", True), ("gpt2", False)):
        twin = models.preset_twin(zoo.ZOO[name].make(quick=True), "cpu")
        dtype = {"bf16-mixed": "bf16", "32-true": "fp32"}[choose_precision("cpu")]
        assert twin == zoo.Config("eager", dtype, channels_last, fused=False), twin  # no compile on a CPU


def test_advise_runs_the_monitor_and_advisor_on_a_zoo_model(tmp_path: Path, one_thread: Any) -> None:
    models = load("models.py")
    out = tmp_path / "models.json"
    assert models.main(["--quick", "--models", "gpt2", "--advise", "--out", str(out)]) == 0
    advice = json.loads(out.read_text())["rows"][0]["advisor"]
    assert list(advice) == ["healthy", "starved", "fp32"]
    assert advice["healthy"]["pass"] is True and advice["healthy"]["got"] == []
    # the starved loader waits two preset steps before each batch: the advisor names the loader
    starved = advice["starved"]
    assert starved["pass"] is True and any(g.startswith("input-bound") for g in starved["got"])
    assert starved["loader_delay_ms"] > 0 and starved["p50_ms"] > advice["healthy"]["p50_ms"]
    assert starved["data_wait_frac"] > 0.3
    assert advice["fp32"]["pass"] is None  # fp32 on tensor cores needs a GPU to be judged
    assert {"samples_per_sec", "gpu_util_mean", "verdicts", "seconds"} <= set(advice["fp32"])


def test_advise_only_adds_the_scenarios_to_the_rows_of_a_file(tmp_path: Path, one_thread: Any) -> None:
    models = load("models.py")
    out = tmp_path / "r" / "models.json"
    assert models.main(["--quick", "--models", "gpt2", "--advise-only", "--out", str(out)]) == 0  # no file
    alone = json.loads(out.read_text())["rows"]
    assert [set(r) for r in alone] == [{"name", "advisor", "advisor_run"}] and alone[0]["name"] == "gpt2"
    assert models.main(["--quick", "--models", "gpt2", "--out", str(out)]) == 0
    before = json.loads(out.read_text())["rows"][0]
    assert "advisor" not in before
    assert models.main(["--quick", "--models", "gpt2", "--advise-only", "--out", str(out)]) == 0
    after = json.loads(out.read_text())["rows"][0]
    assert {k: v for k, v in after.items() if not k.startswith("advisor")} == before  # the turns are kept
    advice = after["advisor"]
    assert list(advice) == ["healthy", "starved", "fp32"]
    assert advice["healthy"]["pass"] and advice["starved"]["pass"]
    # the starved loader waited two of the healthy fit's median steps before each batch
    assert advice["starved"]["loader_delay_ms"] == pytest.approx(2 * advice["healthy"]["p50_ms"], abs=0.01)
    assert after["advisor_run"]["seconds"] > 0
    assert {"command", "date", "machine"} <= set(after["advisor_run"])


def test_rows_say_where_fp16s_grad_scaler_ended(tmp_path: Path, one_thread: Any) -> None:
    """An fp16 ceiling records its GradScaler's last scale (far below its start: steps were skipped)."""
    models = load("models.py")
    out = tmp_path / "models.json"
    models.main(["--quick", "--models", "resnet50", "--search", "eager:fp16:cl", "--only-ceiling", "--out", str(out)])
    row = json.loads(out.read_text())["rows"][0]
    assert row["ceiling_config"]["dtype"] == "fp16" and 0 < row["ceiling_grad_scale"] <= 65536.0
