"""CPU benchmark: batched ``HDF5ImageDataset.__getitems__`` vs per-item HDF5 reads.

For each stored image size, a JPEG folder is converted with ``convert_folder_to_hdf5`` (whole images on a
canvas, one uncompressed image a chunk) and random batches (a shuffled epoch, batch 256) are read these
ways, interleaved in every round (median over rounds kept, so all ratios come from the same run):

* ``h5py per-item``: what a hand-written loader does -- ``dset[i]`` per image on an h5py file opened with
  the default chunk cache, plus the label and the image's meta.
* ``dataset per-item``: ``HDF5ImageDataset.__getitem__`` per index (what the DataLoader's fetcher does for
  a dataset without ``__getitems__``).
* ``dataset __getitems__``: one call per batch (what the DataLoader calls): the store's one read path, a
  gather out of the memory-mapped file into one batch array.

and end to end through a ``DataLoader`` (``num_workers`` 0 and 2, persistent workers, the package's
``UInt8Collate``), per-item (``__getitems__`` hidden) vs batched. The file is in the page cache (read once
before timing), as it is when training several epochs.

    python benchmarks/cpu_hdf5_getitems.py --out benchmarks/results/hdf5_getitems_cpu.json
    python benchmarks/cpu_hdf5_getitems.py --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _shared.py beside this script
from _shared import hdf5_store, quick_out

from lightning_gpuopt._common import format_table
from lightning_gpuopt.bench.measure import write_results
from lightning_gpuopt.bench.synthetic import make_jpeg_folder
from lightning_gpuopt.data.hdf5 import HDF5ImageDataset
from lightning_gpuopt.data.loader import UInt8Collate


class _PerItem:
    """The dataset without ``__getitems__``: the DataLoader then fetches one index at a time."""

    def __init__(self, ds: HDF5ImageDataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int, np.ndarray]:
        return self.ds[i]


def _time_epochs(loader: Any, batches: int) -> float:
    """Seconds per image for ``batches`` batches of a fresh epoch of ``loader``."""
    it = iter(loader)
    t0 = time.perf_counter()
    got = 0
    for _ in range(batches):
        images = next(it)[0]  # (images, labels, meta)
        got += len(images)
    sec = time.perf_counter() - t0
    del it
    return sec / got


def bench_size(
    path: Path, batch_size: int, rounds: int, batches: int, seed: int, workers: list[int]
) -> list[dict[str, Any]]:
    import h5py
    from torch.utils.data import DataLoader

    ds = HDF5ImageDataset(path)
    n = len(ds)
    rng = np.random.default_rng(seed)
    f = h5py.File(path, "r")  # default chunk cache (1 MiB), as a hand-written loader would open it
    dset, labels, meta = f["images"], f["labels"][()], f["meta"][()]
    for i in range(0, n, batch_size):  # warm the page cache and this process's map
        ds.__getitems__(list(range(i, min(n, i + batch_size))))

    def naive(b: list[int]) -> Any:
        return [(dset[i], int(labels[i]), meta[i]) for i in b]

    variants = {
        "h5py per-item": naive,
        "dataset per-item": lambda b: [ds[i] for i in b],
        "dataset __getitems__": ds.__getitems__,
    }
    collate = UInt8Collate("benchmark")
    loaders: dict[str, Any] = {}
    for w in workers:
        extra: dict[str, Any] = {"num_workers": w}
        if w:
            extra.update(persistent_workers=True, prefetch_factor=2)
        loaders[f"DataLoader w{w} per-item"] = DataLoader(
            _PerItem(ds), batch_size=batch_size, shuffle=True, collate_fn=collate, **extra
        )
        loaders[f"DataLoader w{w} __getitems__"] = DataLoader(
            ds, batch_size=batch_size, shuffle=True, collate_fn=collate, **extra
        )
    for loader in loaders.values():  # start workers, map the file in each
        _time_epochs(loader, batches)
    times: dict[str, list[float]] = {k: [] for k in [*variants, *loaders]}
    for _ in range(rounds):
        perm = rng.permutation(n).tolist()
        batch_list = [perm[i * batch_size : (i + 1) * batch_size] for i in range(batches)]
        for name, fn in variants.items():
            t0 = time.perf_counter()
            for b in batch_list:
                fn(b)
            times[name].append((time.perf_counter() - t0) / (batches * batch_size))
        for name, loader in loaders.items():
            times[name].append(_time_epochs(loader, batches))
    loaders.clear()
    f.close()
    size = ds.image_shape[0]
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = []
    for name, sec in med.items():
        row: dict[str, Any] = {
            "name": f"{size}px {name}",
            "samples_per_sec": 1.0 / sec,
            "ratio_to_ceiling": None,
            "image_size": size,
            "us_per_image": sec * 1e6,
            "speedup_vs_h5py_per_item": None,
            "speedup_vs_dataset_per_item": None,
            "speedup_vs_per_item_loader": None,
        }
        if name.startswith("DataLoader"):
            row["speedup_vs_per_item_loader"] = med[name.replace("__getitems__", "per-item")] / sec
        else:
            row["speedup_vs_h5py_per_item"] = med["h5py per-item"] / sec
            row["speedup_vs_dataset_per_item"] = med["dataset per-item"] / sec
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/hdf5_getitems_cpu.json")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="DataLoader num_workers")
    parser.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "gpuopt_data"))
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes; without --out it writes to the temp folder"
    )
    args = parser.parse_args()
    args.out = quick_out(args.out, parser.get_default("out"), args.quick)
    if args.quick:
        args.sizes, args.images, args.batch_size, args.rounds = [32], 128, 32, 2
    batches = args.images // args.batch_size
    src = make_jpeg_folder(
        Path(args.data) / f"hdf5_bench_{args.images}",
        num_images=args.images,
        num_classes=10,
        image_size=(320, 240),
        workers=1 if args.quick else None,
    )
    rows: list[dict[str, Any]] = []
    conversions = {}
    for size in args.sizes:
        h5 = Path(args.data) / f"hdf5_bench_{args.images}_{size}.h5"
        conversions[size] = hdf5_store(src, h5, size)
        rows += bench_size(h5, args.batch_size, args.rounds, batches, seed=size, workers=args.workers)
    write_results(
        args.out,
        rows,
        batch_size=args.batch_size,
        images=args.images,
        rounds=args.rounds,
        conversions=conversions,
        note="us_per_image is the median over rounds; speedups compare variants in the same run",
    )
    print(f"wrote {args.out}")
    print(
        format_table(
            rows,
            [
                "name",
                "samples_per_sec",
                "us_per_image",
                "speedup_vs_h5py_per_item",
                "speedup_vs_dataset_per_item",
                "speedup_vs_per_item_loader",
            ],
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
