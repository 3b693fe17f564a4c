"""Every script in examples/ runs as documented (its CPU form), so the docs' examples cannot rot."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py"))


def test_examples_are_collected() -> None:
    assert {"compute_preset.py", "dali_train.py", "hdf5_train.py", "nvtx_profile.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs_on_cpu(script: str, tmp_path: Path) -> None:
    if script.startswith("dali") and importlib.util.find_spec("nvidia.dali") is None:
        pytest.skip("NVIDIA DALI is not installed (extra `dali`)")
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "LIGHTNING_GPUOPT_CACHE_DIR": str(tmp_path / "cache"),
        "PYTHONPATH": os.pathsep.join([str(EXAMPLES.parent), os.environ.get("PYTHONPATH", "")]),
    }
    args = [sys.executable, str(EXAMPLES / script)]
    if script == "dali_train.py":
        args += ["--data", str(tmp_path / "dali_data")]
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
