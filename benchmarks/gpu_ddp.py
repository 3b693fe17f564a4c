"""Two GPUs under DDP: every part of lightning-gpuopt checked for correctness on one run.

Run on a machine with two GPUs (about 2 minutes)::

    PYTHONPATH=. python3 benchmarks/gpu_ddp.py --out $OUT

The parent process launches one short Lightning fit per scenario as a child process (``--scenario``);
Lightning's DDP launcher re-executes the child once per GPU. Every rank writes what it saw (labels per
epoch, batch counts, the NVML device its monitor samples, the torch device's UUID) to a JSON file; the
parent checks them and writes ``ddp_checks_<gpu>x2.json`` (``ddp_checks_cpu.json`` under ``--quick``) with
a ``checks`` object, a flat map of named true/false results (``<scenario>.<check>``), ``all_passed`` and
the usual ``rows``. ``gpu_ddp_scaling.py --checks <that file>`` puts the checks into the DDP report
``ddp_<gpu>x2.json`` beside the scaling it measures.

Scenarios:
- ``correct-<backend>`` for ``folder``, ``hdf5`` and ``dali`` (when DALI imports): ``Trainer(devices=2,
  strategy="ddp")`` with GPUStatsMonitor(all_ranks=True), NVTXRanges, ChannelsLast and BottleneckAdvisor,
  a training set of 640 one-image classes (label = sample id; 640 = 5 x world_size x batch 64, so every
  sample is seen exactly once an epoch) and a validation set of 601 (not divisible by anything here: no
  hang, equal batch counts, each sample at least once, duplicates only from the sampler's padding).
- ``reordered``: the folder scenario with ``CUDA_VISIBLE_DEVICES=1,0``: rank 0 must sample NVML device 1.

On a GPU every correctness scenario also checks that each rank's monitor reads its own GPU (NVML's UUID and
torch's, compared normalized: torch spells it without NVML's ``GPU-`` prefix). How fast two GPUs train
against one is ``gpu_ddp_scaling.py``'s subject.

``--quick`` runs the correctness scenarios on the CPU (gloo, 2 processes, small sizes).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TRAIN_N, VAL_N, BATCH = 640, 601, 64
DEFAULT_OUT = str(ROOT / "benchmarks" / "results")


# --------------------------------------------------------------------------------------------- child side
def _child(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import CSVLogger

    from lightning_gpuopt import (
        BottleneckAdvisor,
        ChannelsLast,
        GPUStatsMonitor,
        NVTXRanges,
        OptimizedDataModule,
    )
    from lightning_gpuopt.bench.models import ImageClassifier

    out = Path(args.workdir) / args.scenario
    out.mkdir(parents=True, exist_ok=True)
    on_gpu = args.accelerator == "gpu"

    class Probe(ImageClassifier):
        """Records the labels (= sample ids) each rank trains and validates on, per epoch."""

        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self.train_seen: list[torch.Tensor] = []
            self.val_seen: list[torch.Tensor] = []
            self.records: list[dict[str, Any]] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.train_seen.append(batch[1].detach())
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            if not self.trainer.sanity_checking:
                self.val_seen.append(batch[1].detach())
            super().validation_step(batch, batch_idx)

        def on_validation_epoch_end(self) -> None:
            if self.trainer.sanity_checking:
                return
            self.records.append(
                {
                    "split": "val",
                    "epoch": self.current_epoch,
                    "batches": len(self.val_seen),
                    "labels": torch.cat(self.val_seen).tolist() if self.val_seen else [],
                }
            )
            self.val_seen = []

        def on_train_epoch_end(self) -> None:
            self.records.append(
                {
                    "split": "train",
                    "epoch": self.current_epoch,
                    "batches": len(self.train_seen),
                    "labels": torch.cat(self.train_seen).tolist() if self.train_seen else [],
                }
            )
            self.train_seen = []

    class MonitorProbe(pl.Callback):
        nvml_index: int | None = None

        def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if monitor.sampler is not None:
                self.nvml_index = monitor.sampler.index

    monitor = GPUStatsMonitor(all_ranks=True, log_every_n_steps=5)
    probe = MonitorProbe()
    advisor = BottleneckAdvisor()
    callbacks: list[pl.Callback] = [monitor, probe, ChannelsLast(), NVTXRanges(), advisor]
    train, val = (args.train, args.val) if args.backend != "hdf5" else (args.train_h5, args.val_h5)
    dm = OptimizedDataModule(
        train,
        val,
        backend=args.backend,
        batch_size=BATCH,
        num_workers=2,
        image_size=args.image_size,
        storage_size=args.image_size,
    )
    model = Probe(model="small", num_classes=TRAIN_N)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        precision="16-mixed" if on_gpu else "32-true",
        callbacks=callbacks,
        logger=CSVLogger(str(out), name="csv", version=0),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=5,
        num_sanity_val_steps=0,
        max_epochs=2,
    )
    trainer.fit(model, datamodule=dm)

    rank = trainer.global_rank
    device: dict[str, Any] = {"root_device": str(trainer.strategy.root_device)}
    device["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    if on_gpu:
        import pynvml

        idx = trainer.strategy.root_device.index
        device["torch_uuid"] = str(torch.cuda.get_device_properties(idx).uuid)
        # read while training (the sampler stops at teardown): the NVML device the monitor sampled
        nv = probe.nvml_index
        device["monitor_nvml_index"] = nv
        if nv is not None:
            pynvml.nvmlInit()
            try:
                device["monitor_nvml_uuid"] = str(
                    pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(nv))
                )
            finally:
                pynvml.nvmlShutdown()
    result = {
        "rank": rank,
        "world_size": trainer.world_size,
        "device": device,
        "records": model.records,
        "monitor_windows": len(monitor.history),
        "monitor_summary": monitor.summary(),
        "advisor": [v.kind for v in advisor.verdicts],
        "global_step": trainer.global_step,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))


# --------------------------------------------------------------------------------------------- parent side
def _run_child(
    args: argparse.Namespace, scenario: str, devices: int, env: dict[str, str] | None = None, **extra: Any
) -> float:
    cmd = [
        sys.executable,
        __file__,
        "--scenario",
        scenario,
        "--devices",
        str(devices),
        "--workdir",
        args.workdir,
        "--accelerator",
        args.accelerator,
        "--image-size",
        str(args.image_size),
    ]
    for key, value in extra.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    for key in ("train", "val", "train_h5", "val_h5"):
        if getattr(args, key):
            cmd += [f"--{key.replace('_', '-')}", getattr(args, key)]
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), full_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    t0 = time.perf_counter()
    print(f"[ddp] {scenario}: devices={devices} {env or ''}", flush=True)
    try:
        proc = subprocess.run(cmd, env=full_env, timeout=args.child_timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired as err:
        # the scenario's checks fail on its missing rank files; the other scenarios still run
        out = err.stdout.decode() if isinstance(err.stdout, bytes) else err.stdout or ""
        proc = subprocess.CompletedProcess(cmd, 124, out, f"timed out after {args.child_timeout:.0f} s")
    seconds = time.perf_counter() - t0
    log = Path(args.workdir) / f"{scenario}.log"
    log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        print(
            f"[ddp] {scenario} FAILED (rc={proc.returncode}); tail of its log:\n{proc.stderr[-3000:]}",
            flush=True,
        )
    return seconds


def _ranks(args: argparse.Namespace, scenario: str) -> list[dict[str, Any]]:
    folder = Path(args.workdir) / scenario
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]


def _csv_checks(args: argparse.Namespace, scenario: str) -> dict[str, bool]:
    path = Path(args.workdir) / scenario / "csv" / "version_0" / "metrics.csv"
    if not path.is_file():
        return {"logger_file_written": False}
    rows = list(csv.DictReader(path.open()))
    seen: Counter[tuple[str, str]] = Counter()
    keys: set[str] = set()
    for row in rows:
        for key, value in row.items():
            if key not in ("step", "epoch") and value not in ("", None):
                seen[(key, row["step"])] += 1
                keys.add(key)
    gpu_keys = {"gpu/util", "gpu/util/rank0", "gpu/util/rank1"} if args.accelerator == "gpu" else set()
    host_keys = {"time/data_wait_frac", "time/data_wait_frac/rank0", "time/data_wait_frac/rank1"}
    return {
        "logger_file_written": True,
        "no_duplicate_metric_rows": all(n == 1 for n in seen.values()),
        "rank_suffixed_keys_present": (gpu_keys | host_keys) <= keys,
    }


def _coverage(ranks: list[dict[str, Any]], split: str, n: int, world: int) -> dict[str, bool]:
    epochs = sorted({r["epoch"] for rk in ranks for r in rk["records"] if r["split"] == split})
    ok_once, ok_counts, ok_cover = bool(epochs), bool(epochs), bool(epochs)
    for epoch in epochs:
        per_rank = [[r for r in rk["records"] if r["split"] == split and r["epoch"] == epoch] for rk in ranks]
        if any(len(p) != 1 for p in per_rank) or len(per_rank) != world:
            return {f"{split}_records_complete": False}
        batches = {p[0]["batches"] for p in per_rank}
        ok_counts &= len(batches) == 1
        labels = Counter(label for p in per_rank for label in p[0]["labels"])
        if split == "train":
            ok_once &= set(labels) == set(range(n)) and all(c == 1 for c in labels.values())
        else:
            pad = sum(labels.values()) - n
            ok_cover &= set(labels) == set(range(n)) and 0 <= pad < world
    if split == "train":
        return {"train_each_sample_exactly_once": ok_once, "train_equal_batches_per_rank": ok_counts}
    return {"val_each_sample_covered_pad_lt_world": ok_cover, "val_equal_batches_per_rank": ok_counts}


def _device_checks(ranks: list[dict[str, Any]], expect_rank0_nvml: int | None) -> dict[str, bool]:
    from lightning_gpuopt.observe.nvml import normalize_uuid

    # torch spells a GPU's UUID without NVML's "GPU-" prefix: compare them normalized
    own = all(
        normalize_uuid(str(rk["device"].get("monitor_nvml_uuid")))
        == normalize_uuid(str(rk["device"].get("torch_uuid")))
        for rk in ranks
    )
    distinct = len({rk["device"].get("monitor_nvml_index") for rk in ranks}) == len(ranks)
    checks = {"monitor_reads_own_gpu": own and bool(ranks), "ranks_monitor_distinct_gpus": distinct}
    if expect_rank0_nvml is not None:
        r0 = next((rk for rk in ranks if rk["rank"] == 0), None)
        checks["rank0_maps_to_nvml_1_when_reordered"] = (
            r0 is not None and r0["device"].get("monitor_nvml_index") == expect_rank0_nvml
        )
    return checks


def _prepare_data(args: argparse.Namespace) -> None:
    from lightning_gpuopt.bench.synthetic import make_jpeg_folder

    base = Path(args.data_dir)
    size = (64, 48) if args.quick else (160, 120)
    args.train = str(make_jpeg_folder(base / "ddp_train", TRAIN_N, TRAIN_N, image_size=size))
    args.val = str(make_jpeg_folder(base / "ddp_val", VAL_N, VAL_N, image_size=size))
    args.train_h5 = str(base / f"ddp_train_{args.image_size}.h5")
    args.val_h5 = str(base / f"ddp_val_{args.image_size}.h5")
    from _shared import hdf5_store

    for src, dst in ((args.train, args.train_h5), (args.val, args.val_h5)):
        hdf5_store(src, dst, args.image_size)


def _out_path(args: argparse.Namespace) -> Path:
    """``--out`` when it names a ``.json`` file, else ``ddp_checks_<gpu>x2.json`` (``ddp_checks_cpu.json``)
    in that folder; a ``--quick`` run with the default ``--out`` writes to the temp folder instead."""
    from _shared import quick_out

    out = Path(args.out)
    if out.suffix != ".json":
        if args.accelerator == "gpu":
            import torch

            gpu = torch.cuda.get_device_name(0).split()[-1].lower()
            out = out / f"ddp_checks_{gpu}x2.json"
        else:
            out = out / "ddp_checks_cpu.json"
    default = str(Path(DEFAULT_OUT) / "ddp_checks_cpu.json")
    return Path(quick_out(str(out), default, args.quick))


def _parent(args: argparse.Namespace) -> int:
    from lightning_gpuopt._common import format_table
    from lightning_gpuopt._imports import _DALI_AVAILABLE
    from lightning_gpuopt.bench.measure import write_results

    if args.quick:
        args.accelerator = "cpu"
        args.image_size = 32
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    _prepare_data(args)
    checks: dict[str, bool] = {}
    rows: list[dict[str, Any]] = []
    backends = ["folder", "hdf5"] + (["dali"] if bool(_DALI_AVAILABLE) else [])
    notes: list[str] = [] if bool(_DALI_AVAILABLE) else ["DALI not importable here: correct-dali not run"]
    for backend in backends:
        scenario = f"correct-{backend}"
        seconds = _run_child(args, scenario, 2, backend=backend)
        ranks = _ranks(args, scenario)
        c = {"ran": len(ranks) == 2}
        c.update(_coverage(ranks, "train", TRAIN_N, 2))
        c.update(_coverage(ranks, "val", VAL_N, 2))
        c.update(_csv_checks(args, scenario))
        if args.accelerator == "gpu":
            c.update(_device_checks(ranks, None))
        checks.update({f"{scenario}.{k}": v for k, v in c.items()})
        rows.append(
            {
                "name": scenario,
                "samples_per_sec": None,
                "seconds": round(seconds, 1),
                "advisor": ranks[0]["advisor"] if ranks else None,
                "gpu_util_mean": ranks[0]["monitor_summary"].get("gpu/util") if ranks else None,
                "data_wait_frac": ranks[0]["monitor_summary"].get("time/data_wait_frac") if ranks else None,
                "checks_passed": all(c.values()),
            }
        )
    if args.accelerator == "gpu":
        _run_child(args, "reordered", 2, env={"CUDA_VISIBLE_DEVICES": "1,0"}, backend="folder")
        ranks = _ranks(args, "reordered")
        c = {"ran": len(ranks) == 2, **_device_checks(ranks, 1)}
        checks.update({f"reordered.{k}": v for k, v in c.items()})
        rows.append(
            {
                "name": "reordered CUDA_VISIBLE_DEVICES=1,0",
                "checks_passed": all(c.values()),
                "devices": {rk["rank"]: rk["device"] for rk in ranks},
            }
        )
    path = write_results(_out_path(args), rows, checks=checks, all_passed=all(checks.values()), notes=notes)
    print(format_table(rows, ["name", "seconds", "gpu_util_mean", "data_wait_frac", "checks_passed"]))
    for key, value in checks.items():
        print(f"{'PASS' if value else 'FAIL'}  {key}")
    print(f"wrote {path}")
    return 0 if all(checks.values()) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for ddp_checks_<gpu>x2.json, or a .json path")
    p.add_argument("--quick", action="store_true", help="CPU (gloo) correctness scenarios, small sizes")
    p.add_argument("--workdir", default="/tmp/gpuopt_ddp")
    p.add_argument("--data-dir", default="/tmp/gpuopt_data")
    p.add_argument("--accelerator", default="gpu")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--child-timeout", type=float, default=240)
    # child-only arguments
    p.add_argument("--scenario")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--backend", default="folder")
    for key in ("train", "val", "train-h5", "val-h5"):
        p.add_argument(f"--{key}")
    args = p.parse_args()
    if args.scenario:
        _child(args)
        return 0
    return _parent(args)


if __name__ == "__main__":
    raise SystemExit(main())
