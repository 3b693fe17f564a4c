"""GPU batch transforms: uint8 NHWC -> normalized float NCHW (channels_last), with batched crops and flips.

The host ships uint8 HWC images (a quarter of float32's bytes); everything else happens here on the
device, for the whole batch at once:

- train: random resized crop + horizontal flip as ONE ``F.grid_sample`` with a per-sample affine ``theta``
  (flip = negative x scale), then normalize;
- eval: center crop + resize (``F.interpolate``, antialiased), then normalize.

No per-sample Python loops, no host synchronisation, random numbers drawn on the batch's device. The
functions are plain PyTorch and know nothing about Lightning; ``GPUAugment`` bundles them as a module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def check_uint8_nhwc(images: object, where: str = "GPUAugment") -> torch.Tensor:
    """Return ``images`` if it is a uint8 ``(N, H, W, C)`` tensor, else raise ``TypeError`` saying why.

    Only metadata is read (no device sync).
    """
    if not isinstance(images, torch.Tensor):
        raise TypeError(
            f"{where}: expected a uint8 image tensor of shape (N, H, W, C), got {type(images).__name__}"
        )
    if images.dtype != torch.uint8:
        raise TypeError(
            f"{where}: expected uint8 images (N, H, W, C), got dtype {images.dtype}. Datasets feeding "
            "OptimizedDataModule must return uint8 HWC images (0..255); normalization and float conversion "
            "happen on the GPU. Return e.g. `np.asarray(pil_image)` instead of a float tensor."
        )
    if images.dim() != 4 or images.shape[-1] not in (1, 3, 4):
        raise TypeError(
            f"{where}: expected uint8 images of shape (N, H, W, C) with C in (1, 3, 4) (HWC per sample), got "
            f"shape {tuple(images.shape)}. If your dataset returns CHW images, return HWC instead "
            "(`img.permute(1, 2, 0)` / `arr.transpose(1, 2, 0)`)."
        )
    return images


def nhwc_to_nchw(images: torch.Tensor) -> torch.Tensor:
    """View a contiguous ``(N, H, W, C)`` tensor as ``(N, C, H, W)``: a channels_last view, no copy."""
    return images.permute(0, 3, 1, 2)


def random_resized_crop_boxes(
    n: int,
    height: int,
    width: int,
    scale: tuple[float, float] = (0.25, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    device: torch.device | str | None = None,
    generator: torch.Generator | None = None,
    attempts: int = 10,
) -> torch.Tensor:
    """Sample random-resized-crop boxes for ``n`` images, torchvision's rule, vectorized.

    Each box covers a fraction of the image area drawn uniformly from ``scale`` with an aspect ratio
    (w/h) drawn log-uniformly from ``ratio``. Like torchvision, ``attempts`` draws are made and the first
    one that fits is kept; if none fits, the whole image (clamped to ``ratio``) is used, centered.
    Coordinates are continuous pixels (grid_sample interpolates), not rounded.

    Returns:
        float32 tensor ``(n, 4)`` of ``(x0, y0, w, h)`` in pixels, on ``device``.
    """
    lo, hi = float(scale[0]), float(scale[1])
    log_r0, log_r1 = math.log(ratio[0]), math.log(ratio[1])
    u = torch.rand(n, 2 * attempts + 2, device=device, generator=generator)
    area = float(height * width)
    s = lo + (hi - lo) * u[:, :attempts]
    r = torch.exp(log_r0 + (log_r1 - log_r0) * u[:, attempts : 2 * attempts])
    w = torch.sqrt(area * s * r)
    h = torch.sqrt(area * s / r)
    fits = (w <= width) & (h <= height)
    first = fits.to(torch.uint8).argmax(dim=1, keepdim=True)  # first fitting attempt (0 if none fits)
    any_fit = fits.any(dim=1)
    w = w.gather(1, first).squeeze(1)
    h = h.gather(1, first).squeeze(1)
    # fallback: the whole image, clamped to the ratio range (torchvision's central crop)
    in_ratio = width / height
    if in_ratio < ratio[0]:
        fw, fh = float(width), width / ratio[0]
    elif in_ratio > ratio[1]:
        fw, fh = height * ratio[1], float(height)
    else:
        fw, fh = float(width), float(height)
    w = torch.where(any_fit, w, torch.full_like(w, fw))
    h = torch.where(any_fit, h, torch.full_like(h, fh))
    x0 = u[:, -2] * (width - w)
    y0 = u[:, -1] * (height - h)
    return torch.stack([x0, y0, w, h], dim=1)


def crop_resize_flip(
    images: torch.Tensor,
    boxes: torch.Tensor,
    size: int | tuple[int, int],
    flip: torch.Tensor | None = None,
) -> torch.Tensor:
    """Crop each image to its box, resize it to ``size`` and optionally mirror it, in one ``grid_sample``.

    Args:
        images: float ``(N, C, H, W)`` (any memory format).
        boxes: ``(N, 4)`` ``(x0, y0, w, h)`` in pixels (see ``random_resized_crop_boxes``).
        size: output side (or ``(height, width)``).
        flip: optional bool ``(N,)``; True mirrors that sample horizontally.

    Returns:
        ``(N, C, size, size)`` in the dtype of ``images`` (bilinear, border padding).
    """
    n, c, height, width = images.shape
    out_h, out_w = (size, size) if isinstance(size, int) else size
    boxes = boxes.to(device=images.device, dtype=torch.float32)
    x0, y0, w, h = boxes.unbind(1)
    sx = w / width
    if flip is not None:
        sx = torch.where(flip.to(images.device), -sx, sx)
    theta = torch.zeros(n, 2, 3, device=images.device, dtype=torch.float32)
    # align_corners=False: normalized -1..1 spans pixel edges, so box [x0, x0+w] maps to
    # center (2*x0 + w)/W - 1 and half-extent w/W
    theta[:, 0, 0] = sx
    theta[:, 0, 2] = (2 * x0 + w) / width - 1
    theta[:, 1, 1] = h / height
    theta[:, 1, 2] = (2 * y0 + h) / height - 1
    grid = F.affine_grid(theta.to(images.dtype), [n, c, out_h, out_w], align_corners=False)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=False)


def center_crop_resize(images: torch.Tensor, size: int, crop_fraction: float = 0.875) -> torch.Tensor:
    """Evaluation view: the central square of side ``crop_fraction`` x short side, resized to ``size``.

    Equivalent to "resize the short side to ``size / crop_fraction``, then center-crop ``size``" (the
    ImageNet 256 -> 224 recipe) but resamples only the pixels kept. When the square already has side
    ``size`` this is a pure slice (no interpolation).

    Args:
        images: float ``(N, C, H, W)``.
        size: output side.
        crop_fraction: fraction of the short side kept (0.875 = 224/256).
    """
    _, _, height, width = images.shape
    side = max(1, min(height, width, round(min(height, width) * crop_fraction)))
    top, left = (height - side) // 2, (width - side) // 2
    crop = images[:, :, top : top + side, left : left + side]
    if side == size:
        return crop
    # antialias matters when shrinking; it is ignored when enlarging
    return F.interpolate(crop, size=(size, size), mode="bilinear", align_corners=False, antialias=side > size)


def normalize(
    images: torch.Tensor,
    mean: Sequence[float],
    std: Sequence[float],
    input_scale: float = 1.0,
    dtype: torch.dtype | None = None,
    memory_format: torch.memory_format = torch.channels_last,
) -> torch.Tensor:
    """``(images * input_scale - mean) / std`` per channel, written once in ``memory_format`` and ``dtype``.

    ``input_scale=1/255`` folds the uint8 -> [0, 1] scaling into the same multiply-add. The constants are
    copied to the device on each call; ``GPUAugment`` caches them instead.
    """
    c = images.shape[1]
    if len(mean) != c or len(std) != c:
        raise ValueError(f"mean/std have {len(mean)}/{len(std)} values but the images have {c} channels")
    compute = images.dtype if images.dtype.is_floating_point else torch.float32
    scale = torch.tensor([input_scale / s for s in std], dtype=compute).view(1, c, 1, 1)
    bias = torch.tensor([-m / s for m, s in zip(mean, std, strict=True)], dtype=compute).view(1, c, 1, 1)
    return _scale_shift(
        images.to(compute), scale.to(images.device), bias.to(images.device), dtype, memory_format
    )


def _scale_shift(
    x: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    dtype: torch.dtype | None,
    memory_format: torch.memory_format = torch.channels_last,
) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=dtype or x.dtype, device=x.device, memory_format=memory_format)
    if out.dtype == x.dtype:
        # one kernel: reads x in any layout, writes bias + x * scale in the requested one
        torch.addcmul(bias, x, scale, out=out)
    else:
        out.copy_(torch.addcmul(bias, x, scale))
    return out


class GPUAugment(nn.Module):
    """uint8 NHWC batch on the device -> normalized, augmented, channels_last NCHW float batch.

    Train: random resized crop (``scale``, ``ratio``) + horizontal flip (probability ``flip_p``), one
    ``grid_sample`` for the whole batch. Eval: center crop (``eval_crop_fraction`` of the short side) +
    antialiased resize. Both end with per-channel normalization and write channels_last NCHW in
    ``output_dtype``.

    Args:
        image_size: output side in pixels.
        mean: per-channel mean in [0, 1] units.
        std: per-channel std in [0, 1] units.
        scale: random-resized-crop area range (fraction of the image).
        ratio: random-resized-crop aspect-ratio range (w/h).
        flip_p: probability of a horizontal flip (train).
        eval_crop_fraction: fraction of the short side kept in evaluation (224/256).
        output_dtype: dtype of the output (``torch.float32``, ``torch.float16``, ``torch.bfloat16``).
            With a half dtype on CUDA the resampling also runs in half.
        generator: optional ``torch.Generator`` on the batch's device, for reproducible crops.

    Example:
        >>> aug = GPUAugment(image_size=224)
        >>> x = aug(torch.zeros(8, 256, 256, 3, dtype=torch.uint8), train=True)
        >>> x.shape, x.is_contiguous(memory_format=torch.channels_last)
        (torch.Size([8, 3, 224, 224]), True)
    """

    def __init__(
        self,
        image_size: int = 224,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        scale: tuple[float, float] = (0.25, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip_p: float = 0.5,
        eval_crop_fraction: float = 0.875,
        output_dtype: torch.dtype = torch.float32,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(image_size, int) or image_size < 1:
            raise ValueError(f"image_size must be a positive int, got {image_size!r}")
        if len(mean) != len(std) or len(mean) not in (1, 3, 4):
            raise ValueError(f"mean and std need one value per channel (1, 3 or 4), got {mean!r} and {std!r}")
        if any(s <= 0 for s in std):
            raise ValueError(f"std values must be > 0, got {std!r}")
        if any(m > 1.5 for m in mean) or any(s > 1.5 for s in std):
            raise ValueError(
                f"mean/std look like 0..255 units ({mean!r}, {std!r}); give them in [0, 1] units, "
                "e.g. mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)"
            )
        if not (0 < scale[0] <= scale[1] <= 1):
            raise ValueError(f"scale must satisfy 0 < min <= max <= 1, got {scale!r}")
        if not (0 < ratio[0] <= ratio[1]):
            raise ValueError(f"ratio must satisfy 0 < min <= max, got {ratio!r}")
        if not (0.0 <= flip_p <= 1.0):
            raise ValueError(f"flip_p must be in [0, 1], got {flip_p!r}")
        if not (0 < eval_crop_fraction <= 1):
            raise ValueError(f"eval_crop_fraction must be in (0, 1], got {eval_crop_fraction!r}")
        if not output_dtype.is_floating_point:
            raise ValueError(f"output_dtype must be a floating dtype, got {output_dtype}")
        self.image_size = image_size
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.flip_p = float(flip_p)
        self.eval_crop_fraction = float(eval_crop_fraction)
        self.output_dtype = output_dtype
        self.generator = generator
        # per (device, dtype) normalization constants: built once, so no host->device copy per step
        self._constants: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def _compute_dtype(self, device: torch.device) -> torch.dtype:
        # grid_sample/interpolate in half are fine on CUDA; on CPU they are slow or missing, so use fp32
        if device.type == "cuda" and self.output_dtype in (torch.float16, torch.bfloat16):
            return self.output_dtype
        return torch.float32

    def _norm_constants(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, dtype)
        if key not in self._constants:
            c = len(self.mean)
            scale = torch.tensor([1.0 / (255.0 * s) for s in self.std], dtype=dtype).view(1, c, 1, 1)
            bias = torch.tensor([-m / s for m, s in zip(self.mean, self.std, strict=True)], dtype=dtype)
            self._constants[key] = (scale.to(device), bias.view(1, c, 1, 1).to(device))
        return self._constants[key]

    def forward(self, images: torch.Tensor, train: bool | None = None) -> torch.Tensor:
        """Transform a uint8 ``(N, H, W, C)`` batch; ``train=None`` follows ``self.training``."""
        check_uint8_nhwc(images, f"{type(self).__name__}.forward")
        if images.shape[-1] != len(self.mean):
            raise ValueError(
                f"images have {images.shape[-1]} channels but mean/std have {len(self.mean)} values; "
                "pass one mean/std value per channel"
            )
        train = self.training if train is None else train
        device = images.device
        dtype = self._compute_dtype(device)
        x = nhwc_to_nchw(images).to(dtype)  # keeps the channels_last strides: one read, one write
        n, _, height, width = x.shape
        if train:
            boxes = random_resized_crop_boxes(
                n, height, width, self.scale, self.ratio, device=device, generator=self.generator
            )
            flip = None
            if self.flip_p > 0:
                flip = torch.rand(n, device=device, generator=self.generator) < self.flip_p
            x = crop_resize_flip(x, boxes, self.image_size, flip)
        else:
            x = center_crop_resize(x, self.image_size, self.eval_crop_fraction)
        scale, bias = self._norm_constants(device, dtype)
        return _scale_shift(x, scale, bias, self.output_dtype, torch.channels_last)

    def extra_repr(self) -> str:
        return (
            f"image_size={self.image_size}, scale={self.scale}, ratio={self.ratio}, flip_p={self.flip_p}, "
            f"eval_crop_fraction={self.eval_crop_fraction}, output_dtype={self.output_dtype}"
        )
