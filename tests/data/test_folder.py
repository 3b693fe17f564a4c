import multiprocessing as mp
import os
import pickle

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from lightning_gpuopt._common import available_cpus, eval_resize_size
from lightning_gpuopt.data import layout
from lightning_gpuopt.data.datamodule import OptimizedDataModule
from lightning_gpuopt.data.folder import UInt8ImageFolder, load_canvas, scan_image_folder
from lightning_gpuopt.data.loader import BatchReader, UInt8Collate
from tests.data._images import natural as _natural


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
    (empty / "dog").mkdir()
    (empty / "dog" / "notes.txt").write_text("no images here")
    with pytest.raises(ValueError, match=r"dog' holds no images \(only other files, e\.g\. .*notes\.txt'\)"):
        scan_image_folder(empty)


def test_non_image_files_are_skipped_with_one_warning_that_lists_them(tmp_path):
    """As torchvision's ImageFolder: files that are not images (by extension, any case) are left out."""
    root = tmp_path / "data"
    for name in ("cat/a.png", "cat/b.JPG", "cat/deep/c.Jpeg", "dog/d.png"):
        _write(root / name, np.zeros((4, 4, 3), np.uint8))
    (root / "cat" / "notes.txt").write_text("a note")
    (root / "dog" / "labels.csv").write_text("a,b")
    with pytest.warns(UserWarning) as said:
        classes, samples = scan_image_folder(root)
    assert classes == ["cat", "dog"]
    found = [os.path.relpath(p, root) for p, _ in samples]
    assert found == ["cat/a.png", "cat/b.JPG", "cat/deep/c.Jpeg", "dog/d.png"]
    messages = [str(w.message) for w in said if "not images" in str(w.message)]
    assert len(messages) == 1, messages
    assert "skipped 2 file(s) that are not images: 'cat/notes.txt', 'dog/labels.csv'" in messages[0]
    assert len(UInt8ImageFolder(root, size=8)) == 4


def _torchvision_eval(path, image_size):
    """torchvision's evaluation transform on a PIL image: Resize(eval_resize_size) + CenterCrop, as uint8."""
    with Image.open(path) as img:
        rgb = img.convert("RGB")
    width, height = rgb.size
    size = eval_resize_size(image_size)
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(size * long / short)
    rw, rh = (size, new_long) if width <= height else (new_long, size)
    resized = np.asarray(rgb.resize((rw, rh), Image.Resampling.BILINEAR))
    top, left = round((rh - image_size) / 2.0), round((rw - image_size) / 2.0)
    return resized[top : top + image_size, left : left + image_size]


def test_validation_pixels_match_torchvision_end_to_end(tmp_path):
    # 4:3, 3:4, 3:2 and a large 4:3 JPEG (decoded at a reduced DCT scale first)
    sizes = [(320, 240), (240, 320), (360, 240), (1280, 960)]
    paths = []
    for i, (w, h) in enumerate(sizes):
        path = tmp_path / "data" / "a" / f"{i}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        _natural(w, h, seed=i).save(path, quality=92)
        paths.append(path)
    image_size = 112
    dm = OptimizedDataModule(
        val_dir=tmp_path / "data", batch_size=len(sizes), num_workers=0, image_size=image_size
    )
    dm.setup("validate")
    batch = next(iter(dm.val_dataloader()))
    images, labels = dm.on_after_batch_transfer(batch, 0)  # no trainer: the evaluation transform
    assert images.shape == (len(sizes), 3, image_size, image_size) and labels.tolist() == [0] * len(sizes)
    mean, std = torch.tensor(dm.mean).view(1, 3, 1, 1), torch.tensor(dm.std).view(1, 3, 1, 1)
    pixels = (images * std + mean) * 255
    for i, path in enumerate(paths):
        expected = torch.from_numpy(_torchvision_eval(path, image_size).copy()).permute(2, 0, 1).float()
        mad = (pixels[i] - expected).abs().mean().item()
        assert mad <= 2.0, (sizes[i], mad)  # 2/255 on the 0..1 scale
        if max(sizes[i]) < 1000:  # decoded at full scale: PIL's bilinear weights, so within a level
            assert mad < 0.05 and (pixels[i] - expected).abs().max().item() <= 1.01, (sizes[i], mad)


def test_load_canvas_keeps_the_whole_image(tmp_path):
    # 40x30 landscape: left quarter red, middle half green, right quarter blue; nothing may be cut off
    arr = np.zeros((30, 40, 3), np.uint8)
    arr[:, :10, 0] = 255
    arr[:, 10:30, 1] = 255
    arr[:, 30:, 2] = 255
    _write(tmp_path / "a.png", arr)
    canvas, meta = load_canvas(tmp_path / "a.png", 12)
    assert canvas.shape == (*layout.canvas_shape(12), 3) and canvas.dtype == np.uint8
    assert meta.tolist() == [12, 16, 0] and meta.dtype == np.int32
    image = canvas[:12, :16]
    assert image[:, :2, 0].min() > 200 and image[:, -2:, 2].min() > 200  # both outer quarters are kept
    assert (canvas[:, 16:] == 0).all() and (canvas[12:] == 0).all()
    # a portrait image is stored transposed, with the same pixels
    _write(tmp_path / "p.png", np.ascontiguousarray(arr.transpose(1, 0, 2)))
    pcanvas, pmeta = load_canvas(tmp_path / "p.png", 12)
    assert pmeta.tolist() == [12, 16, 1]
    np.testing.assert_array_equal(pcanvas, canvas)


def test_load_canvas_16_bit_png_is_scaled_not_clipped(tmp_path):
    gradient = np.linspace(0, 65535, 24).round().astype(np.uint16)
    arr = np.tile(gradient, (16, 1))  # 24 x 16: stored as it is at storage size 16
    Image.fromarray(arr).save(tmp_path / "g16.png")
    with Image.open(tmp_path / "g16.png") as img:
        assert img.mode.startswith("I")  # 16-bit grey
    canvas, meta = load_canvas(tmp_path / "g16.png", 16)
    assert meta.tolist() == [16, 24, 0]
    expected = (arr / 257).round().astype(np.uint8)
    for c in range(3):
        np.testing.assert_array_equal(canvas[:16, :24, c], expected)


def test_load_canvas_grayscale_and_large_jpeg(tmp_path):
    _write(tmp_path / "g.png", np.full((30, 30), 77, np.uint8))
    g, meta = load_canvas(tmp_path / "g.png", 8)
    assert meta.tolist() == [8, 8, 0] and (g[:8, :8] == 77).all()
    # a JPEG 4x larger than needed goes through the reduced-scale (draft) decode; geometry must still be right
    big = np.zeros((256, 384, 3), np.uint8)
    big[:, 192:] = 200
    Image.fromarray(big).save(tmp_path / "big.jpg", quality=95)
    small, meta = load_canvas(tmp_path / "big.jpg", 32)
    assert meta.tolist() == [32, 48, 0]
    assert small[:32, :22].mean() < 20 and small[:32, 26:48].mean() > 180


def test_corrupt_image_names_file(tmp_path):
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    with pytest.raises(ValueError, match=r"broken\.jpg.*on_corrupt='skip'"):
        load_canvas(bad, 8)


def test_dataset_items_and_pickle(jpeg_folder):
    ds = UInt8ImageFolder(jpeg_folder, size=16)
    assert len(ds) == 48 and ds.classes == ["class_00", "class_01", "class_02"]
    assert ds.storage_size == 16
    img, label, meta = ds[5]
    assert img.shape == (16, 24, 3) and img.dtype == np.uint8 and isinstance(label, int)
    assert meta.tolist() == [16, 21, 0]  # the 64x48 JPEGs, shorter side 16
    clone = pickle.loads(pickle.dumps(ds))
    assert np.array_equal(clone[5][0], img)
    with pytest.raises(ValueError, match="on_corrupt"):
        UInt8ImageFolder(jpeg_folder, on_corrupt="ignore")
    with pytest.raises(ValueError, match=r"size must be an int >= 1 \(pixels\)"):
        UInt8ImageFolder(jpeg_folder, size=0)


def test_spawn_workers(jpeg_folder):
    ds = UInt8ImageFolder(jpeg_folder, size=16)
    loader = DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context=mp.get_context("spawn"))
    labels = torch.cat([b[1] for b in loader])
    assert sorted(labels.tolist()) == sorted(label for _, label in ds.samples)


def test_skip_corrupt_counts_in_workers(tmp_path):
    for i in range(6):
        _write(tmp_path / "data" / "a" / f"{i}.png", np.full((8, 8, 3), i * 10, np.uint8))
    (tmp_path / "data" / "a" / "3.png").write_bytes(b"garbage")
    ds = UInt8ImageFolder(tmp_path / "data", size=8)
    with pytest.raises(ValueError, match=r"3\.png"):
        ds[3]
    ds = UInt8ImageFolder(tmp_path / "data", size=8, on_corrupt="skip", skip_log=tmp_path / "log")
    img, _, _ = ds[3]
    assert (img[:8, :8] == 40).all()  # replaced by the next readable image
    loader = DataLoader(ds, batch_size=3, num_workers=2, collate_fn=UInt8Collate())
    assert sum(len(b[1]) for b in loader) == 6  # batches keep their size
    skipped = ds.skipped()
    assert len(skipped) == 2 and all(p.endswith("3.png") for p in skipped)  # main process + one worker


def test_an_unreadable_folder_is_named_as_unreadable(jpeg_folder, monkeypatch):
    import os

    real = os.scandir
    refused = {str(jpeg_folder / "class_01")}

    def scandir(path="."):
        if os.fspath(path) in refused:
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)  # os.walk lists folders through os.scandir
    with pytest.raises(PermissionError, match=r"cannot read folder '.*class_01' \(Permission denied\); give"):
        scan_image_folder(jpeg_folder)
    refused.add(str(jpeg_folder))
    with pytest.raises(PermissionError, match=r"cannot read folder '.*jpegs\d*' \(Permission denied\)"):
        scan_image_folder(jpeg_folder)


def _mixed_folder(root):
    """JPEGs of several sizes and aspects, a grey JPEG, a CMYK JPEG, a palette PNG and an RGBA PNG."""
    specs = [("a", "0.jpg", "RGB", (64, 48)), ("a", "1.jpg", "RGB", (30, 52)), ("a", "2.jpg", "L", (40, 40)),
             ("b", "3.jpg", "CMYK", (50, 36)), ("b", "4.png", "P", (28, 36)), ("b", "5.png", "RGBA", (90, 60))]
    for i, (cls, name, mode, size) in enumerate(specs):
        path = root / cls / name
        path.parent.mkdir(parents=True, exist_ok=True)
        _natural(*size, seed=i).convert(mode).save(path)
    return root


def test_read_into_fills_the_rows_as_getitem_does(tmp_path):
    ds = UInt8ImageFolder(_mixed_folder(tmp_path / "data"), size=16)
    assert ds.image_shape == (16, 24, 3) and ds.auto_readers >= 1 and ds.read_in_workers
    order = [5, 0, 3, 2, 4, 1]
    images = np.full((len(order), *ds.image_shape), 7, np.uint8)  # stale bytes everywhere
    labels, meta = ds.read_into(order, images)
    for row, index in enumerate(order):
        canvas, label, m = ds[index]
        assert np.array_equal(images[row], canvas) and labels[row] == label and meta[row].tolist() == m.tolist()
    assert labels.dtype == np.int64 and meta.dtype == np.int32
    with pytest.raises(ValueError, match=r"read_into's images.*writable C-contiguous uint8"):
        ds.read_into([0, 1], np.zeros((2, 16, 24, 3), np.float32))


def test_reading_threads_feed_every_mode_and_skip_bad_files(tmp_path):
    from lightning_gpuopt.data.loader import HostDataLoader

    root = _mixed_folder(tmp_path / "data")
    (root / "b" / "6.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    ds = UInt8ImageFolder(root, size=16, on_corrupt="skip")
    loader = HostDataLoader(ds, batch_size=2, read_threads=3, shuffle=False)
    assert isinstance(ds, BatchReader) and loader.read_threads == 3 and loader.num_workers == 0
    batches = list(loader)
    assert [len(b[0]) for b in batches] == [2, 2, 2, 1]  # seven files, seven images
    labels = torch.cat([b[1] for b in batches]).tolist()
    assert labels == [0, 0, 0, 1, 1, 1, 0]  # 6.jpg replaced by the next readable image (0.jpg)
    assert [p.rsplit("/", 1)[-1] for p in ds.skipped()] == ["6.jpg"]
    grey = batches[1][0][0].numpy()  # 2.jpg, grey: three equal channels
    assert (grey[..., 0] == grey[..., 1]).all() and (grey[..., 1] == grey[..., 2]).all()
    strict = HostDataLoader(UInt8ImageFolder(root, size=16), batch_size=2, read_threads=2, shuffle=False)
    with pytest.raises(ValueError, match=r"6\.jpg.*on_corrupt='skip'"):
        list(strict)


@pytest.mark.parametrize("size", [(500, 375), (375, 500), (37, 29), (640, 64)])
def test_resize_keeps_pils_bilinear_within_a_level(size):
    from lightning_gpuopt.data.folder import _resized

    image = _natural(*size, seed=3)
    for target in (layout.resized_size(*size, 256), layout.resized_size(*size, 24)):
        ours = _resized(image, target, None).astype(int)
        pil = np.asarray(image.resize(target, Image.Resampling.BILINEAR)).astype(int)
        assert ours.shape == pil.shape == (target[1], target[0], 3)
        assert np.abs(ours - pil).max() <= 1 and np.abs(ours - pil).mean() < 0.05, (size, target)


def test_datamodule_reads_a_folder_in_workers_a_batch_a_call(jpeg_folder, caplog):
    """The choice is stated in the split's setup line, which says it was chosen from the cores, not
    measured (the line comes with the loader, beside the split's other counts and its staging)."""
    import logging

    dm = OptimizedDataModule(jpeg_folder, batch_size=8, num_workers="auto", image_size=16)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        dm.setup("fit")
        loader = dm.train_dataloader()
    line = f"OptimizedDataModule: train: image folder; num_workers={dm.num_workers} (one a CPU: chosen from "
    assert line in caplog.text and "not measured" in caplog.text
    assert dm.tuning_result is None  # nothing measured: a worker a CPU
    assert loader.num_workers == dm.num_workers == min(UInt8ImageFolder(jpeg_folder).auto_readers,
                                                       available_cpus()) and loader.read_threads == 0
    assert loader.feed_info.num_workers == dm.num_workers and loader.feed_info.decoder == "cpu"
    images, labels, meta = next(iter(loader))
    assert images.shape == (8, 18, 27, 3) and images.dtype == torch.uint8  # storage size 18 at 16


def test_workers_read_whole_batches_as_the_main_process_reads_them(jpeg_folder):
    from lightning_gpuopt.data.loader import HostDataLoader, ReadBatch, UInt8Collate, WholeBatches, read_batch

    ds = UInt8ImageFolder(jpeg_folder, size=18)
    whole = WholeBatches(ds)
    assert isinstance(whole.__getitems__([0, 1, 2, 3]), ReadBatch) and whole.image_shape == ds.image_shape
    assert len(whole) == len(ds) and whole[1][1] == ds[1][1]
    loader = HostDataLoader(whole, batch_size=4, num_workers=2, collate_fn=UInt8Collate("folder"))
    for start, (images, labels, meta) in zip(range(0, len(ds) - 3, 4), loader, strict=False):
        expected = read_batch(ds, list(range(start, start + 4)))
        assert torch.equal(images, expected[0]) and torch.equal(labels, expected[1])
        assert torch.equal(meta, expected[2]) and images.dtype == torch.uint8 and labels.dtype == torch.int64
