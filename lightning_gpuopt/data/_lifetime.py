"""Processes and temporary files that end with their owner (docs/reliability.md, "What ends the processes
and temporary folders"): ``worker_folder`` for DataLoader workers, ``die_with_parent`` and ``Janitor`` for
what must not outlive a process killed with SIGKILL, ``lock_current`` for a lock that dies with its holder."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import multiprocessing.util
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

_PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)
#: after multiprocessing's own exit handlers, which remove the worker's ``pymp-*`` folder at priority -100
_AFTER_TEMP_DIR = -200
_PREFIX = "gpuopt-"  # short: a worker's socket path inside it must stay under the AF_UNIX limit
#: the longest AF_UNIX socket path (``sun_path``: 104 bytes with its NUL on macOS, 108 on Linux)
_SOCKET_PATH_MAX = 103
#: what ``multiprocessing`` adds to a temporary folder for a worker's socket
_SOCKET_SUFFIX = len("/pymp-12345678/listener-12345678")


def _own_folder(folder: str) -> bool:
    """Make ``folder`` or take the one a sibling worker made: a folder of this user, not a link."""
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass  # a sibling worker made it (or someone else did: checked below)
    except OSError:
        return False
    try:
        st = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and (not hasattr(os, "getuid") or st.st_uid == os.getuid())


def _remove_if_orphaned(folder: str, parent: int) -> None:
    """At a worker's exit: remove the loader's folder when the parent died (nobody else will)."""
    if os.getppid() != parent:
        shutil.rmtree(folder, ignore_errors=True)


#: seconds between a worker's looks at its parent (PyTorch's own watchdog looks every 5 s)
ORPHAN_POLL_S = 0.2


def _exit_with_parent(folder: str, parent: int) -> None:
    """In a worker: once ``parent`` has died, remove the loader's folder and exit. PyTorch's watchdog reads
    the parent's pid after ``worker_init_fn``; a parent killed in between leaves it waiting forever."""
    while os.getppid() == parent:
        time.sleep(ORPHAN_POLL_S)
    shutil.rmtree(folder, ignore_errors=True)
    os._exit(1)


class InWorkerFolder:
    """A ``worker_init_fn`` putting the worker's temporary files in ``folder``, then running ``inner``; with
    ``parent``, the worker exits once that process has died (docs/reliability.md)."""

    def __init__(
        self, folder: str, inner: Callable[[int], Any] | None = None, parent: int | None = None
    ) -> None:
        self.folder = folder
        self.inner = inner
        self.parent = parent

    def __call__(self, worker_id: int) -> None:
        # the parent died making this worker: PyTorch's watchdog would wait for it forever
        if self.parent is not None and os.getppid() != self.parent:
            shutil.rmtree(self.folder, ignore_errors=True)
            os._exit(1)
        if _own_folder(self.folder):
            tempfile.tempdir = self.folder  # public: the default folder of tempfile and multiprocessing
            multiprocessing.util.Finalize(
                None, _remove_if_orphaned, args=(self.folder, os.getppid()), exitpriority=_AFTER_TEMP_DIR
            )
        if self.parent is not None:  # started once the folder exists: a later death removes it too
            args = (self.folder, self.parent)
            threading.Thread(
                target=_exit_with_parent, args=args, name="lightning_gpuopt-orphan", daemon=True
            ).start()
        if self.inner is not None:
            self.inner(worker_id)


def _start_method(loader: Any) -> str | None:
    context = getattr(loader, "multiprocessing_context", None)
    if isinstance(context, str):
        return context
    if context is None:
        # the first of all start methods is the default; get_start_method(allow_none=False) would fix it
        return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    return context.get_start_method()


def worker_folder(loader: Any, start: Callable[[], Iterator[Any]]) -> tuple[Iterator[Any], Callable[[], Any]]:
    """``start()`` (``loader``'s iterator) with its workers' temporary files in a folder of their own, and the
    call that removes it (also run at collection); a ``TMPDIR`` too long for a socket keeps the defaults."""
    folder = os.path.join(tempfile.gettempdir(), _PREFIX + secrets.token_hex(4))  # the workers make it
    if len(os.fsencode(folder)) + _SOCKET_SUFFIX > _SOCKET_PATH_MAX:
        return start(), lambda: None
    own = loader.worker_init_fn
    loader.worker_init_fn = InWorkerFolder(
        folder, own, None if _start_method(loader) == "forkserver" else os.getpid()
    )
    try:
        iterator = start()
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        loader.worker_init_fn = own
    return iterator, weakref.finalize(iterator, shutil.rmtree, folder, ignore_errors=True)


def die_with_parent(expected_ppid: int | None = None) -> None:
    """In a child process: get SIGKILL when the parent dies (Linux), and exit now if it already died;
    ``expected_ppid`` is the parent's pid as the parent knew it (None: the one ``multiprocessing`` recorded)."""
    if expected_ppid is None:
        parent = multiprocessing.parent_process()
        expected_ppid = parent.pid if parent is not None and parent.pid is not None else os.getppid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != expected_ppid:  # the parent died before prctl took effect
        os._exit(1)


# Waits until its owner writes "d" (done) to stdin, closes it, or dies (end of file, or a new parent: a forked
# child of the owner may still hold the pipe); unless done, removes the path (a file, or a folder with what is
# in it). Ignores the terminal's and a process group's signals so that it outlives its owner by the moment it
# takes.
_JANITOR = """
import contextlib, os, select, shutil, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
owner = int(sys.argv[2])
while not select.select([0], [], [], 0.5)[0] and os.getppid() == owner:
    pass
done = os.getppid() == owner and os.read(0, 1) == b"d"
if not done:
    path = sys.argv[1]
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)
"""


class Janitor:
    """A process removing ``path`` if its owner dies before ``release``; started before ``path`` exists."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.proc: Any = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _JANITOR, os.fspath(path), str(os.getpid())],
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


def lock_current(path: str | os.PathLike[str], wait_s: float = 0.0) -> int | None:
    """An fd holding ``fcntl.flock`` on the file at ``path`` (made if missing); None while another process
    holds it past ``wait_s`` seconds. A file removed or replaced meanwhile is locked anew."""
    import fcntl

    deadline = time.monotonic() + wait_s
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        os.close(fd)
                        return None
                    time.sleep(0.01)
            current = os.stat(path)
        except FileNotFoundError:  # removed meanwhile: lock the new one
            os.close(fd)
            continue
        except BaseException:
            os.close(fd)
            raise
        if os.path.samestat(os.fstat(fd), current):
            return fd
        os.close(fd)  # replaced while waiting: lock the file that replaced it
