"""The benchmark scripts run against today's API: each one's ``--quick`` CPU mode end to end (``--help`` for
the scripts whose CPU mode takes minutes or that need a GPU), the GPU suite's step list, and the TensorBoard
screenshot tool's folder lookup."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"


@dataclass(frozen=True)
class Quick:
    """One script's ``--quick`` run: extra arguments (``{data}``: a shared data folder, ``{tmp}``: the test's
    own), the modules it needs, row names and top-level keys its results file must hold, and whether
    ``--out`` names a folder; ``measure`` is the row key every named row must hold a positive number in."""

    args: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    rows: tuple[str, ...] = ()
    out_is_folder: bool = False
    extra_keys: tuple[str, ...] = ()
    measure: str = "samples_per_sec"


QUICK: dict[str, Quick] = {
    "gpu_dali.py": Quick(
        ("--data-root", "{data}"),
        ("nvidia.dali",),
        (
            "ceiling (plain loop, batch on GPU)",
            'DALI pipeline alone (no model), decoder="gpu"',
            "Lightning + DALI (defaults)",
        ),
        extra_keys=("pixel_check",),
    ),
    "gpu_dali_decode.py": Quick(
        ("--data-root", "{data}"),
        ("nvidia.dali",),
        ("nvJPEG, 8 threads", "ceiling again (end of run)"),
    ),
    "cpu_hdf5_getitems.py": Quick(
        ("--data", "{data}"),
        ("h5py",),
        ("32px h5py per-item", "32px dataset __getitems__", "32px DataLoader w2 __getitems__"),
    ),
    "gpu_pipeline_diag.py": Quick(
        ("--data-root", "{data}"), ("h5py",), ("default: continuous epochs, staged on the GPU",)
    ),
    "gpu_hdf5.py": Quick(
        ("--data-root", "{data}"),
        ("h5py",),
        ("ceiling: plain loop, batch on GPU", "Lightning + HDF5 __getitems__, workers=1"),
    ),
    "gpu_workers.py": Quick(
        ("--data", "{data}/workers_jpegs", "--cache-dir", "{tmp}/tune"),
        (),
        ("0 workers", "tuned (num_workers='auto')", "sweep 1 workers"),
    ),
    "cpu_workers.py": Quick(
        ("--data", "{data}/workers_jpegs", "--cache-dir", "{tmp}/tune"), (), ("tuned (num_workers='auto')",)
    ),
    "gpu_monitor.py": Quick(
        ("--tb-dir", "{tmp}/tb"), (), ("lightning, GPUStatsMonitor on",), extra_keys=("tensorboard_log_dir",)
    ),
    "gpu_nvtx.py": Quick((), (), ("off", "steps", "modules_depth2")),
    "cpu_nvtx_hooks.py": Quick(
        (), ("nvtx",), ("direct/idle/phases", "lightning/live/modules_depth1"), measure="step_us"
    ),
    "gpu_compute.py": Quick((), (), ("fp32", "preset", "plain 16-mixed+channels_last")),
    "gpu_compile.py": Quick(
        ("--data-root", "{data}"),
        ("h5py",),
        (
            "ceiling_eager",
            "ceiling_compiled",
            "naive",
            "hdf5",
            "hdf5+compile",
            "lightning+compile",
            "lightning+compile+gpu_aug",
            "loader_hdf5",
            "dali+compile",
            "loader_dali_cpu",
        ),
        out_is_folder=True,
        extra_keys=("summary",),
    ),
    "gpu_advisor.py": Quick(
        ("--data-root", "{data}"), (), ("decode-bound", "too-few-workers", "healthy", "unfused-fp16")
    ),
    "gpu_idle.py": Quick(
        ("--data-root", "{data}"), (), ("gpu-resident", "naive", "throttled-50"), out_is_folder=True
    ),
}
#: scripts checked with ``--help`` only, and why not ``--quick``
HELP_ONLY: dict[str, str] = {
    "gpu_advisor_scenarios.py": "it refuses to run without a CUDA GPU",
    "gpu_ddp.py": "test_ddp_quick_chain runs its --quick",
    "gpu_ddp_scaling.py": "test_ddp_quick_chain runs its --quick on gpu_ddp.py's checks",
    "ddp_report.py": "test_ddp_report_rebuilds runs it on fixed results files",
    "gpu_ladder.py": "the ladder it drives runs in tests/test_demo.py; its quick run takes half a minute",
    "accuracy_parity.py": "tests/test_accuracy_parity.py runs it",
    "augment_cost.py": "test_augment_cost_on_cpu runs it on a small batch",
}


def test_augment_cost_on_cpu(tmp_path):
    script = Path(__file__).parents[1] / "benchmarks" / "augment_cost.py"
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            "--device",
            "cpu",
            "--batch",
            "4",
            "--iters",
            "2",
            "--out",
            str(tmp_path),
        ],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "augment_cost_cpu.json").read_text())
    rows = {r["name"]: r for r in result["rows"]}
    for mode in ("train", "eval"):
        for kind in ("plain", "antialias"):
            row = rows[f"{mode}_{kind}_float32"]
            assert row["ms_per_batch"] > 0 and row["samples_per_sec"] > 0


def _env(tmp: Path) -> dict[str, str]:
    return {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        # one intra-op thread a run: with DALI threads and loader workers, two would oversubscribe 2 CPUs
        "OMP_NUM_THREADS": "1",
        "LIGHTNING_GPUOPT_CACHE_DIR": str(tmp / "cache"),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "PYTHONWARNINGS": "ignore",
    }


def _run(args: list[str], tmp: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    # cwd is the test's folder: a script that fell back to a relative default path writes there, not the repo
    return subprocess.run(args, cwd=tmp, env=_env(tmp), capture_output=True, text=True, timeout=timeout)


def _missing(modules: tuple[str, ...]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data folder for the module, so scripts that share generated images make them once."""
    return tmp_path_factory.mktemp("bench_data")


def test_every_benchmark_script_is_checked() -> None:
    scripts = {p.name for p in BENCH.glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(QUICK) | set(HELP_ONLY), "add the script to QUICK or HELP_ONLY"


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(QUICK))
def test_quick_run(script: str, tmp_path: Path, data_root: Path) -> None:
    case = QUICK[script]
    missing = _missing(case.needs)
    if missing:
        pytest.skip(f"{script} --quick needs {', '.join(missing)} (pip install 'lightning-gpuopt[test]')")
    out = tmp_path / "out" if case.out_is_folder else tmp_path / "out" / "result.json"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    args = [a.format(data=data_root, tmp=tmp_path) for a in case.args]
    proc = _run([sys.executable, str(BENCH / script), "--quick", "--out", str(out), *args], cwd, 300)
    assert proc.returncode == 0, f"{script} --quick failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    files = sorted(out.glob("*.json")) if case.out_is_folder else [out]
    assert len(files) == 1, files
    doc = json.loads(files[0].read_text())
    assert {"machine", "command", "date", "rows"} <= set(doc)
    assert all(isinstance(r.get("name"), str) and "samples_per_sec" in r for r in doc["rows"])
    names = [r["name"] for r in doc["rows"]]
    assert set(case.rows) <= set(names), f"{script}: rows {names} lack {set(case.rows) - set(names)}"
    for key in case.extra_keys:
        assert doc.get(key), f"{script}: results lack {key!r}"
    # every named row that ran measured a rate (a scenario skipped on the CPU says so instead)
    ran = [r for r in doc["rows"] if r["name"] in case.rows and not r.get("skipped")]
    assert all(isinstance(r.get(case.measure), (int, float)) and r[case.measure] > 0 for r in ran), ran
    if script == "gpu_dali.py":
        pixels = doc["pixel_check"]
        assert pixels["raw_decode_max_abs_diff"] <= 1.0  # libjpeg-turbo decodes on both sides here
        # the evaluation crops are exact copies of the same resize on both sides: rounding apart
        assert pixels["eval_mean_abs_diff"] < 1.0 and pixels["eval_max_abs_diff"] <= 2.0
    if script == "gpu_compile.py":
        _check_compile_results(doc)
    assert not list(cwd.rglob("*.json")), "a results file landed in the working folder"


@pytest.mark.slow
def test_dali_decode_compiled_quick(tmp_path: Path, data_root: Path) -> None:
    """``gpu_dali_decode.py --compiled``: every set-up fed to each model named, in rounds, medians reported."""
    if _missing(("nvidia.dali",)):
        pytest.skip("gpu_dali_decode.py needs nvidia.dali (pip install 'lightning-gpuopt[test]')")
    out = tmp_path / "result.json"
    args = ["--quick", "--compiled", "--repeats", "2", "--models", "compiled,graphs,eager"]
    proc = _run(
        [
            sys.executable,
            str(BENCH / "gpu_dali_decode.py"),
            *args,
            "--data-root",
            str(data_root),
            "--out",
            str(out),
        ],
        tmp_path,
        300,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    doc = json.loads(out.read_text())
    assert doc["compiled"] is True and doc["repeats"] == 2
    rows = {r["name"]: r for r in doc["rows"]}
    for model in ("compiled", "graphs", "eager"):
        assert rows[f"ceiling {model} (plain loop, batch on GPU)"]["samples_per_sec"] > 0
    setups = [r for r in doc["rows"] if "setup" in r]
    assert any(r["name"].startswith("CPU decoding") for r in setups)
    assert any("alternate_every" in r["setup"] for r in setups)  # pipelines taking turns
    for r in setups:
        for model in ("compiled", "graphs", "eager"):
            assert len(r[f"runs_ratio_to_ceiling_{model}"]) == 2
            assert r[f"samples_per_sec_{model}"] > 0
        assert r["samples_per_sec"] == r["samples_per_sec_compiled"]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--only", "nothing"], "--only"),
        (["--models", "compiled,jit"], "--models"),
        (["--repeats", "0"], "--repeats"),
    ],
)
def test_dali_decode_refuses_bad_arguments_before_work(tmp_path: Path, args: list[str], named: str) -> None:
    # refused before any image or model is made: the data folder stays empty
    data = tmp_path / "data"
    proc = _run(
        [
            sys.executable,
            str(BENCH / "gpu_dali_decode.py"),
            "--quick",
            "--compiled",
            "--data-root",
            str(data),
            *args,
        ],
        tmp_path,
        120,
    )
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr[-2000:]
    assert not data.exists()


def _check_compile_results(doc: dict) -> None:
    summary, rows = doc["summary"], {r["name"]: r for r in doc["rows"]}
    assert rows["ceiling_compiled"]["ratio_to_ceiling"] == pytest.approx(1.0)
    assert rows["ceiling_compiled"]["compile_s"] > 0 and summary["compile_seconds"]["ceiling_compiled"] > 0
    # the compiled fits ran compiled, the augmented one on canvases through the DataModule's hook
    for name in ("hdf5+compile", "lightning+compile", "lightning+compile+gpu_aug"):
        assert rows[name]["compiled_calls"] > 0 and rows[name]["eager_calls"] == 0, rows[name]
    assert isinstance(summary["aug_cost"], float)
    small = [r for r in doc["rows"] if r["name"].startswith("small_")]
    assert len(small) == 2 and all(r["epochs"] >= 4 and r["samples_per_sec"] > 0 for r in small), small
    assert all(isinstance(r["boundary_stall_s"], float) for r in small)
    targets = summary["targets_met"]
    assert "hdf5+compile >= 28x naive" in targets and "aug_cost <= 0.03" in targets
    assert all(v in (True, False, None) for v in targets.values())
    if "dali+compile" in rows and not rows["dali+compile"].get("skipped"):
        assert summary["dali_default_decoder"] == rows["dali+compile"]["decoder"]


def _compile_module():
    spec = importlib.util.spec_from_file_location("gpu_compile", BENCH / "gpu_compile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compile_summary_targets() -> None:
    summarize = _compile_module().summarize
    rows = [
        {"name": "ceiling_eager", "samples_per_sec": 6000.0},
        {"name": "ceiling_compiled", "samples_per_sec": 7400.0},
        {"name": "naive", "samples_per_sec": 250.0},
        {"name": "hdf5", "samples_per_sec": 5600.0},
        {"name": "hdf5+compile", "samples_per_sec": 7100.0},
        {"name": "dali+compile", "samples_per_sec": 6800.0},
        {"name": "lightning+compile", "samples_per_sec": 7300.0},
        {"name": "lightning+compile+gpu_aug", "samples_per_sec": 7000.0},
        {"name": "loader_hdf5", "samples_per_sec": 9000.0},
        {"name": "small_4096", "samples_per_sec": 5000.0, "images": 4096, "boundary_stall_s": 0.2},
        {"name": "small_8192", "samples_per_sec": 6000.0, "images": 8192, "boundary_stall_s": 0.2},
    ]
    summary = summarize(rows)
    targets = summary["targets_met"]
    assert targets["hdf5+compile >= 7000 img/s"] is True
    assert targets["hdf5+compile >= 0.95 of ceiling_compiled"] is True  # 7100 / 7400 = 0.959
    assert targets["dali+compile >= 0.93 of ceiling_compiled"] is False  # 0.919
    assert targets["hdf5+compile >= 28x naive"] is True  # 28.4
    assert targets["aug_cost <= 0.03"] is False and summary["aug_cost"] == pytest.approx(1 - 7000 / 7300)
    assert targets["loader_hdf5 >= 1.3x ceiling_compiled"] is False  # 1.216
    assert targets["loader_dali_gpu >= 1.3x ceiling_compiled"] is None  # not measured
    assert targets["hdf5 >= 0.98 x 0.967 of ceiling_eager"] is False  # 0.933 < 0.948
    assert targets["dali >= 0.98 x 0.986 of ceiling_eager"] is None
    assert summary["small_rate_ratio"] == pytest.approx(5000 / 6000)


def test_compile_epoch_figures() -> None:
    figures = _compile_module().epoch_figures
    # 4 batches an epoch of 0.5 s each; every boundary adds 0.2 s
    first, done = [0.5, 2.7, 4.9, 7.1], [2.0, 4.2, 6.4, 8.6]
    out = figures(first, done, batches=4, batch=10)
    assert out["step_s"] == pytest.approx(0.5)
    assert out["stalls_s"] == pytest.approx([0.2, 0.2, 0.2]) and out["boundary_stall_s"] == pytest.approx(0.2)
    assert out["samples_per_sec"] == pytest.approx(3 * 4 * 10 / 6.6)
    assert figures(first[:1], done[:1], batches=4, batch=10)["samples_per_sec"] is None


@pytest.mark.parametrize("script", sorted(HELP_ONLY))
def test_help(script: str, tmp_path: Path) -> None:
    proc = _run([sys.executable, str(BENCH / script), "--help"], tmp_path, 120)
    assert proc.returncode == 0, f"{script} --help failed:\n{proc.stderr[-4000:]}"
    assert "--out" in proc.stdout


def _suite(tmp: Path, *steps: str) -> list[str]:
    env = {
        **_env(tmp),
        "SUITE_DRY_RUN": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    proc = subprocess.run(
        ["bash", str(BENCH / "gpu_suite.sh"), *steps],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stdout.splitlines() if line.startswith("=== ")]


def test_gpu_suite_runs_scripts_that_exist(tmp_path: Path) -> None:
    lines = _suite(tmp_path)
    steps = [line.split(":", 1)[0][4:] for line in lines]
    assert {"compile", "idle", "advisor_scenarios", "dali", "hdf5"} <= set(steps)
    assert "ddp_scaling" not in steps  # no GPU visible here: the two-GPU steps are left out
    for line in lines:
        words = line.split(": ", 1)[1].split()
        scripts = [w for w in words if w.endswith(".py")]
        assert all((REPO / s).is_file() for s in scripts), line
    assert "skipped (needs two GPUs" in _suite(tmp_path, "ddp_scaling")[0]


def _screenshot_module():
    spec = importlib.util.spec_from_file_location(
        "screenshot_tensorboard", REPO / "tools" / "screenshot_tensorboard.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_screenshot_tool_finds_the_demo_runs_fit(tmp_path: Path) -> None:
    tool = _screenshot_module()
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


# --- the two-GPU DDP benchmark: gpu_ddp.py's checks, gpu_ddp_scaling.py's rows and the report of both ---
def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DDP_ROWS = ("plain_1gpu", "plain_ddp", "lightning_preset", "lightning_1gpu", "hdf5_1gpu", "hdf5_ddp")


@pytest.mark.slow
def test_ddp_quick_chain(tmp_path: Path) -> None:
    """The GPU command's two steps on the CPU: the checks file, then the scaling rows and the report."""
    out, cwd = tmp_path / "out", tmp_path / "cwd"
    cwd.mkdir()
    data = ("--data-dir", str(tmp_path / "data"), "--workdir", str(tmp_path / "work"))
    proc = _run([sys.executable, str(BENCH / "gpu_ddp.py"), "--quick", "--out", str(out), *data], cwd, 300)
    assert proc.returncode == 0, f"gpu_ddp.py --quick failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    checks = out / "ddp_checks_cpu.json"
    assert all(isinstance(v, bool) for v in json.loads(checks.read_text())["checks"].values())
    args = ["--quick", "--out", str(out), "--checks", str(checks), "--repeats", "2"]
    args += ["--data-root", str(tmp_path / "data")]
    proc = _run([sys.executable, str(BENCH / "gpu_ddp_scaling.py"), *args], cwd, 300)
    assert proc.returncode == 0, f"gpu_ddp_scaling.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    scaling = json.loads((out / "ddp_scaling_cpux2.json").read_text())
    rows = {r["name"]: r for r in scaling["rows"]}
    dali = importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.dali")
    for name in DDP_ROWS + (("dali_1gpu", "dali_ddp") if dali else ()):
        row = rows[name]
        assert row["samples_per_sec"] > 0 and len(row["runs"]) == 2, row
        raw = row["raw"]
        assert sorted(raw) == (["0"] if row["gpus"] == 1 else ["0", "1"]), name
        for series in raw.values():  # the timed steps of the median run, on the host clocks (no CUDA here)
            assert len(series["host_wall_ms"]) == len(series["host_cpu_ms"]) == scaling["timed_steps"]
            assert series["gpu_ms"] == [] and all(v >= 0 for v in series["host_cpu_ms"])
        slow = row["slow_steps"]["host_wall_ms"]
        assert set(slow["count"]) == set(raw) and (slow["coincide"] is None) == (row["gpus"] == 1)
    # 7 batches of the 56 images on one device, 3 a rank on two: the fed fits ran across epochs
    assert rows["hdf5_ddp"]["raw"]["0"]["epoch_starts"] and rows["hdf5_ddp"]["feed"]["backend"] == "hdf5"
    if dali:
        assert rows["dali_ddp"]["feed"]["backend"] == "dali" and rows["dali_ddp"]["feed"]["decoder"] == "cpu"
    report = json.loads((out / "ddp_cpu.json").read_text())
    assert {"date", "machine", "command", "checks", "scaling", "targets_met", "rows"} <= set(report)
    assert report["checks"] == json.loads(checks.read_text())["checks"] and report["all_checks_passed"]
    assert report["scaling"]["hdf5"] == pytest.approx(
        rows["hdf5_ddp"]["samples_per_sec"] / rows["hdf5_1gpu"]["samples_per_sec"]
    )
    assert report["scaling"]["synthetic"] == pytest.approx(rows["lightning_preset"]["scaling"])
    assert all("raw" not in r for r in report["rows"])
    assert not list(cwd.rglob("*.json")), "a results file landed in the working folder"


def test_ddp_slow_steps() -> None:
    slow_steps = _bench_module("gpu_ddp_scaling").slow_steps
    both = slow_steps({"0": [10.0, 10.0, 12.0, 10.0, 11.5], "1": [10.0, 10.0, 12.0, 10.0, 10.5]})
    # medians 10.0: over 11.0 are steps 2 and 4 on rank 0, step 2 on rank 1
    assert both == {
        "count": {"0": 2, "1": 1},
        "steps": {"0": [2, 4], "1": [2]},
        "shared": 1,
        "coincide": False,
    }
    same = slow_steps({"0": [10.0, 20.0, 10.0], "1": [5.0, 9.0, 5.0]})
    assert same is not None and same["coincide"] is True and same["shared"] == 1
    one = slow_steps({"0": [10.0, 10.0, 10.0]})
    assert one is not None and one["count"] == {"0": 0} and one["coincide"] is None
    assert slow_steps({"0": []}) is None


def _ddp_rows() -> list[dict]:
    rates = {
        "plain_1gpu": 6000.0,
        "lightning_1gpu": 5900.0,
        "plain_ddp": 11520.0,
        "lightning_preset": 11460.0,
    }
    rates |= {"hdf5_1gpu": 5800.0, "hdf5_ddp": 10440.0, "dali_1gpu": 5700.0}  # dali_ddp did not run
    return [{"name": k, "samples_per_sec": v, "raw": {"0": {}}} for k, v in rates.items()]


def test_ddp_report_figures(tmp_path: Path) -> None:
    report = _bench_module("ddp_report")
    scaling = report.scaling_of(_ddp_rows())
    assert scaling["plain_ddp"] == pytest.approx(1.92) and scaling["synthetic"] == pytest.approx(1.91)
    assert scaling["hdf5"] == pytest.approx(1.8) and scaling["dali"] is None
    assert scaling["plain_ddp_minus_synthetic"] == pytest.approx(0.01)
    targets = report.targets_of(scaling, {"a": True, "b": False})
    assert targets["synthetic >= 1.9"] is True and targets["plain_ddp - synthetic <= 0.02"] is True
    assert targets["hdf5 >= 1.9"] is False and targets["dali >= 1.9"] is None
    assert targets["checks all true"] is False
    doc = {"machine": {"gpu": "NVIDIA H200"}, "rows": _ddp_rows()}
    without = report.build_report(doc, None)
    assert without["checks"] is None and "--checks" in without["checks_note"]
    assert without["targets_met"]["checks all true"] is None
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"checks": {"a": "yes"}}))
    with pytest.raises(ValueError, match="true/false"):
        report.read_checks(bad)
    with pytest.raises(FileNotFoundError, match=r"gpu_ddp\.py"):
        report.read_checks(tmp_path / "missing.json")


def test_ddp_report_rebuilds(tmp_path: Path) -> None:
    scaling = tmp_path / "ddp_scaling_h200x2.json"
    measured = {
        "machine": {"gpu": "NVIDIA H200"},
        "date": "2026-01-01T00:00:00+00:00",
        "command": "python3 x",
    }
    scaling.write_text(json.dumps({**measured, "rows": _ddp_rows()}))
    checks = tmp_path / "ddp_checks_h200x2.json"
    checks.write_text(json.dumps({"machine": {"gpu": "NVIDIA H200"}, "checks": {"x.ran": True}}))
    out = tmp_path / "ddp_h200x2.json"
    args = ["--scaling", str(scaling), "--checks", str(checks), "--out", str(out)]
    proc = _run([sys.executable, str(BENCH / "ddp_report.py"), *args], tmp_path, 120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert {k: doc[k] for k in measured} == measured  # the measurement's, not this machine's
    assert doc["checks"] == {"x.ran": True} and doc["scaling"]["hdf5"] == pytest.approx(1.8)
    assert all("raw" not in r for r in doc["rows"])
    proc = _run([sys.executable, str(BENCH / "ddp_report.py"), *args[:2], "--checks", "nope.json", "--out",
                 str(out)], tmp_path, 120)  # fmt: skip
    assert proc.returncode == 2 and "nope.json" in proc.stderr
