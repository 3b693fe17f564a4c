"""Where a run decodes its JPEGs: ``choose_decoder``, the one rule (DALI's too), and for the in-process
backends nvJPEG or threads of the training process, measured at setup on the run's own files."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_gpuopt._common import warn_once
from lightning_gpuopt.data import decode
from lightning_gpuopt.data.decode import DecodeOptions, decode_canvas_fast, default_decode_threads

__all__ = ["SAMPLE_IMAGES", "DecodeChoice", "choose_decoder", "measure_rates", "resolve_decoder"]

#: images of the run's own files the setup measurement decodes at least (a training batch's, where more)
SAMPLE_IMAGES = 64
_LOGGED: set[str] = set()


@dataclass
class DecodeChoice:
    """Where and on how many threads a run decodes JPEGs, why, and its rates (``measured``: they decided)."""

    decoder: str
    threads: int
    reason: str
    measured: bool = False
    cpu_rate: float | None = None
    gpu_rate: float | None = None


def choose_decoder(
    threads: int,
    cpu_rate: float,
    gpu_rate: float | None,
    *,
    model_rate: float | None = None,
    images: int | None = None,
) -> tuple[str, str]:
    """``("cpu" | "gpu", reason)``: CPU threads where they decode at least ``model_rate`` (when known) or
    nvJPEG's ``gpu_rate`` (``None``: no GPU); nvJPEG otherwise.

    Args:
        threads: the CPU threads measured.
        cpu_rate: images a second they decoded.
        gpu_rate: images a second nvJPEG decoded, ``None`` without a GPU.
        model_rate: images a second the model trains at, where known.
        images: how many of the run's files were measured, for the reason.

    Example:
        >>> choose_decoder(14, 4200.0, 9000.0)[0]
        'gpu'
        >>> choose_decoder(14, 4200.0, 9000.0, model_rate=3000.0)[0]
        'cpu'
    """
    head = f"{threads} CPU threads {cpu_rate:,.0f} img/s"
    tail = f", measured on {images} of your files" if images else ""
    if gpu_rate is None:
        return "cpu", f"{head}{tail}; no GPU to decode on"
    if model_rate is not None and cpu_rate >= model_rate:
        return "cpu", f"{head} >= the model's {model_rate:,.0f} img/s{tail}: the GPU is left to it"
    if gpu_rate > cpu_rate:
        slow = f" < {model_rate:,.0f} img/s the model trains at" if model_rate is not None else ""
        return "gpu", f"nvJPEG {gpu_rate:,.0f} img/s > {head}{slow}{tail}"
    return "cpu", f"{head} >= nvJPEG {gpu_rate:,.0f} img/s{tail}: the GPU is left to the model"


def measure_rates(dataset: Any, indices: Sequence[int], device: torch.device, image_size: int,
                  threads: int) -> tuple[float, float]:  # fmt: skip
    """``(images a second threads decode onto canvases, images a second nvJPEG decodes and crops)`` on
    ``indices`` of ``dataset``, each as in training (nvJPEG after one warm-up batch)."""
    from concurrent.futures import ThreadPoolExecutor

    from lightning_gpuopt.data.decode_gpu import NVJPEGCrops, read_jpeg_batch
    from lightning_gpuopt.data.transforms import AugmentConfig

    size = int(dataset.storage_size)

    def decode_share(share: Sequence[int]) -> None:
        canvas = np.empty(dataset.image_shape, dtype=np.uint8)
        for i in share:
            data, name = dataset.jpeg_bytes(i)
            decode_canvas_fast(data, size, canvas, name)

    shares = [list(indices)[t::threads] for t in range(threads)]
    # one intra-op thread a decoding thread, as the loader's reading threads have
    with ThreadPoolExecutor(threads, "lightning_gpuopt-measure", torch.set_num_threads, (1,)) as pool:
        start = time.perf_counter()
        list(pool.map(decode_share, shares))
        cpu = len(indices) / (time.perf_counter() - start)
    crops = NVJPEGCrops(image_size, AugmentConfig(), seed=0, device=device)
    batch = read_jpeg_batch(dataset, indices)
    cuda = device.type == "cuda"  # on a CPU, torchvision's CPU decoder stands in for nvJPEG
    side = torch.cuda.Stream(device) if cuda else None  # the staging thread's side stream, as in training
    with torch.cuda.device(device if cuda else -1), torch.cuda.stream(side):
        for _ in range(2):  # the first batch makes nvJPEG's handle and buffers
            start = time.perf_counter()
            crops(batch)
            if side is not None:
                side.synchronize()
    return cpu, len(batch) / (time.perf_counter() - start)


def _cpu_only(options: DecodeOptions, threads: int, reason: str) -> DecodeChoice:
    if options.decoder == "gpu":
        warn_once(f"DecodeOptions(decoder='gpu'): {reason}; decoding on CPU threads instead")
    return DecodeChoice("cpu", threads, reason)


def resolve_decoder(
    options: DecodeOptions | None,
    dataset: Any,
    *,
    device: torch.device,
    image_size: int,
    batch_size: int,
    local_world_size: int = 1,
    model_rate: float | None = None,
) -> DecodeChoice:
    """Where the training split ``dataset`` is decoded: ``options.decoder`` where set, CPU threads without
    CUDA or torchvision, else ``choose_decoder`` on ``measure_rates``; logged once on rank zero.

    Example:
        >>> resolve_decoder(DecodeOptions(decoder="cpu", threads=4), ds, device=torch.device("cpu"),
        ...                 image_size=224, batch_size=256)  # doctest: +SKIP
        DecodeChoice(decoder='cpu', threads=4, reason="DecodeOptions(decoder='cpu')", measured=False, ...)
    """
    options = options or DecodeOptions()
    cpu_threads = options.threads or default_decode_threads("cpu", local_world_size)
    gpu_threads = options.threads or default_decode_threads("gpu", local_world_size)
    if options.decoder == "cpu":
        choice = DecodeChoice("cpu", cpu_threads, "DecodeOptions(decoder='cpu')")
    elif device.type != "cuda":
        choice = _cpu_only(options, cpu_threads, "no CUDA device")
    elif decode._torchvision_io() is None:
        choice = _cpu_only(options, cpu_threads, "torchvision is not installed (pip install "
                           "'lightning-gpuopt[vision]' adds nvJPEG decoding on the GPU)")  # fmt: skip
    elif options.decoder == "gpu":
        choice = DecodeChoice("gpu", gpu_threads, "DecodeOptions(decoder='gpu')")
    else:
        try:
            n, k = len(dataset), max(SAMPLE_IMAGES, batch_size)
            sample = sorted({int(i) for i in np.linspace(0, n - 1, num=min(n, k))})
            cpu, gpu = measure_rates(dataset, sample, device, image_size, cpu_threads)
        except RuntimeError as err:  # a torchvision built without nvJPEG, or a GPU that refuses it
            return _log(DecodeChoice("cpu", cpu_threads, f"nvJPEG unavailable ({str(err).splitlines()[0]})"))
        decoder, reason = choose_decoder(cpu_threads, cpu, gpu, model_rate=model_rate, images=len(sample))
        threads = gpu_threads if decoder == "gpu" else cpu_threads
        choice = DecodeChoice(decoder, threads, reason, True, cpu, gpu)
    return _log(choice)


def log_decoder(who: str, decoder: str, cpu: str, reason: str, options: str, how: str = "") -> None:
    """Say once a process, on rank zero, where ``who`` decodes its JPEGs (``cpu``: its CPU threads) and why."""
    where = "with nvJPEG on the GPU" if decoder == "gpu" else f"on {cpu}"
    line = (
        f"{who}: JPEGs decoded {where} (decoder={decoder!r}{how}): {reason}; "
        f"{options}(decoder='cpu' or 'gpu') overrides"
    )
    if line not in _LOGGED:
        _LOGGED.add(line)
        rank_zero_info(line)


def _log(c: DecodeChoice) -> DecodeChoice:
    how = ", measured" if c.measured else ", chosen"
    log_decoder("OptimizedDataModule", c.decoder, f"{c.threads} CPU threads", c.reason, "DecodeOptions", how)
    return c
