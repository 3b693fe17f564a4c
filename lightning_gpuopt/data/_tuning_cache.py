"""The result cache of ``tune_num_workers`` (``workers.json``): read, locked write, entries checked."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from lightning_gpuopt._checks import is_int, is_number
from lightning_gpuopt._common import warn_once


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        warn_once(f"ignoring unreadable worker-tuning cache {path} ({err}); it will be rewritten")
        return {}


#: seconds a cache write waits for another process's write to finish before giving up (a write takes ms)
_LOCK_WAIT_S = 10.0


@contextlib.contextmanager
def _cache_lock(path: Path) -> Iterator[bool]:
    """Hold ``fcntl.flock`` on ``.<cache name>.lock`` beside the cache; yields False when it cannot be had.

    Writers read, change and replace the cache inside it, so entries written at once by several processes
    are all kept. Readers need no lock: the file is only ever replaced whole. Without ``fcntl`` (not POSIX)
    nothing is locked.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover -- not POSIX
        yield True
        return
    lock = path.with_name(f".{path.name}.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        deadline = time.monotonic() + _LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    yield False
                    return
                time.sleep(0.01)
        yield True
    finally:
        os.close(fd)  # drops the lock


def _write_cache(path: Path, key: str, entry: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _cache_lock(path) as locked:
            if not locked:
                warn_once(
                    f"the worker-tuning cache {path} stayed locked by another process for "
                    f"{_LOCK_WAIT_S:.0f} s; this result was not saved (tuning will run again next time)"
                )
                return
            data = _read_cache(path)
            data[key] = entry
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str))
            os.replace(tmp, path)  # atomic: readers never see half a file
    except OSError as err:
        warn_once(
            f"could not write the worker-tuning cache {path} ({err}); tuning will run again next time"
        )


def _cached_problem(hit: Any, candidates: Sequence[int]) -> str | None:
    """Why a cache entry cannot be used as a result (None: it can), checked as an argument would be.

    ``best`` must be one of the candidates and a measured row, every row a candidate with a non-negative
    rate: values ``tune_num_workers`` itself can return.
    """
    if not isinstance(hit, dict):
        return f"the entry is a {type(hit).__name__}, not an object"
    best, table = hit.get("best"), hit.get("table")
    if not is_int(best) or best not in candidates:
        return f"best={best!r} is not one of the candidate worker counts {list(candidates)}"
    if not isinstance(table, list) or not table:
        return "its table of measurements is missing"
    for row in table:
        if not (
            isinstance(row, dict)
            and is_int(row.get("num_workers"))
            and row["num_workers"] in candidates
            and is_number(row.get("samples_per_sec"))
            and row["samples_per_sec"] >= 0
        ):
            return f"its table holds a row that is not a measurement: {row!r}"
    if best not in {row["num_workers"] for row in table}:
        return f"best={best!r} was not measured in its table"
    return None
