"""``lightning-gpuopt convert SRC OUT.h5``: a class-per-subfolder image folder to a uint8 HDF5 store."""

from __future__ import annotations

import argparse
import sys

HELP = "convert a class-per-subfolder image folder to uint8 HDF5"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="image folder laid out as SRC/<class>/<image>")
    parser.add_argument("out", help="HDF5 file to write (e.g. train_256.h5); written atomically")
    parser.add_argument(
        "--size", type=int, default=256, help="stored side in pixels: short side resize + center crop (256)"
    )
    parser.add_argument(
        "--chunk-images", type=int, default=1, help="images per HDF5 chunk (1: best for random reads)"
    )
    parser.add_argument(
        "--compression",
        choices=("none", "gzip", "lzf"),
        default="none",
        help="chunk compression; a random read then decompresses its whole chunk (none)",
    )
    parser.add_argument("--compression-level", type=int, default=4, help="gzip level 0-9 (4)")
    parser.add_argument("--workers", type=int, default=None, help="decode processes (default: all CPUs)")
    parser.add_argument(
        "--on-corrupt",
        choices=("raise", "skip"),
        default="raise",
        help="stop at an unreadable image (raise) or leave it out and list it (skip)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from lightning_gpuopt.data.hdf5 import convert_folder_to_hdf5

    result = convert_folder_to_hdf5(
        args.src,
        args.out,
        size=args.size,
        chunk_images=args.chunk_images,
        compression=None if args.compression == "none" else args.compression,
        compression_level=args.compression_level,
        workers=args.workers,
        progress=not args.no_progress,
        on_corrupt=args.on_corrupt,
        overwrite=args.overwrite,
    )
    rate = result.num_images / result.seconds if result.seconds > 0 else float("nan")
    print(
        f"wrote {result.path}: {result.num_images} images of {args.size}x{args.size}, "
        f"{len(result.classes)} classes, {result.seconds:.1f} s ({rate:,.0f} img/s)"
    )
    if result.skipped:
        shown = ", ".join(result.skipped[:5]) + (" ..." if len(result.skipped) > 5 else "")
        print(f"skipped {len(result.skipped)} unreadable image(s): {shown}", file=sys.stderr)
    return 0
