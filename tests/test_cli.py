"""The CLI's faults: one line naming the path and the fix, exit 2; Ctrl-C exits 130; nothing measured in
vain."""

from __future__ import annotations

import errno
import json
import multiprocessing
import signal
from pathlib import Path

import pytest

from lightning_gpuopt.cli import describe_os_error, main
from tests._cli import one_error_line as _one_error_line
from tests._cli import own_cache  # noqa: F401 - the autouse fixture

DEMO = ["--steps", "4", "--images", "16", "--image-size", "16", "--batch-size", "4", "--accelerator", "cpu"]


def test_demo_out_that_is_a_file(tmp_path, capsys):
    target = tmp_path / "results.txt"
    target.write_text("keep me")
    assert main(["demo", "--out", str(target), *DEMO]) == 2
    line = _one_error_line(capsys.readouterr().err, "demo")
    assert str(target) in line and "is a file, not a folder; give a folder" in line
    assert target.read_text() == "keep me"


def test_demo_out_under_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(["demo", "--out", str(tmp_path / "file" / "runs"), *DEMO]) == 2
    line = _one_error_line(capsys.readouterr().err, "demo")
    assert str(tmp_path / "file") in line and "which is a file; choose another folder" in line


def test_demo_out_on_a_read_only_file_system(tmp_path, monkeypatch, capsys):
    real_mkdir = Path.mkdir

    def read_only(self, *args, **kwargs):
        if tmp_path / "ro" in (self, *self.parents):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert main(["demo", "--out", str(tmp_path / "ro" / "runs"), *DEMO]) == 2
    line = _one_error_line(capsys.readouterr().err, "demo")
    assert str(tmp_path / "ro" / "runs") in line and "Read-only file system" in line
    assert "choose a folder you can write to" in line


def test_an_os_error_from_inside_a_command_is_one_line(monkeypatch, capsys):
    from lightning_gpuopt.commands import bench

    def fail(args):
        raise PermissionError(errno.EACCES, "Permission denied", "/data/cache/workers.json")

    monkeypatch.setattr(bench, "run", fail)
    assert main(["bench"]) == 2
    line = _one_error_line(capsys.readouterr().err, "bench")
    assert "'/data/cache/workers.json'" in line and "Permission denied" in line and "permissions" in line


def test_describe_os_error_names_path_and_fix():
    text = describe_os_error(OSError(errno.ENOSPC, "No space left on device", "/out/ladder.json"))
    assert (
        text
        == "No space left on device: '/out/ladder.json'; the disk is full; free some space or choose another disk"
    )
    assert describe_os_error(OSError("the package's own message")) == "the package's own message"


def test_tune_checks_json_path_before_measuring(jpeg_folder, tmp_path, monkeypatch, capsys):
    """``--candidates 1`` makes it a measurement (``--budget`` alone is refused: nothing would be
    measured), which must not start before ``--json`` is found unwritable."""
    from lightning_gpuopt.data import tuning

    def must_not_measure(*args, **kwargs):
        raise AssertionError("measured although the result could not be saved")

    monkeypatch.setattr(tuning, "tune_num_workers", must_not_measure)
    (tmp_path / "file").write_text("")
    for bad, message in [
        (tmp_path / "file" / "r.json", "which is a file; choose another path"),
        (tmp_path, "is a folder; give a file name"),
    ]:
        assert main(["tune", str(jpeg_folder), "--candidates", "1", "--budget", "1", "--json", str(bad)]) == 2
        line = _one_error_line(capsys.readouterr().err, "tune")
        assert "--json" in line and message in line
    # a writable path is probed without leaving a file behind
    from lightning_gpuopt.bench.runs import check_writable_file

    assert check_writable_file(tmp_path / "new" / "r.json", "--json") == tmp_path / "new" / "r.json"
    assert not (tmp_path / "new" / "r.json").exists()


def test_ctrl_c_exits_130_with_one_line(monkeypatch, capsys):
    from lightning_gpuopt.commands import tune

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(tune, "run", interrupted)
    assert main(["tune", "somewhere"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "lightning-gpuopt tune: interrupted"


def test_ctrl_c_inside_a_lightning_fit_exits_130(tmp_path, monkeypatch, capsys):
    """Lightning turns Ctrl-C inside fit into sys.exit(1) and ignores SIGINT afterwards; the demo reports the
    interruption as one and gives Ctrl-C back."""
    from lightning_gpuopt.bench.models import ImageClassifier

    def press_ctrl_c(self, batch, batch_idx):
        raise KeyboardInterrupt

    monkeypatch.setattr(ImageClassifier, "training_step", press_ctrl_c)
    handler = signal.getsignal(signal.SIGINT)
    assert main(["demo", "--out", str(tmp_path / "out"), "--workers", "0", *DEMO]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "lightning-gpuopt demo: interrupted"
    assert signal.getsignal(signal.SIGINT) == handler


def test_decode_errors_name_the_cli_flag(tmp_path, capsys):
    from PIL import Image

    for cls in ("a", "b"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (20, 16), (i * 40, 0, 0)).save(tmp_path / "imgs" / cls / f"{i}.jpg")
    (tmp_path / "imgs" / "a" / "broken.jpg").write_bytes(b"not a jpeg")
    argv = [
        "tune",
        str(tmp_path / "imgs"),
        "--budget",
        "2",
        "--candidates",
        "0",
        "--batch-size",
        "4",
        "--no-cache",
    ]
    assert main(argv) == 2
    line = _one_error_line(capsys.readouterr().err, "tune")
    assert "broken.jpg" in line and "--on-corrupt skip" in line and "on_corrupt=" not in line
    assert main([*argv, "--on-corrupt", "skip"]) == 0


def test_tune_measures_reading_threads_for_an_hdf5_store(jpeg_folder, tmp_path, capsys):
    pytest.importorskip("h5py")
    from lightning_gpuopt.data.convert import convert_folder_to_hdf5

    store = tmp_path / "s.h5"
    convert_folder_to_hdf5(jpeg_folder, store, 32, workers=1, progress=False)
    out_json = tmp_path / "tune.json"
    argv = ["tune", str(store), "--budget", "3", "--candidates", "0,1,2", "--batch-size", "8"]
    # processes an earlier test left to the garbage collector are not this command's
    before = {p.pid for p in multiprocessing.active_children()}
    assert main([*argv, "--no-cache", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "measuring reading threads for HDF5ImageDataset" in text
    assert (
        "hdf5=HDF5Options(threads=" in text
        and "(reading threads, measured)  or  HostDataLoader(..., read_threads=" in text
    )
    result = json.loads(out_json.read_text())
    measured = [row["num_workers"] for row in result["table"]]
    assert measured[0] == 0 and set(measured) <= {0, 1, 2}
    assert all(row["samples_per_sec"] > 0 for row in result["table"])
    # no worker process was started: the store is read on threads
    assert [p for p in multiprocessing.active_children() if p.pid not in before] == []


def test_tune_on_a_jpeg_store_names_the_backend_that_keeps_worker_processes(jpeg_folder, tmp_path, capsys):
    pytest.importorskip("h5py")
    from lightning_gpuopt.data.convert import convert_folder_to_hdf5

    store = tmp_path / "s_jpeg.h5"
    convert_folder_to_hdf5(jpeg_folder, store, 32, workers=1, progress=False, format="jpeg")
    assert main(["tune", str(store), "--batch-size", "8"]) == 0
    # under backend="auto" DALI would decode the store's training batches where it is installed on a GPU
    assert 'suggestion: OptimizedDataModule(..., backend="hdf5", num_workers=' in capsys.readouterr().out
