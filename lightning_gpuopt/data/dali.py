"""NVIDIA DALI backend: JPEG decoding and augmentation on the GPU, behind a Lightning-ready loader.

``build_dali_pipeline`` defines the pipeline (``fn.readers.file`` sharded by rank, nvJPEG decoding with
``device="mixed"`` or, with ``decoder="cpu"``, libjpeg-turbo on DALI's CPU threads, random-resized-crop +
flip for training, resize + center crop for evaluation, normalization to fp16/fp32 NHWC). ``DALILoader``
wraps DALI's own ``DALIGenericIterator`` and adds what Lightning needs: a ``len`` known before the
pipeline is built, one ``__iter__`` per epoch that neither ends early nor loses or repeats batches after a
partially consumed epoch, the same batch count on every rank, and ``state_dict``/``load_state_dict``
backed by DALI checkpointing so a resumed fit continues the sample order. ``build_dali_loader(dm, split)`` builds one from an ``OptimizedDataModule``.

Without a CUDA root device the same pipeline runs on the CPU (``device_id=None``), so it can be developed
and tested anywhere.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from lightning_gpuopt._imports import require_dali

SPLITS = ("train", "val", "test", "predict")
POLICIES = ("drop", "fill", "partial")
PARTIAL_EPOCH = ("continue", "restart")
READER_NAME = "Reader"
#: where a GPU run decodes its JPEGs (``decoder=``): nvJPEG on the GPU, or libjpeg-turbo on CPU threads
DECODERS = ("gpu", "cpu")
#: default ``worker_nice`` of CPU-decoding pools: the pool soaks up idle cores, never the training loop's
CPU_DECODER_NICE = 10

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
    b"P1",
    b"P2",
    b"P3",
    b"P4",
    b"P5",
    b"P6",  # PNM
)


def _dali_modules() -> tuple[Any, Any, Any, Any, Any]:
    dali = require_dali()
    from nvidia.dali import fn, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    return dali, fn, types, DALIGenericIterator, LastBatchPolicy


def validate_image_files(files: Sequence[str], num_threads: int = 8) -> None:
    """Check that every file exists, is non-empty and starts with a known image signature.

    A cheap read of the first bytes of each file (threaded); full decodability is only known when DALI
    decodes the file, and ``DALILoader`` then names the file in its error.

    Raises:
        ValueError: naming the first bad file and the fix.
    """

    def check(path: str) -> str | None:
        try:
            with open(path, "rb") as fh:
                head = fh.read(12)
        except OSError as err:
            return f"{path!r} cannot be read ({err.strerror})"
        if not head:
            return f"{path!r} is empty"
        if not head.startswith(_SIGNATURES):
            return f"{path!r} is not a JPEG/PNG/BMP/TIFF/WebP/JPEG 2000/PNM image (unknown leading bytes)"
        return None

    with ThreadPoolExecutor(max_workers=max(1, num_threads)) as pool:
        for problem in pool.map(check, files, chunksize=256):
            if problem is not None:
                raise ValueError(
                    f"corrupt or unreadable image: {problem}; remove or replace it (DALI cannot decode it)"
                )


RESIZE_FILTERS = ("antialiased", "linear")


def _check_pipeline_values(**values: Any) -> None:
    """Reject pipeline argument values DALI would only refuse when the pipeline is built (``ValueError``)."""
    if "resize_filter" in values and values["resize_filter"] not in RESIZE_FILTERS:
        raise ValueError(
            f"resize_filter must be one of {list(RESIZE_FILTERS)}, got {values['resize_filter']!r}"
        )
    decoder = values.get("decoder")
    if decoder is not None and decoder not in DECODERS:
        raise ValueError(
            f"decoder must be one of {DECODERS} ('gpu': nvJPEG, 'cpu': CPU threads), got {decoder!r}"
        )
    load = values.get("hw_decoder_load")
    if load is not None and not 0.0 <= float(load) <= 1.0:
        raise ValueError(f"hw_decoder_load must be in [0, 1] or None, got {load!r}")


def _check_worker_nice(nice: Any) -> None:
    if nice is not None and (isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19):
        raise ValueError(f"worker_nice must be an int in [0, 19] (0: unchanged), got {nice!r}")


def build_dali_pipeline(
    files: Sequence[str],
    labels: Sequence[int],
    *,
    batch_size: int,
    image_size: int,
    train: bool,
    device_id: int | None,
    shard_id: int = 0,
    num_shards: int = 1,
    storage_size: int | None = None,
    mean: Sequence[float] = (0.485, 0.456, 0.406),
    std: Sequence[float] = (0.229, 0.224, 0.225),
    half: bool = False,
    num_threads: int = 4,
    prefetch_queue_depth: int = 2,
    seed: int = 0,
    shuffle_seed: int = 42,
    random_area: tuple[float, float] = (0.08, 1.0),
    random_aspect_ratio: tuple[float, float] = (3 / 4, 4 / 3),
    hw_decoder_load: float | None = None,
    resize_filter: str = "antialiased",
    decoder: str = "gpu",
    enable_checkpointing: bool = False,
    checkpoint: bytes | str | None = None,
) -> Any:
    """Define (not build) the DALI pipeline for one rank.

    Args:
        files: image paths (the whole data set: the reader picks this rank's shard).
        labels: class index of each file.
        batch_size: samples per batch on this rank.
        image_size: output height and width.
        train: random-resized-crop (decoding only the crop), flip and shuffling; else resize the shorter
            side to ``storage_size`` and center-crop ``image_size``.
        device_id: CUDA device index for nvJPEG (``device="mixed"``) and GPU operators, or ``None`` for a
            CPU-only pipeline.
        shard_id: this rank's shard (global rank).
        num_shards: number of shards (world size).
        storage_size: evaluation resize of the shorter side (default ``round(image_size * 256 / 224)``).
        mean: per-channel mean in [0, 1] units (scaled to 0..255 here).
        std: per-channel standard deviation in [0, 1] units.
        half: fp16 output instead of fp32.
        num_threads: DALI CPU threads.
        prefetch_queue_depth: batches DALI prepares ahead.
        seed: pipeline seed (random crops and flips).
        shuffle_seed: seed of the per-epoch reshuffle of the training list; must be equal on all ranks.
        random_area: area fraction range of the random crop.
        random_aspect_ratio: aspect ratio range of the random crop.
        hw_decoder_load: share of images sent to the hardware JPEG decoder (mixed decoding only); the rest
            are decoded by nvJPEG's CUDA kernels on the SMs the model trains on. ``None``:
            ``default_hw_decoder_load(device_id)`` (1.0 on Hopper and newer, DALI's 0.65 before).
        resize_filter: ``"antialiased"`` (triangular filter with antialiasing, the default: closest to PIL)
            or ``"linear"`` (bilinear without antialiasing: less GPU work per image, aliasing when
            shrinking a crop a lot).
        decoder: ``"gpu"`` (nvJPEG, ``device="mixed"``: the hardware JPEG decoder and CUDA kernels) or
            ``"cpu"`` (libjpeg-turbo on the ``num_threads`` CPU threads, decoding only the random crop,
            which is then copied to the GPU to be resized and normalized there): the SMs are left to the
            model, if the cores keep up. A CPU pipeline (``device_id=None``) decodes on the CPU anyway.
        enable_checkpointing: let the iterator save the reader and random state.
        checkpoint: a checkpoint string from ``DALIGenericIterator.checkpoints()`` to restore.
    """
    _check_pipeline_values(resize_filter=resize_filter, hw_decoder_load=hw_decoder_load, decoder=decoder)
    dali, fn, types, _, _ = _dali_modules()
    gpu = device_id is not None
    interp, antialias = {
        "antialiased": (types.INTERP_TRIANGULAR, True),
        "linear": (types.INTERP_LINEAR, False),
    }[resize_filter]
    if hw_decoder_load is None:
        hw_decoder_load = default_hw_decoder_load(device_id)
    storage_size = storage_size or round(image_size * 256 / 224)
    mean255 = [float(m) * 255.0 for m in mean]
    std255 = [float(s) * 255.0 for s in std]
    out_dtype = types.FLOAT16 if half else types.FLOAT

    def _decode(jpegs: Any, on_cpu: bool) -> Any:
        """Decode (training: only the random crop) with nvJPEG, or on the CPU threads; output on the GPU."""
        kw: dict[str, Any] = {"device": "cpu" if on_cpu or not gpu else "mixed", "output_type": types.RGB}
        if kw["device"] == "mixed":
            # paddings from DALI's ImageNet example: avoid reallocations for the largest images
            kw.update(
                hw_decoder_load=hw_decoder_load,
                device_memory_padding=211025920,
                host_memory_padding=140544512,
            )
        if train:
            images = fn.decoders.image_random_crop(
                jpegs,
                random_area=list(random_area),
                random_aspect_ratio=list(random_aspect_ratio),
                num_attempts=100,
                **kw,
            )
        else:
            # libjpeg's fancy upsampling, as PIL decodes, so eval batches match the folder backend closely
            images = fn.decoders.image(jpegs, jpeg_fancy_upsampling=True, **kw)
        if gpu and kw["device"] == "cpu":
            images = images.gpu()  # the decoded (cropped) image goes to the GPU for resize and normalize
        return images

    @dali.pipeline_def(
        batch_size=batch_size,
        num_threads=num_threads,
        device_id=device_id,
        seed=seed,
        prefetch_queue_depth=prefetch_queue_depth,
        enable_checkpointing=enable_checkpointing,
        checkpoint=checkpoint,
    )
    def pipeline() -> Any:
        jpegs, label = fn.readers.file(
            files=list(files),
            labels=[int(v) for v in labels],
            shard_id=shard_id,
            num_shards=num_shards,
            # training: a full shuffle of the whole list every epoch with a seed shared by all ranks, so
            # shards stay disjoint (a shuffle buffer would only mix neighbours of a class-sorted list, and
            # would mix pad_last_batch's repeated sample into the batches DROP keeps)
            shuffle_after_epoch=train,
            shuffle_after_epoch_seed=shuffle_seed,
            # pad_last_batch makes every shard the same size, a multiple of the batch, and keeps an epoch
            # from reading into the next shard: with it DROP/FILL/PARTIAL start each epoch cleanly.
            pad_last_batch=True,
            # evaluation reads the same files each epoch on each rank (page-cache friendly)
            stick_to_shard=not train,
            name=READER_NAME,
        )
        op_device = "gpu" if gpu else "cpu"
        images = _decode(jpegs, on_cpu=decoder == "cpu")
        if train:
            images = fn.resize(
                images,
                device=op_device,
                resize_x=image_size,
                resize_y=image_size,
                interp_type=interp,
                antialias=antialias,
            )
            mirror = fn.random.coin_flip(probability=0.5)
        else:
            images = fn.resize(
                images,
                device=op_device,
                resize_shorter=storage_size,
                interp_type=interp,
                antialias=antialias,
            )
            mirror = 0
        images = fn.crop_mirror_normalize(
            images,
            device=op_device,
            dtype=out_dtype,
            output_layout="HWC",  # NHWC batch == channels_last NCHW view, no copy
            crop=(image_size, image_size),
            mean=mean255,
            std=std255,
            mirror=mirror,
        )
        label = fn.cast(label, dtype=types.INT64)
        if gpu:
            label = label.gpu()
        return images, label

    return pipeline()


def _file_in_message(message: str, files: Sequence[str]) -> str | None:
    match = re.search(r"Failed to decode sample #\d+\s*:\s*(\S.*?)\s*$", message, re.MULTILINE)
    if match:
        return match.group(1)
    for path in files:  # failure path only: a linear scan is fine
        if path in message:
            return path
    return None


_SEARCH_BUDGET_S = 60.0


def _find_undecodable(files: Sequence[str], budget_s: float) -> str | None:
    """The first file PIL cannot fully decode, searching for at most ``budget_s`` seconds (failure path)."""
    import time

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
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        for start in range(0, len(files), chunk):
            part = files[start : start + chunk]
            for path, is_bad in zip(part, pool.map(bad, part), strict=True):
                if is_bad:
                    return path
            if time.monotonic() > deadline:
                return None
    return None


def _thread_ids() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:  # not Linux
        return set()


def renice_dali_workers(existing: set[int], nice: int) -> list[int]:
    """Lower the priority of DALI worker threads started since ``existing`` (thread ids) by ``nice``.

    DALI names its pool threads ``[DALI][TP<n>]...``; its executor and prefetch threads, the CUDA driver's
    and the training loop's are left alone. Linux only (per-thread nice values); returns the threads changed.
    """
    changed = []
    for tid in sorted(_thread_ids() - existing):
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                name = fh.read().strip()
            if name.startswith("[DALI][TP"):
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
                changed.append(tid)
        except OSError:  # the thread ended meanwhile
            continue
    return changed


class DALILoader:
    """Lightning-ready iterable over a DALI pipeline: ``(images, labels)`` batches on the device.

    ``images`` is an NCHW channels_last view (no copy) of DALI's NHWC output, normalized, fp16 or fp32
    (bf16 is cast from fp32 on the device); ``labels`` is int64 ``(batch,)`` on the same device.

    Epochs and ranks:
        * ``last_batch_policy="drop"`` (training default): every rank yields
          ``floor(floor(N / world_size) / batch_size)`` full batches a pass, so DDP never waits on a rank
          with one batch more; the few samples left over change from pass to pass.
        * ``"partial"`` (evaluation default): the reader pads shards to equal size and DALI trims the
          padding, so across ranks each sample is seen exactly once; every rank yields the same number of
          batches, the last one may be short (and is skipped if a smaller shard leaves it empty).
        * ``"fill"``: full batches, the last one padded by repeating the shard's last sample.

        A new ``__iter__`` after a partially consumed epoch (``limit_*_batches``, sanity checking,
        ``max_steps``): with ``partial_epoch="continue"`` (training default) the stream carries on where
        it stopped and crosses DALI's epoch boundary inside an epoch when needed, so no sample is skipped
        or repeated within a pass over the data; with ``"restart"`` (evaluation default) the rest of the
        pass is drained (decoded and discarded) so every evaluation starts from the first batch.

    Resuming: with ``checkpointing=True`` (training default) ``state_dict()`` holds DALI's checkpoint of
    the reader and random state plus the batches already yielded this epoch; Lightning saves it with the
    fit loop and ``load_state_dict`` restores it, so a resumed fit continues the same sample order.

    Args:
        files: image paths of the whole split (every rank passes the same list).
        labels: class index per file.
        batch_size: per-rank batch size.
        image_size: output height and width.
        train: training augmentation and shuffling, else resize + center crop.
        device: ``torch.device`` to deliver to; CUDA uses nvJPEG + GPU operators, CPU a CPU pipeline.
        shard_id: this rank (global rank).
        num_shards: world size.
        dtype: ``torch.float16``, ``torch.bfloat16`` or ``torch.float32``.
        last_batch_policy: ``"drop"``, ``"fill"`` or ``"partial"`` (default: drop for train, partial
            otherwise).
        partial_epoch: ``"continue"`` or ``"restart"`` (default: continue for train, restart otherwise).
        checkpointing: enable DALI checkpointing for ``state_dict`` (default: on for train).
        validate_files: check every file's leading bytes before building (cheap; names a bad file).
        epoch_batches: optional callable returning how many batches the consumer takes per epoch (the
            Trainer's ``num_training_batches``); decides whether a restored state is mid-epoch.
        worker_nice: nice increment (0..19) for DALI's worker threads (Linux; elsewhere ignored), so the
            training loop and DALI's executor threads get a core first when decoding keeps every core
            busy. ``None``: ``CPU_DECODER_NICE`` (10) with ``decoder="cpu"``, else 0 (unchanged).
        **pipeline_kwargs: passed to ``build_dali_pipeline`` (``storage_size``, ``mean``, ``std``,
            ``num_threads``, ``prefetch_queue_depth``, ``seed``, ``shuffle_seed``, ``random_area``,
            ``random_aspect_ratio``, ``hw_decoder_load``, ``resize_filter``, ``decoder``).
    """

    def __init__(
        self,
        files: Sequence[str],
        labels: Sequence[int],
        *,
        batch_size: int,
        image_size: int,
        train: bool,
        device: torch.device | str = "cpu",
        shard_id: int = 0,
        num_shards: int = 1,
        dtype: torch.dtype = torch.float32,
        last_batch_policy: str | None = None,
        partial_epoch: str | None = None,
        checkpointing: bool | None = None,
        validate_files: bool = True,
        epoch_batches: Callable[[], int | float] | None = None,
        worker_nice: int | None = None,
        **pipeline_kwargs: Any,
    ) -> None:
        if len(files) != len(labels):
            raise ValueError(f"files ({len(files)}) and labels ({len(labels)}) must have the same length")
        if not files:
            raise ValueError("files is empty; pass at least one image")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= shard_id < num_shards:
            raise ValueError(f"shard_id ({shard_id}) must be in [0, num_shards={num_shards})")
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"dtype must be torch.float16, torch.bfloat16 or torch.float32, got {dtype}")
        policy = last_batch_policy or ("drop" if train else "partial")
        if policy not in POLICIES:
            raise ValueError(f"last_batch_policy must be one of {POLICIES}, got {last_batch_policy!r}")
        partial = partial_epoch or ("continue" if train else "restart")
        if partial not in PARTIAL_EPOCH:
            raise ValueError(f"partial_epoch must be one of {PARTIAL_EPOCH}, got {partial_epoch!r}")
        unknown = set(pipeline_kwargs) - _PIPELINE_KWARGS
        if unknown:
            raise TypeError(
                f"unknown DALI pipeline argument(s) {sorted(unknown)}; valid: {sorted(_PIPELINE_KWARGS)}"
            )
        _check_pipeline_values(**pipeline_kwargs)  # here, not when the first batch builds the pipeline
        _check_worker_nice(worker_nice)
        if worker_nice is None:
            worker_nice = CPU_DECODER_NICE if pipeline_kwargs.get("decoder") == "cpu" else 0
        self.worker_nice = worker_nice
        self.files = list(files)
        self.labels = [int(v) for v in labels]
        self.batch_size = int(batch_size)
        self.image_size = int(image_size)
        self.train = bool(train)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.shard_id = int(shard_id)
        self.num_shards = int(num_shards)
        self.dtype = dtype
        self.last_batch_policy = policy
        self.partial_epoch = partial
        self.checkpointing = self.train if checkpointing is None else bool(checkpointing)
        self.validate_files = validate_files
        self.epoch_batches = epoch_batches
        self.pipeline_kwargs = pipeline_kwargs
        self._iterator: Any = None
        self._pulled = 0  # batches taken from DALI since its last epoch boundary
        self._yielded = 0  # batches yielded in the current (consumer) epoch
        self._skip_on_resume = 0
        self._checkpoint: bytes | str | None = None

    # ------------------------------------------------------------------ length
    def _shard_sizes(self) -> list[int]:
        # DALI's shard boundaries: floor(i * N / S)
        n, s = len(self.files), self.num_shards
        return [(i + 1) * n // s - i * n // s for i in range(s)]

    def __len__(self) -> int:
        """Batches per epoch on this rank, as DALI's iterator counts them (known before building)."""
        sizes = self._shard_sizes()
        if self.last_batch_policy == "drop":
            return (len(self.files) // self.num_shards) // self.batch_size
        # pad_last_batch=True: every shard padded to the largest, in whole batches
        return math.ceil(max(sizes) / self.batch_size)

    # ------------------------------------------------------------------ build
    def _build(self) -> None:
        if self._iterator is not None:
            return
        _, _, _, DALIGenericIterator, LastBatchPolicy = _dali_modules()
        if self.validate_files:
            validate_image_files(self.files, num_threads=int(self.pipeline_kwargs.get("num_threads", 8)))
        device_id = self.device.index if self.device.type == "cuda" else None
        pipe = build_dali_pipeline(
            self.files,
            self.labels,
            batch_size=self.batch_size,
            image_size=self.image_size,
            train=self.train,
            device_id=device_id,
            shard_id=self.shard_id,
            num_shards=self.num_shards,
            half=self.dtype == torch.float16,
            enable_checkpointing=self.checkpointing,
            checkpoint=self._checkpoint,
            **self.pipeline_kwargs,
        )
        policy = {
            "drop": LastBatchPolicy.DROP,
            "fill": LastBatchPolicy.FILL,
            "partial": LastBatchPolicy.PARTIAL,
        }[self.last_batch_policy]
        threads_before = _thread_ids()
        try:
            self._iterator = DALIGenericIterator(
                pipe, ["images", "labels"], reader_name=READER_NAME, last_batch_policy=policy, auto_reset=True
            )
        except RuntimeError as err:
            raise self._decode_error(err) from err
        if self.worker_nice:
            renice_dali_workers(threads_before, self.worker_nice)
        self._checkpoint = None
        if len(self._iterator) != len(self):
            raise RuntimeError(
                f"DALI reports {len(self._iterator)} batches per epoch, lightning-gpuopt computed {len(self)}; "
                "please report this with your DALI version"
            )

    def _decode_error(self, err: RuntimeError) -> Exception:
        message = str(err)
        if "decod" not in message and "nvImageCodec" not in message:
            return err
        path = _file_in_message(message, self.files)
        if path is None:
            # some codec errors ("nvImageCodec failure: '#3'") do not name the file: look for it with PIL
            path = _find_undecodable(self.files, budget_s=_SEARCH_BUDGET_S)
        if path is not None:
            return ValueError(
                f"DALI could not decode image {path!r}; remove or replace the file. DALI said: {err}"
            )
        return RuntimeError(
            f"{message}\nlightning-gpuopt: an image failed to decode and no file could be identified within "
            f"{_SEARCH_BUDGET_S:.0f} s; check the data set with PIL (Image.open(path).load())"
        )

    def close(self) -> None:
        """Release the DALI pipeline (device memory, threads); the next ``__iter__`` builds a new one."""
        if self._iterator is not None and self.checkpointing:
            self._checkpoint = self._iterator.checkpoints()[0]
        self._iterator = None

    # ------------------------------------------------------------------ iteration
    def _pull(self) -> list[dict[str, torch.Tensor]] | None:
        """One batch from DALI, or ``None`` at DALI's epoch boundary (the iterator has reset itself)."""
        try:
            out = next(self._iterator)
        except StopIteration:
            self._pulled = 0
            return None
        except RuntimeError as err:
            raise self._decode_error(err) from err
        self._pulled += 1
        return out

    def _convert(self, out: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        images = out[0]["images"].permute(0, 3, 1, 2)  # NHWC storage -> NCHW channels_last view
        if self.dtype == torch.bfloat16:
            images = images.to(torch.bfloat16)  # preserve_format keeps channels_last
        labels = out[0]["labels"].reshape(-1)
        return images, labels

    def _target(self) -> int:
        n = len(self)
        if self.epoch_batches is not None:
            limit = self.epoch_batches()
            if isinstance(limit, (int, float)) and math.isfinite(limit):
                n = min(n, int(limit))
        return n

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self._build()
        skip, self._skip_on_resume = self._skip_on_resume, 0
        if self.partial_epoch == "continue":
            return self._continue_epoch(skip)
        return self._restart_epoch()

    def _continue_epoch(self, skip: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self._yielded = skip if skip < self._target() else 0
        while self._yielded < len(self):
            out = self._pull()
            if out is None:  # DALI's pass ended (and reset): carry on into the next pass
                out = self._pull()
                if out is None:
                    raise RuntimeError(
                        "DALI pipeline yielded no batch in a whole pass; is the shard smaller than a batch?"
                    )
            self._yielded += 1
            yield self._convert(out)

    def _restart_epoch(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self._pulled:  # a previous epoch stopped early: finish DALI's pass so this one starts at batch 0
            while self._pull() is not None:
                pass
        self._yielded = 0
        while True:
            out = self._pull()
            if out is None:
                return
            images, labels = self._convert(out)
            if labels.shape[0] == 0:  # PARTIAL on a smaller shard can leave the padded last batch empty
                continue
            self._yielded += 1
            yield images, labels

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """DALI's checkpoint (reader position, shuffle and random state) and batches yielded this epoch."""
        checkpoint = None
        if self.checkpointing:
            checkpoint = self._iterator.checkpoints()[0] if self._iterator is not None else self._checkpoint
        return {"checkpoint": checkpoint, "yielded": self._yielded, "num_shards": self.num_shards}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from ``state_dict``; the pipeline is rebuilt from the checkpoint on the next ``__iter__``."""
        if state_dict.get("num_shards", self.num_shards) != self.num_shards:
            raise ValueError(
                f"the DALI state was saved with {state_dict['num_shards']} shards (ranks) but this run has "
                f"{self.num_shards}; resume with the same number of devices or drop the loader state"
            )
        checkpoint = state_dict.get("checkpoint")
        if checkpoint is not None and not self.checkpointing:
            raise ValueError("this DALILoader has checkpointing=False; it cannot restore a DALI checkpoint")
        self._iterator = None
        self._checkpoint = checkpoint
        self._pulled = 0
        self._skip_on_resume = int(state_dict.get("yielded", 0)) if checkpoint is not None else 0

    def __repr__(self) -> str:
        return (
            f"DALILoader(files={len(self.files)}, batch_size={self.batch_size}, train={self.train}, "
            f"device={self.device}, shard={self.shard_id}/{self.num_shards}, policy={self.last_batch_policy!r})"
        )


_PIPELINE_KWARGS = {
    "storage_size",
    "mean",
    "std",
    "num_threads",
    "prefetch_queue_depth",
    "seed",
    "shuffle_seed",
    "random_area",
    "random_aspect_ratio",
    "hw_decoder_load",
    "resize_filter",
    "decoder",
}


#: DALI's own default share for the hardware JPEG decoder (tuned for A100, where nvJPEG's CUDA path helps
#: the five hardware engines keep up).
DALI_HW_DECODER_LOAD = 0.65


def default_hw_decoder_load(device_id: int | None) -> float:
    """Share of JPEGs for the hardware decoder: 1.0 on compute capability >= 9.0 (Hopper and newer), else 0.65.

    Whatever the hardware decoder does not take is decoded by CUDA kernels on the SMs, which the model then
    shares. On one H200 (``benchmarks/results/session2/dali_focus_h200.json``, two runs each) Lightning +
    DALI fed ResNet-50 at 0.911 of the ceiling with 1.0 against 0.888 with 0.65, and the model beside a DALI pipeline
    whose output was discarded ran at 0.929 against 0.907 (``dali_h200.json``). Older GPUs keep DALI's 0.65
    (not measured here). ``device_id=None`` (CPU pipeline): the value is unused; 0.65 is returned.
    """
    if device_id is None:
        return DALI_HW_DECODER_LOAD
    try:
        major, _ = torch.cuda.get_device_capability(device_id)
    except (RuntimeError, AssertionError, AttributeError):  # no CUDA here: the pipeline will say so itself
        return DALI_HW_DECODER_LOAD
    return 1.0 if major >= 9 else DALI_HW_DECODER_LOAD


def default_num_threads(local_world_size: int = 1, decoder: str = "gpu") -> int:
    """DALI CPU threads per rank.

    ``decoder="gpu"`` (nvJPEG): half of this process's CPUs shared by the local ranks, 1..8. The other
    half is for the training loop, the CUDA driver and DALI's own executor threads: on the H200's 16 cores
    a DALI thread per core fed ResNet-50 at 0.896 of the ceiling, 8 or 4 threads at 0.92
    (``benchmarks/results/dali_h200.json``). ``decoder="cpu"``: the threads decode every JPEG, so each rank
    takes its share of the CPUs less two (the training loop and DALI's executor), at least 1: on the H200,
    14 threads fed ResNet-50 at 0.95-0.99 of the ceiling on three machines of four, 15 or 16 threads
    without ``worker_nice`` starved the loop (``benchmarks/results/dali_decode_h200.json``).
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    share = cpus // max(1, local_world_size)
    if decoder == "cpu":
        return max(1, share - 2)
    return max(1, min(8, share // 2))


def check_dali_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse unknown ``dali_kwargs`` keys or bad values when the DataModule is made, not at fit time."""
    import inspect

    params = set(inspect.signature(DALILoader.__init__).parameters) - {
        "self",
        "files",
        "labels",
        "pipeline_kwargs",
    }
    valid = params | _PIPELINE_KWARGS
    unknown = set(kwargs) - valid
    if unknown:
        raise TypeError(f"unknown dali_kwargs key(s) {sorted(unknown)}; valid: {sorted(valid)}")
    try:
        _check_pipeline_values(**{k: v for k, v in kwargs.items() if k in _PIPELINE_KWARGS})
        _check_worker_nice(kwargs.get("worker_nice"))
    except ValueError as err:
        raise ValueError(f"dali_kwargs: {err}") from None


def _split_samples(source: Any, split: str) -> tuple[list[str], list[int]]:
    from lightning_gpuopt.data.folder import scan_image_folder

    if source is None:
        raise ValueError(
            f"backend='dali' needs {split}_dir for the {split!r} split; pass it to OptimizedDataModule"
        )
    if isinstance(source, (list, tuple)):  # an explicit [(path, label), ...] list
        files = [str(p) for p, _ in source]
        labels = [int(y) for _, y in source]
        return files, labels
    _, samples = scan_image_folder(source)
    return [p for p, _ in samples], [y for _, y in samples]


def build_dali_loader(dm: Any, split: str, **overrides: Any) -> DALILoader | list[Any]:
    """Build the ``DALILoader`` for one split of an ``OptimizedDataModule`` (``backend="dali"``).

    Reads ``dm.<split>_dir`` (a class-per-subfolder folder, labels as ``scan_image_folder`` assigns them,
    so they equal the folder backend's; or a list of ``(path, label)``), ``batch_size``, ``image_size``,
    ``storage_size``, ``mean``, ``std``, ``augment``, ``output_dtype``, ``num_workers`` (DALI threads when
    an int) and ``dali_kwargs`` (a dict of ``DALILoader`` arguments, if the DataModule has one). The shard
    is the Trainer's global rank of its world size; the device is its root device.

    Args:
        dm: the DataModule (attached to a Trainer, or standalone: rank 0 of 1 on the current device).
        split: ``"train"``, ``"val"``, ``"test"`` or ``"predict"``; an evaluation split without a folder
            gives ``[]`` (Lightning skips it), a missing ``train_dir`` raises ``ValueError``.
        **overrides: ``DALILoader`` arguments that win over the DataModule's.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    source = getattr(dm, f"{split}_dir", None)
    if source is None and split != "train":
        return []  # like the other backends: Lightning skips a stage whose loader list is empty
    files, labels = _split_samples(source, split)
    trainer = getattr(dm, "trainer", None)
    if trainer is not None:
        device = trainer.strategy.root_device
        rank, world = trainer.global_rank, trainer.world_size
        local_world = max(1, int(getattr(trainer, "num_devices", 1) or 1))
    else:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        rank, world, local_world = 0, 1, 1
    train = split == "train"
    extra = {**(getattr(dm, "dali_kwargs", None) or {}), **overrides}
    num_workers = getattr(dm, "num_workers", None)
    num_threads = (
        num_workers
        if isinstance(num_workers, int) and num_workers > 0
        else default_num_threads(local_world, extra.get("decoder", "gpu"))
    )
    kwargs: dict[str, Any] = {
        "batch_size": int(dm.batch_size),
        "image_size": int(dm.image_size),
        "train": train and bool(getattr(dm, "augment", True)),
        "device": device,
        "shard_id": rank,
        "num_shards": world,
        "dtype": getattr(dm, "output_dtype", torch.float32),
        "num_threads": num_threads,
        "mean": tuple(getattr(dm, "mean", (0.485, 0.456, 0.406))),
        "std": tuple(getattr(dm, "std", (0.229, 0.224, 0.225))),
    }
    if getattr(dm, "storage_size", None):
        kwargs["storage_size"] = int(dm.storage_size)
    if not kwargs["train"] and train:
        # augment=False still trains: keep shuffling-free eval transforms but the train batch policy
        kwargs.update(last_batch_policy="drop", partial_epoch="continue", checkpointing=True)
    if train and trainer is not None:
        kwargs["epoch_batches"] = lambda: trainer.num_training_batches
    kwargs.update(extra)
    return DALILoader(files, labels, **kwargs)
