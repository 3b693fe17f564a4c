"""Where the commands write: one new versioned run folder per run, and paths checked before any work.

A second ``lightning-gpuopt demo`` (or ``bench``) into the same ``--out`` gets ``version_1`` beside
``version_0``: it neither overwrites the first run's ``ladder.json``/``ladder.png`` nor adds its events to the
first run's TensorBoard folders. A path that cannot be written raises ``ValueError`` naming the flag, the path
and the fix, before anything is measured.
"""

from __future__ import annotations

import os
from pathlib import Path

RUN_PREFIX = "version_"


def _first_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(path.anchor or ".")


def _unwritable(flag: str, path: Path, err: OSError, fix: str) -> ValueError:
    return ValueError(f"{flag} {str(path)!r} cannot be written ({err.strerror or err}); {fix}")


def check_output_folder(path: str | os.PathLike[str], flag: str = "--out") -> Path:
    """``path`` as an absolute folder that is, or can become, a writable folder; raises ``ValueError`` otherwise.

    Creates the folder (and its parents): creating it is the one test that also holds on read-only file
    systems and for the root user.
    """
    folder = Path(path).expanduser().absolute()
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{flag} {str(folder)!r} is a file, not a folder; give a folder (made if missing)")
    anchor = _first_existing(folder)
    if not anchor.is_dir():
        raise ValueError(
            f"{flag} {str(folder)!r} lies under {str(anchor)!r}, which is a file; choose another folder"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _unwritable(flag, folder, err, f"choose a folder you can write to ({flag} DIR)") from err
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
            raise _unwritable(flag, run, err, f"choose a folder you can write to ({flag} DIR)") from err
        return run


def check_writable_file(path: str | os.PathLike[str], flag: str) -> Path:
    """Make sure ``path`` can be written as a file (its folder is created), without leaving a new file behind."""
    file = Path(path).expanduser().absolute()
    if file.is_dir():
        raise ValueError(f"{flag} {str(file)!r} is a folder; give a file name such as {file / 'result.json'}")
    anchor = _first_existing(file.parent)
    if not anchor.is_dir():
        raise ValueError(
            f"{flag} {str(file)!r} lies under {str(anchor)!r}, which is a file; choose another path"
        )
    existed = file.exists()
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with open(file, "a", encoding="utf-8"):
            pass
    except OSError as err:
        raise _unwritable(flag, file, err, "choose a path you can write to") from err
    if not existed:
        file.unlink()
    return file
