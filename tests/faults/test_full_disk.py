"""``lightning-gpuopt convert`` onto a disk that is, or becomes, full.

Three ways, each with and without an older store at ``OUT`` (``--overwrite``):

- ``tmpfs-too-small``: the destination is a 2 MiB tmpfs, smaller than the store (about 3.4 MB);
- ``tmpfs-filled``: an 8 MiB tmpfs that another writer fills once the converter has written a seeded fraction
  of the store's bytes, so the conversion's own writes fail with ENOSPC;
- ``file-size-limit``: the child's RLIMIT_FSIZE is 1 MiB (SIGXFSZ ignored), so its writes past 1 MiB fail
  with EFBIG, as on a full disk. This one needs no mount and runs everywhere.

The tmpfs cases run where this process may mount a tmpfs (root with CAP_SYS_ADMIN) and are skipped with the
reason elsewhere. Expected: exit code != 0 without a crash, one error line naming the destination, no
temporary file, the older store untouched.
"""

from __future__ import annotations

import contextlib
import random
import subprocess

import pytest

from tests.faults import _procs
from tests.faults._helpers import (
    check_one_line_error,
    convert_argv,
    place_old_store,
    run_convert,
    sha256,
    temp_files,
)
from tests.faults._watch import Watch, kill_at

WAYS = ("tmpfs-too-small", "tmpfs-filled", "file-size-limit")
CASES = [(way, existing) for way in WAYS for existing in (False, True)]
CAN_MOUNT = _procs.has_tmpfs_mount()


@contextlib.contextmanager
def tmpfs(path, size: str):
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def _fill(folder) -> None:
    """Write zeros into ``folder`` until its filesystem is full."""
    block = b"\0" * (1 << 16)
    with contextlib.suppress(OSError), open(folder / "filler", "wb", buffering=0) as fh:
        while True:
            fh.write(block)


@pytest.mark.parametrize(
    ("way", "existing"), CASES, ids=[f"{w}-{'overwrite' if e else 'new'}" for w, e in CASES]
)
def test_convert_onto_full_disk(sources, case_dir, way, existing):
    if way.startswith("tmpfs") and not CAN_MOUNT:
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN); file-size-limit stands in")
    extra = ["--workers", "2"] + (["--overwrite"] if existing else [])
    with contextlib.ExitStack() as stack:
        if way == "file-size-limit":
            disk = case_dir
        else:
            disk = stack.enter_context(tmpfs(case_dir / "disk", "2m" if way == "tmpfs-too-small" else "8m"))
        out = disk / "out.h5"
        before = place_old_store(sources, out) if existing else None
        if way == "tmpfs-filled":
            fraction = random.Random(f"disk-{existing}").uniform(0.1, 0.6)

            def fire(watch: Watch):
                paths = [p for p in disk.iterdir() if p.name.startswith("out.h5.tmp-")]
                size = sum(p.stat().st_size for p in paths if p.exists())
                return (
                    {"fraction": round(fraction, 3)}
                    if paths and size >= fraction * sources.reference_bytes
                    else None
                )

            filled = kill_at(
                convert_argv(sources.main, out, *extra),
                lambda watch: _fill(disk),
                fire,
                str(case_dir),
                cwd=case_dir,
            )
            assert filled.reached, f"the store never reached {fraction:.0%} of its size: {filled.describe()}"
            assert not filled.survivors, filled.describe()
            proc = subprocess.CompletedProcess([], filled.returncode, filled.stdout, filled.stderr)
            (disk / "filler").unlink()
        else:
            limit = _procs.file_size_limit(1 << 20) if way == "file-size-limit" else None
            proc = run_convert(sources.main, out, *extra, preexec_fn=limit)
        problems = check_one_line_error(proc, str(out))
        assert problems == [], f"{problems}; stderr: {proc.stderr[-800:]!r}"
        assert temp_files(out) == [], f"temporary files left: {temp_files(out)}"
        if before is None:
            assert not out.exists(), "a store was left at OUT by a conversion that failed"
        else:
            assert out.exists() and sha256(out) == before, "the older store at OUT was changed"
