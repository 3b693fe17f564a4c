"""``lightning-gpuopt demo`` on the CPU: where it writes, what it prints, and that two runs stay apart."""

import json
from pathlib import Path

import pytest

from lightning_gpuopt.cli import main

TINY = [
    "--steps", "6", "--images", "24", "--image-size", "16", "--batch-size", "4", "--accelerator", "cpu",
    "--ladder-seconds", "0",
]  # fmt: skip


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_GPUOPT_CACHE_DIR", str(tmp_path / "cache"))


def test_demo_runs_and_says_where_the_logs_are(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["demo", "--out", str(out), "--workers", "0", *TINY]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "samples/s" in text and "data-wait fraction" in text
    run = out / "version_0"
    log_dir = run / "tensorboard" / "fit"
    assert f"this run writes to {run}" in text
    assert f"logs: {log_dir}" in text
    assert f"tensorboard --logdir {run / 'tensorboard'}" in text
    # Lightning's banners stay out of the demo's output
    for banner in ("GPU available", "TPU available", "Tip:", "LeafSpec"):
        assert banner not in captured.out + captured.err
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"time/step_ms", "time/data_wait_frac", "throughput/samples_per_sec", "train/loss"} <= tags
    # the generated images are cached outside the run folder; a second run reuses them in its own folder
    assert sorted(p.name for p in (tmp_path / "cache" / "demo").iterdir()) == ["jpeg_24_10c_22x18"]
    assert main(["demo", "--out", str(out), "--workers", "0", *TINY]) == 0
    assert "using cached generated images" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["version_0", "version_1"]
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 1  # the first run's events were not added to


def test_demo_runs_the_ladder_beside_the_recorded_gpu_run(tmp_path, capsys, monkeypatch):
    from lightning_gpuopt.bench import demo

    # a budget that holds on a loaded machine: every row gets its three fits (the cut: the next test)
    monkeypatch.setattr(demo, "BUDGET_S", 3600.0)
    out = tmp_path / "run"
    argv = ["demo", "--out", str(out), "--workers", "1", *TINY[:-2], "--ladder-seconds", "0.6"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "time budget spent" not in text
    run = out / "version_0"
    doc = json.loads((run / "ladder.json").read_text())
    rows = {r["name"]: r for r in doc["rows"]}
    naive = rows["naive"]
    assert naive["samples_per_sec"] > 0 and len(naive["windows"]) == 3
    assert naive["samples_per_sec_min"] <= naive["samples_per_sec"] <= naive["samples_per_sec_max"]
    # three fits taking turns, each the same number of steps, their step times' p50/p90 beside samples/s
    assert [r["turn"] for r in naive["repeats"]] == [0, 1, 2]
    assert len({r["steps"] for r in naive["repeats"]}) == 1 and 0 < naive["p50_ms"] <= naive["p90_ms"]
    assert all(r["ratio_to_ceiling"] > 0 for r in naive["repeats"])
    assert rows["ceiling_eager"]["samples_per_sec"] > 0
    # the compiled rows are left out of a CPU demo (a minute or more of compiling), saying how to run them
    for name in ("+compile", "ceiling_compiled"):
        assert rows[name]["status"] == "skipped" and rows[name]["samples_per_sec"] is None
        assert "--rows ...,+compile" in rows[name]["reason"]
    assert "skipped here: +compile, ceiling_compiled: torch.compile on a CPU" in text
    assert doc["ceiling"] == "ceiling_eager" and doc["compile_seconds"] == {}
    assert "compile time" not in text
    assert rows["+16-mixed"]["samples_per_sec"] is None and "CUDA" in rows["+16-mixed"]["reason"]
    # the table: this machine's median [range] left of "|", the recorded H200 ladder right of it
    table = text[text.index("row  ") :]
    naive_line = next(line for line in table.splitlines() if line.startswith("naive "))
    here, recorded = naive_line.split("|")
    from lightning_gpuopt.bench.report import load_reference

    shipped = {r["name"]: r for r in load_reference()["rows"]}
    assert table.splitlines()[0].split()[:6] == ["row", "samples/s", "[range]", "p50", "ms", "p90"]
    assert f"{naive['samples_per_sec']:,.0f} [" in here and f" {naive['p90_ms']:.1f} " in here
    assert recorded.split()[0] == f"{shipped['naive']['samples_per_sec']:,.0f}"
    assert "NVIDIA H200 recorded: resnet50, batch 256, 224 px" in text
    assert "a CPU cannot show: the GPU rows (+pinned, +dali, +16-mixed)" in text and "GPU-Util" in text
    assert f"ladder results: {run / 'ladder.json'}" in text
    assert (run / "ladder.png").is_file()
    assert sorted(p.name for p in (run / "tensorboard").iterdir())[:2] == ["00_naive", "01_workers"]
    # each window is a fit of its own, the rows taking turns: one TensorBoard run a fit
    assert sorted(p.name for p in (run / "tensorboard" / "00_naive").iterdir()) == ["fit_0", "fit_1", "fit_2"]
    assert "[round 3/3," in text


def test_demo_names_the_rows_its_time_budget_cut_short(tmp_path, capsys, monkeypatch):
    from lightning_gpuopt.bench import demo

    monkeypatch.setattr(demo, "BUDGET_S", 0.0)  # 30 x 0.4 s: spent in the first round
    out = tmp_path / "run"
    argv = ["demo", "--out", str(out), "--workers", "1", *TINY[:-2], "--ladder-seconds", "0.4"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    rows = json.loads((out / "version_0" / "ladder.json").read_text())["rows"]
    short = [r["name"] for r in rows if r["status"] == "ok" and len(r["repeats"]) < 3]
    left_out = [r["name"] for r in rows if r["status"] == "skipped" and r["reason"] == "time budget spent"]
    assert short or left_out
    line = next(line for line in text.splitlines() if line.startswith("time budget spent: "))
    assert all(f"{name} measured in " in line for name in short)
    assert line.endswith(f"{', '.join(left_out)} not measured" if left_out else "of 3 fits")


def test_demo_rejects_bad_arguments(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--steps", "0"]) == 2
    assert main(["demo", "--out", str(tmp_path), "--ladder-seconds", "-1"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--accelerator", "tpu"])
    assert not any(Path(tmp_path).iterdir())
