"""The shape of the package: no import circle (an import inside a function counts), one adapter from
Lightning's hooks to the observers, no function over 80 lines, at most 18,000 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lightning_gpuopt
from lightning_gpuopt.observe._lifecycle import ObserverCallback
from lightning_gpuopt.observe.advisor import BottleneckAdvisor
from lightning_gpuopt.observe.gpu_stats import GPUStatsMonitor
from lightning_gpuopt.observe.nvtx import NVTXRanges

PACKAGE = Path(lightning_gpuopt.__file__).resolve().parent
FILES = sorted(PACKAGE.rglob("*.py"))
#: the package's size, counted as ``wc -l`` counts its modules
MAX_LINES = 18_000


def _name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Modules of ``modules`` that ``path`` imports anywhere (functions included), ``TYPE_CHECKING`` aside."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            # `from a.b import c` imports the module a.b.c where there is one, else a name of a.b
            targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                       for a in node.names]  # fmt: skip
        else:
            continue
        found |= {t for t in targets if t in modules}
    return found - {_name(path)}


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_no_import_circle_even_through_imports_inside_functions():
    modules = {_name(p) for p in FILES}
    graph = {_name(p): _imports(p, modules) for p in FILES}
    assert "lightning_gpuopt.observe._lifecycle" in graph and "lightning_gpuopt.data.hdf5" in graph
    circles = sorted(m for m in graph if m in _reaches(graph, m))
    assert circles == [], f"modules on an import circle: {circles}"


_HOOKS = [
    name
    for name, value in vars(ObserverCallback).items()
    if (name.startswith("on_") or name in ("setup", "teardown")) and callable(value)
]


@pytest.mark.parametrize("observer", [GPUStatsMonitor, BottleneckAdvisor, NVTXRanges])
def test_the_observers_share_one_adapter_from_lightning_hooks(observer):
    assert issubclass(observer, ObserverCallback) and len(_HOOKS) >= 15
    # NVTXRanges also ranges validate/test/predict runs: its own setup opens them for every stage
    extra = {"setup"} if observer is NVTXRanges else set()
    assert {h for h in _HOOKS if h in vars(observer)} == extra


def test_no_function_over_80_lines():
    long = {
        f"{p.relative_to(PACKAGE)}:{n.name}": n.end_lineno - n.lineno + 1
        for p in FILES
        for n in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 80
    }
    assert long == {}


def test_the_package_fits_in_its_line_budget():
    lines = sum(len(p.read_bytes().splitlines()) for p in FILES)
    assert 5_000 < lines <= MAX_LINES, f"{lines} lines in {len(FILES)} modules"
