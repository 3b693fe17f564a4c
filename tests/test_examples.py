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
def test_example_runs_on_cpu_and_leaves_nothing_in_the_temp_folder(script: str, tmp_path: Path) -> None:
    """Each script runs as documented (no argument) and removes what it wrote under the temp folder."""
    if script.startswith("dali") and importlib.util.find_spec("nvidia.dali") is None:
        pytest.skip("NVIDIA DALI is not installed (extra `dali`)")
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "LIGHTNING_GPUOPT_CACHE_DIR": str(tmp_path / "cache"),
        "PYTHONPATH": os.pathsep.join([str(EXAMPLES.parent), os.environ.get("PYTHONPATH", "")]),
        "TMPDIR": str(temp),
        # torch's own compile cache (made under the temp folder by `import torch._dynamo`) is a cache kept
        # on purpose, not a script's leftover
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
    }
    work = tmp_path / "cwd"
    work.mkdir()
    args = [sys.executable, str(EXAMPLES / script)]
    proc = subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert sorted(p.name for p in temp.iterdir()) == []


def test_an_example_keeps_what_it_writes_under_a_folder_the_user_names(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "LIGHTNING_GPUOPT_CACHE_DIR": str(tmp_path / "cache"),
        "PYTHONPATH": os.pathsep.join([str(EXAMPLES.parent), os.environ.get("PYTHONPATH", "")]),
    }
    out = tmp_path / "store.h5"
    args = [sys.executable, str(EXAMPLES / "hdf5_train.py"), "--out", str(out)]
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.is_file()
