import math

import pytest
import torch

from lightning_gpuopt.data.transforms import (
    GPUAugment,
    center_crop_resize,
    crop_resize_flip,
    normalize,
    random_resized_crop_boxes,
)

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def _images(n=4, h=40, w=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, h, w, 3), dtype=torch.uint8, generator=g)


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


def test_eval_is_exact_center_crop_and_deterministic():
    aug = GPUAugment(image_size=28, eval_crop_fraction=28 / 32)
    x = _images(h=32, w=32)
    a, b = aug(x, train=False), aug(x, train=False)
    assert torch.equal(a, b)
    expected = normalize(x.permute(0, 3, 1, 2)[:, :, 2:30, 2:30].float(), MEAN, STD, input_scale=1 / 255)
    assert torch.allclose(a, expected, atol=1e-5)


def test_eval_resizes_when_needed():
    x = torch.rand(2, 3, 50, 70)
    out = center_crop_resize(x, 20, crop_fraction=0.8)  # central 40x40 -> 20x20, antialiased
    assert out.shape == (2, 3, 20, 20)
    const = center_crop_resize(torch.full((1, 3, 50, 70), 0.3), 20, 0.8)
    assert torch.allclose(const, torch.tensor(0.3), atol=1e-6)


def test_crop_box_statistics():
    boxes = random_resized_crop_boxes(20000, 60, 80, scale=(0.25, 1.0), ratio=(3 / 4, 4 / 3))
    x0, y0, w, h = boxes.unbind(1)
    assert (x0 >= 0).all() and (y0 >= 0).all()
    assert (x0 + w <= 80 + 1e-3).all() and (y0 + h <= 60 + 1e-3).all()
    area = w * h / (60 * 80)
    ratio = w / h
    assert area.min() >= 0.25 - 1e-4 and area.max() <= 1 + 1e-4
    assert ratio.min() >= 3 / 4 - 1e-4 and ratio.max() <= 4 / 3 + 1e-4
    # areas are uniform on [0.25, 1] before rejection of boxes that do not fit: mean well inside
    assert 0.45 < area.mean() < 0.65
    # positions spread over the free range (mean offset fraction ~0.5)
    frac = x0 / (80 - w).clamp_min(1e-6)
    assert abs(frac[(80 - w) > 1].mean().item() - 0.5) < 0.03
    # log-ratio roughly symmetric around 0
    assert abs(torch.log(ratio).mean().item()) < 0.05


def test_crop_fallback_when_nothing_fits():
    # a very wide image with a narrow ratio range: whole-height crops clamped to the ratio, centered
    boxes = random_resized_crop_boxes(100, 10, 100, scale=(1.0, 1.0), ratio=(1.0, 1.0))
    assert torch.allclose(boxes[:, 2], torch.tensor(10.0)) and torch.allclose(boxes[:, 3], torch.tensor(10.0))


def test_crop_resize_flip_samples_the_box_exactly():
    ramp = torch.arange(8, dtype=torch.float32).view(1, 1, 1, 8).expand(2, 1, 8, 8).contiguous()
    boxes = torch.tensor([[2.0, 0.0, 4.0, 8.0], [2.0, 0.0, 4.0, 8.0]])
    out = crop_resize_flip(ramp, boxes, (8, 4), flip=torch.tensor([False, True]))
    assert torch.allclose(out[0, 0, 3], torch.tensor([2.0, 3.0, 4.0, 5.0]), atol=1e-5)
    assert torch.allclose(out[1, 0, 3], torch.tensor([5.0, 4.0, 3.0, 2.0]), atol=1e-5)


def test_flip_frequency_half():
    # left half black, right half white; whole-image "crop" so only the flip changes the picture
    x = torch.zeros(4000, 8, 8, 3, dtype=torch.uint8)
    x[:, :, 4:] = 255
    aug = GPUAugment(
        image_size=8, scale=(1.0, 1.0), ratio=(1.0, 1.0), generator=torch.Generator().manual_seed(0)
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
    with pytest.raises(ValueError, match=r"\[0, 1\] units"):
        GPUAugment(16, mean=(123.0, 116.0, 103.0), std=(58.0, 57.0, 57.0))
    with pytest.raises(ValueError, match="scale"):
        GPUAugment(16, scale=(0.5, 0.2))
    with pytest.raises(ValueError, match="output_dtype"):
        GPUAugment(16, output_dtype=torch.int8)


@pytest.mark.gpu
def test_cuda_matches_cpu_and_no_sync():
    x = _images(n=16, h=36, w=36)
    aug = GPUAugment(32, output_dtype=torch.float16)
    ref = GPUAugment(32)(x, train=False)
    xc = x.cuda()
    aug(xc, train=True)  # builds cached constants
    torch.cuda.set_sync_debug_mode("error")
    try:
        out_train = aug(xc, train=True)
        out_eval = aug(xc, train=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out_train.is_cuda and out_train.dtype == torch.float16
    assert out_train.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(out_eval.float().cpu(), ref, atol=2e-2)
    assert math.isfinite(out_train.float().sum().item())
