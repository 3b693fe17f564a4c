"""GPU batch transforms: uint8 canvases -> normalized float NCHW (channels_last), cropped from the whole image.

The host ships uint8 images kept whole on a fixed canvas (``lightning_gpuopt.data.layout``) with a per-sample
``meta = (h, w, transposed)``; everything else happens here on the device, for the whole batch at once:

- train: torchvision's ``RandomResizedCrop`` sampling (area fraction uniform in ``scale``, log aspect ratio
  uniform in ``ratio``, 10 tries, then the whole image clamped to the ratio range) drawn per sample in the
  image's own coordinates, plus a horizontal flip;
- eval: ``Resize(eval_resize_size(image_size)) + CenterCrop(image_size)`` of the whole image, as a box.

The box, flip and the transposition of portrait images become one per-sample 2x3 ``theta``; one affine
grid (``F.affine_grid``'s, built from broadcast sums) and one ``F.grid_sample`` (bilinear,
``align_corners=False``, edges replicated at the image's border; k x k taps per pixel, averaged, where a box
shrinks, which antialiases like PIL's bilinear resize) resample the batch, values are rounded to integers as torchvision's uint8 pipeline rounds, then
normalized into channels_last NCHW. No per-sample Python loop, no host synchronisation; random numbers are
drawn on the batch's device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from lightning_gpuopt._common import IMAGENET_MEAN, IMAGENET_STD, eval_resize_size
from lightning_gpuopt.data._checks import check_arg, check_pair, is_int, is_number

#: most antialiasing taps per axis (``GPUAugment.antialias_taps``): shrinks beyond it are filtered more weakly.
MAX_TAPS = 4
#: tries torchvision's ``RandomResizedCrop.get_params`` makes before its fallback.
CROP_ATTEMPTS = 10


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
        check_arg(is_number(self.flip_p), "augment.flip_p", self.flip_p, "a number", error=TypeError)
        check_arg(0.0 <= self.flip_p <= 1.0, "augment.flip_p", self.flip_p, "a probability in [0, 1]")
        object.__setattr__(self, "flip_p", float(self.flip_p))


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
    """Sample one random-resized-crop box per image, torchvision's ``get_params`` rule, vectorized.

    Each try draws an area fraction uniformly from ``scale`` and an aspect ratio (w/h) log-uniformly from
    ``ratio``; the first of ``CROP_ATTEMPTS`` tries that fits inside the image is kept and placed uniformly
    at random. When none fits, the whole image clamped to the ratio range is used, centered. Coordinates
    are continuous pixels (the resampling interpolates), not rounded.

    Args:
        heights: float ``(N,)`` image heights in pixels.
        widths: float ``(N,)`` image widths in pixels.
        scale: area fraction range.
        ratio: aspect ratio range.
        generator: random generator on the tensors' device.

    Returns:
        float32 ``(N, 4)`` boxes ``(x0, y0, w, h)`` in the image's pixels, on the tensors' device.
    """
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
    """The evaluation view as boxes: torchvision's ``Resize(eval_resize_size(image_size))`` then
    ``CenterCrop(image_size)`` of each whole image, mapped back to the image's pixels.

    The resized sides follow torchvision (shorter side to the resize size, the longer one truncated) and the
    crop offset rounds half to even as ``round`` does, so where the image is stored at the resize size the
    box is a whole-pixel window and the result an exact copy of those pixels.

    Returns:
        float32 ``(N, 4)`` boxes ``(x0, y0, w, h)``.
    """
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


def crop_theta(
    meta: torch.Tensor, boxes: torch.Tensor, flip: torch.Tensor | None, canvas: tuple[int, int]
) -> torch.Tensor:
    """Per-sample ``affine_grid`` matrices that read ``boxes`` (image coordinates) out of stored canvases.

    Output column ``u`` and row ``v`` (both in ``[-1, 1]``) map to the image point
    ``(x0 + w (1 + s u) / 2, y0 + h (1 + v) / 2)`` with ``s = -1`` for a flipped sample; a transposed sample
    stores the image's x along the canvas rows, so its matrix swaps the axes.

    Args:
        meta: int ``(N, 3)`` ``(h, w, transposed)`` as stored.
        boxes: float ``(N, 4)`` ``(x0, y0, w, h)`` in image coordinates.
        flip: bool ``(N,)`` or ``None``.
        canvas: ``(height, width)`` of the stored arrays.

    Returns:
        float32 ``(N, 2, 3)``.
    """
    ch, cw = float(canvas[0]), float(canvas[1])
    x0, y0, bw, bh = boxes.to(torch.float32).unbind(1)
    t = meta[:, 2].to(boxes.device) != 0
    s = torch.ones_like(bw) if flip is None else 1.0 - 2.0 * flip.to(bw.dtype)
    zero = torch.zeros_like(bw)
    rows = (
        torch.where(t, zero, s * bw / cw),
        torch.where(t, bh / cw, zero),
        torch.where(t, (2 * y0 + bh) / cw, (2 * x0 + bw) / cw) - 1,
        torch.where(t, s * bw / ch, zero),
        torch.where(t, zero, bh / ch),
        torch.where(t, (2 * x0 + bw) / ch, (2 * y0 + bh) / ch) - 1,
    )
    return torch.stack(rows, dim=1).view(-1, 2, 3)


def affine_grid(theta: torch.Tensor, size: int) -> torch.Tensor:
    """``F.affine_grid(theta, (N, C, size, size), align_corners=False)``, computed as two broadcast sums.

    Each grid coordinate is ``t0 * u + t1 * v + t2`` with ``u`` and ``v`` the output pixel centres in
    ``[-1, 1]``, so it is the sum of a per-column and a per-row term: two kernels over the grid instead of
    ``affine_grid``'s batched matrix product, which costs several times more on a GPU.

    Returns:
        ``(N, size, size, 2)`` in ``theta``'s dtype.
    """
    n = theta.shape[0]
    centres = (torch.arange(size, device=theta.device, dtype=theta.dtype) * 2 + 1) / size - 1
    grid = torch.empty(n, size, size, 2, device=theta.device, dtype=theta.dtype)
    for axis in range(2):
        row = theta[:, axis].view(n, 3, 1, 1)
        torch.add(
            row[:, 0] * centres.view(1, 1, size) + row[:, 2],
            row[:, 1] * centres.view(1, size, 1),
            out=grid[..., axis],
        )
    return grid


def tap_offsets(
    taps: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Positions of ``taps`` equally weighted taps: a triangle distribution's quantile midpoints, scaled to
    unit variance (two taps: -1, 1). Built on ``device`` from ``arange``, so no host-to-device copy."""
    q = (torch.arange(taps, device=device, dtype=dtype) + 0.5) / taps
    pos = torch.where(q < 0.5, torch.sqrt(2 * q) - 1, 1 - torch.sqrt(2 * (1 - q)))
    return pos / pos.square().mean().sqrt()


def antialias_grid(theta: torch.Tensor, shrink: torch.Tensor, size: int, taps: int) -> torch.Tensor:
    """``affine_grid(theta, size)`` with ``taps x taps`` bilinear taps per output pixel, ``(N, taps size,
    taps size, 2)``: ``F.avg_pool2d(grid_sample(...), taps)`` is the antialiased output.

    PIL's (and torchvision's ``antialias=True``) bilinear downscale by ``s`` is a triangle filter of
    half-width ``s`` input pixels (variance ``s^2 / 6``); one bilinear tap is a triangle of half-width 1
    (variance ``1 / 6``). Equally weighted taps along each output axis (``tap_offsets``), spread so that
    their variance is the missing ``(s^2 - 1) / 6``, give the average PIL's low-pass. Where a sample does
    not shrink along an axis (``s <= 1``) its taps coincide and the result is plain bilinear. Like
    ``affine_grid``, the grid is two broadcast sums (a per-column and a per-row term), now with per-sample
    tap positions.

    Args:
        theta: ``(N, 2, 3)`` from ``crop_theta``.
        shrink: ``(N, 2)`` input pixels per output pixel along the output's columns and rows.
        size: output side.
        taps: taps per axis.
    """
    n, k = theta.shape[0], taps
    offsets = tap_offsets(k, theta.device, theta.dtype)
    spread = torch.sqrt(torch.clamp(shrink * shrink - 1.0, min=0.0) / 6.0)  # input pixels
    step = spread / shrink.clamp(min=1e-6) * (2.0 / size)  # normalized output units (a pixel is 2 / size)
    centres = (torch.arange(size, device=theta.device, dtype=theta.dtype) * 2 + 1) / size - 1
    # (N, size * k): pixel centre + tap offset, taps of one pixel adjacent
    cu = (centres.view(1, size, 1) + offsets.view(1, 1, k) * step[:, 0].view(n, 1, 1)).view(n, 1, size * k)
    cv = (centres.view(1, size, 1) + offsets.view(1, 1, k) * step[:, 1].view(n, 1, 1)).view(n, size * k, 1)
    grid = torch.empty(n, size * k, size * k, 2, device=theta.device, dtype=theta.dtype)
    for axis in range(2):
        row = theta[:, axis].view(n, 3, 1, 1)
        torch.add(row[:, 0] * cu + row[:, 2], row[:, 1] * cv, out=grid[..., axis])
    return grid


def resample(
    images: torch.Tensor,
    meta: torch.Tensor,
    theta: torch.Tensor,
    size: int,
    shrink: torch.Tensor | None = None,
    taps: int = 2,
) -> torch.Tensor:
    """One bilinear ``grid_sample`` of ``theta``'s boxes into ``size x size``, edges replicated at each
    image's stored border (``meta``), rounded to integers.

    Args:
        images: float ``(N, C, H, W)`` canvases (any memory format), values 0..255.
        meta: int ``(N, 3)`` ``(h, w, transposed)``.
        theta: ``(N, 2, 3)`` from ``crop_theta``.
        size: output side.
        shrink: ``(N, 2)`` box width and height over ``size``; given, downscaled samples are antialiased
            like PIL's bilinear resize (``antialias_grid``); ``None``: plain bilinear.
        taps: taps per axis where ``shrink`` is given.
    """
    n, _, ch, cw = images.shape
    if shrink is None:
        grid = affine_grid(theta.to(images.dtype), size)
    else:
        grid = antialias_grid(theta.to(images.dtype), shrink.to(images.dtype), size, taps)
    m = meta.to(device=images.device, dtype=images.dtype)
    # pixel centres 0 .. valid-1 in normalized units: sampling never blends in the canvas's padding
    hi = torch.stack([(2 * m[:, 1] - 1) / cw - 1, (2 * m[:, 0] - 1) / ch - 1], dim=1).view(n, 1, 1, 2)
    lo = torch.empty_like(hi)
    lo[..., 0], lo[..., 1] = 1.0 / cw - 1.0, 1.0 / ch - 1.0  # filled on the device: no host copy
    torch.clamp(grid, lo, hi, out=grid)
    out = F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=False)
    if shrink is not None:
        out = F.avg_pool2d(out, taps)  # the taps of each output pixel, averaged
    return out.round_()


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


def check_mean_std(mean: object, std: object) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``mean`` and ``std`` as float tuples in [0, 1] units, one value per channel, or a one-line error."""
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
    """uint8 canvases on the device -> normalized, cropped, channels_last NCHW float batch.

    Train: a random resized crop (``augment.scale``, ``augment.ratio``) drawn in each image's own
    coordinates plus a horizontal flip (``augment.flip_p``). Eval: ``Resize(eval_resize_size(image_size))``
    + ``CenterCrop(image_size)`` of the whole image. Both are one ``grid_sample`` for the whole batch (see
    the module docstring), then per-channel normalization written channels_last in ``output_dtype``.
    Resampling is bilinear; a box larger than the output is antialiased like PIL's bilinear resize (``k x k``
    bilinear taps per output pixel spread by the sample's shrink, averaged; ``antialias_grid``), in the same
    single ``grid_sample``. ``k`` follows the largest shrink the canvas's shape allows (2 for 224-pixel crops
    of 256-pixel stores); where no box can be larger than the output, no taps run.

    Args:
        image_size: output side in pixels.
        augment: the training crop and flip.
        mean: per-channel mean in [0, 1] units.
        std: per-channel std in [0, 1] units.
        output_dtype: dtype of the output (resampling always runs in float32).
        generator: optional ``torch.Generator`` on the batch's device, for reproducible crops.
        antialias: low-pass the samples a box shrinks, as PIL's bilinear resize (torchvision's
            ``antialias=True``) does; ``False`` samples plain bilinear, which aliases crops shrunk by more
            than about 1.5x.

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
        antialias: bool = True,
    ) -> None:
        super().__init__()
        check_arg(is_int(image_size) and image_size >= 1, "image_size", image_size, "a positive int (pixels)")
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
        check_arg(isinstance(antialias, bool), "antialias", antialias, "True or False", error=TypeError)
        self.antialias = antialias
        # per-device normalization constants: built once, so no host->device copy per step
        self._constants: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _norm_constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._constants:
            c = len(self.mean)
            scale = torch.tensor([1.0 / (255.0 * s) for s in self.std]).view(1, c, 1, 1)
            bias = torch.tensor([-m / s for m, s in zip(self.mean, self.std, strict=True)]).view(1, c, 1, 1)
            self._constants[device] = (scale.to(device), bias.to(device))
        return self._constants[device]

    def sample_boxes(self, meta: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Training crop boxes ``(x0, y0, w, h)`` in each image's own (upright) pixels, ``(N, 4)`` float32."""
        heights, widths = image_sizes(meta)
        return random_resized_crop_boxes(heights, widths, self.augment.scale, self.augment.ratio, generator)

    def eval_boxes(self, meta: torch.Tensor) -> torch.Tensor:
        """Evaluation boxes ``(x0, y0, w, h)`` in each image's own pixels, ``(N, 4)`` float32."""
        heights, widths = image_sizes(meta)
        return center_crop_boxes(heights, widths, self.image_size)

    def antialias_taps(self, canvas: tuple[int, int], train: bool) -> int:
        """Taps per axis the resampling of a ``canvas``-sized batch uses: 0 where no box can be larger than
        the output (plain bilinear), else ``ceil`` of the largest shrink possible (at most ``MAX_TAPS``).
        Decided from shapes alone, so no device value is read."""
        if not self.antialias:
            return 0
        # a training crop can span the whole stored image; the evaluation box is image_size /
        # eval_resize_size of the stored image's scale
        largest = max(canvas) / self.image_size if train else min(canvas) / eval_resize_size(self.image_size)
        return 0 if largest <= 1.0 else min(MAX_TAPS, max(2, math.ceil(largest)))

    def forward(
        self, images: torch.Tensor, meta: torch.Tensor | None = None, train: bool | None = None
    ) -> torch.Tensor:
        """Transform a uint8 ``(N, H, W, C)`` batch.

        Args:
            images: uint8 canvases (or fixed-size images that are wholly valid).
            meta: int ``(N, 3)`` ``(h, w, transposed)``; ``None``: every array is a whole upright image.
            train: random crop + flip (True) or the evaluation view (False); ``None`` follows ``self.training``.
        """
        check_uint8_nhwc(images, f"{type(self).__name__}.forward")
        if images.shape[-1] != len(self.mean):
            raise ValueError(
                f"images have {images.shape[-1]} channels but mean/std have {len(self.mean)} values; "
                "pass one mean/std value per channel"
            )
        device = images.device
        meta = full_image_meta(images) if meta is None else meta.to(device)
        if meta.dim() != 2 or meta.shape != (images.shape[0], 3):
            raise ValueError(
                f"{type(self).__name__}.forward: meta must be (N, 3) = (h, w, transposed) per sample, got shape "
                f"{tuple(meta.shape)} for {images.shape[0]} images (lightning_gpuopt.data.layout)"
            )
        train = self.training if train is None else train
        if train:
            boxes = self.sample_boxes(meta, self.generator)
            flip = torch.rand(images.shape[0], device=device, generator=self.generator) < self.augment.flip_p
        else:
            boxes, flip = self.eval_boxes(meta), None
        x = images.permute(0, 3, 1, 2).float()  # keeps the channels_last strides: one read, one write
        canvas = (images.shape[1], images.shape[2])
        theta = crop_theta(meta, boxes, flip, canvas)
        taps = self.antialias_taps(canvas, train)
        shrink = boxes[:, 2:] / self.image_size if taps else None
        x = resample(x, meta, theta, self.image_size, shrink, taps)
        scale, bias = self._norm_constants(device)
        return _scale_shift(x, scale, bias, self.output_dtype, torch.channels_last)

    def extra_repr(self) -> str:
        return (
            f"image_size={self.image_size}, augment={self.augment}, output_dtype={self.output_dtype}, "
            f"antialias={self.antialias}"
        )
