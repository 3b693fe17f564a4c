"""Folders and images that cannot be written or read.

Root ignores file permissions, so when the suite runs as root its children drop CAP_DAC_OVERRIDE and
CAP_DAC_READ_SEARCH first (``_procs.drop_file_override``) and then meet ``chmod`` as any user does. The
read-only bind mount cases need root with CAP_SYS_ADMIN and are skipped with the reason elsewhere.

- destination not writable (``chmod 555``; a read-only bind mount), with and without an older store at OUT:
  one error line naming the folder, exit code != 0, no temporary file, the older store untouched;
- source unreadable (``chmod 000`` on an image, a class folder, the source folder): one error line naming
  it and no store, or, for an image with ``--on-corrupt skip``, a store without it that lists it as skipped;
- a fit whose folder holds an unreadable image: with ``on_corrupt="raise"`` it stops with an error naming
  the image and leaves no worker behind; with ``"skip"`` it finishes and counts the image as skipped.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults import _procs
from tests.faults._helpers import (
    CHILD_TIMEOUT_S,
    GRACE_S,
    REPO,
    check_one_line_error,
    child_env,
    place_old_store,
    read_store,
    run_convert,
    sha256,
    temp_files,
)

CAN_MOUNT = _procs.has_tmpfs_mount()
DEST_CASES = [(way, existing) for way in ("chmod-555", "ro-bind-mount") for existing in (False, True)]
SOURCE_CASES = ("image", "image-skip", "class-folder", "source-folder")
FIT_CHILD = Path(__file__).with_name("_fit_child.py")


@contextlib.contextmanager
def read_only(folder: Path, way: str):
    if way == "chmod-555":
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
        return
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], check=True)
        yield
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


@pytest.mark.parametrize(
    ("way", "existing"), DEST_CASES, ids=[f"{w}-{'overwrite' if e else 'new'}" for w, e in DEST_CASES]
)
def test_destination_not_writable(sources, case_dir, way, existing):
    if way == "ro-bind-mount" and not CAN_MOUNT:
        pytest.skip("cannot bind-mount here (needs root with CAP_SYS_ADMIN); chmod-555 stands in")
    dest = case_dir / "dest"
    dest.mkdir()
    out = dest / "out.h5"
    before = place_old_store(sources, out) if existing else None
    with read_only(dest, way):
        proc = run_convert(
            sources.small,
            out,
            "--workers",
            "2",
            *(["--overwrite"] if existing else []),
            preexec_fn=_procs.obey_permissions(),
        )
    problems = check_one_line_error(proc, str(dest))
    assert problems == [], f"{problems}; stderr: {proc.stderr[-800:]!r}"
    assert temp_files(out) == []
    if before is None:
        assert not out.exists()
    else:
        assert sha256(out) == before, "the older store at OUT was changed"


def _unreadable(src: Path, case: str) -> Path:
    """Make part of ``src`` unreadable; returns that path."""
    target = {
        "image": src / "class_01" / "img_000003.jpg",
        "image-skip": src / "class_01" / "img_000003.jpg",
        "class-folder": src / "class_00",
        "source-folder": src,
    }[case]
    target.chmod(0o000)
    return target


@pytest.mark.parametrize("case", SOURCE_CASES)
def test_source_not_readable(sources, case_dir, case):
    src = case_dir / "src"
    shutil.copytree(sources.small, src)
    out = case_dir / "out.h5"
    target = _unreadable(src, case)
    try:
        extra = ["--on-corrupt", "skip"] if case == "image-skip" else []
        proc = run_convert(src, out, "--workers", "2", *extra, preexec_fn=_procs.obey_permissions())
    finally:
        target.chmod(0o755 if target.is_dir() else 0o644)
    assert temp_files(out) == []
    if case == "image-skip":
        assert proc.returncode == 0, proc.stderr
        store = read_store(out)
        rel = target.relative_to(src).as_posix()
        files = [f.decode() if isinstance(f, bytes) else f for f in store["files"]]
        skipped = [f.decode() if isinstance(f, bytes) else f for f in store["skipped_files"]]
        assert rel not in files and skipped == [rel] and len(files) == 19
        assert rel in proc.stderr, f"the skipped image is not reported: {proc.stderr!r}"
        return
    problems = check_one_line_error(proc, str(target))
    why = ("permission", "denied", "not readable", "unreadable", "cannot read")
    if not any(word in proc.stderr.lower() for word in why):
        problems.append("the error does not say the path cannot be read")
    assert problems == [], f"{problems}; stderr: {proc.stderr[-800:]!r}"
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("on_corrupt", ("raise", "skip"))
def test_fit_with_unreadable_image(fit_data, case_dir, short_tmp, on_corrupt):
    folder = case_dir / "folder"
    shutil.copytree(fit_data.folder, folder)
    image = sorted((folder / "class_02").iterdir())[1]
    image.chmod(0o000)
    tmpdir = short_tmp
    with subprocess.Popen(
        [sys.executable, str(FIT_CHILD), str(folder), str(case_dir), "--on-corrupt", on_corrupt],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=child_env(TMPDIR=str(tmpdir), TORCHINDUCTOR_CACHE_DIR=str(case_dir / "inductor")),
        preexec_fn=_procs.obey_permissions(),
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=CHILD_TIMEOUT_S)
            tree: list[_procs.Proc] = []
        except subprocess.TimeoutExpired:
            tree = _procs.descendants(proc.pid)
            proc.kill()
            stdout, stderr = proc.communicate()
    left, _ = _procs.wait_for_survivors(tree, str(case_dir), GRACE_S)
    _procs.kill_all(left)
    image.chmod(0o644)
    problems = []
    if tree:
        problems.append("the fit hung")
    if left:
        problems.append(f"processes outlived the fit: {[p.describe() for p in left]}")
    leftovers = sorted(p.name for p in tmpdir.iterdir())
    if leftovers:
        problems.append(f"left in the fit's TMPDIR: {leftovers}")
    if on_corrupt == "raise":
        if proc.returncode == 0 or "@ done" in stdout:
            problems.append(f"the fit did not stop (exit code {proc.returncode})")
        if str(image) not in stderr:
            problems.append("the error does not name the image")
    else:
        done = [ln for ln in stdout.splitlines() if ln.startswith("@ done")]
        if proc.returncode != 0 or not done or int(done[0].split("skipped=")[1]) < 1:
            problems.append(f"the fit did not finish with the image skipped (exit code {proc.returncode})")
    assert problems == [], f"{problems}; stdout tail {stdout[-300:]!r}; stderr tail {stderr[-800:]!r}"
