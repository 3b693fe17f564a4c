"""Start a child, watch it until a chosen point, send it a signal there, and collect what it left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.faults import _procs
from tests.faults._helpers import CHILD_TIMEOUT_S, GRACE_S, REPO, child_env


@dataclass
class Killed:
    """What happened to a child that was sent a signal at a point."""

    reached: bool  # the point was reached while the child ran (else it ended first)
    returncode: int | None
    exited_after_s: float | None  # seconds from the signal to its exit (None: it had to be SIGKILLed)
    survivors: list[_procs.Proc]  # processes of its tree (or naming its token) alive after the grace period
    waited_s: float  # seconds until its processes were gone (or the grace period ran out)
    seen: dict = field(default_factory=dict)  # what the trigger observed when it fired
    stdout: str = ""
    stderr: str = ""

    def describe(self) -> str:
        left = "; ".join(p.describe() for p in self.survivors) or "none"
        return (
            f"reached={self.reached} rc={self.returncode} exited_after={self.exited_after_s} seen={self.seen} "
            f"tree_gone_after={self.waited_s} "
            f"survivors=[{left}] stderr tail={self.stderr.strip()[-600:]!r}"
        )


class Watch:
    """The child under watch: cheap views of its state for a trigger to test."""

    def __init__(self, proc: subprocess.Popen, started: float) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.started = started
        self.tree: list[_procs.Proc] = []

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def children(self) -> list[_procs.Proc]:
        self.tree = _procs.descendants(self.pid)
        return self.tree

    def open_paths(self) -> list[str]:
        paths = []
        try:
            fds = os.listdir(f"/proc/{self.pid}/fd")
        except OSError:
            return paths
        for fd in fds:
            with contextlib.suppress(OSError):
                paths.append(os.readlink(f"/proc/{self.pid}/fd/{fd}"))
        return paths

    def written(self) -> int:
        """Bytes the child has passed to write system calls so far (``wchar`` of ``/proc/PID/io``)."""
        try:
            with open(f"/proc/{self.pid}/io") as fh:
                for line in fh:
                    if line.startswith("wchar:"):
                        return int(line.split()[1])
        except OSError:
            pass
        return 0

    def maps(self, fragment: str) -> bool:
        try:
            with open(f"/proc/{self.pid}/maps") as fh:
                return fragment in fh.read()
        except OSError:
            return False


def kill_at(
    argv: list[str],
    sig: int | Callable[[Watch], None],
    trigger: Callable[[Watch], dict | None],
    token: str,
    *,
    cwd: Path,
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
    on_line: Callable[[str], None] | None = None,
    poll_s: float = 0.001,
) -> Killed:
    """Run ``argv``; when ``trigger(watch)`` returns a dict (what it saw), send ``sig`` to the child.

    ``sig`` may instead be a function of the watch that applies another fault (fills its disk, say); the
    child then runs on to its end.

    The child's own process tree is recorded just before the signal. After the child exits, its tree and
    every process whose command line holds ``token`` get ``GRACE_S`` to disappear; what is left is reported
    (and then SIGKILLed so later cases start clean).
    """
    out_path, err_path = cwd / "child.stdout", cwd / "child.stderr"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        started = time.monotonic()
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=err,
            cwd=REPO,
            env=env or child_env(),
            preexec_fn=preexec_fn,
            start_new_session=True,
        )
    watch = Watch(proc, started)
    seen = None
    tree: list[_procs.Proc] = []
    read_at = 0
    try:
        while proc.poll() is None and watch.elapsed < CHILD_TIMEOUT_S:
            if on_line is not None:
                text = out_path.read_text(errors="replace")
                complete = text[read_at:].rpartition("\n")[0]
                if complete:
                    read_at += len(complete) + 1
                    for line in complete.splitlines():
                        on_line(line)
            found = trigger(watch)
            if found is not None:
                tree = _procs.descendants(proc.pid)
                if proc.poll() is None:  # still running: the point is reached
                    if callable(sig):
                        sig(watch)
                    else:
                        os.kill(proc.pid, sig)
                    seen = {**found, "children": len(tree), "at_s": round(watch.elapsed, 3)}
                break
            time.sleep(poll_s)
        if seen is None:
            tree = tree or watch.tree
            if proc.poll() is None:  # the point never came: stop the child, the case fails as not reached
                proc.kill()
        signalled = time.monotonic()
        exited_after: float | None
        try:
            proc.wait(timeout=CHILD_TIMEOUT_S)
            exited_after = round(time.monotonic() - signalled, 3)
        except subprocess.TimeoutExpired:
            tree = _procs.descendants(proc.pid) or tree
            proc.kill()
            proc.wait()
            exited_after = None
        left, waited = _procs.wait_for_survivors(tree, token, GRACE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _procs.kill_all(left)
    return Killed(
        reached=seen is not None,
        returncode=proc.returncode,
        exited_after_s=exited_after,
        survivors=left,
        waited_s=round(waited, 3),
        seen=seen or {},
        stdout=out_path.read_text(errors="replace"),
        stderr=err_path.read_text(errors="replace"),
    )


SIGNALS = {"kill-9": signal.SIGKILL, "kill-15": signal.SIGTERM}
