"""Read what the NVTX injection recorder (``nvtx_recorder.c``) wrote and rebuild the range tree.

Shared by ``tests/observe/test_nvtx.py`` and ``tests/gpu/test_nvtx_recorded.py``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
RECORDER_SOURCE = HERE / "nvtx_recorder.c"


@dataclass(frozen=True)
class Event:
    tid: int
    kind: str  # init, domain, string, push, pop, start, end, mark, category, thread_name
    domain: str  # "-" for the default domain (torch.cuda.nvtx, nvtxRangePushA)
    color: str  # ARGB hex or "-"
    message: str
    range_id: int


def build_recorder(out_dir: str | os.PathLike[str], cc: str | None = None) -> Path | None:
    """Compile the recorder into ``out_dir/librecorder.so``; None when there is no C compiler."""
    cc = cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        return None
    include = os.environ.get("NVTX3_INCLUDE_DIR", str(HERE))
    out = Path(out_dir) / "librecorder.so"
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O2", f"-I{include}", str(RECORDER_SOURCE), "-o", str(out), "-lpthread"],
        check=True,
        capture_output=True,
        text=True,
    )
    return out


def recorder_env(library: str | os.PathLike[str], out_file: str | os.PathLike[str]) -> dict[str, str]:
    """Environment variables that attach the recorder to any NVTX v3 client of a new process."""
    return {"NVTX_INJECTION64_PATH": str(Path(library).resolve()), "NVTX_RECORDER_OUT": str(out_file)}


def read_events(path: str | os.PathLike[str]) -> list[Event]:
    events = []
    for line in Path(path).read_text().splitlines():
        parts = line.split("\t")
        if len(parts) != 6:
            continue
        tid, kind, domain, color, message, rid = parts
        events.append(Event(int(tid), kind, domain, color, message, int(rid)))
    return events


def split_scenarios(events: list[Event]) -> dict[str, list[Event]]:
    """Events between ``scenario NAME`` marks, by NAME (the marks themselves are left out)."""
    out: dict[str, list[Event]] = {}
    current: list[Event] | None = None
    for ev in events:
        if ev.kind == "mark" and ev.message.startswith("scenario "):
            current = out.setdefault(ev.message.removeprefix("scenario "), [])
            continue
        if current is not None:
            current.append(ev)
    return out


@dataclass
class Tree:
    """Push/pop ranges of one domain replayed per thread like a profiler does."""

    lines: list[tuple[int, int, str]]  # (tid, depth, message) per push, in order
    problems: list[str]  # pops without a push, ranges left open
    marks: list[tuple[int, str]]  # (index into lines at the time of the mark, message)
    colors: dict[str, str]


def replay(events: list[Event], domain: str) -> Tree:
    stacks: dict[int, list[str]] = {}
    lines: list[tuple[int, int, str]] = []
    problems: list[str] = []
    marks: list[tuple[int, str]] = []
    colors: dict[str, str] = {}
    for ev in events:
        if ev.domain != domain:
            continue
        stack = stacks.setdefault(ev.tid, [])
        if ev.kind == "push":
            lines.append((ev.tid, len(stack), ev.message))
            colors.setdefault(ev.message.split(" ")[0] if ev.message[-1:].isdigit() else ev.message, ev.color)
            stack.append(ev.message)
        elif ev.kind == "pop":
            if not stack:
                problems.append(f"thread {ev.tid}: pop without an open range")
            else:
                stack.pop()
        elif ev.kind == "mark":
            marks.append((len(lines), ev.message))
    for tid, stack in stacks.items():
        if stack:
            problems.append(f"thread {tid}: left open {stack}")
    return Tree(lines, problems, marks, colors)


def outline(tree: Tree) -> list[str]:
    """``"  " * depth + message`` for each push: an indented picture of the timeline's nesting."""
    return ["  " * depth + msg for _, depth, msg in tree.lines]


def summary(tree: Tree) -> dict[str, object]:
    """Counts of each range name (numbers stripped), threads, problems and the first pushes."""
    names = Counter(" ".join(w for w in msg.split(" ") if not w.isdigit()) for _, _, msg in tree.lines)
    return {
        "pushes": len(tree.lines),
        "threads": len({tid for tid, _, _ in tree.lines}),
        "counts": dict(names),
        "max_depth": max((d for _, d, _ in tree.lines), default=-1) + 1,
        "problems": tree.problems,
        "marks": [m for _, m in tree.marks],
        "first": outline(tree)[:24],
    }
