"""DDP on two GPUs: how close plain PyTorch DDP and Lightning's DDP come to twice one GPU, and which
``DDPStrategy`` settings the preset should hand Lightning.

ResNet-50, batch 256 a GPU, fp16 autocast + channels_last, fused SGD, on batches resident on each GPU (no
data pipeline). Rows:

- ``plain_1gpu``: the plain loop on one GPU (the other waits): the 1-GPU rate every scaling divides by,
- ``lightning_1gpu``: ``Trainer(**fast_trainer_kwargs(model, devices=1))`` on one GPU,
- ``plain_ddp``: plain PyTorch ``DistributedDataParallel`` with its defaults, 2 GPUs,
- ``plain_ddp_view_static``: the same with ``gradient_as_bucket_view=True, static_graph=True``,
- ``lightning_preset``: ``Trainer(**fast_trainer_kwargs(model, devices=2, strategy="ddp"))``, as users get it
  (``DDPStrategy(**PRESET_DDP_KWARGS)``, ChannelsLast, FusedOptimizer, CompileModel(when="auto") which
  times 10 batches and stays eager in a run this short),
- ``lightning_ddp_defaults``: the preset's callbacks with ``DDPStrategy()`` (Lightning's defaults),
- ``lightning_view_static``: ``DDPStrategy(gradient_as_bucket_view=True, static_graph=True)``,
- ``lightning_view_bucket100``: ``DDPStrategy(gradient_as_bucket_view=True, bucket_cap_mb=100)``,
- ``lightning_no_callbacks``: ``DDPStrategy(**PRESET_DDP_KWARGS)`` without the preset's callbacks (the model
  converted to channels_last and built with fused SGD beforehand: the same work).

Each row runs 3 times in alternating order; the median is kept. ``samples_per_sec`` is the rows' combined
rate (2 GPUs x batch x steps / the slower rank's seconds); ``scaling`` = that / ``plain_1gpu``;
``ratio_to_ceiling`` = that / (GPUs x ``plain_1gpu``). ``rank_step_ms`` gives each rank's step times from
CUDA events (median, p90, max; no host sync per step).

Run on the two-GPU machine (one command, about 6 minutes)::

    PYTHONPATH=. python3 benchmarks/gpu_ddp_scaling.py --out $OUT

The 2-GPU rows run in two ranks started by ``torch.distributed.run`` (NCCL, with NVLink SHARP/multicast
off: ``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1``, kept when set).
``--quick`` runs everything on the CPU (gloo, tiny model) to prove the script end to end.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TWO_GPU_ROWS = (
    "plain_1gpu",
    "plain_ddp",
    "plain_ddp_view_static",
    "lightning_preset",
    "lightning_preset_blocking",
    "lightning_ddp_defaults",
    "lightning_view_static",
    "lightning_view_bucket100",
    "lightning_no_callbacks",
)
COLUMNS = ["name", "gpus", "samples_per_sec", "scaling", "ratio_to_ceiling", "rank0_step_ms", "rank1_step_ms"]


def _settings(quick: bool) -> dict[str, Any]:
    if quick:
        return {"model": "small", "classes": 10, "batch": 8, "image": 32, "warmup": 2, "steps": 6}
    return {"model": "resnet50", "classes": 1000, "batch": 256, "image": 224, "warmup": 10, "steps": 40}


# --------------------------------------------------------------------------------------------- one rank
class _Steps:
    """Per-step CUDA events (no sync until the end) and the wall time of the timed steps."""

    def __init__(self, device: Any, warmup: int) -> None:
        self.device, self.warmup = device, warmup
        self.events: list[Any] = []
        self.t0 = self.seconds = 0.0
        self.count = 0

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before_step(self) -> None:
        import torch

        if self.count == self.warmup:
            self.sync()
            self.t0 = time.perf_counter()
        if self.count >= self.warmup and self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)
        self.count += 1

    def finish(self) -> dict[str, Any]:
        import torch

        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append(end)
        self.sync()
        self.seconds = time.perf_counter() - self.t0
        steps_ms = [a.elapsed_time(b) for a, b in itertools.pairwise(self.events)]
        return {"seconds": self.seconds, "timed_steps": self.count - self.warmup, "step_ms": steps_ms}


def _plain(cfg: dict[str, Any], device: Any, ddp_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    import torch
    from torch import nn

    from lightning_gpuopt.bench.models import build_model
    from lightning_gpuopt.compute.channels_last import apply_channels_last

    torch.manual_seed(0)
    model = apply_channels_last(build_model(cfg["model"], cfg["classes"]).to(device))
    if ddp_kwargs is not None:
        ids = [device.index] if device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=ids, **ddp_kwargs)
    cuda = device.type == "cuda"
    x = torch.randn(cfg["batch"], 3, cfg["image"], cfg["image"], device=device)
    x = x.contiguous(memory_format=torch.channels_last)
    ys = [torch.randint(0, cfg["classes"], (cfg["batch"],), device=device) for _ in range(8)]
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=cuda or None)
    scaler = torch.amp.GradScaler(device.type, enabled=cuda)
    loss_fn = nn.CrossEntropyLoss()
    steps = _Steps(device, cfg["warmup"])
    for i in range(cfg["warmup"] + cfg["steps"]):
        steps.before_step()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.float16 if cuda else torch.bfloat16):
            loss = loss_fn(model(x), ys[i % len(ys)])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return steps.finish()


def _lightning(cfg: dict[str, Any], device: Any, row: str, devices: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, Dataset

    from lightning_gpuopt.bench.measure import quiet_lightning
    from lightning_gpuopt.bench.models import ImageClassifier, build_model
    from lightning_gpuopt.compute.channels_last import apply_channels_last
    from lightning_gpuopt.compute.compile import CompileModel
    from lightning_gpuopt.compute.ddp import NonBlockingStepChecks
    from lightning_gpuopt.compute.precision import PRESET_DDP_KWARGS, fast_trainer_kwargs

    class SameBatch(Dataset):
        def __init__(self, n: int) -> None:
            self.n = n
            self.x = torch.randn(cfg["batch"], 3, cfg["image"], cfg["image"], device=device).contiguous(
                memory_format=torch.channels_last
            )
            self.ys = [torch.randint(0, cfg["classes"], (cfg["batch"],), device=device) for _ in range(8)]

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self.x, self.ys[i % len(self.ys)]

        def __len__(self) -> int:
            return self.n

    steps = _Steps(device, cfg["warmup"])

    finished: dict[str, Any] = {}

    class StepTimes(pl.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            steps.before_step()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            # the clock stops with the last step, not after the fit's teardown (not part of training speed)
            if steps.count == cfg["warmup"] + cfg["steps"] and not finished:
                finished.update(steps.finish())

    torch.manual_seed(0)
    net = build_model(cfg["model"], cfg["classes"])
    common: dict[str, Any] = {
        "accelerator": "gpu" if device.type == "cuda" else "cpu",
        "devices": devices,
        "max_steps": cfg["warmup"] + cfg["steps"],
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "use_distributed_sampler": False,  # every rank trains on its own resident batch
    }
    precision = "16-mixed" if device.type == "cuda" else "bf16-mixed"
    strategies = {
        "lightning_preset": "ddp",
        "lightning_preset_blocking": "ddp",
        "lightning_ddp_defaults": DDPStrategy(),
        "lightning_view_static": DDPStrategy(gradient_as_bucket_view=True, static_graph=True),
        "lightning_view_bucket100": DDPStrategy(gradient_as_bucket_view=True, bucket_cap_mb=100),
    }
    if row == "lightning_no_callbacks":
        apply_channels_last(net)
        kwargs = {
            **common,
            "precision": precision,
            "benchmark": device.type == "cuda",
            "strategy": DDPStrategy(**PRESET_DDP_KWARGS),
            "callbacks": [StepTimes()],
        }
    else:
        strategy = strategies.get(row, "auto")
        kwargs = fast_trainer_kwargs(net, device, strategy=strategy, callbacks=[StepTimes()], **common)
        if row == "lightning_preset_blocking":  # the preset without its fix of Lightning's per-step host sync
            kwargs["callbacks"] = [c for c in kwargs["callbacks"] if not isinstance(c, NonBlockingStepChecks)]
        if device.type != "cuda":
            kwargs["precision"] = precision  # the CPU check runs the mixed-precision path too
    module = ImageClassifier(net, lr=0.01)  # fused SGD for CUDA parameters
    trainer = pl.Trainer(**kwargs)
    with quiet_lightning():
        trainer.fit(module, DataLoader(SameBatch(cfg["warmup"] + cfg["steps"]), batch_size=None))
    result = dict(finished) if finished else steps.finish()
    comp = next((c for c in trainer.callbacks if isinstance(c, CompileModel)), None)  # type: ignore[attr-defined]
    result["compile_decision"] = None if comp is None or comp.decision is None else comp.decision.reason
    strategy_obj = trainer.strategy
    result["ddp_kwargs"] = {k: str(v) for k, v in getattr(strategy_obj, "_ddp_kwargs", {}).items()}
    return result


def _worker(args: argparse.Namespace) -> None:
    """One of the two ranks ``torch.distributed.run`` starts: every 2-GPU row, repeated, in order."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    local = int(os.environ["LOCAL_RANK"])
    cfg = _settings(args.quick)
    cuda = torch.cuda.is_available() and not args.quick
    if cuda:
        torch.cuda.set_device(local)
        from lightning_gpuopt.compute.precision import configure_backends

        configure_backends(tf32=True, cudnn_benchmark=True)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    out = Path(args.workdir) / f"rank{rank}.jsonl"
    for rep in range(args.repeats):
        rows = [r for r in TWO_GPU_ROWS if not args.rows or r in args.rows.split(",")]
        order = rows if rep % 2 == 0 else rows[::-1]
        for row in order:
            dist.barrier()
            if row == "plain_1gpu":
                result = _plain(cfg, device, None) if rank == 0 else None
            elif row.startswith("plain"):
                ddp = {} if row == "plain_ddp" else {"gradient_as_bucket_view": True, "static_graph": True}
                result = _plain(cfg, device, ddp)
            else:
                result = _lightning(cfg, device, row, devices=2)
            if result is not None:
                with out.open("a") as f:
                    f.write(json.dumps({"row": row, "rep": rep, "rank": rank, **result}) + "\n")
            if cuda:
                torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------- parent
def _summarize_steps(step_ms: list[float]) -> dict[str, float] | None:
    if not step_ms:
        return None
    ordered = sorted(step_ms)
    return {
        "median": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "max": ordered[-1],
    }


def _one_gpu_lightning(args: argparse.Namespace, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    import torch

    cuda = torch.cuda.is_available() and not args.quick
    if cuda:
        from lightning_gpuopt.compute.precision import configure_backends

        configure_backends(tf32=True, cudnn_benchmark=True)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    runs = []
    for rep in range(args.repeats):
        runs.append(
            {"row": "lightning_1gpu", "rep": rep, "rank": 0, **_lightning(cfg, device, "lightning_1gpu", 1)}
        )
        if cuda:
            torch.cuda.empty_cache()
    return runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="folder for ddp_scaling_<gpu>x2.json (or a .json path)")
    p.add_argument("--quick", action="store_true", help="CPU, gloo, tiny model")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", default="", help="comma-separated 2-GPU rows to run (default: all)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return 0
    if not args.out:
        p.error("--out is required")

    import tempfile

    import torch

    from lightning_gpuopt._common import format_table
    from lightning_gpuopt.bench.measure import write_results

    cuda = torch.cuda.is_available() and not args.quick
    if cuda and torch.cuda.device_count() < 2:
        p.error(f"this machine has {torch.cuda.device_count()} GPU(s); the benchmark needs 2 (or --quick)")
    cfg = _settings(args.quick)
    t_start = time.perf_counter()

    runs = _one_gpu_lightning(args, cfg) if not args.rows or "lightning_1gpu" in args.rows.split(",") else []
    workdir = Path(tempfile.mkdtemp(prefix="ddp_scaling_"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for key, value in NCCL_ENV.items():
        env.setdefault(key, value)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(Path(__file__).resolve()), "--worker", "--workdir", str(workdir), "--repeats", str(args.repeats),
    ]  # fmt: skip
    if args.quick:
        cmd.append("--quick")
    if args.rows:
        cmd += ["--rows", args.rows]
    launch = subprocess.run(cmd, env=env, check=False)
    for f in sorted(workdir.glob("rank*.jsonl")):
        runs += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    if launch.returncode != 0:
        print(
            f"the 2-rank run exited with {launch.returncode}; rows below are what it finished",
            file=sys.stderr,
        )

    # combined rate of one run: every rank trained `batch` samples a step; the slower rank sets the pace
    per_run: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in runs:
        per_run.setdefault((r["row"], r["rep"]), []).append(r)
    rates: dict[str, list[float]] = {}
    extra: dict[str, dict[str, Any]] = {}
    for (row_name, _rep), ranks in sorted(per_run.items()):
        world = len(ranks)
        slowest = max(r["seconds"] for r in ranks)
        steps = ranks[0]["timed_steps"]
        rates.setdefault(row_name, []).append(world * cfg["batch"] * steps / slowest)
        info = extra.setdefault(row_name, {"gpus": world, "rank_step_ms": {}})
        for r in ranks:
            info["rank_step_ms"].setdefault(str(r["rank"]), []).extend(r.get("step_ms", []))
        for key in ("compile_decision", "ddp_kwargs"):
            if ranks[0].get(key) is not None:
                info[key] = ranks[0][key]

    one_gpu = statistics.median(rates["plain_1gpu"]) if rates.get("plain_1gpu") else None
    lightning_one = statistics.median(rates["lightning_1gpu"]) if rates.get("lightning_1gpu") else None
    rows = []
    for name in ("plain_1gpu", "lightning_1gpu", *[n for n in TWO_GPU_ROWS if n != "plain_1gpu"]):
        if name not in rates:
            continue
        info = extra[name]
        sps = statistics.median(rates[name])
        steps = {rank: _summarize_steps(ms) for rank, ms in info.pop("rank_step_ms").items()}
        row: dict[str, Any] = {
            "name": name,
            "samples_per_sec": sps,
            "runs": rates[name],
            "scaling": sps / one_gpu if one_gpu else None,
            "ratio_to_ceiling": sps / (info["gpus"] * one_gpu) if one_gpu else None,
            "gpu_util_mean": None,
            "data_wait_frac": None,
            "rank_step_ms": steps,
            **info,
        }
        if name.startswith("lightning") and lightning_one and info["gpus"] == 2:
            row["scaling_vs_lightning_1gpu"] = sps / lightning_one
        for rank in ("0", "1"):
            s = steps.get(rank)
            row[f"rank{rank}_step_ms"] = s["median"] if s else None
        rows.append(row)

    out = Path(args.out)
    gpu = torch.cuda.get_device_name(0).split()[-1].lower() if cuda else "cpu"
    path = out if out.suffix == ".json" else out / f"ddp_scaling_{gpu}x2.json"
    best = max((r for r in rows if r["name"].startswith("lightning_") and r["gpus"] == 2),
               key=lambda r: r["samples_per_sec"], default=None)  # fmt: skip
    preset = next((r["samples_per_sec"] for r in rows if r["name"] == "lightning_preset"), None)
    summary = {
        "one_gpu_plain": one_gpu,
        "best_lightning_row": best["name"] if best else None,
        "preset_to_best_lightning": preset / best["samples_per_sec"] if best and preset else None,
        "nccl_env": {k: env.get(k) for k in NCCL_ENV},
        "launch_returncode": launch.returncode,
    }
    write_results(
        path,
        rows,
        benchmark="gpu_ddp_scaling",
        model=cfg["model"],
        batch_size_per_gpu=cfg["batch"],
        image_size=cfg["image"],
        timed_steps=cfg["steps"],
        repeats=args.repeats,
        quick=args.quick,
        summary=summary,
        total_seconds=time.perf_counter() - t_start,
    )
    for k, v in summary.items():
        print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    print(f"results: {path}")
    print(format_table(rows, COLUMNS))
    return 0 if launch.returncode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
