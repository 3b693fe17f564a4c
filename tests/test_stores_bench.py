"""benchmarks/stores.py: its --quick CPU run (both stores warm and cold, the disk's O_DIRECT bandwidth) and
the eviction check it relies on, which must see a file whose pages stay in memory."""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import pytest

pytest.importorskip("h5py")
if not hasattr(os, "posix_fadvise"):
    pytest.skip("the cold rows need os.posix_fadvise (Linux)", allow_module_level=True)

from tests.test_benchmarks import load


def test_quick_run_writes_every_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_GPUOPT_CACHE_DIR", str(tmp_path / "cache"))
    stores = load("stores.py")
    out = tmp_path / "stores.json"
    assert stores.main(["--quick", "--data", str(tmp_path / "data"), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {r["name"]: r for r in doc["rows"]}
    assert list(rows) == list(stores.ROWS)
    source = doc["source_bytes_per_image"]
    assert source > 0
    for name in ("raw_store_warm", "raw_store_cold", "compact_store_warm", "compact_store_cold"):
        row = rows[name]
        assert row["samples_per_sec"] > 0 and row["min"] <= row["samples_per_sec"] <= row["max"], row
        assert len(row["repeats"]) == 2 and row["read_threads"] >= 1
        assert row["per_thread_per_sec"] == row["samples_per_sec"] / row["read_threads"]
        assert row["rule_expected_per_sec"] == doc["data"]["rule"][name] > 0
        if name.endswith("_cold"):
            assert row["evicted"] is True and len(row["eviction"]) == 2, row
    # the raw store holds canvases, larger than the JPEGs; the compact one no more than the JPEGs
    assert rows["raw_store_warm"]["bytes_per_image"] > source >= rows["compact_store_cold"]["bytes_per_image"]
    disk = rows["disk_odirect"]
    if disk["GBps"] is not None:  # None where the file system takes no O_DIRECT reads (tmpfs)
        assert disk["GBps"] > 0 and rows["raw_store_cold"]["disk_bound_per_sec"] > 0
    assert doc["data"]["stores"]["compact_store"]["format"] == "jpeg"
    assert doc["data"]["rule"]["choice"] in ("raw", "jpeg")
    assert doc["data"]["stores"]["raw_store"]["seconds"] > 0


def test_the_eviction_check_sees_pages_that_stay(tmp_path: Path) -> None:
    stores = load("stores.py")
    path = tmp_path / "blob.bin"
    path.write_bytes(os.urandom(8 << 20))
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())
    assert stores.checked_eviction(path)["evicted"] is True
    # pages mapped and touched by a process are not dropped by POSIX_FADV_DONTNEED: the check says so
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        assert sum(mapped[k] for k in range(0, len(mapped), 4096)) >= 0
        assert stores.checked_eviction(path)["evicted"] is False
