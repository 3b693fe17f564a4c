"""Accuracy parity: does training through lightning-gpuopt's pipelines reach the accuracy of torchvision's?

The same small network is trained from scratch on the same data, with the same recipe, seeds and
``Trainer(**fast_trainer_kwargs(model, device))``, fed by

* ``reference``: an ImageFolder dataset with torchvision's ImageNet transforms (``RandomResizedCrop(size,
  scale=(0.08, 1))`` + ``RandomHorizontalFlip`` for training, ``Resize(round(size * 256 / 224))`` +
  ``CenterCrop(size)`` for validation; real torchvision when it imports, else the PIL reimplementation
  in ``_parity_data.py``) and a plain ``DataLoader``;
* ``folder``, ``hdf5``, ``dali``: ``OptimizedDataModule`` with its defaults for that backend (the HDF5 file
  made by ``convert_folder_to_hdf5`` from the same folder). ``dali`` runs wherever ``nvidia.dali`` imports (a
  CPU pipeline on a CPU run); elsewhere its row says why it did not;
* ``threads``, ``nvjpeg``: the folder decoded in the training process without DALI
  (``DecodeOptions(decoder="cpu")``: threads onto canvases, ``"gpu"``: nvJPEG and crops from the whole image on
  the GPU); ``nvjpeg`` runs where a CUDA GPU and torchvision are, elsewhere its row says why it did not;
* ``centre-square`` (border set only): a control, the reference's transforms applied to each training image's
  centre square, as a pipeline that stores square images would train.

Each row reports the top-1 accuracy on the validation folder after the last epoch, over several seeds (mean,
standard deviation, each seed's figure). A backend passes when its mean is within
``max(2 x reference std, 1 point)`` of the reference's mean. Two data sets (``_parity_data.py``): ``photos``,
patches of scikit-image's sample photographs, and ``border``, where the class evidence of the training images
lies in the outer eighth of the image, outside its centre square.

    python benchmarks/accuracy_parity.py --size cpu            # both data sets, CI-sized (2 CPU cores)
    python benchmarks/accuracy_parity.py --size gpu            # one GPU, larger images and network
    python benchmarks/accuracy_parity.py --size cpu --dataset border --rows reference,folder,hdf5 --seeds 3

Writes ``benchmarks/results/<date>-accuracy-parity-<dataset>-<cpu|gpu name>.json`` per data set (``--out`` to change
the folder) and prints a table last.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _parity_data import (
    DATASETS,
    ReferenceImageFolder,
    make_dataset,
    reference_transform,
    torchvision_available,
)
from _zoo import ParityClassifier

from lightning_gpuopt._common import cache_dir, eval_resize_size, format_table

ROWS = ("reference", "folder", "hdf5", "dali", "threads", "nvjpeg")
#: rows decoded in the training process, and the decoder each asks for
DECODE_ROWS = {"threads": "cpu", "nvjpeg": "gpu"}
#: a control on the border set: the reference's transforms on each training image's centre square only
CONTROL = "centre-square"
#: the package's code the rows run (relative to this folder), for the results' ``commit``
CODE_RUN = ("../lightning_gpuopt/data", "../lightning_gpuopt/compute", "../lightning_gpuopt/_common.py")
DEFAULT_ROWS = {"photos": list(ROWS), "border": [*ROWS, CONTROL]}
CRITERION = "each backend within max(2 x reference std, 1 point) of reference"
QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False,
         "enable_checkpointing": False, "num_sanity_val_steps": 0}  # fmt: skip


@dataclass(frozen=True)
class ParityConfig:
    """One benchmark size: data, network and recipe.

    Attributes:
        image_size: side of the crops the network sees.
        width: channels of the network's first stage (doubled at each of its two downsamplings).
        blocks: residual blocks a stage (0: plain conv stages).
        batch_size: samples a step.
        epochs: passes over the training set.
        lr: peak SGD learning rate (linear warm-up over the first epoch, cosine decay to 0).
        workers: DataLoader workers (DALI threads) of every row.
        seeds: training seeds (the data is the same for all).
        train_per_class: training images a class.
        val_per_class: validation images a class.
        image_long_side: long side of the generated images (see ``make_dataset``).
        accelerator: Lightning accelerator of every row.
        jobs: fits run at once, each in its own process (on a GPU run they share the one GPU, each with
            ``workers`` loader workers): a small network leaves most of a large GPU idle.

    Example:
        >>> quick = replace(SIZES["cpu"], epochs=4, seeds=(0, 1))
        >>> run_parity("border", quick, "cpu", ["reference", "folder"], Path("/tmp/parity"))  # doctest: +SKIP
    """

    image_size: int
    width: int
    blocks: int
    batch_size: int
    epochs: int
    lr: float
    workers: int
    seeds: tuple[int, ...]
    train_per_class: dict[str, int]
    val_per_class: dict[str, int]
    image_long_side: int
    accelerator: str
    jobs: int = 1


SIZES: dict[str, ParityConfig] = {
    "cpu": ParityConfig(image_size=32, width=16, blocks=0, batch_size=32, epochs=16, lr=0.05, workers=0,
                        seeds=(0, 1, 2), train_per_class={"photos": 80, "border": 160},
                        val_per_class={"photos": 40, "border": 80}, image_long_side=64, accelerator="cpu"),
    "gpu": ParityConfig(image_size=96, width=32, blocks=1, batch_size=128, epochs=20, lr=0.1, workers=3,
                        seeds=(0, 1, 2), train_per_class={"photos": 500, "border": 800},
                        val_per_class={"photos": 100, "border": 200}, image_long_side=192, accelerator="gpu",
                        jobs=4),
}  # fmt: skip


# ------------------------------------------------------------------------------------------------ rows
def nvjpeg_unavailable() -> str | None:
    """Why the nvJPEG row cannot run here, or ``None`` when it can."""
    ok = torch.cuda.is_available() and torchvision_available()
    return None if ok else "nvJPEG needs a CUDA GPU and torchvision"


def dali_unavailable() -> str | None:
    """Why the DALI row cannot run here, or ``None`` when it can."""
    try:
        import nvidia.dali  # noqa: F401
    except Exception as err:  # not installed, or a build that does not load here
        return f"nvidia.dali does not import ({type(err).__name__}: {err})"
    return None


def _reference_loaders(
    train_dir: Path, val_dir: Path, cfg: ParityConfig, centre_square: bool = False
) -> tuple[Any, Any]:
    from torch.utils.data import DataLoader

    train_tf = reference_transform(cfg.image_size, True, centre_square=centre_square)
    val_tf = reference_transform(cfg.image_size, False)
    if torchvision_available():
        from torchvision.datasets import ImageFolder

        train: Any = ImageFolder(str(train_dir), transform=train_tf)
        val: Any = ImageFolder(str(val_dir), transform=val_tf)
    else:
        train = ReferenceImageFolder(train_dir, train_tf)
        val = ReferenceImageFolder(val_dir, val_tf)
    common = {
        "num_workers": cfg.workers,
        "pin_memory": cfg.accelerator == "gpu",
        "persistent_workers": cfg.workers > 0,
    }
    return (
        DataLoader(train, batch_size=cfg.batch_size, shuffle=True, drop_last=True, **common),
        DataLoader(val, batch_size=cfg.batch_size, shuffle=False, **common),
    )


def train_once(
    row: str, seed: int, data: dict[str, Path], num_classes: int, cfg: ParityConfig
) -> dict[str, Any]:
    """Train one row with one seed; return its top-1, precision and fit seconds."""
    from lightning_gpuopt import OptimizedDataModule, fast_trainer_kwargs

    pl.seed_everything(seed, workers=True, verbose=False)
    model = ParityClassifier(num_classes, cfg.width, cfg.blocks, cfg.lr)
    trainer_args = {
        **QUIET,
        "accelerator": cfg.accelerator,
        "devices": 1,
        "max_epochs": cfg.epochs,
        "check_val_every_n_epoch": cfg.epochs,
    }
    device = "cuda" if cfg.accelerator == "gpu" else "cpu"
    if device == "cpu":
        # bf16 on a CPU made this small net lose a class on some seeds (with either pipeline); the rows
        # compare data pipelines, so they train in fp32 there
        trainer_args["precision"] = "32-true"
    # every row trains under the same Trainer preset: the rows differ only in how data reaches the model
    trainer = pl.Trainer(**fast_trainer_kwargs(model, device, **trainer_args))
    if row in ("reference", CONTROL):
        loaders = _reference_loaders(data["train"], data["val"], cfg, centre_square=row == CONTROL)
        start = time.perf_counter()
        trainer.fit(model, *loaders)
    else:
        from lightning_gpuopt import DecodeOptions

        h5 = row == "hdf5"
        # the decode rows: the folder decoded in the training process, on cfg.workers threads (at least one)
        how = {"decode": DecodeOptions(decoder=DECODE_ROWS[row], threads=max(1, cfg.workers))} if row in \
            DECODE_ROWS else {"backend": row, "num_workers": cfg.workers}  # fmt: skip
        dm = OptimizedDataModule(
            data["train_h5" if h5 else "train"],
            data["val_h5" if h5 else "val"],
            batch_size=cfg.batch_size,
            image_size=cfg.image_size,
            **how,
        )
        start = time.perf_counter()
        trainer.fit(model, datamodule=dm)
    seconds = time.perf_counter() - start
    if model.top1 is None:
        raise RuntimeError(f"{row} (seed {seed}): no validation pass ran; check the validation data")
    return {"top1": 100.0 * model.top1, "precision": str(trainer.precision), "fit_seconds": seconds}


def _fit_job(args: tuple[str, int, dict[str, Path], int, ParityConfig]) -> dict[str, Any]:
    torch.set_num_threads(1)  # the jobs share the host's cores; their loaders do the CPU work
    return train_once(*args)


def _run_fits(
    fits: list[tuple[str, int]], data: dict[str, Path], num_classes: int, cfg: ParityConfig
) -> dict[tuple[str, int], dict[str, Any]]:
    """Run every ``(row, seed)`` fit, ``cfg.jobs`` at a time in spawned processes (in this one for 1 job)."""
    if cfg.jobs <= 1:
        return {(row, seed): train_once(row, seed, data, num_classes, cfg) for row, seed in fits}
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    # one fresh process a fit (max_tasks_per_child=1): no CUDA or DALI state carries from fit to fit
    with ProcessPoolExecutor(cfg.jobs, mp_context=mp.get_context("spawn"), max_tasks_per_child=1) as pool:
        results = pool.map(_fit_job, [(row, seed, data, num_classes, cfg) for row, seed in fits])
        return dict(zip(fits, results, strict=True))


def prepare_data(
    dataset: str, cfg: ParityConfig, size: str, data_dir: Path, rows: list[str]
) -> dict[str, Path]:
    """Make the data set (once) and, for the hdf5 row, its HDF5 copies at the DataModule's storage size."""
    root = data_dir / f"{dataset}_{size}"
    train, val = make_dataset(
        dataset,
        root,
        train_per_class=cfg.train_per_class[dataset],
        val_per_class=cfg.val_per_class[dataset],
        image_long_side=cfg.image_long_side,
    )
    paths = {"train": train, "val": val}
    if "hdf5" in rows:
        from lightning_gpuopt import convert_folder_to_hdf5

        storage = eval_resize_size(cfg.image_size)
        for split, folder in (("train", train), ("val", val)):
            out = root / f"{split}_{storage}.h5"
            if not out.exists() or out.stat().st_mtime < (root / "manifest.json").stat().st_mtime:
                convert_folder_to_hdf5(folder, out, storage, workers=0, progress=False, overwrite=True)
            paths[f"{split}_h5"] = out
    return paths


def summarize(name: str, results: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    top1 = [r["top1"] for r in results]
    seconds = [r["fit_seconds"] for r in results]
    return {
        "name": name,
        "top1_mean": statistics.fmean(top1),
        "top1_median": statistics.median(top1),
        "top1_worst": min(top1),
        "top1_std": statistics.stdev(top1) if len(top1) > 1 else 0.0,
        "seeds": seeds,
        "top1": top1,
        "precision": results[0]["precision"],
        "control": name == CONTROL,
        "fit_seconds_mean": statistics.fmean(seconds),
        "skipped": None,
    }


def within(rows: list[dict[str, Any]]) -> dict[str, bool | None]:
    """Each backend row: its median seed within ``max(2 x reference std, 1 point)`` of the reference's median
    seed (None: not run); one seed that failed to converge moves neither median (the worst seed is reported
    beside it, ``top1_worst``)."""
    ref = next((r for r in rows if r["name"] == "reference" and r["top1_mean"] is not None), None)
    out: dict[str, bool | None] = {}
    for r in rows:
        if r["name"] in ("reference", CONTROL):
            continue
        if ref is None or r["top1_mean"] is None or not r.get("top1"):
            out[r["name"]] = None
            continue
        tolerance = max(2.0 * ref["top1_std"], 1.0)
        gap = statistics.median(r["top1"]) - statistics.median(ref["top1"])
        out[r["name"]] = bool(abs(gap) <= tolerance)
    return out


def run_parity(
    dataset: str,
    cfg: ParityConfig,
    size: str,
    rows: list[str],
    data_dir: Path,
) -> dict[str, Any]:
    """Train every row with every seed on ``dataset``; return ``{"rows", "within", ...}`` (no file written)."""
    data = prepare_data(dataset, cfg, size, data_dir, rows)
    num_classes = sum(1 for d in data["train"].iterdir() if d.is_dir())
    out_rows: list[dict[str, Any]] = []
    unavailable = {"dali": dali_unavailable, "nvjpeg": nvjpeg_unavailable}
    skipped = {row: why for row in rows if row in unavailable and (why := unavailable[row]()) is not None}
    runnable = [r for r in rows if r not in skipped]
    fits = [(row, seed) for row in runnable for seed in cfg.seeds]
    done = _run_fits(fits, data, num_classes, cfg)
    for row in rows:
        if row in skipped:
            out_rows.append(
                {
                    "name": row,
                    "top1_mean": None,
                    "top1_median": None,
                    "top1_worst": None,
                    "top1_std": None,
                    "seeds": [],
                    "top1": [],
                    "skipped": skipped[row],
                }
            )
        else:
            out_rows.append(summarize(row, [done[(row, seed)] for seed in cfg.seeds], list(cfg.seeds)))
    ref = next((r for r in out_rows if r["name"] == "reference"), None)
    for r in out_rows:
        if ref is not None and r["top1_mean"] is not None and ref["top1_mean"] is not None:
            r["delta_vs_reference"] = r["top1_mean"] - ref["top1_mean"]
    return {
        "rows": out_rows,
        "dataset": dataset,
        "criterion": CRITERION,
        "within": within(out_rows),
        "config": {**asdict(cfg), "size": size, "num_classes": num_classes},
        "reference_transforms": "torchvision" if torchvision_available() else "PIL reimplementation",
    }


def machine_info() -> dict[str, Any]:
    """``bench.measure.machine_info``, torch's threads and the git commit of this checkout (``+dirty``: the
    code the rows run, ``CODE_RUN``, differs from that commit)."""
    import subprocess

    from lightning_gpuopt.bench.measure import machine_info as machine

    info: dict[str, Any] = {**machine(), "torch_threads": torch.get_num_threads(), "commit": None}
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        git = {"cwd": here, "capture_output": True, "text": True, "check": True}
        head = subprocess.run(["git", "rev-parse", "HEAD"], **git)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *CODE_RUN], **git)
        info["commit"] = head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        pass
    return info


def write_results(path: Path, result: dict[str, Any], command: str) -> Path:
    """Write ``{"machine", "command", "date", "rows", ...result}`` as JSON."""
    import datetime as dt
    import json

    doc = {
        "machine": machine_info(),
        "command": command,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        **result,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def _machine_tag(size: str) -> str:
    if size == "cpu" or not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).lower()
    for tag in ("h200", "h100", "a100", "l40s", "l4"):
        if tag in name:
            return tag
    return "gpu"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="cpu", help="cpu: 2 CPU cores; gpu: one GPU")
    p.add_argument("--dataset", choices=[*DATASETS, "all"], default="all")
    p.add_argument(
        "--rows",
        default=None,
        help=f"comma-separated rows of {','.join([*ROWS, CONTROL])} (default: all, the control on border only)",
    )
    p.add_argument("--seeds", type=int, default=None, help="number of seeds (default: the size's 3)")
    p.add_argument(
        "--jobs", type=int, default=None, help="fits run at once, one process each (default: the size's)"
    )
    p.add_argument("--out", default="benchmarks/results", help="folder of the JSON results")
    p.add_argument("--data-dir", default=None, help="where data sets are made (default: the package cache)")
    args = p.parse_args(argv)
    rows = None if args.rows is None else [r.strip() for r in args.rows.split(",") if r.strip()]
    if rows is not None:
        bad = [r for r in rows if r not in (*ROWS, CONTROL)]
        if bad or not rows:
            p.error(f"--rows: unknown row(s) {bad}; choose from {','.join([*ROWS, CONTROL])}")
    cfg = SIZES[args.size]
    if cfg.accelerator == "gpu" and not torch.cuda.is_available():
        p.error("--size gpu needs a CUDA GPU; use --size cpu on this machine")
    if args.seeds is not None:
        if args.seeds < 2:
            p.error("--seeds must be >= 2 (the criterion needs the reference's standard deviation)")
        cfg = replace(cfg, seeds=tuple(range(args.seeds)))
    if args.jobs is not None:
        if args.jobs < 1:
            p.error("--jobs must be >= 1")
        cfg = replace(cfg, jobs=args.jobs)
    command = " ".join(shlex.quote(a) for a in ["python", *sys.argv])
    data_dir = Path(args.data_dir) if args.data_dir else cache_dir() / "accuracy_parity"
    datasets = list(DATASETS) if args.dataset == "all" else [args.dataset]

    tables = []
    for dataset in datasets:
        start = time.perf_counter()
        result = run_parity(dataset, cfg, args.size, rows or DEFAULT_ROWS[dataset], data_dir)
        result["seconds"] = time.perf_counter() - start
        day = time.strftime("%Y-%m-%d", time.gmtime())
        path = Path(args.out) / f"{day}-accuracy-parity-{dataset}-{_machine_tag(args.size)}.json"
        write_results(path, result, command)
        shown = [
            {
                **r,
                "within": result["within"].get(r["name"]),
                "note": r.get("skipped") or ("control: centre square only" if r.get("control") else None),
            }
            for r in _read_rows(path)
        ]
        columns = ["name", "top1_mean", "top1_median", "top1_worst", "top1_std", "top1", "precision",
                   "fit_seconds_mean", "within", "note"]
        tables.append(
            f"{dataset} ({args.size}, {result['seconds']:.0f} s) -> {path}\n{format_table(shown, columns)}"
        )
    print("\n\n".join(tables))
    return 0


def _read_rows(path: Path) -> list[dict[str, Any]]:
    import json

    rows = json.loads(path.read_text())["rows"]
    for r in rows:
        r["top1"] = " ".join(f"{v:.1f}" for v in r["top1"]) or None
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
