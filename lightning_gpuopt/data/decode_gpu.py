"""Training batches decoded by nvJPEG (torchvision's batched ``decode_jpeg``) on the staging thread's side
stream and cropped as ``GPUAugment`` crops, from JPEG bytes read by threads (docs/datamodule.md)."""

from __future__ import annotations

import collections
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_gpuopt._checks import check_int
from lightning_gpuopt._common import IMAGENET_MEAN, IMAGENET_STD
from lightning_gpuopt.data.decode import (
    GPU_READ_THREADS,
    _torchvision_io,
    check_pixels,
    decode_rgb,
    jpeg_info,
    nvjpeg_decodable,
)
from lightning_gpuopt.data.loader import ContinuousDataLoader, read_ahead
from lightning_gpuopt.data.transforms import (
    AugmentConfig,
    GPUAugment,
    _scale_shift,
    band_size,
    resample,
)

__all__ = ["GROUP", "JPEGBatch", "NVJPEGCrops", "NVJPEGLoader", "read_jpeg_batch"]

#: images resampled together on one canvas (sorted by size, so a canvas carries little padding)
GROUP = 64
#: batches of decoded images kept alive at most while the GPU still crops from them
HELD = 4


@dataclass(slots=True, eq=False)
class JPEGBatch:
    """A batch as its reading thread leaves it: per image JPEG bytes for nvJPEG (``data``) or the image decoded
    on the CPU (``decoded``), its name, and the int64 labels (not a tuple: staged as it is)."""

    data: list[torch.Tensor | None]
    decoded: list[torch.Tensor | None]
    labels: torch.Tensor
    names: list[str]

    def __len__(self) -> int:
        return len(self.names)


def read_jpeg_batch(dataset: Any, indices: Sequence[int]) -> JPEGBatch:
    """Read the images at ``indices`` of ``dataset``; decode here those nvJPEG's batched decode does not take."""
    data: list[torch.Tensor | None] = []
    decoded: list[torch.Tensor | None] = []
    names, labels = [], []
    pin = torch.cuda.is_available()  # what the staging thread copies to the GPU, copied without a wait
    for index in indices:
        payload, name = dataset.jpeg_bytes(int(index))
        info = jpeg_info(payload)
        if nvjpeg_decodable(info):
            check_pixels(info, name)
            data.append(torch.frombuffer(payload, dtype=torch.uint8))
            decoded.append(None)
        else:
            data.append(None)
            image = decode_rgb(payload, name, info)
            decoded.append(image.pin_memory() if pin else image)
        names.append(name)
        labels.append(dataset.label(int(index)))
    labels_t = torch.tensor(labels, dtype=torch.int64)
    return JPEGBatch(data, decoded, labels_t.pin_memory() if pin else labels_t, names)


def _nvjpeg(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    tvio = _torchvision_io()
    if tvio is None:
        raise ModuleNotFoundError(
            "decoding JPEGs on the GPU needs torchvision: pip install 'lightning-gpuopt[vision]'"
        )
    return list(tvio.decode_jpeg(data, mode=tvio.ImageReadMode.RGB, device=device))


class NVJPEGCrops:
    """``JPEGBatch`` -> ``(normalized channels_last float32 NCHW, int64 labels)`` on ``device`` (default: the
    current CUDA device), decoded by nvJPEG and cropped as ``GPUAugment`` crops, the boxes drawn from ``seed``.

    Example:
        >>> crops = NVJPEGCrops(224, AugmentConfig(), seed=0)  # doctest: +SKIP
        >>> images, labels = crops(read_jpeg_batch(folder, range(256)))  # doctest: +SKIP
    """

    def __init__(
        self,
        image_size: int,
        augment: AugmentConfig | None,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        self.image_size, self.augment = int(image_size), augment
        self.device = None if device is None else torch.device(device)
        self.generator = torch.Generator().manual_seed(int(seed))
        self._norm = GPUAugment(image_size, augment, mean, std)  # its boxes, its normalization constants
        # decoded images a batch's crops still read on the GPU: nvJPEG writes the next batch on a stream of
        # its own, so their memory must not go back to the allocator before those reads are done
        self._held: collections.deque[tuple[torch.cuda.Event, list[torch.Tensor]]] = collections.deque()

    def __call__(self, batch: JPEGBatch) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.device or torch.device("cuda", torch.cuda.current_device())
        while self._held and (len(self._held) > HELD or self._held[0][0].query()):
            self._held.popleft()[0].synchronize()  # done already, but for the few over HELD
        images = self.decode(batch, device)
        out, order = self.crop(images, device)
        scale, bias = self._norm._norm_constants(device)
        labels = _to(batch.labels[order], device)
        if device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
            self._held.append((done, images))
        return _scale_shift(out, scale, bias, torch.float32), labels

    def decode(self, batch: JPEGBatch, device: torch.device) -> list[torch.Tensor]:
        """Every image of ``batch`` as uint8 ``(3, H, W)`` on ``device``."""
        out: list[torch.Tensor | None] = [None if t is None else _to(t, device) for t in batch.decoded]
        todo = [i for i, d in enumerate(batch.data) if d is not None]
        if todo:
            try:
                got = _nvjpeg([batch.data[i] for i in todo], device)  # type: ignore[misc]
            except RuntimeError:  # one image nvJPEG refuses fails the call: decode one by one
                got = [self._one(batch, i, device) for i in todo]
            for i, image in zip(todo, got, strict=True):
                out[i] = image
        return out  # type: ignore[return-value]

    @staticmethod
    def _one(batch: JPEGBatch, i: int, device: torch.device) -> torch.Tensor:
        data = batch.data[i]
        assert data is not None
        try:
            return _nvjpeg([data], device)[0]
        except RuntimeError:  # decoded on the CPU, or named there when it cannot be decoded at all
            return _to(decode_rgb(bytearray(data.numpy().tobytes()), batch.names[i]), device)

    def crop(self, images: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The crops of ``images`` (NCHW channels_last, float16 on a GPU) and the order they come in."""
        size = self.image_size
        meta = torch.tensor([[int(t.shape[1]), int(t.shape[2]), 0] for t in images], dtype=torch.int32)
        hw = meta[:, :2].float()
        boxes, flip = self._norm.boxes(meta, self.augment is not None, self.generator)
        region = _regions(boxes, hw, size)  # int64 (x0, y0, x1, y1) a box needs, inside its image
        extent = region[:, 2:] - region[:, :2]  # (width, height)
        transposed = extent[:, 1] > extent[:, 0]  # the longer side along the canvas' width
        stored = torch.where(transposed.view(-1, 1), extent, extent.flip(1))  # (h, w) on the canvas
        local = boxes.clone()
        local[:, :2] -= region[:, :2].to(torch.float32)
        order = torch.argsort(stored[:, 0] * stored[:, 1], descending=True, stable=True)
        # float16 on a GPU: uint8 is exact in it and the matrix products run on tensor cores
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        regions, sideways = region.tolist(), transposed.tolist()
        parts = []
        for group in order.split(GROUP):
            idx = group.tolist()
            h, w = int(stored[group, 0].max()), int(stored[group, 1].max())
            canvas = torch.zeros((len(idx), 3, h, w), dtype=dtype, device=device)
            for row, i in enumerate(idx):
                x0, y0, x1, y1 = regions[i]
                src = images[i][:, y0:y1, x0:x1]
                if sideways[i]:
                    canvas[row, :, : x1 - x0, : y1 - y0].copy_(src.transpose(1, 2))
                else:
                    canvas[row, :, : y1 - y0, : x1 - x0].copy_(src)
            meta = torch.cat([stored[group], transposed[group].view(-1, 1).to(torch.int64)], dim=1)
            shrink = float((boxes[group, 2:] / size).max())
            parts.append(resample(
                canvas, _to(meta.to(torch.int32), device), _to(local[group], device),
                None if flip is None else _to(flip[group], device), size, band_size(shrink),
            ))  # fmt: skip
        out = parts[0] if len(parts) == 1 else torch.cat(parts).contiguous(memory_format=torch.channels_last)
        return out, order


def _to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (on the host) on ``device``, copied from pinned memory so the copy waits for nothing."""
    if device.type != "cuda":
        return tensor
    return (tensor if tensor.is_pinned() else tensor.pin_memory()).to(device, non_blocking=True)


def _regions(boxes: torch.Tensor, hw: torch.Tensor, size: int) -> torch.Tensor:
    """The pixels ``(x0, y0, x1, y1)`` each box's resampling reads: the box widened by the filter's reach."""
    x0, y0, bw, bh = boxes.to(torch.float64).unbind(1)
    mx = torch.ceil(torch.clamp(bw / size, min=1.0)) + 1
    my = torch.ceil(torch.clamp(bh / size, min=1.0)) + 1
    height, width = hw[:, 0].to(torch.float64), hw[:, 1].to(torch.float64)
    left = torch.clamp(torch.floor(x0) - mx, min=0)
    top = torch.clamp(torch.floor(y0) - my, min=0)
    right = torch.minimum(torch.ceil(x0 + bw) + mx, width)
    bottom = torch.minimum(torch.ceil(y0 + bh) + my, height)
    return torch.stack([left, top, right, bottom], dim=1).to(torch.int64)


class NVJPEGLoader(ContinuousDataLoader):
    """A ``ContinuousDataLoader`` of JPEG bytes read by ``reader_threads`` threads, decoded by its
    ``device_transform`` (``NVJPEGCrops``) on the staging thread.

    Example:
        >>> crops = NVJPEGCrops(224, AugmentConfig())
        >>> loader = NVJPEGLoader(folder, batch_size=256, shuffle=True, drop_last=True, pin_memory=True,
        ...                       reader_threads=4, device_transform=crops)  # doctest: +SKIP
    """

    def __init__(self, *args: Any, reader_threads: int = GPU_READ_THREADS, device_transform: Any = None,
                 feed_info: Any = None, read_threads: int = 0, **kwargs: Any) -> None:  # fmt: skip
        # every argument is named here: Lightning re-creates the loader (under DDP) from this signature
        super().__init__(*args, device_transform=device_transform, feed_info=feed_info,
                         read_threads=read_threads, **kwargs)  # fmt: skip
        check_int(reader_threads, "reader_threads", low=1)
        self.reader_threads = reader_threads

    def _batches(self) -> Iterator[Any]:
        jobs = (functools.partial(read_jpeg_batch, self.dataset, list(b)) for b in self._index_batches())
        return read_ahead(jobs, self.reader_threads)
