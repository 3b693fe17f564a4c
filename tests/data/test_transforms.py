import math

import numpy as np
import pytest
import torch

from lightning_gpuopt._common import eval_resize_size
from lightning_gpuopt.data import layout, transforms
from lightning_gpuopt.data.transforms import (
    AugmentConfig,
    GPUAugment,
    band_size,
    center_crop_boxes,
    resample,
    resize_weights,
)

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def _images(n=4, h=40, w=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, h, w, 3), dtype=torch.uint8, generator=g)


def _pixels(out):
    """Normalized output back to 0..255 pixel values."""
    return out.float() * torch.tensor(STD).view(1, 3, 1, 1) * 255 + torch.tensor(MEAN).view(1, 3, 1, 1) * 255


def _stored(image, storage_size):
    canvas, meta = layout.place_on_canvas(image, storage_size)
    return torch.from_numpy(canvas)[None], torch.from_numpy(meta)[None]


# ---------------------------------------------------------------- torchvision references (no torchvision here)
def tv_random_resized_crop(height, width, scale, ratio, rng):
    """torchvision's ``RandomResizedCrop.get_params``: ``(top, left, h, w)`` in integer pixels."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        h, w = height, round(height * max(ratio))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def tv_eval_box(height, width, image_size):
    """torchvision's ``Resize(eval_resize_size) + CenterCrop(image_size)`` as a box of the original image."""
    size = eval_resize_size(image_size)
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size, int(size * long / short)
    rw, rh = (new_short, new_long) if width <= height else (new_long, new_short)
    top, left = round((rh - image_size) / 2.0), round((rw - image_size) / 2.0)
    sx, sy = width / rw, height / rh
    return left * sx, top * sy, image_size * sx, image_size * sy


def _ks(a, b, shift):
    """Kolmogorov-Smirnov distance of two samples allowing values to move by ``shift`` (Levy's form):
    torchvision rounds boxes to whole pixels, which moves its point masses (the fallback crop) slightly."""
    a, b = np.sort(a), np.sort(b)
    x = np.concatenate([a, b])

    def cdf(v, at):
        return np.searchsorted(v, at, "right") / v.size

    return max((cdf(a, x - shift) - cdf(b, x)).max(), (cdf(b, x) - cdf(a, x + shift)).max())


def _coverage(boxes_xywh, width, height, cells=16):
    """Fraction of boxes covering each cell centre of a cells x cells grid over the image."""
    centres = (np.arange(cells) + 0.5) / cells
    x0, y0 = boxes_xywh[:, 0:1] / width, boxes_xywh[:, 1:2] / height
    x1, y1 = x0 + boxes_xywh[:, 2:3] / width, y0 + boxes_xywh[:, 3:4] / height
    in_x = (x0 <= centres) & (centres < x1)  # (n, cells)
    in_y = (y0 <= centres) & (centres < y1)
    return (in_y[:, :, None] & in_x[:, None, :]).mean(axis=0)


# original image sizes (width, height): landscape 4:3, portrait 3:4, square, very elongated (5:1)
SIZES = [(500, 375), (375, 500), (256, 256), (1000, 200)]


@pytest.mark.parametrize("width,height", SIZES)
def test_crop_boxes_match_torchvision_distribution_and_coverage(width, height):
    n, config = 10_000, AugmentConfig()
    rng = np.random.default_rng(0)
    ref = np.array([tv_random_resized_crop(height, width, config.scale, config.ratio, rng) for _ in range(n)])
    ref_xywh = np.stack([ref[:, 1], ref[:, 0], ref[:, 3], ref[:, 2]], axis=1).astype(np.float64)
    # what the canvas stores for this image: resized to 256 on the shorter side, portrait transposed
    sw, sh = layout.resized_size(width, height, 256)
    meta = torch.tensor([[min(sw, sh), max(sw, sh), int(sh > sw)]] * n, dtype=torch.int32)
    boxes = GPUAugment(224).boxes(meta, True, torch.Generator().manual_seed(0))[0].double().numpy()
    assert (boxes[:, :2] >= 0).all() and (boxes[:, 0] + boxes[:, 2] <= sw + 1e-3).all()
    assert (boxes[:, 1] + boxes[:, 3] <= sh + 1e-3).all()  # image coordinates: the upright image

    area = boxes[:, 2] * boxes[:, 3] / (sw * sh)
    ref_area = ref_xywh[:, 2] * ref_xywh[:, 3] / (width * height)
    assert _ks(area, ref_area, shift=0.005) < 0.03
    log_ratio = np.log(boxes[:, 2] / boxes[:, 3])
    assert _ks(log_ratio, np.log(ref_xywh[:, 2] / ref_xywh[:, 3]), shift=0.01) < 0.03
    ours, theirs = _coverage(boxes, sw, sh), _coverage(ref_xywh, width, height)
    assert np.abs(ours - theirs).max() < 0.04
    # the borders of the image are reached as often as torchvision reaches them
    border = np.r_[ours[0], ours[-1], ours[:, 0], ours[:, -1]]
    assert border.min() > 0.5 * np.r_[theirs[0], theirs[-1], theirs[:, 0], theirs[:, -1]].min() > 0


@pytest.mark.parametrize("width,height", [*SIZES, (341, 256), (257, 300), (299, 301)])
@pytest.mark.parametrize("image_size", [224, 112, 63])
def test_eval_boxes_are_torchvision_resize_center_crop(width, height, image_size):
    got = center_crop_boxes(torch.tensor([float(height)]), torch.tensor([float(width)]), image_size)[0]
    assert got.tolist() == pytest.approx(tv_eval_box(height, width, image_size), abs=1e-3)


@pytest.mark.parametrize("shape", [(256, 341), (341, 256), (256, 256), (256, 300)])
def test_eval_at_the_resize_size_is_an_exact_pixel_copy(shape):
    image = np.random.default_rng(1).integers(0, 256, (*shape, 3), dtype=np.uint8)
    canvas, meta = _stored(image, 256)
    out = GPUAugment(224)(canvas, meta, train=False)
    top, left = round((shape[0] - 224) / 2), round((shape[1] - 224) / 2)
    expected = torch.from_numpy(image[top : top + 224, left : left + 224]).permute(2, 0, 1).float()
    assert (_pixels(out)[0] - expected).abs().max() < 1e-3


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("flip", [False, True])
def test_theta_reads_the_box_of_the_upright_image(transposed, flip):
    image = np.random.default_rng(2).integers(0, 256, (30, 40, 3), dtype=np.uint8)
    if transposed:
        image = np.ascontiguousarray(image.transpose(1, 0, 2))  # a portrait 40 x 30 image
    canvas, meta = _stored(image, 30)
    assert bool(meta[0, 2]) == transposed
    box = torch.tensor([[5.0, 7.0, 20.0, 20.0]])  # (x0, y0, w, h): a 1:1 window of the upright image
    x = canvas.permute(0, 3, 1, 2).float().contiguous()
    out = resample(x, meta, box, torch.tensor([flip]), 20, band_size(1.0))[0]
    expected = torch.from_numpy(image[7:27, 5:25]).permute(2, 0, 1).float()
    if flip:
        expected = expected.flip(-1)
    assert torch.equal(out, expected)


def test_crops_never_blend_in_the_canvas_padding():
    white = np.full((20, 27, 3), 255, np.uint8)  # stored on a wider canvas whose padding is zero
    canvas, meta = _stored(white, 20)
    assert canvas.shape[2] > 27
    aug = GPUAugment(16, AugmentConfig(scale=(0.9, 1.0)), generator=torch.Generator().manual_seed(0))
    out = aug(canvas.expand(64, -1, -1, -1), meta.expand(64, 3), train=True)
    assert (_pixels(out) > 254.99).all()
    assert (_pixels(aug(canvas, meta, train=False)) > 254.99).all()


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_shape_dtype_memory_format(train, dtype):
    out = GPUAugment(image_size=32, output_dtype=dtype)(_images(), train=train)
    assert out.shape == (4, 3, 32, 32)
    assert out.dtype == dtype
    assert out.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("train", [True, False])
def test_value_range_matches_normalization(train):
    aug = GPUAugment(image_size=16, mean=MEAN, std=STD)
    black = aug(torch.zeros(2, 20, 20, 3, dtype=torch.uint8), train=train)
    white = aug(torch.full((2, 20, 20, 3), 255, dtype=torch.uint8), train=train)
    for c in range(3):
        assert torch.allclose(black[:, c], torch.tensor(-MEAN[c] / STD[c]), atol=1e-5)
        assert torch.allclose(white[:, c], torch.tensor((1 - MEAN[c]) / STD[c]), atol=1e-5)
    x = aug(_images(h=20, w=20), train=train)
    lo = min(-m / s for m, s in zip(MEAN, STD, strict=True))
    hi = max((1 - m) / s for m, s in zip(MEAN, STD, strict=True))
    assert x.min() >= lo - 1e-4 and x.max() <= hi + 1e-4


def test_flip_frequency_half():
    # left half black, right half white; whole-image "crop" so only the flip changes the picture
    x = torch.zeros(4000, 8, 8, 3, dtype=torch.uint8)
    x[:, :, 4:] = 255
    aug = GPUAugment(
        8, AugmentConfig(scale=(1.0, 1.0), ratio=(1.0, 1.0)), generator=torch.Generator().manual_seed(0)
    )
    out = aug(x, train=True)
    flipped = out[:, 0, :, 0] > out[:, 0, :, -1]  # bright left edge means mirrored
    rate = flipped.all(dim=1).float().mean().item()
    assert abs(rate - 0.5) < 0.04  # binomial sd ~ 0.008
    assert (flipped.all(dim=1) | (~flipped).all(dim=1)).all()  # each sample is flipped entirely or not


def test_train_crops_vary_and_are_reproducible_with_generator():
    x = _images(n=8, h=32, w=32)
    a = GPUAugment(16, generator=torch.Generator().manual_seed(3))(x, train=True)
    b = GPUAugment(16, generator=torch.Generator().manual_seed(3))(x, train=True)
    c = GPUAugment(16, generator=torch.Generator().manual_seed(4))(x, train=True)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_train_follows_module_mode():
    aug = GPUAugment(16)
    x = _images(h=32, w=32)
    aug.eval()
    assert torch.equal(aug(x), aug(x, train=False))


def test_bad_inputs_and_arguments():
    aug = GPUAugment(16)
    with pytest.raises(TypeError, match="uint8"):
        aug(torch.rand(2, 16, 16, 3))
    with pytest.raises(TypeError, match="CHW"):
        aug(torch.zeros(2, 3, 16, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="meta must be"):
        aug(_images(), torch.zeros(4, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[0, 1\] units"):
        GPUAugment(16, mean=(123.0, 116.0, 103.0), std=(58.0, 57.0, 57.0))
    with pytest.raises(TypeError, match=r"^mean must be a sequence of numbers"):
        GPUAugment(16, mean="imagenet")
    with pytest.raises(ValueError, match=r"augment\.scale"):
        AugmentConfig(scale=(0.5, 0.2))
    with pytest.raises(ValueError, match=r"augment\.flip_p"):
        AugmentConfig(flip_p=2)
    with pytest.raises(TypeError, match=r"augment\.ratio"):
        AugmentConfig(ratio=0.75)
    with pytest.raises(ValueError, match="output_dtype"):
        GPUAugment(16, output_dtype=torch.int8)
    assert AugmentConfig() == AugmentConfig(scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), flip_p=0.5)


@pytest.mark.gpu
def test_cuda_matches_cpu_and_no_sync():
    image = np.random.default_rng(3).integers(0, 256, (256, 341, 3), dtype=np.uint8)
    canvas, meta = _stored(image, 256)
    canvas, meta = canvas.expand(16, -1, -1, -1).contiguous(), meta.expand(16, 3).contiguous()
    aug = GPUAugment(224, output_dtype=torch.float16)
    ref = GPUAugment(224)(canvas, meta, train=False)
    xc, mc = canvas.cuda(), meta.cuda()
    aug(xc, mc, train=True)  # builds cached constants
    torch.cuda.set_sync_debug_mode("error")
    try:
        out_train = aug(xc, mc, train=True)
        out_eval = aug(xc, mc, train=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out_train.is_cuda and out_train.dtype == torch.float16
    assert out_train.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(out_eval.float().cpu(), ref, atol=2e-2)
    assert math.isfinite(out_train.float().sum().item())


def _texture(height, width, seed=0):
    """Noise low-passed to half resolution: energy up to half the Nyquist rate, which aliases when shrunk."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = Image.fromarray(rng.integers(0, 256, (height // 2, width // 2, 3), dtype=np.uint8))
    return np.asarray(small.resize((width, height), Image.Resampling.BILINEAR))


@pytest.mark.parametrize("portrait", [False, True])
@pytest.mark.parametrize("size", [32, 48, 64])
def test_downscaled_crop_matches_pil_antialiased_resize(portrait, size):
    """A shrinking box is low-passed as PIL's bilinear resize is (plain bilinear misses by 5-18 levels)."""
    from PIL import Image

    image = _texture(128, 96) if portrait else _texture(96, 128)
    h, w = image.shape[:2]
    canvas, meta = _stored(image, 96)  # stored as it is (short side 96), portrait transposed
    # the whole image as the box: scale 1 and the image's own aspect ratio; no flip
    whole = AugmentConfig(scale=(1.0, 1.0), ratio=(w / h, w / h), flip_p=0.0)
    expected = np.asarray(Image.fromarray(image).resize((size, size), Image.Resampling.BILINEAR), np.float32)
    got = _pixels(GPUAugment(size, whole)(canvas, meta, train=True))[0].permute(1, 2, 0).numpy()
    # PIL's triangle filter, within rounding (PIL rounds between its two passes, fixed-point weights)
    assert float(np.abs(got - expected).mean()) <= 0.3


def _pil_box_resize(image, box, size):
    """PIL's antialiased bilinear resize of ``box = (x0, y0, w, h)`` of ``image`` to ``size x size``."""
    from PIL import Image

    x0, y0, w, h = (float(v) for v in box)
    resized = Image.fromarray(image).resize(
        (size, size), Image.Resampling.BILINEAR, box=(x0, y0, x0 + w, y0 + h)
    )
    return np.asarray(resized, np.float32)


@pytest.mark.parametrize("portrait", [False, True])
def test_random_crops_match_pil_box_resize_with_flips(portrait):
    image = _texture(60, 84, seed=4)
    if portrait:
        image = np.ascontiguousarray(image.transpose(1, 0, 2))
    canvas, meta = _stored(image, 60)
    n, size = 24, 32
    aug = GPUAugment(size, generator=torch.Generator().manual_seed(5))
    out = _pixels(aug(canvas.expand(n, -1, -1, -1), meta.expand(n, 3), train=True)).round()
    # the same boxes and flips, drawn again from the same seed
    g = torch.Generator().manual_seed(5)
    boxes, flips = aug.boxes(meta.expand(n, 3), True, g)
    assert 0 < int(flips.sum()) < n
    diffs = []
    for i in range(n):
        expected = _pil_box_resize(image, boxes[i].tolist(), size)
        if flips[i]:
            expected = expected[:, ::-1]
        diffs.append(np.abs(out[i].permute(1, 2, 0).numpy() - expected).mean())
    assert max(diffs) <= 0.35, diffs


@pytest.mark.parametrize("width,height", [(341, 256), (256, 341), (300, 200), (96, 128)])
def test_eval_matches_pil_resize_center_crop(width, height):
    from PIL import Image

    image = _texture(height, width, seed=6)
    canvas, meta = _stored(image, min(width, height))
    size = 96
    out = _pixels(GPUAugment(size)(canvas, meta, train=False))[0].round().permute(1, 2, 0).numpy()
    # torchvision's eval view through PIL: Resize(short side) then CenterCrop
    resize = eval_resize_size(size)
    short, long = (width, height) if width <= height else (height, width)
    rw, rh = (resize, int(resize * long / short)) if width <= height else (int(resize * long / short), resize)
    resized = np.asarray(Image.fromarray(image).resize((rw, rh), Image.Resampling.BILINEAR), np.float32)
    top, left = round((rh - size) / 2), round((rw - size) / 2)
    expected = resized[top : top + size, left : left + size]
    # PIL resizes the whole image; we resample only the box: the same weights, so within rounding
    assert np.abs(out - expected).mean() <= 0.35


def test_resize_weights_rows_sum_to_one_within_the_valid_region():
    n, size, extent = 6, 10, 40
    g = torch.Generator().manual_seed(0)
    valid = torch.tensor([40, 30, 25, 40, 12, 5])
    length = torch.rand(n, generator=g) * valid.float() * 0.9 + 1
    start = torch.rand(n, generator=g) * (valid.float() - length)
    flip = torch.tensor([False, True] * 3)
    w = resize_weights(start, length, valid, flip, size, extent, band_size(4.0))
    assert w.shape == (n, size, extent)
    assert torch.allclose(w.sum(2), torch.ones(n, size), atol=1e-6)
    assert (w >= 0).all()
    for i in range(n):
        assert (w[i, :, int(valid[i]) :] == 0).all()  # never reads the padding
    # a flip reverses the output rows
    unflipped = resize_weights(start, length, valid, None, size, extent, band_size(4.0))
    assert torch.equal(w[1::2], unflipped[1::2].flip(1))
    assert torch.equal(w[::2], unflipped[::2])


def test_resize_weights_edges_replicate_and_upscale_is_bilinear():
    # an upscaling box hanging at the image's edge: the edge pixel stands in for what lies beyond it
    w = resize_weights(
        torch.tensor([0.0]), torch.tensor([4.0]), torch.tensor([4]), None, 8, 6, band_size(1.0)
    )[0]
    assert torch.allclose(w[0], torch.tensor([1.0, 0, 0, 0, 0, 0]))  # centre 0.25: pixel 0 only
    assert torch.allclose(w[-1], torch.tensor([0, 0, 0, 1.0, 0, 0]))  # centre 3.75: last valid pixel
    assert torch.allclose(w[1], torch.tensor([0.75, 0.25, 0, 0, 0, 0]))  # centre 0.75
    # a 2x shrink: PIL's triangle of half-width 2 around centre 1.0, normalized over the pixels it covers
    w2 = resize_weights(
        torch.tensor([0.0]), torch.tensor([8.0]), torch.tensor([8]), None, 4, 8, band_size(2.0)
    )[0]
    raw = np.maximum(0.0, 1 - np.abs(np.arange(8) + 0.5 - 1.0) / 2)
    assert np.allclose(w2[0].numpy(), raw / raw.sum(), atol=1e-6)


def test_band_follows_the_largest_shrink(monkeypatch):
    assert band_size(1.0) == 3 and band_size(0.5) == 3 and band_size(1.5) == 4 and band_size(2.0) == 5
    bands, real = [], transforms.resample

    def recording(*args):
        bands.append(args[-1])
        return real(*args)

    monkeypatch.setattr(transforms, "resample", recording)
    canvas = torch.zeros(2, *layout.canvas_shape(256), 3, dtype=torch.uint8)
    GPUAugment(224)(canvas, train=True)
    GPUAugment(224)(canvas, train=False)
    assert bands == [band_size(384 / 224), band_size(256 / eval_resize_size(224))]


def test_half_precision_resample_stays_within_a_level():
    image = _texture(64, 90, seed=7)
    canvas, meta = _stored(image, 64)
    x = canvas.permute(0, 3, 1, 2).float().contiguous()
    boxes = torch.tensor([[3.5, 2.25, 80.0, 60.0]])
    band = band_size(90 / 32)
    full = resample(x, meta, boxes, torch.tensor([True]), 32, band)
    half = resample(x.half(), meta, boxes, torch.tensor([True]), 32, band).float()
    assert (half - full).abs().max() <= 1.0 and (half - full).abs().mean() < 0.05
