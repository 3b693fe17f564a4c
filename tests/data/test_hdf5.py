import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

h5py = pytest.importorskip("h5py")

from lightning_gpuopt.cli import main as cli_main  # noqa: E402
from lightning_gpuopt.data.folder import load_uint8_image, scan_image_folder  # noqa: E402
from lightning_gpuopt.data.hdf5 import FORMAT, HDF5ImageDataset, convert_folder_to_hdf5  # noqa: E402
from tests._ddp import CloseProcessGroup  # noqa: E402
from tests._lightning import quiet_trainer  # noqa: E402


def _write_h5(path, images, labels, chunks=True, **kwargs):
    """A hand-made store (no converter): labels are the caller's choice, e.g. the sample index."""
    with h5py.File(path, "w") as f:
        ch = (1, *images.shape[1:]) if chunks is True else chunks
        f.create_dataset("images", data=images, chunks=ch, **kwargs)
        f.create_dataset("labels", data=labels)
    return path


def _index_store(path, n=40, size=6, **kwargs):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
    return _write_h5(path, images, np.arange(n, dtype=np.int64), **kwargs), images


@pytest.mark.parametrize(("chunk_images", "compression"), [(1, None), (4, "gzip"), (3, "lzf"), (5, None)])
def test_round_trip_pixels_and_metadata(jpeg_folder, tmp_path, chunk_images, compression):
    out = tmp_path / "d.h5"
    res = convert_folder_to_hdf5(
        jpeg_folder,
        out,
        size=20,
        chunk_images=chunk_images,
        compression=compression,
        workers=2,
        progress=False,
    )
    classes, samples = scan_image_folder(jpeg_folder)
    assert res.num_images == len(samples) == 48 and res.classes == classes and res.skipped == []
    assert out.is_file() and not list(tmp_path.glob("d.h5.tmp-*"))
    ds = HDF5ImageDataset(out)
    assert len(ds) == 48 and ds.classes == classes and ds.image_shape == (20, 20, 3)
    assert ds.raw_reads == (compression is None)
    assert ds.files() == [os.path.relpath(p, jpeg_folder) for p, _ in samples]
    attrs = ds.attrs()
    assert attrs["format"] == FORMAT and attrs["format_version"] == 1 and attrs["image_size"] == 20
    assert attrs["chunk_images"] == chunk_images and attrs["compression"] == (compression or "none")
    with h5py.File(out, "r") as f:
        assert f["images"].chunks == (chunk_images, 20, 20, 3) and f["images"].compression == compression
        assert f["labels"].dtype == np.int64
    for i, (path, label) in enumerate(samples):
        image, got_label = ds[i]
        assert image.dtype == np.uint8 and got_label == label
        np.testing.assert_array_equal(image, load_uint8_image(path, 20))  # the documented resize


@pytest.mark.parametrize("raw_reads", [True, False])
@pytest.mark.parametrize("chunks", [True, (4, 6, 6, 3), None])
def test_getitems_matches_getitem(tmp_path, raw_reads, chunks):
    path, images = _index_store(tmp_path / "s.h5", chunks=chunks)
    ds = HDF5ImageDataset(path, raw_reads=raw_reads)
    for idx in ([5, 3, 3, 39, -1, 20, 21, 22], list(range(40)), list(range(39, -1, -1)), [7], []):
        got = ds.__getitems__(idx)
        assert [label for _, label in got] == [i % 40 for i in idx]
        for i, (img, _) in zip(idx, got, strict=True):
            np.testing.assert_array_equal(img, images[i])
            np.testing.assert_array_equal(ds[i][0], images[i])
    with pytest.raises(IndexError, match="out of range"):
        ds.__getitems__([0, 40])
    with pytest.raises(IndexError):
        ds[-41]


@pytest.mark.parametrize("mmap_reads", [True, False])
@pytest.mark.parametrize("fancy_max", [0, 1 << 30])  # 0: recycled batch buffer; else: one fancy gather
def test_raw_read_paths_agree_and_items_stay_valid(tmp_path, monkeypatch, mmap_reads, fancy_max):
    import lightning_gpuopt.data.hdf5 as hdf5_mod

    monkeypatch.setattr(hdf5_mod, "_FANCY_MAX_BYTES", fancy_max)
    for chunks in (True, None):  # chunked (converter default) and contiguous files
        path, images = _index_store(tmp_path / f"m{chunks}.h5", chunks=chunks)
        ds = HDF5ImageDataset(path, mmap_reads=mmap_reads)
        assert ds.raw_reads and ds.mmap_reads == mmap_reads
        first = ds.__getitems__([3, 1, 1, 39])
        kept = first[0][0]
        assert kept.flags.writeable and kept.shape == (6, 6, 3)
        del first
        for _ in range(3):  # later batches must not overwrite an image still referenced
            second = ds.__getitems__([10, 11, 12, 13, 14])
        np.testing.assert_array_equal(kept, images[3])
        np.testing.assert_array_equal(np.stack([x for x, _ in second]), images[10:15])
        kept[:] = 0  # writing an item changes neither the file nor later reads
        np.testing.assert_array_equal(ds[3][0], images[3])
        np.testing.assert_array_equal(ds.__getitems__([3])[0][0], images[3])
        clone = pickle.loads(pickle.dumps(ds))
        assert clone._win is None and clone._buf is None
        np.testing.assert_array_equal(clone.__getitems__([39, 0])[1][0], images[0])


def test_images_past_end_of_file_are_not_mapped(tmp_path, monkeypatch):
    path, _ = _index_store(tmp_path / "t.h5", chunks=None)
    assert HDF5ImageDataset(path).mmap_reads
    monkeypatch.setattr(os.path, "getsize", lambda p: 100)  # as if truncated: no map (no SIGBUS later)
    ds = HDF5ImageDataset(path)
    assert ds.raw_reads and not ds.mmap_reads


def test_chunk_cache_sized_to_chunks(tmp_path):
    path, _ = _index_store(tmp_path / "z.h5", chunks=(4, 6, 6, 3), compression="gzip")
    ds = HDF5ImageDataset(path, cache_chunks=3)
    chunk_bytes = 4 * 6 * 6 * 3
    assert not ds.raw_reads and ds.rdcc_nbytes == 3 * chunk_bytes and ds.rdcc_nslots >= 521
    ds[0]
    # the file this process opened really carries those settings
    assert ds._file.id.get_access_plist().get_cache()[1:] == (ds.rdcc_nslots, ds.rdcc_nbytes, 1.0)
    raw, _ = _index_store(tmp_path / "r.h5")
    assert HDF5ImageDataset(raw, raw_reads=False).rdcc_nbytes == 0  # unfiltered: read past the cache


def test_pickle_and_reopen_after_fork(tmp_path):
    path, images = _index_store(tmp_path / "p.h5")
    ds = HDF5ImageDataset(path)
    ds[0]  # open here first: workers must not reuse this process's handle
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._fd is None and clone._pid is None
    np.testing.assert_array_equal(clone[3][0], images[3])
    loader = DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context="fork")
    got = torch.cat([x for x, _ in loader]).numpy()
    np.testing.assert_array_equal(got, images)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
@pytest.mark.parametrize("compression", ["gzip", None])  # h5py path; memory-mapped path
def test_spawned_workers_read_right(tmp_path, context, compression):
    path, images = _index_store(tmp_path / "w.h5", n=64, chunks=(4, 6, 6, 3), compression=compression)
    ds = HDF5ImageDataset(path)
    assert ds.mmap_reads == (compression is None)
    loader = DataLoader(ds, batch_size=8, shuffle=True, num_workers=2, multiprocessing_context=context)
    seen = []
    for x, y in loader:
        for img, label in zip(x.numpy(), y.tolist(), strict=True):
            np.testing.assert_array_equal(img, images[label])
            seen.append(label)
    assert sorted(seen) == list(range(64))


def test_dataset_errors_name_file_and_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.h5.*lightning-gpuopt convert"):
        HDF5ImageDataset(tmp_path / "missing.h5")
    (tmp_path / "text.h5").write_text("hello")
    with pytest.raises(ValueError, match=r"text\.h5.* not an HDF5 file"):
        HDF5ImageDataset(tmp_path / "text.h5")
    with h5py.File(tmp_path / "empty.h5", "w") as f:
        f.create_dataset("pixels", data=np.zeros(3))
    with pytest.raises(ValueError, match=r"empty\.h5.*'images'.*'labels'"):
        HDF5ImageDataset(tmp_path / "empty.h5")
    _write_h5(tmp_path / "len.h5", np.zeros((4, 5, 5, 3), np.uint8), np.zeros(3, np.int64))
    with pytest.raises(ValueError, match=r"len\.h5.*4 images but 3 labels"):
        HDF5ImageDataset(tmp_path / "len.h5")
    _write_h5(tmp_path / "float.h5", np.zeros((4, 5, 5, 3), np.float32), np.zeros(4, np.int64))
    with pytest.raises(ValueError, match=r"float\.h5.*uint8 \(N, H, W, 3\)"):
        HDF5ImageDataset(tmp_path / "float.h5")
    _write_h5(tmp_path / "chw.h5", np.zeros((4, 3, 5, 5), np.uint8), np.zeros(4, np.int64))
    with pytest.raises(ValueError, match=r"chw\.h5"):
        HDF5ImageDataset(tmp_path / "chw.h5")


def test_converter_validates_inputs(jpeg_folder, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        convert_folder_to_hdf5(tmp_path / "nope", tmp_path / "o.h5", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no class subfolders"):
        convert_folder_to_hdf5(tmp_path / "empty", tmp_path / "o.h5", progress=False)
    with pytest.raises(FileNotFoundError, match=r"output folder .*nodir.* does not exist"):
        convert_folder_to_hdf5(jpeg_folder, tmp_path / "nodir" / "o.h5", progress=False)
    with pytest.raises(ValueError, match="compression"):
        convert_folder_to_hdf5(jpeg_folder, tmp_path / "o.h5", compression="zstd", progress=False)
    with pytest.raises(ValueError, match="chunk_images"):
        convert_folder_to_hdf5(jpeg_folder, tmp_path / "o.h5", chunk_images=0, progress=False)
    (tmp_path / "o.h5").write_bytes(b"keep me")
    with pytest.raises(ValueError, match=r"already exists.*overwrite"):
        convert_folder_to_hdf5(jpeg_folder, tmp_path / "o.h5", size=8, progress=False)
    assert (tmp_path / "o.h5").read_bytes() == b"keep me"
    convert_folder_to_hdf5(jpeg_folder, tmp_path / "o.h5", size=8, overwrite=True, workers=1, progress=False)
    assert len(HDF5ImageDataset(tmp_path / "o.h5")) == 48


def _folder_with_corrupt(tmp_path, jpeg_folder):
    import shutil

    root = tmp_path / "src"
    shutil.copytree(jpeg_folder, root)
    bad = root / "class_01" / "img_000010.jpg"
    bad.write_bytes(b"this is not a jpeg")
    return root, bad


def test_corrupt_image_named_and_no_output(jpeg_folder, tmp_path):
    root, _ = _folder_with_corrupt(tmp_path, jpeg_folder)
    out = tmp_path / "o.h5"
    with pytest.raises(ValueError, match=r"img_000010\.jpg.*on_corrupt='skip'"):
        convert_folder_to_hdf5(root, out, size=8, workers=2, progress=False)
    assert not out.exists() and not list(tmp_path.glob("o.h5.tmp-*"))  # the exception path cleans up


def test_corrupt_image_skipped_and_listed(jpeg_folder, tmp_path):
    root, _ = _folder_with_corrupt(tmp_path, jpeg_folder)
    res = convert_folder_to_hdf5(
        root, tmp_path / "o.h5", size=8, workers=2, on_corrupt="skip", progress=False
    )
    assert res.skipped == ["class_01/img_000010.jpg"] and res.num_images == 47
    ds = HDF5ImageDataset(tmp_path / "o.h5")
    assert len(ds) == 47 and ds.attrs()["num_skipped"] == 1
    assert "class_01/img_000010.jpg" not in ds.files()
    with h5py.File(tmp_path / "o.h5", "r") as f:
        assert [s.decode() for s in f["skipped_files"][()]] == res.skipped
    # labels still line up with their files after the gap
    _, samples = scan_image_folder(root)
    by_rel = {os.path.relpath(p, root): (p, lbl) for p, lbl in samples}
    for i, rel in enumerate(ds.files()):
        path, label = by_rel[rel]
        image, got = ds[i]
        assert got == label
        np.testing.assert_array_equal(image, load_uint8_image(path, 8))


_SLOW_CONVERT = textwrap.dedent(
    """
    import sys, time
    import lightning_gpuopt.data.folder as folder
    real = folder.load_uint8_image
    def slow(path, size):  # decoding slowed down so the conversion is still running when killed
        time.sleep(0.02)
        return real(path, size)
    folder.load_uint8_image = slow
    from lightning_gpuopt.data.hdf5 import convert_folder_to_hdf5
    convert_folder_to_hdf5(sys.argv[1], sys.argv[2], size=8, workers=1, progress=True)
    """
)


def test_killed_conversion_leaves_no_output(jpeg_folder, tmp_path):
    out = tmp_path / "o.h5"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CONVERT, str(jpeg_folder), str(out)],
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        tmp = []
        while time.monotonic() < deadline and not tmp:
            tmp = list(tmp_path.glob("o.h5.tmp-*"))
            time.sleep(0.02)
        assert tmp, "the conversion never started writing"
        time.sleep(0.2)  # some images written
        assert proc.poll() is None, "the conversion finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    assert not out.exists()
    assert tmp[0].exists()  # SIGKILL allows no cleanup ...
    convert_folder_to_hdf5(jpeg_folder, out, size=8, workers=1, progress=False)
    assert not tmp[0].exists() and len(HDF5ImageDataset(out)) == 48  # ... the next run removes it


def test_cli_convert(jpeg_folder, tmp_path, capsys):
    out = tmp_path / "cli.h5"
    argv = ["convert", str(jpeg_folder), str(out), "--size", "12", "--chunk-images", "2"]
    assert cli_main([*argv, "--compression", "lzf", "--workers", "1", "--no-progress"]) == 0
    assert "48 images of 12x12" in capsys.readouterr().out
    ds = HDF5ImageDataset(out)
    assert ds.image_shape == (12, 12, 3) and ds.chunks == (2, 12, 12, 3) and ds.compression == "lzf"
    assert cli_main([*argv, "--no-progress"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert cli_main([*argv, "--no-progress", "--overwrite"]) == 0


class _LabelRecorder(pl.LightningModule):
    def __init__(self, out):
        super().__init__()
        self.layer = torch.nn.Conv2d(3, 2, 1)
        self.out = out
        self.labels = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.labels += y.tolist()
        return self.layer(x).float().mean()

    def on_train_epoch_end(self):
        Path(self.out, f"rank{self.global_rank}.json").write_text(json.dumps(self.labels))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_ddp_cpu_each_sample_once(tmp_path):
    datamodule = pytest.importorskip("lightning_gpuopt.data.datamodule")
    path, _ = _index_store(tmp_path / "ddp.h5", n=32, size=12)
    dm = datamodule.OptimizedDataModule(path, backend="hdf5", batch_size=4, num_workers=0, image_size=8)
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",  # fork deadlocks in libgomp after earlier tests ran parallel convolutions
        max_epochs=1,
        callbacks=[CloseProcessGroup()],
    )
    trainer.fit(_LabelRecorder(str(tmp_path)), datamodule=dm)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 16
    assert sorted(ranks[0] + ranks[1]) == list(range(32))
