"""DALI against torchvision's recipes, on CPU pipelines: training crop boxes and evaluation pixels.

Training: images whose pixels hold their own coordinates (R = column, G = row) go through the real
``DALILoader``; a linear fit of each output row and column gives back the crop's box in the original
image (linear interpolation of a linear ramp stays linear), which is compared with torchvision's
``RandomResizedCrop.get_params`` (reimplemented in ``tests/data/_images.py``): area and aspect
distributions and how often each point, corners included, lies inside a crop.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("nvidia.dali")

from lightning_gpuopt._common import eval_resize_size
from lightning_gpuopt.data.dali import DALILoader, DALIOptions
from lightning_gpuopt.data.transforms import AugmentConfig
from tests.data._images import (
    coordinate_rgb,
    crop_boxes,
    crop_coverage,
    grey16_as_rgb8,
    ks_statistic,
    mad,
    save,
    save_grey16,
    smooth_rgb,
    tv_center_crop,
    tv_resize,
    tv_rrc_params,
)

OUT = 64  # training output side
ZERO, ONE = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)  # no normalization: outputs are pixel / 255


@pytest.mark.parametrize(("height", "width"), [(192, 256), (224, 168)])
def test_training_crops_follow_torchvision_random_resized_crop(tmp_path, height, width):
    path = save(coordinate_rgb(height, width), tmp_path / "coords.png")
    n = 512
    torch.manual_seed(0)  # the loader's crop seed follows torch's
    loader = DALILoader(
        [path] * 64, [0] * 64, batch_size=64, image_size=OUT, train=True, mean=ZERO, std=ONE,
        options=DALIOptions(threads=2),
    )  # fmt: skip
    got = [crop_boxes(images) for _ in range(n // 64) for images, _ in loader]  # one batch an epoch
    boxes, flips = np.concatenate([b for b, _ in got]), np.concatenate([f for _, f in got])
    rng = random.Random(0)
    ref = np.array([tv_rrc_params(rng, height, width) for _ in range(8000)], dtype=np.float64)
    area = boxes[:, 2] * boxes[:, 3] / (height * width)
    ref_area = ref[:, 2] * ref[:, 3] / (height * width)
    assert ks_statistic(area, ref_area) < 0.1
    assert ks_statistic(np.log(boxes[:, 3] / boxes[:, 2]), np.log(ref[:, 3] / ref[:, 2])) < 0.1
    assert area.min() > 0.07 and area.max() < 1.02  # torchvision's (0.08, 1) of the whole image
    # inside the image, and every border is reached (a central-square crop never reaches the long sides)
    bottom, right = boxes[:, 0] + boxes[:, 2], boxes[:, 1] + boxes[:, 3]
    assert abs(boxes[:, 0].min()) < 1.5 and abs(boxes[:, 1].min()) < 1.5
    assert abs(bottom.max() - height) < 1.5 and abs(right.max() - width) < 1.5
    points = [
        (y, x) for y in (0.5, height / 4, height / 2, height - 0.5) for x in (0.5, width / 3, width - 0.5)
    ]
    cover, ref_cover = crop_coverage(boxes, points), crop_coverage(ref, points)
    assert np.abs(cover - ref_cover).max() < 0.07, (cover, ref_cover)
    assert 0.4 < flips.mean() < 0.6


def test_the_augment_config_is_honoured(tmp_path):
    path = save(coordinate_rgb(192, 256), tmp_path / "coords.png")
    augment = AugmentConfig(scale=(0.25, 0.25), ratio=(1.0, 1.0), flip_p=0.0)
    loader = DALILoader(
        [path] * 32, [0] * 32, batch_size=32, image_size=OUT, train=True, augment=augment, mean=ZERO, std=ONE,
        options=DALIOptions(threads=2),
    )  # fmt: skip
    boxes, flips = crop_boxes(next(iter(loader))[0])
    assert not flips.any()
    side = np.sqrt(0.25 * 192 * 256)  # square crops of a quarter of the area
    np.testing.assert_allclose(boxes[:, 2:], side, atol=1.5)
    assert np.ptp(boxes[:, 1]) > 10  # at random places


def _eval_reference(img: Image.Image, image_size: int) -> np.ndarray:
    return tv_center_crop(np.asarray(tv_resize(img, eval_resize_size(image_size))), image_size)


def test_evaluation_pixels_match_pil_resize_and_center_crop(tmp_path):
    image_size = 48  # resized to eval_resize_size(48) = 55 on the shorter side
    shapes = [(120, 160), (160, 120), (75, 100), (97, 131), (64, 64), (60, 150), (300, 201)]
    files, refs = [], []
    for k, (h, w) in enumerate(shapes):
        arr = smooth_rgb(h, w, k)
        png = save(arr, tmp_path / f"s{k}.png")
        jpg = save(arr, tmp_path / f"s{k}.jpg", quality=95)
        files += [png, jpg]
        refs += [_eval_reference(Image.fromarray(arr), image_size)] * 2
    files.append(save_grey16(90, 140, tmp_path / "grey16.png"))  # 16-bit PNG: scaled, not clipped
    refs.append(_eval_reference(grey16_as_rgb8(files[-1]), image_size))
    loader = DALILoader(
        files, list(range(len(files))), batch_size=len(files), image_size=image_size, train=False,
        mean=ZERO, std=ONE, options=DALIOptions(threads=2),
    )  # fmt: skip
    images, labels = next(iter(loader))
    assert labels.tolist() == list(range(len(files)))
    got = (images.float() * 255.0).permute(0, 2, 3, 1).numpy()
    for path, out, ref in zip(files, got, refs, strict=True):
        if path.endswith(".jpg"):  # the reference is the PNG's pixels: JPEG's own loss is allowed for
            ref = _eval_reference(Image.open(path).convert("RGB"), image_size)
        assert mad(out, ref) <= 2.0, path
