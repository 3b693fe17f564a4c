"""Where a conversion writes: checked, claimed for one writer, published without replacing (docs/hdf5.md)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

from lightning_gpuopt.data._lifetime import lock_current


class OutputExistsError(ValueError):
    """The output file exists and ``overwrite`` was not given: ``path`` names it."""

    def __init__(self, path: str) -> None:
        super().__init__(f"output {path!r} already exists; pass overwrite=True or another name")
        self.path = path


class OutputInUseError(ValueError):
    """Another conversion is writing the same output: ``path`` names it, ``pid`` is its process (or None)."""

    def __init__(self, path: str, pid: int | None) -> None:
        who = f"another conversion (pid {pid})" if pid is not None else "another conversion"
        super().__init__(f"{who} is writing {path!r}; wait for it to finish, or write to another name")
        self.path = path
        self.pid = pid


def _destination(out: str | os.PathLike[str], overwrite: bool) -> tuple[Path, Path]:
    """``(out, the file to write)``: a symbolic link's target is replaced in its own folder, the link kept."""
    out_path = Path(out).expanduser()
    dest = Path(os.path.realpath(out_path)) if out_path.is_symlink() else out_path
    if not dest.parent.is_dir():
        raise FileNotFoundError(
            f"output folder {str(dest.parent)!r} does not exist; create it first (mkdir -p)"
        )
    if dest.is_dir():
        raise ValueError(f"output {str(out_path)!r} is a folder; give a file name such as train.h5")
    if dest.exists() and not overwrite:
        raise OutputExistsError(str(out_path))
    return out_path, dest


def _cannot_create(err: OSError, dest: Path) -> OSError:
    """The error of a destination folder that refuses new files; its ``destination`` names the output."""
    refused = type(err)(
        err.errno,
        f"cannot create files in {str(dest.parent)!r} ({err.strerror}); "
        "choose an output in a writable folder",
    )
    refused.destination = str(dest)  # type: ignore[attr-defined]
    return refused


class _Claim:
    """``flock`` on ``.<name>.lock`` beside the destination, not waited for (busy: ``OutputInUseError``)."""

    def __init__(self, dest: Path, shown: str) -> None:
        self.path = dest.with_name(f".{dest.name}.lock")
        try:
            self.fd = lock_current(self.path)
        except OSError as err:
            raise _cannot_create(err, dest) from None
        if self.fd is None:
            holder = ""
            with contextlib.suppress(OSError):
                holder = self.path.read_text().strip()
            raise OutputInUseError(shown, int(holder) if holder.isdigit() else None)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        """Remove the lock file, then drop the lock (in this order, so no two conversions hold a claim)."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self.fd)
        self.fd = None


_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EMLINK, errno.EXDEV}


def _publish(tmp: Path, dest: Path, shown: str, overwrite: bool) -> None:
    """Give the finished ``tmp`` its final name; without ``overwrite`` an existing ``dest`` stays."""
    if overwrite:
        os.replace(tmp, dest)
        return
    try:
        os.link(tmp, dest)  # fails if dest exists, however it got there
    except FileExistsError:
        raise OutputExistsError(shown) from None
    except OSError as err:
        if err.errno not in _NO_HARD_LINKS:
            raise
        # a filesystem without hard links: the claim keeps other conversions out; check, then rename
        if os.path.lexists(dest):
            raise OutputExistsError(shown) from None
        os.replace(tmp, dest)
        return
    tmp.unlink()


def _check_free_space(dest: Path, needed: int) -> None:
    """Refuse before decoding when the store cannot fit: free space, and the file size limit (ulimit -f)."""
    free = shutil.disk_usage(dest.parent).free
    if free < needed:
        raise OSError(
            f"not enough free space for {str(dest)!r}: the store needs about {needed:,} bytes, "
            f"{free:,} are free on its filesystem; free some space or write it elsewhere"
        )
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError):  # not on this platform
        return
    if limit != resource.RLIM_INFINITY and limit < needed:
        raise OSError(
            f"{str(dest)!r} would be about {needed:,} bytes but this process may write files of at most "
            f"{limit:,} bytes (ulimit -f); raise the limit"
        )


def _create_temp(tmp: Path, dest: Path) -> None:
    """Create the temporary file now, so a read-only or full destination fails before any decoding."""
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as err:
        raise _cannot_create(err, dest) from None
    os.close(fd)
