"""convert_folder_to_hdf5 / `lightning-gpuopt convert`: whole images on the canvas, and its failure modes."""

import io
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

h5py = pytest.importorskip("h5py")

from lightning_gpuopt.cli import main as cli_main  # noqa: E402
from lightning_gpuopt.data import convert as convert_mod  # noqa: E402
from lightning_gpuopt.data import folder as folder_mod  # noqa: E402
from lightning_gpuopt.data import layout  # noqa: E402
from lightning_gpuopt.data.convert import (  # noqa: E402
    FORMAT_VERSION,
    CorruptImageError,
    OutputExistsError,
    OutputInUseError,
    convert_folder_to_hdf5,
)
from lightning_gpuopt.data.folder import load_canvas, scan_image_folder  # noqa: E402
from lightning_gpuopt.data.hdf5 import FORMAT, HDF5ImageDataset  # noqa: E402
from lightning_gpuopt.data.jpeg_store import (  # noqa: E402
    JPEG_FORMAT,
    JPEG_FORMAT_VERSION,
    JPEG_QUALITY,
    JPEGStoreDataset,
)
from tests.data._images import grey16_as_rgb8, mad, save, save_grey16, smooth_rgb, tv_resize  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _region(canvas: np.ndarray, meta: np.ndarray) -> np.ndarray:
    """The stored image in its own orientation."""
    h, w, transposed = meta.tolist()
    region = canvas[:h, :w]
    return region.transpose(1, 0, 2) if transposed else region


def _jpeg_round_trip(array: np.ndarray, grey: bool) -> np.ndarray:
    """``array`` encoded as the JPEG store encodes (quality ``JPEG_QUALITY``), decoded back to RGB."""
    img = Image.fromarray(array)
    buf = io.BytesIO()
    (img.convert("L") if grey else img).save(buf, format="JPEG", quality=JPEG_QUALITY)
    return np.asarray(Image.open(buf).convert("RGB"))


@pytest.mark.parametrize("fmt", ["raw", "jpeg"])
def test_store_holds_torchvision_resize_of_whole_images(tmp_path, fmt):
    """Both stores hold torchvision's resize of each whole image; the JPEG store differs from it by no more
    than its own encoding costs (a source it re-encodes), on top of the raw store's tolerance."""
    src = tmp_path / "src"
    files = {
        "a/landscape.png": smooth_rgb(60, 80, 0),
        "a/portrait.png": smooth_rgb(90, 61, 1),
        "a/square.png": smooth_rgb(50, 50, 2),
        "b/panorama.png": smooth_rgb(30, 100, 3),  # longer than the canvas: its centre kept
        "b/large.jpg": smooth_rgb(600, 800, 4),  # decoded at a reduced DCT scale first
        "b/tiny.png": smooth_rgb(12, 16, 5),  # upscaled, as torchvision does
        "a/kept.jpg": smooth_rgb(32, 40, 6),  # already the stored size: the JPEG store keeps its bytes
    }
    for rel, arr in files.items():
        save(arr, src / rel, **({"quality": 95} if rel.endswith(".jpg") else {}))
    save_grey16(40, 64, src / "b" / "grey16.png")
    out = tmp_path / "s.h5"
    res = convert_folder_to_hdf5(src, out, 32, workers=2, progress=False, format=fmt)
    assert res.num_images == 8 and res.classes == ["a", "b"] and res.storage_size == 32 and res.format == fmt
    ds = HDF5ImageDataset(out)
    assert isinstance(ds, JPEGStoreDataset) == (fmt == "jpeg")
    assert ds.image_shape == (32, 48, 3) and ds.storage_size == 32
    _, samples = scan_image_folder(src)
    assert ds.files() == [os.path.relpath(p, src) for p, _ in samples]
    attrs = ds.attrs()
    if fmt == "raw":
        assert attrs["format"] == FORMAT and attrs["format_version"] == FORMAT_VERSION == 3
    else:
        assert attrs["format"] == JPEG_FORMAT and attrs["format_version"] == JPEG_FORMAT_VERSION
    assert attrs["complete"] and attrs["storage_size"] == 32
    checked = 0
    for i, rel in enumerate(ds.files()):
        canvas, label, meta = ds[i]
        assert label == (0 if rel.startswith("a/") else 1)
        original = grey16_as_rgb8(src / rel) if "grey16" in rel else Image.open(src / rel).convert("RGB")
        w, h = original.size
        ref = layout.cut_to_canvas(np.asarray(tv_resize(original, 32)), 32)  # a long side cut to the canvas
        region = _region(canvas, meta)
        assert region.shape == ref.shape, rel
        tolerance = 2.0
        if fmt == "jpeg" and rel != "a/kept.jpg":  # re-encoded: plus what the encoding alone costs
            tolerance += mad(_jpeg_round_trip(ref, grey="grey16" in rel), ref)
        assert mad(region, ref) <= tolerance, (rel, mad(region, ref), tolerance)
        assert meta[2] == (h > w)  # portraits are stored transposed
        outside = canvas.copy()
        outside[: meta[0], : meta[1]] = 0
        assert not outside.any()  # nothing outside the image's region
        checked += 1
    assert checked == 8
    if fmt == "jpeg":
        assert attrs["num_kept"] == 1 and res.bytes_written < res.source_bytes


def _copy_with_corrupt(tmp_path, jpeg_folder):
    root = tmp_path / "src"
    shutil.copytree(jpeg_folder, root)
    (root / "class_01" / "img_000010.jpg").write_bytes(b"this is not a jpeg")
    return root


def test_corrupt_image_named_and_no_output(jpeg_folder, tmp_path):
    root = _copy_with_corrupt(tmp_path, jpeg_folder)
    out = tmp_path / "o.h5"
    with pytest.raises(CorruptImageError, match=r"img_000010\.jpg.*on_corrupt='skip'"):
        convert_folder_to_hdf5(root, out, 8, workers=2, progress=False)
    assert not out.exists() and not list(tmp_path.glob("o.h5.tmp-*"))


def test_corrupt_image_skipped_and_listed(jpeg_folder, tmp_path):
    root = _copy_with_corrupt(tmp_path, jpeg_folder)
    res = convert_folder_to_hdf5(root, tmp_path / "o.h5", 8, workers=2, on_corrupt="skip", progress=False)
    assert res.skipped == ["class_01/img_000010.jpg"] and res.num_images == 47
    ds = HDF5ImageDataset(tmp_path / "o.h5")
    assert len(ds) == 47 and ds.attrs()["num_skipped"] == 1
    with h5py.File(tmp_path / "o.h5", "r") as f:
        assert [s.decode() for s in f["skipped_files"][()]] == res.skipped
    _, samples = scan_image_folder(root)
    by_rel = {os.path.relpath(p, root): (p, lbl) for p, lbl in samples}
    for i, rel in enumerate(ds.files()):  # labels and meta still line up with their files after the gap
        path, label = by_rel[rel]
        canvas, got, meta = ds[i]
        assert got == label
        expected, expected_meta = load_canvas(path, 8)
        np.testing.assert_array_equal(canvas, expected)
        np.testing.assert_array_equal(meta, expected_meta)
    assert ds._block_start is not None  # the skipped image's row stays: the kept images are still one block
    out = np.empty((len(ds), *ds.image_shape), np.uint8)
    ds.read_into(np.arange(len(ds)), out)
    np.testing.assert_array_equal(out, np.stack([ds[i][0] for i in range(len(ds))]))


def test_converter_validates_inputs(jpeg_folder, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        convert_folder_to_hdf5(tmp_path / "nope", tmp_path / "o.h5", progress=False)
    with pytest.raises(FileNotFoundError, match=r"output folder .*nodir.* does not exist"):
        convert_folder_to_hdf5(jpeg_folder, tmp_path / "nodir" / "o.h5", progress=False)
    for bad, error in ((0, ValueError), (12.5, TypeError), ("256", TypeError)):
        with pytest.raises(error, match=r"^storage_size must be an int >= 1"):
            convert_folder_to_hdf5(jpeg_folder, tmp_path / "o.h5", bad, progress=False)
    (tmp_path / "o.h5").write_bytes(b"keep me")
    with pytest.raises(ValueError, match=r"already exists.*overwrite"):
        convert_folder_to_hdf5(jpeg_folder, tmp_path / "o.h5", 8, progress=False)
    assert (tmp_path / "o.h5").read_bytes() == b"keep me"
    convert_folder_to_hdf5(jpeg_folder, tmp_path / "o.h5", 8, overwrite=True, workers=1, progress=False)
    assert len(HDF5ImageDataset(tmp_path / "o.h5")) == 48


# -- one writer a store, and a store is published only complete --------------------------------------------


def _hook_block(monkeypatch, at_block: int, action) -> None:
    """Run ``action(writer)`` once, in the first conversion to reach decoded block ``at_block``, before
    that block is written (blocks before it are on disk, the rest not yet)."""
    real = convert_mod._write_blocks
    done = threading.Event()

    def write_blocks(writer, blocks, keep_going, advance):
        def hooked():
            for b, block in enumerate(blocks):
                if b == at_block and not done.is_set():
                    done.set()
                    action(writer)
                yield block

        return real(writer, hooked(), keep_going, advance)

    monkeypatch.setattr(convert_mod, "_write_blocks", write_blocks)


class _Paused:
    """A conversion in a thread, held at its second block until ``resume()``."""

    def __init__(self, monkeypatch, src, out) -> None:
        self.reached, self.go = threading.Event(), threading.Event()
        self.result = self.error = None

        def hold(writer):
            self.reached.set()
            assert self.go.wait(30)

        _hook_block(monkeypatch, 1, hold)

        def work():
            try:
                self.result = convert_folder_to_hdf5(src, out, 8, workers=1, progress=False)
            except BaseException as err:  # handed to the test
                self.error = err

        self.thread = threading.Thread(target=work)
        self.thread.start()
        assert self.reached.wait(30), "the conversion did not start"

    def resume(self):
        self.go.set()
        self.thread.join(30)
        return self.result, self.error


def test_a_second_conversion_to_the_same_store_fails_at_once(jpeg_folder, tmp_path, monkeypatch, capsys):
    other = tmp_path / "other"
    shutil.copytree(jpeg_folder / "class_00", other / "only")  # 16 images: tells the two stores apart
    out = tmp_path / "same.h5"
    paused = _Paused(monkeypatch, jpeg_folder, out)
    try:
        t0 = time.perf_counter()
        busy = rf"another conversion \(pid {os.getpid()}\) is writing .*same\.h5"
        with pytest.raises(OutputInUseError, match=busy):
            convert_folder_to_hdf5(other, out, 8, workers=1, progress=False)
        with pytest.raises(OutputInUseError):  # --overwrite does not let two writers share a store
            convert_folder_to_hdf5(other, out, 8, workers=1, progress=False, overwrite=True)
        argv = ["convert", str(other), str(out), "--size", "8", "--workers", "1", "--no-progress"]
        assert cli_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("lightning-gpuopt convert: error: another conversion") and "same.h5" in err
        assert "wait for it to finish, or write to another name" in err and len(err.splitlines()) == 1
        assert time.perf_counter() - t0 < 30  # a hang guard: refused before scanning or decoding anything
    finally:
        result, error = paused.resume()
    assert error is None and result.num_images == 48
    assert len(HDF5ImageDataset(out)) == 48  # the first writer's store, whole
    with pytest.raises(OutputExistsError, match=r"same\.h5.* already exists"):  # after it: exists
        convert_folder_to_hdf5(other, out, 8, workers=1, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "same.h5"]  # no lock or temp left


def test_a_file_that_appears_during_a_conversion_is_not_replaced(jpeg_folder, tmp_path, monkeypatch):
    out = tmp_path / "o.h5"
    _hook_block(monkeypatch, 1, lambda writer: out.write_bytes(b"keep me"))
    with pytest.raises(OutputExistsError, match=r"o\.h5.* already exists"):
        convert_folder_to_hdf5(jpeg_folder, out, 8, workers=1, progress=False)
    assert out.read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.h5"]
    monkeypatch.undo()
    convert_folder_to_hdf5(jpeg_folder, out, 8, workers=1, progress=False, overwrite=True)
    assert len(HDF5ImageDataset(out)) == 48


def test_a_lock_file_left_by_a_killed_conversion_does_not_block(jpeg_folder, tmp_path):
    out = tmp_path / "o.h5"
    (tmp_path / ".o.h5.lock").write_text("999999\n")  # what a SIGKILL leaves: the file, not the lock
    convert_folder_to_hdf5(jpeg_folder, out, 8, workers=1, progress=False)
    assert len(HDF5ImageDataset(out)) == 48 and not (tmp_path / ".o.h5.lock").exists()


def test_a_store_copied_before_the_conversion_finished_is_refused(jpeg_folder, tmp_path, monkeypatch):
    out, copy = tmp_path / "o.h5", tmp_path / "copy.h5"
    # 48 images in blocks of 32: the copy holds the first block written, the rest allocated and black
    _hook_block(monkeypatch, 1, lambda writer: shutil.copyfile(writer.tmp, copy))
    convert_folder_to_hdf5(jpeg_folder, out, 8, workers=1, progress=False)
    assert len(HDF5ImageDataset(out)) == 48
    with h5py.File(copy, "r") as f:
        assert "complete" not in f.attrs and "meta" not in f  # the tables come last, with the mark
    with pytest.raises(
        ValueError, match=r"copy\.h5.* is incomplete: the conversion did not finish.*convert SRC_FOLDER"
    ):
        HDF5ImageDataset(copy)


def _no_decoding(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("decoding started before the check")

    monkeypatch.setattr(folder_mod, "load_canvas", refuse)


def test_a_file_name_that_is_not_utf8_is_refused_before_decoding(jpeg_folder, tmp_path, monkeypatch):
    root = tmp_path / "src"
    shutil.copytree(jpeg_folder, root)
    raw = os.path.join(os.fsencode(root / "class_02"), b"caf\xe9.jpg")
    shutil.copyfile(os.fsencode(root / "class_02" / "img_000002.jpg"), raw)
    _no_decoding(monkeypatch)
    with pytest.raises(ValueError, match=r"caf\\xe9\.jpg.* not valid UTF-8.*rename"):
        convert_folder_to_hdf5(root, tmp_path / "o.h5", 8, workers=1, progress=False)
    assert not list(tmp_path.glob("o.h5*"))


def test_free_space_is_checked_before_decoding(jpeg_folder, tmp_path, monkeypatch):
    _no_decoding(monkeypatch)
    real = shutil.disk_usage

    def nearly_full(path):
        return real(path)._replace(free=100_000)

    monkeypatch.setattr(shutil, "disk_usage", nearly_full)
    with pytest.raises(OSError, match=r"o\.h5.* needs about ([\d,]+) bytes, 100,000 are free") as info:
        convert_folder_to_hdf5(jpeg_folder, tmp_path / "o.h5", 64, workers=1, progress=False)
    needed = int(re.search(r"about ([\d,]+) bytes", str(info.value)).group(1).replace(",", ""))
    assert 48 * 64 * 96 * 3 < needed < 48 * 64 * 96 * 3 + (2 << 20)  # the canvases and a little more
    assert not list(tmp_path.glob("o.h5*"))


_LIMITED = """
import errno, os, resource, signal, sys
from lightning_gpuopt.data import convert
from lightning_gpuopt.data import folder
decoded = []
def load_canvas(*a, _real=folder.load_canvas, **k):
    print("DECODED")
    decoded.append(1)
    return _real(*a, **k)
folder.load_canvas = load_canvas
if sys.argv[3] in ("ulimit", "layout"):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (150_000, 150_000))
    if sys.argv[3] == "layout":  # past the check: HDF5's own writes fail while it lays the file out
        convert._check_free_space = lambda dest, needed: None
else:  # the disk fills up after the first images were written
    real = os.pwrite
    def pwrite(fd, data, offset):
        if len(decoded) > 5:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)
    os.pwrite = pwrite
try:
    convert.convert_folder_to_hdf5(sys.argv[1], sys.argv[2], 32, workers=1, progress=False)
except OSError as err:
    print(f"OSError: {err}")
    sys.exit(3)
"""


@pytest.mark.parametrize("failure", ["ulimit", "layout", "disk full midway"])
def test_write_failures_are_clean_errors(jpeg_folder, tmp_path, failure):
    out = tmp_path / "o.h5"
    res = subprocess.run(
        [sys.executable, "-c", _LIMITED, str(jpeg_folder), str(out), failure.split()[0]],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert res.returncode == 3, res.stdout + res.stderr  # an exception, not a crash at exit
    if failure == "ulimit":  # known before decoding
        assert "ulimit -f" in res.stdout and "o.h5" in res.stdout and "DECODED" not in res.stdout
    elif failure == "layout":  # HDF5 could not write the file: the same one-line error, no RuntimeError
        assert "writing" in res.stdout and "o.h5.tmp-" in res.stdout and "too large" in res.stdout
        assert "DECODED" not in res.stdout and "RuntimeError" not in res.stdout + res.stderr
    else:
        assert "writing" in res.stdout and "o.h5.tmp-" in res.stdout and "No space left" in res.stdout
        assert "DECODED" in res.stdout
    assert not list(tmp_path.glob("o.h5*"))


def test_convert_onto_a_symlink_replaces_its_target(jpeg_folder, tmp_path):
    real_dir = tmp_path / "stores"
    real_dir.mkdir()
    target = real_dir / "train_v1.h5"
    convert_folder_to_hdf5(jpeg_folder, target, 8, workers=1, progress=False)
    link = tmp_path / "train.h5"
    link.symlink_to(target)
    first = HDF5ImageDataset(link).uuid
    convert_folder_to_hdf5(jpeg_folder, link, 12, workers=1, progress=False, overwrite=True)
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert HDF5ImageDataset(target).storage_size == 12 and HDF5ImageDataset(target).uuid != first
    assert not list(tmp_path.glob("*.tmp-*")) and not list(real_dir.glob("*.tmp-*"))


def test_a_read_only_destination_fails_before_decoding(jpeg_folder, tmp_path, monkeypatch):
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    if os.geteuid() == 0:  # root ignores permission bits, not the immutable attribute
        if subprocess.run(["chattr", "+i", str(readonly)], capture_output=True).returncode != 0:
            pytest.skip("running as root and chattr +i is unavailable here")
    else:
        readonly.chmod(0o555)
    _no_decoding(monkeypatch)
    try:
        with pytest.raises(PermissionError, match=r"cannot create files in .*readonly.*writable folder"):
            convert_folder_to_hdf5(jpeg_folder, readonly / "o.h5", 8, workers=2, progress=False)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(readonly)], check=True)
        readonly.chmod(0o755)
    assert not list(readonly.iterdir())


def test_cli_convert(jpeg_folder, tmp_path, capsys):
    out = tmp_path / "cli.h5"
    argv = ["convert", str(jpeg_folder), str(out), "--size", "12", "--workers", "1", "--no-progress"]
    assert cli_main(argv) == 0
    assert "48 images, stored at 12 px" in capsys.readouterr().out
    assert HDF5ImageDataset(out).image_shape == (12, 18, 3)
    assert cli_main(argv) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert cli_main([*argv, "--overwrite"]) == 0


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--size", "0"], "--size must be a positive number of pixels"),
        (["--workers", "-1"], "--workers must be 0 or more"),
        ([], "already exists; pass --overwrite or another name"),
    ],
)
def test_cli_errors_speak_of_flags(jpeg_folder, tmp_path, capsys, flags, expected):
    out = tmp_path / "o.h5"
    out.write_bytes(b"keep me")
    assert cli_main(["convert", str(jpeg_folder), str(out), "--no-progress", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lightning-gpuopt convert: error: ") and expected in err, err
    assert len(err.splitlines()) == 1
    assert not any(word in err for word in ("storage_size", "overwrite=", "workers must be None"))
    assert out.read_bytes() == b"keep me"


def test_cli_decode_error_suggests_the_flag(jpeg_folder, tmp_path, capsys):
    root = _copy_with_corrupt(tmp_path, jpeg_folder)
    assert cli_main(["convert", str(root), str(tmp_path / "o.h5"), "--workers", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "img_000010.jpg" in err and "--on-corrupt skip" in err and "on_corrupt=" not in err
    assert len(err.strip().splitlines()) == 1


# -- signals: a conversion held mid-way by a FIFO among the images (its decode blocks until written) --


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def _wait_until(check, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def _is_janitor(pid: int) -> bool:
    try:
        return b"os.unlink" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


class _HeldConversion:
    """``convert`` in a subprocess with two decode workers, one of them blocked on a FIFO, and its janitor."""

    def __init__(self, tmp_path: Path, jpeg_folder: Path, cli: bool = False) -> None:
        self.src = Path(shutil.copytree(jpeg_folder, tmp_path / "src"))
        os.mkfifo(self.src / "class_00" / "aaa_blocks.jpg")
        self.out = tmp_path / "o.h5"
        if cli:
            cmd = [sys.executable, "-m", "lightning_gpuopt", "convert", str(self.src), str(self.out)]
            cmd += ["--size", "16", "--workers", "2", "--no-progress"]
        else:
            script = (
                "import sys\nfrom lightning_gpuopt.data.convert import convert_folder_to_hdf5\n"
                "convert_folder_to_hdf5(sys.argv[1], sys.argv[2], 16, workers=2, progress=False)\n"
            )
            cmd = [sys.executable, "-c", script, str(self.src), str(self.out)]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=REPO)
        self.workers: list[int] = []
        self.janitor: list[int] = []

        def started() -> bool:
            kids = _children(self.proc.pid)
            self.janitor = [p for p in kids if _is_janitor(p)]
            self.workers = [p for p in kids if p not in self.janitor]
            return bool(list(tmp_path.glob("o.h5.tmp-*"))) and len(self.workers) >= 2 and bool(self.janitor)

        assert _wait_until(started) and self.proc.poll() is None, "the conversion did not start"
        time.sleep(0.3)  # the other worker decodes the rest; the converter waits for the blocked block

    def finish(self) -> tuple[int, str]:
        _, err = self.proc.communicate(timeout=60)
        return self.proc.returncode, err

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()
        for pid in self.workers + self.janitor:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_sigkill_leaves_no_worker_and_no_temp(jpeg_folder, tmp_path):
    held = _HeldConversion(tmp_path, jpeg_folder)
    try:
        held.proc.send_signal(signal.SIGKILL)
        held.finish()
        everyone = held.workers + held.janitor
        assert _wait_until(lambda: all(_gone(p) for p in everyone), timeout=10), "a process survived"
        assert not list(tmp_path.glob("o.h5*"))  # the janitor removed the temporary file
    finally:
        held.cleanup()


def test_temps_of_dead_conversions_are_removed_by_the_next_one(jpeg_folder, tmp_path):
    # what a SIGKILL of the converter and its janitor together (a killed process group) leaves
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = tmp_path / f"o.h5.tmp-{int(dead.stdout)}"
    stale.write_bytes(b"half a store")
    alive = tmp_path / f"o.h5.tmp-{os.getppid()}"  # a conversion still running (its process exists)
    alive.write_bytes(b"in progress")
    convert_folder_to_hdf5(jpeg_folder, tmp_path / "o.h5", 8, workers=1, progress=False)
    assert not stale.exists() and alive.exists()


def test_sigterm_stops_the_workers_and_removes_the_temp(jpeg_folder, tmp_path):
    held = _HeldConversion(tmp_path, jpeg_folder)
    try:
        held.proc.send_signal(signal.SIGTERM)
        code, _ = held.finish()
        assert code == -signal.SIGTERM  # still ends as killed by SIGTERM, after cleaning up
        assert _wait_until(lambda: all(_gone(p) for p in held.workers + held.janitor), timeout=10)
        assert not list(tmp_path.glob("o.h5*"))
    finally:
        held.cleanup()


def test_ctrl_c_in_the_cli_stops_the_workers_and_prints_one_line(jpeg_folder, tmp_path):
    held = _HeldConversion(tmp_path, jpeg_folder, cli=True)
    try:
        held.proc.send_signal(signal.SIGINT)
        code, err = held.finish()
        assert code == 130 and "interrupted" in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1
        assert _wait_until(lambda: all(_gone(p) for p in held.workers + held.janitor), timeout=10)
        assert not list(tmp_path.glob("o.h5*"))
    finally:
        held.cleanup()


def test_a_worker_that_dies_in_the_cli_exits_1_with_the_flag_to_find_the_image(jpeg_folder, tmp_path):
    held = _HeldConversion(tmp_path, jpeg_folder, cli=True)
    try:
        for pid in held.workers:
            os.kill(pid, signal.SIGKILL)
        code, err = held.finish()
        assert code == 1, err
        line = err.strip()
        assert line.startswith("lightning-gpuopt convert: error: a decode worker")
        assert len(line.splitlines()) == 1
        assert "--workers 1" in line and "workers=1" not in line and "was not written" in line
        assert not list(tmp_path.glob("o.h5*")) and not list(tmp_path.glob(".o.h5.lock"))
    finally:
        held.cleanup()


def test_a_worker_that_dies_is_an_error_not_a_hang(jpeg_folder, tmp_path):
    held = _HeldConversion(tmp_path, jpeg_folder)
    try:
        for pid in held.workers:  # the decode workers only
            os.kill(pid, signal.SIGKILL)
        code, err = held.finish()
        assert code == 1 and "decode worker" in err and "died" in err
        assert not list(tmp_path.glob("o.h5*"))
    finally:
        held.cleanup()
