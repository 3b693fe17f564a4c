"""The benchmark scripts against today's API: each maintained script's ``--quick`` CPU run in this process
(a few rows, one turn), the pure pieces, the run-all step list, and the size rules of ``benchmarks/``
(at most 5,100 lines in all, no function over 80 lines)."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
MAX_LINES, MAX_FUNCTION_LINES = 5100, 80

#: script -> its --quick arguments here ({tmp}: the test's folder, {data}: the module's shared data folder)
QUICK: dict[str, tuple[str, ...]] = {
    "compute.py": ("--rows", "fp32,preset", "--repeats", "1"),
    "feeds.py": ("--feeds", "resident,hdf5,hdf5:inline,folder:0", "--repeats", "1", "--data", "{data}"),
    "overhead.py": ("--rows", "monitor,nvtx", "--repeats", "1", "--tensorboard", "{tmp}/tb"),
    "advisor.py": ("--only", "healthy,too-few-workers", "--data", "{data}"),
    "ladder.py": ("--rows", "naive,+hdf5", "--repeats", "1"),
    "peers.py": (
        "--only",
        "ours_resident,ours_hdf5",
        "--repeats",
        "1",
        "--loader-batches",
        "0",
        "--data",
        "{data}",
    ),
    "ddp_scaling.py": ("--rows", "plain_1gpu,plain_ddp", "--repeats", "1", "--data", "{data}"),
}
#: rows every named script's results must hold, each with a positive rate
ROWS: dict[str, tuple[str, ...]] = {
    "compute.py": ("ceiling", "fp32", "preset"),
    "feeds.py": ("ceiling", "resident", "hdf5", "hdf5:inline", "folder:0"),
    "overhead.py": ("off", "monitor", "nvtx", "ceiling"),
    "advisor.py": ("healthy", "too-few-workers"),
    "ladder.py": ("naive", "+hdf5", "ceiling_eager"),
    "peers.py": ("ceiling_compiled", "ours_resident", "ours_hdf5"),
    "ddp_scaling.py": ("plain_1gpu", "plain_ddp"),
}
#: scripts checked otherwise, and how
OTHERS = {
    "accuracy_parity.py": "tests/test_accuracy_parity.py runs it; --help here",
    "stores.py": "tests/test_stores_bench.py runs its --quick and its eviction check",
    "models.py": "tests/test_models_bench.py runs its --quick on two stand-ins and its search lists",
    "jpeg.py": "tests/test_jpeg_bench.py runs its --quick, its hiding of DALI and its images' description",
    "energy.py": "tests/test_energy_bench.py runs its --quick and its rows' pieces",
}


def load(script: str) -> ModuleType:
    """A script as a module, its folder first on ``sys.path`` as ``python benchmarks/<script>`` has it."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"benchmarks_{Path(script).stem}", BENCH / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _missing(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data folder for the module: the scripts that share generated images make them once."""
    return tmp_path_factory.mktemp("bench_data")


@pytest.fixture
def quiet_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """One intra-op thread (loader workers and DALI threads share 2 CPUs), a cache of the test's own."""
    monkeypatch.setenv("LIGHTNING_GPUOPT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_every_script_is_checked() -> None:
    scripts = {p.name for p in BENCH.glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(QUICK) | set(OTHERS), (
        "add the script to QUICK (or OTHERS, saying how it is checked)"
    )


@pytest.mark.parametrize("script", sorted(QUICK))
def test_quick_run(script: str, tmp_path: Path, data_root: Path, quiet_cpu: Any) -> None:
    if script in ("feeds.py", "ladder.py", "peers.py", "ddp_scaling.py") and _missing("h5py"):
        pytest.skip(
            f"{script} --quick makes an HDF5 store: needs h5py (pip install 'lightning-gpuopt[test]')"
        )
    out = tmp_path / "out" / "result.json"
    args = [a.format(tmp=tmp_path, data=data_root) for a in QUICK[script]]
    assert load(script).main(["--quick", "--out", str(out), *args]) == 0
    doc = json.loads(out.read_text())
    assert {"machine", "command", "date", "rows"} <= set(doc)
    rows = {r["name"]: r for r in doc["rows"]}
    assert set(ROWS[script]) <= set(rows), (
        f"{script}: rows {sorted(rows)} lack {set(ROWS[script]) - set(rows)}"
    )
    for name in ROWS[script]:
        assert rows[name]["samples_per_sec"] > 0, rows[name]
        if script not in ("ladder.py", "advisor.py"):  # the harness's rows: medians, spread, turns
            assert {"ratio_to_ceiling", "p50_ms", "p90_ms", "repeats", "of_ceiling_worst"} <= set(rows[name])
            assert rows[name]["repeats"] and rows[name]["error"] is None
    if script == "advisor.py":
        assert rows["healthy"]["pass"] is True and rows["too-few-workers"]["pass"] is True, rows
    if script == "ddp_scaling.py":
        assert rows["plain_ddp"]["gpus"] == 2 and doc["scaling"]["plain_ddp"] > 0
    if script == "overhead.py":
        assert doc["tensorboard_log_dir"] and Path(doc["tensorboard_log_dir"]).is_dir()


def test_quick_mode_writes_no_recorded_result(tmp_path: Path) -> None:
    shared = load("_shared.py")
    assert shared.results_path(None, "feeds", quick=True).parent == Path(tempfile.gettempdir())
    recorded = shared.results_path(None, "feeds", quick=False)
    assert recorded.parent == BENCH / "results" and recorded.name.endswith("-feeds-cpu.json")
    assert shared.results_path(str(tmp_path / "x.json"), "feeds", quick=True) == tmp_path / "x.json"


@pytest.mark.parametrize("script", ["peers", "jpeg"])
def test_feed_scripts_write_dated_results_by_default(script: str) -> None:
    """Like every script, ``peers.py`` and ``jpeg.py`` write ``results/<date>-<subject>-<machine>.json``
    (scratch that git ignores), a ``--quick`` run to the temp folder."""
    parse = load(f"{script}.py").parse_args
    recorded = parse([])
    assert Path(recorded.out) == load("_shared.py").results_path(None, script, quick=False)
    assert "results_subject" not in vars(recorded)
    assert Path(parse(["--quick"]).out).parent == Path(tempfile.gettempdir())


def test_feed_specs() -> None:
    feeds = load("feeds.py")
    assert feeds.parse_feed("hdf5:8") == ("hdf5", 8) and feeds.parse_feed("dali:cpu") == ("dali", "cpu")
    assert feeds.parse_feed("folder") == ("folder", None)
    assert feeds.parse_feed("hdf5:inline") == ("hdf5", "inline")
    for bad in ("lmdb", "dali:8", "hdf5:cpu", "hdf5:pread"):
        with pytest.raises(ValueError, match="feed"):
            feeds.parse_feed(bad)


def test_ddp_repetition_and_scaling() -> None:
    ddp = load("ddp_scaling.py")
    from lightning_gpuopt.bench.steady import Measurement

    both = ddp.combine([Measurement(8, 2.0, (1.0, 3.0)), Measurement(8, 4.0, (2.0, 2.0))])
    assert both.samples_per_sec == 4.0 and both.step_ms == (2.0, 3.0)  # the slower rank sets the pace

    def rate(samples: int) -> list[Measurement | BaseException]:
        return [Measurement(samples, 1.0, (10.0,))]

    results = {"plain_1gpu": rate(100), "plain_ddp": rate(192), "lightning_ddp": rate(191),
               "hdf5_ddp": [RuntimeError("x")]}  # fmt: skip
    figures = ddp.scaling_of(results)
    assert figures["scaling"]["plain_ddp"] == pytest.approx(1.92) and figures["scaling"]["hdf5"] is None
    targets = figures["targets"]
    assert targets["synthetic >= 1.9"] is True and targets["hdf5 >= 1.9"] is None
    assert targets["plain_ddp - synthetic <= 0.02"] is True


def test_compute_preset_against_the_best_manual_row() -> None:
    compute = load("compute.py")
    from lightning_gpuopt.bench.steady import Measurement

    out = compute.summary(
        {
            "ceiling": [Measurement(10, 1.0, (1.0,))],
            "fp32": [Measurement(5, 1.0, (1.0,))],
            "16-mixed": [Measurement(8, 1.0, (1.0,))],
            "preset": [Measurement(9, 1.0, (1.0,))],
        }
    )
    assert out == {"preset_to_best": pytest.approx(9 / 8), "best_row": "16-mixed"}  # fmt: skip


@pytest.mark.parametrize("script", sorted(OTHERS))
def test_help(script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as exit_:
        load(script).main()
    assert exit_.value.code == 0 and "--out" in capsys.readouterr().out


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_benchmarks_fit_in_5100_lines() -> None:
    files = sorted(p for p in BENCH.iterdir() if p.suffix in (".py", ".sh"))
    total = sum(_lines(p) for p in files)
    assert total <= MAX_LINES, ", ".join(f"{p.name} {_lines(p)}" for p in files)


@pytest.mark.parametrize("script", [p.name for p in sorted(BENCH.glob("*.py"))])
def test_no_function_over_80_lines(script: str) -> None:
    tree = ast.parse((BENCH / script).read_text())
    long = [f"{node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines"
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]  # fmt: skip
    assert not long, f"{script}: split {long}"


def test_one_module_holds_the_benchmarks_models_and_plain_loop() -> None:
    """LightningModules and plain training loops are ``_zoo.py``'s; the scripts import them from there."""
    elsewhere = []
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef) or path.name == "_zoo.py":
                continue
            bases = {getattr(b, "attr", getattr(b, "id", "")) for b in node.bases}
            if (
                "LightningModule" in bases
                or any(b.endswith(("Classifier", "Loop")) for b in bases)
                or (node.name.endswith("Loop"))
            ):
                elsewhere.append(f"{path.name}: {node.name}")
    assert elsewhere == []


def _run_all(tmp: Path, *steps: str) -> list[str]:
    env = {**os.environ, "SUITE_DRY_RUN": "1", "CUDA_VISIBLE_DEVICES": "",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # fmt: skip
    proc = subprocess.run(["bash", str(BENCH / "run_all.sh"), *steps], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stdout.splitlines() if line.startswith("=== ")]


def test_run_all_runs_scripts_that_exist(tmp_path: Path) -> None:
    lines = _run_all(tmp_path)
    steps = [line.split(":", 1)[0][4:] for line in lines]
    assert steps == ["tests", "ladder", "peers", "compute", "feeds", "overhead", "advisor"]
    assert "pytest -m gpu" in lines[0] and "peers.py --out /tmp/run_all/results/" in lines[2]
    assert re.search(r"--out /tmp/run_all/results/\d{4}-\d{2}-\d{2}-peers-gpu\.json$", lines[2]), lines[2]
    for line in lines:
        scripts = [w for w in line.split(": ", 1)[1].split() if w.endswith(".py")]
        assert all((REPO / s).is_file() for s in scripts), line
    named = _run_all(tmp_path, "ddp_scaling", "parity", "jpeg", "stores", "models")
    assert "skipped (needs two GPUs" in named[0] and "accuracy_parity.py --size gpu" in named[1]
    for line, script in zip(named[2:], ("jpeg", "stores", "models"), strict=True):
        assert f"benchmarks/{script}.py --out /tmp/run_all/results/" in line, line
    assert named[-1].endswith("-models-gpu.json"), named[-1]


def test_screenshot_tool_finds_the_demo_runs_fit(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "screenshot_tensorboard", REPO / "tools" / "screenshot_tensorboard.py"
    )
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    demo = tmp_path / "demo"
    for n in (0, 2, 10):
        (demo / f"version_{n}" / "tensorboard" / "fit").mkdir(parents=True)
    (demo / "version_10" / "tensorboard" / "00_naive" / "fit_0").mkdir(parents=True)
    assert tool.resolve_logdir(demo) == demo / "version_10" / "tensorboard" / "fit"  # the newest, by number
    assert tool.resolve_logdir(demo / "version_2") == demo / "version_2" / "tensorboard" / "fit"
    plain = tmp_path / "tb"
    plain.mkdir()
    assert tool.resolve_logdir(plain) == plain
    with pytest.raises(FileNotFoundError, match="--logdir"):
        tool.resolve_logdir(tmp_path / "missing")


def test_peers_merge_keeps_each_rows_own_ceiling(tmp_path: Path) -> None:
    peers = load("peers.py")
    write = load("_shared.py").write_results
    a = write(
        tmp_path / "a.json",
        [
            {"name": "ceiling_compiled", "samples_per_sec": 100.0},
            {"name": "ours_hdf5", "samples_per_sec": 98.0, "of_ceiling": 0.98},
        ],
        images=8,
    )
    b = write(
        tmp_path / "b.json",
        [
            {"name": "ceiling_compiled", "samples_per_sec": 90.0},
            {"name": "webdataset", "samples_per_sec": 45.0, "of_ceiling": 0.5},
        ],
        images=9,
        disk_read_gbps_o_direct=0.86,
    )
    doc = json.loads(peers.merge([str(a), str(b)], str(tmp_path / "m.json")).read_text())
    rows = {r["name"]: r for r in doc["rows"]}
    assert set(rows) == {"ceiling_compiled_run1", "ours_hdf5", "ceiling_compiled_run2", "webdataset"}
    assert rows["webdataset"]["ceiling_run"] == 2 and rows["webdataset"]["of_ceiling"] == 0.5
    assert len(doc["runs"]) == 2
    assert (
        doc["images"] == 8 and doc["disk_read_gbps_o_direct"] == 0.86
    )  # each key from the first run with it


def test_peers_refuses_an_unknown_row(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load("peers.py").parse_args(["--only", "ours_hdf5,ffcv"])
    assert "unknown rows ['ffcv']" in capsys.readouterr().err
