from pathlib import Path

import pytest

from lightning_gpuopt.cli import main

TINY = ["--steps", "6", "--images", "24", "--image-size", "16", "--batch-size", "4", "--accelerator", "cpu"]


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


def test_demo_rejects_bad_arguments(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--steps", "0"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--accelerator", "tpu"])
    assert not any(Path(tmp_path).iterdir())
