"""Bad input meets a one-line error that names it, before any work is spent.

The command (``lightning_gpuopt.cli.main``, in this process) must return a non-zero code with one error line
on stderr naming the path or argument; the Python API must raise the documented exception naming it.
``docs/reliability.md`` lists each input with the error users get.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.faults._helpers import OLD_SIZE

# case -> (arguments after ``convert`` built from (src, tmp), what the error line must name)
CLI_CASES = {
    "source missing": (lambda s, t: [t / "missing", t / "o.h5"], lambda s, t: t / "missing"),
    "source is a file": (
        lambda s, t: [s / "class_00" / "img_000000.jpg", t / "o.h5"],
        lambda s, t: "img_000000.jpg",
    ),
    "source without class folders": (lambda s, t: [t / "empty", t / "o.h5"], lambda s, t: t / "empty"),
    "class folder without images": (lambda s, t: [t / "noimg", t / "o.h5"], lambda s, t: t / "noimg" / "b"),
    "corrupt image": (lambda s, t: [t / "bad", t / "o.h5", "--workers", "1"], lambda s, t: "broken.jpg"),
    "non-UTF-8 file name": (lambda s, t: [t / "latin", t / "o.h5"], lambda s, t: t / "latin"),
    "output exists": (lambda s, t: [s, t / "exists.h5"], lambda s, t: t / "exists.h5"),
    "output folder missing": (lambda s, t: [s, t / "nowhere" / "o.h5"], lambda s, t: t / "nowhere"),
    "output is a folder": (lambda s, t: [s, t / "empty"], lambda s, t: t / "empty"),
    "size not positive": (lambda s, t: [s, t / "o.h5", "--size", "0"], lambda s, t: "size"),
    "workers negative": (lambda s, t: [s, t / "o.h5", "--workers", "-1"], lambda s, t: "workers"),
}


@pytest.fixture
def bad_inputs(sources, tmp_path) -> Path:
    """Folders and files for the bad-input cases, under ``tmp_path``."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "noimg" / "a").mkdir(parents=True)
    (tmp_path / "noimg" / "b").mkdir()
    shutil.copy(sources.small / "class_00" / "img_000000.jpg", tmp_path / "noimg" / "a")
    shutil.copytree(sources.small, tmp_path / "txt")
    (tmp_path / "txt" / "class_00" / "notes.txt").write_text("not an image")
    shutil.copytree(sources.small, tmp_path / "bad")
    data = (sources.small / "class_01" / "img_000001.jpg").read_bytes()
    (tmp_path / "bad" / "class_01" / "broken.jpg").write_bytes(data[: len(data) // 3])
    shutil.copytree(sources.small, tmp_path / "latin")
    shutil.copy(
        sources.small / "class_00" / "img_000000.jpg",
        os.path.join(os.fsencode(tmp_path / "latin" / "class_00"), b"caf\xe9.jpg"),
    )
    shutil.copyfile(sources.old_store, tmp_path / "exists.h5")
    return tmp_path


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_convert_bad_input(sources, bad_inputs, capsys, case):
    from lightning_gpuopt.cli import main

    make_args, named = CLI_CASES[case]
    argv = ["convert", *map(str, make_args(sources.small, bad_inputs)), "--no-progress"]
    code = main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("lightning-gpuopt convert: error:")]
    assert code not in (0, None), f"exit code {code}; stderr {err!r}"
    assert len(lines) == 1, f"want one error line: {err!r}"
    assert str(named(sources.small, bad_inputs)) in lines[0], lines[0]
    assert not list(bad_inputs.glob("*.tmp-*")) and not (bad_inputs / "o.h5").exists()


def test_convert_skips_a_non_image_file_with_one_warning(sources, bad_inputs, capsys):
    """As torchvision's ImageFolder: ``notes.txt`` in a class folder is left out, and said once."""
    from lightning_gpuopt.cli import main

    with pytest.warns(UserWarning, match=r"skipped 1 file\(s\) that are not images: 'class_00/notes\.txt'"):
        code = main(["convert", str(bad_inputs / "txt"), str(bad_inputs / "o.h5"), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    images = sum(1 for p in (sources.small).rglob("*.jpg"))
    assert f"{images} images" in capsys.readouterr().out


def _truncated(store: Path, out: Path) -> Path:
    data = store.read_bytes()
    out.write_bytes(data[: len(data) // 2])
    return out


def _foreign(out: Path) -> Path:
    import h5py

    with h5py.File(out, "w") as f:
        f["x"] = [1, 2, 3]
    return out


def _text(out: Path) -> Path:
    out.write_text("not HDF5")
    return out


# case -> (build the failing call from (sources, tmp), exception type, what the message must name)
API_CASES = {
    "store missing": ("dataset", lambda s, t: t / "missing.h5", FileNotFoundError),
    "store not HDF5": ("dataset", lambda s, t: _text(t / "text.h5"), ValueError),
    "HDF5 file not a store": ("dataset", lambda s, t: _foreign(t / "foreign.h5"), ValueError),
    "store truncated": ("dataset", lambda s, t: _truncated(s.old_store, t / "half.h5"), ValueError),
    "train_dir missing": ("datamodule", lambda s, t: {"train_dir": t / "missing"}, FileNotFoundError),
    "num_workers above 4 a CPU": (
        "datamodule",
        lambda s, t: {"train_dir": s.small, "num_workers": 10_000},
        ValueError,
    ),
    "store smaller than image_size": (
        "setup",
        lambda s, t: {"train_dir": s.old_store, "image_size": OLD_SIZE * 2},
        ValueError,
    ),
    "batch_size above the samples": (
        "setup",
        lambda s, t: {"train_dir": s.small, "batch_size": 64, "num_workers": 0},
        ValueError,
    ),
}
API_NAMES = {
    "store missing": "missing.h5",
    "store not HDF5": "text.h5",
    "HDF5 file not a store": "foreign.h5",
    "store truncated": "half.h5",
    "train_dir missing": "train_dir",
    "num_workers above 4 a CPU": "num_workers",
    "store smaller than image_size": "storage size",
    "batch_size above the samples": "batch_size",
}


@pytest.mark.parametrize("case", list(API_CASES))
def test_api_bad_input(sources, tmp_path, case):
    from lightning_gpuopt.data.datamodule import OptimizedDataModule
    from lightning_gpuopt.data.hdf5 import HDF5ImageDataset

    kind, build, error = API_CASES[case]
    arg = build(sources, tmp_path)
    with pytest.raises(error) as info:
        if kind == "dataset":
            HDF5ImageDataset(arg)
        elif kind == "datamodule":
            OptimizedDataModule(**arg)
        else:
            OptimizedDataModule(**arg).setup("fit")
    message = str(info.value)
    assert API_NAMES[case] in message and "\n" not in message, message
