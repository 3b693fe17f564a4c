"""The package's shape: the public names, a light import, the CLI entry points, an import graph without
cycles, and the core never reaching into the harness."""

import ast
import importlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_gpuopt
from lightning_gpuopt import _EXPORTS
from lightning_gpuopt.cli import COMMANDS, main
from tests._cli import one_error_line

PACKAGE = Path(lightning_gpuopt.__file__).resolve().parent
HEAVY = ("pynvml", "h5py", "nvidia.dali", "nvtx", "torchvision")
# the product: what feeds the GPU, makes its work cheaper, and shows what it does
PRODUCT = {
    "GPUStatsMonitor",
    "NVTXRanges",
    "BottleneckAdvisor",
    "Verdict",
    "ChannelsLast",
    "FusedOptimizer",
    "CompileModel",
    "fast_trainer_kwargs",
    "choose_precision",
    "OptimizedDataModule",
    "AugmentConfig",
    "TuningConfig",
    "DALIOptions",
    "HDF5Options",
    "GPUAugment",
    "UInt8ImageFolder",
    "HDF5ImageDataset",
    "convert_folder_to_hdf5",
    "DALILoader",
    "DecodeOptions",
    "WorkerTuner",
    "tune_num_workers",
    "GPUOptCLI",
    "FabricObserver",
}
CORE_LINES = 700


def _core_modules() -> list[Path]:
    files = [PACKAGE / "_common.py", PACKAGE / "_compat.py"]
    for part in ("data", "compute", "observe"):
        files += sorted((PACKAGE / part).rglob("*.py"))
    return files


def test_import_is_light():
    code = (
        "import json, sys\n"
        "import lightning_gpuopt\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "import torch\n"
        "print(json.dumps({'heavy': heavy, 'cuda_initialized': torch.cuda.is_initialized()}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["heavy"] == []
    assert result["cuda_initialized"] is False


def test_exports_are_the_product_and_resolve():
    assert set(_EXPORTS) == PRODUCT and len(PRODUCT) == 24
    assert lightning_gpuopt.__all__ == ["__version__", *sorted(PRODUCT)]
    for name in PRODUCT:
        assert getattr(lightning_gpuopt, name) is getattr(importlib.import_module(_EXPORTS[name]), name)
    assert set(dir(lightning_gpuopt)) >= set(lightning_gpuopt.__all__)
    with pytest.raises(AttributeError, match="no attribute"):
        lightning_gpuopt.DoesNotExist  # noqa: B018


def _package_of(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])


def _imported_modules(source: str, package: str) -> set[str]:
    """Every module an ``import`` anywhere in ``source`` names (relative imports resolved in ``package``)."""
    tree = ast.parse(source)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the module's package
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize(
    "source",
    [
        "from lightning_gpuopt.bench.models import ImageClassifier\n",
        "import lightning_gpuopt.cli\n",
        "def f():\n    from lightning_gpuopt import commands\n",
        "from ..bench import measure\n",
    ],
)
def test_the_import_check_sees_harness_imports(source):
    assert _harness_imports(_imported_modules(source, "lightning_gpuopt.data"))
    assert not _harness_imports(_imported_modules("from lightning_gpuopt._common import cache_dir\n", "x"))


def _harness_imports(names: set[str]) -> list[str]:
    banned = ("lightning_gpuopt.bench", "lightning_gpuopt.commands", "lightning_gpuopt.cli")
    return sorted(n for n in names if any(n == b or n.startswith(b + ".") for b in banned))


def test_core_never_imports_the_harness_and_stays_small():
    files = _core_modules()
    assert len(files) > 10
    offenders = {
        str(p.relative_to(PACKAGE)): _harness_imports(
            _imported_modules(p.read_text(encoding="utf-8"), _package_of(p))
        )
        for p in files
    }
    assert {k: v for k, v in offenders.items() if v} == {}
    too_long = {
        str(p.relative_to(PACKAGE)): n
        for p in files
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > CORE_LINES
    }
    assert too_long == {}, f"core modules over {CORE_LINES} lines: {too_long}"


# --- the import graph -------------------------------------------------------------------------------------
HARNESS = ("lightning_gpuopt.bench", "lightning_gpuopt.commands", "lightning_gpuopt.cli")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_level_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The imports a module runs when it is imported, and those under ``if TYPE_CHECKING:`` (a cycle through
    an annotation still ties the two modules together); not those inside functions."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            found += _module_level_imports(node.body) + _module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                found += _module_level_imports(block)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            found += _module_level_imports(node.body)
    return found


def _import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """``module -> modules of the package it imports at module level``, from ``{module: (source, is_package)}``.

    ``from a.b import c`` is an edge to the module ``a.b.c`` where there is one, else to ``a.b``; an import
    of a name outside the package is no edge.
    """
    graph: dict[str, set[str]] = {}
    for name, (source, is_package) in sources.items():
        package = name if is_package else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in _module_level_imports(ast.parse(source).body):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: resolve against the module's package
                    parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{parent}.{base}" if base else parent
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in sources else base for a in node.names]
            for target in targets:
                while target and target not in sources:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) through each strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = {v}
            while (w := stack.pop()) != v:
                component.add(w)
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_through(graph, component) for component in components]


def _cycle_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    # shortest way from the component's first module back to itself, inside the component
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & component):
            if w == start:
                return [*paths[v], start]
            if w not in paths:
                paths[w] = [*paths[v], w]
                queue.append(w)
    raise AssertionError(f"no cycle in {component}")


def _package_sources() -> dict[str, tuple[str, bool]]:
    return {
        _module_name(p): (p.read_text(encoding="utf-8"), p.name == "__init__.py")
        for p in sorted(PACKAGE.rglob("*.py"))
    }


def test_the_import_graph_sees_module_level_imports_and_cycles():
    sources = {
        "pkg": ("", True),
        "pkg.a": ("from pkg import b\n", False),
        "pkg.b": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import X\n", False),
        "pkg.c": ("try:\n    import pkg.a\nexcept ImportError:\n    pass\n", False),
        "pkg.d": ("def f():\n    from pkg import a\n", False),
        "pkg.e": ("import torch\nfrom pkg.d import f\n", False),
    }
    graph = _import_graph(sources)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.d"] == set() and graph["pkg.e"] == {"pkg.d"}
    assert _cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    assert _cycles({**graph, "pkg.c": set()}) == []


def test_the_package_has_no_import_cycles():
    graph = _import_graph(_package_sources())
    assert "lightning_gpuopt.compute.preset" in graph and len(graph) > 40
    cycles = _cycles(graph)
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_only_the_harness_imports_the_bench_package():
    offenders = {
        name: bench
        for name, (source, is_package) in _package_sources().items()
        if not any(name == h or name.startswith(h + ".") for h in HARNESS)
        and (
            bench := sorted(
                n
                for n in _imported_modules(source, name if is_package else name.rpartition(".")[0])
                if n == "lightning_gpuopt.bench" or n.startswith("lightning_gpuopt.bench.")
            )
        )
    }
    assert offenders == {}


def test_the_bench_package_holds_only_what_the_commands_use():
    """Every module of ``lightning_gpuopt.bench`` is reached from the commands' imports (anywhere in a
    module, functions included); what only the benchmark scripts use lives in ``benchmarks/``."""
    sources = _package_sources()
    bench = {n for n in sources if n.startswith("lightning_gpuopt.bench.")}
    reached: set[str] = set()
    todo = [n for n in sources if n.startswith("lightning_gpuopt.commands.")]
    while todo:
        name = todo.pop()
        source, is_package = sources[name]
        for imported in _imported_modules(source, name if is_package else name.rpartition(".")[0]):
            if imported in bench and imported not in reached:
                reached.add(imported)
                todo.append(imported)
    assert sorted(bench - reached) == []


def test_every_availability_flag_is_used():
    from lightning_gpuopt import _imports

    flags = [n for n in vars(_imports) if n.startswith("_") and n.endswith("_AVAILABLE")]
    assert flags
    others = [p for p in PACKAGE.rglob("*.py") if p.name != "_imports.py"]
    others += sorted((PACKAGE.parent / "benchmarks").glob("*.py"))
    text = "\n".join(p.read_text(encoding="utf-8") for p in others)
    assert [f for f in flags if f not in text] == []


def test_recorded_ladder_ships_with_the_package():
    from lightning_gpuopt.bench import rows
    from lightning_gpuopt.bench.report import load_reference

    ref = load_reference()
    names = [r["name"] for r in ref["rows"]]
    # every recorded row is a ladder row
    assert rows.parse_rows(names) == names
    assert ref["machine"]["gpu"] and all(r["samples_per_sec"] > 0 for r in ref["rows"])


@pytest.mark.parametrize(
    "command",
    [
        [str(Path(sys.executable).parent / "lightning-gpuopt"), "--help"],
        [sys.executable, "-m", "lightning_gpuopt", "--help"],
    ],
    ids=["console-script", "python-m"],
)
def test_cli_help(command):
    if not Path(command[0]).exists():
        pytest.skip(f"{command[0]} is not installed (package not installed with pip)")
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in COMMANDS:
        assert name in out.stdout


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_subcommand_help(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0
    assert f"lightning-gpuopt {name}" in capsys.readouterr().out


def _doc_imports() -> list[tuple[str, str]]:
    """``(file, statement)`` for each ``from lightning_gpuopt... import ...`` / ``import lightning_gpuopt...``
    line in the fenced code blocks (parenthesised lists joined) and inline code of README.md and docs/*.md."""
    root = PACKAGE.parent
    found = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        if not path.exists():
            continue
        in_code, lines = False, path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            line = lines[i].strip()
            if line.startswith("```"):
                in_code = not in_code
            elif not in_code:  # prose: `from lightning_gpuopt.x import y` in an inline code span
                spans = re.findall(r"`((?:from|import) lightning_gpuopt[^`]*)`", line)
                found += [(path.name, span) for span in spans]
            else:
                line = line.removeprefix(">>> ").removeprefix("$ ")
                if line.startswith(("from lightning_gpuopt", "import lightning_gpuopt")):
                    stmt = line.split("#")[0].strip()
                    while stmt.count("(") > stmt.count(")") and i + 1 < len(lines):
                        i += 1
                        stmt += " " + lines[i].split("#")[0].strip()
                    found.append((path.name, stmt.rstrip("\\").strip()))
            i += 1
    return found


DOC_IMPORTS = _doc_imports()


def test_docs_show_imports():
    assert any("ContinuousDataLoader" in stmt for _, stmt in DOC_IMPORTS)
    assert len(DOC_IMPORTS) >= 10


@pytest.mark.parametrize(("doc", "statement"), DOC_IMPORTS, ids=[f"{d}:{s}" for d, s in DOC_IMPORTS])
def test_doc_imports_resolve(doc, statement):
    """Every import a page shows works: a moved or renamed name cannot leave the docs behind."""
    tree = ast.parse(statement)  # a doc line that is not Python fails here, naming the page
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            missing = [a.name for a in node.names if a.name != "*" and not hasattr(module, a.name)]
            if missing:  # a submodule imported by name (``from lightning_gpuopt import data``)
                missing = [n for n in missing if importlib.util.find_spec(f"{node.module}.{n}") is None]
            assert not missing, f"{doc}: `{statement}`: {node.module} has no {missing}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)


def _broken_torchvision(folder: Path, version: str = "0.29.1") -> Path:
    """A torchvision that fails at import as one built for another torch does."""
    (folder / "torchvision").mkdir(parents=True)
    (folder / "torchvision" / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n'
    )
    info = folder / f"torchvision-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torchvision\nVersion: {version}\n")
    return folder


def test_a_torchvision_built_for_another_torch_is_named_with_the_fix(jpeg_folder, tmp_path):
    """It takes `import lightning.pytorch` down (torchmetrics imports it): every command ends with one line
    naming both versions and the pip command, exit 2; the package's names raise ImportError saying the same."""
    import os

    import torch

    fake = _broken_torchvision(tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), str(PACKAGE.parent)])}
    env["LIGHTNING_GPUOPT_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_gpuopt", "tune", str(jpeg_folder)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc.stderr, "tune")
    minor = int(torch.__version__.split(".")[1])
    assert f"torchvision 0.29.1 cannot be imported with torch {torch.__version__}" in line
    assert "operator torchvision::nms does not exist" in line
    assert f'pip install --force-reinstall --no-deps "torchvision==0.{minor + 15}.*"' in line
    code = "from lightning_gpuopt import OptimizedDataModule"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1
    assert "ImportError: torchvision 0.29.1 cannot be imported with torch" in proc.stderr


@pytest.mark.parametrize(
    ("torch_version", "command"),
    [
        ("2.13.0+cpu", '"torchvision==0.28.*" --index-url https://download.pytorch.org/whl/cpu'),
        ("2.11.0+cu130", '"torchvision==0.26.*" --index-url https://download.pytorch.org/whl/cu130'),
        ("2.4.1", '"torchvision==0.19.*" (or'),
    ],
)
def test_the_fix_names_the_torchvision_made_for_this_torch(monkeypatch, torch_version, command):
    import torch

    from lightning_gpuopt._imports import torchvision_mismatch

    monkeypatch.setattr(torch, "__version__", torch_version)
    line = torchvision_mismatch(RuntimeError("operator torchvision::nms does not exist"))
    assert f"with torch {torch_version} (RuntimeError: operator torchvision::nms does not exist)" in line
    assert f"pip install --force-reinstall --no-deps {command}" in line and "\n" not in line
