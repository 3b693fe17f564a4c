"""``benchmarks/jpeg.py``: its ``--quick`` CPU run (the rows with and without DALI, the host's decode limit),
the row that hides DALI, and the images it describes."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.test_benchmarks import load


def test_quick_run_writes_the_rows(tmp_path):
    jpeg = load("jpeg.py")
    out = tmp_path / "jpeg.json"
    rows = "ours_folder,ours_jpeg_store,ours_folder_dali,decode_limit"
    assert jpeg.main(["--quick", "--only", rows, "--data", str(tmp_path / "data"), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    by_name = {r["name"]: r for r in doc["rows"]}
    assert set(by_name) == {"ceiling_compiled", *rows.split(",")}
    assert all(by_name[n]["samples_per_sec"] > 0 for n in by_name), doc["rows"]
    images = doc["images"]
    assert (images["count"], images["width_min"], images["width_max"], images["grayscale"], images["cmyk"]) == (
        64, 96, 96, 0, 0) and doc["date"] and doc["quick"] is True  # fmt: skip
    for name in ("ours_folder", "ours_jpeg_store", "ours_folder_dali"):
        row = by_name[name]
        assert row["decoder"] and row["loader_alone_per_sec"] > 0 and row["loader_alone_cpu_cores"] > 0, row
        assert all(r["of_compiled_ceiling"] > 0 for r in row["repeats"]) and row["p90_ms"] >= row["p50_ms"], (
            row
        )
        assert row["dali_importable"] is (name == "ours_folder_dali"), row  # the others run as without DALI
    assert re.fullmatch(r"CPU, \d+ threads", by_name["ours_folder"]["decoder"])  # the threads: the host's
    assert by_name["ours_folder"]["bytes_per_image"] == doc["source_bytes_per_image"]
    assert 0 < by_name["ours_jpeg_store"]["bytes_per_image"] < doc["source_bytes_per_image"]
    assert (
        by_name["ours_folder_dali"]["backend"] == "dali" and by_name["ours_jpeg_store"]["backend"] == "hdf5"
    )


def test_dali_is_unimportable_inside_and_back_afterwards():
    jpeg = load("jpeg.py")
    from lightning_gpuopt.data.backends import dali_installed

    pytest.importorskip("nvidia.dali")
    saved = sys.modules.get("nvidia.dali")
    with jpeg.dali_hidden():
        assert not dali_installed()
        with pytest.raises(ImportError):
            import nvidia.dali  # noqa: F401
    assert dali_installed() and sys.modules.get("nvidia.dali") is saved


def test_the_images_are_described_from_their_headers(tmp_path):
    from PIL import Image

    paths = []
    for i, (size, mode, kw) in enumerate(
        [
            ((200, 100), "RGB", {}),
            ((100, 200), "L", {}),
            ((300, 150), "CMYK", {}),
            ((120, 90), "RGB", {"progressive": True}),
        ]
    ):
        paths.append(tmp_path / f"{i}.jpg")
        Image.new(mode, size).save(paths[-1], **kw)
    (tmp_path / "x.png").write_bytes(b"not a jpeg")
    got = load("jpeg.py").describe_images([*paths, tmp_path / "x.png"])
    assert got == {
        "count": 5,
        "jpeg": 4,
        "width_min": 100,
        "width_max": 300,
        "height_min": 90,
        "height_max": 200,
        "aspect_min": 0.5,
        "aspect_max": 2.0,
        "grayscale": 1,
        "cmyk": 1,
        "progressive": 1,
    }
