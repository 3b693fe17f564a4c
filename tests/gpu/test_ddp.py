"""Two GPUs under DDP, every part of the package in one fit (``_ddp_child.py``), checked from what each
rank saw.

For the folder, HDF5 and DALI backends: every training sample is seen exactly once an epoch (640 one-image
classes = 5 x 2 ranks x batch 64), the ranks get equal batch counts, validation (601 samples, divisible by
nothing here) covers every sample with padding below the world size, the CSV logger has one row a metric
and step with the rank-suffixed keys, and each rank's monitor reads its own GPU. With
``CUDA_VISIBLE_DEVICES=1,0`` rank 0's monitor samples NVML device 1.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("_ddp_child.py")
TRAIN_N, VAL_N, IMAGE = 640, 601, 64


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One-image classes as JPEG folders, and the same as uint8 stores."""
    from lightning_gpuopt import convert_folder_to_hdf5
    from lightning_gpuopt.bench.synthetic import make_jpeg_folder

    base = tmp_path_factory.mktemp("ddp_data")
    out = {}
    for split, n in (("train", TRAIN_N), ("val", VAL_N)):
        folder = make_jpeg_folder(base / split, n, n, image_size=(160, 120))
        store = base / f"{split}.h5"
        convert_folder_to_hdf5(folder, store, storage_size=IMAGE, progress=False)
        out[split], out[f"{split}_h5"] = str(folder), str(store)
    return out


def run_child(
    data: dict[str, str], backend: str, workdir: Path, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    h5 = backend == "hdf5"
    cmd = [sys.executable, str(CHILD), "--backend", backend, "--workdir", str(workdir),
           "--classes", str(TRAIN_N), "--train", data["train_h5" if h5 else "train"],
           "--val", data["val_h5" if h5 else "val"], "--image-size", str(IMAGE)]  # fmt: skip
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": path}
    proc = subprocess.run(cmd, env=full_env, cwd=workdir, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads(p.read_text()) for p in sorted(workdir.glob("rank*.json"))]
    assert len(ranks) == 2, proc.stderr[-4000:]
    return ranks


def per_epoch(ranks: list[dict[str, Any]], split: str) -> dict[int, list[dict[str, Any]]]:
    """Each epoch's record of every rank (one a rank)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for rank in ranks:
        for r in rank["records"]:
            if r["split"] == split:
                out.setdefault(r["epoch"], []).append(r)
    assert out and all(len(v) == len(ranks) for v in out.values()), out.keys()
    return out


def check_coverage(ranks: list[dict[str, Any]]) -> None:
    for epoch, records in per_epoch(ranks, "train").items():
        labels = Counter(label for r in records for label in r["labels"])
        assert set(labels) == set(range(TRAIN_N)) and set(labels.values()) == {1}, f"train epoch {epoch}"
        assert len({r["batches"] for r in records}) == 1, f"train epoch {epoch}: unequal batch counts"
    for epoch, records in per_epoch(ranks, "val").items():
        labels = Counter(label for r in records for label in r["labels"])
        pad = sum(labels.values()) - VAL_N
        assert set(labels) == set(range(VAL_N)) and 0 <= pad < len(ranks), f"val epoch {epoch}: pad {pad}"
        assert len({r["batches"] for r in records}) == 1, f"val epoch {epoch}: unequal batch counts"


def check_logged(workdir: Path) -> None:
    rows = list(csv.DictReader((workdir / "csv" / "version_0" / "metrics.csv").open()))
    seen: Counter[tuple[str, str]] = Counter()
    for row in rows:
        for key, value in row.items():
            if key not in ("step", "epoch") and value not in ("", None):
                seen[(key, row["step"])] += 1
    assert all(n == 1 for n in seen.values()), [k for k, n in seen.items() if n > 1][:5]
    keys = {key for key, _ in seen}
    assert {"gpu/util/rank0", "gpu/util/rank1", "time/data_wait_frac/rank1"} <= keys, sorted(keys)


def check_own_gpu(ranks: list[dict[str, Any]]) -> None:
    from lightning_gpuopt.observe.nvml import normalize_uuid

    for rank in ranks:  # torch spells a UUID without NVML's "GPU-" prefix
        dev = rank["device"]
        assert normalize_uuid(str(dev.get("monitor_nvml_uuid"))) == normalize_uuid(dev["torch_uuid"]), dev
    assert len({r["device"]["monitor_nvml_index"] for r in ranks}) == 2


@pytest.mark.parametrize("backend", ["folder", "hdf5", "dali"])
def test_ddp_fit_sees_each_sample_once_and_logs_each_rank(
    data: dict[str, str], backend: str, tmp_path: Path
) -> None:
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    pytest.importorskip("pynvml")
    ranks = run_child(data, backend, tmp_path)
    check_coverage(ranks)
    check_logged(tmp_path)
    check_own_gpu(ranks)


def test_reordered_devices_map_rank0_to_nvml_1(data: dict[str, str], tmp_path: Path) -> None:
    pytest.importorskip("pynvml")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0,1").split(",")
    if len(visible) < 2 or not all(v.strip().isdigit() for v in visible[:2]):
        pytest.skip("CUDA_VISIBLE_DEVICES names fewer than two GPUs by index")
    ranks = run_child(data, "folder", tmp_path, env={"CUDA_VISIBLE_DEVICES": f"{visible[1]},{visible[0]}"})
    check_own_gpu(ranks)
    rank0 = next(r for r in ranks if r["rank"] == 0)
    assert rank0["device"]["monitor_nvml_index"] == int(visible[1]), rank0["device"]
