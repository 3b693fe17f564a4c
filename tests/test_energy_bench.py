"""``benchmarks/energy.py`` and its rows (``benchmarks/_energy.py``): the ``--quick`` CPU run, rows a
CPU cannot run saying why, the rows' models and feeds, and on a GPU the four rows' figures."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from tests.test_benchmarks import load

energy = load("_energy.py")
zoo = sys.modules["_zoo"]  # the classifiers, as _energy imported them


def test_quick_run_trains_naive_and_says_why_the_others_cannot(tmp_path):
    out = tmp_path / "energy.json"
    assert load("energy.py").main(["--quick", "--repeats", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {"machine", "command", "date", "rows"} <= set(doc) and doc["benchmark"] == "energy"
    rows = {r["name"]: r for r in doc["rows"]}
    assert list(rows) == list(energy.ROWS)
    for row in rows.values():  # every row has the figures, null where not measured
        assert {"joules_per_sample", "jpeg_engine_util", "cuda_graphs", "cuda_graphs_reason"} <= set(row)
    naive = rows["naive"]
    assert naive["status"] == "ok" and naive["samples_per_sec"] > 0 and naive["repeats"]
    assert naive["joules_per_sample"] is None  # a CPU has no energy counter
    assert naive["cuda_graphs"] is False and naive["cuda_graphs_reason"] == "eager: not compiled"
    for name in ("preset", "gpu_decode", "graphs_skipped"):
        assert rows[name]["status"] == "cannot run" and "needs a CUDA GPU" in rows[name]["reason"]


def test_the_results_file_is_named_after_the_gpu_model():
    assert energy.gpu_tag("NVIDIA H100 80GB HBM3") == "h100"
    assert energy.gpu_tag("NVIDIA H200") == "h200" and energy.gpu_tag("NVIDIA A100-SXM4-80GB") == "a100"
    assert energy.gpu_tag(None) == "cpu"


def test_rows_that_cannot_run_say_why():
    assert energy.why_not("naive", cuda=False, decoder=None) is None
    assert "CUDA" in energy.why_not("preset", cuda=False, decoder=None)
    assert "DALI or torchvision" in energy.why_not("gpu_decode", cuda=True, decoder=None)
    assert energy.why_not("gpu_decode", cuda=True, decoder="torchvision") is None
    assert energy.gpu_decoder("auto", cuda=False) is None


def test_fit_figures_read_the_measured_windows_and_the_compile():
    history = [{"step": 9.0, "gpu/power_w": 100.0, "gpu/jpeg_util": 0.0, "gpu/util": 10.0},  # warm-up
               {"step": 19.0, "gpu/power_w": 300.0, "gpu/jpeg_util": 90.0, "gpu/util": 95.0},
               {"step": 29.0, "gpu/power_w": 500.0, "gpu/jpeg_util": 98.0, "gpu/util": 99.0}]  # fmt: skip
    compiler = SimpleNamespace(cuda_graphs=False, cuda_graphs_reason="mutated inputs (1 instances)")
    got = energy.fit_figures(SimpleNamespace(history=history), compiler, steps=20, samples_per_sec=1000.0)
    assert got == {"joules_per_sample": 0.4, "power_w": 400.0, "jpeg_engine_util": 94.0, "gpu_util_mean": 97.0,
                   "cuda_graphs": False, "cuda_graphs_reason": "mutated inputs (1 instances)"}  # fmt: skip
    eager = energy.fit_figures(SimpleNamespace(history=[]), None, steps=20, samples_per_sec=10.0)
    assert eager["joules_per_sample"] is None and eager["cuda_graphs"] is False


def test_in_place_normalize_computes_the_same_and_changes_its_input():
    torch.manual_seed(0)
    plain = zoo.Uint8Classifier("small", num_classes=4)
    in_place = zoo.InPlaceNormalize("small", num_classes=4)
    in_place.load_state_dict(plain.state_dict())
    x = torch.randint(0, 256, (2, 3, 32, 32)).float()
    kept = x.clone()
    torch.testing.assert_close(in_place.eval()(x), plain.eval()(kept))
    assert not torch.equal(x, kept)  # the input itself was normalized: what torch records no graphs for


def test_jpeg_bytes_stay_on_the_host_and_crops_have_the_size(jpeg_folder):
    data = energy.JPEGBytes(jpeg_folder)
    encoded, labels = energy.collate_jpegs([data[0], data[1]])
    assert encoded.data[0][:2].tolist() == [0xFF, 0xD8] and labels.tolist() == [data[0][1], data[1][1]]
    moved = move_data_to_device((encoded, labels), torch.device("meta"))
    assert moved[0] is encoded and moved[1].device.type == "meta"  # decode_jpeg reads host bytes
    crop = zoo.random_resized_crop(torch.randint(0, 256, (3, 48, 64), dtype=torch.uint8), 32)
    assert crop.shape == (1, 3, 32, 32) and crop.min() >= 0 and crop.max() <= 255


def test_gpu_decode_classifier_decodes_crops_and_flips(jpeg_folder):
    pytest.importorskip("torchvision", reason="torchvision decodes the JPEGs (not installed here)")
    data = energy.JPEGBytes(jpeg_folder)
    model = zoo.GPUDecodeClassifier("small", num_classes=3, image_size=16)
    x, y = model.on_after_batch_transfer(energy.collate_jpegs([data[i] for i in range(4)]), 0)
    assert x.shape == (4, 3, 16, 16) and x.dtype == torch.uint8 and y.shape == (4,)


@pytest.mark.gpu
def test_gpu_rows_measure_energy_the_jpeg_engine_and_cuda_graphs(tmp_path):
    out = tmp_path / "energy.json"
    args = ["--arch", "small", "--batch-size", "32", "--image-size", "64", "--images", "128", "--warmup", "3",
            "--steps", "30", "--repeats", "1", "--decoder", "torchvision", "--out", str(out)]  # fmt: skip
    load("energy.py").main(args)
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    for name in energy.ROWS:
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["joules_per_sample"] > 0 and rows[name]["power_w"] > 0
    assert rows["preset"]["cuda_graphs"] is True
    assert rows["graphs_skipped"]["cuda_graphs"] is False
    assert "mutated inputs" in rows["graphs_skipped"]["cuda_graphs_reason"]
