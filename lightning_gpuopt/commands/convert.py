"""``lightning-gpuopt convert SRC OUT.h5``: a class-per-subfolder image folder to a uint8 HDF5 store."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning_gpuopt._checks import check_arg

HELP = "convert a class-per-subfolder image folder to uint8 HDF5"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="image folder laid out as SRC/<class>/<image>")
    parser.add_argument("out", help="HDF5 file to write (e.g. train_256.h5); written atomically")
    parser.add_argument(
        "--size",
        type=int,
        default=256,
        help="storage size: the shorter side of each stored whole image, in pixels (256 for 224 crops)",
    )
    parser.add_argument("--workers", type=int, default=None, help="decode processes (default: all CPUs)")
    parser.add_argument(
        "--on-corrupt",
        choices=("raise", "skip"),
        default="raise",
        help="stop at an unreadable image (raise) or leave it out and list it (skip)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _fail(message: str) -> None:
    print(f"lightning-gpuopt convert: error: {message}", file=sys.stderr)


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad arguments in the command line's own words (raises ``ValueError``, one line)."""
    check_arg(
        args.size >= 1, "--size", args.size, "a positive number of pixels", fix="e.g. 256 for 224 crops"
    )
    check_arg(
        args.workers is None or args.workers >= 0,
        "--workers",
        args.workers,
        "0 or more (0 or 1: decode in this process)",
        fix="leave it out to use every CPU",
    )
    out = Path(args.out).expanduser()
    if not args.overwrite and out.exists() and not out.is_dir():
        raise ValueError(f"output {args.out!r} already exists; pass --overwrite or another name")


def run(args: argparse.Namespace) -> int:
    from lightning_gpuopt.data.convert import (
        CorruptImageError,
        OutputExistsError,
        OutputInUseError,
        convert_folder_to_hdf5,
    )

    check_args(args)
    try:
        result = convert_folder_to_hdf5(
            args.src,
            args.out,
            args.size,
            workers=args.workers,
            progress=not args.no_progress,
            on_corrupt=args.on_corrupt,
            overwrite=args.overwrite,
        )
    except CorruptImageError as err:
        _fail(
            f"cannot decode image {err.path!r} ({err.reason}); remove or replace it, "
            "or pass --on-corrupt skip"
        )
        return 2
    except OutputExistsError:  # appeared after the check above, e.g. written by another conversion
        _fail(f"output {args.out!r} already exists; pass --overwrite or another name")
        return 2
    except OutputInUseError as err:
        _fail(str(err))
        return 2
    except OSError as err:  # read-only or full destination, failed write: the message names the path
        if isinstance(err, FileNotFoundError):
            raise
        _fail(err.strerror if err.filename is None and err.strerror else str(err))
        return 1
    except KeyboardInterrupt:
        _fail(f"interrupted; {args.out} was not written")
        return 130
    rate = result.num_images / result.seconds if result.seconds > 0 else float("nan")
    print(
        f"wrote {result.path}: {result.num_images} images, stored at {result.storage_size} px, "
        f"{len(result.classes)} classes, {result.seconds:.1f} s ({rate:,.0f} img/s)"
    )
    if result.skipped:
        shown = ", ".join(result.skipped[:5]) + (" ..." if len(result.skipped) > 5 else "")
        print(f"skipped {len(result.skipped)} unreadable image(s): {shown}", file=sys.stderr)
    return 0
