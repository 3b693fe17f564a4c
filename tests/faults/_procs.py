"""Processes seen through ``/proc``: a child's process tree, what outlives it, and how to start one under a fault.

Only Linux ``/proc`` is read. A process is identified by ``(pid, start time)``, so a pid reused by an unrelated
process after the one we saw died is never mistaken for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

_PR_CAPBSET_DROP = 24
_CAP_DAC_OVERRIDE = 1
_CAP_DAC_READ_SEARCH = 2


@dataclass(frozen=True)
class Proc:
    """One process: pid, parent pid, state letter, start time (clock ticks since boot) and command line."""

    pid: int
    ppid: int
    state: str
    start: int
    cmdline: str

    def describe(self) -> str:
        return f"pid {self.pid} (ppid {self.ppid}, state {self.state}): {self.cmdline[:160]}"


def read_proc(pid: int) -> Proc | None:
    """The process ``pid`` now, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().decode(errors="replace")
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    # the command name in parentheses may itself hold spaces or parentheses: split after the last one
    fields = stat[stat.rindex(")") + 2 :].split()
    return Proc(pid=pid, ppid=int(fields[1]), state=fields[0], start=int(fields[19]), cmdline=cmdline)


def all_procs() -> list[Proc]:
    procs = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            proc = read_proc(int(name))
            if proc is not None:
                procs.append(proc)
    return procs


def descendants(pid: int, procs: Iterable[Proc] | None = None) -> list[Proc]:
    """Every process below ``pid`` in the tree (children, their children, ...)."""
    by_parent: dict[int, list[Proc]] = {}
    for proc in all_procs() if procs is None else procs:
        by_parent.setdefault(proc.ppid, []).append(proc)
    found: list[Proc] = []
    todo = [pid]
    while todo:
        for child in by_parent.get(todo.pop(), []):
            found.append(child)
            todo.append(child.pid)
    return found


def is_running(proc: Proc) -> bool:
    """The same process (pid and start time) still exists and is not a zombie."""
    now = read_proc(proc.pid)
    return now is not None and now.start == proc.start and now.state not in ("Z", "X")


def survivors(seen: Iterable[Proc], token: str, ignore: Iterable[int] = ()) -> list[Proc]:
    """Processes of ``seen`` still running, plus any running process whose command line holds ``token``."""
    skip = {os.getpid(), *ignore}
    out = {p.pid: p for p in seen if p.pid not in skip and is_running(p)}
    for proc in all_procs():
        if proc.pid not in skip and token in proc.cmdline and proc.state not in ("Z", "X"):
            out.setdefault(proc.pid, proc)
    return sorted(out.values(), key=lambda p: p.pid)


def wait_for_survivors(
    seen: Iterable[Proc], token: str, grace_s: float, ignore: Iterable[int] = ()
) -> tuple[list[Proc], float]:
    """Poll until nothing of ``seen`` (nor any process naming ``token``) runs, at most ``grace_s``.

    Returns the processes still running at the end and the seconds waited.
    """
    seen = list(seen)
    start = time.monotonic()
    while True:
        left = survivors(seen, token, ignore)
        waited = time.monotonic() - start
        if not left or waited >= grace_s:
            return left, waited
        time.sleep(0.05)


def kill_all(procs: Iterable[Proc]) -> None:
    """SIGKILL each of ``procs`` that is still the same process (cleanup after a failed check)."""
    for proc in procs:
        if is_running(proc):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc.pid, signal.SIGKILL)


def has_tmpfs_mount() -> bool:
    """Whether this process may mount a filesystem (a 1 MiB tmpfs is mounted and unmounted to find out)."""
    import subprocess
    import tempfile

    if os.geteuid() != 0:
        return False
    with tempfile.TemporaryDirectory(prefix="faults_mount_probe_") as d:
        try:
            mounted = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", d], capture_output=True
            )
        except OSError:  # no mount command
            return False
        if mounted.returncode != 0:
            return False
        subprocess.run(["umount", d], capture_output=True, check=True)
        return True


def obey_permissions() -> Callable[[], None] | None:
    """A ``preexec_fn`` under which a child honours file permissions (None when it does anyway: not root)."""
    return drop_file_override if os.geteuid() == 0 else None


def is_root() -> bool:
    return os.geteuid() == 0


def drop_file_override() -> None:
    """In a child before exec: drop CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH so root obeys file permissions.

    Removed from the bounding set, the capabilities are not granted again when the child execs, so a
    ``chmod 000`` file or a ``chmod 555`` folder refuses root as it refuses any user.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_CAPBSET_DROP, {cap}) failed: {os.strerror(err)}")


def file_size_limit(max_bytes: int) -> Callable[[], None]:
    """A ``preexec_fn`` that caps the size of files the child writes (RLIMIT_FSIZE) and ignores SIGXFSZ.

    A write past the limit then fails with EFBIG instead of killing the process, as a full disk fails a
    write with ENOSPC.
    """

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    return apply
