"""NVIDIA DALI backend: images decoded (nvJPEG or CPU threads) and augmented by DALI, in a Lightning loader.

``DALIOptions`` holds what a user decides (where JPEGs are decoded, how many threads; by default the decoder
follows from rates measured on the run's own files, ``choose_decoder``, the threads from the cores); the pipeline itself
(``lightning_gpuopt.data.dali_pipeline``) follows torchvision's recipes on the whole image.
``DALILoader`` wraps DALI's ``DALIGenericIterator`` and adds what Lightning needs: a ``len`` known before
the pipeline is built, one ``__iter__`` per epoch that neither ends early nor loses or repeats batches
after a partially consumed epoch, the same batch count on every rank, and ``state_dict`` /
``load_state_dict`` backed by DALI checkpointing, so a resumed fit continues the sample order.
``build_dali_loader(dm, split)`` builds one from an ``OptimizedDataModule``.

Without a CUDA root device the same pipeline runs on the CPU (``device_id=None``), so it can be developed
and tested anywhere. Importing this module does not import DALI.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_gpuopt._checks import check_arg, check_choice, check_int
from lightning_gpuopt._common import IMAGENET_MEAN, IMAGENET_STD, FeedInfo
from lightning_gpuopt.data.dali_pipeline import (
    DALI_HW_DECODER_LOAD,
    DECODERS,
    READER_NAME,
    SAMPLE_JPEGS,
    DecodeRates,
    build_dali_pipeline,
    choose_decoder,
    dali_modules,
    decode_error,
    default_hw_decoder_load,
    default_num_threads,
    measure_decode_rates,
    renice_dali_workers,
    thread_ids,
    validate_image_files,
)
from lightning_gpuopt.data.loader import SPLITS, timed_batches
from lightning_gpuopt.data.transforms import AugmentConfig

__all__ = [
    "DALI_HW_DECODER_LOAD",
    "DECODERS",
    "DALIFeedInfo",
    "DALILoader",
    "DALIOptions",
    "build_dali_loader",
    "build_dali_pipeline",
    "choose_decoder",
    "default_hw_decoder_load",
    "default_num_threads",
    "validate_image_files",
]

_LOGGED: set[str] = set()  # decoder choices already logged in this process
_MEASURED: dict[Any, DecodeRates] = {}  # decode rates measured in this process, by sample and decoder
#: nice increment of DALI's pool threads when they decode on the CPU: the pool soaks up idle cores, never
#: the training loop's
CPU_DECODER_NICE = 10


@dataclass(frozen=True)
class DALIOptions:
    """What a user decides about the DALI backend; everything else is fixed at its measured best.

    Attributes:
        decoder: ``None`` (default): chosen when the loader is built by ``choose_decoder`` from the rates
            this host decodes the split's own files at (``measure_decode_rates``): CPU threads where they
            decode at least as fast as nvJPEG on this GPU, nvJPEG otherwise; the choice, its figures and
            reason are logged once and kept in the loader's ``feed_info``. ``"gpu"``:
            nvJPEG, DALI's ``"mixed"`` decoder (the hardware JPEG decoder takes every image on Hopper and
            newer). ``"cpu"``: libjpeg-turbo decodes on DALI's CPU threads (only the random crop, for
            training) and the GPU only resizes and normalizes; it costs the model less where the cores
            keep up. A CPU run decodes on the CPU whatever this says.
        threads: DALI CPU threads per rank; ``None``: ``default_num_threads`` for the resolved decoder
            (with ``"gpu"`` half the rank's CPUs, at most 8; with ``"cpu"`` all of them but two).

    Example:
        >>> dm = OptimizedDataModule("data/train", "data/val", backend="dali",
        ...                          dali=DALIOptions(decoder="cpu"))  # doctest: +SKIP
    """

    decoder: str | None = None
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.decoder is not None:
            check_choice(
                self.decoder,
                "dali.decoder",
                DECODERS,
                fix="or None: None chooses from rates measured on your files, 'gpu' decodes with nvJPEG, "
                "'cpu' on DALI's CPU threads (DALIOptions(decoder=...))",
            )
        check_int(
            self.threads,
            "dali.threads",
            low=1,
            none_ok=True,
            fix="the DALI CPU threads per rank (DALIOptions(threads=...)); None picks them from the CPUs",
        )

    def resolved_decoder(
        self,
        local_world_size: int = 1,
        *,
        cuda: bool = True,
        measure: Callable[[int], DecodeRates] | None = None,
    ) -> tuple[str, str]:
        """``(decoder, reason)`` for a run with ``local_world_size`` ranks on this machine.

        ``"cpu"`` without ``cuda`` (a CPU pipeline), ``decoder`` when set, else ``choose_decoder`` on the
        rates ``measure(threads)`` takes for the threads the CPU decoder would have (``DALILoader`` measures
        on its own files); with nothing to measure on, nvJPEG.
        """
        if not cuda:
            return "cpu", "no CUDA device: the pipeline runs on the CPU"
        if self.decoder is not None:
            return self.decoder, f"DALIOptions(decoder={self.decoder!r})"
        if measure is None:
            return "gpu", "nvJPEG: no files given to measure the CPU threads on"
        return choose_decoder(measure(self.threads or default_num_threads(local_world_size, "cpu")))

    def resolved_threads(self, local_world_size: int = 1, *, cuda: bool = True) -> int:
        """``threads``, or the default for the resolved decoder and this many ranks on the machine."""
        return self.resolved(local_world_size, cuda=cuda)[1]

    def resolved(self, local_world_size: int = 1, **rule: Any) -> tuple[str, int, str]:
        """``(decoder, threads, reason)`` settled for a run: ``resolved_decoder`` (``rule``: its keywords
        ``cuda``, ``measure``), then ``threads`` or ``default_num_threads`` for that decoder (chosen from the
        cores, not measured); the plain values a pipeline is built with.

        Example:
            >>> DALIOptions(decoder="cpu", threads=4).resolved()
            ('cpu', 4, "DALIOptions(decoder='cpu')")
        """
        decoder, reason = self.resolved_decoder(local_world_size, **rule)
        return decoder, self.threads or default_num_threads(local_world_size, decoder), reason


@dataclass
class DALIFeedInfo(FeedInfo):
    """``FeedInfo`` of a ``DALILoader``, with why its decoder was chosen.

    Attributes:
        decoder_reason: ``choose_decoder``'s reason when ``DALIOptions.decoder`` was ``None``, else what
            set it (the option, or a CPU run).
        cpu_decode_rate: images a second DALI's CPU threads decoded this source at, measured when the
            loader was built (``None``: not measured: the decoder was set, or a CPU run).
        gpu_decode_rate: the same for nvJPEG on this GPU.

    Example:
        >>> DALIFeedInfo(backend="dali", decoder="gpu", decoder_reason="DALIOptions(decoder='gpu')").decoder
        'gpu'
    """

    decoder_reason: str | None = None
    cpu_decode_rate: float | None = None
    gpu_decode_rate: float | None = None


class DALILoader:
    """Lightning-ready iterable over a DALI pipeline: ``(images, labels)`` batches on the device.

    ``images`` is an NCHW channels_last view (no copy) of DALI's NHWC output, normalized, fp16 or fp32
    (bf16 is cast from fp32 on the device); ``labels`` is int64 ``(batch,)`` on the same device.
    Training crops follow torchvision's ``RandomResizedCrop`` + flip on the whole image; evaluation is
    ``Resize(eval_resize_size(image_size))`` + ``CenterCrop(image_size)`` (``dali_pipeline``).

    Epochs and ranks:
        * training: every rank yields ``floor(floor(N / world_size) / batch_size)`` full batches a pass
          (DALI's ``DROP``), so DDP never waits on a rank with one batch more; the few samples left over
          change from pass to pass (the list is reshuffled every epoch, with a seed shared by the ranks).
          A new ``__iter__`` after a partially consumed epoch (``limit_train_batches``, ``max_steps``)
          continues the stream where it stopped, crossing DALI's epoch boundary when needed, so no sample
          is skipped or repeated within a pass.
        * evaluation: the reader pads shards to equal size and DALI trims the padding (``PARTIAL``), so
          across ranks each sample is seen once, in file order; every rank yields the same number of
          batches (``len``). Shards differ by one sample at most: where a smaller shard ends on a batch
          boundary its last batch is its last sample again (as Lightning's ``DistributedSampler`` pads:
          fewer than ``num_shards`` repeats in all). A new ``__iter__`` after a partial pass (the sanity
          check) drains the rest, so every evaluation starts from the first batch.

    Resuming: a training loader's ``state_dict()`` holds DALI's checkpoint of the reader and random state
    plus the batches already yielded this epoch; Lightning saves it with the fit loop and
    ``load_state_dict`` restores it, so a resumed fit continues the same sample order.

    ``feed_info`` (``DALIFeedInfo``) describes the feed for the advisor, with the decoder used and why;
    ``fetch_seconds`` is the cumulative time the consumer spent inside ``next()``.

    Args:
        files: image paths of the whole split (every rank passes the same list).
        labels: class index per file.
        batch_size: per-rank batch size.
        image_size: output height and width.
        train: training semantics (shuffle, whole batches, continue partial epochs, checkpointing).
        augment: the training crop and flip (``AugmentConfig``: torchvision's ``RandomResizedCrop`` and
            ``RandomHorizontalFlip`` by default); ``None`` trains on the evaluation transform. Evaluation
            loaders ignore it.
        device: ``torch.device`` to deliver to; CUDA runs a GPU pipeline, CPU a CPU pipeline.
        shard_id: this rank (global rank).
        num_shards: world size.
        dtype: ``torch.float16``, ``torch.bfloat16`` or ``torch.float32``.
        mean: per-channel mean in [0, 1] units.
        std: per-channel standard deviation in [0, 1] units.
        options: ``DALIOptions`` (decoder, threads); a ``None`` decoder or thread count is resolved for
            ``local_world_size`` ranks on this machine.
        local_world_size: training processes on this machine (they share its CPUs).
        epoch_batches: optional callable returning how many batches the consumer takes per epoch (the
            Trainer's ``num_training_batches``); decides whether a restored state is mid-epoch.

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
        check_arg(
            dtype in (torch.float16, torch.bfloat16, torch.float32),
            "dtype",
            dtype,
            "torch.float16, torch.bfloat16 or torch.float32",
            error=TypeError,
        )
        check_arg(
            options is None or isinstance(options, DALIOptions),
            "options",
            options,
            "None or DALIOptions(...)",
            error=TypeError,
        )
        self.files = list(files)
        self.labels = [int(v) for v in labels]
        self.batch_size = int(batch_size)
        self.image_size = int(image_size)
        self.train = bool(train)
        check_arg(
            augment is None or isinstance(augment, AugmentConfig),
            "augment",
            augment,
            "None or AugmentConfig(...)",
            error=TypeError,
        )
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
        options = options or DALIOptions()
        decoder, threads, reason = options.resolved(
            local_world_size, cuda=self.device.type == "cuda", measure=self._measure
        )
        self.settle(decoder, threads, reason)
        self.fetch_seconds = 0.0  # _common.FETCH_SECONDS_ATTR: cumulative seconds spent inside next()
        self._iterator: Any = None
        self._pulled = 0  # batches taken from DALI since its last epoch boundary
        self._yielded = 0  # batches yielded in the current (consumer) epoch
        self._skip_on_resume = 0
        self._checkpoint: bytes | str | None = None

    def _sample_jpegs(self) -> list[bytes]:
        """The JPEG bytes of up to ``SAMPLE_JPEGS`` of this split's files, spread over it."""
        step = max(1, len(self.files) // SAMPLE_JPEGS)
        out = []
        for path in self.files[::step][:SAMPLE_JPEGS]:
            with open(path, "rb") as fh:
                out.append(fh.read())
        return out

    def _measure(self, threads: int) -> DecodeRates:
        """This host's decode rates on a sample of this split's files (``measure_decode_rates``), once a
        process for the same files, threads, device and kind of decode."""
        device_id = self.device.index if self.device.type == "cuda" else None
        key = (self.files[0], len(self.files), threads, device_id, self.augment if self.train else None)
        if key not in _MEASURED:
            _MEASURED[key] = measure_decode_rates(
                self._sample_jpegs(), threads=threads, device_id=device_id, crop=key[-1]
            )
        self._rates = _MEASURED[key]
        return self._rates

    def settle(self, decoder: str, threads: int, reason: str) -> None:
        """Build the pipeline with ``decoder`` on ``threads`` threads (``reason``: why), as ``__init__`` does
        with the options' choice, before the first iteration; ``build_dali_loader`` settles every rank on
        rank zero's decoder. Logged once a process."""
        self.options = DALIOptions(decoder, threads)
        self._decoder, self._threads = decoder, threads  # what the pipeline is built with
        if self.device.type == "cuda" and reason not in _LOGGED and "DALIOptions(" not in reason:
            _LOGGED.add(reason)
            where = "on DALI's CPU threads" if decoder == "cpu" else "with nvJPEG on the GPU"
            rank_zero_info(
                f"DALILoader: JPEGs decoded {where} (decoder={decoder!r}): {reason}; "
                "DALIOptions(decoder='cpu' or 'gpu') overrides"
            )
        self.worker_nice = CPU_DECODER_NICE if decoder == "cpu" else 0
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

    # ------------------------------------------------------------------ length
    def __len__(self) -> int:
        """Batches per epoch on this rank, as DALI's iterator counts them (known before building)."""
        n, s = len(self.files), self.num_shards
        if self.train:  # DROP
            return (n // s) // self.batch_size
        # pad_last_batch=True: every shard padded to the largest (DALI's boundaries: floor(i * N / S))
        largest = max((i + 1) * n // s - i * n // s for i in range(s))
        return math.ceil(largest / self.batch_size)

    # ------------------------------------------------------------------ build
    def _build(self) -> None:
        if self._iterator is not None:
            return
        dali_modules()  # a missing DALI names the extras before any file is read
        from nvidia.dali.plugin.pytorch import DALIGenericIterator

        pipe, iterator_kwargs = self._pipeline()
        threads_before = thread_ids()
        try:
            self._iterator = DALIGenericIterator(
                pipe, ["images", "labels"], auto_reset=True, **iterator_kwargs
            )
        except RuntimeError as err:
            raise self._decode_error(err) from err
        if self.worker_nice:
            renice_dali_workers(threads_before, self.worker_nice)
        self._built()

    def _pipeline_kwargs(self) -> dict[str, Any]:
        """``build_dali_pipeline``'s arguments that do not depend on where the JPEGs come from."""
        return {
            "batch_size": self.batch_size,
            "image_size": self.image_size,
            "device_id": self.device.index if self.device.type == "cuda" else None,
            "decoder": self._decoder,
            "num_threads": self._threads,
            "augment": self.augment,
            "mean": self.mean,
            "std": self.std,
            "half": self.dtype == torch.float16,
            "seed": self.seed,
        }

    def _pipeline(self) -> tuple[Any, dict[str, Any]]:
        """The pipeline over the files (checked first), and the ``DALIGenericIterator`` arguments for it."""
        from nvidia.dali.plugin.pytorch import LastBatchPolicy

        validate_image_files(self.files, num_threads=self._threads)
        pipe = build_dali_pipeline(
            self.files,
            self.labels,
            train=self.train,
            shard_id=self.shard_id,
            num_shards=self.num_shards,
            checkpointing=self.train,
            checkpoint=self._checkpoint,
            **self._pipeline_kwargs(),
        )
        policy = LastBatchPolicy.DROP if self.train else LastBatchPolicy.PARTIAL
        return pipe, {"reader_name": READER_NAME, "last_batch_policy": policy}

    def _built(self) -> None:
        self._checkpoint = None
        if len(self._iterator) != len(self):
            raise RuntimeError(
                f"DALI reports {len(self._iterator)} batches per epoch, lightning-gpuopt computed "
                f"{len(self)}; "
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

    def _decode_error(self, err: RuntimeError) -> Exception:
        """The error to raise for DALI's ``err``: the file it names or an undecodable one, where found."""
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
        return timed_batches(self, self._continue_epoch(skip) if self.train else self._restart_epoch())

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

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """DALI's checkpoint (reader position, shuffle and random state) and batches yielded this epoch."""
        checkpoint = None
        if self.train:
            checkpoint = self._iterator.checkpoints()[0] if self._iterator is not None else self._checkpoint
        return {"checkpoint": checkpoint, "yielded": self._yielded, "num_shards": self.num_shards}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict``; the pipeline is rebuilt from its checkpoint on the next ``__iter__``."""
        shards = state_dict.get("num_shards", self.num_shards)
        check_arg(
            shards == self.num_shards,
            "the DALI state's num_shards (ranks)",
            shards,
            f"this run's {self.num_shards}",
            "resume with the same number of devices or drop the loader state",
        )
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

    def __repr__(self) -> str:
        return (
            f"DALILoader(files={len(self.files)}, batch_size={self.batch_size}, train={self.train}, "
            f"device={self.device}, shard={self.shard_id}/{self.num_shards}, options={self.options})"
        )


def build_dali_loader(
    dm: Any,
    split: str,
    *,
    options: DALIOptions | None = None,
    device: torch.device | str | None = None,
) -> DALILoader | list[Any]:
    """Build the ``DALILoader`` for one split of an ``OptimizedDataModule`` (``backend="dali"``).

    Reads ``dm.<split>_dir`` (a class-per-subfolder folder, labelled as ``scan_image_folder`` does, so as
    the folder backend), ``batch_size``, ``image_size``, ``mean``, ``std``, ``augment`` and ``dali``
    (``DALIOptions``: the decoder and DALI's threads).
    Batches are float32, as the other backends deliver them. The shard is the Trainer's global rank of its
    world size; the device is its root device.

    Args:
        dm: the ``OptimizedDataModule`` (attached to a Trainer, or standalone: rank 0 of 1 on the current
            device).
        split: ``"train"``, ``"val"``, ``"test"`` or ``"predict"``; an evaluation split without a folder
            gives ``[]`` (Lightning skips it), a missing ``train_dir`` raises ``ValueError``.
        options: ``DALIOptions`` that replace the DataModule's.
        device: where batches go, instead of the Trainer's root device.

    Example:
        >>> dm = OptimizedDataModule("data/train", backend="dali", batch_size=64)  # doctest: +SKIP
        >>> images, labels = next(iter(build_dali_loader(dm, "train", device="cpu")))  # doctest: +SKIP
    """
    from lightning_gpuopt.data.folder import scan_image_folder

    check_arg(split in SPLITS, "split", split, f"one of {SPLITS}")
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
    train = split == "train"
    root, rank, world, local_world, epoch_batches = loader_placement(dm, train=train)
    options = dm_options(dm, options)
    loader = DALILoader(
        [p for p, _ in samples],
        [y for _, y in samples],
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
        epoch_batches=epoch_batches,
    )
    return rank_zero_decoder(dm.trainer, loader, options, local_world)


def rank_zero_decoder(trainer: Any, loader: DALILoader, options: DALIOptions, local_world: int) -> Any:
    """``loader`` settled on global rank zero's decoder where the options leave it to the measurement and
    the run has several ranks (each measured on its own GPU; one ``broadcast``, every rank calls it), so all
    ranks decode alike; each keeps its own thread count, from its node's cores."""
    if trainer is None or trainer.world_size <= 1 or options.decoder is not None:
        return loader
    if loader.device.type != "cuda":
        return loader
    decoder, reason = trainer.strategy.broadcast(
        (loader.options.decoder, loader.feed_info.decoder_reason), src=0
    )
    if decoder != loader.options.decoder:
        loader.settle(
            decoder, options.threads or default_num_threads(local_world, decoder), f"rank 0's: {reason}"
        )
    return loader


def loader_placement(dm: Any, *, train: bool) -> tuple[torch.device, int, int, int, Any]:
    """Where a DataModule's DALI loader runs: ``(root device, global rank, world size, local ranks,
    epoch_batches)`` from its Trainer, or the current device as rank 0 of 1 standalone; ``epoch_batches``
    reads the Trainer's ``num_training_batches`` for a training loader (else ``None``)."""
    trainer = dm.trainer
    if trainer is None:
        cuda = torch.cuda.is_available()
        root = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        return root, 0, 1, 1, None
    batches = (lambda: trainer.num_training_batches) if train else None
    local = max(1, trainer.num_devices)
    return trainer.strategy.root_device, trainer.global_rank, trainer.world_size, local, batches


def dm_options(dm: Any, options: DALIOptions | None = None) -> DALIOptions:
    """``options``, else the DataModule's ``dali`` (or the defaults). DALI's threads are
    ``DALIOptions.threads``; ``num_workers`` counts DataLoader worker processes, which DALI has none of."""
    return options if options is not None else dm.dali or DALIOptions()
