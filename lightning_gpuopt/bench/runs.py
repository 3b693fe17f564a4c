"""Where the commands write: a new ``version_<n>`` run folder per run (never over an earlier run), and
output paths checked before any work (``ValueError`` naming the flag, the path and the fix).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

RUN_PREFIX = "version_"


def _check_parent(flag: str, path: Path, what: str) -> None:
    """Raise when ``path`` would lie under a file."""
    anchor = next((p for p in (path, *path.parents) if p.exists()), Path(path.anchor or "."))
    if not anchor.is_dir():
        raise ValueError(
            f"{flag} {str(path)!r} lies under {str(anchor)!r}, which is a file; choose another {what}"
        )


def _unwritable(flag: str, path: Path, err: OSError, what: str) -> ValueError:
    return ValueError(
        f"{flag} {str(path)!r} cannot be written ({err.strerror or err}); choose a {what} you can write to"
    )


def check_output_folder(path: str | os.PathLike[str], flag: str = "--out") -> Path:
    """``path`` as an absolute writable folder, created (the one test that also holds on read-only file
    systems and for root); raises ``ValueError`` otherwise."""
    folder = Path(path).expanduser().absolute()
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{flag} {str(folder)!r} is a file, not a folder; give a folder (made if missing)")
    _check_parent(flag, folder, "folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _unwritable(flag, folder, err, "folder") from err
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {str(folder)!r} is not writable; choose a folder you can write to")
    return folder


def new_run_dir(out: str | os.PathLike[str], flag: str = "--out") -> Path:
    """Create and return ``out/version_<n>``, ``n`` one above the highest already there (0 in a new folder)."""
    folder = check_output_folder(out, flag)
    taken = [
        int(p.name[len(RUN_PREFIX) :])
        for p in folder.iterdir()
        if p.name.startswith(RUN_PREFIX) and p.name[len(RUN_PREFIX) :].isdigit()
    ]
    n = max(taken, default=-1) + 1
    while True:
        run = folder / f"{RUN_PREFIX}{n}"
        try:
            run.mkdir()
        except FileExistsError:  # another run took it a moment ago
            n += 1
            continue
        except OSError as err:
            raise _unwritable(flag, run, err, "folder") from err
        return run


def in_new_run(out: str | os.PathLike[str], work: Callable[[Path], T]) -> T:
    """``work(run)`` in a ``new_run_dir``; a run that raised before its ``ladder.json`` leaves no folder."""
    run = new_run_dir(out)
    try:
        return work(run)
    except BaseException:
        if not (run / "ladder.json").is_file():
            shutil.rmtree(run, ignore_errors=True)
        raise


def check_writable_file(path: str | os.PathLike[str], flag: str) -> Path:
    """``path``, checked to be writable as a file (its folder created), no new file left behind."""
    file = Path(path).expanduser().absolute()
    if file.is_dir():
        raise ValueError(f"{flag} {str(file)!r} is a folder; give a file name such as {file / 'result.json'}")
    _check_parent(flag, file, "path")
    existed = file.exists()
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with open(file, "a", encoding="utf-8"):
            pass
    except OSError as err:
        raise _unwritable(flag, file, err, "path") from err
    if not existed:
        file.unlink()
    return file
