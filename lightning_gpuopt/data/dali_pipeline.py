"""The DALI pipeline behind ``DALILoader``, and the checks and diagnostics around it.

``build_dali_pipeline`` defines one rank's pipeline: ``fn.readers.file`` sharded by rank, decoding with
nvJPEG (``device="mixed"``) or libjpeg-turbo on DALI's CPU threads, then torchvision's recipes on the
whole image. Training: ``RandomResizedCrop(image_size)`` with the ``AugmentConfig``'s area and aspect
ranges (torchvision's ``(0.08, 1)`` and ``(3/4, 4/3)`` by default; ten attempts, decoding only the crop)
+ horizontal flip. Evaluation: ``Resize(eval_resize_size(image_size))``
(shorter side, longer side truncated as torchvision computes it) + ``CenterCrop(image_size)`` (offsets
rounded as torchvision rounds them). Resizing uses the antialiased linear filter (PIL's bilinear). Output:
normalized fp16/fp32 NHWC. EXIF orientation is ignored, as PIL does, so every backend sees the same pixels.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from lightning_gpuopt._checks import check_arg, check_int
from lightning_gpuopt._common import IMAGENET_MEAN, IMAGENET_STD, available_cpus, eval_resize_size
from lightning_gpuopt._imports import require_dali
from lightning_gpuopt.data.transforms import CROP_ATTEMPTS, AugmentConfig

READER_NAME = "Reader"
#: where a GPU run decodes its JPEGs: nvJPEG on the GPU, or libjpeg-turbo on DALI's CPU threads
DECODERS = ("gpu", "cpu")
#: batches DALI prepares ahead
PREFETCH_QUEUE_DEPTH = 2
#: the training shuffle's seed: the same on every rank, so shards stay disjoint
SHUFFLE_SEED = 42
#: DALI's own default share for the hardware JPEG decoder (tuned for A100)
DALI_HW_DECODER_LOAD = 0.65

# Leading bytes of the formats DALI's image decoders read; a file that starts with none of them (or is
# empty) cannot be decoded, and DALI's error for it does not name the file, so it is caught up front.
_SIGNATURES: tuple[bytes, ...] = (
    b"\xff\xd8",  # JPEG
    b"\x89PNG",
    b"BM",  # BMP
    b"II*\x00",  # TIFF little endian
    b"MM\x00*",  # TIFF big endian
    b"RIFF",  # WebP
    b"\x00\x00\x00\x0cjP  ",  # JPEG 2000
    b"\xff\x4f\xff\x51",  # JPEG 2000 code stream
    *(f"P{k}".encode() for k in range(1, 7)),  # PNM
)
_SEARCH_BUDGET_S = 60.0
_FIX = "remove or replace it (DALI cannot decode it)"
_BOMB_FIX = (
    "refused as the folder and HDF5 backends refuse it: remove or replace the file, or raise "
    "PIL.Image.MAX_IMAGE_PIXELS if you trust it"
)


def dali_modules() -> tuple[Any, Any, Any]:
    """``(nvidia.dali, fn, types)``, or ``ModuleNotFoundError`` naming the extras to install."""
    dali = require_dali()
    from nvidia.dali import fn, types

    return dali, fn, types


def default_hw_decoder_load(device_id: int | None) -> float:
    """Share of JPEGs for the hardware decoder: 1.0 on compute capability >= 9.0 (Hopper on), else 0.65.

    Whatever the hardware decoder does not take is decoded by CUDA kernels on the SMs the model trains on;
    on Hopper the hardware decoder keeps up alone. ``device_id=None`` (CPU pipeline): unused, 0.65.
    """
    if device_id is None:
        return DALI_HW_DECODER_LOAD
    import torch

    try:
        major, _ = torch.cuda.get_device_capability(device_id)
    except (RuntimeError, AssertionError, AttributeError):  # no CUDA here: the pipeline will say so itself
        return DALI_HW_DECODER_LOAD
    return 1.0 if major >= 9 else DALI_HW_DECODER_LOAD


#: cores a rank keeps off CPU decoding: the training loop and DALI's executor
RESERVED_CORES = 2
#: JPEGs of the user's ``measure_decode_rates`` decodes (spread over the split), and the least seconds it
#: decodes them for on each decoder
SAMPLE_JPEGS, MEASURE_SECONDS = 64, 0.3


@dataclass(frozen=True)
class DecodeRates:
    """What ``measure_decode_rates`` measured on this host: images a second ``threads`` of DALI's CPU threads
    decode (``cpu``) and nvJPEG on this GPU decodes (``gpu``; ``None`` without one), over ``images`` of the
    split's JPEGs, as its loader decodes them (the training crop, or the whole image)."""

    cpu: float
    gpu: float | None
    images: int
    threads: int


def choose_decoder(rates: DecodeRates) -> tuple[str, str]:
    """Where a GPU run decodes its JPEGs by default: ``("cpu" | "gpu", reason)``, from this host's ``rates``.

    CPU threads where they decode at least as fast as nvJPEG on this GPU (both measured on the run's own
    files before its loader is built, so before any step: the model's rate is not known yet): the GPU is
    then left to the model; nvJPEG otherwise, which costs the model a share of the GPU beside it but keeps
    up where the rank's cores do not. Without a GPU figure the CPU threads decode.

    Example:
        >>> choose_decoder(DecodeRates(cpu=5900.0, gpu=9800.0, images=64, threads=14))[0]
        'gpu'
        >>> choose_decoder(DecodeRates(cpu=12000.0, gpu=9800.0, images=64, threads=30))[0]
        'cpu'
    """
    head = f"{rates.threads} CPU threads {rates.cpu:,.0f} img/s"
    tail = f", measured on {rates.images} of your files"
    if rates.gpu is None:
        return "cpu", f"{head}{tail}; no GPU to decode on"
    if rates.gpu > rates.cpu:
        return "gpu", f"nvJPEG {rates.gpu:,.0f} img/s > {head}{tail}"
    return "cpu", f"{head} >= nvJPEG {rates.gpu:,.0f} img/s{tail}: the GPU is left to the model"


def measure_decode_rates(
    jpegs: Sequence[bytes], *, threads: int, device_id: int | None, crop: AugmentConfig | None
) -> DecodeRates:
    """This host's decode rates on ``jpegs`` (the run's own files): DALI's CPU decoder on ``threads``
    threads, and nvJPEG (DALI's ``"mixed"`` decoder) on ``device_id`` where given; each decodes the whole
    sample as one batch, once to warm up, then for at least ``MEASURE_SECONDS``. ``crop``: the training
    crop's ranges (decode the crop only, as training does); ``None``: whole images, as evaluation does."""
    cpu = _decode_rate(jpegs, device="cpu", threads=threads, device_id=device_id, crop=crop)
    gpu = None
    if device_id is not None:
        gpu = _decode_rate(jpegs, device="mixed", threads=threads, device_id=device_id, crop=crop)
    return DecodeRates(cpu, gpu, len(jpegs), threads)


def _decode_rate(
    jpegs: Sequence[bytes], *, device: str, threads: int, device_id: int | None, crop: AugmentConfig | None
) -> float:
    """Images a second one DALI decoder (``device``: ``"cpu"`` or ``"mixed"``) decodes ``jpegs`` at."""
    import numpy as np

    dali, fn, types = dali_modules()
    batch = [np.frombuffer(data, dtype=np.uint8) for data in jpegs]
    kw: dict[str, Any] = {"device": device, "output_type": types.RGB}
    if device == "mixed":
        kw["hw_decoder_load"] = default_hw_decoder_load(device_id)

    @dali.pipeline_def(batch_size=len(batch), num_threads=threads, device_id=device_id, seed=0,
                       exec_pipelined=False, exec_async=False, prefetch_queue_depth=1)  # fmt: skip
    def pipeline() -> Any:
        data = fn.external_source(source=lambda: batch, batch=True, dtype=types.UINT8)
        if crop is None:
            return fn.decoders.image(data, **kw)
        return fn.decoders.image_random_crop(data, random_area=list(crop.scale),
                                             random_aspect_ratio=list(crop.ratio), num_attempts=CROP_ATTEMPTS,
                                             **kw)  # fmt: skip

    pipe = pipeline()
    pipe.build()
    pipe.run()  # warm-up: the decoders' start, nvJPEG's allocations
    runs, t0 = 0, time.perf_counter()
    while runs < 2 or time.perf_counter() - t0 < MEASURE_SECONDS:
        pipe.run()
        runs += 1
    if device == "mixed":
        import torch

        torch.cuda.synchronize(device_id)  # the last batch's decoding has finished
    seconds = time.perf_counter() - t0
    del pipe
    return runs * len(batch) / seconds


def default_num_threads(local_world_size: int = 1, decoder: str = "gpu") -> int:
    """DALI CPU threads per rank.

    ``decoder="gpu"`` (nvJPEG): half of this process's CPUs shared by the local ranks, 1..8; the other half
    is for the training loop, the CUDA driver and DALI's own executor threads. ``decoder="cpu"``: the
    threads decode every JPEG, so each rank takes its share of the CPUs less ``RESERVED_CORES`` (the
    training loop and DALI's executor), at least 1. See docs/benchmarks.md for the measurements behind both.
    """
    share = available_cpus() // max(1, local_world_size)
    if decoder == "cpu":
        return max(1, share - RESERVED_CORES)
    return max(1, min(8, share // 2))


def _torchvision_resize(fn: Any, types: Any, shape: Any, size: int) -> tuple[Any, Any]:
    """``(width, height)`` torchvision's ``Resize(size)`` gives an image of ``shape`` (H, W, C): the shorter
    side becomes ``size``, the longer ``int(size * long / short)`` (integer arithmetic, exact)."""
    h, w = shape[0], shape[1]
    portrait = fn.cast(w <= h, dtype=types.INT64)
    new_w = portrait * size + (1 - portrait) * ((size * w) // h)
    new_h = (1 - portrait) * size + portrait * ((size * h) // w)
    return fn.cast(new_w, dtype=types.FLOAT), fn.cast(new_h, dtype=types.FLOAT)


def _center_crop_pos(fn: Any, types: Any, length: Any, size: int) -> Any:
    """``crop_pos`` placing a ``size`` crop at torchvision's ``CenterCrop`` offset
    ``round((length - size) / 2)`` (Python rounds halves to even; DALI's own centring rounds them up)."""
    d = length - size
    k = d // 2
    offset = k + (d - 2 * k) * (k - 2 * (k // 2))
    return fn.cast(offset, dtype=types.FLOAT) / fn.cast(d + (d == 0), dtype=types.FLOAT)


def build_dali_pipeline(
    files: Sequence[str],
    labels: Sequence[int],
    *,
    batch_size: int,
    image_size: int,
    train: bool,
    device_id: int | None,
    decoder: str,
    num_threads: int,
    augment: AugmentConfig | None = None,
    shard_id: int = 0,
    num_shards: int = 1,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    half: bool = False,
    seed: int = 0,
    checkpointing: bool = False,
    checkpoint: bytes | str | None = None,
    source: Callable[[Any], Any] | None = None,
) -> Any:
    """Define (not build) the DALI pipeline for one rank.

    Args:
        files: image paths (the whole data set: the reader picks this rank's shard); ignored with ``source``.
        labels: class index of each file.
        batch_size: samples per batch on this rank.
        image_size: output height and width.
        train: reshuffle the file list every epoch (else read it in order, each rank its own shard).
        device_id: CUDA device for decoding and the GPU operators, or ``None`` for a CPU-only pipeline.
        decoder: ``"gpu"`` (nvJPEG, DALI's ``"mixed"`` decoder) or ``"cpu"`` (libjpeg-turbo on DALI's
            threads); a CPU pipeline decodes on the CPU either way.
        num_threads: DALI CPU threads.
        augment: the training crop and flip (``AugmentConfig``); ``None``: resize + center crop.
        shard_id: this rank's shard (global rank).
        num_shards: number of shards (world size).
        mean: per-channel mean in [0, 1] units.
        std: per-channel standard deviation in [0, 1] units.
        half: fp16 output instead of fp32.
        seed: seed of the random crops and flips.
        checkpointing: let the iterator save the reader and random state.
        checkpoint: a checkpoint from ``DALIGenericIterator.checkpoints()`` to restore.
        source: instead of reading ``files``, a batch callback for ``fn.external_source`` (``batch_info``:
            called with DALI's ``BatchInfo``) returning ``(JPEG byte arrays, int32 labels (n, 1))`` of this
            rank, raising ``StopIteration`` at the end of an epoch (``dali_store.StoreBatches``). DALI reads
            the arrays in place: the callback keeps each batch alive for ``PREFETCH_QUEUE_DEPTH`` more calls.

    Example:
        >>> pipe = build_dali_pipeline(files, labels, batch_size=64, image_size=224, train=True,
        ...                            device_id=0, decoder="gpu", num_threads=8,
        ...                            augment=AugmentConfig())  # doctest: +SKIP
    """
    check_arg(decoder in DECODERS, "decoder", decoder, f"one of {DECODERS}")
    check_int(num_threads, "num_threads", low=1)
    dali, fn, types = dali_modules()
    gpu = device_id is not None
    mean255 = [float(m) * 255.0 for m in mean]
    std255 = [float(s) * 255.0 for s in std]
    resize_kw = {"interp_type": types.INTERP_LINEAR, "antialias": True}  # PIL's bilinear
    decode_kw: dict[str, Any] = {"output_type": types.RGB, "adjust_orientation": False}
    if gpu and decoder == "gpu":
        # paddings from DALI's ImageNet example: avoid reallocations for the largest images
        decode_kw.update(
            device="mixed",
            hw_decoder_load=default_hw_decoder_load(device_id),
            device_memory_padding=211025920,
            host_memory_padding=140544512,
        )
    else:
        decode_kw["device"] = "cpu"
    op_device = "gpu" if gpu else "cpu"

    def _read_files(fn: Any) -> Any:
        return fn.readers.file(
            files=list(files),
            labels=[int(v) for v in labels],
            shard_id=shard_id,
            num_shards=num_shards,
            # training: a full shuffle of the whole list every epoch with a seed shared by all ranks, so
            # shards stay disjoint (a shuffle buffer would only mix neighbours of a class-sorted list)
            shuffle_after_epoch=train,
            shuffle_after_epoch_seed=SHUFFLE_SEED,
            # every shard the same size, a multiple of the batch; an epoch never reads into the next shard
            pad_last_batch=True,
            stick_to_shard=not train,  # evaluation reads the same files each epoch (page-cache friendly)
            name=READER_NAME,
        )

    @dali.pipeline_def(
        batch_size=batch_size,
        num_threads=num_threads,
        device_id=device_id,
        seed=seed,
        prefetch_queue_depth=PREFETCH_QUEUE_DEPTH,
        enable_checkpointing=checkpointing,
        checkpoint=checkpoint,
    )
    def pipeline() -> Any:
        if source is not None:
            jpegs, label = fn.external_source(
                source=source, num_outputs=2, batch=True, batch_info=True, dtype=[types.UINT8, types.INT32],
                no_copy=True,  # the source keeps each batch alive until DALI has consumed it
            )
        else:
            jpegs, label = _read_files(fn)
        if augment is not None:
            images = fn.decoders.image_random_crop(
                jpegs,
                random_area=list(augment.scale),
                random_aspect_ratio=list(augment.ratio),
                num_attempts=CROP_ATTEMPTS,
                **decode_kw,
            )
            if gpu and decode_kw["device"] == "cpu":
                images = images.gpu()  # the decoded crop goes to the GPU to be resized there
            images = fn.resize(
                images, device=op_device, resize_x=image_size, resize_y=image_size, **resize_kw
            )
            crop: dict[str, Any] = {}
            mirror = fn.random.coin_flip(probability=augment.flip_p)
        else:
            shape = fn.peek_image_shape(jpegs, adjust_orientation=False)
            # libjpeg's fancy upsampling, as PIL decodes
            images = fn.decoders.image(jpegs, jpeg_fancy_upsampling=True, **decode_kw)
            if gpu and decode_kw["device"] == "cpu":
                images = images.gpu()
            new_w, new_h = _torchvision_resize(fn, types, shape, eval_resize_size(image_size))
            images = fn.resize(images, device=op_device, resize_x=new_w, resize_y=new_h, **resize_kw)
            crop = {
                "crop": (image_size, image_size),
                "crop_pos_x": _center_crop_pos(fn, types, fn.cast(new_w, dtype=types.INT64), image_size),
                "crop_pos_y": _center_crop_pos(fn, types, fn.cast(new_h, dtype=types.INT64), image_size),
            }
            mirror = 0
        images = fn.crop_mirror_normalize(
            images,
            device=op_device,
            dtype=types.FLOAT16 if half else types.FLOAT,
            output_layout="HWC",  # NHWC batch == channels_last NCHW view, no copy
            mean=mean255,
            std=std255,
            mirror=mirror,
            **crop,
        )
        label = fn.cast(label, dtype=types.INT64)
        if gpu:
            label = label.gpu()
        return images, label

    return pipeline()


# -- files: checked up front, named when DALI fails --------------------------------------------------


_JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg_size(fh: Any) -> tuple[int, int] | None:
    """``(width, height)`` from a JPEG's frame header (the markers before it skipped by their lengths)."""
    pos = 2
    while True:
        fh.seek(pos)
        seg = fh.read(4)
        if len(seg) < 4 or seg[0] != 0xFF:
            return None
        marker = seg[1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            pos += 2
            continue
        if marker in (0xD9, 0xDA):  # end of image, start of scan: no frame header before them
            return None
        if marker in _JPEG_SOF:
            frame = fh.read(5)
            if len(frame) < 5:
                return None
            return int.from_bytes(frame[3:5], "big"), int.from_bytes(frame[1:3], "big")
        pos += 2 + int.from_bytes(seg[2:4], "big")


def _pixel_check(fh: Any, head: bytes, path: str) -> str | None:
    """PIL's pixel limit for an open image file, read from its header alone (no pixel is decoded).

    PNG and JPEG sizes are read directly (the IHDR chunk; the frame header) and checked by
    ``pixel_limit_problem``; other formats are opened with ``PIL.Image.open``, which parses only the header
    and applies the same rule itself. ``head`` holds the file's first 24 bytes (or the whole file). A
    header that cannot be read passes: DALI decodes the file or names it.
    """
    size = None
    if head.startswith(b"\x89PNG") and head[12:16] == b"IHDR" and len(head) >= 24:
        size = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    elif head.startswith(b"\xff\xd8"):
        size = _jpeg_size(fh)
    if size is not None:
        return pixel_limit_problem(path, size)
    from PIL import Image

    fh.seek(0)
    try:
        with Image.open(fh):
            return None
    except Image.DecompressionBombError as err:
        return f"image {path!r} is a possible decompression bomb ({err}); {_BOMB_FIX}"
    except Exception:  # noqa: BLE001 -- a header PIL cannot parse: DALI decodes it or names it
        return None


def pixel_limit_problem(path: str, size: tuple[int, int]) -> str | None:
    """PIL's decompression-bomb rule for an image of ``size``, as the folder and HDF5 backends apply it.

    ``PIL.Image.MAX_IMAGE_PIXELS`` (read at each call; None turns the check off): above it a
    ``DecompressionBombWarning``, above twice it the image is refused (returns why).
    """
    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS
    width, height = size
    pixels = width * height
    if limit is None or pixels <= limit:
        return None
    if pixels > 2 * limit:
        return (
            f"image {path!r} is {width}x{height} = {pixels:,} pixels, more than twice PIL's limit "
            f"(PIL.Image.MAX_IMAGE_PIXELS = {limit:,}): a possible decompression bomb; {_BOMB_FIX}"
        )
    warnings.warn(
        f"image {path!r} is {width}x{height} = {pixels:,} pixels, over PIL.Image.MAX_IMAGE_PIXELS = "
        f"{limit:,}: it could be a decompression bomb",
        Image.DecompressionBombWarning,
        stacklevel=2,
    )
    return None


def validate_image_files(files: Sequence[str], num_threads: int = 8) -> None:
    """Check that every file exists, is non-empty, starts with a known image signature and is within
    PIL's pixel limit.

    A cheap read of each file's header (threaded): its leading bytes and its size in pixels, checked by
    ``pixel_limit_problem``, the rule the other backends apply through PIL (``_pixel_check``).
    Full decodability is only known when DALI decodes the file, and ``DALILoader`` then names the file in
    its error.

    Raises:
        ValueError: naming the first bad file and the fix.
    """

    def check(path: str) -> str | None:
        try:
            with open(path, "rb") as fh:
                head = fh.read(24)
                if not head:
                    return f"corrupt or unreadable image: {path!r} is empty; {_FIX}"
                if not head.startswith(_SIGNATURES):
                    return (
                        f"corrupt or unreadable image: {path!r} is not a JPEG/PNG/BMP/TIFF/WebP/JPEG 2000/"
                        f"PNM image (unknown leading bytes); {_FIX}"
                    )
                return _pixel_check(fh, head, path)
        except OSError as err:
            return f"corrupt or unreadable image: {path!r} cannot be read ({err.strerror}); {_FIX}"

    with ThreadPoolExecutor(max_workers=max(1, num_threads)) as pool:
        for problem in pool.map(check, files, chunksize=256):
            if problem is not None:
                raise ValueError(problem)


def _file_in_message(message: str, files: Sequence[str]) -> str | None:
    match = re.search(r"Failed to decode sample #\d+\s*:\s*(\S.*?)\s*$", message, re.MULTILINE)
    if match:
        return match.group(1)
    for path in files:  # failure path only: a linear scan is fine
        if path in message:
            return path
    return None


def _find_undecodable(files: Sequence[str], budget_s: float) -> str | None:
    """The first file PIL cannot fully decode, searching for at most ``budget_s`` seconds (failure path)."""
    from PIL import Image

    def bad(path: str) -> bool:
        try:
            with Image.open(path) as img:
                img.load()
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
            return True
        return False

    deadline = time.monotonic() + budget_s
    chunk = 256
    with ThreadPoolExecutor(max_workers=min(16, available_cpus())) as pool:
        for start in range(0, len(files), chunk):
            part = files[start : start + chunk]
            for path, is_bad in zip(part, pool.map(bad, part), strict=True):
                if is_bad:
                    return path
            if time.monotonic() > deadline:
                return None
    return None


def decode_error(err: RuntimeError, files: Sequence[str]) -> Exception:
    """DALI's decoding error re-worded to name the file (``ValueError``); other errors come back unchanged."""
    message = str(err)
    if "decod" not in message and "nvImageCodec" not in message:
        return err
    path = _file_in_message(message, files)
    if path is None:
        # some codec errors ("nvImageCodec failure: '#3'") do not name the file: look for it with PIL
        path = _find_undecodable(files, budget_s=_SEARCH_BUDGET_S)
    if path is not None:
        return ValueError(
            f"DALI could not decode image {path!r}; remove or replace the file. DALI said: {err}"
        )
    return RuntimeError(
        f"{message}\nlightning-gpuopt: an image failed to decode and no file could be identified within "
        f"{_SEARCH_BUDGET_S:.0f} s; check the data set with PIL (Image.open(path).load())"
    )


# -- thread priority ---------------------------------------------------------------------------------


def thread_ids() -> set[int]:
    """Ids of this process's threads (Linux; empty elsewhere)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def renice_dali_workers(existing: set[int], nice: int) -> list[int]:
    """Lower the priority of DALI pool threads started since ``existing`` (thread ids) by ``nice``.

    DALI names its pool threads ``[DALI][TP<n>]...``; its executor and prefetch threads, the CUDA driver's
    and the training loop's are left alone. Linux only (per-thread nice values); returns the threads changed.
    """
    changed = []
    for tid in sorted(thread_ids() - existing):
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                name = fh.read().strip()
            if name.startswith("[DALI][TP"):
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
                changed.append(tid)
        except OSError:  # the thread ended meanwhile
            continue
    return changed
