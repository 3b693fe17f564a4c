"""``benchmarks/jpeg.py``: its ``--quick`` CPU run (a few rows, one turn) and the eviction of a raw store's
memory map."""

from __future__ import annotations

import json
import mmap

import numpy as np

from tests.test_benchmarks import load


def test_quick_run_writes_the_rows(tmp_path):
    jpeg = load("jpeg.py")
    out = tmp_path / "jpeg.json"
    rows = "ours_folder,ours_jpeg_store,ours_folder_dali,compact_store_cold,decode_limit,loader_cpu_workers"
    assert jpeg.main(["--quick", "--only", rows, "--repeats", "1", "--data", str(tmp_path / "data"),
                      "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    by_name = {r["name"]: r for r in doc["rows"]}
    assert set(by_name) == {"ceiling_compiled", *rows.split(",")}
    assert all(by_name[n]["samples_per_sec"] > 0 for n in by_name), doc["rows"]
    images = doc["images"]
    assert (images["count"], images["width_min"], images["width_max"], images["grayscale"], images["cmyk"]) == (
        64, 96, 96, 0, 0) and doc["date"]  # fmt: skip
    for name in ("ours_folder", "ours_jpeg_store", "ours_folder_dali"):
        row = by_name[name]
        assert row["decoder"] and row["loader_alone_per_sec"] > 0 and row["loader_alone_cpu_cores"] > 0, row
        assert all(r["of_compiled_ceiling"] > 0 for r in row["repeats"]) and row["p90_ms"] >= row["p50_ms"], row
        assert row["dali_importable"] is (name == "ours_folder_dali"), row  # the others run as without DALI
    assert by_name["ours_folder"]["decoder"] == "CPU, 1 thread of the training process"
    assert by_name["ours_folder_dali"]["backend"] == "dali" and by_name["ours_jpeg_store"]["backend"] == "hdf5"
    assert doc["source_bytes_per_image"] > 0 and doc["quick"] is True
    store = by_name["compact_store_cold"]
    assert store["bytes_per_image"] > 0 and store["of_compiled_ceiling"] > 0
    assert by_name["ours_folder"]["bytes_per_image"] == doc["source_bytes_per_image"]
    cpu_loader = by_name["loader_cpu_workers"]
    assert cpu_loader["of_decode_limit"] == cpu_loader["samples_per_sec"] / by_name["decode_limit"]["samples_per_sec"]


def test_the_raw_stores_map_is_found_and_evicted(tmp_path):
    jpeg = load("jpeg.py")
    from lightning_gpuopt import OptimizedDataModule
    from lightning_gpuopt.bench.synthetic import make_jpeg_folder
    from lightning_gpuopt.data.hdf5 import convert_folder_to_hdf5

    src = make_jpeg_folder(tmp_path / "jpegs", num_images=8, num_classes=2, image_size=(40, 30))
    store = tmp_path / "s.h5"
    convert_folder_to_hdf5(src, store, storage_size=16, progress=False)
    dm = OptimizedDataModule(str(store), batch_size=4, num_workers=0, image_size=16)
    dm.setup("fit")
    first = next(iter(dm.train_dataloader()))[0].numpy().copy()
    maps = jpeg._maps_of(dm)
    assert len(maps) == 1 and isinstance(maps[0], mmap.mmap)
    with jpeg.evicting(store, dm, every_s=0.01):
        batches = [b[0].numpy() for b in dm.train_dataloader()]
    assert len(batches) == 2 and all(np.any(b) for b in batches)  # evicted pages read back from the file
    assert first.shape == batches[0].shape
    dm.teardown("fit")


def test_a_bad_decode_thread_count_is_named_before_any_work(tmp_path, capsys):
    import pytest

    jpeg = load("jpeg.py")
    with pytest.raises(SystemExit):
        jpeg.main(["--quick", "--only", "ours_folder_cpu_decode:0", "--data", str(tmp_path / "data")])
    assert "unknown rows ['ours_folder_cpu_decode:0']" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()  # nothing generated


def test_a_decoder_row_takes_its_own_thread_count(tmp_path, capsys):
    import pytest

    jpeg = load("jpeg.py")
    args = jpeg.parse_args(["--quick", "--only", "ours_folder_cpu_decode:16,ours_folder_cpu_decode,ours_folder"])
    assert args.only == ["ours_folder_cpu_decode:16", "ours_folder_cpu_decode", "ours_folder"]
    for bad in ("torchvision_v2:4", "ours_folder_cpu_decode:0", "ours_folder_gpu_decode:x", "ours_folder:"):
        with pytest.raises(SystemExit):
            jpeg.parse_args(["--quick", "--only", bad])
        assert f"unknown rows ['{bad}']" in capsys.readouterr().err
    seen = []

    class DataModule:  # what the row hands measured_fit, without a GPU or DALI here
        backend = backend_reason = None

        def __init__(self, path, args, **kw):  # type: ignore[no-untyped-def]
            seen.append(kw["dali"])

    for name, threads in (("ours_folder_cpu_decode:16", 16), ("ours_folder_gpu_decode", None)):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(jpeg, "_datamodule", DataModule)
            mp.setattr(jpeg, "measured_fit", lambda *a, **kw: None)
            jpeg.training_variant(name, None, args, {"train": tmp_path}, {})()
        assert (seen[-1].decoder, seen[-1].threads) == (name.split("_")[2].split(":")[0], threads)
