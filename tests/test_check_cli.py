"""``lightning-gpuopt check DIR``: every unreadable image listed at once, exit 1; exit 0 on a clean folder; the
folder's own errors in one line, exit 2. ``check_image_folder`` fails exactly the images training fails."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from lightning_gpuopt.cli import main
from lightning_gpuopt.data.folder import (
    UnreadableImagesError,
    check_image_folder,
    load_canvas,
    scan_image_folder,
)
from tests._cli import (
    one_error_line,
    own_cache,  # noqa: F401 - the autouse fixture
)


def _folder(root, n=12):
    for i in range(n):
        path = root / f"class_{i % 3}" / f"{i:02d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (90, 120, 3), dtype=np.uint8)).save(path)
    return root


def _damage(root):
    """Three kinds of bad file: truncated, not an image at all, a hole of 0xff bytes in the entropy data."""
    truncated, text, hole = (
        root / "class_1" / "04.jpg",
        root / "class_2" / "08.jpg",
        root / "class_0" / "06.jpg",
    )
    truncated.write_bytes(truncated.read_bytes()[:900])
    text.write_bytes(b"not an image")
    data = bytearray(hole.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = b"\xff" * 64
    hole.write_bytes(bytes(data))
    return [hole, truncated, text]  # in file order


def test_check_lists_every_unreadable_image_and_exits_1(tmp_path, capsys):
    root = _folder(tmp_path / "data")
    bad = _damage(root)
    assert main(["check", str(root)]) == 1
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert [line.partition(": ")[0] for line in lines] == [str(p) for p in bad]
    assert "OSError: image file is truncated" in lines[1]
    assert "UnidentifiedImageError: cannot identify image file" in lines[2]
    line = one_error_line(err, "check")
    assert f"3 of 12 images in {str(root)!r} cannot be decoded (listed above)" in line


def test_check_exits_0_on_a_clean_folder_and_2_on_a_folder_that_is_not_one(tmp_path, capsys):
    root = _folder(tmp_path / "data")
    assert main(["check", str(root), "--threads", "2"]) == 0
    assert capsys.readouterr().out.startswith(f"12 images in {str(root)!r} decode (")
    assert main(["check", str(tmp_path / "missing")]) == 2
    assert "does not exist" in one_error_line(capsys.readouterr().err, "check")
    assert main(["check", str(root), "--threads", "0"]) == 2
    assert "--threads must be 1 or more, got 0" in one_error_line(capsys.readouterr().err, "check")


def test_the_check_fails_exactly_the_images_training_fails(tmp_path):
    root = _folder(tmp_path / "data")
    _damage(root)
    with pytest.raises(UnreadableImagesError) as raised:
        check_image_folder(root, threads=2)
    checked = {e.path for e in raised.value.errors}
    failing = set()
    for path, _ in scan_image_folder(root)[1]:
        try:
            load_canvas(path, 256)
        except ValueError:
            failing.add(path)
    assert checked == failing and len(failing) == 3
    assert raised.value.images == 12
