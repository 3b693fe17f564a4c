"""The result cache of ``tune_num_workers`` (``workers.json``): read, locked write, entries checked."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from lightning_gpuopt._checks import is_int, is_number
from lightning_gpuopt._common import warn_once
from lightning_gpuopt.data._lifetime import lock_current


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
        data = json.loads(text) if text.strip() else {}  # empty: a writer holding its lock made it
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        data, problem = None, str(err)
    else:
        problem = f"it holds a JSON {type(data).__name__}, not an object of entries"
    if isinstance(data, dict):
        return data
    warn_once(f"ignoring unreadable worker-tuning cache {path} ({problem}); it will be rewritten")
    return {}


#: seconds a cache write waits for another process's write to finish before giving up (a write takes ms)
_LOCK_WAIT_S = 10.0


@contextlib.contextmanager
def _cache_lock(path: Path) -> Iterator[bool]:
    """Hold the writers' lock on the cache file (False: not had in time); readers need none."""
    fd = lock_current(path, _LOCK_WAIT_S)
    if fd is None:
        yield False
        return
    try:
        yield True
    finally:
        os.close(fd)  # drops the lock (on the file this process replaced, or still at the path)


def _write_cache(path: Path, key: str, entry: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
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
            try:
                tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str))
                os.replace(tmp, path)  # atomic: readers never see half a file
            except BaseException:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise
    except OSError as err:
        warn_once(f"could not write the worker-tuning cache {path} ({err}); tuning will run again next time")


def _cached_problem(hit: Any, candidates: Sequence[int]) -> str | None:
    """Why a cache entry is not a result ``tune_num_workers`` could return (None: it is)."""
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
