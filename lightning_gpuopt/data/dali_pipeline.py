"""The DALI pipeline behind ``DALILoader`` (docs/dali.md), and the checks and diagnostics around it."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from lightning_gpuopt._checks import check_choice, check_int
from lightning_gpuopt._common import IMAGENET_MEAN, IMAGENET_STD, available_cpus, eval_resize_size
from lightning_gpuopt._imports import require_dali
from lightning_gpuopt.data.decode import DECODERS
from lightning_gpuopt.data.transforms import CROP_ATTEMPTS, AugmentConfig

READER_NAME = "Reader"
#: batches DALI prepares ahead
PREFETCH_QUEUE_DEPTH = 2
#: the training shuffle's seed: the same on every rank, so shards stay disjoint
SHUFFLE_SEED = 42
#: DALI's own default share for the hardware JPEG decoder (tuned for A100)
DALI_HW_DECODER_LOAD = 0.65
#: JPEGs ``measure_decode_rates`` decodes (spread over the split), and the least seconds a decoder runs
SAMPLE_JPEGS, MEASURE_SECONDS = 64, 0.3

# Leading bytes of what DALI decodes (DALI's error for another file does not name it): JPEG, PNG, BMP, TIFF
# (little and big endian), WebP, JPEG 2000 (file and code stream), PNM
_SIGNATURES: tuple[bytes, ...] = (b"\xff\xd8", b"\x89PNG", b"BM", b"II*\x00", b"MM\x00*", b"RIFF")
_SIGNATURES += (b"\xff\x4f\xff\x51", b"\x00\x00\x00\x0cjP  ", *(f"P{k}".encode() for k in range(1, 7)))
_SEARCH_BUDGET_S = 60.0
_HEADER_BYTES = 1 << 16  # holds a JPEG's frame header unless EXIF or ICC data is larger (PIL then reads it)
_FIX = "remove or replace it (DALI cannot decode it)"


def dali_modules() -> tuple[Any, Any, Any]:
    """``(nvidia.dali, fn, types)``, or ``ModuleNotFoundError`` naming the extras to install."""
    dali = require_dali()
    from nvidia.dali import fn, types

    return dali, fn, types


def default_hw_decoder_load(device_id: int | None) -> float:
    """Share of JPEGs for the hardware decoder: 1.0 on compute capability >= 9.0, else DALI's 0.65."""
    import torch

    try:
        major = -1 if device_id is None else torch.cuda.get_device_capability(device_id)[0]
    except (RuntimeError, AssertionError, AttributeError):  # no CUDA here: the pipeline will say so itself
        major = -1
    return 1.0 if major >= 9 else DALI_HW_DECODER_LOAD


@dataclass(frozen=True)
class DecodeRates:
    """Images a second ``threads`` DALI CPU threads and nvJPEG (``None``: no GPU) decoded ``images`` JPEGs at."""

    cpu: float
    gpu: float | None
    images: int
    threads: int


def measure_decode_rates(
    jpegs: Sequence[bytes], *, threads: int, device_id: int | None, crop: AugmentConfig | None
) -> DecodeRates:
    """``DecodeRates`` of DALI's CPU decoder on ``threads`` threads and nvJPEG on ``device_id`` (where given)
    decoding ``jpegs``, the ``crop`` only where given."""
    kw: dict[str, Any] = {"threads": threads, "device_id": device_id, "crop": crop}
    cpu = _decode_rate(jpegs, device="cpu", **kw)
    gpu = None if device_id is None else _decode_rate(jpegs, device="mixed", **kw)
    return DecodeRates(cpu, gpu, len(jpegs), threads)


def _decode_rate(
    jpegs: Sequence[bytes], *, device: str, threads: int, device_id: int | None, crop: AugmentConfig | None
) -> float:
    import numpy as np

    dali, fn, types = dali_modules()
    batch = [np.frombuffer(data, dtype=np.uint8) for data in jpegs]
    kw: dict[str, Any] = {"device": device, "output_type": types.RGB}
    if device == "mixed":
        kw["hw_decoder_load"] = default_hw_decoder_load(device_id)
    if crop is not None:
        kw.update(
            random_area=list(crop.scale), random_aspect_ratio=list(crop.ratio), num_attempts=CROP_ATTEMPTS
        )
    decode = fn.decoders.image if crop is None else fn.decoders.image_random_crop

    @dali.pipeline_def(
        batch_size=len(batch),
        num_threads=threads,
        device_id=device_id,
        seed=0,
        exec_pipelined=False,
        exec_async=False,
        prefetch_queue_depth=1,
    )
    def pipeline() -> Any:
        return decode(fn.external_source(source=lambda: batch, batch=True, dtype=types.UINT8), **kw)

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


def _torchvision_resize(fn: Any, types: Any, shape: Any, size: int) -> tuple[Any, Any]:
    h, w = shape[0], shape[1]
    portrait = fn.cast(w <= h, dtype=types.INT64)
    new_w = portrait * size + (1 - portrait) * ((size * w) // h)
    new_h = (1 - portrait) * size + portrait * ((size * h) // w)
    return fn.cast(new_w, dtype=types.FLOAT), fn.cast(new_h, dtype=types.FLOAT)


def _center_crop_pos(fn: Any, types: Any, length: Any, size: int) -> Any:
    """torchvision's ``CenterCrop`` offset ``round((length - size) / 2)`` (DALI's rounds halves up)."""
    d = length - size
    k = d // 2
    offset = k + (d - 2 * k) * (k - 2 * (k // 2))
    return fn.cast(offset, dtype=types.FLOAT) / fn.cast(d + (d == 0), dtype=types.FLOAT)


def _decode_kwargs(types: Any, device_id: int | None, decoder: str) -> dict[str, Any]:
    kw: dict[str, Any] = {"output_type": types.RGB, "adjust_orientation": False, "device": "cpu"}
    if device_id is not None and decoder == "gpu":
        # paddings from DALI's ImageNet example: avoid reallocations for the largest images
        kw.update(
            device="mixed",
            hw_decoder_load=default_hw_decoder_load(device_id),
            device_memory_padding=211025920,
            host_memory_padding=140544512,
        )
    return kw


def _crop_images(
    fn: Any,
    types: Any,
    jpegs: Any,
    image_size: int,
    augment: AugmentConfig | None,
    decode_kw: dict[str, Any],
    gpu: bool,
) -> tuple[Any, dict[str, Any]]:
    """``(resized images, crop_mirror_normalize's crop or mirror arguments)``, train or evaluation."""
    op_device = "gpu" if gpu else "cpu"
    resize_kw = {"device": op_device, "interp_type": types.INTERP_LINEAR, "antialias": True}  # PIL's bilinear
    if augment is not None:
        area = {"random_area": list(augment.scale), "random_aspect_ratio": list(augment.ratio)}
        images = fn.decoders.image_random_crop(jpegs, num_attempts=CROP_ATTEMPTS, **area, **decode_kw)
    else:
        shape = fn.peek_image_shape(jpegs, adjust_orientation=False)
        # libjpeg's fancy upsampling, as PIL decodes
        images = fn.decoders.image(jpegs, jpeg_fancy_upsampling=True, **decode_kw)
    if gpu and decode_kw["device"] == "cpu":
        images = images.gpu()  # decoded on the CPU, resized on the GPU
    if augment is not None:
        images = fn.resize(images, resize_x=image_size, resize_y=image_size, **resize_kw)
        return images, {"mirror": fn.random.coin_flip(probability=augment.flip_p)}
    new_w, new_h = _torchvision_resize(fn, types, shape, eval_resize_size(image_size))
    images = fn.resize(images, resize_x=new_w, resize_y=new_h, **resize_kw)
    crop = {
        "crop": (image_size, image_size),
        "crop_pos_x": _center_crop_pos(fn, types, fn.cast(new_w, dtype=types.INT64), image_size),
        "crop_pos_y": _center_crop_pos(fn, types, fn.cast(new_h, dtype=types.INT64), image_size),
    }
    return images, crop


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
    """Define (not build) the DALI pipeline of one rank (docs/dali.md): ``DALILoader``'s arguments, with
    ``device_id`` ``None`` for a CPU pipeline, ``half`` for fp16 output, ``checkpoint`` to restore, and
    ``source`` (``StoreBatches``) to read instead of ``files``.

    Example:
        >>> pipe = build_dali_pipeline(files, labels, batch_size=64, image_size=224, train=True,
        ...                            device_id=0, decoder="gpu", num_threads=8,
        ...                            augment=AugmentConfig())  # doctest: +SKIP
    """
    check_choice(decoder, "decoder", DECODERS)
    check_int(num_threads, "num_threads", low=1)
    dali, fn, types = dali_modules()
    gpu = device_id is not None
    decode_kw = _decode_kwargs(types, device_id, decoder)
    norm = {"device": "gpu" if gpu else "cpu", "dtype": types.FLOAT16 if half else types.FLOAT}
    # NHWC batch == channels_last NCHW view, no copy
    norm.update(output_layout="HWC", mean=[m * 255.0 for m in mean], std=[s * 255.0 for s in std])

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
        if source is None:
            jpegs, label = fn.readers.file(
                files=list(files),
                labels=[int(v) for v in labels],
                shard_id=shard_id,
                num_shards=num_shards,
                # training: a full shuffle of the whole list every epoch with a seed shared by all ranks, so
                # shards stay disjoint (a shuffle buffer would only mix neighbours of a class-sorted list)
                shuffle_after_epoch=train,
                shuffle_after_epoch_seed=SHUFFLE_SEED,
                # every shard the same size, a multiple of the batch: an epoch never reads into the next
                pad_last_batch=True,
                stick_to_shard=not train,  # evaluation reads the same files each epoch (page-cache friendly)
                name=READER_NAME,
            )
        else:  # the source keeps each batch alive until DALI has consumed it
            kw = {"num_outputs": 2, "batch": True, "batch_info": True, "no_copy": True}
            jpegs, label = fn.external_source(source=source, dtype=[types.UINT8, types.INT32], **kw)
        images = _crop_images(fn, types, jpegs, image_size, augment, decode_kw, gpu)
        images = fn.crop_mirror_normalize(images[0], **norm, **images[1])
        label = fn.cast(label, dtype=types.INT64)
        return images, label.gpu() if gpu else label

    return pipeline()


# -- files: checked up front, named when DALI fails --------------------------------------------------


def _pixel_check(fh: Any, head: bytes, path: str) -> str | None:
    from PIL import Image

    from lightning_gpuopt.data.decode import BOMB_FIX, jpeg_info, pixel_limit_problem

    size = None
    if head.startswith(b"\x89PNG") and head[12:16] == b"IHDR" and len(head) >= 24:
        size = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    elif head.startswith(b"\xff\xd8"):
        info = jpeg_info(head)
        size = None if info is None else (info.width, info.height)
    if size is not None:
        return pixel_limit_problem(path, size)
    fh.seek(0)
    try:
        with Image.open(fh):  # parses the header only, and applies PIL's limit itself
            return None
    except Image.DecompressionBombError as err:
        return f"image {path!r} is a possible decompression bomb ({err}); {BOMB_FIX}"
    except Exception:  # a header PIL cannot parse: DALI decodes it or names it
        return None


def validate_image_files(files: Sequence[str], num_threads: int = 8) -> None:
    """``ValueError`` naming the first file that is missing, empty, of no known image signature, or over
    PIL's pixel limit by its header (checked in threads)."""

    def check(path: str) -> str | None:
        try:
            with open(path, "rb") as fh:
                head = fh.read(_HEADER_BYTES)
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


def _find_undecodable(files: Sequence[str], budget_s: float) -> str | None:
    from PIL import Image

    def bad(path: str) -> bool:
        try:
            with Image.open(path) as img:
                img.load()
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
            return True
        return False

    deadline = time.monotonic() + budget_s
    with ThreadPoolExecutor(max_workers=min(16, available_cpus())) as pool:
        for start in range(0, len(files), 256):
            part = files[start : start + 256]
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
    # some codec errors ("nvImageCodec failure: '#3'") do not name the file: look for it with PIL
    match = re.search(r"Failed to decode sample #\d+\s*:\s*(\S.*?)\s*$", message, re.MULTILINE)
    path = match.group(1) if match else next((p for p in files if p in message), None)  # a linear scan
    path = path or _find_undecodable(files, budget_s=_SEARCH_BUDGET_S)
    if path is not None:
        return ValueError(
            f"DALI could not decode image {path!r}; remove or replace the file. DALI said: {err}"
        )
    return RuntimeError(
        f"{message}\nlightning-gpuopt: an image failed to decode and no file could be identified within "
        f"{_SEARCH_BUDGET_S:.0f} s; check the data set with PIL (Image.open(path).load())"
    )
