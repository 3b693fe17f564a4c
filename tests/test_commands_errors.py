"""The commands' user errors: the true reason in one line with the fix, exit 2, found before any work."""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path

import pytest

from lightning_gpuopt.cli import main


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_GPUOPT_CACHE_DIR", str(tmp_path / "cache"))


def _one_error_line(err: str, command: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"lightning-gpuopt {command}: error: ")
    assert "Traceback" not in err
    return lines[0]


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
def test_convert_maps_the_conversions_refusal_to_exit_2(small_folder, tmp_path, monkeypatch, capsys, code, words):
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
    assert main(["convert", str(small_folder), str(tmp_path / "o.h5"), "--no-progress", "--workers", "0"]) == 2
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
def test_tune_refuses_bad_arguments_before_importing_the_data_stack(tmp_path, monkeypatch, capsys, argv, words):
    for name in _HEAVY:  # importing any of them now fails loudly
        monkeypatch.setitem(sys.modules, name, None)
    argv = [a.format(missing=tmp_path / "nowhere", here=tmp_path) for a in argv]
    t0 = time.perf_counter()
    assert main(["tune", *argv]) == 2
    assert time.perf_counter() - t0 < 1.5
    line = _one_error_line(capsys.readouterr().err, "tune")
    assert words in line and "halted" not in line


def test_tune_says_which_count_it_measures(small_folder, capsys):
    argv = ["tune", str(small_folder), "--budget", "0.5", "--candidates", "0", "--batch-size", "2", "--no-cache"]
    assert main([*argv, "--size", "16"]) == 0
    assert "measuring num_workers=0 ..." in capsys.readouterr().out


def test_tune_size_help_describes_the_stored_whole_image(capsys):
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "decoded square side" not in text and "shorter side" in text
