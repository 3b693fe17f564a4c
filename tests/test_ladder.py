"""``lightning-gpuopt bench`` and ``lightning_gpuopt.ladder`` on the CPU: a tiny ladder end to end, bad args."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_gpuopt import ladder
from lightning_gpuopt.cli import main
from tests._lightning import quiet_trainer

TINY = ["--model", "small", "--batch-size", "8", "--image-size", "32", "--warmup", "1"]


def test_tiny_ladder_end_to_end(jpeg_folder, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(
        [
            "bench",
            "--data",
            str(jpeg_folder),
            *TINY,
            "--rows",
            "naive,+workers,+dali,ceiling_lightning",
            "--workers",
            "1",
            "--seconds",
            "1",
            "--out",
            str(out),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--accelerator",
            "cpu",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    doc = json.loads((out / "ladder.json").read_text())
    rows = {r["name"]: r for r in doc["rows"]}
    # selected rows in ladder order, the plain ceiling always measured (it is the ratios' ceiling)
    assert [r["name"] for r in doc["rows"]] == [
        "naive",
        "+workers",
        "+dali",
        "ceiling_lightning",
        "ceiling_plain",
    ]
    assert set(ladder.TABLE_COLUMNS) - {"status"} <= set(doc["rows"][0])
    assert doc["machine"]["torch"] == torch.__version__
    assert doc["ceiling_samples_per_sec"] == rows["ceiling_plain"]["samples_per_sec"] > 0
    naive = rows["naive"]
    assert naive["status"] == "ok" and naive["samples_per_sec"] > 0
    assert naive["num_workers"] == 0 and naive["pin_memory"] is False and naive["precision"] == "32-true"
    assert naive["speedup_vs_naive"] == pytest.approx(1.0)
    assert naive["ratio_to_ceiling"] == pytest.approx(
        naive["samples_per_sec"] / doc["ceiling_samples_per_sec"]
    )
    assert naive["steps_measured"] >= 1 and naive["gpu_util_mean"] is None  # no GPU on a CPU run
    assert rows["ceiling_plain"]["ratio_to_ceiling"] == pytest.approx(1.0)
    # a prefetching loader is measured over whole epochs (48 images / batch 8 = 6 steps an epoch)
    workers = rows["+workers"]
    assert workers["status"] == "ok" and workers["num_workers"] == 1
    assert isinstance(workers["whole_epochs"], bool) and workers["steps_measured"] >= 1
    assert naive["whole_epochs"] is None  # no workers, nothing prefetched: no need to align
    assert rows["ceiling_lightning"]["status"] == "ok"
    dali = rows["+dali"]
    assert dali["status"] == "cannot run" and "CUDA" in dali["reason"] and dali["samples_per_sec"] is None
    # PNG chart and one TensorBoard run per Lightning row
    assert (out / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = sorted(p.name for p in (out / "tensorboard").iterdir())
    assert runs == ["00_naive", "01_workers", "08_ceiling_lightning"]
    assert any((out / "tensorboard" / "00_naive").glob("events.out.tfevents.*"))
    # the table comes last on stdout and says why a row did not run
    table = captured.out.strip().splitlines()
    assert table[0].split()[:3] == ["name", "samples_per_sec", "ratio_to_ceiling"]
    assert any(line.startswith("+dali") and "cannot run: DALI" in line for line in table)
    assert "[bench] [" in captured.err  # progress lines for each row


def test_generated_dataset_is_cached_and_steps_bound_rows(tmp_path, capsys):
    args = [
        "bench",
        "--images",
        "16",
        "--classes",
        "2",
        "--image-size-src",
        "40x30",
        *TINY,
        "--rows",
        "naive",
        "--seconds",
        "0",
        "--steps",
        "2",
        "--out",
        str(tmp_path / "out"),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--no-tensorboard",
    ]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "generating 16 40x30 JPEGs" in err
    folder = tmp_path / "cache" / "jpeg_16_2c_40x30"
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == ["class_00", "class_01"]
    doc = json.loads((tmp_path / "out" / "ladder.json").read_text())
    assert doc["rows"][0]["steps_measured"] == 2
    assert not (tmp_path / "out" / "tensorboard").exists()
    args[args.index("naive")] = "ceiling_plain"  # the cheapest row: only the data lookup matters here
    assert main(args) == 0
    assert "using cached generated folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--rows", "naive,+turbo"], "unknown row name(s) '+turbo' in --rows; valid rows: naive, +workers"),
        (["--rows", ""], "valid rows: naive"),
        (["--batch-size", "-4"], "--batch-size must be >= 1"),
        (["--warmup", "-1"], "--warmup must be >= 0"),
        (["--seconds", "-1"], "--seconds must be >= 0"),
        (["--seconds", "0"], "give --steps N"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--images", "0"], "--images must be >= 1"),
        (["--workers", "-2"], "--workers must be >= 0"),
    ],
)
def test_bad_arguments_give_clear_errors(jpeg_folder, tmp_path, capsys, extra, message):
    rc = main(["bench", "--data", str(jpeg_folder), "--out", str(tmp_path / "o"), *TINY, *extra])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("lightning-gpuopt bench: error:") and message in err
    assert not (tmp_path / "o").exists()  # nothing ran


def test_data_path_errors(tmp_path, capsys):
    assert main(["bench", "--data", str(tmp_path / "nope"), *TINY]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("x")
    assert main(["bench", "--data", str(tmp_path / "notes.txt"), *TINY]) == 2
    assert "not .h5/.hdf5" in capsys.readouterr().err
    h5 = tmp_path / "images.h5"
    h5.write_bytes(b"")
    assert main(["bench", "--data", str(h5), *TINY, "--rows", "naive,+hdf5"]) == 2
    err = capsys.readouterr().err
    assert "naive read an image folder but --data is an HDF5 file" in err and "+hdf5" in err
    # a folder with fewer images than one batch
    (tmp_path / "few" / "a").mkdir(parents=True)
    from PIL import Image

    Image.new("RGB", (16, 16)).save(tmp_path / "few" / "a" / "x.png")
    assert main(["bench", "--data", str(tmp_path / "few"), *TINY, "--out", str(tmp_path / "o")]) == 2
    assert "fewer than one batch" in capsys.readouterr().err


def test_bad_source_size_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--image-size-src", "500by375"])
    assert exc.value.code == 2
    assert "expected WIDTHxHEIGHT" in capsys.readouterr().err


def test_parse_rows_returns_ladder_order():
    assert ladder.parse_rows("ceiling_plain, +hdf5,naive") == ["naive", "+hdf5", "ceiling_plain"]
    assert ladder.ROW_NAMES[-1] == "ceiling_plain" and ladder.ROW_NAMES[7] == "+channels_last"
    # each ladder row adds one thing: the last data row before the compute rows is the full stack's input
    full = ladder.ROW_SPECS[ladder.ROW_NAMES.index("+channels_last")]
    assert full.mixed and full.channels_last and full.loader == "best"


def test_naive_dataset_is_float_chw_normalized(jpeg_folder):
    ds = ladder.NaiveImageFolder(jpeg_folder, size=24)
    x, y = ds[0]
    assert x.dtype == torch.float32 and x.shape == (3, 24, 24) and isinstance(y, int)
    assert len(ds) == 48 and ds.classes == ["class_00", "class_01", "class_02"]
    # normalized: roughly centred, not in [0, 1] pixel units
    assert x.min() < 0 < x.max()
    with pytest.raises(ValueError, match="size must be a positive int"):
        ladder.NaiveImageFolder(jpeg_folder, size=0)


def test_window_means_skip_warmup_windows():
    history = [
        {"step": 5, "gpu/util": 10.0, "time/data_wait_frac": 0.9},
        {"step": 10, "gpu/util": 98.0, "time/data_wait_frac": 0.1},
        {"step": 15, "gpu/util": 96.0, "time/data_wait_frac": 0.3},
    ]
    assert ladder._window_means(history, start_step=5) == (pytest.approx(97.0), pytest.approx(0.2))
    assert ladder._window_means([], start_step=3) == (None, None)


def _tiny_fit(meter, batches_per_epoch=6):
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_gpuopt.models import ImageClassifier

    data = TensorDataset(
        torch.randn(4 * batches_per_epoch, 3, 8, 8), torch.randint(0, 2, (4 * batches_per_epoch,))
    )
    trainer = quiet_trainer(
        accelerator="cpu",
        max_epochs=50,
        callbacks=[meter],
    )
    trainer.fit(ImageClassifier("small", num_classes=2), DataLoader(data, batch_size=4))
    return trainer


def test_row_meter_measures_whole_epochs_when_aligned():
    meter = ladder._RowMeter(warmup=2, warmup_seconds=60.0, seconds=0.001, max_steps=None, align_epochs=True)
    trainer = _tiny_fit(meter)
    # warm-up runs to the end of epoch 0; the window is exactly epoch 1
    assert meter.start_step == 6 and meter.measured_steps == 6 and meter.aligned is True
    assert trainer.global_step == 12 and meter.samples_per_sec > 0


def test_row_meter_without_alignment_and_step_cap():
    meter = ladder._RowMeter(warmup=2, warmup_seconds=60.0, seconds=0, max_steps=3, align_epochs=False)
    _tiny_fit(meter)
    assert meter.start_step == 2 and meter.measured_steps == 3 and meter.aligned is False


@pytest.mark.gpu
def test_gpu_ladder_runs_cuda_rows(tmp_path):
    from lightning_gpuopt.data.synthetic import make_jpeg_folder

    data = make_jpeg_folder(tmp_path / "jpegs", num_images=512, num_classes=4, image_size=(96, 72))
    config = ladder.LadderConfig(
        data=data,
        model="small",
        batch_size=64,
        image_size=64,
        rows=["naive", "+pinned", "+uint8_gpu_aug", "+16-mixed", "+channels_last"],
        seconds=2.0,
        warmup=2,
        num_workers=4,
        cache_dir=tmp_path / "cache",
    )
    rows = {r["name"]: r for r in ladder.run_ladder(config)}
    for name in ("naive", "+pinned", "+uint8_gpu_aug", "+16-mixed", "+channels_last", "ceiling_plain"):
        assert rows[name]["status"] == "ok", rows[name]
        assert rows[name]["samples_per_sec"] > 0
    assert rows["+pinned"]["pin_memory"] is True and rows["+pinned"]["num_workers"] == 4
    assert rows["+16-mixed"]["precision"] == "16-mixed" and rows["naive"]["precision"] == "32-true"
    assert rows["+uint8_gpu_aug"]["gpu_util_mean"] is not None  # NVML through GPUStatsMonitor
    assert rows["ceiling_plain"]["precision"] == "fp16 autocast"
