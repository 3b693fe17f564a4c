"""Class-per-subfolder image folders decoded to whole uint8 images on a canvas (``data.layout``) by
``decode_canvas``, the package's one decode routine, so a converted store gives the folder's pixels."""

from __future__ import annotations

import ast
import io
import os
import re
import shlex
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from torch.utils.data import Dataset

from lightning_gpuopt._checks import check_arg, check_batch_array, check_choice, check_int
from lightning_gpuopt._common import warn_once
from lightning_gpuopt.data.readers import DecodesInWorkers

#: torchvision's ``ImageFolder`` image extensions (any case)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp")

ON_CORRUPT = ("raise", "skip")
#: serializes appends to a skip log from the reading threads of one process.
_SKIP_LOG_LOCK = threading.Lock()
#: what an unreadable image's error advises by default.
SKIP_FIX = "remove or replace the file, or pass on_corrupt='skip' to skip unreadable images"
#: the shorter side ``check_image_folder`` decodes to: a reduced DCT scale still entropy-decodes every byte
CHECK_SIZE = 16
_MESSAGE = re.compile(r"cannot decode image ('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\") \((.*?)\); ")


class CorruptImageError(ValueError):
    """An image file its decoder refuses: one line naming the file and the fix, also re-raised from a worker.

    Attributes:
        path: the file.
        reason: what the decoder said (``"OSError: image file is truncated"``).

    Example:
        >>> str(CorruptImageError.of("a/1.jpg", "OSError: truncated", "remove it"))
        "cannot decode image 'a/1.jpg' (OSError: truncated); remove it"
    """

    def __init__(self, message: str, *, path: str | None = None, reason: str | None = None) -> None:
        from lightning_gpuopt import _compat

        message = _compat.worker_error_message(message, type(self)) or message
        super().__init__(message)
        found = _MESSAGE.match(message) if path is None else None
        if found is not None:
            path, reason = ast.literal_eval(found.group(1)), found.group(2)
        self.path, self.reason = path, reason

    @classmethod
    def of(cls, path: str, reason: str, fix: str = SKIP_FIX) -> CorruptImageError:
        """The error for ``path``: ``cannot decode image '<path>' (<reason>); <fix>``, on one line."""
        reason = " ".join(reason.split())
        return cls(f"cannot decode image {path!r} ({reason}); {fix}", path=path, reason=reason)


class UnreadableImagesError(ValueError):
    """Images of a folder its decoders refuse, all of them at once (``check_image_folder``).

    Attributes:
        root: the folder.
        images: how many images it holds.
        errors: a ``CorruptImageError`` for each image that cannot be decoded, in file order.
    """

    def __init__(self, root: str, images: int, errors: Sequence[CorruptImageError], fix: str = "") -> None:
        self.root, self.images, self.errors = root, images, list(errors)
        shown = _shown([f"{os.path.relpath(e.path or '', root)!r} ({e.reason})" for e in self.errors], 20)
        fix = fix or "remove or replace them, or pass on_corrupt='skip' to skip unreadable images"
        super().__init__(
            f"{len(self.errors)} of {images} image(s) in {root!r} cannot be decoded: {shown}; {fix}"
        )

    def __reduce__(self) -> Any:
        return (type(self), (self.root, self.images, self.errors))


def _shown(items: Sequence[str], k: int = 10) -> str:
    return ", ".join(items[:k]) + (f" and {len(items) - k} more" if len(items) > k else "")


def _unreadable(err: OSError) -> None:
    raise _cannot_read(err.filename, err) from err


def _cannot_read(path: Any, err: OSError) -> OSError:
    fix = (
        "give this user read and execute permission (chmod -R u+rX) or move it out of the dataset"
        if isinstance(err, PermissionError)
        else "check the folder and its disk"
    )
    failed = type(err)(f"cannot read folder {os.fspath(path)!r} ({err.strerror or err}); {fix}")
    failed.errno = err.errno
    return failed


def folder_classes(root: str | os.PathLike[str]) -> list[str]:
    """The class names of an image folder: its sorted immediate subfolders, hidden ones left out."""
    root_path = Path(root).expanduser()
    if not root_path.exists():
        raise FileNotFoundError(f"image folder {str(root_path)!r} does not exist; check the path")
    if not root_path.is_dir():
        raise ValueError(
            f"{str(root_path)!r} is a file, not a folder; pass a folder laid out as <root>/<class>/<image> "
            "(read an HDF5 store with HDF5ImageDataset, or OptimizedDataModule's backend='auto')"
        )
    try:
        classes = sorted(e.name for e in os.scandir(root_path) if e.is_dir() and not e.name.startswith("."))
    except OSError as err:
        raise _cannot_read(root_path, err) from err
    if not classes:
        raise ValueError(
            f"image folder {str(root_path)!r} has no class subfolders; lay it out as <root>/<class>/<image>"
        )
    return classes


def class_indices(
    train_classes: Sequence[str],
    classes: Sequence[str],
    *,
    split: str,
    path: str | os.PathLike[str] | None,
    train_path: str | os.PathLike[str] | None = None,
) -> list[int]:
    """The training label of each of ``classes`` (a split's, in its label order); ``split``, ``path`` and
    ``train_path`` name them in the ``ValueError`` for a class the training split lacks.

    Example:
        >>> class_indices(["cat", "dog", "fox"], ["cat", "fox"], split="val", path="data/val")
        [0, 2]
    """
    index = {name: i for i, name in enumerate(train_classes)}
    missing = [name for name in classes if name not in index]
    if missing:
        where = f" ({os.fspath(train_path)!r})" if train_path is not None else ""
        source = repr(os.fspath(path)) if path is not None else "its dataset"
        shown = _shown([repr(m) for m in missing])
        raise ValueError(
            f"the {split} split ({source}) has "
            f"{len(missing)} class(es) the training split{where} lacks: {shown}. Labels are the training "
            f"split's class indices ({len(train_classes)} classes), so every {split} class must be a "
            f"training class: add those classes to the training data or remove them from the {split} data"
        )
    return [index[name] for name in classes]


def scan_image_folder(root: str | os.PathLike[str]) -> tuple[list[str], list[tuple[str, int]]]:
    """``(classes, [(path, class_index), ...])`` of ``root/<class>/<image>``, listed as torchvision's
    ``ImageFolder`` lists it (docs/datamodule.md); a missing, unreadable or empty folder raises naming it."""
    root_path = Path(root).expanduser()
    classes = folder_classes(root_path)
    samples: list[tuple[str, int]] = []
    skipped: list[str] = []
    for index, name in enumerate(classes):
        class_dir = root_path / name
        files: list[str] = []
        others: list[str] = []
        for dirpath, dirnames, filenames in os.walk(class_dir, onerror=_unreadable, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for fname in filenames:
                if not fname.startswith("."):
                    full = os.path.join(dirpath, fname)
                    (files if fname.lower().endswith(IMAGE_EXTENSIONS) else others).append(full)
        if not files:
            besides = f" (only other files, e.g. {sorted(others)[0]!r})" if others else ""
            raise ValueError(
                f"class folder {str(class_dir)!r} holds no images{besides}; remove it or add images "
                f"({', '.join(IMAGE_EXTENSIONS)})"
            )
        samples.extend((f, index) for f in sorted(files))
        skipped.extend(sorted(others))
    if skipped:
        shown = _shown([repr(os.path.relpath(p, root_path)) for p in skipped])
        warn_once(
            f"image folder {str(root_path)!r}: skipped {len(skipped)} file(s) that are not images: "
            f"{shown} (images end in {', '.join(IMAGE_EXTENSIONS)}, in any case)"
        )
    return classes, samples


def decode_canvas(
    source: str | os.PathLike[str] | bytes | bytearray | memoryview | BinaryIO,
    storage_size: int,
    out: np.ndarray | None = None,
    *,
    name: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Decode one whole image onto a uint8 canvas, resized as torchvision's ``Resize(storage_size)``: the
    package's one decode routine (``layout`` has the canvas rules).

    Args:
        source: an image file's path, its encoded bytes, or a binary file object positioned at its start.
        storage_size: shorter side of the stored image.
        out: canvas-shaped uint8 array to fill in place.
        name: what the error names (default: the path, or ``"<bytes>"``).

    Returns:
        ``(canvas, meta)``: uint8 ``(H, W, 3)`` canvas and int32 ``(h, w, transposed)``.

    Raises:
        CorruptImageError: (a ``ValueError``) the image cannot be read or decoded.

    Example:
        >>> canvas, meta = decode_canvas(open("cat.jpg", "rb").read(), 256, name="cat.jpg")  # doctest: +SKIP
    """
    from PIL import Image

    from lightning_gpuopt.data import layout

    layout.canvas_shape(storage_size)  # checks storage_size
    if isinstance(source, (bytes, bytearray, memoryview)):
        source, label = io.BytesIO(source), "<bytes>"
    else:
        label = os.fspath(source) if isinstance(source, (str, os.PathLike)) else getattr(source, "name", "")
    label = name if name is not None else str(label or "<file object>")
    try:
        with Image.open(source) as img:
            width, height = img.size
            target = layout.resized_size(width, height, storage_size)
            box = None
            # decode at a reduced DCT scale only down to twice the target, where the result stays within
            # the bilinear resize of the full decode (layout.draft_size)
            if img.format == "JPEG":
                draft = layout.draft_size(width, height, target)
                if draft is not None:
                    drafted = img.draft("RGB", draft)
                    box = drafted[1] if drafted is not None else None
            rgb = layout.to_rgb8(img)
            return layout.place_on_canvas(_resized(rgb, target, box), storage_size, out)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise CorruptImageError.of(label, f"{type(err).__name__}: {err}") from err


def _resized(rgb: Any, target: tuple[int, int], box: Any) -> np.ndarray:
    """``rgb`` resized to ``target``: torch's bilinear (PIL's weights), or PIL's of a draft's ``box``."""
    from PIL import Image

    if box is not None:
        return np.asarray(rgb.resize(target, Image.Resampling.BILINEAR, box=box), dtype=np.uint8)
    pixels = np.asarray(rgb, dtype=np.uint8)
    if (pixels.shape[1], pixels.shape[0]) == tuple(target):
        return pixels
    from lightning_gpuopt import _compat

    if not pixels.flags.writeable:  # PIL hands out its bytes read-only; torch takes only writable arrays
        pixels = pixels.copy()
    return _compat.resize_rgb_uint8(pixels, target[1], target[0])


#: ``decode_canvas`` under the name the converters call: ``load_canvas(path, storage_size, out=None)``
load_canvas = decode_canvas


def check_image_folder(root: str | os.PathLike[str], *, threads: int | None = None, fix: str = "") -> int:
    """Decode every image of ``root/<class>/<image>`` (to ``CHECK_SIZE``, in ``threads`` threads, default two
    a CPU) and return how many there are, or raise one ``UnreadableImagesError`` listing each that cannot be
    decoded, advising ``fix``.

    Example:
        >>> check_image_folder("data/train")  # doctest: +SKIP
        1281167
    """
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from lightning_gpuopt._common import available_cpus

    check_int(threads, "threads", low=1, none_ok=True)
    root_path = os.fspath(Path(root).expanduser())
    _, samples = scan_image_folder(root_path)

    def check(path: str) -> CorruptImageError | None:
        try:
            decode_canvas(path, CHECK_SIZE)
        except CorruptImageError as err:
            return err
        return None

    workers = min(threads or 2 * available_cpus(), len(samples))
    # one intra-op thread a checking thread: the small resizes stay on its own core
    with ThreadPoolExecutor(workers, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        errors = [err for err in pool.map(check, (p for p, _ in samples)) if err is not None]
    if errors:
        raise UnreadableImagesError(root_path, len(samples), errors, fix)
    return len(samples)


class UInt8ImageFolder(DecodesInWorkers, Dataset):
    """Map-style dataset over ``root/<class>/<image>`` returning ``(canvas, label, meta)``: each image decoded
    whole onto a uint8 canvas (``decode_canvas``), ``meta`` int32 ``(h, w, transposed)``.

    Args:
        root: folder laid out as ``root/<class>/<image>``; scanned now (errors surface before training).
        size: shorter side of the stored images in pixels (256 for 224 crops).
        on_corrupt: ``"raise"`` names an unreadable file; ``"skip"`` returns the next readable image instead.
        skip_log: folder where skipped paths are appended (one file a process), so workers' skips count.

    Example:
        >>> ds = UInt8ImageFolder("train/", size=256)  # doctest: +SKIP
        >>> canvas, label, meta = ds[0]  # (256, 384, 3) uint8, int, int32 (h, w, transposed)  # doctest: +SKIP
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        size: int = 256,
        on_corrupt: str = "raise",
        skip_log: str | os.PathLike[str] | None = None,
    ) -> None:
        check_int(size, "size", low=1, what="(pixels)")
        check_choice(on_corrupt, "on_corrupt", ON_CORRUPT)
        self.root = os.fspath(Path(root).expanduser())
        self.size = size
        self.on_corrupt = on_corrupt
        self.skip_log = os.fspath(skip_log) if skip_log is not None else None
        self.classes, self.samples = scan_image_folder(self.root)
        self._skipped_here: list[str] = []

    @property
    def storage_size(self) -> int:
        """Shorter side of the stored images (the canvas height), as the DataModule reads it from any store."""
        return self.size

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """Every sample's canvas ``(H, W, 3)`` (``layout.canvas_shape(size)``)."""
        from lightning_gpuopt.data import layout

        return (*layout.canvas_shape(self.size), 3)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[np.ndarray, int, np.ndarray]:
        canvas = np.empty(self.image_shape, dtype=np.uint8)
        label, meta = self._decode_into(index, canvas)
        return canvas, label, meta

    def read_into(
        self, indices: Sequence[int] | np.ndarray, images: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Decode the images at ``indices`` onto the rows of ``images``; return ``(labels, meta)``."""
        idx = [int(i) for i in indices]
        shape = (len(idx), *self.image_shape)
        check_batch_array(images, shape, "UInt8ImageFolder.read_into's images")
        labels = np.empty(len(idx), dtype=np.int64)
        meta = np.empty((len(idx), 3), dtype=np.int32)
        for row, index in enumerate(idx):
            labels[row], meta[row] = self._decode_into(index, images[row])
        return labels, meta

    def _load(self, index: int, out: np.ndarray) -> tuple[int, np.ndarray]:
        path, label = self.samples[index]
        return label, decode_canvas(path, self.size, out)[1]

    def _decode_into(self, index: int, out: np.ndarray) -> tuple[int, np.ndarray]:
        if self.on_corrupt == "raise":
            try:
                return self._load(index, out)
            except CorruptImageError as err:  # the fix names this folder's check
                fix = (
                    f"remove or replace it (`lightning-gpuopt check {shlex.quote(self.root)}` lists every "
                    f"unreadable image at once), or pass on_corrupt='skip' to skip unreadable images"
                )
                raise CorruptImageError.of(self.samples[index][0], err.reason or "", fix) from None
        n = len(self.samples)
        # try the following images in turn; give up if a long run is unreadable (a broken folder)
        for offset in range(min(n, 64)):
            try:
                return self._load((index + offset) % n, out)
            except ValueError:
                self._record_skip(self.samples[(index + offset) % n][0])
        raise ValueError(
            f"{min(n, 64)} consecutive images from index {index} in {self.root!r} are unreadable; "
            "the folder looks broken (check the files, e.g. with PIL)"
        )

    def _record_skip(self, path: str) -> None:
        self._skipped_here.append(path)
        if self.skip_log is not None:
            with _SKIP_LOG_LOCK:
                os.makedirs(self.skip_log, exist_ok=True)
                log = os.path.join(self.skip_log, f"skipped-{os.getpid()}.txt")
                with open(log, "a", encoding="utf-8") as fh:
                    fh.write(path + "\n")

    def relabel(self, classes: Sequence[str], indices: Sequence[int]) -> None:
        """Label class ``self.classes[i]``'s samples ``indices[i]`` (``class_indices``), named by ``classes``."""
        n = len(self.classes)
        check_arg(len(indices) == n, "indices", len(indices), f"{n}: one a class")
        self.samples = [(path, int(indices[label])) for path, label in self.samples]
        self.classes = list(classes)

    def skipped(self) -> list[str]:
        """Paths skipped so far as unreadable, in this process and (via ``skip_log``) in worker processes."""
        paths = list(self._skipped_here)
        if self.skip_log is not None and os.path.isdir(self.skip_log):
            # this process's skips are already in _skipped_here
            for name in sorted(set(os.listdir(self.skip_log)) - {f"skipped-{os.getpid()}.txt"}):
                with open(os.path.join(self.skip_log, name), encoding="utf-8") as fh:
                    paths.extend(line.rstrip("\n") for line in fh if line.strip())
        return paths

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this dataset for caches (worker tuning)."""
        mtime = os.path.getmtime(self.root) if os.path.isdir(self.root) else None
        return {
            "class": type(self).__name__,
            "root": os.path.abspath(self.root),
            "len": len(self),
            "size": self.size,
            "layout": "canvas",
            "mtime": mtime,
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(root={self.root!r}, size={self.size}, images={len(self)}, "
            f"classes={len(self.classes)})"
        )
