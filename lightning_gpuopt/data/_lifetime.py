"""Processes and files that must not outlive the process that made them, even after a SIGKILL.

``die_with_parent`` makes a worker process (a decode worker, a DataLoader worker) get SIGKILL when its parent
dies (Linux ``PR_SET_PDEATHSIG``) and exit at once if the parent is already gone. ``WorkerInit`` does that as
a DataLoader ``worker_init_fn`` and then calls the one it wraps. ``Janitor`` removes a temporary file or
folder when its owner dies before saying it is done: a SIGKILL leaves the owner no chance to clean up.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from lightning_gpuopt import _compat

_PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)


def die_with_parent(
    expected_ppid: int | None = None, *, pdeathsig: bool = True, signum: int = signal.SIGKILL
) -> None:
    """In a child process: get ``signum`` when the parent dies (Linux), and exit now if it already died.

    Args:
        expected_ppid: the parent's pid as the parent knew it; None: the pid ``multiprocessing`` recorded in
            the parent when it made this process (else the current parent pid). A process forked in the
            instant its parent dies already sees another parent (pid 1 or a subreaper) and exits.
        pdeathsig: set the parent-death signal. Linux sends it when the *thread* that forked this process
            ends, so it is only right when that thread lives as long as the parent's use of this process.
    """
    if expected_ppid is None:
        parent = multiprocessing.parent_process()
        expected_ppid = parent.pid if parent is not None and parent.pid is not None else os.getppid()
    if pdeathsig and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    if os.getppid() != expected_ppid:  # the parent died before prctl took effect
        os._exit(1)


def _exit_cleanly(signum: int, frame: Any) -> None:
    """SIGTERM in a DataLoader worker: exit through Python, so ``multiprocessing`` removes its ``pymp-*`` folder.

    Killed outright (SIGKILL, or SIGTERM's default action), a worker that has shared a tensor leaves that
    folder behind in the temporary folder. Should the clean exit hang (its queue's pipe full with nobody
    reading), SIGALRM's default action ends the process a few seconds later.
    """
    signal.alarm(3)
    # the folder is removed now too: should the alarm end the process, no exit handler runs
    own = _compat.multiprocessing_tempdir()
    if own is not None and own != _INHERITED_TEMPDIR.get(os.getpid()):
        shutil.rmtree(own, ignore_errors=True)
    raise SystemExit(128 + signum)


# pid -> the pymp-* folder a worker inherited from its parent at start (the parent's: never removed here)
_INHERITED_TEMPDIR: dict[int, str | None] = {}


# pid -> the janitor of the pymp-* folder this process shares with its workers (kept: its pipe is the signal)
_SHARED_TEMPDIR: dict[int, tuple[str, Janitor]] = {}


def shared_tempdir() -> str:
    """This process's ``pymp-*`` folder, made now if need be, for its DataLoader workers to use as theirs.

    A worker that makes its own folder (to pass a shared tensor's file descriptor) can end before its exit
    handlers run, or make the folder after they ran (its queue's feeder thread is still sending when an error
    stops the loader), and leaves it behind. Workers given this folder (``WorkerInit.tempdir``) make none;
    ``multiprocessing`` removes it at this process's exit and a ``Janitor`` when this process is killed.
    """
    import multiprocessing.util

    pid = os.getpid()
    if pid not in _SHARED_TEMPDIR:
        path = multiprocessing.util.get_temp_dir()
        _SHARED_TEMPDIR[pid] = (path, Janitor(path))
    return _SHARED_TEMPDIR[pid][0]


class WorkerInit:
    """A DataLoader ``worker_init_fn``: the worker dies with the process that iterates the loader.

    It makes SIGTERM end the worker cleanly, calls ``die_with_parent`` (the parent's death sends SIGTERM) and
    then ``inner`` (a user's ``worker_init_fn``). Without ``inner`` and under
    ``seed_everything(workers=True)`` it seeds the worker as Lightning would have (Lightning only adds its own
    function to loaders that have none). The parent-death signal is set only when the loader was made on the
    main thread, where Lightning iterates it; elsewhere the worker still exits if its parent is already gone.

    Given ``tempdir`` (the parent's ``shared_tempdir()``, set before the workers start), the worker uses that
    folder as its ``pymp-*`` folder and makes none of its own.

    Args:
        inner: the ``worker_init_fn`` to call afterwards (None: none).

    Example:
        >>> loader = DataLoader(dataset, num_workers=2, worker_init_fn=WorkerInit(my_init))  # doctest: +SKIP
    """

    def __init__(self, inner: Callable[[int], Any] | None = None) -> None:
        self.inner = inner
        self.tempdir: str | None = None
        self.main_thread = threading.current_thread() is threading.main_thread()

    def __call__(self, worker_id: int) -> None:
        if self.tempdir is not None:
            _compat.use_multiprocessing_tempdir(self.tempdir)
        _INHERITED_TEMPDIR[os.getpid()] = _compat.multiprocessing_tempdir()
        signal.signal(signal.SIGTERM, _exit_cleanly)
        die_with_parent(pdeathsig=self.main_thread, signum=signal.SIGTERM)
        if self.inner is not None:
            self.inner(worker_id)
        elif int(os.environ.get("PL_SEED_WORKERS", "0")):
            from lightning.fabric.utilities.seed import pl_worker_init_function

            pl_worker_init_function(worker_id)


# Reads stdin until its owner writes "d" (done) or dies (end of file: nobody holds the pipe any more); unless
# done, removes the path (a file, or a folder with what is in it). Ignores the terminal's and a process
# group's signals so that it outlives its owner by the moment it takes.
_JANITOR = """
import os, shutil, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if sys.stdin.buffer.read(1) != b"d":
    path = sys.argv[1]
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass
"""


class Janitor:
    """A tiny process that removes ``path`` when its owner dies before calling ``release``.

    Start it before ``path`` exists, so no moment is left in which a SIGKILL strands it. The janitor notices
    its owner's death as the end of a pipe only the owner holds (and the owner's forked children, which die
    with it: ``die_with_parent``).

    Args:
        path: the temporary file or folder to remove.

    Example:
        >>> janitor = Janitor(tmp)  # doctest: +SKIP
        >>> # make and use tmp; a SIGKILL here still removes it
        >>> janitor.release(done=False)  # removes tmp now  # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.proc: Any = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _JANITOR, os.fspath(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # no Ctrl-C or terminal hang-up from the owner's terminal
        )

    def release(self, done: bool) -> None:
        """Tell the janitor its owner is finished: ``done`` keeps the path, else the janitor removes it."""
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            if done:
                self.proc.stdin.write(b"d")
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self.proc = None
