"""The package's shape: the public names, a light import, the CLI entry points, and the core never
reaching into the harness."""

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_gpuopt
from lightning_gpuopt import _EXPORTS
from lightning_gpuopt.cli import COMMANDS, main

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
    "GPUAugment",
    "UInt8ImageFolder",
    "HDF5ImageDataset",
    "convert_folder_to_hdf5",
    "DALILoader",
    "WorkerTuner",
    "tune_num_workers",
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
    assert set(_EXPORTS) == PRODUCT and len(PRODUCT) == 20
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


def test_recorded_ladder_ships_with_the_package():
    from lightning_gpuopt.bench import rows
    from lightning_gpuopt.bench.report import load_reference

    ref = load_reference()
    names = [r["name"] for r in ref["rows"]]
    # every recorded row is a ladder row (old names through their aliases)
    assert rows.parse_rows(names) == [rows.ROW_ALIASES.get(n, n) for n in names]
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
