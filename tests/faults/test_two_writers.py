"""Two conversions to one store, started together: one writes it, the other stops with a one-line error.

Both run the ``lightning-gpuopt convert`` command as child processes, from different source folders and
without ``--overwrite``. Exactly one must exit 0 and leave its own store, complete; the other must exit 2
naming the store (another conversion is writing it, or it already exists once the first finished).
"""

from __future__ import annotations

import subprocess

from tests.faults._helpers import (
    CHILD_TIMEOUT_S,
    REPO,
    check_one_line_error,
    child_env,
    convert_argv,
    temp_files,
)


def test_two_writers_one_store(sources, case_dir):
    out = case_dir / "same.h5"
    folders = (sources.main, sources.small)
    procs = [
        subprocess.Popen(
            convert_argv(src, out, "--workers", "1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
            cwd=REPO,
        )
        for src in folders
    ]
    done = [(p, *p.communicate(timeout=CHILD_TIMEOUT_S)) for p in procs]
    codes = [p.returncode for p, _, _ in done]
    assert sorted(codes) == [0, 2], [(p.returncode, err[-400:]) for p, _, err in done]
    winner = codes.index(0)
    _, stdout, _ = done[winner]
    assert f"wrote {out}:" in stdout
    lost, lost_out, lost_err = done[1 - winner]
    loser = subprocess.CompletedProcess(lost.args, lost.returncode, lost_out, lost_err)
    assert check_one_line_error(loser, "same.h5") == []
    assert "is writing" in loser.stderr or "already exists" in loser.stderr, loser.stderr

    from lightning_gpuopt.data.hdf5 import HDF5ImageDataset

    store = HDF5ImageDataset(out)  # complete and the winner's own
    assert store.attrs()["source"] == str(folders[winner])
    assert len(store) == (320 if winner == 0 else 20)
    assert temp_files(out) == [] and sorted(p.name for p in case_dir.iterdir()) == ["same.h5"]
