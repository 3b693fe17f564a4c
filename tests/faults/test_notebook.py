"""Fits in one long-lived process (a notebook): after each, nothing of the package's still runs or lies in
``TMPDIR``.

``_notebook_child.py`` runs fit + validate four times on each CPU backend (an image folder read by a worker
process with ``on_corrupt="skip"``, the raw store read by a thread, the JPEG store read by a worker process,
DALI's CPU pipeline) and four fits that stop on an image that is not a JPEG (``on_corrupt="raise"``), all in
one process with ``num_workers=1``. After every call: no child process of that process is alive (polled for
up to 10 s) and its private ``TMPDIR`` is empty (torch's compile cache is kept elsewhere). The ``TMPDIR`` is
short, so the workers keep their temporary files in a folder of their loader's (``_lifetime.worker_folder``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults._helpers import child_env

CHILD = Path(__file__).with_name("_notebook_child.py")
BAD = "zz_bad.jpg"


@pytest.fixture(scope="module")
def notebook_data(tmp_path_factory) -> Path:
    from lightning_gpuopt.bench.synthetic import make_jpeg_folder
    from lightning_gpuopt.data.convert import convert_folder_to_hdf5

    root = tmp_path_factory.mktemp("notebook")
    good = make_jpeg_folder(root / "good", num_images=24, num_classes=3, image_size=(40, 32), workers=1)
    convert_folder_to_hdf5(good, root / "raw.h5", 18, workers=0, progress=False)
    convert_folder_to_hdf5(good, root / "jpeg.h5", 18, workers=0, progress=False, format="jpeg")
    shutil.copytree(good, root / "folder")
    (root / "folder" / "class_01" / BAD).write_bytes(b"not a jpeg")
    return root


def _backends() -> list[str]:
    from lightning_gpuopt.data.backends import dali_installed

    return ["folder", "hdf5", "jpeg", "bad"] + (["dali"] if dali_installed() else [])


@pytest.mark.slow
def test_fits_in_one_process_leave_no_process_and_no_temporary_folder(notebook_data, tmp_path, short_tmp):
    backends = _backends()
    proc = subprocess.run(
        [sys.executable, str(CHILD), str(notebook_data), ",".join(backends)],
        env=child_env(TMPDIR=str(short_tmp), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor")),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "@ done" in proc.stdout, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    rounds = 4  # fit + validate each, a fit that stops on the bad file alone
    assert len(rows) == rounds * (2 * (len(backends) - 1) + 1), proc.stdout[-2000:]
    problems = []
    for r in rows:
        where = f"{r['backend']} round {r['round']} after {r['call']}"
        if r["children"]:
            problems.append(f"{where}: alive {r['children']}")
        if r["left"]:
            problems.append(f"{where}: left in TMPDIR {r['left']}")
        stopped = r["error"] is not None
        if r["backend"] == "bad" and not (stopped and BAD in r["error"]):
            problems.append(f"{where}: the fit did not stop on {BAD}: {r['error']}")
        elif r["backend"] != "bad" and stopped:
            problems.append(f"{where}: raised {r['error'][:300]}")
    assert problems == [], "\n".join(problems)
