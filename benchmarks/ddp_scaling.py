"""DDP scaling: how close two GPUs come to twice one, for plain PyTorch DDP and a user's module through the
preset, on batches kept on the GPUs and fed from the uint8 store and from DALI.

    plain_1gpu, plain_ddp        a plain PyTorch loop (fp16 autocast, channels_last, fused SGD) on a resident
                                 batch; on two GPUs wrapped in DistributedDataParallel with its defaults
    lightning_1gpu, lightning_ddp  UserClassifier (torchvision's ResNet-50, its own SGD) through
                                 Trainer(**fast_trainer_kwargs(model[, devices=2, strategy="ddp"])),
                                 a resident batch
    hdf5_1gpu, hdf5_ddp          the same fed by OptimizedDataModule("store.h5") (reading threads, "auto")
    dali_1gpu, dali_ddp          the same fed by OptimizedDataModule("jpegs/", backend="dali"), the default
                                 decoder

The 1-GPU rows run in this process on GPU 0 with every CPU, as a user with one GPU has them; the 2-GPU rows
in the two ranks ``torch.distributed.run`` starts once (NCCL with NVLink SHARP/multicast off). Within each
group the rows take turns ``--repeats`` times; a repetition is a ``StepClock`` window on every rank, and a
2-GPU repetition's rate is both ranks' samples over the slower rank's seconds, its step times the slower
rank's at each step. ``scaling`` is a 2-GPU row's median over its own 1-GPU row's (``lightning_ddp`` also
over ``plain_1gpu``: ``synthetic``); ``targets`` are each >= 1.9 and the preset within 0.02 of plain DDP.

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    python3 benchmarks/ddp_scaling.py                  # two H200s: about 8 minutes
    python3 benchmarks/ddp_scaling.py --quick          # CPU (gloo, two processes) smoke run
"""

from __future__ import annotations

import argparse
import os
import pickle
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _shared import add_common, free, hdf5_store, measured_fit, report, resident, results_path, say, take_turns
from _zoo import UserClassifier, compiled_ceiling, measure_ceiling

from lightning_gpuopt.bench.steady import Measurement

ROOT = Path(__file__).resolve().parents[1]
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
FEEDS = ("plain", "lightning", "hdf5", "dali")
ROWS = tuple(f"{f}_{g}" for f in FEEDS for g in ("1gpu", "ddp"))
#: scaling figure -> (2-GPU row, 1-GPU row)
SCALING = {
    "plain_ddp": ("plain_ddp", "plain_1gpu"),
    "synthetic": ("lightning_ddp", "plain_1gpu"),
    "lightning": ("lightning_ddp", "lightning_1gpu"),
    "hdf5": ("hdf5_ddp", "hdf5_1gpu"),
    "dali": ("dali_ddp", "dali_1gpu"),
}
MIN_SCALING, MAX_LOSS_TO_PLAIN_DDP = 1.9, 0.02


def combine(per_rank: list[Measurement]) -> Measurement:
    """One DDP repetition from every rank's window: all samples over the slower rank's seconds."""
    steps = tuple(max(s) for s in zip(*(m.step_ms for m in per_rank), strict=False))
    return Measurement(sum(m.samples for m in per_rank), max(m.seconds for m in per_rank), steps)


def plain_ddp(args: argparse.Namespace, local: int) -> Measurement:
    """The plain loop with its model wrapped in ``DistributedDataParallel`` (defaults), on this rank."""
    loop, _ = compiled_ceiling(args.arch, args.batch_size, args.image_size, 100, args.device, compile=False)
    ids = [local] if args.device == "cuda" else None
    ddp = torch.nn.parallel.DistributedDataParallel
    loop.model = ddp(loop.model, device_ids=ids)  # type: ignore[arg-type]
    return measure_ceiling(loop, args.warmup, args.steps)


def lightning_row(row: str, args: argparse.Namespace) -> Measurement:
    """One fit of ``UserClassifier`` through the preset, on one GPU or two, resident or fed."""
    from lightning_gpuopt import OptimizedDataModule

    feed_name, gpus = row.split("_")
    trainer: dict[str, Any] = {"devices": 2, "strategy": "ddp"} if gpus == "ddp" else {}
    if feed_name == "lightning":  # every rank trains on its own resident batch
        trainer["use_distributed_sampler"] = False
        fit: dict[str, Any] = {"train_dataloaders": resident(args.batch_size, args.image_size, args.device)}
    else:
        backend = "hdf5" if feed_name == "hdf5" else "dali"
        dm = OptimizedDataModule(args.data_paths[backend], backend=backend, batch_size=args.batch_size,
                                 image_size=args.image_size)  # fmt: skip
        fit = {"datamodule": dm}
    model = UserClassifier(args.arch, num_classes=100)
    m = measured_fit(model, args.warmup, args.steps, device=args.device, trainer=trainer, **fit)
    free()
    return m


def worker(args: argparse.Namespace) -> None:
    """One of the two ranks: the 2-GPU rows taking turns; rank 0 pickles the combined repetitions."""
    import torch.distributed as dist

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(local)
        torch.backends.cudnn.benchmark = True
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")

    def variant(row: str) -> Callable[[], Measurement]:
        def go() -> Measurement:
            dist.barrier()
            mine = plain_ddp(args, local) if row == "plain_ddp" else lightning_row(row, args)
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            return combine(gathered)

        return go

    results = take_turns({r: variant(r) for r in args.rank_rows}, args.repeats,
                         on_result=say if rank == 0 else None)  # fmt: skip
    if rank == 0:
        kept = {
            k: [m if isinstance(m, Measurement) else RuntimeError(str(m)) for m in v]
            for k, v in results.items()
        }
        Path(args.workdir, "ranks.pkl").write_bytes(pickle.dumps(kept))
    dist.barrier()
    dist.destroy_process_group()


def launch_ranks(args: argparse.Namespace, rows: list[str], timeout: float) -> dict[str, list[Any]]:
    """The 2-GPU rows in two ranks of ``torch.distributed.run``, stopped with every rank past ``timeout``."""
    workdir = tempfile.mkdtemp(prefix="ddp_scaling_")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           "--worker", "--workdir", workdir, "--rank-rows", ",".join(rows), "--repeats", str(args.repeats),
           "--warmup", str(args.warmup), "--steps", str(args.steps), "--arch", args.arch,
           "--batch-size", str(args.batch_size), "--image-size", str(args.image_size)]  # fmt: skip
    cmd += [f"--{k}-path={v}" for k, v in args.data_paths.items()] + (["--quick"] if args.quick else [])
    env = {
        **NCCL_ENV,
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)  # its own group: stopped with its ranks
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        print(f"the ranks ran past --budget-s and were stopped ({timeout:.0f} s left)", file=sys.stderr)
    path = Path(workdir, "ranks.pkl")
    if not path.exists():
        return {
            r: [RuntimeError(f"the ranks exited with {proc.returncode} before writing results")] for r in rows
        }
    return pickle.loads(path.read_bytes())  # written by this script's own ranks


def prepare(args: argparse.Namespace, rows: list[str]) -> dict[str, str]:
    """The JPEG folder (DALI rows) and the store converted from it (HDF5 rows): 32 steps an epoch a rank."""
    from lightning_gpuopt.bench.synthetic import make_jpeg_folder

    if not any(r.startswith(("hdf5", "dali")) for r in rows):
        return {}
    n, size = (64, (64, 48)) if args.quick else (16384, (500, 375))
    jpegs = make_jpeg_folder(Path(args.data) / f"ddp_jpeg_{n}_{size[0]}x{size[1]}", num_images=n,
                             num_classes=100, image_size=size)  # fmt: skip
    store = jpegs.parent / f"{jpegs.name}_{args.storage}.h5"
    if any(r.startswith("hdf5") for r in rows):
        hdf5_store(jpegs, store, args.storage)
    return {"hdf5": str(store), "dali": str(jpegs)}


def scaling_of(results: dict[str, list[Any]]) -> dict[str, Any]:
    """Each ``SCALING`` figure from the rows' median rates, and whether the targets hold (null where a row
    did not run)."""
    rate = {
        name: statistics.median(m.samples_per_sec or 0.0 for m in ms if isinstance(m, Measurement))
        for name, ms in results.items()
        if any(isinstance(m, Measurement) for m in ms)
    }
    scaling = {k: rate[a] / rate[b] if a in rate and b in rate else None for k, (a, b) in SCALING.items()}
    loss = (
        None
        if None in (scaling["plain_ddp"], scaling["synthetic"])
        else scaling["plain_ddp"] - scaling["synthetic"]
    )
    targets = {f"{k} >= {MIN_SCALING}": None if scaling[k] is None else scaling[k] >= MIN_SCALING
               for k in ("synthetic", "hdf5", "dali")}  # fmt: skip
    targets[f"plain_ddp - synthetic <= {MAX_LOSS_TO_PLAIN_DDP}"] = (
        None if loss is None else loss <= MAX_LOSS_TO_PLAIN_DDP
    )
    return {"scaling": scaling, "targets": targets}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common(p, warmup=40, steps=150)
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows")
    p.add_argument("--data", default="/tmp/gpuopt_data", help="where the JPEGs and the store are made")
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--batch-size", type=int, default=256, help="samples a step a GPU")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--storage", type=int, default=256, help="the store's shorter side")
    p.add_argument("--budget-s", type=float, default=540.0, help="the ranks are stopped past this")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a rank, started by the parent
    for hidden in ("--workdir", "--rank-rows", "--hdf5-path", "--dali-path"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    if args.quick and not args.worker:
        args.arch, args.batch_size, args.image_size, args.storage = "small", 4, 32, 37
        args.warmup, args.steps, args.repeats = 2, 3, min(args.repeats, 2)
    args.rows = [r for r in args.rows.split(",") if r]
    if unknown := sorted(set(args.rows) - set(ROWS)):
        p.error(f"--rows: unknown {unknown}; choose from {', '.join(ROWS)}")
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        p.error(f"{torch.cuda.device_count()} GPU visible; the benchmark needs 2 (or --quick)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        args.rank_rows, args.data_paths = (
            args.rank_rows.split(","),
            {"hdf5": args.hdf5_path, "dali": args.dali_path},
        )
        worker(args)
        return 0
    t0 = time.perf_counter()
    if not any(r.startswith("dali") for r in args.rows) or _has_dali():
        skipped = {}
    else:
        skipped = {r: "nvidia.dali is not installed" for r in args.rows if r.startswith("dali")}
    rows = [r for r in args.rows if r not in skipped]
    args.data_paths = prepare(args, rows)
    torch.backends.cudnn.benchmark = args.device == "cuda"
    one = {r: (lambda r=r: lightning_row(r, args)) for r in rows if r.endswith("_1gpu") and r != "plain_1gpu"}
    if "plain_1gpu" in rows:
        loop, _ = compiled_ceiling(
            args.arch, args.batch_size, args.image_size, 100, args.device, compile=False
        )
        one = {"plain_1gpu": lambda: measure_ceiling(loop, args.warmup, args.steps), **one}
    results: dict[str, list[Any]] = dict(take_turns(one, args.repeats, on_result=say))
    two = [r for r in rows if r.endswith("_ddp")]
    if two:
        results.update(launch_ranks(args, two, args.budget_s - (time.perf_counter() - t0)))
    figures = scaling_of(results)
    per_row = {r: {"gpus": 2 if r.endswith("_ddp") else 1} for r in results}
    path = results_path(args.out, "ddp-scaling", args.quick)
    table = report(path, results, "plain_1gpu", label="x one GPU", per_row=per_row, skipped=skipped,
                   quick=args.quick, **figures, seconds=time.perf_counter() - t0,
                   settings={k: v for k, v in vars(args).items() if k != "rows"})  # fmt: skip
    for key, value in figures["scaling"].items():
        print(f"scaling {key}: {'-' if value is None else f'{value:.3f}'}")
    for key, ok in figures["targets"].items():
        print(f"{'-   ' if ok is None else 'PASS' if ok else 'MISS'}  {key}")
    return 0 if all(r["error"] is None for r in table) else 1


def _has_dali() -> bool:
    import importlib.util

    return (
        importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.dali") is not None
    )


if __name__ == "__main__":
    sys.exit(main())
