"""DALI backend: pixel agreement with the folder backend, and ResNet-50 throughput against the ceiling.

(a) On the same files: DALI's raw decode (nvJPEG on a GPU) against PIL, and DALI's evaluation view
    (``Resize(eval_resize_size(image_size)) + CenterCrop(image_size)`` of the whole image) against the
    folder backend's (``load_canvas`` then ``GPUAugment``'s evaluation crop), in uint8 levels.
(b) In one run: the ceiling (ResNet-50 fp16 autocast + channels_last on one batch already on the GPU, plain
    PyTorch loop) against the pipeline alone (no model), against the plain loop fed by DALI or running
    beside it (what DALI's own GPU work takes from the model), and against the same model trained through
    Lightning (``precision="16-mixed"``, channels_last) fed by ``OptimizedDataModule(backend="dali")`` from
    8,192 ImageNet-sized JPEGs, for each ``DALIOptions``: ``decoder="gpu"`` (nvJPEG) and
    ``decoder="cpu"`` (DALI's CPU threads decode), and thread counts. An unfused-SGD row shows what the
    GradScaler's per-step host sync costs. Target: >= 0.95 of the ceiling.

``--focus`` runs only the Lightning rows of each decoder, three times in alternating order (median kept),
plus what each decoder's pipeline delivers alone and costs a model beside it.

    PYTHONPATH=. python3 benchmarks/gpu_dali.py --out $OUT/gpu_dali.json
    PYTHONPATH=. python3 benchmarks/gpu_dali.py --quick      # CPU pipelines, tiny images and model
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from _shared import quick_out

from lightning_gpuopt._common import available_cpus, eval_resize_size, format_table
from lightning_gpuopt.bench.measure import ThroughputMeter, plain_loop_throughput, write_results
from lightning_gpuopt.bench.synthetic import make_jpeg_folder
from lightning_gpuopt.data.dali import DALILoader, DALIOptions
from lightning_gpuopt.data.folder import scan_image_folder

T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def pixel_check(files: list[str], device: torch.device, image_size: int) -> dict[str, Any]:
    """DALI against the folder backend on the same files, in uint8 levels.

    Raw decode: DALI's decoder (nvJPEG on a GPU) against PIL. Evaluation view: ``DALILoader(train=False)``
    against the folder backend's path to the same view (``load_canvas`` at ``eval_resize_size(image_size)``,
    then ``GPUAugment``'s evaluation crop), both unnormalized.
    """
    from nvidia.dali import fn, pipeline_def, types
    from PIL import Image

    from lightning_gpuopt.data.folder import load_canvas
    from lightning_gpuopt.data.transforms import GPUAugment

    gpu = device.type == "cuda"
    n = len(files)

    @pipeline_def(batch_size=n, num_threads=4, device_id=device.index if gpu else None)
    def raw() -> Any:
        jpegs, _ = fn.readers.file(files=files)
        return fn.decoders.image(
            jpegs, device="mixed" if gpu else "cpu", output_type=types.RGB, jpeg_fancy_upsampling=True
        )

    pipe = raw()
    pipe.build()
    (out,) = pipe.run()
    out = out.as_cpu() if gpu else out
    raw_diffs = []
    for i, f in enumerate(files):
        with Image.open(f) as img:
            ref = np.asarray(img.convert("RGB"), dtype=np.float32)
        raw_diffs.append(np.abs(np.asarray(out.at(i), dtype=np.float32) - ref))
    raw_all = np.concatenate([d.ravel() for d in raw_diffs])

    mean, std = (0.0, 0.0, 0.0), (1 / 255, 1 / 255, 1 / 255)  # outputs in uint8 levels
    loader = DALILoader(
        files, [0] * n, batch_size=n, image_size=image_size, train=False, device=device,
        options=DALIOptions(threads=4), mean=mean, std=std,
    )  # fmt: skip
    images, _ = next(iter(loader))
    loader.close()
    dali = images.float().cpu()
    canvases, metas = zip(*(load_canvas(f, eval_resize_size(image_size)) for f in files), strict=True)
    folder = GPUAugment(image_size, mean=mean, std=std)(
        torch.from_numpy(np.stack(canvases)).to(device),
        torch.from_numpy(np.stack(metas)).to(device),
        train=False,
    )
    eval_diff = (dali - folder.float().cpu()).abs().numpy()
    return {
        "files": n,
        "raw_decode_mean_abs_diff": float(raw_all.mean()),
        "raw_decode_p99_abs_diff": float(np.percentile(raw_all, 99)),
        "raw_decode_max_abs_diff": float(raw_all.max()),
        "eval_mean_abs_diff": float(eval_diff.mean()),
        "eval_p99_abs_diff": float(np.percentile(eval_diff, 99)),
        "eval_max_abs_diff": float(eval_diff.max()),
    }


def _train_loader(dm_kwargs: dict[str, Any], device: torch.device, options: DALIOptions | None) -> DALILoader:
    from lightning_gpuopt.data.dali import build_dali_loader
    from lightning_gpuopt.data.datamodule import OptimizedDataModule

    # the training split always has a folder here, so the builder returns a loader (not the empty list)
    return cast(
        DALILoader,
        build_dali_loader(OptimizedDataModule(**dm_kwargs), "train", device=device, options=options),
    )


def dali_only(
    dm_kwargs: dict[str, Any], device: torch.device, batches: int, options: DALIOptions | None = None
) -> float:
    """Samples/s of the training pipeline alone (no model), synchronised at both ends."""
    loader = _train_loader(dm_kwargs, device, options)
    it = iter(loader)
    for _ in range(min(5, len(loader) - 1)):
        next(it)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(batches):
        try:
            next(it)
        except StopIteration:  # epoch end: the next epoch continues the stream
            it = iter(loader)
            next(it)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    rate = batches * loader.batch_size / (time.perf_counter() - t0)
    loader.close()
    return rate


def plain_fed(
    model_name: str,
    num_classes: int,
    dm_kwargs: dict[str, Any],
    device: torch.device,
    use_feed: bool,
    steps: int,
    warmup: int,
    options: DALIOptions | None = None,
) -> float:
    """The plain-loop ceiling with a DALI pipeline feeding it (``use_feed``) or running beside it, discarded.

    Fed: a hand-written DALI loop without Lightning. Beside: the model trains on its resident batch while
    the pipeline decodes and augments the same number of batches on the same GPU, so the drop against the
    ceiling is what DALI's own GPU work (nvJPEG's CUDA stages, resize, normalize) takes from the model.
    """
    from lightning_gpuopt.bench.models import build_model

    loader = _train_loader(dm_kwargs, device, options)

    def batches() -> Any:
        while True:
            yield from loader

    it = batches()
    rate = plain_loop_throughput(
        build_model(model_name, num_classes),
        dm_kwargs["batch_size"],
        image_size=dm_kwargs["image_size"],
        num_classes=num_classes,
        dtype=torch.float16 if device.type == "cuda" else None,
        device=device,
        steps=steps,
        warmup=warmup,
        feed=lambda: next(it),
        use_feed=use_feed,
    )
    loader.close()
    return rate


def lightning_dali(
    model_name: str,
    num_classes: int,
    dm_kwargs: dict[str, Any],
    steps: int,
    gpu: bool,
    options: DALIOptions | None = None,
    fused: bool | None = None,
) -> dict[str, Any]:
    """Train through Lightning fed by ``OptimizedDataModule(backend="dali", dali=options)``; samples/s."""
    import lightning.pytorch as pl

    from lightning_gpuopt.bench.models import ImageClassifier
    from lightning_gpuopt.data.datamodule import OptimizedDataModule

    dm = OptimizedDataModule(**dm_kwargs, dali=options)
    model = ImageClassifier(model_name, num_classes=num_classes, lr=0.01, fused=fused)
    model = model.to(memory_format=torch.channels_last)
    meter = ThroughputMeter(warmup=min(10, steps // 2))
    trainer = pl.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        precision="16-mixed" if gpu else "32-true",
        max_steps=steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[meter],
    )
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    return {"samples_per_sec": meter.samples_per_sec, "fit_seconds": time.perf_counter() - t0, "steps": steps}


def _options_fields(options: DALIOptions | None) -> dict[str, Any]:
    o = options or DALIOptions()
    return {"decoder": o.decoder, "threads": o.threads}


def focus_configs() -> list[tuple[str, DALIOptions | None]]:
    """The Lightning rows of ``--focus``: each decoder with its default threads, the CPU decoder on every core."""
    cores = available_cpus()
    return [
        ('decoder="gpu" (nvJPEG)', DALIOptions(decoder="gpu")),
        ('decoder="cpu", default threads', DALIOptions(decoder="cpu")),
        (f'decoder="cpu", {cores} threads (one a core)', DALIOptions(decoder="cpu", threads=cores)),
    ]


#: pipeline-only and model-beside rows: what each decoder delivers and what it costs the model
FOCUS_EXPLAIN: list[tuple[str, DALIOptions | None]] = [
    ('decoder="gpu" (nvJPEG)', DALIOptions(decoder="gpu")),
    ('decoder="cpu"', DALIOptions(decoder="cpu")),
]


def focus_run(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    ceiling: float,
    model_name: str,
    num_classes: int,
    dm_kwargs: dict[str, Any],
    steps: int,
    gpu: bool,
    images: int,
) -> int:
    """Each focus configuration three times (forward, reverse, forward order), the median kept."""
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    plain_steps, plain_warmup = (60, 15) if gpu else (3, 1)
    for name, options in FOCUS_EXPLAIN:
        only = dali_only(dm_kwargs, device, 100 if gpu else 4, options)
        rows.append(
            {"name": f"DALI alone, {name}", "samples_per_sec": only, "ratio_to_ceiling": only / ceiling}
        )
        beside = plain_fed(
            model_name, num_classes, dm_kwargs, device, False, plain_steps, plain_warmup, options
        )
        rows.append(
            {
                "name": f"plain loop, DALI beside, {name}",
                "samples_per_sec": beside,
                "ratio_to_ceiling": beside / ceiling,
            }
        )
        print(
            f"[{elapsed():.0f}s] {name}: alone {only:.0f}/s, model beside {beside / ceiling:.3f}", flush=True
        )
    configs = focus_configs()
    order = configs + configs[::-1] + configs
    runs: dict[str, list[float]] = {}
    for name, options in order:
        if elapsed() > args.budget_s - 15:
            print(f"[{elapsed():.0f}s] budget: skipping a run of {name}", flush=True)
            continue
        res = lightning_dali(model_name, num_classes, dm_kwargs, steps, gpu, options)
        if res["samples_per_sec"]:
            runs.setdefault(name, []).append(res["samples_per_sec"])
        print(f"[{elapsed():.0f}s] Lightning + DALI, {name}: {res['samples_per_sec']} samples/s", flush=True)
    best = 0.0
    for name, options in configs:
        rates = runs.get(name, [])
        sps = statistics.median(rates) if rates else None
        ratio = sps / ceiling if sps else None
        best = max(best, ratio or 0.0)
        rows.append(
            {
                "name": f"Lightning + DALI, {name}",
                "samples_per_sec": sps,
                "ratio_to_ceiling": ratio,
                "runs_ratio_to_ceiling": [round(r / ceiling, 4) for r in rates],
                **_options_fields(options),
            }
        )
    verdict = "pass" if best >= args.target else "short"
    write_results(
        args.out,
        rows,
        benchmark="gpu_dali_focus",
        quick=args.quick,
        model=model_name,
        batch_size=dm_kwargs["batch_size"],
        image_size=dm_kwargs["image_size"],
        dataset={"images": images},
        target_ratio=args.target,
        best_ratio=best,
        verdict=verdict,
        seconds=elapsed(),
    )
    print(
        f"best median ratio {best:.3f} (target {args.target}) -> {verdict}; {elapsed():.0f} s; wrote {args.out}"
    )
    print(format_table(rows, ["name", "samples_per_sec", "ratio_to_ceiling", "runs_ratio_to_ceiling"]))
    return 0


def jpeg_data(data_root: str, gpu: bool) -> Path:
    """The JPEG folder of the DALI benchmarks: 8,192 ImageNet-sized images on the GPU, 32 tiny ones else."""
    if gpu:
        return make_jpeg_folder(Path(data_root) / "imagenet_8192", num_images=8192, num_classes=100)
    return make_jpeg_folder(
        Path(data_root) / "quick_dali_32", num_images=32, num_classes=4, image_size=(64, 48), workers=1
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/gpu_dali.json")
    parser.add_argument("--quick", action="store_true", help="tiny CPU run that proves the script works")
    parser.add_argument("--data-root", default="/tmp/gpuopt_data")
    parser.add_argument("--budget-s", type=float, default=260.0)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument(
        "--focus",
        action="store_true",
        help="only the decisive Lightning comparisons of each decoder, each configuration three times in "
        "alternating order; no pixel check",
    )
    args = parser.parse_args()
    args.out = quick_out(args.out, parser.get_default("out"), args.quick)

    gpu = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    root = jpeg_data(args.data_root, gpu)
    if gpu:
        torch.backends.cudnn.benchmark = True  # same setting for the ceiling and the Lightning runs
        model_name, num_classes, batch, image_size = "resnet50", 100, 256, 224
        steps, dali_batches, plain_steps, plain_warmup = 150, 100, 60, 15
    else:
        model_name, num_classes, batch, image_size = "small", 4, 8, 32
        steps, dali_batches, plain_steps, plain_warmup = 6, 4, 3, 1
    print(f"[{elapsed():.0f}s] data at {root}", flush=True)
    _, samples = scan_image_folder(root)
    files = [p for p, _ in samples]

    pixels: dict[str, Any] = {"skipped": "--focus"}
    if not args.focus:
        pixels = pixel_check(files[:: max(1, len(files) // 16)][:16], device, image_size)
    print(f"[{elapsed():.0f}s] pixel check {pixels}", flush=True)

    from lightning_gpuopt.bench.models import build_model

    ceiling = plain_loop_throughput(
        build_model(model_name, num_classes),
        batch,
        image_size=image_size,
        num_classes=num_classes,
        dtype=torch.float16 if gpu else None,
        device=device,
        steps=plain_steps,
        warmup=plain_warmup,
    )
    print(f"[{elapsed():.0f}s] ceiling {ceiling:.1f} samples/s", flush=True)
    rows: list[dict[str, Any]] = [
        {"name": "ceiling (plain loop, batch on GPU)", "samples_per_sec": ceiling, "ratio_to_ceiling": 1.0}
    ]
    dm_kwargs = {
        "train_dir": str(root),
        "backend": "dali",
        "batch_size": batch,
        "image_size": image_size,
        "num_workers": "auto",
    }

    if args.focus:
        return focus_run(args, rows, ceiling, model_name, num_classes, dm_kwargs, steps, gpu, len(files))
    decoders: list[tuple[str, DALIOptions | None]] = [('decoder="gpu"', DALIOptions(decoder="gpu"))]
    if gpu:  # a CPU run decodes on the CPU whatever the options say
        decoders.append(('decoder="cpu"', DALIOptions(decoder="cpu")))
    for label, options in decoders:
        only = dali_only(dm_kwargs, device, dali_batches, options)
        rows.append(
            {
                "name": f"DALI pipeline alone (no model), {label}",
                "samples_per_sec": only,
                "ratio_to_ceiling": only / ceiling,
                **_options_fields(options),
            }
        )
        print(f"[{elapsed():.0f}s] DALI alone, {label}: {only:.1f} samples/s", flush=True)

    for name, use_feed in [
        ("plain loop fed by DALI (hand-written, no Lightning)", True),
        ("plain loop on its resident batch, DALI running beside", False),
    ]:
        sps = plain_fed(model_name, num_classes, dm_kwargs, device, use_feed, plain_steps, plain_warmup)
        rows.append({"name": name, "samples_per_sec": sps, "ratio_to_ceiling": sps / ceiling})
        print(f"[{elapsed():.0f}s] {name}: {sps:.1f} samples/s ratio {sps / ceiling:.3f}", flush=True)

    variants: list[tuple[str, DALIOptions | None]] = [("Lightning + DALI (defaults)", None)]
    if gpu:
        cores = available_cpus()
        variants += [
            ('Lightning + DALI decoder="cpu"', DALIOptions(decoder="cpu")),
            (f"Lightning + DALI {cores} threads (one a core)", DALIOptions(threads=cores)),
            ("Lightning + DALI 4 threads", DALIOptions(threads=4)),
            ("Lightning + DALI (defaults), again", None),
        ]
        # the per-step host sync of an unfused optimizer under GradScaler, measured in the same run
        res = lightning_dali(model_name, num_classes, dm_kwargs, steps, gpu, fused=False)
        sps = res["samples_per_sec"]
        rows.append(
            {
                "name": "Lightning + DALI (defaults), unfused SGD",
                "samples_per_sec": sps,
                "ratio_to_ceiling": sps / ceiling if sps else None,
                **res,
                "fused": False,
            }
        )
        print(f"[{elapsed():.0f}s] unfused SGD: {sps} samples/s", flush=True)
    best = 0.0
    for i, (name, options) in enumerate(variants):
        if i > 0 and elapsed() > args.budget_s - 20:
            rows.append({"name": f"{name} (skipped: time budget)", "samples_per_sec": None})
            continue
        res = lightning_dali(model_name, num_classes, dm_kwargs, steps, gpu, options)
        sps = res["samples_per_sec"]
        ratio = sps / ceiling if sps else None
        best = max(best, ratio or 0.0)
        rows.append(
            {
                "name": name,
                "samples_per_sec": sps,
                "ratio_to_ceiling": ratio,
                **res,
                **_options_fields(options),
            }
        )
        print(f"[{elapsed():.0f}s] {name}: {sps} samples/s ratio {ratio}", flush=True)

    verdict = "pass" if best >= args.target else "short"
    write_results(
        args.out,
        rows,
        benchmark="gpu_dali",
        quick=args.quick,
        model=model_name,
        batch_size=batch,
        image_size=image_size,
        dataset={"root": str(root), "images": len(files)},
        pixel_check=pixels,
        target_ratio=args.target,
        best_ratio=best,
        verdict=verdict,
        seconds=elapsed(),
    )
    print(f"pixel check: raw decode mean/max |diff| {pixels['raw_decode_mean_abs_diff']:.2f}/"
          f"{pixels['raw_decode_max_abs_diff']:.0f} levels; evaluation view against the folder backend "
          f"mean/max {pixels['eval_mean_abs_diff']:.2f}/{pixels['eval_max_abs_diff']:.0f}")  # fmt: skip
    print(f"best ratio {best:.3f} (target {args.target}) -> {verdict}; {elapsed():.0f} s; wrote {args.out}")
    print(format_table(rows, ["name", "samples_per_sec", "ratio_to_ceiling"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
