"""A store replaced under an open ``HDF5ImageDataset`` by ``lightning-gpuopt convert --overwrite``.

The dataset is made on a store of 20 images at 32 px; then the file is replaced by another conversion,
either of other size and count (320 images at 48 px) or of the same shape (20 other images at 32 px, the
file as large as before). Reading it afterwards, in this process or through a DataLoader with fork or spawn
workers, must raise an error naming the file: never hand out samples of the other store. In the ``mapped``
cases this process read the store before the swap; it may then keep serving the original store's samples
(its mapping holds the old file), but still never the other one's.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from torch.utils.data import DataLoader

from tests.faults._helpers import OLD_SIZE, SIZE, read_store, run_convert

CONTEXTS = ("in-process", "fork", "spawn")
SWAPS = {"other-size-and-count": ("main", SIZE), "same-shape": ("other", OLD_SIZE)}
CASES = [(ctx, swap, False) for ctx in CONTEXTS for swap in SWAPS]
CASES += [(ctx, "same-shape", True) for ctx in CONTEXTS]


def _samples(batches) -> list[tuple[np.ndarray, int, np.ndarray]]:
    out = []
    for canvases, labels, metas in batches:
        out += [(c.numpy(), int(lbl), m.numpy()) for c, lbl, m in zip(canvases, labels, metas, strict=True)]
    return out


def _matches(sample, store: dict, i: int) -> bool:
    canvas, label, meta = sample
    return (
        i < len(store["labels"])
        and canvas.shape == store["images"][i].shape
        and np.array_equal(canvas, store["images"][i])
        and label == int(store["labels"][i])
        and np.array_equal(meta, store["meta"][i])
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("context", "swap", "mapped"),
    CASES,
    ids=[f"{c}-{s}" + ("-mapped" if m else "") for c, s, m in CASES],
)
def test_swapped_store(sources, case_dir, context, swap, mapped):
    from lightning_gpuopt.data.hdf5 import HDF5ImageDataset

    path = case_dir / "store.h5"
    shutil.copyfile(sources.old_store, path)
    original = read_store(path)
    dataset = HDF5ImageDataset(path)
    if mapped:
        canvas, label, meta = dataset[0]
        assert _matches((canvas, label, meta), original, 0)
    folder, size = SWAPS[swap]
    swapped = run_convert(getattr(sources, folder), path, "--overwrite", "--workers", "1", size=size)
    assert swapped.returncode == 0, swapped.stderr
    if swap == "same-shape":  # only the store's identity can tell the two files apart
        assert path.stat().st_size == sources.old_store.stat().st_size
        assert read_store(path)["images"].shape == original["images"].shape

    workers = 0 if context == "in-process" else 1
    loader = DataLoader(
        dataset,
        batch_size=4,
        num_workers=workers,
        multiprocessing_context=None if workers == 0 else context,
    )
    got: list = []
    error: BaseException | None = None
    try:
        for batch in loader:
            got += _samples([batch])
    except Exception as err:  # the error a reader gets is the finding
        # without its traceback the error holds no frame, so the loader's workers stop with their iterator
        error = err.with_traceback(None)
    foreign = [i for i, s in enumerate(got) if not _matches(s, original, i)]
    assert foreign == [], (
        f"{len(foreign)} of {len(got)} samples read after the swap are not the original store's "
        f"(first at index {foreign[0]}); error afterwards: {error!r}"
    )
    if mapped and context == "in-process" and error is None:
        assert len(got) == len(original["labels"])  # the old mapping served the whole original store
        return
    assert error is not None, f"reading the replaced store raised nothing ({len(got)} samples returned)"
    assert str(path) in str(error), f"the error does not name {str(path)!r}: {error!r}"
