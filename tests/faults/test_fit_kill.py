"""A short Lightning fit killed (SIGKILL, SIGTERM) at seeded points.

The fit (``_fit_child.py``) trains an ``OptimizedDataModule`` on a small image folder (``on_corrupt="skip"``,
so the DataModule keeps a folder for skipped-image reports; two DataLoader worker processes) or on the same
images as an HDF5 store (read by two threads of the training process), and prints where it is. Points:
right after ``setup`` (the folder, where the DataModule makes its skip folder); as soon as the first
DataLoader worker process exists (the folder; before it has set itself up); at a seeded training step (of
16); at a seeded validation batch (of 8, in a seeded epoch). After each kill: no process of the fit is left
(its workers included) and the temporary folder the child was given (``TMPDIR``, short enough for the
workers' folder of their own) is empty (torch's compile cache is kept elsewhere).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from tests.faults._helpers import child_env
from tests.faults._watch import SIGNALS, Watch, kill_at

CHILD = Path(__file__).with_name("_fit_child.py")
POINTS = {"folder": ("setup", "workers", "train", "val"), "hdf5": ("train", "val")}
CASES = [(backend, name, point) for backend, points in POINTS.items() for name in SIGNALS for point in points]


def _target(point: str, rng: random.Random) -> str | None:
    if point == "setup":
        return "@ setup"
    if point == "workers":
        return None  # the first DataLoader worker process is seen
    if point == "train":
        return f"@ train {rng.randrange(1, 16)}"
    return f"@ val {rng.randrange(2)} {rng.randrange(8)}"


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "signal_name", "point"), CASES, ids=["-".join(c) for c in CASES])
def test_fit_killed(fit_data, case_dir, short_tmp, backend, signal_name, point):
    rng = random.Random(f"fit-{backend}-{signal_name}-{point}")
    target = _target(point, rng)
    tmpdir = short_tmp
    data = fit_data.folder if backend == "folder" else fit_data.store
    argv = [sys.executable, str(CHILD), str(data), str(case_dir)]
    if backend == "folder":
        argv += ["--on-corrupt", "skip"]
    lines: list[str] = []

    def fire(watch: Watch):
        if target is None:
            return {"workers": True} if watch.children() else None
        return {"line": target} if target in lines else None

    killed = kill_at(
        argv,
        SIGNALS[signal_name],
        fire,
        str(case_dir),
        cwd=case_dir,
        env=child_env(TMPDIR=str(tmpdir), TORCHINDUCTOR_CACHE_DIR=str(case_dir / "inductor")),
        on_line=lines.append,
        poll_s=0.001 if target is None else 0.01,
    )
    detail = killed.describe() + f" last marks={lines[-3:]}"
    assert killed.reached, f"the fit ended before {target or 'a worker started'!r}: {detail}"
    problems = []
    if killed.exited_after_s is None:
        problems.append("the fit did not exit after the signal")
    if killed.survivors:
        problems.append(f"{len(killed.survivors)} process(es) outlived the fit")
    left = sorted(p.name for p in tmpdir.iterdir())
    if left:
        problems.append(f"left in the fit's TMPDIR: {left}")
    assert problems == [], f"{problems}; {detail}"
