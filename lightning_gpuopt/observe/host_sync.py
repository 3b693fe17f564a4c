"""Which lines of the user's code make the host wait for the GPU, and how often a step: ``SyncLocator`` runs
``torch.cuda.set_sync_debug_mode("warn")`` for a few training steps and charges each warning to a line
(``attribute``). How the monitor runs it: docs/advisor.md."""

from __future__ import annotations

import functools
import os
import sysconfig
import traceback
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_gpuopt._common import package_dirs

__all__ = ["SYNCS_KEY", "SYNC_MESSAGE", "SyncLocator", "SyncSite", "attribute", "owner_of", "user_sites"]

#: The text of torch's warning at a synchronizing call under ``set_sync_debug_mode("warn")``.
SYNC_MESSAGE = "synchronizing CUDA operation"
#: Key of the synchronizing calls a step found in the user's code (``GPUStatsMonitor``).
SYNCS_KEY = "gpu/host_syncs_per_step"

_LIGHTNING = ("lightning", "lightning_fabric", "pytorch_lightning", "lightning_utilities", "torchmetrics")
#: Lightning's own training loop: a sync under these frames is the loop's, not the user's line above them
_LOOP_PARTS = (f"{os.sep}loops{os.sep}", f"{os.sep}trainer{os.sep}trainer.py")


@functools.cache
def _package_dirs() -> dict[str, tuple[str, ...]]:
    paths = sysconfig.get_paths()
    stdlib = tuple(
        os.path.join(os.path.realpath(paths[k]), "") for k in ("stdlib", "platstdlib") if k in paths
    )
    return {
        "lightning-gpuopt": package_dirs(("lightning_gpuopt",)),
        "lightning": package_dirs(_LIGHTNING),
        "torch": package_dirs(("torch",)),
        "python": stdlib,
    }


def owner_of(filename: str) -> str:
    """``"user"``, ``"lightning-gpuopt"``, ``"lightning"``, ``"torch"`` or ``"python"`` (the standard
    library, and frames without a file such as ``<frozen ...>``)."""
    if filename.startswith("<"):
        return "python"
    path = os.path.realpath(filename)
    for owner, dirs in _package_dirs().items():
        if dirs and path.startswith(dirs):
            return owner
    return "user"


@dataclass(frozen=True)
class SyncSite:
    """A line where the host waited for the GPU (``owner``: whose line, as ``owner_of`` says), with the
    synchronizing calls it made (``count``) in the ``steps`` training steps the locator was on for."""

    filename: str
    lineno: int
    code: str
    owner: str
    count: int
    steps: int

    @property
    def where(self) -> str:
        """``file.py:42``: the file's name and the line."""
        return f"{os.path.basename(self.filename)}:{self.lineno}"

    @property
    def per_step(self) -> float:
        return self.count / self.steps if self.steps else float(self.count)

    def describe(self) -> str:
        """``"`model.py:42` synchronizes every step (`loss.item()`)"``."""
        n = self.per_step
        often = f"in {n:.0%} of steps" if n < 0.95 else "every step" if n < 1.5 else f"{n:.0f} times a step"
        code = self.code if len(self.code) <= 60 else self.code[:57] + "..."
        whose = "" if self.owner == "user" else f" ({self.owner}'s own)"
        return f"`{self.where}`{whose} synchronizes {often}" + (f" (`{code}`)" if code else "")


def attribute(stack: Sequence[Any]) -> tuple[str, int, str, str] | None:
    """``(filename, lineno, code, owner)`` of the line a synchronizing call at ``stack`` (outermost frame first,
    as ``traceback.extract_stack`` gives it) is charged to."""
    frames = [(f, owner_of(f.filename)) for f in stack]
    frames = [(f, o) for f, o in frames if o != "python"] or frames
    if not frames:
        return None
    user = next((i for i in range(len(frames) - 1, -1, -1) if frames[i][1] == "user"), None)
    inner = frames[user + 1 :] if user is not None else frames
    in_loop = any(o == "lightning" and any(p in f.filename for p in _LOOP_PARTS) for f, o in inner)
    if user is not None and not in_loop:
        f, o = frames[user]
    else:
        libs = [(f, o) for f, o in inner if o in ("lightning", "lightning-gpuopt")]
        f, o = libs[-1] if libs else inner[-1] if inner else frames[-1]
    return f.filename, int(f.lineno or 0), (f.line or "").strip(), o


class SyncLocator:
    """Counts synchronizing CUDA calls by the line they come from, between ``start()`` and ``stop()``.

    Call ``start()``, ``step()`` after each training step, and ``stop()`` to turn it off and get the sites,
    most frequent first. ``record(stack)`` counts one sync at ``stack``.

    Example:
        >>> from traceback import FrameSummary
        >>> locator = SyncLocator()
        >>> locator.record([FrameSummary("/home/me/model.py", 42, "training_step", line="loss.item()")])
        >>> locator.step()
        >>> locator.sites()[0].describe()
        '`model.py:42` synchronizes every step (`loss.item()`)'
    """

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, int, str, str]] = Counter()
        self.steps = 0
        self._catch: Any = None
        self._showwarning: Any = None

    @property
    def running(self) -> bool:
        return self._catch is not None

    def record(self, stack: Sequence[Any]) -> None:
        """Count one synchronizing call made at ``stack`` (outermost frame first)."""
        site = attribute(stack)
        if site is not None:
            self.counts[site] += 1

    def step(self) -> None:
        """A training step ended."""
        self.steps += 1

    def _hook(self, message: Any, category: Any, filename: str, lineno: int, file: Any = None,
              line: Any = None) -> None:  # fmt: skip
        if SYNC_MESSAGE in str(message):
            here = os.path.realpath(__file__)
            stack = [f for f in traceback.extract_stack() if os.path.realpath(f.filename) != here]
            self.record(stack)
        elif self._showwarning is not None:
            self._showwarning(message, category, filename, lineno, file, line)

    def start(self) -> bool:
        """Turn the sync debug mode on; ``False`` without CUDA, or where the user set a sync debug mode."""
        if self.running or not torch.cuda.is_available() or torch.cuda.get_sync_debug_mode() != 0:
            return False
        self.counts.clear()
        self.steps = 0
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.filterwarnings("always", message=f".*{SYNC_MESSAGE}")
        self._showwarning = warnings.showwarning
        warnings.showwarning = self._hook
        torch.cuda.set_sync_debug_mode("warn")
        return True

    def stop(self) -> list[SyncSite]:
        """Turn the mode back to what it was; the sites counted since ``start()``."""
        if self.running:
            torch.cuda.set_sync_debug_mode(0)  # start() ran only where the mode was off
            catch, self._catch = self._catch, None
            catch.__exit__(None, None, None)  # restores the filters and showwarning
            self._showwarning = None
        return self.sites()

    def sites(self) -> list[SyncSite]:
        """The sites counted so far, most frequent first."""
        return [
            SyncSite(filename, lineno, code, owner, count, self.steps)
            for (filename, lineno, code, owner), count in self.counts.most_common()
        ]


def user_sites(sites: Sequence[SyncSite]) -> list[SyncSite]:
    """The sites in the user's own code."""
    return [s for s in sites if s.owner == "user"]
