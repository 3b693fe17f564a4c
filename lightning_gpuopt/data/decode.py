"""JPEG folders and stores decoded in the training process without DALI (docs/datamodule.md): by its threads
onto the host backends' canvases (``"cpu"``), or by nvJPEG (``"gpu"``, ``decode_gpu``)."""

from __future__ import annotations

import functools
import io
import os
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from lightning_gpuopt._checks import check_choice, check_int
from lightning_gpuopt._common import available_cpus
from lightning_gpuopt.data import layout
from lightning_gpuopt.data.folder import SKIP_FIX, CorruptImageError, UInt8ImageFolder, decode_canvas
from lightning_gpuopt.data.jpeg_store import JPEGStoreDataset

__all__ = [
    "DECODERS",
    "DecodeOptions",
    "DecoderOptions",
    "ThreadDecoded",
    "ThreadDecodedFolder",
    "ThreadDecodedStore",
    "decode_rgb",
    "jpeg_info",
]

#: where a run decodes its JPEGs: nvJPEG on the GPU, or CPU threads (the training process's or DALI's)
DECODERS = ("gpu", "cpu")
#: cores a rank keeps off decoding: the training loop and the thread that stages batches on the GPU
RESERVED_THREADS = 2
#: threads reading JPEG bytes for nvJPEG (and decoding what it cannot) by default
GPU_READ_THREADS = 4
#: what a refused decompression bomb's error advises
BOMB_FIX = (
    "refused as the folder and HDF5 backends refuse it: remove or replace the file, or raise "
    "PIL.Image.MAX_IMAGE_PIXELS if you trust it"
)


@dataclass(frozen=True)
class DecoderOptions:
    """Where JPEGs are decoded and on how many CPU threads; ``DecodeOptions`` and ``DALIOptions`` name it."""

    decoder: str | None = None
    threads: int | None = None
    _prefix = "decode"  # what its errors call it
    _threads = "threads of the training process"

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.decoder is not None:
            fix = f"or None: None measures both on your files ({name}(decoder=...))"
            check_choice(self.decoder, f"{self._prefix}.decoder", DECODERS, fix=fix)
        fix = f"{self._threads} ({name}(threads=...)); None picks them from the CPUs"
        check_int(self.threads, f"{self._prefix}.threads", low=1, none_ok=True, fix=fix)


class DecodeOptions(DecoderOptions):
    """How ``OptimizedDataModule`` decodes a JPEG folder or a JPEG store without DALI (docs/datamodule.md).

    Attributes:
        decoder: ``None``: measured at setup on the run's files; ``"gpu"``: nvJPEG; ``"cpu"``: CPU threads.
        threads: threads that decode (``"cpu"``) or read JPEG bytes (``"gpu"``); ``None``: from the CPUs.

    Example:
        >>> options = DecodeOptions(decoder="cpu")
        >>> dm = OptimizedDataModule("data/train", "data/val", decode=options)  # doctest: +SKIP
    """


def default_decode_threads(decoder: str, local_world_size: int = 1, *, dali: bool = False) -> int:
    """Threads a rank decodes with (``"cpu"``: its share of the CPUs less ``RESERVED_THREADS``), or beside
    nvJPEG reads bytes with (``GPU_READ_THREADS``, at most that share) or runs DALI with (``dali``: half the
    share, 1..8; docs/benchmarks.md has the measurements)."""
    share = max(1, available_cpus() // max(1, local_world_size))
    if decoder == "cpu":
        return max(1, share - RESERVED_THREADS)
    return max(1, min(8, share // 2) if dali else min(GPU_READ_THREADS, share - RESERVED_THREADS))


def root_device(trainer: Any) -> torch.device:
    """The Trainer's root device, else the current CUDA device, else the CPU."""
    if trainer is not None:
        return trainer.strategy.root_device
    cuda = torch.cuda.is_available()
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


class JPEGInfo(NamedTuple):
    """A JPEG's frame header, and Adobe's colour transform (``None`` without an Adobe marker)."""

    width: int
    height: int
    components: int
    baseline: bool
    adobe_transform: int | None


_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_STANDALONE = frozenset({0x01, 0xD0, 0xD1, 0xD2, 0xD3, 0xD4, 0xD5, 0xD6, 0xD7, 0xD8})


def jpeg_info(data: bytes | bytearray | memoryview) -> JPEGInfo | None:
    """The frame header of the JPEG in ``data``, or ``None`` where ``data`` is no JPEG one can read it from.

    Example:
        >>> jpeg_info(b"not a jpeg") is None
        True
    """
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return None
    i, adobe = 2, None
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in _STANDALONE:
            i += 2
            continue
        length = (data[i + 2] << 8) | data[i + 3]
        if length < 2 or marker in (0xDA, 0xD9):  # a scan or the end before any frame header
            return None
        if marker == 0xEE and length >= 12 and bytes(data[i + 4 : i + 9]) == b"Adobe":
            adobe = data[i + 15]
        if marker in _SOF:
            if i + 10 > n:
                return None
            height, width = (data[i + 5] << 8) | data[i + 6], (data[i + 7] << 8) | data[i + 8]
            if not height or not width:
                return None
            baseline = marker in (0xC0, 0xC1) and data[i + 4] == 8
            return JPEGInfo(width, height, data[i + 9], baseline, adobe)
        i += 2 + length
    return None


def nvjpeg_decodable(info: JPEGInfo | None) -> bool:
    """Whether nvJPEG's batched decode takes the JPEG: baseline YCbCr colour (else decoded on the CPU)."""
    return info is not None and info.baseline and info.components == 3 and info.adobe_transform in (None, 1)


@functools.cache
def _torchvision_io() -> Any | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchvision.io as tvio
    except Exception:  # not installed, or a build that does not load with this torch
        return None
    return tvio


def pixel_limit_problem(path: str, size: tuple[int, int]) -> str | None:
    """PIL's decompression-bomb rule for an image of ``size``: a warning above ``PIL.Image.MAX_IMAGE_PIXELS``;
    above twice it, why the image is refused."""
    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS
    width, height = size
    pixels = width * height
    if limit is None or pixels <= limit:
        return None
    if pixels > 2 * limit:
        return (
            f"image {path!r} is {width}x{height} = {pixels:,} pixels, more than twice PIL's limit "
            f"(PIL.Image.MAX_IMAGE_PIXELS = {limit:,}): a possible decompression bomb; {BOMB_FIX}"
        )
    warnings.warn(
        f"image {path!r} is {width}x{height} = {pixels:,} pixels, over PIL.Image.MAX_IMAGE_PIXELS = "
        f"{limit:,}: it could be a decompression bomb",
        Image.DecompressionBombWarning,
        stacklevel=2,
    )
    return None


def check_pixels(info: JPEGInfo | None, name: str) -> None:
    """``pixel_limit_problem`` for a JPEG decoded outside PIL, raised as ``ValueError``."""
    problem = None if info is None else pixel_limit_problem(name, (info.width, info.height))
    if problem is not None:
        raise ValueError(problem)


def decode_rgb(data: bytes | bytearray, name: str, info: JPEGInfo | None = None) -> torch.Tensor:
    """One whole image as uint8 RGB ``(3, H, W)`` on the CPU: torchvision's ``decode_jpeg`` for a JPEG (PIL's
    pixels), else PIL; ``ValueError`` naming ``name`` where it cannot be decoded or is refused."""
    data = data if isinstance(data, bytearray) else bytearray(data)
    info = info or jpeg_info(data)
    tvio = _torchvision_io()
    if tvio is not None and info is not None:
        check_pixels(info, name)
        try:
            return tvio.decode_jpeg(torch.frombuffer(data, dtype=torch.uint8), mode=tvio.ImageReadMode.RGB)
        except RuntimeError as err:
            raise _cannot_decode(name, err) from err
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            rgb = np.asarray(layout.to_rgb8(img), dtype=np.uint8)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise _cannot_decode(name, err) from err
    return torch.from_numpy(rgb.copy()).permute(2, 0, 1)


def _cannot_decode(name: str, err: BaseException) -> CorruptImageError:
    detail = str(err).strip().splitlines()[-1] if str(err).strip() else ""
    return CorruptImageError.of(name, f"{type(err).__name__}: {detail[:200]}")


def decode_canvas_fast(data: bytes | bytearray, storage_size: int, out: np.ndarray, name: str) -> np.ndarray:
    """``folder.decode_canvas`` of ``data`` onto ``out`` (returns the meta), inside torch operators that release
    the GIL where torchvision is installed and PIL would not draft the JPEG."""
    info = jpeg_info(data) if _torchvision_io() is not None else None
    if info is not None:
        target = layout.resized_size(info.width, info.height, storage_size)
        if layout.draft_size(info.width, info.height, target) is None:
            from lightning_gpuopt import _compat

            rgb = decode_rgb(data, name, info).permute(1, 2, 0).contiguous().numpy()
            if (rgb.shape[1], rgb.shape[0]) != tuple(target):
                rgb = _compat.resize_rgb_uint8(rgb, target[1], target[0])
            return layout.place_on_canvas(rgb, storage_size, out)[1]
    return decode_canvas(bytes(data), storage_size, out, name=name)[1]


def _read_file(path: str) -> bytearray:
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        data = bytearray(size)
        got = fh.readinto(data)
    return data if got == size else data[:got]


class ThreadDecoded:
    """A dataset read by ``threads`` threads of the training process (``read_into``), not by worker processes:
    the base of ``ThreadDecodedFolder`` and ``ThreadDecodedStore``."""

    read_in_workers = False
    threads: int

    def _set_threads(self, threads: int | None) -> None:
        check_int(threads, "threads", low=1, none_ok=True)
        self.threads = threads or default_decode_threads("cpu")

    @property
    def auto_readers(self) -> int:
        """Reading threads ``num_workers="auto"`` gives it: ``threads``."""
        return self.threads


class ThreadDecodedFolder(ThreadDecoded, UInt8ImageFolder):
    """``UInt8ImageFolder`` decoded by threads of the training process (``decode_canvas_fast``).

    Example:
        >>> ds = ThreadDecodedFolder("data/train", size=256, threads=14)  # doctest: +SKIP
    """

    def __init__(self, root: Any, size: int = 256, on_corrupt: str = "raise", skip_log: Any = None,
                 threads: int | None = None) -> None:  # fmt: skip
        super().__init__(root, size, on_corrupt, skip_log)
        self._set_threads(threads)

    def label(self, index: int) -> int:
        return int(self.samples[index][1])

    def jpeg_bytes(self, index: int) -> tuple[bytearray, str]:
        """Sample ``index``'s file as read from the disk, and its name for errors."""
        path = self.samples[index][0]
        try:
            return _read_file(path), path
        except OSError as err:
            raise ValueError(f"cannot read image {path!r} ({err.strerror or err}); {SKIP_FIX}") from err

    def _load(self, index: int, out: np.ndarray) -> tuple[int, np.ndarray]:
        data, name = self.jpeg_bytes(index)
        return self.samples[index][1], decode_canvas_fast(data, self.size, out, name)

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "read": "threads"}


class ThreadDecodedStore(ThreadDecoded, JPEGStoreDataset):
    """``JPEGStoreDataset`` decoded by threads of the training process (``decode_canvas_fast``).

    Example:
        >>> ds = ThreadDecodedStore("train_jpeg.h5", threads=14)  # doctest: +SKIP
    """

    def __init__(self, path: Any, threads: int | None = None) -> None:
        super().__init__(path)
        self._set_threads(threads)

    def label(self, index: int) -> int:
        return int(self.labels[self._index(index)])

    def jpeg_bytes(self, index: int) -> tuple[bytearray, str]:
        """Image ``index``'s JPEG bytes (one ``pread``) and its name for errors."""
        i = self._index(index)
        return bytearray(self._bytes(self._reader().fileno(), i)), f"image {i} of {self.path!r}"

    def _decode(self, fd: int, i: int, out: np.ndarray) -> np.ndarray:
        data = bytearray(self._bytes(fd, i))
        return decode_canvas_fast(data, self.storage_size, out, f"image {i} of {self.path!r}")
