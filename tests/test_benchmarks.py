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
        ("nvJPEG (default), 8 threads", "ceiling again (end of run)"),
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
    "gpu_ddp.py": "its CPU mode launches a DDP fit per scenario and backend",
    "gpu_ddp_scaling.py": "its CPU mode launches torch.distributed.run for every row",
    "gpu_ladder.py": "the ladder it drives runs in tests/test_demo.py; its quick run takes half a minute",
    "accuracy_parity.py": "tests/test_accuracy_parity.py runs it",
}


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
