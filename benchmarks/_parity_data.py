"""Data and reference transforms for ``benchmarks/accuracy_parity.py``.

Two class-per-subfolder JPEG sets, written once per size and reused:

* ``photos``: real photographs shipped inside scikit-image (``skimage.data``); a class is one source photo
  and a sample is a random crop of it (2-20 % of its area, aspect ratio 1:2 to 2:1, landscape and portrait
  alike), flipped at random, jittered in brightness and contrast, rescaled and saved as JPEG. Telling which photo a small
  patch comes from is a fair, non-trivial task that uses colour, texture and shape.
* ``border``: 4:3 and 3:4 images of grey noise with two small squares whose colour is the class. In the
  training images one square lies in the outer eighth at each end of the long side (left/right, or
  top/bottom for portrait images), strips that the image's centre square never contains; in the validation
  images both lie where every evaluation centre crop sees them. A pipeline that trains on crops of the whole
  image learns the colours; one that trains on crops of the centre square never sees a square and scores
  chance (25 %).

The reference pipeline is torchvision's ImageNet recipe: ``RandomResizedCrop(size, scale=(0.08, 1))`` +
``RandomHorizontalFlip()`` + ``ToTensor()`` + ``Normalize`` for training, and
``Resize(round(size * 256 / 224)) + CenterCrop(size)`` + ``ToTensor()`` + ``Normalize`` for validation.
Real torchvision is used when it imports; otherwise this module's PIL reimplementation of those transforms,
which follows torchvision's algorithms step for step (same random draws from torch's generator, same
rounding, PIL bilinear resampling as torchvision uses for PIL images).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_gpuopt._common import IMAGENET_MEAN, IMAGENET_STD, eval_resize_size

DATASETS = ("photos", "border")
#: RGB colour of the square of each border class (class names sort in this order).
BORDER_COLOURS: dict[str, tuple[int, int, int]] = {
    "0_red": (215, 35, 35),
    "1_green": (35, 190, 45),
    "2_blue": (40, 70, 225),
    "3_yellow": (230, 205, 30),
}
#: skimage.data photos used as classes: colour photos, and grey ones (stored as grey RGB).
PHOTOS = (
    "astronaut",
    "coffee",
    "chelsea",
    "rocket",
    "hubble_deep_field",
    "immunohistochemistry",
    "camera",
    "coins",
    "brick",
    "gravel",
)
_MANIFEST = "manifest.json"


# ----------------------------------------------------------------------------------------- data sets
def _save_jpeg(img: Any, path: Path, quality: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, format="JPEG", quality=quality)


def _load_photos() -> dict[str, np.ndarray]:
    try:
        import skimage.data as skdata
    except ImportError as err:
        raise ModuleNotFoundError(
            f"the 'photos' data set is cut from scikit-image's sample photos ({err}); "
            "`pip install scikit-image`, or run with --dataset border"
        ) from err
    photos = {}
    for name in PHOTOS:
        arr = np.asarray(getattr(skdata, name)())
        if arr.ndim == 2:
            arr = np.stack([arr] * 3, axis=-1)
        photos[name] = np.ascontiguousarray(arr[..., :3]).astype(np.uint8)
    return photos


def _photo_sample(photo: np.ndarray, rng: np.random.Generator, short_range: tuple[int, int]) -> Any:
    """A random patch of ``photo``: 2-20 % of its area, aspect 1:2..2:1, jittered, short side in range."""
    from PIL import Image, ImageEnhance

    height, width = photo.shape[:2]
    for _ in range(100):
        area = rng.uniform(0.02, 0.20) * height * width
        aspect = math.exp(rng.uniform(math.log(0.5), math.log(2.0)))  # w / h
        w, h = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        if 8 <= w <= width and 8 <= h <= height:
            break
    else:  # pragma: no cover - the ranges above always fit the photos used
        w, h = min(width, height), min(width, height)
    top, left = int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1))
    img = Image.fromarray(photo[top : top + h, left : left + w])
    if rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    img = ImageEnhance.Brightness(img).enhance(rng.uniform(0.7, 1.3))
    img = ImageEnhance.Contrast(img).enhance(rng.uniform(0.7, 1.3))
    short = int(rng.integers(short_range[0], short_range[1] + 1))
    scale = short / min(w, h)
    return img.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.BILINEAR)


def _grey_noise(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Grey clutter: smooth blobs plus fine noise, no colour (the squares carry all the colour)."""
    coarse = rng.uniform(50, 200, size=(max(2, height // 6), max(2, width // 6)))
    from PIL import Image

    smooth = np.asarray(
        Image.fromarray(coarse.astype(np.float32), mode="F").resize((width, height), Image.Resampling.BICUBIC)
    )
    grey = np.clip(smooth + rng.normal(0, 18, size=(height, width)), 0, 255).astype(np.uint8)
    return np.stack([grey] * 3, axis=-1)


def _border_sample(rng: np.random.Generator, colour: tuple[int, int, int], long: int, train: bool) -> Any:
    """A 4:3 (or, half the time, 3:4) noise image with two coloured squares (see the module docstring)."""
    from PIL import Image

    short = long * 3 // 4
    side = max(3, long // 10)
    img = _grey_noise(rng, short, long)  # built landscape; portrait ones are transposed at the end
    strip = long // 8  # outer eighth: outside the centre square (which spans short/long = 3/4 of the width)
    # inside the region every evaluation crop keeps (the centre 0.875 of the short side, squared)
    keep = int(short * 0.8)
    x0, y0 = (long - keep) // 2, (short - keep) // 2
    for end in (0, 1):  # training: one square at each end of the long side
        if train:
            x = int(rng.integers(0, strip - side + 1))
            x = long - side - x if end else x
            y = int(rng.integers(0, short - side + 1))
        else:
            x = int(rng.integers(x0, x0 + keep - side + 1))
            y = int(rng.integers(y0, y0 + keep - side + 1))
        img[y : y + side, x : x + side] = colour
    if rng.random() < 0.5:
        img = img.transpose(1, 0, 2)
    return Image.fromarray(np.ascontiguousarray(img))


def make_dataset(
    name: str,
    root: str | os.PathLike[str],
    *,
    train_per_class: int,
    val_per_class: int,
    image_long_side: int,
    seed: int = 0,
) -> tuple[Path, Path]:
    """Write data set ``name`` under ``root`` (``train/<class>/*.jpg``, ``val/<class>/*.jpg``) once.

    An existing set with the same manifest (name, counts, size, seed) is reused as it is.

    Args:
        name: ``"photos"`` or ``"border"``.
        root: folder to write into (created).
        train_per_class: training images per class.
        val_per_class: validation images per class.
        image_long_side: ``border``: the long side of each image; ``photos``: the long side of the largest
            patch (short sides vary from half of it to three quarters).
        seed: the data seed (the same data for every training seed).

    Returns:
        ``(train_dir, val_dir)``.
    """
    if name not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {name!r}")
    root = Path(root)
    manifest = {
        "name": name,
        "train_per_class": train_per_class,
        "val_per_class": val_per_class,
        "image_long_side": image_long_side,
        "seed": seed,
        "version": 2,
    }
    train_dir, val_dir = root / "train", root / "val"
    mpath = root / _MANIFEST
    if mpath.is_file() and json.loads(mpath.read_text()) == manifest:
        return train_dir, val_dir
    import shutil

    for d in (train_dir, val_dir):
        shutil.rmtree(d, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    if name == "photos":
        photos = _load_photos()
        short_range = (image_long_side // 2, image_long_side * 3 // 4)
        for split, count in (("train", train_per_class), ("val", val_per_class)):
            for cls, photo in photos.items():
                for i in range(count):
                    img = _photo_sample(photo, rng, short_range)
                    _save_jpeg(img, root / split / cls / f"{i:05d}.jpg", int(rng.integers(75, 96)))
    else:
        for split, count in (("train", train_per_class), ("val", val_per_class)):
            for cls, colour in BORDER_COLOURS.items():
                for i in range(count):
                    img = _border_sample(rng, colour, image_long_side, train=split == "train")
                    _save_jpeg(img, root / split / cls / f"{i:05d}.jpg", 95)
    mpath.write_text(json.dumps(manifest, indent=1) + "\n")
    return train_dir, val_dir


# ----------------------------------------------------------------------------------------- reference
def rrc_params(
    width: int,
    height: int,
    scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (3 / 4, 4 / 3),
    generator: torch.Generator | None = None,
) -> tuple[int, int, int, int]:
    """``(top, left, h, w)`` of a random resized crop, as ``torchvision.transforms.RandomResizedCrop.get_params``.

    Ten tries: an area fraction uniform in ``scale`` and a log-uniform aspect ratio in ``ratio``; the first
    box that fits is placed uniformly. If none fits, the whole image clamped to ``ratio``, centred.
    """
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1], generator=generator).item()
        aspect = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=generator)).item()
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, size=(1,), generator=generator).item())
            left = int(torch.randint(0, width - w + 1, size=(1,), generator=generator).item())
            return top, left, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = round(w / min(ratio))
    elif in_ratio > max(ratio):
        h = height
        w = round(h * max(ratio))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def resize_shorter_size(width: int, height: int, size: int) -> tuple[int, int]:
    """``(width, height)`` after torchvision's ``Resize(size)``: shorter side ``size``, longer truncated."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size, int(size * long / short)
    return (new_short, new_long) if width <= height else (new_long, new_short)


def center_crop_box(width: int, height: int, size: int) -> tuple[int, int]:
    """``(top, left)`` of torchvision's ``CenterCrop(size)`` (Python's round, as torchvision uses)."""
    return round((height - size) / 2.0), round((width - size) / 2.0)


class RandomResizedCrop:
    """PIL ``RandomResizedCrop(size, scale, ratio)`` with torchvision's parameters and bilinear resize."""

    def __init__(
        self, size: int, scale: Sequence[float] = (0.08, 1.0), ratio: Sequence[float] = (3 / 4, 4 / 3)
    ):
        self.size, self.scale, self.ratio = size, tuple(scale), tuple(ratio)

    def __call__(self, img: Any) -> Any:
        from PIL import Image

        top, left, h, w = rrc_params(img.width, img.height, self.scale, self.ratio)
        return img.crop((left, top, left + w, top + h)).resize(
            (self.size, self.size), Image.Resampling.BILINEAR
        )


class RandomHorizontalFlip:
    """PIL ``RandomHorizontalFlip(p)`` drawing ``torch.rand(1)`` as torchvision does."""

    def __init__(self, p: float = 0.5):
        self.p = p

    def __call__(self, img: Any) -> Any:
        from PIL import Image

        if torch.rand(1).item() < self.p:
            return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return img


class Resize:
    """PIL ``Resize(size)``: the shorter side to ``size``, bilinear (antialiased when shrinking)."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, img: Any) -> Any:
        from PIL import Image

        return img.resize(resize_shorter_size(img.width, img.height, self.size), Image.Resampling.BILINEAR)


class CenterCrop:
    """PIL ``CenterCrop(size)`` for images at least ``size`` on each side."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, img: Any) -> Any:
        top, left = center_crop_box(img.width, img.height, self.size)
        return img.crop((left, top, left + self.size, top + self.size))


class ToNormalizedTensor:
    """``ToTensor()`` then ``Normalize(mean, std)``: uint8 HWC -> float CHW in [0, 1], standardized."""

    def __init__(self, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD):
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, img: Any) -> torch.Tensor:
        x = torch.from_numpy(np.array(img, dtype=np.uint8, copy=True)).permute(2, 0, 1).float().div_(255)
        return (x - self.mean) / self.std


class Compose:
    """Apply transforms in order, as ``torchvision.transforms.Compose``.

    Example:
        >>> train = Compose([RandomResizedCrop(32), RandomHorizontalFlip(), ToNormalizedTensor()])
    """

    def __init__(self, transforms: Sequence[Callable[[Any], Any]]):
        self.transforms = list(transforms)

    def __call__(self, img: Any) -> Any:
        for t in self.transforms:
            img = t(img)
        return img


def torchvision_available() -> bool:
    """Whether real torchvision imports next to this torch."""
    try:
        import torchvision.transforms  # noqa: F401
    except Exception:  # a missing wheel, or one built for another torch (operator registration fails)
        return False
    return True


class CentreSquare:
    """Cut a PIL image to its centre square (side = the shorter side): the control of the border set, which
    trains on crops of the centre square only, as a pipeline that stores square images does."""

    def __call__(self, img: Any) -> Any:
        side = min(img.width, img.height)
        top, left = center_crop_box(img.width, img.height, side)
        return img.crop((left, top, left + side, top + side))


def reference_transform(
    image_size: int, train: bool, use_torchvision: bool | None = None, centre_square: bool = False
) -> Callable[[Any], Any]:
    """torchvision's ImageNet transform (training or validation) for ``image_size``.

    Args:
        image_size: output side.
        train: ``RandomResizedCrop(scale=(0.08, 1)) + RandomHorizontalFlip`` else ``Resize + CenterCrop``.
        use_torchvision: ``None``: real torchvision when it imports, else this module's reimplementation.
        centre_square: training crops come from the image's centre square (``CentreSquare`` first).
    """
    if use_torchvision is None:
        use_torchvision = torchvision_available()
    resize = eval_resize_size(image_size)
    first: list[Callable[[Any], Any]] = [CentreSquare()] if centre_square and train else []
    if use_torchvision:
        from torchvision import transforms as T

        head = (
            [T.RandomResizedCrop(image_size, scale=(0.08, 1.0)), T.RandomHorizontalFlip()]
            if train
            else [T.Resize(resize), T.CenterCrop(image_size)]
        )
        return T.Compose([*first, *head, T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    head = (
        [RandomResizedCrop(image_size, scale=(0.08, 1.0)), RandomHorizontalFlip()]
        if train
        else [Resize(resize), CenterCrop(image_size)]
    )
    return Compose([*first, *head, ToNormalizedTensor()])


class ReferenceImageFolder(Dataset):
    """``torchvision.datasets.ImageFolder``'s behaviour: sorted class folders, sorted files, PIL RGB loader.

    Args:
        root: ``root/<class>/<image>``.
        transform: applied to each PIL image.

    Example:
        >>> ds = ReferenceImageFolder("data/train", reference_transform(32, train=True))  # doctest: +SKIP
        >>> image, label = ds[0]  # float (3, 32, 32), int  # doctest: +SKIP
    """

    def __init__(self, root: str | os.PathLike[str], transform: Callable[[Any], Any]):
        root = Path(root)
        self.classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
        self.samples = [
            (str(f), i)
            for i, c in enumerate(self.classes)
            for f in sorted((root / c).rglob("*"))
            if f.is_file() and f.suffix.lower() in (".jpg", ".jpeg", ".png")
        ]
        if not self.samples:
            raise ValueError(f"{str(root)!r} holds no images laid out as <root>/<class>/<image>")
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        path, label = self.samples[index]
        with open(path, "rb") as f:
            img = Image.open(f).convert("RGB")
        return self.transform(img), label
