import multiprocessing as mp
import pickle

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from lightning_gpuopt.data.folder import UInt8ImageFolder, load_uint8_image, scan_image_folder


def _write(path, arr):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)


def test_scan_sorted_and_ignores_root_files(jpeg_folder):
    classes, samples = scan_image_folder(jpeg_folder)
    assert classes == ["class_00", "class_01", "class_02"]
    assert len(samples) == 48
    assert [p for p, _ in samples] == sorted(p for p, _ in samples)  # sorted within and across classes
    assert {label for _, label in samples} == {0, 1, 2}
    assert all("lightning_gpuopt_synthetic.json" not in p for p, _ in samples)


def test_scan_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        scan_image_folder(tmp_path / "missing")
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        scan_image_folder(f)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no class subfolders"):
        scan_image_folder(empty)
    (empty / "cat").mkdir()
    with pytest.raises(ValueError, match="holds no images"):
        scan_image_folder(empty)
    _write(empty / "cat" / "a.png", np.zeros((4, 4, 3), np.uint8))
    (empty / "cat" / ".DS_Store").write_text("hidden files are ignored")
    assert len(scan_image_folder(empty)[1]) == 1
    (empty / "cat" / "notes.csv").write_text("a,b")
    with pytest.raises(ValueError, match=r"non-image.*notes\.csv"):
        scan_image_folder(empty)


def test_load_resizes_short_side_and_center_crops(tmp_path):
    # 40x20 image: left quarter red, middle half green, right quarter blue -> the center square is green
    arr = np.zeros((20, 40, 3), np.uint8)
    arr[:, :10, 0] = 255
    arr[:, 10:30, 1] = 255
    arr[:, 30:, 2] = 255
    _write(tmp_path / "a.png", arr)
    out = load_uint8_image(tmp_path / "a.png", 10)
    assert out.shape == (10, 10, 3) and out.dtype == np.uint8 and out.flags.writeable
    inner = out[
        :, 1:-1
    ]  # the bilinear filter blends the outer columns with their neighbours, as a full resize would
    assert inner[..., 1].min() == 255 and inner[..., 0].max() == 0 and inner[..., 2].max() == 0
    assert out[..., 1].min() > 200


def test_load_grayscale_and_large_jpeg(tmp_path):
    _write(tmp_path / "g.png", np.full((30, 30), 77, np.uint8))
    g = load_uint8_image(tmp_path / "g.png", 8)
    assert g.shape == (8, 8, 3) and (g == 77).all()
    # a JPEG 4x larger than needed goes through the reduced-scale (draft) decode; result must still be right
    big = np.zeros((256, 256, 3), np.uint8)
    big[:, 128:] = 200
    Image.fromarray(big).save(tmp_path / "big.jpg", quality=95)
    small = load_uint8_image(tmp_path / "big.jpg", 32)
    assert small.shape == (32, 32, 3)
    assert small[:, :12].mean() < 20 and small[:, 20:].mean() > 180


def test_corrupt_image_names_file(tmp_path):
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    with pytest.raises(ValueError, match=r"broken\.jpg.*on_corrupt='skip'"):
        load_uint8_image(bad, 8)


def test_dataset_items_and_pickle(jpeg_folder):
    ds = UInt8ImageFolder(jpeg_folder, size=16)
    assert len(ds) == 48 and ds.classes == ["class_00", "class_01", "class_02"]
    img, label = ds[5]
    assert img.shape == (16, 16, 3) and img.dtype == np.uint8 and isinstance(label, int)
    clone = pickle.loads(pickle.dumps(ds))
    assert np.array_equal(clone[5][0], img)
    with pytest.raises(ValueError, match="on_corrupt"):
        UInt8ImageFolder(jpeg_folder, on_corrupt="ignore")


def test_spawn_workers(jpeg_folder):
    ds = UInt8ImageFolder(jpeg_folder, size=16)
    loader = DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context=mp.get_context("spawn"))
    labels = torch.cat([y for _, y in loader])
    assert sorted(labels.tolist()) == sorted(label for _, label in ds.samples)


def test_skip_corrupt_counts_in_workers(tmp_path):
    for i in range(6):
        _write(tmp_path / "data" / "a" / f"{i}.png", np.full((8, 8, 3), i * 10, np.uint8))
    (tmp_path / "data" / "a" / "3.png").write_bytes(b"garbage")
    ds = UInt8ImageFolder(tmp_path / "data", size=8)
    with pytest.raises(ValueError, match=r"3\.png"):
        ds[3]
    ds = UInt8ImageFolder(tmp_path / "data", size=8, on_corrupt="skip", skip_log=tmp_path / "log")
    img, _ = ds[3]
    assert (img == 40).all()  # replaced by the next readable image
    loader = DataLoader(ds, batch_size=3, num_workers=2)
    assert sum(len(y) for _, y in loader) == 6  # batches keep their size
    skipped = ds.skipped()
    assert len(skipped) == 2 and all(p.endswith("3.png") for p in skipped)  # main process + one worker
