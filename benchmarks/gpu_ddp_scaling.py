"""DDP on two GPUs: how close plain PyTorch DDP and Lightning with the preset come to twice one GPU, on
batches already on the GPUs and fed by ``OptimizedDataModule`` from a uint8 HDF5 store and from DALI.

ResNet-50, batch 256 a GPU, 224 px, fp16 autocast + channels_last, fused SGD; 20 warm-up steps, then 80
timed. Rows run by default:

- ``plain_1gpu``: a plain PyTorch loop on a batch resident on GPU 0 (rank 0; rank 1 waits): the 1-GPU rate
  ``scaling`` divides by,
- ``plain_ddp``: plain PyTorch ``DistributedDataParallel`` with its defaults, 2 GPUs,
- ``lightning_preset``: ``Trainer(**fast_trainer_kwargs(model, devices=2, strategy="ddp"))`` as users get it,
  on the same resident batches,
- ``lightning_1gpu``: the same preset on GPU 0 alone,
- ``hdf5_1gpu``, ``hdf5_ddp``: the preset fed by ``OptimizedDataModule(store, backend="hdf5",
  num_workers="auto")`` (workers measured per rank in ``setup``, cached), the store converted from generated
  500x375 JPEGs at 256 px,
- ``dali_1gpu``, ``dali_ddp``: the preset fed by ``OptimizedDataModule(jpeg_folder, backend="dali")`` with
  the decoder its default picks for the cores a rank has (the rows record which and why);
  ``dali_ddp_reserve3``: CPU decoding with three cores a rank kept for the training loop, DALI's executor
  and NCCL instead of the default's two (not a default row).

More rows through ``--rows`` (``--rows all`` runs every one): ``plain_ddp_view_static``
(``gradient_as_bucket_view=True, static_graph=True``), ``lightning_preset_blocking`` (the preset without
``NonBlockingStepChecks``), ``lightning_ddp_defaults`` (the preset's callbacks with ``DDPStrategy()``),
``lightning_view_static``, ``lightning_view_bucket100`` (``DDPStrategy`` settings) and
``lightning_no_callbacks`` (``DDPStrategy(**PRESET_DDP_KWARGS)`` without the preset's callbacks, the model
converted to channels_last and built with fused SGD beforehand).

The 1-GPU rows ``lightning_1gpu``, ``hdf5_1gpu`` and ``dali_1gpu`` run in this process on GPU 0 with the
whole machine's CPUs, as a user with one GPU has them; every other row runs in the two ranks
``torch.distributed.run`` starts once (NCCL, NVLink SHARP/multicast off:
``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1``, kept when set). The
JPEGs and the store are made once, before any row, with every core (``--data-root``, reused when present),
enough images that an epoch of a rank holds 32 steps. Each row runs ``--repeats`` times, in alternating
order; the median is kept.

``samples_per_sec`` is a row's combined rate (GPUs x batch x timed steps / the slower rank's seconds);
``scaling`` = that / ``plain_1gpu``; ``scaling_vs_own_1gpu`` of a fed 2-GPU row = that / its 1-GPU row. For
the median run of each row, ``raw`` keeps each rank's per-step lists (ms, 0.01 ms): ``gpu_ms`` (between CUDA
events recorded at each step start; no host sync per step), ``host_wall_ms`` and ``host_cpu_ms`` (the main
thread's ``time.thread_time()``), and ``epoch_starts`` (timed steps that began an epoch). How a slow step
reads: long on a rank's host clock but short in its CPU time, that thread waited (for a batch or for the
GPU); long in CPU time, the host was the bound; long on both ranks' GPUs while one rank's host was slow,
that rank straggled and the other waited in the all-reduce; long on both GPUs with both hosts steady, GPU
work or the all-reduce itself. ``slow_steps`` counts the steps
over 1.1x the median of each series and says whether those steps are the same on both ranks;
``host_cpu_frac`` is each rank's CPU time / wall time over the timed steps.

Besides ``ddp_scaling_<gpu>x2.json`` the run writes the report ``ddp_<gpu>x2.json`` (``ddp_report.py``:
scaling of each feed, targets, and ``gpu_ddp.py``'s correctness checks when ``--checks`` names its file).
The run prints what each row is expected to take before it starts, each row's median ``run_s`` at the end,
and stops the ranks when ``--budget-s`` (420 s) is spent, keeping the rows they finished. On the two-GPU
machine, both scripts in one command (about 2 minutes of checks, then about 6 of scaling on 2 H200s and
32 cores)::

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=.
    python3 benchmarks/gpu_ddp.py --out $OUT; \\
        python3 benchmarks/gpu_ddp_scaling.py --checks $OUT/ddp_checks_h200x2.json --out $OUT

``--quick`` runs the same rows on the CPU (gloo, tiny model and images, the DALI CPU pipeline when DALI
imports) to prove the script end to end.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _shared import QUIET_FIT  # noqa: E402

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
#: rows the two ranks run (``plain_1gpu`` on rank 0 alone)
RANK_ROWS = (
    "plain_1gpu",
    "plain_ddp",
    "plain_ddp_view_static",
    "lightning_preset",
    "lightning_preset_blocking",
    "lightning_ddp_defaults",
    "lightning_view_static",
    "lightning_view_bucket100",
    "lightning_no_callbacks",
    "hdf5_ddp",
    "dali_ddp",
    "dali_ddp_reserve3",
)
#: rows this process runs on GPU 0 with the whole machine's CPUs
PARENT_ROWS = ("lightning_1gpu", "hdf5_1gpu", "dali_1gpu")
ALL_ROWS = ("plain_1gpu", "lightning_1gpu", "hdf5_1gpu", "dali_1gpu", *RANK_ROWS[1:])
DEFAULT_ROWS = (
    "plain_1gpu",
    "plain_ddp",
    "lightning_preset",
    "lightning_1gpu",
    "hdf5_1gpu",
    "hdf5_ddp",
    "dali_1gpu",
    "dali_ddp",
)
#: a step slower than this times its series' median counts as slow
SLOW_STEP = 1.1
COLUMNS = [
    "name",
    "gpus",
    "samples_per_sec",
    "scaling",
    "scaling_vs_own_1gpu",
    "rank0_step_ms",
    "rank1_step_ms",
    "slow_gpu_steps",
    "run_s",
    "feed",
]


def _settings(quick: bool) -> dict[str, Any]:
    if quick:
        # 56 images: 7 batches (under MIN_TUNE_BATCHES: "auto" takes a worker a batch, no measurement)
        return {
            "model": "small",
            "classes": 10,
            "batch": 8,
            "image": 32,
            "warmup": 2,
            "steps": 6,
            "images": 56,
            "jpeg_size": (64, 48),
        }
    # 16,384 images: 32 steps an epoch on each of 2 ranks, 64 on one GPU
    return {
        "model": "resnet50",
        "classes": 1000,
        "batch": 256,
        "image": 224,
        "warmup": 20,
        "steps": 80,
        "images": 16384,
        "jpeg_size": (500, 375),
    }


#: expected seconds on 2 H200s: a step (1 GPU, 2 GPUs), each fit's start-up by kind, a worker-count
#: measurement (once per world size), the ranks' start
_STEP_S = {1: 0.042, 2: 0.050}
_SETUP_S = {"plain": 2.0, "lightning": 4.0, "hdf5": 7.0, "dali": 7.0}
_TUNE_S, _LAUNCH_S = 32.0, 20.0


def _kind(row: str) -> str:
    return row.split("_")[0] if row.startswith(("plain", "hdf5", "dali")) else "lightning"


def _gpus(row: str) -> int:
    return 1 if row.endswith("_1gpu") else 2


def estimate(rows: list[str], cfg: dict[str, Any], repeats: int) -> tuple[dict[str, float], float]:
    """Expected seconds of one run of each row on 2 H200s, and of the whole benchmark (data made apart)."""
    per_row = {r: _SETUP_S[_kind(r)] + (cfg["warmup"] + cfg["steps"]) * _STEP_S[_gpus(r)] for r in rows}
    tunes = len({_gpus(r) for r in rows if r.startswith("hdf5")})
    launch = _LAUNCH_S if any(r in RANK_ROWS for r in rows) else 0.0
    return per_row, repeats * sum(per_row.values()) + tunes * _TUNE_S + launch


# --------------------------------------------------------------------------------------------- one rank
class _Steps:
    """At each step start: a CUDA event (no sync until the end), the host's wall clock and the main
    thread's CPU time; the wall seconds of the timed steps."""

    def __init__(self, device: Any, warmup: int) -> None:
        self.device, self.warmup = device, warmup
        self.events: list[Any] = []
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.epoch_starts: list[int] = []
        self.t0 = 0.0
        self.count = 0

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def before_step(self, new_epoch: bool = False) -> None:
        import torch

        if self.count == self.warmup:
            self.sync()
            self.t0 = time.perf_counter()
        if self.count >= self.warmup:
            if self.device.type == "cuda":
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self.events.append(event)
            self.wall.append(time.perf_counter())
            self.cpu.append(time.thread_time())
            if new_epoch:
                self.epoch_starts.append(self.count - self.warmup)
        self.count += 1

    def finish(self) -> dict[str, Any]:
        import torch

        # the host's clocks stop before the final sync: waiting for the GPU there is no step's time
        self.wall.append(time.perf_counter())
        self.cpu.append(time.thread_time())
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append(end)
        self.sync()
        seconds = time.perf_counter() - self.t0

        def deltas(xs: list[float], scale: float) -> list[float]:
            return [round((b - a) * scale, 2) for a, b in itertools.pairwise(xs)]

        return {
            "seconds": seconds,
            "timed_steps": self.count - self.warmup,
            "gpu_ms": [round(a.elapsed_time(b), 2) for a, b in itertools.pairwise(self.events)],
            "host_wall_ms": deltas(self.wall, 1e3),
            "host_cpu_ms": deltas(self.cpu, 1e3),
            "epoch_starts": self.epoch_starts,
        }


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


def _lightning(
    cfg: dict[str, Any], device: Any, row: str, devices: int, data: dict[str, str | None] | None = None
) -> dict[str, Any]:
    """One Lightning fit: on resident batches, or fed by ``OptimizedDataModule`` (rows ``hdf5_*``,
    ``dali_*``, reading ``data[backend]``)."""
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
    from lightning_gpuopt.data.datamodule import OptimizedDataModule

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
            steps.before_step(new_epoch=batch_idx == 0)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            # the clock stops with the last step, not after the fit's teardown (not part of training speed)
            if steps.count == cfg["warmup"] + cfg["steps"] and not finished:
                finished.update(steps.finish())

    torch.manual_seed(0)
    net = build_model(cfg["model"], cfg["classes"])
    fed = row.startswith(("hdf5", "dali"))
    common: dict[str, Any] = {
        "accelerator": "gpu" if device.type == "cuda" else "cpu",
        "devices": devices,
        "max_steps": cfg["warmup"] + cfg["steps"],
        **QUIET_FIT,
    }
    if not fed:
        common["use_distributed_sampler"] = False  # every rank trains on its own resident batch
    precision = "16-mixed" if device.type == "cuda" else "bf16-mixed"
    strategies = {
        "lightning_preset": "ddp",
        "lightning_preset_blocking": "ddp",
        "lightning_ddp_defaults": DDPStrategy(),
        "lightning_view_static": DDPStrategy(gradient_as_bucket_view=True, static_graph=True),
        "lightning_view_bucket100": DDPStrategy(gradient_as_bucket_view=True, bucket_cap_mb=100),
        "hdf5_ddp": "ddp",
        "dali_ddp": "ddp",
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
    dm = None
    with quiet_lightning():
        if fed:
            backend = row.split("_")[0]
            source = (data or {}).get(backend)
            if source is None:
                raise ValueError(f"row {row}: no {backend} data was made; the parent passes --{backend}")
            extra: dict[str, Any] = {}
            if row.endswith("_reserve3"):
                # DALI's CPU threads with three cores a rank kept off decoding instead of the default's two
                from lightning_gpuopt._common import available_cpus
                from lightning_gpuopt.data.dali import DALIOptions

                share = available_cpus() // _gpus(row)
                extra["dali"] = DALIOptions(decoder="cpu", threads=max(1, share - 3))
            dm = OptimizedDataModule(
                source, backend=backend, batch_size=cfg["batch"], image_size=cfg["image"], **extra
            )  # num_workers="auto": per rank in setup; DALI: the default decoder
            trainer.fit(module, datamodule=dm)
        else:
            trainer.fit(module, DataLoader(SameBatch(cfg["warmup"] + cfg["steps"]), batch_size=None))
    result = dict(finished) if finished else steps.finish()
    comp = next((c for c in trainer.callbacks if isinstance(c, CompileModel)), None)  # type: ignore[attr-defined]
    result["compile_decision"] = None if comp is None or comp.decision is None else comp.decision.reason
    result["ddp_kwargs"] = {k: str(v) for k, v in getattr(trainer.strategy, "_ddp_kwargs", {}).items()}
    if dm is not None:
        info = getattr(trainer.train_dataloader, "feed_info", None)
        result["feed"] = info.to_dict() if info is not None else {"num_workers": dm.num_workers}
    return result


def _run_row(cfg: dict[str, Any], device: Any, row: str, rank: int, data: dict[str, str | None]) -> Any:
    if row == "plain_1gpu":
        return _plain(cfg, device, None) if rank == 0 else None
    if row.startswith("plain"):
        ddp = {} if row == "plain_ddp" else {"gradient_as_bucket_view": True, "static_graph": True}
        return _plain(cfg, device, ddp)
    return _lightning(cfg, device, row, _gpus(row), data)


def _worker(args: argparse.Namespace) -> None:
    """One of the two ranks ``torch.distributed.run`` starts: its rows, repeated, in alternating order."""
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
    data = {"hdf5": args.hdf5, "dali": args.dali}
    rows = args.rows.split(",")
    failed: set[str] = set()
    for rep in range(args.repeats):
        for row in rows if rep % 2 == 0 else rows[::-1]:
            if row in failed:
                continue
            dist.barrier()
            t0 = time.perf_counter()
            try:
                result = _run_row(cfg, device, row, rank, data)
            except Exception as err:  # one row's failure is recorded; the other rows still run
                traceback.print_exc()
                result = {"error": f"{type(err).__name__}: {err}"[:500]}
            # a row that failed on either rank is not repeated (both ranks learn it here)
            flag = torch.tensor([float("error" in (result or {}))], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                failed.add(row)
            if result is not None:
                result["wall_s"] = time.perf_counter() - t0
                with out.open("a") as f:
                    f.write(json.dumps({"row": row, "rep": rep, "rank": rank, **result}) + "\n")
            gc.collect()
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


def slow_steps(per_rank: dict[str, list[float]]) -> dict[str, Any] | None:
    """Steps over ``SLOW_STEP`` x the median of their rank's series: how many on each rank, which, how many
    are slow on every rank, and whether the ranks' slow steps are the same ones (None for one rank)."""
    found = {r: [i for i, v in enumerate(xs) if v > SLOW_STEP * statistics.median(xs)]
             for r, xs in per_rank.items() if xs}  # fmt: skip
    if not found:
        return None
    sets = [set(v) for v in found.values()]
    return {
        "count": {r: len(v) for r, v in found.items()},
        "steps": found,
        "shared": len(set.intersection(*sets)),
        "coincide": sets[0] == sets[1] if len(sets) == 2 else None,
    }


def _one_gpu_rows(
    args: argparse.Namespace, cfg: dict[str, Any], rows: list[str], data: dict[str, str | None]
) -> list[dict[str, Any]]:
    """The 1-GPU Lightning rows in this process, on GPU 0 with every CPU, in alternating order."""
    import torch

    cuda = torch.cuda.is_available() and not args.quick
    if cuda:
        from lightning_gpuopt.compute.precision import configure_backends

        configure_backends(tf32=True, cudnn_benchmark=True)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    runs: list[dict[str, Any]] = []
    failed: set[str] = set()
    for rep in range(args.repeats):
        for row in rows if rep % 2 == 0 else rows[::-1]:
            if row in failed:
                continue
            t0 = time.perf_counter()
            try:
                result = _lightning(cfg, device, row, 1, data)
            except Exception as err:  # one row's failure is recorded; the other rows still run
                traceback.print_exc()
                result = {"error": f"{type(err).__name__}: {err}"[:500]}
                failed.add(row)
            runs.append({"row": row, "rep": rep, "rank": 0, **result, "wall_s": time.perf_counter() - t0})
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    return runs


def _launch_ranks(args: argparse.Namespace, rows: list[str], data: dict[str, str | None], workdir: Path,
                  env: dict[str, str], timeout: float) -> int:  # fmt: skip
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(Path(__file__).resolve()), "--worker", "--workdir", str(workdir), "--repeats", str(args.repeats),
        "--rows", ",".join(rows),
    ]  # fmt: skip
    for key, value in data.items():
        if value is not None:
            cmd += [f"--{key}", value]
    if args.quick:
        cmd.append("--quick")
    # its own process group, so a run past its time limit is ended with every rank
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        print(f"the ranks ran past --budget-s ({timeout:.0f} s left) and were stopped", file=sys.stderr)
        return 124


def _make_data(
    cfg: dict[str, Any], root: Path, rows: list[str]
) -> tuple[dict[str, str | None], dict[str, Any]]:
    """The JPEG folder (DALI's rows) and the uint8 store converted from it (the HDF5 rows), made once."""
    from _shared import hdf5_store

    from lightning_gpuopt._common import eval_resize_size
    from lightning_gpuopt.bench.synthetic import make_jpeg_folder

    data: dict[str, str | None] = {"hdf5": None, "dali": None}
    notes: dict[str, Any] = {}
    if not any(r.startswith(("hdf5", "dali")) for r in rows):
        return data, notes
    w, h = cfg["jpeg_size"]
    t0 = time.perf_counter()
    jpegs = make_jpeg_folder(
        root / f"ddp_jpeg_{cfg['images']}_{w}x{h}",
        num_images=cfg["images"],
        num_classes=min(100, cfg["classes"]),
        image_size=(w, h),
    )
    notes["jpeg_seconds"] = round(time.perf_counter() - t0, 1)
    if any(r.startswith("dali") for r in rows):
        data["dali"] = str(jpegs)
    if any(r.startswith("hdf5") for r in rows):
        storage = eval_resize_size(cfg["image"])
        store = jpegs.parent / f"{jpegs.name}_{storage}.h5"
        notes["store"] = hdf5_store(jpegs, store, storage)
        data["hdf5"] = str(store)
    return data, notes


def _choose_rows(arg: str, cuda: bool, quick: bool) -> tuple[list[str], dict[str, str]]:
    """The rows asked for that can run here, and why each other asked-for row cannot."""
    wanted = list(ALL_ROWS) if arg == "all" else arg.split(",") if arg else list(DEFAULT_ROWS)
    skipped: dict[str, str] = {}
    dali = (
        importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.dali") is not None
    )
    h5py = importlib.util.find_spec("h5py") is not None
    for row in wanted:
        if row.startswith("dali") and not dali:
            skipped[row] = "nvidia.dali is not installed (pip install 'lightning-gpuopt[dali]')"
        elif row.startswith("dali") and not (cuda or quick):
            skipped[row] = "no CUDA device (--quick runs DALI's CPU pipeline)"
        elif row.startswith("hdf5") and not h5py:
            skipped[row] = "h5py is not installed"
    return [r for r in wanted if r not in skipped], skipped


def _rows_of(
    runs: list[dict[str, Any]], cfg: dict[str, Any], skipped: dict[str, str]
) -> list[dict[str, Any]]:
    """One row per name: median rate over repeats, and the median run's per-step lists and slow steps."""
    per_run: dict[tuple[str, int], list[dict[str, Any]]] = {}
    errors: dict[str, list[str]] = {}
    for r in runs:
        if "error" in r:
            errors.setdefault(r["row"], []).append(f"rank {r['rank']}, repeat {r['rep']}: {r['error']}")
        else:
            per_run.setdefault((r["row"], r["rep"]), []).append(r)
    by_row: dict[str, list[tuple[float, list[dict[str, Any]]]]] = {}
    for (name, _rep), ranks in sorted(per_run.items()):
        if name in errors:  # a repeat that ran on one rank only says nothing of the pair
            continue
        ranks.sort(key=lambda r: r["rank"])
        slowest = max(r["seconds"] for r in ranks)
        rate = len(ranks) * cfg["batch"] * ranks[0]["timed_steps"] / slowest
        by_row.setdefault(name, []).append((rate, ranks))
    rates = {name: statistics.median(rate for rate, _ in reps) for name, reps in by_row.items()}
    rows: list[dict[str, Any]] = []
    for name in ALL_ROWS:
        if name in skipped:
            rows.append({"name": name, "samples_per_sec": None, "skipped": skipped[name]})
        if name in errors:
            rows.append({"name": name, "samples_per_sec": None, "errors": errors[name]})
        if name not in by_row:
            continue
        reps = by_row[name]
        sps = rates[name]
        # the median run: the repeat whose rate is nearest the median (with 3 repeats, the median itself)
        rate, ranks = min(reps, key=lambda rr: abs(rr[0] - sps))
        first = ranks[0]
        series = {key: {str(r["rank"]): r[key] for r in ranks} for key in ("gpu_ms", "host_wall_ms")}
        one = rates.get("plain_1gpu")
        gpus = len(ranks)
        row: dict[str, Any] = {
            "name": name,
            "gpus": gpus,
            "samples_per_sec": sps,
            "runs": [rate for rate, _ in reps],
            "scaling": sps / one if one else None,
            "ratio_to_ceiling": sps / (gpus * one) if one else None,
            "gpu_util_mean": None,
            "data_wait_frac": None,
            "run_s": statistics.median(r["wall_s"] for _, rr in reps for r in rr),
            "median_run": next(r["rep"] for r in ranks),
            "rank_step_ms": {
                str(r["rank"]): _summarize_steps(r["gpu_ms"] or r["host_wall_ms"]) for r in ranks
            },
            "host_cpu_frac": {
                str(r["rank"]): round(sum(r["host_cpu_ms"]) / max(sum(r["host_wall_ms"]), 1e-9), 3)
                for r in ranks
            },
            "slow_steps": {key: slow_steps(value) for key, value in series.items()},
            "raw": {
                str(r["rank"]): {k: r[k] for k in ("gpu_ms", "host_wall_ms", "host_cpu_ms", "epoch_starts")}
                for r in ranks
            },
        }
        for rank in ("0", "1"):
            s = row["rank_step_ms"].get(rank)
            row[f"rank{rank}_step_ms"] = s["median"] if s else None
        slow = row["slow_steps"]["gpu_ms"] or row["slow_steps"]["host_wall_ms"]
        row["slow_gpu_steps"] = "/".join(str(v) for v in slow["count"].values()) if slow else None
        for key in ("compile_decision", "ddp_kwargs", "feed"):
            if first.get(key):
                row[key] = first[key]
        own = name.split("_")[0] + "_1gpu"
        if name.startswith(("hdf5", "dali")) and gpus == 2 and rates.get(own):
            row["scaling_vs_own_1gpu"] = sps / rates[own]
        if name.startswith("lightning") and gpus == 2 and rates.get("lightning_1gpu"):
            row["scaling_vs_own_1gpu"] = sps / rates["lightning_1gpu"]
        rows.append(row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="folder for ddp_scaling_<gpu>x2.json and the report ddp_<gpu>x2.json")
    p.add_argument("--quick", action="store_true", help="CPU, gloo, tiny model and images")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--rows", default="", help=f"comma-separated rows, or 'all' (default: {','.join(DEFAULT_ROWS)})"
    )
    p.add_argument("--checks", help="gpu_ddp.py's results file, read into the report's checks")
    p.add_argument("--data-root", default="/tmp/gpuopt_data", help="where the JPEGs and the store are made")
    p.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="seconds the whole run may take: the ranks are stopped then, the rows they finished kept",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--hdf5", help=argparse.SUPPRESS)
    p.add_argument("--dali", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return 0
    if not args.out:
        p.error("--out is required")
    unknown = [r for r in args.rows.split(",") if r] if args.rows != "all" else []
    unknown = [r for r in unknown if r not in ALL_ROWS]
    if unknown:
        p.error(f"--rows: unknown {unknown}; pick from {', '.join(ALL_ROWS)} or 'all'")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")

    import tempfile

    import torch
    from ddp_report import build_report, read_checks, report_rows

    from lightning_gpuopt._common import format_table
    from lightning_gpuopt.bench.measure import machine_info, write_results

    checks_doc = None
    if args.checks:
        try:
            checks_doc = read_checks(args.checks)
        except (ValueError, FileNotFoundError) as err:
            p.error(str(err))
    cuda = torch.cuda.is_available() and not args.quick
    if cuda and torch.cuda.device_count() < 2:
        p.error(f"this machine has {torch.cuda.device_count()} GPU(s); the benchmark needs 2 (or --quick)")
    cfg = _settings(args.quick)
    t_start = time.perf_counter()
    rows_to_run, skipped = _choose_rows(args.rows, cuda, args.quick)
    for row, why in skipped.items():
        print(f"skip {row}: {why}")
    per_row, total = estimate(rows_to_run, cfg, args.repeats)
    print(f"expected on 2 H200s (the full run): {total:.0f} s besides making the data; a run of each row:")
    print("  " + ", ".join(f"{r} {s:.0f} s" for r, s in per_row.items()))

    data, data_notes = _make_data(cfg, Path(args.data_root), rows_to_run)
    print(f"data ready after {time.perf_counter() - t_start:.0f} s: {data_notes}", flush=True)
    runs = _one_gpu_rows(args, cfg, [r for r in rows_to_run if r in PARENT_ROWS], data)
    rank_rows = [r for r in rows_to_run if r in RANK_ROWS]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for key, value in NCCL_ENV.items():
        env.setdefault(key, value)
    returncode = 0
    if rank_rows:
        workdir = Path(tempfile.mkdtemp(prefix="ddp_scaling_"))
        # what is left of the budget, less the time to write the results
        left = args.budget_s - (time.perf_counter() - t_start) - 10.0
        returncode = _launch_ranks(args, rank_rows, data, workdir, env, max(left, 1.0))
        for f in sorted(workdir.glob("rank*.jsonl")):
            runs += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        if returncode != 0:
            print(
                f"the 2-rank run exited with {returncode}; rows below are what it finished", file=sys.stderr
            )

    rows = _rows_of(runs, cfg, skipped)
    out = Path(args.out)
    gpu = torch.cuda.get_device_name(0).split()[-1].lower() if cuda else "cpu"
    scaling_path = out / f"ddp_scaling_{gpu}x2.json"
    report_path = out / (f"ddp_{gpu}x2.json" if cuda else "ddp_cpu.json")
    settings = {
        "model": cfg["model"],
        "batch_size_per_gpu": cfg["batch"],
        "image_size": cfg["image"],
        "warmup_steps": cfg["warmup"],
        "timed_steps": cfg["steps"],
        "repeats": args.repeats,
        "images": cfg["images"],
    }
    summary = {
        "nccl_env": {k: env.get(k) for k in NCCL_ENV},
        "launch_returncode": returncode,
        "expected_seconds": round(total, 1),
        "data": data_notes,
        "one_gpu_rows_in": "the parent process, GPU 0, every CPU",
    }
    scaling_doc = {"machine": machine_info(), "rows": rows, **settings, "results_file": scaling_path.name}
    report = build_report(scaling_doc, args.checks, checks_doc)
    summary["total_seconds"] = round(time.perf_counter() - t_start, 1)
    write_results(scaling_path, rows, benchmark="gpu_ddp_scaling", quick=args.quick, summary=summary,
                  scaling=report["scaling"], **settings)  # fmt: skip
    write_results(report_path, report_rows(rows), benchmark="gpu_ddp_scaling", **report)

    print(f"took {summary['total_seconds']:.0f} s (expected {total:.0f} s besides the data)")
    for key, value in report["scaling"].items():
        print(f"scaling {key}: {value:.3f}" if isinstance(value, float) else f"scaling {key}: {value}")
    for key, ok in report["targets_met"].items():
        print(f"{'-   ' if ok is None else 'PASS' if ok else 'FAIL'}  {key}")
    print(report["checks_note"])
    print(f"results: {scaling_path}\nreport: {report_path}")
    shown = [{**r, "feed": (r.get("feed") or {}).get("decoder") or (r.get("feed") or {}).get("num_workers")}
             for r in rows]  # fmt: skip
    print(format_table(shown, COLUMNS))
    return 0 if returncode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
