"""``lightning-gpuopt bench`` and ``lightning_gpuopt.bench`` on the CPU: a tiny ladder end to end, bad args."""

from __future__ import annotations

import json
import statistics
import time

import lightning.pytorch as pl
import pytest
import torch

from lightning_gpuopt.bench import report, rows, steady
from lightning_gpuopt.bench.runner import run_ladder
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
            "--repeats",
            "2",
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
    run = out / "version_0"
    assert f"this run writes to {run}" in captured.err
    doc = json.loads((run / "ladder.json").read_text())
    rows = {r["name"]: r for r in doc["rows"]}
    # selected rows in ladder order, the eager ceiling always measured; no compiled row asked on a CPU, so
    # no compiled ceiling: the ratios are against the eager one
    assert [r["name"] for r in doc["rows"]] == [
        "naive",
        "+workers",
        "+dali",
        "ceiling_lightning",
        "ceiling_eager",
    ]
    assert set(report.TABLE_COLUMNS) - {"status", "range"} <= set(doc["rows"][0])
    assert {"compiled", "compile_seconds", "ratio_to_eager_ceiling"} <= set(doc["rows"][0])
    assert doc["machine"]["torch"] == torch.__version__
    assert doc["ceiling"] == "ceiling_eager" and doc["ceiling_compiled_samples_per_sec"] is None
    assert doc["ceiling_samples_per_sec"] == rows["ceiling_eager"]["samples_per_sec"] > 0
    assert doc["ceiling_eager_samples_per_sec"] == doc["ceiling_samples_per_sec"]
    assert doc["compile_seconds"] == {}
    naive = rows["naive"]
    assert naive["status"] == "ok" and naive["samples_per_sec"] > 0
    assert naive["num_workers"] == 0 and naive["pin_memory"] is False and naive["precision"] == "32-true"
    assert naive["speedup_vs_naive"] == pytest.approx(1.0)
    assert naive["ratio_to_eager_ceiling"] == naive["ratio_to_ceiling"]
    assert naive["compiled"] is False and naive["compile_seconds"] is None
    assert naive["gpu_util_mean"] is None  # no GPU on a CPU run
    # two fits taking turns, each a fixed window: the median with the range, p50/p90 step times
    reps = naive["repeats"]
    assert [r["turn"] for r in reps] == [0, 1] and naive["windows"] == [r["samples_per_sec"] for r in reps]
    assert reps[0]["steps"] == reps[1]["steps"] >= 2 and naive["steps_measured"] == 2 * reps[0]["steps"]
    assert naive["samples_per_sec_min"] <= naive["samples_per_sec"] <= naive["samples_per_sec_max"]
    assert 0 < naive["p50_ms"] <= naive["p90_ms"]
    # ratios turn by turn: each fit against the ceiling measured in the same turn
    eager = rows["ceiling_eager"]["repeats"]
    for rep, ceiling in zip(reps, eager, strict=True):
        assert rep["ratio_to_ceiling"] == pytest.approx(rep["samples_per_sec"] / ceiling["samples_per_sec"])
    assert naive["ratio_to_ceiling"] == pytest.approx(sum(r["ratio_to_ceiling"] for r in reps) / 2)
    assert naive["ratio_to_ceiling_worst"] == min(r["ratio_to_ceiling"] for r in reps)
    assert rows["ceiling_eager"]["ratio_to_ceiling"] == pytest.approx(1.0)
    workers = rows["+workers"]
    assert workers["status"] == "ok" and workers["num_workers"] == 1 and len(workers["repeats"]) == 2
    assert rows["ceiling_lightning"]["status"] == "ok"
    dali = rows["+dali"]
    assert dali["status"] == "cannot run" and "CUDA" in dali["reason"] and dali["samples_per_sec"] is None
    # PNG chart and one TensorBoard run per Lightning row, inside this run's folder
    assert (run / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = sorted(p.name for p in (run / "tensorboard").iterdir())
    assert runs == ["00_naive", "01_workers", "09_ceiling_lightning"]
    assert sorted(p.name for p in (run / "tensorboard" / "00_naive").iterdir()) == ["fit_0", "fit_1"]
    assert any((run / "tensorboard" / "00_naive" / "fit_0").glob("events.out.tfevents.*"))
    # the table comes last on stdout and says why a row did not run
    table = captured.out.strip().splitlines()
    header = ["name", "samples_per_sec", "range", "joules_per_sample", "p50_ms", "p90_ms", "ratio_to_ceiling"]
    assert table[0].split()[:7] == header
    assert any(line.startswith("+dali") and "cannot run: DALI" in line for line in table)
    # under the table: which ceiling the ratios use
    note = next(line for line in table if line.startswith("ratio_to_ceiling"))
    assert note.startswith("ratio_to_ceiling and ratio_to_eager_ceiling: against ceiling_eager (")
    assert note.endswith("ceiling_compiled was not measured") and "compile time" not in captured.out
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
        "--repeats",
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
    doc = json.loads((tmp_path / "out" / "version_0" / "ladder.json").read_text())
    # with --seconds 0, each of the two repetitions measures exactly --steps steps
    assert [r["steps"] for r in doc["rows"][0]["repeats"]] == [2, 2] and doc["rows"][0]["steps_measured"] == 4
    assert not (tmp_path / "out" / "version_0" / "tensorboard").exists()
    # the cheapest row: only the data lookup matters here
    args[args.index("naive")] = "ceiling_eager"
    assert main(args) == 0
    assert "using cached generated images" in capsys.readouterr().err
    # the second run has its own folder; the first run's results are untouched
    assert (tmp_path / "out" / "version_1" / "ladder.json").is_file()
    assert json.loads((tmp_path / "out" / "version_0" / "ladder.json").read_text()) == doc


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--rows", "naive,+turbo"], "unknown row name(s) '+turbo' in --rows; valid rows: naive, +workers"),
        (["--rows", ""], "valid rows: naive"),
        (["--batch-size", "-4"], "--batch-size must be an int >= 1, got -4"),
        (["--time-budget", "0"], "--time-budget must be > 0 s (leave it out for no budget), got 0.0"),
        (["--warmup", "-1"], "--warmup must be >= 0"),
        (["--seconds", "-1"], "--seconds must be >= 0"),
        (["--seconds", "0"], "give --steps N"),
        (["--steps", "1"], "--steps must be >= 2"),
        (["--repeats", "0"], "--repeats must be an int >= 1"),
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
    assert rows.parse_rows("ceiling_eager, +hdf5,naive") == ["naive", "+hdf5", "ceiling_eager"]
    assert rows.ROW_NAMES == (
        "naive",
        "+workers",
        "+pinned",
        "+uint8_gpu_aug",
        "+hdf5",
        "+dali",
        "+16-mixed",
        "+channels_last",
        "+compile",
        "ceiling_lightning",
        "ceiling_eager",
        "ceiling_compiled",
    )
    # each ladder row adds one thing: the last data row before the compute rows is the full stack's input
    full = rows.SPEC_BY_NAME["+channels_last"]
    assert full.mixed and full.channels_last and full.loader == "best" and not full.compiled
    compiled = rows.SPEC_BY_NAME["+compile"]
    assert (compiled.loader, compiled.mixed, compiled.channels_last, compiled.compiled) == (
        "best",
        True,
        True,
        True,
    )
    assert [s.name for s in rows.ROW_SPECS if s.compiled] == ["+compile", "ceiling_compiled"]
    eager, ceiling = rows.SPEC_BY_NAME["ceiling_eager"], rows.SPEC_BY_NAME["ceiling_compiled"]
    assert eager.loader == ceiling.loader == "plain" and ceiling.compiled and not eager.compiled


def test_compiled_rows_on_a_cpu_run_only_when_named():
    # the whole ladder (the default) leaves them out on a CPU; a shorter list naming one asks for them
    assert not rows.compile_asked(rows.ROW_NAMES)
    assert not rows.compile_asked(["naive", "+channels_last", "ceiling_eager"])
    assert rows.compile_asked(["naive", "+compile"]) and rows.compile_asked(["ceiling_compiled"])


def test_cpu_runner_skips_compiled_rows_of_the_whole_ladder(jpeg_folder, tmp_path):
    from lightning_gpuopt.bench.runner import LadderRunner

    whole = LadderRunner(rows.LadderConfig(jpeg_folder, batch_size=8, accelerator="cpu", cache_dir=tmp_path))
    for name in ("+compile", "ceiling_compiled"):
        status, reason = whole.cannot_run_reason(rows.SPEC_BY_NAME[name])
        assert status == rows.SKIPPED and "name the row to run it (--rows ...,+compile)" in reason
    asked = LadderRunner(
        rows.LadderConfig(
            jpeg_folder, batch_size=8, accelerator="cpu", cache_dir=tmp_path, rows=["naive", "+compile"]
        )
    )
    assert asked.cannot_run_reason(rows.SPEC_BY_NAME["+compile"]) is None
    assert asked.cannot_run_reason(rows.SPEC_BY_NAME["ceiling_compiled"]) is None


def _ceiling_rows(eager=6176.0, compiled=7309.0, compiled_status="ok"):
    return [
        {"name": "naive", "status": "ok", "samples_per_sec": 250.0},
        {"name": "+channels_last", "status": "ok", "samples_per_sec": 5518.0},
        {"name": "+compile", "status": "ok", "samples_per_sec": 6900.0, "compile_seconds": 39.5},
        {"name": "+dali", "status": "cannot run", "samples_per_sec": None},
        {"name": "ceiling_eager", "status": "ok", "samples_per_sec": eager},
        {
            "name": "ceiling_compiled",
            "status": compiled_status,
            "samples_per_sec": compiled,
            "compile_seconds": 41.0,
        },
    ]


def test_ratios_are_against_the_compiled_ceiling_where_it_was_measured():
    results = _ceiling_rows()
    summary = report.fill_ratios(results)
    by = {r["name"]: r for r in results}
    assert summary == {
        "ceiling": "ceiling_compiled",
        "ceiling_samples_per_sec": 7309.0,
        "ceiling_eager_samples_per_sec": 6176.0,
        "ceiling_compiled_samples_per_sec": 7309.0,
        "compile_seconds": {"+compile": 39.5, "ceiling_compiled": 41.0},
    }
    assert by["+channels_last"]["ratio_to_ceiling"] == pytest.approx(5518 / 7309)
    assert by["+channels_last"]["ratio_to_eager_ceiling"] == pytest.approx(5518 / 6176)
    assert by["+compile"]["ratio_to_ceiling"] == pytest.approx(6900 / 7309)
    assert by["ceiling_compiled"]["ratio_to_ceiling"] == pytest.approx(1.0)
    assert by["ceiling_eager"]["ratio_to_ceiling"] == pytest.approx(6176 / 7309)
    assert by["ceiling_eager"]["ratio_to_eager_ceiling"] == pytest.approx(1.0)
    assert by["+compile"]["speedup_vs_naive"] == pytest.approx(6900 / 250)
    dali = by["+dali"]
    assert dali["ratio_to_ceiling"] is dali["ratio_to_eager_ceiling"] is dali["speedup_vs_naive"] is None
    lines = report.ceiling_notes(results)
    assert lines == [
        "ratio_to_ceiling: against ceiling_compiled (7,309 samples/s); ratio_to_eager_ceiling: against "
        "ceiling_eager (6,176 samples/s)",
        "compile time (first compiled step to first fast step): +compile 39.5 s, ceiling_compiled 41.0 s",
    ]


@pytest.mark.parametrize("status", ["failed", "skipped"])
def test_ratios_fall_back_to_the_eager_ceiling(status):
    results = _ceiling_rows(compiled=None if status == "skipped" else 7309.0, compiled_status=status)
    results[-1]["reason"] = "why"
    summary = report.fill_ratios(results)
    by = {r["name"]: r for r in results}
    assert summary["ceiling"] == "ceiling_eager" and summary["ceiling_compiled_samples_per_sec"] is None
    assert (
        by["+compile"]["ratio_to_ceiling"]
        == by["+compile"]["ratio_to_eager_ceiling"]
        == pytest.approx(6900 / 6176)
    )
    assert report.ceiling_notes(results)[0].endswith(f"; ceiling_compiled {status}: why")
    # no ceiling at all: no ratios, no ceiling line
    bare = [{"name": "naive", "status": "ok", "samples_per_sec": 10.0}]
    assert report.fill_ratios(bare)["ceiling"] is None and bare[0]["ratio_to_ceiling"] is None
    assert bare[0]["speedup_vs_naive"] == 1.0 and report.ceiling_notes(bare) == []


def test_first_fast_step_finds_the_end_of_the_compile():
    assert steady.first_fast_step([40.0, 0.1, 0.1, 0.1]) == 1
    assert steady.first_fast_step([0.1, 0.1, 0.1]) == 0  # nothing to compile
    assert steady.first_fast_step([40.0, 2.0, 0.1, 0.12, 0.1]) == 2  # a recompile in the second step
    assert steady.first_fast_step([40.0, 0.1, 0.1]) is None  # too few fast steps yet
    assert steady.first_fast_step([40.0, 0.1, 0.1, 0.5]) is None  # not settled: 5x apart
    # a jittery step after the compile counts as not yet fast
    assert steady.first_fast_step([40.0, 0.1, 0.5, 0.1, 0.1, 0.1]) == 3
    assert steady.first_fast_step([]) is None


def test_naive_dataset_is_float_chw_normalized(jpeg_folder):
    ds = rows.NaiveImageFolder(jpeg_folder, size=24)
    x, y = ds[0]
    assert x.dtype == torch.float32 and x.shape == (3, 24, 24) and isinstance(y, int)
    assert len(ds) == 48 and ds.classes == ["class_00", "class_01", "class_02"]
    # normalized: roughly centred, not in [0, 1] pixel units
    assert x.min() < 0 < x.max()
    with pytest.raises(ValueError, match="size must be a positive int"):
        rows.NaiveImageFolder(jpeg_folder, size=0)


def test_window_means_skip_warmup_windows():
    history = [
        {"step": 5, "gpu/util": 10.0, "time/data_wait_frac": 0.9},
        {"step": 10, "gpu/util": 98.0, "time/data_wait_frac": 0.1},
        {"step": 15, "gpu/util": 96.0, "time/data_wait_frac": 0.3},
    ]
    assert steady.window_means(history, start_step=5) == (pytest.approx(97.0), pytest.approx(0.2))
    assert steady.window_means([], start_step=3) == (None, None)


def test_joules_per_sample_is_the_measured_windows_power_over_the_rows_rate():
    history = [{"step": 5, "gpu/power_w": 100.0}, {"step": 10, "gpu/power_w": 400.0}, {"step": 15}]
    assert steady.joules_per_sample(history, 5, 200.0) == pytest.approx(2.0)  # 400 W at 200 samples/s
    assert steady.joules_per_sample(history, 5, None) is None
    assert steady.joules_per_sample([{"step": 9, "gpu/util": 50.0}], 5, 200.0) is None  # no power: a CPU run
    # the ladder's table and Markdown show it beside samples/s
    row = {"name": "naive", "samples_per_sec": 200.0, "joules_per_sample": 2.0, "status": "ok"}
    table = report.format_ladder_table([row], notes=False)
    header = table.splitlines()[0]
    assert header.index("samples_per_sec") < header.index("joules_per_sample") and "2" in table
    from tests.test_benchmarks import load

    markdown = load("ladder.py").format_ladder_markdown([row])
    assert "| J/sample |" in markdown and "| 2 |" in markdown


def _tiny_fit(clock, batches_per_epoch=6, extra=(), workers=0):
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_gpuopt.bench.models import ImageClassifier

    data = TensorDataset(
        torch.randn(4 * batches_per_epoch, 3, 8, 8), torch.randint(0, 2, (4 * batches_per_epoch,))
    )
    loader = DataLoader(data, batch_size=4, num_workers=workers, persistent_workers=workers > 0)
    trainer = quiet_trainer(accelerator="cpu", max_epochs=50, callbacks=[*extra, clock])
    trainer.fit(ImageClassifier("small", num_classes=2), loader)
    return trainer


class _Sleep(pl.Callback):
    """Makes training steps ``seconds`` longer: the first ``slow`` of them ``first`` seconds instead, as a
    compile does."""

    def __init__(self, seconds, slow=0, first=0.0):
        self.seconds, self.slow, self.first = seconds, slow, first

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(self.first if trainer.global_step <= self.slow else self.seconds)


def test_prefetched_batches_counts_what_a_loader_holds_ready():
    from torch.utils.data import DataLoader

    from lightning_gpuopt.bench.runner import prefetched_batches

    assert prefetched_batches(DataLoader(range(8))) == 1  # the batch Lightning fetches ahead
    assert prefetched_batches(DataLoader(range(8), num_workers=3, prefetch_factor=4)) == 13
    assert prefetched_batches(DataLoader(range(8), num_workers=2)) == 5  # DataLoader's default factor: 2


def test_row_clock_warms_up_past_the_prefetch_and_sizes_its_window_from_the_warm_up():
    from lightning_gpuopt.bench.runner import RowClock

    clock = RowClock(warmup=2, steps=2, seconds=0.4, max_steps=100)
    trainer = _tiny_fit(clock, extra=[_Sleep(0.04)], workers=1)
    # 2 warm-up steps past 1 worker x prefetch 2 and the batch fetched ahead; their step time into 0.4 s
    assert clock.warmup == 2 + 2 + 1
    m = clock.measurement
    assert clock.warmup_step_s >= 0.04 and clock.steps == max(2, int(0.4 / clock.warmup_step_s))
    assert m.steps == clock.steps and trainer.global_step == clock.warmup + 1 + clock.steps
    assert m.p50_ms >= 40 and m.samples == 4 * m.steps
    capped = RowClock(warmup=2, steps=2, seconds=10.0, max_steps=4)
    _tiny_fit(capped, extra=[_Sleep(0.01)])
    assert capped.steps == 4 and capped.measurement.steps == 4
    fixed = RowClock(warmup=1, steps=3)  # no seconds: exactly ``steps``
    _tiny_fit(fixed, extra=[_Sleep(0.01)])
    assert fixed.steps == 3 and fixed.measurement.steps == 3


def test_row_clock_settles_after_a_compile_and_sizes_from_the_settled_steps():
    from lightning_gpuopt.bench.runner import RowClock

    clock = RowClock(warmup=1, steps=2, seconds=2.0, settle=True)
    _tiny_fit(clock, extra=[_Sleep(0.01, slow=3, first=1.5)])
    # steps 0-2 are slow (the compile); the window's length comes from the fast steps after them
    assert clock.compile_seconds >= 2.5 and clock.measurement.compile_seconds == clock.compile_seconds
    assert clock.warmup_step_s < 1.5 and clock.steps == max(2, int(2.0 / clock.warmup_step_s))
    assert clock.measurement.steps == clock.steps


def _measured_row(name, rates, turns=None):
    from lightning_gpuopt.bench.runner import LadderRunner
    from lightning_gpuopt.bench.steady import Measurement

    row = {"name": name, "status": "ok", "compile_seconds": None, "_steps": None, "_measured": []}
    for turn, rate in zip(turns or range(len(rates)), rates, strict=True):
        LadderRunner._add_repeat(row, turn, Measurement(int(rate), 1.0, (1000.0 / 2, 1000.0 / 2)), 2)
    return row


def test_rows_keep_each_repetition_and_its_ratio_to_the_ceiling_of_its_turn():
    results = [
        _measured_row("naive", [10, 12, 11]),
        _measured_row("+workers", [45, 20, 40]),
        _measured_row("+hdf5", [80, 90], turns=[0, 2]),  # missed turn 1
        _measured_row("ceiling_eager", [100, 50, 100]),
    ]
    workers = results[1]
    assert (workers["samples_per_sec"], workers["samples_per_sec_min"], workers["samples_per_sec_max"]) == (
        40,
        20,
        45,
    )
    assert workers["windows"] == [45, 20, 40] and workers["steps_measured"] == 6
    assert workers["p50_ms"] == workers["p90_ms"] == 500.0
    summary = report.fill_ratios(results)
    assert summary["ceiling"] == "ceiling_eager"
    # the slow second turn hit the ceiling too: turn by turn, +workers held 0.4-0.45 of it
    assert [r["ratio_to_ceiling"] for r in workers["repeats"]] == [0.45, 0.4, 0.4]
    assert workers["ratio_to_ceiling"] == 0.4 and workers["ratio_to_ceiling_worst"] == 0.4
    assert workers["ratio_to_eager_ceiling"] == 0.4
    hdf5 = results[2]
    assert [r["ratio_to_ceiling"] for r in hdf5["repeats"]] == [0.8, 0.9]
    assert hdf5["ratio_to_ceiling"] == pytest.approx(0.85)
    # a ceiling without repetitions: the ratio of the medians
    plain = [{"name": "+workers", "samples_per_sec": 40.0}, {"name": "ceiling_eager", "samples_per_sec": 80}]
    report.fill_ratios(plain)
    assert plain[0]["ratio_to_ceiling"] == 0.5 and plain[0]["ratio_to_ceiling_worst"] is None


def _row(name, rates):
    rates = sorted(rates)
    return {
        "name": name,
        "status": "ok",
        "samples_per_sec": rates[len(rates) // 2],
        "samples_per_sec_min": rates[0],
        "samples_per_sec_max": rates[-1],
        "spread": (rates[-1] - rates[0]) / rates[len(rates) // 2],
        "windows": rates,
        "p50_ms": 12.5,
        "p90_ms": 14.0,
    }


def test_compare_calls_overlapping_ranges_noise():
    slow, fast, close = _row("a", [10, 11, 12]), _row("b", [30, 31, 33]), _row("c", [11.5, 12.5, 13])
    assert report.compare(fast, slow) == pytest.approx(31 / 11)
    assert report.compare(close, slow) is None  # ranges overlap: within the noise
    assert report.compare(fast, {"name": "x", "samples_per_sec": None}) is None


def test_comparison_table_marks_noise_and_prints_the_recorded_run():
    results = [
        _row("naive", [10, 11, 12]),
        _row("+workers", [30, 31, 33]),
        {"name": "+pinned", "status": "cannot run", "samples_per_sec": None},
        _row("+uint8_gpu_aug", [28, 32, 40]),
        _row("+compile", [40, 41, 42]),
        _row("ceiling_eager", [50, 51, 52]),
    ]
    ref = report.load_reference()
    text = report.format_comparison(results, ref)
    lines = {line.split()[0]: line for line in text.splitlines()[2:]}
    # the recorded ceiling_eager is shown beside this run's; a row the recording lacks shows "-"
    recorded = {r["name"]: r for r in ref["rows"]}
    assert f"{recorded['ceiling_eager']['samples_per_sec']:,.0f}" in lines["ceiling_eager"].split("|")[1]
    if "+compile" in recorded:
        assert f"{recorded['+compile']['samples_per_sec']:,.0f}" in lines["+compile"].split("|")[1]
    else:
        assert lines["+compile"].split("|")[1].split()[0] == "-"
    assert "11 [10-12]" in lines["naive"] and "1.0x" in lines["naive"]
    assert "2.8x" in lines["+workers"] and "~" not in lines["+workers"]
    # compared with the nearest row above that ran (+workers): the ranges overlap
    assert "~1.0x" in lines["+uint8_gpu_aug"]
    assert "cannot run" in lines["+pinned"]
    assert f"{recorded['+pinned']['samples_per_sec']:,.0f}" in lines["+pinned"]
    notes = report.noise_notes(results)
    assert any("+uint8_gpu_aug" in n and "noise-level" in n for n in notes)
    assert any(n.startswith("~ marks") for n in notes)
    assert report.noise_notes(results[:2]) == []


def test_png_labels_are_not_clipped(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    long = {"name": "+16-mixed", "status": "cannot run", "reason": "x" * 40 + " " + "y" * 40 + " end)"}
    short = _row("naive", [10, 11, 12])
    narrow = report.plot_ladder([short], tmp_path / "a.png")
    wide = report.plot_ladder([short, long], tmp_path / "b.png", reference=report.load_reference())
    # the image grows to hold the long label (and the recorded panel) instead of cutting it off
    assert Image.open(wide).size[0] > Image.open(narrow).size[0]
    assert Image.open(wide).size[1] > 2 * Image.open(narrow).size[1]


@pytest.mark.gpu
def test_gpu_ladder_runs_cuda_rows(tmp_path):
    from lightning_gpuopt.bench.synthetic import make_jpeg_folder

    data = make_jpeg_folder(tmp_path / "jpegs", num_images=512, num_classes=4, image_size=(96, 72))
    config = rows.LadderConfig(
        data=data,
        model="small",
        batch_size=64,
        image_size=64,
        rows=["naive", "+pinned", "+uint8_gpu_aug", "+16-mixed", "+channels_last", "+compile"],
        seconds=2.0,
        warmup=2,
        num_workers=4,
        cache_dir=tmp_path / "cache",
    )
    results = run_ladder(config)
    by = {r["name"]: r for r in results}
    names = ("naive", "+pinned", "+uint8_gpu_aug", "+16-mixed", "+channels_last", "+compile")
    for name in (*names, "ceiling_eager", "ceiling_compiled"):
        assert by[name]["status"] == "ok", by[name]
        assert by[name]["samples_per_sec"] > 0 and len(by[name]["windows"]) == 3
    assert by["+pinned"]["pin_memory"] is True and by["+pinned"]["num_workers"] == 4
    assert by["+16-mixed"]["precision"] == "16-mixed" and by["naive"]["precision"] == "32-true"
    assert by["+uint8_gpu_aug"]["gpu_util_mean"] is not None  # NVML through GPUStatsMonitor
    assert by["+uint8_gpu_aug"]["joules_per_sample"] > 0  # its power over its samples/s
    assert by["ceiling_eager"]["precision"] == by["ceiling_compiled"]["precision"] == "fp16 autocast"
    # on CUDA the compiled ceiling is the ratios' ceiling; both compiled rows timed their compile
    compiled = by["ceiling_compiled"]["samples_per_sec"]
    assert report.ceiling_summary(results)["ceiling"] == "ceiling_compiled"
    # the ratio is taken turn by turn (report.turn_ratios): the median of each turn's row over its ceiling
    turns = [t for t in report.turn_ratios(by["+compile"], by["ceiling_compiled"]) if t is not None]
    expected = statistics.median(turns) if turns else by["+compile"]["samples_per_sec"] / compiled
    assert by["+compile"]["ratio_to_ceiling"] == pytest.approx(expected)
    assert by["+compile"]["compile_seconds"] >= 0 and by["ceiling_compiled"]["compile_seconds"] >= 0


@pytest.mark.slow
def test_compiled_rows_run_on_a_cpu_when_named(jpeg_folder, tmp_path, capsys):
    # inductor's C++ kernels for a tiny model: the warm-up covers the compile, which is timed on its own
    out = tmp_path / "out"
    argv = [
        "bench",
        "--data",
        str(jpeg_folder),
        "--model",
        "small",
        "--batch-size",
        "4",
        "--image-size",
        "16",
    ]
    argv += ["--warmup", "1", "--rows", "+compile", "--workers", "0", "--seconds", "0.5", "--out", str(out)]
    argv += ["--cache-dir", str(tmp_path / "cache"), "--accelerator", "cpu", "--no-tensorboard"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    doc = json.loads((out / "version_0" / "ladder.json").read_text())
    by = {r["name"]: r for r in doc["rows"]}
    # +compile asks for the compiled ceiling too: the ratios' ceiling
    assert list(by) == ["+compile", "ceiling_eager", "ceiling_compiled"]
    for name in by:
        assert by[name]["status"] == "ok" and by[name]["samples_per_sec"] > 0, by[name]
    compiled, row = by["ceiling_compiled"], by["+compile"]
    assert compiled["compiled"] and row["compiled"] and not by["ceiling_eager"]["compiled"]
    # zero where inductor's on-disk caches make the first step about as fast as the others
    assert compiled["compile_seconds"] >= 0 and row["compile_seconds"] >= 0
    assert by["ceiling_eager"]["compile_seconds"] is None
    assert doc["compile_seconds"] == {
        "+compile": row["compile_seconds"],
        "ceiling_compiled": compiled["compile_seconds"],
    }
    assert doc["ceiling"] == "ceiling_compiled"
    assert (
        doc["ceiling_samples_per_sec"]
        == doc["ceiling_compiled_samples_per_sec"]
        == compiled["samples_per_sec"]
    )
    # each fit against the ceilings' fits of its turn; every fit compiles afresh and times its compile
    import statistics

    turns = list(zip(row["repeats"], compiled["repeats"], by["ceiling_eager"]["repeats"], strict=True))
    assert len(turns) == 3 and all(r["compile_seconds"] is not None for r in row["repeats"])
    ratios = [r["samples_per_sec"] / c["samples_per_sec"] for r, c, _ in turns]
    assert row["ratio_to_ceiling"] == pytest.approx(statistics.median(ratios))
    eager = [r["samples_per_sec"] / e["samples_per_sec"] for r, _, e in turns]
    assert row["ratio_to_eager_ceiling"] == pytest.approx(statistics.median(eager))
    # measured after the compile: a window ran at compiled speed, not the compile's seconds a step
    assert row["seconds_measured"] < row["compile_seconds"] + 30
    # under the table: the ratios' ceiling, then the compile time line
    lines = captured.out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("ratio_to_ceiling"))
    assert lines[at].startswith("ratio_to_ceiling: against ceiling_compiled (")
    assert lines[at + 1] == (
        f"compile time (first compiled step to first fast step): +compile {row['compile_seconds']:.1f} s, "
        f"ceiling_compiled {compiled['compile_seconds']:.1f} s"
    )
    assert "compiled: " in captured.err and "from the first step to the first fast one" in captured.err


def test_a_cached_store_of_another_format_is_converted_again(jpeg_folder, tmp_path):
    pytest.importorskip("h5py")
    import h5py

    from lightning_gpuopt.bench.runner import LadderRunner
    from lightning_gpuopt.data.hdf5 import HDF5ImageDataset

    runner = LadderRunner(rows.LadderConfig(jpeg_folder, batch_size=8, accelerator="cpu", cache_dir=tmp_path))
    path, why = runner._hdf5_file()
    assert why is None and path is not None
    with h5py.File(path, "r+") as f:  # as a store written by an older version
        f.attrs["format_version"] = 2
    runner._h5_path = None
    again, _ = runner._hdf5_file()
    assert again == path
    HDF5ImageDataset(again).close()  # readable: converted again
