import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_gpuopt
from lightning_gpuopt import _EXPORTS
from lightning_gpuopt.cli import COMMANDS, main

HEAVY = ("pynvml", "h5py", "nvidia.dali", "nvtx")


def test_import_is_light():
    code = (
        "import json, sys\n"
        "import lightning_gpuopt\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "torch_imported = 'torch' in sys.modules\n"
        "import torch\n"
        "print(json.dumps({'heavy': heavy, 'torch_imported': torch_imported,"
        " 'cuda_initialized': torch.cuda.is_initialized()}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["heavy"] == []
    assert result["cuda_initialized"] is False


def test_every_public_name_resolves():
    for name in lightning_gpuopt.__all__:
        if name == "__version__":
            continue
        module = _EXPORTS[name]
        assert getattr(lightning_gpuopt, name) is getattr(importlib.import_module(module), name)
    assert set(dir(lightning_gpuopt)) >= set(lightning_gpuopt.__all__)
    with pytest.raises(AttributeError, match="no attribute"):
        lightning_gpuopt.DoesNotExist  # noqa: B018


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
