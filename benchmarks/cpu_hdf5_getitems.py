"""CPU benchmark: batched ``HDF5ImageDataset.__getitems__`` vs per-item HDF5 reads.

For each stored image size, a JPEG folder is converted with ``convert_folder_to_hdf5`` and random batches
(a shuffled epoch, batch 256) are read four ways, interleaved over several rounds (median kept):

* ``h5py per-item``: what a hand-written loader does -- ``dset[i]`` per image on an h5py file opened with
  the default chunk cache, plus the label.
* ``dataset per-item``: ``HDF5ImageDataset.__getitem__`` per index (the DataLoader fetcher's path for a
  dataset without ``__getitems__``).
* ``dataset __getitems__``: one call per batch (what the DataLoader calls, torch >= 2.1).
* ``__getitems__ via h5py``: the same with ``raw_reads=False`` (the compressed-store path).

and end to end through a ``DataLoader(num_workers=0)`` with the package's collate, per-item vs batched.
The file is in the page cache (read once before timing), as it is when training several epochs.

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_gpuopt.benchmarking import format_table, write_results
from lightning_gpuopt.data.hdf5 import HDF5ImageDataset, convert_folder_to_hdf5
from lightning_gpuopt.data.synthetic import make_jpeg_folder


class _PerItem:
    """The dataset without ``__getitems__``: the DataLoader then fetches one index at a time."""

    def __init__(self, ds: HDF5ImageDataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.ds[i]


def _collate() -> Any:
    try:
        from lightning_gpuopt.data.datamodule import UInt8Collate

        return UInt8Collate("benchmark")
    except ImportError:  # datamodule not there: torch's default
        from torch.utils.data import default_collate

        return default_collate


def bench_size(path: Path, batch_size: int, rounds: int, batches: int, seed: int) -> list[dict[str, Any]]:
    import h5py
    from torch.utils.data import DataLoader

    ds = HDF5ImageDataset(path)
    ds_h5 = HDF5ImageDataset(path, raw_reads=False)
    n = len(ds)
    rng = np.random.default_rng(seed)
    f = h5py.File(path, "r")  # default chunk cache (1 MiB), as a hand-written loader would open it
    dset, labels = f["images"], f["labels"][()]
    ds.__getitems__(list(range(n)))  # warm the page cache

    def naive(b: list[int]) -> Any:
        return [(dset[i], int(labels[i])) for i in b]

    variants = {
        "h5py per-item": naive,
        "dataset per-item": lambda b: [ds[i] for i in b],
        "dataset __getitems__": ds.__getitems__,
        "__getitems__ via h5py": ds_h5.__getitems__,
    }
    collate = _collate()
    loaders = {
        "DataLoader per-item": lambda: DataLoader(
            _PerItem(ds), batch_size=batch_size, shuffle=True, collate_fn=collate
        ),
        "DataLoader __getitems__": lambda: DataLoader(
            ds, batch_size=batch_size, shuffle=True, collate_fn=collate
        ),
    }
    times: dict[str, list[float]] = {k: [] for k in [*variants, *loaders]}
    for _ in range(rounds):
        perm = rng.permutation(n).tolist()
        batch_list = [perm[i * batch_size : (i + 1) * batch_size] for i in range(batches)]
        for name, fn in variants.items():
            t0 = time.perf_counter()
            for b in batch_list:
                fn(b)
            times[name].append((time.perf_counter() - t0) / (batches * batch_size))
        for name, make in loaders.items():
            it = iter(make())
            t0 = time.perf_counter()
            for _ in range(batches):
                next(it)
            times[name].append((time.perf_counter() - t0) / (batches * batch_size))
    f.close()
    size = ds.image_shape[0]
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = []
    for name, sec in med.items():
        base = med["DataLoader per-item"] if name.startswith("DataLoader") else med["h5py per-item"]
        rows.append(
            {
                "name": f"{size}px {name}",
                "samples_per_sec": 1.0 / sec,
                "ratio_to_ceiling": None,
                "image_size": size,
                "us_per_image": sec * 1e6,
                "speedup_vs_h5py_per_item": med["h5py per-item"] / sec
                if not name.startswith("DataLoader")
                else None,
                "speedup_vs_dataset_per_item": med["dataset per-item"] / sec
                if not name.startswith("DataLoader")
                else None,
                "speedup_vs_per_item_loader": base / sec if name.startswith("DataLoader") else None,
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/hdf5_getitems_cpu.json")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "gpuopt_data"))
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes; writes next to --out as *_quick.json"
    )
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.images, args.batch_size, args.rounds = [32, 64], 256, 64, 2
        args.out = str(Path(args.out).with_name(Path(args.out).stem + "_quick.json"))
        args.out = os.path.join(tempfile.gettempdir(), Path(args.out).name)
    batches = args.images // args.batch_size
    src = make_jpeg_folder(
        Path(args.data) / f"hdf5_bench_{args.images}",
        num_images=args.images,
        num_classes=10,
        image_size=(320, 240),
    )
    rows: list[dict[str, Any]] = []
    conversions = {}
    for size in args.sizes:
        h5 = Path(args.data) / f"hdf5_bench_{args.images}_{size}.h5"
        if not h5.exists():
            res = convert_folder_to_hdf5(src, h5, size=size, progress=False)
            conversions[size] = {"seconds": res.seconds, "images_per_sec": res.num_images / res.seconds}
        rows += bench_size(h5, args.batch_size, args.rounds, batches, seed=size)
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
