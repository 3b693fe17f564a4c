"""The commands' user errors: the true reason in one line with the fix, exit 2, found before any work."""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path

import pytest

from lightning_gpuopt.cli import main
from tests._cli import one_error_line as _one_error_line
from tests._cli import own_cache  # noqa: F401 - the autouse fixture


@pytest.fixture
def small_folder(tmp_path):
    from PIL import Image

    for cls in ("a", "b"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (20, 16), (i * 40, 0, 0)).save(tmp_path / "imgs" / cls / f"{i}.jpg")
    return tmp_path / "imgs"


# -- convert: an unwritable destination ----------------------------------------------------------------


def test_convert_into_a_read_only_folder_says_so(small_folder, tmp_path, monkeypatch, capsys):
    """A read-only disk reports no free space; the reason given is that it is read-only (exit 2)."""
    pytest.importorskip("h5py")
    ro = tmp_path / "ro"
    ro.mkdir()
    real_statvfs = os.statvfs

    def statvfs(path):
        result = real_statvfs(path)
        if Path(path) == ro:

            class ReadOnly:
                f_flag = result.f_flag | os.ST_RDONLY
                f_bavail = 0

            return ReadOnly()
        return result

    monkeypatch.setattr(os, "statvfs", statvfs)
    monkeypatch.setattr("shutil.disk_usage", lambda p: type("U", (), {"free": 0, "total": 0, "used": 0})())
    assert main(["convert", str(small_folder), str(ro / "out.h5"), "--no-progress", "--workers", "0"]) == 2
    line = _one_error_line(capsys.readouterr().err, "convert")
    assert "read-only file system" in line and repr(str(ro)) in line and "writable disk" in line
    assert "free space" not in line
    assert list(ro.iterdir()) == []


@pytest.mark.parametrize(
    ("code", "words"),
    [(errno.EROFS, "read-only file system"), (errno.EACCES, "permission denied in its folder")],
)
def test_convert_maps_the_conversions_refusal_to_exit_2(
    small_folder, tmp_path, monkeypatch, capsys, code, words
):
    """A refusal found by the conversion itself (creating its lock or temporary file) exits 2 too."""
    pytest.importorskip("h5py")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    real_open = os.open

    def refuse(path, *args, **kwargs):
        if Path(os.fsdecode(path)).parent == out_dir:
            raise OSError(code, os.strerror(code), os.fsdecode(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    out = out_dir / "out.h5"
    assert main(["convert", str(small_folder), str(out), "--no-progress", "--workers", "0"]) == 2
    line = _one_error_line(capsys.readouterr().err, "convert")
    assert words in line and repr(str(out_dir)) in line and "choose" in line
    assert "free space" not in line


def test_convert_without_room_exits_2(small_folder, tmp_path, monkeypatch, capsys):
    pytest.importorskip("h5py")
    monkeypatch.setattr("shutil.disk_usage", lambda p: type("U", (), {"free": 10, "total": 10, "used": 0})())
    argv = ["convert", str(small_folder), str(tmp_path / "o.h5"), "--no-progress", "--workers", "0"]
    assert main(argv) == 2
    line = _one_error_line(capsys.readouterr().err, "convert")
    assert "not enough free space" in line and "[Errno" not in line


# -- convert: a file as SRC -----------------------------------------------------------------------------


def test_convert_of_an_image_file_gives_command_line_advice(small_folder, tmp_path, capsys):
    image = small_folder / "a" / "0.jpg"
    assert main(["convert", str(image), str(tmp_path / "o.h5")]) == 2
    line = _one_error_line(capsys.readouterr().err, "convert")
    assert repr(str(image)) in line and "SRC must be a class-per-subfolder image folder" in line
    assert "backend=" not in line
    assert not (tmp_path / "o.h5").exists()


def test_convert_of_a_store_says_it_is_one_already(tmp_path, capsys):
    store = tmp_path / "train.h5"
    store.write_bytes(b"\x89HDF\r\n\x1a\n")
    assert main(["convert", str(store), str(tmp_path / "o.h5")]) == 2
    line = _one_error_line(capsys.readouterr().err, "convert")
    assert repr(str(store)) in line and "already a store" in line
    assert "OptimizedDataModule" in line and "lightning-gpuopt tune" in line and "backend=" not in line


# -- tune: arguments checked first, progress while measuring -------------------------------------------

_HEAVY = ("lightning_gpuopt.data.folder", "lightning_gpuopt.data.loader", "lightning_gpuopt.data.tuning")


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["{missing}"], "does not exist"),
        (["{here}", "--candidates", "2,x"], "--candidates"),
        (["{here}", "--budget", "0"], "--budget"),
        (["{here}", "--batch-size", "0"], "--batch-size"),
    ],
)
def test_tune_refuses_bad_arguments_before_importing_the_data_stack(
    tmp_path, monkeypatch, capsys, argv, words
):
    for name in _HEAVY:  # importing any of them now fails loudly
        monkeypatch.setitem(sys.modules, name, None)
    argv = [a.format(missing=tmp_path / "nowhere", here=tmp_path) for a in argv]
    t0 = time.perf_counter()
    assert main(["tune", *argv]) == 2
    assert time.perf_counter() - t0 < 1.0
    line = _one_error_line(capsys.readouterr().err, "tune")
    assert words in line and "halted" not in line


def test_tune_says_which_count_it_measures(small_folder, capsys):
    argv = ["tune", str(small_folder), "--budget", "0.5", "--candidates", "0", "--batch-size", "2"]
    assert main([*argv, "--no-cache", "--size", "16"]) == 0
    assert "measuring num_workers=0 (1 of 1) ..." in capsys.readouterr().out


def test_tune_size_help_describes_the_stored_whole_image(capsys):
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "decoded square side" not in text and "shorter side" in text


# -- bench: arguments before the run folder; a run where no row ran fails -------------------------------

BENCH = ["--model", "small", "--image-size", "16", "--batch-size", "2", "--steps", "2", "--seconds", "0"]
BENCH += ["--repeats", "1", "--workers", "0", "--no-tensorboard", "--accelerator", "cpu"]


def test_bench_torchvision_model_without_torchvision_makes_no_folder(tmp_path, monkeypatch, capsys):
    import lightning_gpuopt._imports as imports

    monkeypatch.setattr(imports, "_TORCHVISION_AVAILABLE", False)
    out = tmp_path / "out"
    assert main(["bench", "--model", "resnet50", "--out", str(out)]) == 2
    line = _one_error_line(capsys.readouterr().err, "bench")
    assert "--model resnet50" in line and "torchvision" in line and "--model small" in line
    assert not out.exists()


def _fake_outputs(monkeypatch):
    from lightning_gpuopt.bench import report

    def write_outputs(results, config, js, png, title):
        js.write_text("{}")
        return js, None, None

    monkeypatch.setattr(report, "write_outputs", write_outputs)
    monkeypatch.setattr(report, "format_ladder_table", lambda results: "table")
    monkeypatch.setattr(report, "noise_notes", lambda results, marks: [])


def test_bench_exits_1_when_no_requested_row_ran(small_folder, tmp_path, monkeypatch, capsys):
    from lightning_gpuopt.bench import runner

    why = "the fit ended before the warm-up did (too few batches?)"
    rows = [
        {"name": "naive", "status": "failed", "reason": why},
        {"name": "ceiling_eager", "status": "ok", "reason": None},
    ]
    monkeypatch.setattr(runner, "run_ladder", lambda config, progress=None: rows)
    _fake_outputs(monkeypatch)
    argv = ["bench", "--data", str(small_folder), "--rows", "naive", "--out", str(tmp_path / "out"), *BENCH]
    assert main(argv) == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("lightning-gpuopt bench: error: no row ran") and "naive" in last and why in last
    # one requested row measured: success
    rows[0].update(status="ok", reason=None)
    assert main(argv) == 0


def test_bench_with_no_row_this_machine_can_run_ends_at_once(tmp_path):
    """Rows a CPU cannot run end the command before any data is generated or anything timed: exit 1, a line
    a row with why and what would make it run, no output folder."""
    import signal
    import subprocess

    out, cache = tmp_path / "out", tmp_path / "cache"
    env = {**os.environ, "LIGHTNING_GPUOPT_CACHE_DIR": str(cache), "CUDA_VISIBLE_DEVICES": ""}
    argv = [sys.executable, "-m", "lightning_gpuopt", "bench", "--rows", "+dali,+16-mixed,+pinned"]
    argv += ["--accelerator", "cpu", "--out", str(out)]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        stdout, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("bench with no runnable row was still running after 120 s")
    seconds = time.monotonic() - t0
    assert proc.returncode == 1, err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and stdout == ""
    for name in ("+dali", "+16-mixed", "+pinned"):
        (line,) = (x for x in lines if x.startswith(f"lightning-gpuopt bench: {name}: cannot run: "))
        assert "CUDA GPU" in line and "run it on a machine with a CUDA GPU" in line
    assert lines[-1].startswith(
        "lightning-gpuopt bench: error: no row ran (none of +pinned, +dali, +16-mixed"
    )
    assert len(lines) == 4  # no data generated, no fit, no ceiling timed
    assert not out.exists() and not cache.exists()
    assert seconds < 30


def test_bench_runs_the_rows_that_can_run_and_says_which_were_dropped(small_folder, tmp_path, capsys):
    from lightning_gpuopt.bench.rows import LadderConfig, blocked_rows
    from lightning_gpuopt.bench.runner import run_ladder

    config = LadderConfig(small_folder, rows=["+dali", "+16-mixed"], accelerator="cpu", batch_size=2)
    assert set(blocked_rows(config)) == {"+dali", "+16-mixed"}
    said: list[str] = []
    rows = run_ladder(config, progress=said.append)
    # nothing runs, not even the ceilings, which would measure nothing a row asked for
    assert [(r["name"], r["status"]) for r in rows] == [("+dali", "cannot run"), ("+16-mixed", "cannot run")]
    assert said[-1] == "none of the rows asked for can run here: nothing is measured"
    config = LadderConfig(small_folder, rows=["naive", "+dali"], accelerator="cpu", batch_size=2)
    assert set(blocked_rows(config)) == {"+dali"}
    argv = ["bench", "--data", str(small_folder), "--rows", "naive,+dali", "--out", str(tmp_path / "out")]
    assert main([*argv, *BENCH]) == 0
    err = capsys.readouterr().err
    assert "[bench] +dali: dropped (cannot run): DALI decodes on a CUDA GPU" in err
    assert "naive: DataLoader" in err and "ceiling_eager: synthetic" in err


def test_bench_failed_run_leaves_no_empty_version_folder(small_folder, tmp_path, monkeypatch, capsys):
    from lightning_gpuopt.bench import runner

    def fail(config, progress=None):
        raise ValueError("the data could not be read")

    monkeypatch.setattr(runner, "run_ladder", fail)
    out = tmp_path / "out"
    assert main(["bench", "--data", str(small_folder), "--rows", "naive", "--out", str(out), *BENCH]) == 2
    assert "the data could not be read" in capsys.readouterr().err
    assert list(out.iterdir()) == []


def test_bench_exits_1_naming_the_rows_that_failed(small_folder, tmp_path, monkeypatch, capsys):
    from lightning_gpuopt.bench import runner

    rows = [
        {"name": "naive", "status": "failed", "reason": "RuntimeError: out of memory"},
        {"name": "ceiling_eager", "status": "ok", "reason": None},
    ]
    monkeypatch.setattr(runner, "run_ladder", lambda config, progress=None: rows)
    _fake_outputs(monkeypatch)
    argv = ["bench", "--data", str(small_folder), "--rows", "naive,ceiling_eager", "--out", str(tmp_path)]
    assert main([*argv, *BENCH]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "lightning-gpuopt bench: error: 1 row failed (naive: RuntimeError: out of memory)"


def test_bench_run_that_raised_leaves_not_even_its_partial_logs(small_folder, tmp_path, monkeypatch, capsys):
    from lightning_gpuopt.bench import runner

    out = tmp_path / "out"

    def half_way(config, progress=None):
        (out / "version_0" / "tensorboard").mkdir(parents=True)
        (out / "version_0" / "tensorboard" / "events.out").write_text("a row's logs")
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_ladder", half_way)
    assert main(["bench", "--data", str(small_folder), "--rows", "naive", "--out", str(out), *BENCH]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "lightning-gpuopt bench: interrupted"
    assert list(out.iterdir()) == []


# -- demo: a ladder that measured nothing fails -----------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "code", "words"),
    [
        ([{"name": "+dali", "status": "cannot run", "reason": "needs a CUDA GPU"}], 1, "no row ran (+dali:"),
        ([{"name": "naive", "status": "ok", "reason": None}], 0, None),
    ],
)
def test_demo_exits_1_when_its_ladder_measured_nothing(tmp_path, monkeypatch, capsys, rows, code, words):
    import json

    from lightning_gpuopt.bench import demo

    def run_demo(options, say=print):
        run = tmp_path / "out" / "version_0"
        run.mkdir(parents=True)
        (run / "ladder.json").write_text(json.dumps({"rows": rows}))
        return run

    monkeypatch.setattr(demo, "run_demo", run_demo)
    assert main(["demo", "--out", str(tmp_path / "out")]) == code
    err = capsys.readouterr().err
    if words is None:
        assert err == ""
    else:
        assert _one_error_line(err, "demo").startswith(f"lightning-gpuopt demo: error: {words}")


def test_a_demo_that_raises_leaves_no_run_folder(tmp_path, monkeypatch):
    from lightning_gpuopt.bench import demo

    def broken_fit(*args, **kwargs):
        raise RuntimeError("the fit broke")

    monkeypatch.setattr(demo, "_fit", broken_fit)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="the fit broke"):
        demo.run_demo(
            demo.DemoOptions(out=str(out), images=8, batch_size=4, ladder_seconds=0), say=lambda line: None
        )
    assert list(out.iterdir()) == []  # no version_<n> left behind


# -- the parser: usage errors in one line; Python advice spelled as the command's options -----------------


def test_a_usage_error_is_one_line_naming_the_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["tune", "somewhere", "--budget", "soon"])
    assert exit_info.value.code == 2
    line = _one_error_line(capsys.readouterr().err, "tune")
    assert "argument --budget: invalid float value: 'soon'" in line
    assert line.endswith("(see lightning-gpuopt tune --help)")


_DECODE = (
    "cannot decode image 'a/1.jpg' (OSError: truncated); remove or replace the file, or pass "
    "on_corrupt='skip' to skip unreadable images"
)


def test_a_worker_error_is_its_own_message_with_the_commands_flag(monkeypatch, capsys):
    """An error re-raised from a DataLoader worker: the worker's message, advice as the command's option."""
    from lightning_gpuopt.commands import tune

    wrapped = "Caught ValueError in DataLoader worker process 0.\n"
    wrapped += "Original Traceback (most recent call last):\n"
    wrapped += f'  File "folder.py", line 3, in decode\n    raise ValueError(...)\nValueError: {_DECODE}'

    def fail(args):
        raise ValueError(wrapped)

    monkeypatch.setattr(tune, "run", fail)
    assert main(["tune", "somewhere"]) == 2
    line = _one_error_line(capsys.readouterr().err, "tune")
    assert line == (
        "lightning-gpuopt tune: error: cannot decode image 'a/1.jpg' (OSError: truncated); remove or replace "
        "the file, or pass --on-corrupt skip to skip unreadable images"
    )


def test_python_advice_a_command_has_no_option_for_is_left_out(monkeypatch, capsys):
    from lightning_gpuopt.commands import bench

    def fail(args):
        raise ValueError(f"{_DECODE}; or regenerate the folder")

    monkeypatch.setattr(bench, "run", fail)
    assert main(["bench"]) == 2
    line = _one_error_line(capsys.readouterr().err, "bench")
    assert line.endswith("(OSError: truncated); remove or replace the file; or regenerate the folder")
