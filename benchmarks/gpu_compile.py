"""torch.compile on one GPU: ResNet-50 eager against compiled, in a plain loop and through Lightning.

Every row trains ResNet-50 (batch 256, 224 px) with fp16 autocast + channels_last and fused SGD:

- ``ceiling_eager``, ``ceiling_compiled``: a plain PyTorch loop on a batch resident on the GPU, the model
  as it is and ``torch.compile``d (default mode, ``dynamic=False``),
- ``lightning_eager``, ``lightning+compile``: ``Trainer(**fast_trainer_kwargs(model, compile=False|True))``
  on GPU-resident batches (the batch is not copied),
- ``hdf5+compile``: fed by ``OptimizedDataModule(backend="hdf5", num_workers=8)`` from a uint8 HDF5 store
  converted from generated JPEGs (skipped without h5py),
- ``dali+compile``: fed by ``OptimizedDataModule(backend="dali", dali=DALIOptions(decoder="cpu"))`` from the same
  JPEGs (only when ``nvidia.dali`` imports).

Throughput is the median of timed windows after warm-up; ``ratio_to_ceiling`` is against
``ceiling_compiled``. ``first_step_s`` is the wall time of the first training step, ``compile_s`` that
minus the eager row's first step (cuDNN autotuning happens in both): the one-time cost of compiling. The
summary gives what ``should_compile``'s constants are made of: ``step_saving`` (share of an eager step a
compiled one saves), ``compile_s`` and the break-even eager time ``compile_s / step_saving``.

Run on the GPU machine (one command, about 6 minutes)::

    PYTHONPATH=. python3 benchmarks/gpu_compile.py --out $OUT

Quick check on a CPU (tiny model and images, inductor's C++ kernels; a few minutes)::

    PYTHONPATH=. python3 benchmarks/gpu_compile.py --quick --out /tmp/compile_quick
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_gpuopt._common import eval_resize_size, format_table  # noqa: E402
from lightning_gpuopt.bench.measure import quiet_lightning, write_results  # noqa: E402
from lightning_gpuopt.bench.models import ImageClassifier, build_model  # noqa: E402
from lightning_gpuopt.compute.channels_last import apply_channels_last  # noqa: E402
from lightning_gpuopt.compute.compile import CompileModel, should_compile  # noqa: E402
from lightning_gpuopt.compute.precision import configure_backends, fast_trainer_kwargs  # noqa: E402

COLUMNS = ["name", "samples_per_sec", "ratio_to_ceiling", "first_step_s", "compile_s", "step_ms", "compiled"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class _Cfg:
    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        quick = args.quick
        self.device = device
        self.model = "small" if quick else "resnet50"
        self.classes = 10 if quick else 1000
        self.batch = 8 if quick else 256
        self.image = 32 if quick else 224
        self.warmup = 2 if quick else 10
        self.windows = 3
        self.window_steps = 3 if quick else 20
        self.amp = torch.float16 if device.type == "cuda" else torch.bfloat16
        self.precision = "16-mixed" if device.type == "cuda" else "bf16-mixed"
        self.images = 96 if quick else 8192
        self.jpeg_size = (64, 48) if quick else (500, 375)
        self.storage = eval_resize_size(self.image)
        self.workers = 2 if quick else 8

    @property
    def steps(self) -> int:
        return self.warmup + self.windows * self.window_steps


# --- the ceiling: a plain loop --------------------------------------------------------------------------
def plain_row(name: str, cfg: _Cfg, compiled: bool) -> dict[str, Any]:
    """The plain loop of ``plain_loop_throughput`` with the first step and the windows timed apart."""
    device = cfg.device
    torch.manual_seed(0)
    model = apply_channels_last(build_model(cfg.model, cfg.classes).to(device))
    x = torch.randn(cfg.batch, 3, cfg.image, cfg.image, device=device).contiguous(
        memory_format=torch.channels_last
    )
    ys = [torch.randint(0, cfg.classes, (cfg.batch,), device=device) for _ in range(8)]
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.amp == torch.float16)
    loss_fn = nn.CrossEntropyLoss()
    run = torch.compile(model, dynamic=False) if compiled else model
    count = 0

    def step() -> None:
        nonlocal count
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=cfg.amp):
            loss = loss_fn(run(x), ys[count % len(ys)])
        count += 1
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    model.train()
    _sync(device)
    t0 = time.perf_counter()
    step()
    _sync(device)
    first = time.perf_counter() - t0
    for _ in range(cfg.warmup):
        step()
    rates = []
    for _ in range(cfg.windows):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(cfg.window_steps):
            step()
        _sync(device)
        rates.append(cfg.window_steps * cfg.batch / (time.perf_counter() - t0))
    return {
        "name": name,
        "samples_per_sec": statistics.median(rates),
        "windows": rates,
        "first_step_s": first,
        "compiled": compiled,
    }


# --- through Lightning ----------------------------------------------------------------------------------
class _SameBatch(Dataset):
    """One batch on the GPU at every index (``batch_size=None``: the DataLoader passes it untouched)."""

    def __init__(self, x: torch.Tensor, ys: list[torch.Tensor], n: int) -> None:
        self.x, self.ys, self.n = x, ys, n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x, self.ys[index % len(self.ys)]

    def __len__(self) -> int:
        return self.n


class _Windows(pl.Callback):
    """The first batch's wall time, then samples/s in windows after warm-up (device syncs at the edges)."""

    def __init__(self, cfg: _Cfg) -> None:
        self.cfg = cfg
        self.first: float | None = None
        self.rates: list[float] = []
        self._t0 = 0.0
        self._done = 0  # batches finished, across epochs

    def _now(self, pl_module: pl.LightningModule) -> float:
        _sync(pl_module.device)
        return time.perf_counter()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int
    ) -> None:
        timed = self._done - self.cfg.warmup - 1  # batches 0 .. warmup are the first and the warm-up
        if self._done == 0 or (timed >= 0 and timed % self.cfg.window_steps == 0):
            self._t0 = self._now(pl_module)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, out: Any, batch: Any, i: int
    ) -> None:
        self._done += 1
        if self._done == 1:
            self.first = self._now(pl_module) - self._t0
        timed = self._done - self.cfg.warmup - 1
        if timed > 0 and timed % self.cfg.window_steps == 0:
            seconds = self._now(pl_module) - self._t0
            self.rates.append(self.cfg.window_steps * self.cfg.batch / seconds)


def lightning_row(
    name: str, cfg: _Cfg, compiled: bool, datamodule: pl.LightningDataModule | None = None
) -> dict[str, Any]:
    device = cfg.device
    torch.manual_seed(0)
    net = build_model(cfg.model, cfg.classes)  # a fed run's labels (< 100) fit in these classes
    module = ImageClassifier(net, lr=0.01)
    windows = _Windows(cfg)
    kwargs = fast_trainer_kwargs(
        net,
        device,
        compile=compiled,
        callbacks=[windows],
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
        max_steps=cfg.steps + 1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    if device.type != "cuda":
        kwargs["precision"] = cfg.precision  # the CPU check exercises the mixed-precision path too
    trainer = pl.Trainer(**kwargs)
    with quiet_lightning():
        if datamodule is None:
            x = torch.randn(cfg.batch, 3, cfg.image, cfg.image, device=device).contiguous(
                memory_format=torch.channels_last
            )
            ys = [torch.randint(0, cfg.classes, (cfg.batch,), device=device) for _ in range(8)]
            trainer.fit(module, DataLoader(_SameBatch(x, ys, cfg.steps + 1), batch_size=None))
        else:
            trainer.fit(module, datamodule=datamodule)
    comp = next((c for c in trainer.callbacks if isinstance(c, CompileModel)), None)  # type: ignore[attr-defined]
    row = {
        "name": name,
        "samples_per_sec": statistics.median(windows.rates) if windows.rates else None,
        "windows": windows.rates,
        "first_step_s": windows.first,
        "compiled": bool(comp and comp.compiled_calls),
        "compiled_calls": comp.compiled_calls if comp else 0,
        "eager_calls": comp.eager_calls if comp else 0,
        "precision": str(trainer.precision),
    }
    return row


def _jpegs(cfg: _Cfg, data_root: Path) -> Path:
    from lightning_gpuopt.bench.synthetic import make_jpeg_folder

    return make_jpeg_folder(
        data_root / f"jpeg_{cfg.images}_{cfg.jpeg_size[0]}x{cfg.jpeg_size[1]}",
        num_images=cfg.images,
        num_classes=min(100, cfg.classes),
        image_size=cfg.jpeg_size,
    )


def _datamodule(cfg: _Cfg, backend: str, data: Path) -> pl.LightningDataModule:
    from lightning_gpuopt.data.datamodule import OptimizedDataModule

    kw: dict[str, Any] = {"backend": backend, "batch_size": cfg.batch, "image_size": cfg.image}
    if backend == "hdf5":
        kw.update(num_workers=cfg.workers, storage_size=cfg.storage)
    else:
        from lightning_gpuopt.data.dali import DALIOptions

        kw.update(dali=DALIOptions(decoder="cpu"))
    return OptimizedDataModule(str(data), **kw)


# --- main -------------------------------------------------------------------------------------------------
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for compile_<gpu>.json")
    p.add_argument("--quick", action="store_true", help="tiny CPU run proving the script end to end")
    p.add_argument("--data-root", default="/tmp/gpuopt_data", help="where the generated JPEGs and store go")
    p.add_argument("--no-fed", action="store_true", help="skip the hdf5 and dali rows")
    p.add_argument("--budget-s", type=float, default=450.0, help="skip the fed rows past this")
    args = p.parse_args()

    t_start = time.perf_counter()
    cuda = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    cfg = _Cfg(args, device)
    if cuda:
        configure_backends(tf32=True, cudnn_benchmark=True)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")

    rows: list[dict[str, Any]] = []
    for name, row_fn, compiled in (
        ("ceiling_eager", plain_row, False),
        ("ceiling_compiled", plain_row, True),
        ("lightning_eager", lightning_row, False),
        ("lightning+compile", lightning_row, True),
    ):
        rows.append(row_fn(name, cfg, compiled))
        _free()  # the row's model and optimizer are gone with its frame
    skipped: list[str] = []
    notes: dict[str, Any] = {}
    if not args.no_fed:
        data_root = Path(args.data_root)
        t0 = time.perf_counter()
        jpegs = _jpegs(cfg, data_root)
        notes["jpeg_seconds"] = time.perf_counter() - t0
        if importlib.util.find_spec("h5py") is not None:
            from lightning_gpuopt.data.convert import convert_folder_to_hdf5

            store = data_root / f"{jpegs.name}_{cfg.storage}.h5"
            if not store.exists():
                t0 = time.perf_counter()
                convert_folder_to_hdf5(jpegs, store, storage_size=cfg.storage, progress=False)
                notes["convert_seconds"] = time.perf_counter() - t0
            if time.perf_counter() - t_start < args.budget_s:
                rows.append(lightning_row("hdf5+compile", cfg, True, _datamodule(cfg, "hdf5", store)))
                _free()
            else:
                skipped.append("hdf5+compile")
        else:
            skipped.append("hdf5+compile (no h5py)")
        dali = importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.dali")
        if dali and cuda and time.perf_counter() - t_start < args.budget_s:
            rows.append(lightning_row("dali+compile", cfg, True, _datamodule(cfg, "dali", jpegs)))
        else:
            skipped.append("dali+compile" + ("" if dali and cuda else " (no nvidia.dali or no GPU)"))

    by_name = {r["name"]: r for r in rows}
    ceiling = by_name["ceiling_compiled"]["samples_per_sec"]
    for r in rows:
        sps = r["samples_per_sec"]
        r["ratio_to_ceiling"] = sps / ceiling if sps and ceiling else None
        r["step_ms"] = 1000 * cfg.batch / sps if sps else None
        r.setdefault("gpu_util_mean", None)
        r.setdefault("data_wait_frac", None)
    eager_first = {
        "ceiling": by_name["ceiling_eager"]["first_step_s"],
        "lightning": by_name["lightning_eager"]["first_step_s"],
    }
    for r in rows:
        if r["compiled"] and r["first_step_s"] is not None:
            base = eager_first["ceiling" if r["name"].startswith("ceiling") else "lightning"]
            r["compile_s"] = r["first_step_s"] - (base or 0.0)

    summary: dict[str, Any] = {"skipped_rows": skipped, **notes}
    for prefix, eager, comp in (
        ("ceiling", "ceiling_eager", "ceiling_compiled"),
        ("lightning", "lightning_eager", "lightning+compile"),
    ):
        e, c = by_name[eager]["samples_per_sec"], by_name[comp]["samples_per_sec"]
        if e and c:
            saving = 1 - e / c  # share of an eager step's time the compiled step saves
            summary[f"{prefix}_speedup"] = c / e
            summary[f"{prefix}_step_saving"] = saving
            compile_s = by_name[comp].get("compile_s")
            if compile_s is not None and saving > 0:
                summary[f"{prefix}_compile_s"] = compile_s
                summary[f"{prefix}_break_even_s"] = compile_s / saving
    if cuda:
        eager_step = 1 / by_name["lightning_eager"]["samples_per_sec"] * cfg.batch
        # the rule's answer for an ImageNet epoch (5,005 steps at batch 256) and for 90 of them
        for epochs in (1, 90):
            d = should_compile(
                has_conv=True, device=device, steps_left=5005 * epochs, step_seconds=eager_step
            )
            summary[f"rule_imagenet_{epochs}_epochs"] = {"compile": d.compile, "reason": d.reason}

    out = Path(args.out)
    gpu = torch.cuda.get_device_name(0).split()[-1].lower() if cuda else "cpu"
    path = out / f"compile_{gpu}.json" if out.suffix != ".json" else out
    write_results(
        path,
        rows,
        benchmark="gpu_compile",
        model=cfg.model,
        batch_size=cfg.batch,
        image_size=cfg.image,
        device=str(device),
        quick=args.quick,
        summary=summary,
        total_seconds=time.perf_counter() - t_start,
    )
    for k, v in summary.items():
        print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    print(f"results: {path}")
    print(format_table(rows, COLUMNS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
