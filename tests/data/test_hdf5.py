"""HDF5ImageDataset: batched memory-mapped reads, pickling and workers, identity, errors."""

import gc
import os
import pickle
import shutil

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

h5py = pytest.importorskip("h5py")

from lightning_gpuopt._common import FeedInfo  # noqa: E402
from lightning_gpuopt.data import hdf5 as hdf5_mod  # noqa: E402
from lightning_gpuopt.data.convert import convert_folder_to_hdf5  # noqa: E402
from lightning_gpuopt.data.hdf5 import FORMAT, HDF5ImageDataset  # noqa: E402
from tests.data._images import image_folder  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A converted store of the 48-image JPEG folder at storage_size 16, and its canvases read with h5py."""
    root = tmp_path_factory.mktemp("store")
    src = image_folder(root / "src", num_images=48, num_classes=3, size=(64, 48))
    path = root / "s.h5"
    convert_folder_to_hdf5(src, path, 16, workers=1, progress=False)
    with h5py.File(path, "r") as f:
        return path, f["images"][()], f["meta"][()], f["labels"][()]


def test_items_are_canvas_label_meta(store):
    path, images, meta, labels = store
    ds = HDF5ImageDataset(path)
    assert len(ds) == 48 and ds.storage_size == 16 and ds.image_shape == (16, 24, 3)
    assert ds.feed_info == FeedInfo(backend="hdf5")
    canvas, label, m = ds[5]
    assert canvas.dtype == np.uint8 and canvas.shape == (16, 24, 3) and canvas.flags.writeable
    assert label == labels[5] and m.dtype == np.int32 and m.tolist() == meta[5].tolist() == [16, 21, 0]
    np.testing.assert_array_equal(canvas, images[5])
    assert ds.fingerprint()["uuid"] == ds.attrs()["uuid"] == ds.uuid


def test_getitems_matches_the_file_and_items_stay_valid(store):
    path, images, meta, labels = store
    ds = HDF5ImageDataset(path)
    for idx in ([5, 3, 3, 47, -1, 20, 21, 22], list(range(48)), list(range(47, -1, -1)), [7], []):
        got = ds.__getitems__(idx)
        assert [label for _, label, _ in got] == [int(labels[i]) for i in idx]
        for i, (img, _, m) in zip(idx, got, strict=True):
            np.testing.assert_array_equal(img, images[i])
            np.testing.assert_array_equal(m, meta[i])
    first = ds.__getitems__([3, 1, 1, 47])
    kept = first[0][0]
    del first
    for _ in range(3):  # later batches must not overwrite an image still referenced
        second = ds.__getitems__([10, 11, 12, 13, 14])
    np.testing.assert_array_equal(kept, images[3])
    np.testing.assert_array_equal(np.stack([x for x, _, _ in second]), images[10:15])
    kept[:] = 0  # writing an item changes neither the file nor later reads
    np.testing.assert_array_equal(ds[3][0], images[3])
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._file is None and clone._rows is None
    np.testing.assert_array_equal(clone.__getitems__([47, 0])[1][0], images[0])


def test_convert_lays_the_images_out_back_to_back(store):
    path, *_ = store
    ds = HDF5ImageDataset(path)
    offsets = ds._offsets
    assert (np.diff(offsets) == ds._image_bytes).all()  # one (N, image bytes) block: a batch is one gather
    assert ds._block_start == offsets[0]


def test_a_store_whose_images_are_not_back_to_back_is_refused_naming_convert(store, tmp_path):
    path, *_ = store
    scattered = tmp_path / "scattered.h5"
    shutil.copy(path, scattered)
    with h5py.File(scattered, "a") as f:
        offsets = f["chunk_offsets"][()]
        offsets[[1, 2]] = offsets[[2, 1]]
        f["chunk_offsets"][...] = offsets
    with pytest.raises(ValueError, match=r"scattered\.h5.*earlier lightning-gpuopt.*convert .*--overwrite"):
        HDF5ImageDataset(scattered)


def test_read_into_fills_a_batch_array_from_many_threads_at_once(store):
    from concurrent.futures import ThreadPoolExecutor

    from lightning_gpuopt.data.loader import BatchReader

    path, images, meta, labels = store
    ds = HDF5ImageDataset(path)
    assert isinstance(ds, BatchReader)
    rng = np.random.default_rng(0)
    batches = [rng.integers(-48, 48, size=int(rng.integers(1, 20))) for _ in range(64)]

    def read(idx):
        out = np.full((len(idx), *ds.image_shape), 7, dtype=np.uint8)
        got_labels, got_meta = ds.read_into(idx, out)
        return idx, out, got_labels, got_meta

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(read, batches))
    for idx, out, got_labels, got_meta in results:
        np.testing.assert_array_equal(out, images[idx])
        np.testing.assert_array_equal(got_labels, labels[idx])
        np.testing.assert_array_equal(got_meta, meta[idx])
        assert got_labels.dtype == np.int64 and got_meta.dtype == np.int32
    ds.close()  # the file reopens on the next read
    out = np.empty((2, *ds.image_shape), np.uint8)
    ds.read_into([1, 0], out)
    np.testing.assert_array_equal(out, images[[1, 0]])
    clone = pickle.loads(pickle.dumps(ds))  # the open file does not travel
    assert clone._file is None and clone._rows is None
    clone.read_into([47, 3], out)
    np.testing.assert_array_equal(out, images[[47, 3]])


def test_read_into_a_store_truncated_while_open_raises_naming_it(store, tmp_path):
    path, *_ = store
    live = tmp_path / "cut.h5"
    shutil.copy(path, live)
    ds = HDF5ImageDataset(live)
    out = np.empty((1, *ds.image_shape), np.uint8)
    ds.read_into([0], out)  # open (and mapped) before the cut
    os.truncate(live, int(ds._offsets[40]))
    with pytest.raises(RuntimeError, match=r"cut\.h5.*truncated while open.*--overwrite"):
        ds.read_into([47], out)


def test_read_into_checks_its_arguments(store, tmp_path):
    path, *_ = store
    ds = HDF5ImageDataset(path)
    shape = ds.image_shape
    for bad in (
        np.empty((2, *shape), np.float32),
        np.empty((3, *shape), np.uint8),
        np.empty((2, *shape), np.uint8)[:, ::-1],
        torch.empty((2, *shape), dtype=torch.uint8),
    ):
        with pytest.raises(ValueError, match=r"writable C-contiguous uint8 array of shape \(2, 16, 24, 3\)"):
            ds.read_into([0, 1], bad)
    with pytest.raises(IndexError, match=r"^index must be in range.*, got 48$"):
        ds.read_into([0, 48], np.empty((2, *shape), np.uint8))
    live = tmp_path / "live.h5"
    shutil.copy(path, live)
    swapped = HDF5ImageDataset(live)
    other = image_folder(tmp_path / "other", num_images=8, num_classes=2, size=(40, 40))
    convert_folder_to_hdf5(other, live, 24, workers=1, progress=False, overwrite=True)
    with pytest.raises(RuntimeError, match=r"live\.h5.* changed since this HDF5ImageDataset was made"):
        swapped.read_into([0], np.empty((1, *shape), np.uint8))


def test_indices_are_checked(store):
    path, *_ = store
    ds = HDF5ImageDataset(path)
    with pytest.raises(
        IndexError, match=r"^index must be in range for the 48 images .*valid: -48 to 47\), got -49$"
    ):
        ds[-49]
    with pytest.raises(IndexError, match=r"got 48$"):
        ds.__getitems__([0, 48])
    with pytest.raises(IndexError, match=r"got -50$"):
        ds.__getitems__([0, -50, 60])
    for bad in ("1", 1.7, None):
        with pytest.raises(TypeError, match="indices must be integers"):
            ds[bad]
    with pytest.raises(TypeError, match="indices must be integers"):
        ds.__getitems__([0.5, 1.0])
    np.testing.assert_array_equal(ds[np.int64(-1)][0], ds[47][0])
    np.testing.assert_array_equal(ds[torch.tensor(2)][0], ds[2][0])


def test_pickle_and_reopen_after_fork(store):
    path, images, *_ = store
    ds = HDF5ImageDataset(path)
    ds[0]  # mapped here first: forked workers must map their own
    loader = DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context="fork")
    got = torch.cat([x for x, _, _ in loader]).numpy()
    np.testing.assert_array_equal(got, images)


def test_spawned_workers_read_right(store):
    path, images, meta, labels = store
    ds = HDF5ImageDataset(path)
    loader = DataLoader(ds, batch_size=8, shuffle=True, num_workers=2, multiprocessing_context="spawn")
    seen = []
    index_of = {img.tobytes(): i for i, img in enumerate(images)}
    for x, y, m in loader:
        for img, label, row in zip(x.numpy(), y.tolist(), m.numpy(), strict=True):
            i = index_of[img.tobytes()]
            assert label == labels[i] and row.tolist() == meta[i].tolist()
            seen.append(i)
    assert sorted(seen) == list(range(48))


def test_a_replaced_store_is_refused_in_every_process(store, tmp_path):
    # the dataset is made, then the file is converted again (other size and count) under the same name:
    # a process that opens it afterwards must not read the new bytes with the old shape
    path, *_ = store
    live = tmp_path / "live.h5"
    shutil.copy(path, live)
    ds = HDF5ImageDataset(live)
    other = image_folder(tmp_path / "other", num_images=20, num_classes=2, size=(40, 40))
    convert_folder_to_hdf5(other, live, 24, workers=1, progress=False, overwrite=True)
    loader = DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context="spawn")
    with pytest.raises(RuntimeError, match=r"live\.h5.* changed since this HDF5ImageDataset was made"):
        next(iter(loader))
    gc.collect()  # the failed iterator sits in a reference cycle: collected now, its worker stops now
    with pytest.raises(RuntimeError, match=r"live\.h5.* changed"):
        ds[0]
    assert len(HDF5ImageDataset(live)) == 20  # a new dataset reads the new store


def test_a_store_mapped_before_it_was_replaced_keeps_its_own_bytes(store, tmp_path):
    path, images, *_ = store
    live = tmp_path / "live.h5"
    shutil.copy(path, live)
    ds = HDF5ImageDataset(live)
    ds[0]  # mapped: the map holds the old file
    (tmp_path / "new.h5").write_bytes(b"x" * 100)
    os.replace(tmp_path / "new.h5", live)
    np.testing.assert_array_equal(ds[7][0], images[7])


def _hand_made(path, **attrs):
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=np.zeros((4, 8, 8, 3), np.uint8), chunks=(1, 8, 8, 3))
        f.create_dataset("labels", data=np.zeros(4, np.int64))
        f.attrs.update(attrs)
    return path


def test_errors_name_the_file_and_the_fix(store, tmp_path):
    path, *_ = store
    with pytest.raises(FileNotFoundError, match=r"missing\.h5.*lightning-gpuopt convert"):
        HDF5ImageDataset(tmp_path / "missing.h5")
    (tmp_path / "text.h5").write_text("hello")
    with pytest.raises(ValueError, match=r"text\.h5.* not an HDF5 file.*re-run `lightning-gpuopt convert"):
        HDF5ImageDataset(tmp_path / "text.h5")
    data = path.read_bytes()
    for name, cut in (("half.h5", len(data) // 2), ("head.h5", 4096)):
        (tmp_path / name).write_bytes(data[:cut])
        with pytest.raises(
            ValueError, match=rf"{name.replace('.', '[.]')}.*(truncated|damaged).*--overwrite"
        ):
            HDF5ImageDataset(tmp_path / name)
    with pytest.raises(ValueError, match=r"plain\.h5.* not a lightning-gpuopt image store"):
        HDF5ImageDataset(_hand_made(tmp_path / "plain.h5"))
    old = _hand_made(tmp_path / "old.h5", format=FORMAT, format_version=1, image_size=8)
    with pytest.raises(
        ValueError,
        match=r"old\.h5.* another lightning-gpuopt \(format version 1,.*SRC_FOLDER .*old\.h5 --overwrite",
    ):
        HDF5ImageDataset(old)
    shutil.copy(path, tmp_path / "edited.h5")
    with h5py.File(tmp_path / "edited.h5", "a") as f:
        del f["meta"]
    with pytest.raises(ValueError, match=r"edited\.h5.* no 'meta' dataset"):
        HDF5ImageDataset(tmp_path / "edited.h5")


def test_a_store_without_the_completeness_mark_is_refused(store, tmp_path):
    path, *_ = store
    assert HDF5ImageDataset(path).attrs()["complete"]
    unmarked, older = tmp_path / "unmarked.h5", tmp_path / "older.h5"
    for copy, version in ((unmarked, None), (older, 2)):
        shutil.copy(path, copy)
        with h5py.File(copy, "a") as f:
            del f.attrs["complete"]
            if version is not None:
                f.attrs["format_version"] = version
    incomplete = r"unmarked\.h5.* is incomplete: the conversion did not finish.*--overwrite"
    with pytest.raises(ValueError, match=incomplete):
        HDF5ImageDataset(unmarked)
    older_fix = r"older\.h5.* lightning-gpuopt \(format version 2,.*SRC_FOLDER .*older\.h5 --overwrite"
    with pytest.raises(ValueError, match=older_fix):
        HDF5ImageDataset(older)


def test_a_batch_asks_the_kernel_for_exactly_its_images_bytes(store, monkeypatch):
    # a store bigger than memory is read from the disk: each image's bytes are asked for ahead, and no more
    path, images, _meta, _labels = store
    ds = HDF5ImageDataset(path)
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(hdf5_mod, "_FADVISE", lambda fd, off, n, advice: calls.append((off, n, advice)))
    idx = np.array([5, 1, 47, 1])
    wanted = [(int(ds._offsets[i]), ds._image_bytes, os.POSIX_FADV_WILLNEED) for i in idx]
    out = np.empty((len(idx), *ds.image_shape), np.uint8)
    ds.read_into(idx, out)  # the reading threads' path
    assert calls == wanted
    np.testing.assert_array_equal(out, images[idx])
    calls.clear()
    got = ds.__getitems__(idx.tolist())  # the worker processes' path
    assert calls == wanted
    np.testing.assert_array_equal(np.stack([c for c, _, _ in got]), images[idx])
    ds.close()
