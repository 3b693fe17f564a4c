from pathlib import Path

import pytest

from lightning_gpuopt.cli import main

TINY = [
    "--steps", "6", "--images", "24", "--image-size", "16", "--batch-size", "4", "--accelerator", "cpu",
    "--ladder-seconds", "0",
]  # fmt: skip


def test_demo_runs_and_says_where_the_logs_are(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["demo", "--out", str(out), "--workers", "0", *TINY]) == 0
    text = capsys.readouterr().out
    assert "samples/s" in text and "data-wait fraction" in text
    log_dir = out / "tensorboard" / "version_0"
    assert f"logs: {log_dir}" in text
    assert f"tensorboard --logdir {log_dir.parent}" in text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"time/step_ms", "time/data_wait_frac", "throughput/samples_per_sec", "train/loss"} <= tags
    # the generated images are cached: a second run reuses them
    assert sorted(p.name for p in (out / "data").iterdir()) == ["jpeg_24_16"]
    assert main(["demo", "--out", str(out), "--workers", "0", *TINY]) == 0
    assert (out / "tensorboard" / "version_1").is_dir()


def test_demo_runs_the_short_ladder(tmp_path, capsys):
    import json

    out = tmp_path / "run"
    argv = ["demo", "--out", str(out), "--workers", "1", *TINY[:-2], "--ladder-seconds", "1"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    doc = json.loads((out / "ladder.json").read_text())
    rows = {r["name"]: r for r in doc["rows"]}
    assert rows["naive"]["samples_per_sec"] > 0 and rows["ceiling_plain"]["samples_per_sec"] > 0
    assert rows["+16-mixed"]["samples_per_sec"] is None and "CUDA" in rows["+16-mixed"]["reason"]
    assert "naive" in text and "ladder results:" in text
    assert (out / "ladder.png").is_file()


def test_demo_rejects_bad_arguments(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--steps", "0"]) == 2
    assert main(["demo", "--out", str(tmp_path), "--ladder-seconds", "-1"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--accelerator", "tpu"])
    assert not any(Path(tmp_path).iterdir())
