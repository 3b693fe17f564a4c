"""What the fault cases share: paths, limits, the convert command line and the checks of what a run left."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
#: shorter side of the stores the suite writes (small canvases keep the cases fast)
SIZE = 48
#: shorter side of the older, smaller store the overwrite and swap cases start from
OLD_SIZE = 32
#: seconds a killed child's processes may take to disappear
GRACE_S = 10.0
#: seconds any child may run before the case fails as hung
CHILD_TIMEOUT_S = 120.0


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child: this one, the repository importable, warnings quiet, extra values set."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.update(extra)
    return env


def convert_argv(src: Path, out: Path, *extra: str, size: int = SIZE) -> list[str]:
    """``python -m lightning_gpuopt convert SRC OUT --size SIZE --no-progress ...`` for this interpreter."""
    return [
        sys.executable,
        "-m",
        "lightning_gpuopt",
        "convert",
        str(src),
        str(out),
        "--size",
        str(size),
        "--no-progress",
        *extra,
    ]


def run_convert(src: Path, out: Path, *extra: str, size: int = SIZE, **kwargs) -> subprocess.CompletedProcess:
    """Run the convert command to its end; stdout and stderr captured as text."""
    return subprocess.run(
        convert_argv(src, out, *extra, size=size),
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        env=child_env(),
        cwd=REPO,
        **kwargs,
    )


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def temp_files(out: Path) -> list[str]:
    """Temporary files a conversion to ``out`` leaves beside it (``OUT.tmp-*``)."""
    return sorted(p.name for p in out.parent.glob(out.name + ".tmp-*"))


def read_store(path: Path) -> dict[str, np.ndarray]:
    """Everything a store holds that another conversion of the same folder must reproduce."""
    import h5py

    with h5py.File(path, "r") as f:
        data = {
            name: f[name][()] for name in ("images", "meta", "labels", "classes", "files", "skipped_files")
        }
        for key in ("format", "format_version", "layout_version", "storage_size"):
            data[f"attr:{key}"] = np.asarray(f.attrs[key])
    return data


def store_differences(path: Path, reference: dict[str, np.ndarray]) -> list[str]:
    """What differs between the store at ``path`` and ``reference`` (empty: complete and equal)."""
    from lightning_gpuopt.data.hdf5 import HDF5ImageDataset

    try:
        HDF5ImageDataset(path)  # the reader's own checks: format, shapes, offsets, truncation
        got = read_store(path)
    except Exception as err:  # any failure to read is the finding
        return [f"unreadable: {type(err).__name__}: {err}"]
    return [
        f"{key}: {np.shape(got.get(key))} vs {np.shape(value)}"
        for key, value in reference.items()
        if key not in got or not np.array_equal(got[key], value)
    ]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error" in line.lower()]


def check_one_line_error(proc: subprocess.CompletedProcess, *names: str) -> list[str]:
    """Problems with a failed command's report: it must exit != 0 without a crash or traceback, on one line
    naming each of ``names``."""
    problems = []
    if proc.returncode == 0:
        problems.append("exit code 0")
    if proc.returncode < 0 or proc.returncode in (134, 139):
        problems.append(f"crashed (exit code {proc.returncode})")
    if "Traceback" in proc.stderr:
        problems.append("traceback on stderr: " + proc.stderr.strip().splitlines()[-1][:300])
    lines = [
        ln for ln in proc.stderr.strip().splitlines() if ln.startswith("lightning-gpuopt convert: error:")
    ]
    if len(lines) != 1:
        problems.append(f"{len(lines)} error lines (want 1): {proc.stderr.strip()[-400:]!r}")
    for name in names:
        if not any(name in ln for ln in lines):
            problems.append(f"the error does not name {name!r}: {lines!r}")
    return problems


def place_old_store(sources, out: Path) -> str:
    """Put the older store at ``out`` and return its hash."""
    shutil.copyfile(sources.old_store, out)
    return sha256(out)
