"""`lightning-gpuopt convert`: --format raw|jpeg|auto, the consequence lines (bytes, expected read rate, the
rule's recommendation) and the exit codes, one a kind of failure, each with command-line advice and nothing
left behind."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("h5py")

from lightning_gpuopt.cli import main as cli_main  # noqa: E402
from lightning_gpuopt.data import store_choice  # noqa: E402
from lightning_gpuopt.data.hdf5 import HDF5ImageDataset  # noqa: E402
from lightning_gpuopt.data.jpeg_store import JPEGStoreDataset  # noqa: E402

GIB = 1 << 30


def _convert(src: Path, out: Path, *flags: str, size: int = 16) -> list[str]:
    return ["convert", str(src), str(out), "--size", str(size), "--workers", "1", "--no-progress", *flags]


def _left_in(folder: Path, keep: str | None = None) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != keep)


def _make_small(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine whose memory holds no raw store of the test folder and whose disk is slow: the rule's JPEG
    side (2 cores a GPU decoding beat 1 MB/s of 64 px canvases, larger than the 64x48 source JPEGs). The
    disk probe still writes its file."""
    monkeypatch.setattr(store_choice, "memory_bytes", lambda: 20_000)
    monkeypatch.setattr(store_choice, "cores_per_gpu", lambda: 2)
    monkeypatch.setattr(store_choice, "disk_read_gbps", lambda *a, **k: 0.001)
    monkeypatch.setattr(store_choice, "PROBE_BYTES", 1 << 20)


@pytest.fixture
def small_machine(monkeypatch):
    _make_small(monkeypatch)


def test_jpeg_format_writes_the_compact_store_and_states_its_bytes_and_rate(jpeg_folder, tmp_path, capsys):
    out = tmp_path / "s.h5"
    assert cli_main(_convert(jpeg_folder, out, "--format", "jpeg")) == 0
    text = capsys.readouterr().out
    assert isinstance(HDF5ImageDataset(out), JPEGStoreDataset)
    assert "JPEG store, 48 images, stored at 16 px" in text
    ratio = float(re.search(r"kB an image: ([0-9.]+)x the source files", text).group(1))
    assert 0 < ratio <= 1.0  # no more bytes than the source JPEGs
    assert re.search(r"expected read rate: about [0-9,]+ img/s \(\d+ cores a GPU decoding", text)
    assert "recommended here" not in text  # --format was given


def test_without_format_the_raw_store_is_written_and_the_rule_recommends(
    jpeg_folder, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(store_choice, "memory_bytes", lambda: 64 * GIB)
    out = tmp_path / "raw.h5"
    assert cli_main(_convert(jpeg_folder, out)) == 0
    text = capsys.readouterr().out
    assert not isinstance(HDF5ImageDataset(out), JPEGStoreDataset)
    assert "raw store, 48 images" in text and "while the page cache holds it" in text
    assert re.search(r"kB an image: [0-9.]+x the source files", text)
    assert "recommended here: --format raw: the raw store" in text and "fits in half of 69 GB memory" in text


def test_without_format_a_machine_the_raw_store_overwhelms_is_told_to_use_jpeg(
    jpeg_folder, tmp_path, capsys, small_machine
):
    out = tmp_path / "raw.h5"
    assert cli_main(_convert(jpeg_folder, out, size=64)) == 0
    text = capsys.readouterr().out
    assert not isinstance(HDF5ImageDataset(out), JPEGStoreDataset)  # the default is not changed silently
    assert "recommended here: --format jpeg: the raw store" in text and "does not fit" in text
    assert "the disk's, the store being over half the memory" in text


@pytest.mark.parametrize("machine", ["large", "small"])
def test_auto_states_its_choice_before_converting(jpeg_folder, tmp_path, capsys, monkeypatch, machine):
    if machine == "large":
        monkeypatch.setattr(store_choice, "memory_bytes", lambda: 64 * GIB)
    else:
        _make_small(monkeypatch)
    out = tmp_path / "auto.h5"
    assert cli_main(_convert(jpeg_folder, out, "--format", "auto", size=64)) == 0
    first, *rest = capsys.readouterr().out.splitlines()
    jpeg = machine == "small"
    assert first.startswith(f"--format auto: the {'JPEG' if jpeg else 'raw'} store: the raw store")
    assert isinstance(HDF5ImageDataset(out), JPEGStoreDataset) == jpeg
    assert rest[0].startswith(f"wrote {out}: {'JPEG' if jpeg else 'raw'} store, 48 images, stored at 64 px")
    assert _left_in(tmp_path) == ["auto.h5"]  # the disk probe is gone


def test_the_rule_is_the_documented_comparison():
    host = {"memory": 128 * GIB, "disk_gbps": 0.86, "cores": 16}
    fits = store_choice.choose_store_format(8192, 2 * GIB, GIB, **host)
    assert fits.format == "raw" and fits.raw_rate == store_choice.RAW_CACHED_RATE
    imagenet = store_choice.choose_store_format(1_281_167, 378 * GIB, 140 * GIB, **host)
    assert imagenet.format == "jpeg" and "GB/s, assumed" not in imagenet.reason
    assert imagenet.raw_rate == pytest.approx(0.86e9 / (378 * GIB / 1_281_167))
    assert imagenet.jpeg_rate == pytest.approx(min(16_000, 0.86e9 / (140 * GIB / 1_281_167)))
    # few cores a GPU and a fast disk: the raw store read from the disk beats decoding
    few = store_choice.choose_store_format(
        1_281_167, 378 * GIB, 140 * GIB, memory=128 * GIB, disk_gbps=6.0, cores=4
    )
    assert few.format == "raw" and few.raw_rate > few.jpeg_rate == 4 * store_choice.JPEG_DECODE_RATE_PER_CORE
    assumed = store_choice.choose_store_format(10, 10 * GIB, GIB, memory=GIB, cores=1)
    assert assumed.disk_gbps == store_choice.ASSUMED_DISK_GBPS
    assert "GB/s, assumed" in assumed.reason


def test_the_rule_weighs_this_hosts_rates_measured_on_the_users_images(jpeg_folder, capsys):
    """The decode rate a core and the copy rate are measured on a sample of the source, not taken from
    another host's figures; the rule uses them and says so (``assumed`` only where nothing was measured)."""
    from lightning_gpuopt.data.folder import scan_image_folder

    _, samples = scan_image_folder(jpeg_folder)
    rates = store_choice.measure_rates([p for p, _ in samples], 64)
    assert rates is not None and rates.images == store_choice.SAMPLE_IMAGES
    assert rates.decode > 0 and rates.copy > 0
    host = {"memory": 128 * GIB, "disk_gbps": 0.86, "cores": 16}
    fits = store_choice.choose_store_format(8192, 2 * GIB, GIB, **host, rates=rates)
    assert fits.rates is rates and fits.jpeg_rate == pytest.approx(16 * rates.decode)
    assert fits.raw_rate == pytest.approx(4 * rates.copy)  # four reading threads
    assert f"measured on {rates.images} of your images" in fits.reason and "assumed" not in fits.reason
    assert "assumed" in store_choice.choose_store_format(8192, 2 * GIB, GIB, **host).reason
    assert store_choice.measure_rates([str(jpeg_folder / "missing.jpg")], 64) is None
    out = jpeg_folder.parent / "measured.h5"
    assert cli_main(_convert(jpeg_folder, out, "--format", "jpeg", size=64)) == 0
    text = capsys.readouterr().out
    assert "img/s a core, measured on 32 of your images" in text and "a core, assumed" not in text


def test_disk_read_gbps_measures_a_file_or_says_it_cannot(tmp_path, monkeypatch):
    small = tmp_path / "small.bin"
    small.write_bytes(b"x" * 4096)
    assert store_choice.disk_read_gbps(small) is None  # too small to be worth a figure
    monkeypatch.setattr(store_choice, "MIN_PROBE_BYTES", 1 << 20)
    gbps = store_choice.probe_disk_gbps(tmp_path, "probe.tmp")
    assert not (tmp_path / "probe.tmp").exists()
    assert gbps is None or gbps > 0  # None on a file system without O_DIRECT (tmpfs)


# -- exit codes: 2 the user's to fix, 1 the machine's failure, 130 interrupted; nothing left behind --


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing source", "does not exist"),
        ("empty source", "has no class subfolders"),
        ("h5 source", "already a store"),
        ("missing out folder", "does not exist; create it first (mkdir -p)"),
        ("bad format", "invalid choice: 'zip'"),
    ],
)
def test_user_errors_exit_2_in_one_line_of_command_line_words(jpeg_folder, tmp_path, capsys, case, expected):
    src, out = jpeg_folder, tmp_path / "o.h5"
    flags: list[str] = []
    if case == "missing source":
        src = tmp_path / "nope"
    elif case == "empty source":
        src = tmp_path / "empty"
        src.mkdir()
    elif case == "h5 source":
        src = tmp_path / "x.h5"
        src.write_bytes(b"")
    elif case == "missing out folder":
        out = tmp_path / "no" / "o.h5"
    else:
        flags = ["--format", "zip"]
    with pytest.raises(SystemExit) if case == "bad format" else _nothing() as stop:
        assert cli_main(_convert(src, out, *flags)) == 2
    if case == "bad format":
        assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and "Traceback" not in err, err
    assert case == "bad format" or len(err.splitlines()) == 1
    # no Python-API advice (overwrite=True, on_corrupt='skip', workers=1)
    assert not re.search(r"\w+=(True|'|\"|\d)", err), err
    assert not out.exists() and not list(tmp_path.glob("*.tmp-*")) and not list(tmp_path.glob(".*.lock"))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_failed_write_exits_1_naming_the_file_and_leaves_nothing(
    jpeg_folder, tmp_path, capsys, monkeypatch
):
    # the JPEG store's bytes cannot be copied into the file: an I/O failure, not the user's to fix
    monkeypatch.setattr(os, "copy_file_range", lambda *a: 0)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    assert cli_main(_convert(jpeg_folder, out_dir / "o.h5", "--format", "jpeg")) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("lightning-gpuopt convert: error: writing") and "was not written" in err, err
    assert len(err.splitlines()) == 1
    assert _left_in(out_dir) == []


def test_an_unreadable_image_with_the_jpeg_format_gets_the_flag(jpeg_folder, tmp_path, capsys):
    src = Path(shutil.copytree(jpeg_folder, tmp_path / "src"))
    (src / "class_00" / "img_000000.jpg").write_bytes(b"not a jpeg")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    assert cli_main(_convert(src, out_dir / "o.h5", "--format", "jpeg")) == 2
    err = capsys.readouterr().err.strip()
    assert "img_000000.jpg" in err and "--on-corrupt skip" in err and "on_corrupt=" not in err
    assert _left_in(out_dir) == []


def test_sources_smaller_than_size_are_named_in_one_warning_with_the_size_that_upsamples_none(
    jpeg_folder, tmp_path, capsys
):
    """The fixture's 64x48 JPEGs at --size 64 are upsampled (48 -> 64): one warning line naming how many,
    the smallest and --size 48; at --size 48 none is. The DataModule's rule is the same function: the store
    at 48 takes image_size 48 and refuses 49."""
    import warnings

    from lightning_gpuopt.data.datamodule import OptimizedDataModule

    assert cli_main(_convert(jpeg_folder, tmp_path / "up.h5", size=64)) == 0
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()
    assert line == (
        "lightning-gpuopt convert: warning: 48 of 48 source images have a shorter side below --size 64 (the "
        "smallest 64x48): they are upsampled to it, which adds no detail; --size 48 keeps every image at most "
        "at its own size (OptimizedDataModule then takes image_size <= 48)"
    )
    assert cli_main(_convert(jpeg_folder, tmp_path / "at.h5", size=48)) == 0
    assert capsys.readouterr().err == ""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*stored with its shorter side at")
        OptimizedDataModule(tmp_path / "at.h5", batch_size=4, num_workers=0, image_size=48).setup("fit")
    with pytest.raises(ValueError, match=r"storage size must be >= image_size \(49\)"):
        OptimizedDataModule(tmp_path / "at.h5", batch_size=4, num_workers=0, image_size=49).setup("fit")


def test_the_library_warns_once_in_its_own_words(jpeg_folder, tmp_path):
    from lightning_gpuopt.data.convert import convert_folder_to_hdf5

    with pytest.warns(
        UserWarning, match=r"^48 of 48 source images have a shorter side below storage_size=56"
    ):
        result = convert_folder_to_hdf5(jpeg_folder, tmp_path / "s.h5", 56, workers=2, progress=False)
    assert (result.upsampled, result.smallest_source) == (48, (64, 48))
    result = convert_folder_to_hdf5(
        jpeg_folder, tmp_path / "j.h5", 40, workers=1, progress=False, format="jpeg"
    )
    assert (result.upsampled, result.smallest_source) == (0, None)
