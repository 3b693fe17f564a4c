"""GPU batch transforms: uint8 canvases -> normalized channels_last float NCHW crops of the whole image, each
box resized as PIL's bilinear by two batched matrix products (docs/accuracy.md), without host sync."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lightning_gpuopt._checks import check_arg, check_float, check_int, check_pair, is_number
from lightning_gpuopt._common import IMAGENET_MEAN, IMAGENET_STD, eval_resize_size

#: tries torchvision's ``RandomResizedCrop.get_params`` makes before its fallback.
CROP_ATTEMPTS = 10
#: elements the rows of the resize matrices are padded to (16 bytes of float16)
_ALIGN = 8


@dataclass(frozen=True)
class AugmentConfig:
    """Training augmentation: torchvision's ``RandomResizedCrop`` + ``RandomHorizontalFlip``.

    Args:
        scale: range of the crop's area as a fraction of the whole image (torchvision's default).
        ratio: range of the crop's aspect ratio, width / height (log-uniform).
        flip_p: probability of a horizontal flip.

    Example:
        >>> AugmentConfig(scale=(0.25, 1.0))  # a milder crop than ImageNet's recipe
        AugmentConfig(scale=(0.25, 1.0), ratio=(0.75, 1.3333333333333333), flip_p=0.5)
    """

    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip_p: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale", check_pair(self.scale, "augment.scale", 0.0, 1.0, "area fraction"))
        object.__setattr__(
            self, "ratio", check_pair(self.ratio, "augment.ratio", 0.0, None, "width / height")
        )
        flip_p = check_float(self.flip_p, "augment.flip_p", low=0.0, high=1.0, what="(a probability)")
        object.__setattr__(self, "flip_p", flip_p)


def full_image_meta(images: torch.Tensor) -> torch.Tensor:
    """``meta`` for a batch whose arrays are wholly valid, upright images: ``(H, W, 0)`` per sample."""
    n, h, w = images.shape[:3]
    meta = torch.zeros(n, 3, dtype=torch.int32, device=images.device)  # built on the device: no copy, no sync
    meta[:, 0], meta[:, 1] = h, w
    return meta


def image_sizes(meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(heights, widths)`` (float32) of the images as they are seen, from stored ``meta`` (transposed back)."""
    m = meta.to(torch.float32)
    t = meta[:, 2] != 0
    return torch.where(t, m[:, 1], m[:, 0]), torch.where(t, m[:, 0], m[:, 1])


def random_resized_crop_boxes(
    heights: torch.Tensor,
    widths: torch.Tensor,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """float32 ``(N, 4)`` boxes ``(x0, y0, w, h)`` by torchvision's ``RandomResizedCrop.get_params`` rule."""
    n, a = heights.shape[0], CROP_ATTEMPTS
    height, width = heights.view(n, 1).float(), widths.view(n, 1).float()
    u = torch.rand(n, 2 * a + 2, device=heights.device, generator=generator)
    log_r0, log_r1 = math.log(ratio[0]), math.log(ratio[1])
    frac = scale[0] + (scale[1] - scale[0]) * u[:, :a]
    r = torch.exp(log_r0 + (log_r1 - log_r0) * u[:, a : 2 * a])
    area = height * width
    w = torch.sqrt(area * frac * r)
    h = torch.sqrt(area * frac / r)
    fits = (w <= width) & (h <= height)
    first = fits.to(torch.uint8).argmax(dim=1, keepdim=True)  # the first try that fits (0 if none)
    w, h = w.gather(1, first).squeeze(1), h.gather(1, first).squeeze(1)
    height, width = height.squeeze(1), width.squeeze(1)
    # torchvision's fallback: the whole image, clamped to the ratio range, centered
    aspect = width / height
    fw = torch.where(aspect > ratio[1], height * ratio[1], width)
    fh = torch.where(aspect < ratio[0], width / ratio[0], height)
    found = fits.any(dim=1)
    w, h = torch.where(found, w, fw), torch.where(found, h, fh)
    x0 = torch.where(found, u[:, -2] * (width - w), (width - w) / 2)
    y0 = torch.where(found, u[:, -1] * (height - h), (height - h) / 2)
    return torch.stack([x0, y0, w, h], dim=1)


def center_crop_boxes(heights: torch.Tensor, widths: torch.Tensor, image_size: int) -> torch.Tensor:
    """float32 ``(N, 4)`` boxes ``(x0, y0, w, h)`` of torchvision's evaluation ``Resize + CenterCrop``."""
    resize = eval_resize_size(image_size)
    h = heights.round().to(torch.int64)
    w = widths.round().to(torch.int64)
    portrait = w <= h  # torchvision: short, long = (w, h) if w <= h else (h, w)
    long_side = torch.div(resize * torch.maximum(h, w), torch.minimum(h, w), rounding_mode="floor")
    rh = torch.where(portrait, long_side, torch.full_like(h, resize))
    rw = torch.where(portrait, torch.full_like(w, resize), long_side)
    top = ((rh - image_size).float() / 2).round()
    left = ((rw - image_size).float() / 2).round()
    sy, sx = h.float() / rh.float(), w.float() / rw.float()
    return torch.stack([left * sx, top * sy, image_size * sx, image_size * sy], dim=1)


def band_size(largest_shrink: float) -> int:
    """Input pixels a row of weights spans where a box shrinks by at most ``largest_shrink`` (``s``):
    ``ceil(2 max(s, 1)) + 1``."""
    return math.ceil(2.0 * max(largest_shrink, 1.0) - 1e-6) + 1


def resize_weights(
    start: torch.Tensor,
    length: torch.Tensor,
    valid: torch.Tensor,
    flip: torch.Tensor | None,
    size: int,
    extent: int,
    band: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(N, size, extent)`` matrices of PIL's antialiased bilinear resize of each box (``start``, ``length``)
    along one axis, over ``band`` pixels a row, nothing at or past ``valid``; ``flip`` reverses the output."""
    n, device = start.shape[0], start.device
    start, length = start.to(torch.float32).view(n, 1, 1), length.to(torch.float32).view(n, 1, 1)
    valid = valid.to(device=device, dtype=torch.float32).view(n, 1, 1)
    scale = length / size
    half = scale.clamp(min=1.0)
    o = torch.arange(size, device=device, dtype=torch.float32).view(1, size, 1) + 0.5
    if flip is not None:
        o = torch.where(flip.view(n, 1, 1), size - o, o)
    centre = start + o * scale  # (N, size, 1)
    # the band's first pixel, kept inside the valid region where the region is wide enough
    first = torch.floor(centre - half + 0.5).clamp(min=0.0)
    first = torch.minimum(first, (valid - band).clamp(min=0.0))
    j = first + torch.arange(band, device=device, dtype=torch.float32).view(1, 1, band)  # (N, size, band)
    w = (1.0 - (j + 0.5 - centre).abs() / half).clamp(min=0.0) * (j < valid)
    w = w / w.sum(dim=2, keepdim=True).clamp(min=1e-12)
    # rows padded to a multiple of 8 elements: aligned operands let cuBLAS use its tensor-core kernels (an
    # odd row stride falls back to a byte-aligned kernel several times slower)
    stride = -(-(extent + band) // _ALIGN) * _ALIGN
    dense = torch.zeros(n, size, stride, device=device, dtype=dtype)
    dense.scatter_(2, j.to(torch.int64), w.to(dtype))  # band indices are distinct: no write collides
    return dense[..., :extent]


def resample(
    images: torch.Tensor,
    meta: torch.Tensor,
    boxes: torch.Tensor,
    flip: torch.Tensor | None,
    size: int,
    band: int,
) -> torch.Tensor:
    """Each box ``(x0, y0, w, h)`` (upright image pixels) of its ``(N, C, H, W)`` canvas, stored as ``meta``
    says, resized to ``size x size`` (``resize_weights``): rounded, channels_last, in ``images``' dtype."""
    n, c, ch, cw = images.shape
    meta = meta.to(images.device)
    x0, y0, bw, bh = boxes.to(torch.float32).unbind(1)
    t = meta[:, 2] != 0
    no_flip = torch.zeros_like(t)
    f = no_flip if flip is None else flip.to(device=images.device, dtype=torch.bool)
    # canvas columns hold the image's x unless transposed, canvas rows its y; both axes' matrices in one
    # call (2N samples), so the small kernels that build them launch once
    weights = resize_weights(
        torch.cat([torch.where(t, y0, x0), torch.where(t, x0, y0)]),
        torch.cat([torch.where(t, bh, bw), torch.where(t, bw, bh)]),
        torch.cat([meta[:, 1], meta[:, 0]]),
        torch.cat([torch.where(t, no_flip, f), torch.where(t, f, no_flip)]),
        size, max(ch, cw), band, images.dtype,
    )  # fmt: skip
    cols, rows = weights[:n, :, :cw], weights[n:, :, :ch]
    # (N, T, C*H): columns first (the longer axis); then the rows, as rows x tmp^T: (N, S, T*C), so the
    # channels come out innermost
    tmp = torch.bmm(cols, images.reshape(n, c * ch, cw).transpose(1, 2))
    out = torch.bmm(rows, tmp.view(n, size * c, ch).transpose(1, 2)).view(n, size, size, c)
    # out[n, S, T, c]: S indexes output canvas rows, T output canvas columns: an upright sample's (y, x), NHWC
    # (channels_last) already; a transposed sample's (x, y), swapped back here
    nhwc = torch.empty_like(out)
    torch.where(t.view(n, 1, 1, 1), out.transpose(1, 2), out, out=nhwc)
    return nhwc.round_().permute(0, 3, 1, 2)


def _scale_shift(
    x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=dtype, device=x.device, memory_format=torch.channels_last)
    # one kernel: reads x in any layout and dtype, writes bias + x * scale channels_last in ``dtype``
    torch.addcmul(bias, x, scale, out=out)
    return out


def check_mean_std(mean: object, std: object) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``mean`` and ``std`` as float tuples in [0, 1] units, one value a channel, or a one-line error."""
    for name, value in (("mean", mean), ("std", std)):
        check_arg(
            isinstance(value, (tuple, list)) and all(is_number(v) for v in value),
            name,
            value,
            "a sequence of numbers, one per channel",
            f"e.g. {name}={IMAGENET_MEAN if name == 'mean' else IMAGENET_STD} (ImageNet, the default)",
            error=TypeError,
        )
    m = tuple(float(v) for v in mean)  # type: ignore[attr-defined]
    s = tuple(float(v) for v in std)  # type: ignore[attr-defined]
    check_arg(
        len(m) == len(s) and len(m) in (1, 3, 4), "mean/std", (m, s), "one value per channel (1, 3 or 4)"
    )
    check_arg(all(v > 0 for v in s), "std", s, "> 0 in every channel")
    check_arg(
        all(v <= 1.5 for v in m + s),
        "mean/std",
        (m, s),
        "in [0, 1] units",
        f"divide by 255, e.g. mean={IMAGENET_MEAN}, std={IMAGENET_STD}",
    )
    return m, s


class GPUAugment(nn.Module):
    """uint8 canvases on the device -> normalized channels_last NCHW float crops: a random resized crop and
    flip (train) or ``Resize + CenterCrop`` (eval) of the whole image, resized as PIL's bilinear.

    Args:
        image_size: output side in pixels.
        augment: the training crop and flip.
        mean: per-channel mean in [0, 1] units.
        std: per-channel std in [0, 1] units.
        output_dtype: dtype of the output (resampling runs in float16 on a GPU, float32 on a CPU).
        generator: optional ``torch.Generator`` on the batch's device, for reproducible crops.

    Example:
        >>> from lightning_gpuopt.data import layout
        >>> aug = GPUAugment(image_size=224)
        >>> canvas = torch.zeros(8, *layout.canvas_shape(256), 3, dtype=torch.uint8)
        >>> meta = torch.tensor([[256, 341, 0]] * 8, dtype=torch.int32)  # 341x256 landscape images
        >>> x = aug(canvas, meta, train=True)
        >>> x.shape, x.is_contiguous(memory_format=torch.channels_last)
        (torch.Size([8, 3, 224, 224]), True)
    """

    def __init__(
        self,
        image_size: int = 224,
        augment: AugmentConfig | None = None,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        output_dtype: torch.dtype = torch.float32,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        check_int(image_size, "image_size", low=1, what="(pixels)")
        augment = AugmentConfig() if augment is None else augment
        check_arg(isinstance(augment, AugmentConfig), "augment", augment, "an AugmentConfig", error=TypeError)
        check_arg(
            isinstance(output_dtype, torch.dtype) and output_dtype.is_floating_point,
            "output_dtype",
            output_dtype,
            "a floating torch dtype (torch.float32, torch.float16, torch.bfloat16)",
        )
        self.image_size = image_size
        self.augment = augment
        self.mean, self.std = check_mean_std(mean, std)
        self.output_dtype = output_dtype
        self.generator = generator
        # per-device normalization constants: built once, so no host->device copy per step
        self._constants: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _norm_constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._constants:
            c = len(self.mean)
            scale = torch.tensor([1.0 / (255.0 * s) for s in self.std]).view(1, c, 1, 1)
            bias = torch.tensor([-m / s for m, s in zip(self.mean, self.std, strict=True)]).view(1, c, 1, 1)
            self._constants[device] = (scale.to(device), bias.to(device))
        return self._constants[device]

    def boxes(
        self, meta: torch.Tensor, train: bool, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Crop boxes ``(x0, y0, w, h)`` in each image's own (upright) pixels, ``(N, 4)`` float32, and flips:
        the training crop and flip drawn from ``generator``, or (``train=False``) the evaluation boxes."""
        heights, widths = image_sizes(meta)
        if not train:
            return center_crop_boxes(heights, widths, self.image_size), None
        a = self.augment
        boxes = random_resized_crop_boxes(heights, widths, a.scale, a.ratio, generator)
        return boxes, torch.rand(meta.shape[0], device=meta.device, generator=generator) < a.flip_p

    def forward(
        self, images: torch.Tensor, meta: torch.Tensor | None = None, train: bool | None = None
    ) -> torch.Tensor:
        """Transform uint8 ``(N, H, W, C)`` canvases with ``meta`` ``(h, w, transposed)`` (``None``: whole
        upright images); ``train``: random crop + flip, else the evaluation view (``None``: ``self.training``)."""
        where = f"{type(self).__name__}.forward"
        name, must = f"{where}'s images", "uint8 of shape (N, H, W, C) with C in (1, 3, 4)"
        check_arg(isinstance(images, torch.Tensor), name, type(images).__name__, must, error=TypeError)
        fix = (
            "datasets feeding OptimizedDataModule return uint8 HWC images (0..255), normalized on the GPU: return "
            "e.g. `np.asarray(pil_image)`, not a float tensor"
        )
        check_arg(images.dtype == torch.uint8, name, f"dtype {images.dtype}", must, fix, TypeError)
        fix = "return HWC images, not CHW (`img.permute(1, 2, 0)` / `arr.transpose(1, 2, 0)`)"
        ok = images.dim() == 4 and images.shape[-1] in (1, 3, 4)
        check_arg(ok, name, f"shape {tuple(images.shape)}", must, fix, TypeError)
        c, fix = f"{len(self.mean)} channels, one per mean/std value", "pass one mean/std value per channel"
        check_arg(images.shape[-1] == len(self.mean), name, f"{images.shape[-1]} channels", c, fix)
        device = images.device
        meta = full_image_meta(images) if meta is None else meta.to(device)
        check_arg(
            meta.dim() == 2 and meta.shape == (images.shape[0], 3),
            f"{where}'s meta",
            f"shape {tuple(meta.shape)} for {images.shape[0]} images",
            "(N, 3) = (h, w, transposed) per sample (lightning_gpuopt.data.layout)",
        )
        train = self.training if train is None else train
        boxes, flip = self.boxes(meta, train, self.generator)
        # float16 on a GPU: uint8 is exact in it and the matrix products run on tensor cores
        compute = torch.float16 if device.type == "cuda" else torch.float32
        x = images.permute(0, 3, 1, 2).to(compute, memory_format=torch.contiguous_format)
        # the largest shrink: a training crop can span the whole stored image, the evaluation box is
        # image_size / eval_resize_size of the stored image
        sides = images.shape[1:3]
        largest = max(sides) / self.image_size if train else min(sides) / eval_resize_size(self.image_size)
        x = resample(x, meta, boxes, flip, self.image_size, band_size(largest))
        return _scale_shift(x, *self._norm_constants(device), self.output_dtype)

    def extra_repr(self) -> str:
        return f"image_size={self.image_size}, augment={self.augment}, output_dtype={self.output_dtype}"
