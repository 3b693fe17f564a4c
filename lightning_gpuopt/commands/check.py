"""``lightning-gpuopt check DIR``: decode every image of a folder and list each one that cannot be decoded,
``<path>: <reason>`` a line. Exit codes: 0 every image decodes; 1 some cannot; 2 a user error.
"""

from __future__ import annotations

import argparse

EXIT_UNREADABLE = 1


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="image folder laid out as DIR/<class>/<image>")
    parser.add_argument(
        "--threads", type=int, default=None, help="decoding threads (default: two a CPU this process may use)"
    )


def run(args: argparse.Namespace) -> int:
    import sys
    import time

    from lightning_gpuopt._checks import check_arg
    from lightning_gpuopt.data.folder import UnreadableImagesError, check_image_folder

    check_arg(args.threads is None or args.threads >= 1, "--threads", args.threads, "1 or more")
    start = time.perf_counter()
    try:
        images = check_image_folder(args.dir, threads=args.threads)
    except UnreadableImagesError as err:
        for error in err.errors:
            print(f"{error.path}: {error.reason}")
        print(
            f"lightning-gpuopt check: error: {len(err.errors)} of {err.images} images in {args.dir!r} cannot "
            "be decoded (listed above); remove or replace them, or train with on_corrupt='skip' to skip them",
            file=sys.stderr,
        )
        return EXIT_UNREADABLE
    print(f"{images} images in {args.dir!r} decode ({time.perf_counter() - start:.1f} s)")
    return 0
