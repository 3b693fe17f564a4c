"""Fixtures of the fault-injection suite: source folders, reference stores and the convert command line.

Every case runs ``lightning-gpuopt convert`` or a Lightning fit as a child process (``sys.executable``), puts
it under a fault (a signal at a chosen point, a full or read-only filesystem, a swapped store) and checks
what is left afterwards. The summary at the end of the run counts the cases of each group that hold.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.faults._helpers import OLD_SIZE, SIZE, read_store


@dataclass(frozen=True)
class Sources:
    """The suite's source folders and the conversions it compares against."""

    root: Path
    main: Path  # the folder the kill and disk cases convert
    small: Path  # a few images: an older store to overwrite, a store to swap in
    other: Path  # as many images as ``small``, of the same sizes, other pixels
    scan: Path  # thousands of hard links: a long scan
    reference: dict  # read_store of main converted at SIZE
    reference_bytes: int  # file size of that store
    old_store: Path  # small converted at OLD_SIZE: the "existing OUT" of the overwrite cases


@pytest.fixture(scope="package")
def sources(tmp_path_factory) -> Sources:
    from lightning_gpuopt.bench.synthetic import make_jpeg_folder
    from lightning_gpuopt.data.convert import convert_folder_to_hdf5

    root = tmp_path_factory.mktemp("faults_sources")
    main = make_jpeg_folder(root / "main", num_images=320, num_classes=4, image_size=(160, 120), workers=1)
    small = make_jpeg_folder(root / "small", num_images=20, num_classes=2, image_size=(96, 64), workers=1)
    other = make_jpeg_folder(
        root / "other", num_images=20, num_classes=2, image_size=(96, 64), seed=500, workers=1
    )
    scan = root / "scan"
    first = next(iter(sorted((main / "class_00").glob("*.jpg"))))
    for c in range(3):
        (scan / f"c{c}").mkdir(parents=True)
        for i in range(4000):
            os.link(first, scan / f"c{c}" / f"i{i:05d}.jpg")
    ref_path = root / "reference.h5"
    convert_folder_to_hdf5(main, ref_path, SIZE, workers=0, progress=False)
    old = root / "old.h5"
    convert_folder_to_hdf5(small, old, OLD_SIZE, workers=0, progress=False)
    return Sources(root, main, small, other, scan, read_store(ref_path), ref_path.stat().st_size, old)


@dataclass(frozen=True)
class FitData:
    """What the fit cases train on: an image folder and the same images as a store."""

    folder: Path
    store: Path


@pytest.fixture(scope="package")
def fit_data(tmp_path_factory) -> FitData:
    from lightning_gpuopt._common import eval_resize_size
    from lightning_gpuopt.bench.synthetic import make_jpeg_folder
    from lightning_gpuopt.data.convert import convert_folder_to_hdf5

    root = tmp_path_factory.mktemp("faults_fit")
    folder = make_jpeg_folder(root / "folder", num_images=64, num_classes=4, image_size=(64, 48), workers=1)
    store = root / "store.h5"
    convert_folder_to_hdf5(folder, store, eval_resize_size(32), workers=0, progress=False)
    return FitData(folder, store)


@pytest.fixture
def short_tmp() -> Path:
    """A ``TMPDIR`` for a fit child, short enough that its DataLoader workers' sockets fit in their loader's
    folder (AF_UNIX paths are short; pytest's ``tmp_path`` is too long for that, and the workers would then
    keep ``multiprocessing``'s own folders)."""
    d = Path(tempfile.mkdtemp(prefix="f-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def case_dir(tmp_path) -> Path:
    """A folder of this case alone; its path is the token that finds the case's processes in ``/proc``."""
    d = tmp_path / "case"
    d.mkdir()
    yield d
    # a case that failed may leave a read-only folder: make it removable again
    for p in [d, *d.rglob("*")]:
        if p.is_dir() and not p.is_symlink():
            p.chmod(0o755)


# -- the count the run reports ----------------------------------------------------------------------------

_OUTCOMES: dict[str, Counter] = {}


def pytest_runtest_logreport(report) -> None:
    if "tests/faults/" not in report.nodeid.replace(os.sep, "/"):
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        group = report.nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py").removeprefix("test_")
        _OUTCOMES.setdefault(group, Counter())[report.outcome] += 1


def pytest_terminal_summary(terminalreporter) -> None:
    if not _OUTCOMES:
        return
    total = Counter()
    terminalreporter.section("fault injection")
    for group, counts in sorted(_OUTCOMES.items()):
        total.update(counts)
        ran = counts["passed"] + counts["failed"]
        extra = f", {counts['skipped']} skipped" if counts["skipped"] else ""
        terminalreporter.write_line(f"{group}: {counts['passed']}/{ran} hold{extra}")
    ran = total["passed"] + total["failed"]
    verdict = "all hold" if total["failed"] == 0 else f"{total['failed']} fail"
    terminalreporter.write_line(
        f"{ran} cases, {verdict}" + (f" ({total['skipped']} skipped)" if total["skipped"] else "")
    )
