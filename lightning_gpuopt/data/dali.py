"""NVIDIA DALI backend (docs/dali.md): ``DALIOptions`` and ``DALILoader``, a Lightning-ready loader over a
DALI pipeline (``dali_pipeline``). Importing this module does not import DALI."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_gpuopt._checks import check_arg, check_int
from lightning_gpuopt._common import IMAGENET_MEAN, IMAGENET_STD, FeedInfo
from lightning_gpuopt.data.dali_pipeline import (
    READER_NAME,
    SAMPLE_JPEGS,
    DecodeRates,
    build_dali_pipeline,
    dali_modules,
    decode_error,
    measure_decode_rates,
    validate_image_files,
)
from lightning_gpuopt.data.decode import DecoderOptions, default_decode_threads, root_device
from lightning_gpuopt.data.decode_choice import choose_decoder, log_decoder
from lightning_gpuopt.data.transforms import AugmentConfig

__all__ = ["DALIFeedInfo", "DALILoader", "DALIOptions", "build_dali_loader"]

_MEASURED: dict[Any, DecodeRates] = {}  # decode rates measured in this process, by sample and decoder
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class DALIOptions(DecoderOptions):
    """What a user decides about the DALI backend (docs/dali.md#options-dalioptions).

    Attributes:
        decoder: ``None``: measured on the run's files; ``"gpu"``: nvJPEG; ``"cpu"``: DALI's CPU threads.
        threads: DALI CPU threads per rank; ``None``: ``default_decode_threads(decoder, dali=True)``.

    Example:
        >>> dm = OptimizedDataModule("data/train", "data/val", backend="dali",
        ...                          dali=DALIOptions(decoder="cpu"))  # doctest: +SKIP
    """

    _prefix, _threads = "dali", "the DALI CPU threads per rank"

    def resolved(
        self,
        local_world_size: int = 1,
        *,
        cuda: bool = True,
        measure: Callable[[int], DecodeRates] | None = None,
    ) -> tuple[str, int, str]:
        """``(decoder, threads, reason)`` for ``local_world_size`` ranks on this machine: ``"cpu"`` without
        ``cuda``, ``decoder`` where set, else ``choose_decoder`` on ``measure(threads)`` (nvJPEG without it).

        Example:
            >>> DALIOptions(decoder="cpu", threads=4).resolved()
            ('cpu', 4, "DALIOptions(decoder='cpu')")
        """
        if not cuda:
            decoder, reason = "cpu", "no CUDA device: the pipeline runs on the CPU"
        elif self.decoder is not None:
            decoder, reason = self.decoder, f"DALIOptions(decoder={self.decoder!r})"
        elif measure is None:
            decoder, reason = "gpu", "nvJPEG: no files given to measure the CPU threads on"
        else:
            rates = measure(self.threads or default_decode_threads("cpu", local_world_size))
            decoder, reason = choose_decoder(rates.threads, rates.cpu, rates.gpu, images=rates.images)
        threads = self.threads or default_decode_threads(decoder, local_world_size, dali=True)
        return decoder, threads, reason


@dataclass
class DALIFeedInfo(FeedInfo):
    """``FeedInfo`` of a ``DALILoader``, with why its decoder was chosen.

    Attributes:
        decoder_reason: ``choose_decoder``'s reason, or what set the decoder.
        cpu_decode_rate: images a second DALI's CPU threads decoded this source at (``None``: not measured).
        gpu_decode_rate: the same for nvJPEG on this GPU.

    Example:
        >>> DALIFeedInfo(backend="dali", decoder="gpu", decoder_reason="DALIOptions(decoder='gpu')").decoder
        'gpu'
    """

    decoder_reason: str | None = None
    cpu_decode_rate: float | None = None
    gpu_decode_rate: float | None = None


class DALILoader:
    """Lightning-ready iterable over a DALI pipeline: ``(channels_last NCHW images, int64 labels)`` on the
    device; epochs, ranks, resuming and ``feed_info`` as docs/dali.md says.

    Args:
        files: image paths of the whole split (every rank passes the same list).
        labels: class index per file.
        batch_size: per-rank batch size.
        image_size: output height and width.
        train: training semantics (shuffle, whole batches, partial epochs continued, checkpointing).
        augment: the training crop and flip; ``None`` trains on the evaluation transform.
        device: ``torch.device`` to deliver to; CUDA runs a GPU pipeline, CPU a CPU pipeline.
        shard_id: this rank (global rank).
        num_shards: world size.
        dtype: ``torch.float16``, ``torch.bfloat16`` or ``torch.float32``.
        mean: per-channel mean in [0, 1] units.
        std: per-channel standard deviation in [0, 1] units.
        options: ``DALIOptions`` (decoder, threads).
        local_world_size: training processes on this machine (they share its CPUs).
        epoch_batches: callable giving the batches the consumer takes an epoch (``num_training_batches``).

    Example:
        >>> loader = DALILoader(files, labels, batch_size=256, image_size=224, train=True,
        ...                     device="cuda", dtype=torch.float16)  # doctest: +SKIP
        >>> images, labels = next(iter(loader))  # doctest: +SKIP
    """

    def __init__(
        self,
        files: Sequence[str],
        labels: Sequence[int],
        *,
        batch_size: int,
        image_size: int,
        train: bool,
        augment: AugmentConfig | None = AugmentConfig(),  # noqa: B008 (frozen: safe to share)
        device: torch.device | str = "cpu",
        shard_id: int = 0,
        num_shards: int = 1,
        dtype: torch.dtype = torch.float32,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        options: DALIOptions | None = None,
        local_world_size: int = 1,
        epoch_batches: Callable[[], int | float] | None = None,
    ) -> None:
        check_arg(
            len(files) == len(labels), "labels", f"{len(labels)} labels", f"one per file ({len(files)})"
        )
        check_arg(len(files) > 0, "files", files, "a non-empty list of image paths")
        check_int(batch_size, "batch_size", low=1)
        check_int(image_size, "image_size", low=1)
        check_arg(0 <= shard_id < num_shards, "shard_id", shard_id, f"in [0, num_shards={num_shards})")
        check_int(local_world_size, "local_world_size", low=1)
        check_arg(dtype in _DTYPES, "dtype", dtype, f"one of {_DTYPES}", error=TypeError)
        for name, value, cls in (("options", options, DALIOptions), ("augment", augment, AugmentConfig)):
            ok = value is None or isinstance(value, cls)
            check_arg(ok, name, value, f"None or {cls.__name__}(...)", error=TypeError)
        self.files = list(files)
        self.labels = [int(v) for v in labels]
        self.batch_size = int(batch_size)
        self.image_size = int(image_size)
        self.train = bool(train)
        self.augment = augment if self.train else None
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.shard_id, self.num_shards = int(shard_id), int(num_shards)
        self.dtype = dtype
        self.mean, self.std = tuple(float(m) for m in mean), tuple(float(s) for s in std)
        self.epoch_batches = epoch_batches
        # per shard, so ranks do not draw the same crops; torch's seed makes runs reproducible
        self.seed = (torch.initial_seed() + 7919 * self.shard_id) % (2**31 - 1)
        self._rates: DecodeRates | None = None
        decoder, threads, reason = (options or DALIOptions()).resolved(
            local_world_size, cuda=self.device.type == "cuda", measure=self._measure
        )
        self.settle(decoder, threads, reason)
        self.fetch_seconds = 0.0  # _common.FETCH_SECONDS_ATTR: seconds the consumer waited for DALI
        self._iterator: Any = None
        self._pulled = 0  # batches taken from DALI since its last epoch boundary
        self._yielded = 0  # batches yielded in the current (consumer) epoch
        self._skip_on_resume = 0
        self._checkpoint: bytes | str | None = None

    def _sample_jpegs(self) -> list[bytes]:
        out = []
        for i in range(0, len(self.files), max(1, len(self.files) // SAMPLE_JPEGS))[:SAMPLE_JPEGS]:
            start, length = self._byte_range(i)
            with open(self.files[i], "rb") as fh:
                fh.seek(start)
                out.append(fh.read(length))
        return out

    def _byte_range(self, i: int) -> tuple[int, int]:
        return 0, -1  # the whole file

    def _measure(self, threads: int) -> DecodeRates:
        device_id = self.device.index if self.device.type == "cuda" else None
        key = (self.files[0], len(self.files), threads, device_id, self.augment if self.train else None)
        if key not in _MEASURED:
            _MEASURED[key] = measure_decode_rates(
                self._sample_jpegs(), threads=threads, device_id=device_id, crop=key[-1]
            )
        self._rates = _MEASURED[key]
        return self._rates

    def settle(self, decoder: str, threads: int, reason: str) -> None:
        """Build the pipeline with ``decoder`` on ``threads`` threads (``reason`` logged once a process)."""
        self.options = DALIOptions(decoder, threads)  # what the pipeline is built with
        if self.device.type == "cuda" and "DALIOptions(" not in reason:
            log_decoder("DALILoader", decoder, "DALI's CPU threads", reason, "DALIOptions")
        rates = self._rates
        self.feed_info = DALIFeedInfo(
            backend="dali",
            batch_size=self.batch_size,
            host_batches=False,
            decoder=decoder,
            threads=threads,
            decoder_reason=reason,
            cpu_decode_rate=rates.cpu if rates is not None else None,
            gpu_decode_rate=rates.gpu if rates is not None else None,
        )

    def __len__(self) -> int:
        n, s = len(self.files), self.num_shards
        if self.train:  # DROP
            return (n // s) // self.batch_size
        # pad_last_batch=True: every shard padded to the largest (DALI's boundaries: floor(i * N / S))
        largest = max((i + 1) * n // s - i * n // s for i in range(s))
        return math.ceil(largest / self.batch_size)

    def _build(self) -> None:
        if self._iterator is not None:
            return
        dali_modules()  # a missing DALI names the extras before any file is read
        from nvidia.dali.plugin.pytorch import DALIGenericIterator

        pipe, iterator_kwargs = self._pipeline()
        try:
            self._iterator = DALIGenericIterator(
                pipe, ["images", "labels"], auto_reset=True, **iterator_kwargs
            )
        except RuntimeError as err:
            raise self._decode_error(err) from err
        self._built()

    def _pipeline_kwargs(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "image_size": self.image_size,
            "device_id": self.device.index if self.device.type == "cuda" else None,
            "decoder": self.options.decoder,
            "num_threads": self.options.threads,
            "train": self.train,
            "shard_id": self.shard_id,
            "num_shards": self.num_shards,
            "augment": self.augment,
            "mean": self.mean,
            "std": self.std,
            "half": self.dtype == torch.float16,
            "seed": self.seed,
        }

    def _pipeline(self) -> tuple[Any, dict[str, Any]]:
        from nvidia.dali.plugin.pytorch import LastBatchPolicy

        validate_image_files(self.files, num_threads=self.options.threads or 1)
        kw = {"checkpointing": self.train, "checkpoint": self._checkpoint, **self._pipeline_kwargs()}
        pipe = build_dali_pipeline(self.files, self.labels, **kw)
        policy = LastBatchPolicy.DROP if self.train else LastBatchPolicy.PARTIAL
        return pipe, {"reader_name": READER_NAME, "last_batch_policy": policy}

    def _built(self) -> None:
        self._checkpoint = None
        if len(self._iterator) != len(self):
            raise RuntimeError(
                f"DALI reports {len(self._iterator)} batches per epoch, lightning-gpuopt computed {len(self)}; "
                "please report this with your DALI version"
            )

    def close(self) -> None:
        """Release the DALI pipeline (device memory, threads); the next ``__iter__`` builds a new one."""
        if self._iterator is not None and self.train:
            try:
                self._checkpoint = self._iterator.checkpoints()[0]
            except RuntimeError:  # a pipeline that failed keeps no place to resume from
                self._checkpoint = None
        self._iterator = None

    def _pull(self) -> list[dict[str, torch.Tensor]] | None:
        start = time.perf_counter()
        try:
            out = next(self._iterator)
        except StopIteration:
            self._pulled = 0
            return None
        except RuntimeError as err:
            raise self._decode_error(err) from err
        finally:
            self.fetch_seconds += time.perf_counter() - start
        self._pulled += 1
        return out

    def _decode_error(self, err: RuntimeError) -> Exception:
        return decode_error(err, self.files)

    def _convert(self, out: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        images = out[0]["images"].permute(0, 3, 1, 2)  # NHWC storage -> NCHW channels_last view
        if self.dtype == torch.bfloat16:
            images = images.to(torch.bfloat16)  # preserve_format keeps channels_last
        return images, out[0]["labels"].reshape(-1)

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
        return self._continue_epoch(skip) if self.train else self._restart_epoch()

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
        if self._pulled:  # a previous pass stopped early: finish DALI's pass so this one starts at batch 0
            while self._pull() is not None:
                pass
        self._yielded = 0
        # a shard one sample smaller than the largest that ends on a batch boundary gets an empty padded last
        # batch from PARTIAL; its last sample is yielded again instead, so every rank yields len(self) batches
        n, s, r = len(self.files), self.num_shards, self.shard_id
        mine = (r + 1) * n // s - r * n // s
        repeat_after = mine // self.batch_size if mine % self.batch_size == 0 and mine else None
        last: tuple[torch.Tensor, torch.Tensor] | None = None
        while True:
            out = self._pull()
            if out is None:
                return
            images, labels = self._convert(out)
            if labels.shape[0] == 0:
                if last is None or self._yielded >= len(self):
                    continue
                images, labels = last
            elif self._yielded + 1 == repeat_after and repeat_after < len(self):
                last = (images[-1:].clone(), labels[-1:].clone())  # DALI reuses its output buffers
            self._yielded += 1
            yield images, labels

    def state_dict(self) -> dict[str, Any]:
        """DALI's checkpoint (reader position, shuffle and random state) and batches yielded this epoch."""
        checkpoint = None
        if self.train:
            checkpoint = self._iterator.checkpoints()[0] if self._iterator is not None else self._checkpoint
        return {"checkpoint": checkpoint, "yielded": self._yielded, "num_shards": self.num_shards}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict``; the pipeline is rebuilt from its checkpoint on the next ``__iter__``."""
        self._check_shards(state_dict)
        checkpoint = state_dict.get("checkpoint")
        check_arg(
            checkpoint is None or self.train,
            "an evaluation DALILoader's state",
            "a DALI checkpoint",
            "without one: an evaluation loader restarts its pass",
        )
        self._iterator = None
        self._checkpoint = checkpoint
        self._pulled = 0
        self._skip_on_resume = int(state_dict.get("yielded", 0)) if checkpoint is not None else 0

    def _check_shards(self, state_dict: dict[str, Any]) -> None:
        shards = state_dict.get("num_shards", self.num_shards)
        fix = "resume with the same number of devices or drop the loader state"
        what = "the DALI state's num_shards (ranks)"
        check_arg(shards == self.num_shards, what, shards, f"this run's {self.num_shards}", fix)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self._what}, batch_size={self.batch_size}, train={self.train}, "
            f"device={self.device}, shard={self.shard_id}/{self.num_shards}, options={self.options})"
        )

    @property
    def _what(self) -> str:
        return f"files={len(self.files)}"


def build_dali_loader(
    dm: Any,
    split: str,
    *,
    options: DALIOptions | None = None,
    device: torch.device | str | None = None,
) -> DALILoader | list[Any]:
    """The float32 ``DALILoader`` of one split of an ``OptimizedDataModule`` (docs/dali.md).

    Args:
        dm: the ``OptimizedDataModule`` (standalone: rank 0 of 1 on the current device).
        split: ``"train"``, ``"val"``, ``"test"`` or ``"predict"`` (without its folder: ``[]``).
        options: ``DALIOptions`` that replace the DataModule's.
        device: where batches go, instead of the Trainer's root device.

    Example:
        >>> dm = OptimizedDataModule("data/train", backend="dali", batch_size=64)  # doctest: +SKIP
        >>> images, labels = next(iter(build_dali_loader(dm, "train", device="cpu")))  # doctest: +SKIP
    """
    from lightning_gpuopt.data.folder import scan_image_folder

    splits = ("train", "val", "test", "predict")  # Lightning's <split>_dataloader hooks
    check_arg(split in splits, "split", split, f"one of {splits}")
    source = getattr(dm, f"{split}_dir")
    if source is None and split != "train":
        return []  # like the other backends: Lightning skips a stage whose loader list is empty
    check_arg(
        source is not None,
        "train_dir",
        None,
        "a JPEG folder with backend='dali' to fit",
        "pass train_dir to OptimizedDataModule",
    )
    _, samples = scan_image_folder(source)
    files, labels = [p for p, _ in samples], [y for _, y in samples]
    return dm_loader(DALILoader, dm, files, labels, train=split == "train", options=options, device=device)


def dm_loader(cls: Any, dm: Any, *args: Any, train: bool, options: Any = None, device: Any = None) -> Any:
    """``cls(*args, ...)`` with ``dm``'s settings on its Trainer's root device and rank; under DDP every rank
    takes global rank zero's measured decoder."""
    trainer = dm.trainer
    options = options if options is not None else dm.dali or DALIOptions()
    root = root_device(trainer)
    if trainer is None:
        rank, world, local_world, batches = 0, 1, 1, None
    else:
        rank, world = trainer.global_rank, trainer.world_size
        local_world = max(1, trainer.num_devices)
        batches = (lambda: trainer.num_training_batches) if train else None
    loader = cls(
        *args,
        batch_size=dm.batch_size,
        image_size=dm.image_size,
        train=train,
        augment=dm.augment,
        device=root if device is None else device,
        shard_id=rank,
        num_shards=world,
        mean=dm.mean,
        std=dm.std,
        options=options,
        local_world_size=local_world,
        epoch_batches=batches,
    )
    if world <= 1 or options.decoder is not None or loader.device.type != "cuda":
        return loader
    # each rank measured on its own GPU: all decode as rank zero does, each keeping its node's threads
    decoder, reason = trainer.strategy.broadcast(
        (loader.options.decoder, loader.feed_info.decoder_reason), src=0
    )
    if decoder != loader.options.decoder:
        threads = options.threads or default_decode_threads(decoder, local_world, dali=True)
        loader.settle(decoder, threads, f"rank 0's: {reason}")
    return loader
