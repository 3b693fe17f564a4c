"""``lightning-gpuopt convert SRC OUT.h5``: a class-per-subfolder image folder to an HDF5 store, then what it
costs and delivers (docs/hdf5.md). Exit codes: 0 written; 2 the user's to fix; 1 a failure of the machine (an
I/O error, a decode worker that died); 130 interrupted.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_gpuopt._checks import check_arg

if TYPE_CHECKING:
    from lightning_gpuopt.data.convert import ConversionResult

# the library's warning about sources smaller than the storage size, which the command says with its flag
UPSAMPLED = r"\d+ of \d+ source images have a shorter side below storage_size="
EXIT_USER, EXIT_FAILED, EXIT_INTERRUPTED = 2, 1, 130


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="image folder laid out as SRC/<class>/<image>")
    parser.add_argument("out", help="HDF5 file to write (e.g. train_256.h5); written atomically")
    parser.add_argument("--size", type=int, default=256, help="stored shorter side (px; 256 for 224 crops)")
    formats = "raw (default): uint8 canvases; jpeg: the compact JPEG store; auto: the rule's (docs/hdf5.md)"
    parser.add_argument("--format", choices=("raw", "jpeg", "auto"), help=formats)
    parser.add_argument("--workers", type=int, help="decode processes (default: all CPUs)")
    on_corrupt = "stop at an unreadable image (raise) or leave it out and list it (skip)"
    parser.add_argument("--on-corrupt", choices=("raise", "skip"), default="raise", help=on_corrupt)
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
    _check_source(args.src)
    _check_destination_folder(args.out)


def _check_source(src: str) -> None:
    """A file given as SRC gets command-line advice (the library's names a Python argument)."""
    path = Path(src).expanduser()
    if not path.is_file():
        return  # a missing or badly laid out folder is named by the conversion itself
    layout = "SRC must be a class-per-subfolder image folder, SRC/<class>/<image>"
    if path.suffix.lower() in (".h5", ".hdf5"):
        raise ValueError(
            f"SRC {src!r} is an HDF5 file, already a store: there is nothing to convert; pass it to "
            f"OptimizedDataModule or `lightning-gpuopt tune {src}` directly ({layout})"
        )
    raise ValueError(
        f"SRC {src!r} is a file, not a folder; {layout} (one subfolder a class, holding its images)"
    )


def _folder_of(out: str) -> Path:
    """The folder the output is written in (a symbolic link's target is replaced in its own folder)."""
    out_path = Path(out).expanduser()
    dest = Path(os.path.realpath(out_path)) if out_path.is_symlink() else out_path
    return dest.absolute().parent


_WHY = {
    errno.EROFS: "its folder {} is on a read-only file system; choose an output on a writable disk",
    errno.EACCES: "permission denied in its folder {}; choose a folder you can write to, or change its "
    "permissions (chmod/chown)",
}


def _unwritable(out: str, code: int | None) -> str | None:
    """Why ``out`` cannot be written and what to do, for a read-only or forbidden folder."""
    why = _WHY.get(errno.EACCES if code == errno.EPERM else code or 0)
    return None if why is None else f"cannot write {out!r}: " + why.format(repr(str(_folder_of(out))))


def _check_destination_folder(out: str) -> None:
    """Refuse a read-only or forbidden output folder before a scan (a read-only disk shows no free space)."""
    folder = _folder_of(out)
    if not folder.is_dir():
        return  # the conversion names the missing folder
    try:
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # no statvfs here: the conversion's own checks decide
        read_only = False
    if read_only or not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(_unwritable(out, errno.EROFS if read_only else errno.EACCES))


def _os_error_message(err: OSError, out: str) -> str:
    # the conversion marks a refusal of its destination (its lock or temporary file cannot be created)
    reason = _unwritable(out, err.errno) if getattr(err, "destination", None) else None
    if reason is not None:
        return reason
    if err.filename is None:
        return err.strerror or str(err)  # the package's own message names the path and the fix
    from lightning_gpuopt.cli import describe_os_error

    return describe_os_error(err)


def _raw_bytes(num_images: int, size: int) -> int:
    from lightning_gpuopt.data import layout

    ch, cw = layout.canvas_shape(size)
    return num_images * ch * cw * 3


def _auto_format(args: argparse.Namespace, files: list[str], rates: Any) -> str:
    """``--format auto``: the store the rule picks, stated in one line before converting."""
    from lightning_gpuopt.data import store_choice

    sizes = [os.stat(p).st_size for p in files]
    raw, disk = _raw_bytes(len(sizes), args.size), None
    if not store_choice.fits(raw, store_choice.memory_bytes()):
        probe = f"{Path(args.out).name}.tmp-probe-{os.getpid()}"
        disk = store_choice.probe_disk_gbps(_folder_of(args.out), probe)
    choice = store_choice.choose_store_format(len(sizes), raw, sum(sizes), disk_gbps=disk, rates=rates)
    print(f"--format auto: the {'JPEG' if choice.format == 'jpeg' else 'raw'} store: {choice.reason}")
    return choice.format


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def _consequences(result: ConversionResult, given: str | None, rates: Any = None) -> list[str]:
    """What the written store costs and delivers, and (``--format`` not given) the rule's recommendation."""
    from lightning_gpuopt.data import store_choice

    n, fmt = max(1, result.num_images), result.format
    stored, source = result.bytes_written, result.source_bytes
    lines = [
        f"bytes: {_gb(stored)} of images, {stored / n / 1e3:,.1f} kB an image: {stored / max(1, source):.2f}x "
        f"the source files ({_gb(source)}, {source / n / 1e3:,.1f} kB an image)"
    ]
    disk = store_choice.disk_read_gbps(result.path)
    raw = stored if fmt == "raw" else _raw_bytes(n, result.storage_size)
    jpeg = stored if fmt == "jpeg" else source  # the JPEG store holds no more than the sources
    choice = store_choice.choose_store_format(n, raw, jpeg, disk_gbps=disk, rates=rates)
    disk_text = f"the disk: {choice.disk_gbps:.2f} GB/s, " + ("O_DIRECT, measured" if disk else "assumed")
    cold = f"about {choice.disk_gbps * 1e9 / (stored / n):,.0f} img/s ({disk_text})"
    if fmt == "raw":
        size = f"{_gb(stored)} against {_gb(choice.memory)} memory"
        if store_choice.fits(stored, choice.memory):
            how = "measured" if rates is not None else "assumed"
            rate = f"about {choice.raw_rate:,.0f} img/s while the page cache holds it ({how}; {size})"
        else:
            rate = f"the disk's, the store being over half the memory ({size})"
        lines.append(f"expected read rate: {rate}; from a cold cache {cold}")
    else:
        lines.append(
            f"expected read rate: about {choice.jpeg_rate:,.0f} img/s ({choice.cores_per_gpu} cores a GPU "
            f"decoding x {store_choice.per_core(rates)}); its bytes come from a cold cache at {cold}"
        )
    if given is None:
        lines.append(
            f'recommended here: --format {choice.format}: {choice.reason} (docs/hdf5.md, "Raw or JPEG store")'
        )
    return lines


def run(args: argparse.Namespace) -> int:
    from lightning_gpuopt.data import store_choice
    from lightning_gpuopt.data._destination import _destination
    from lightning_gpuopt.data.convert import DecodeWorkerError, OutputExistsError, convert_folder_to_hdf5
    from lightning_gpuopt.data.folder import scan_image_folder

    check_args(args)
    given = args.format
    try:
        _destination(args.out, args.overwrite)  # the conversion's own checks of OUT, before any work
        files = [p for p, _ in scan_image_folder(Path(args.src).expanduser())[1]]
        # this host's rates on a sample of the source: what the rule weighs instead of another host's figures
        rates = store_choice.measure_rates(files, args.size)
        fmt = _auto_format(args, files, rates) if given == "auto" else given or "raw"
        with warnings.catch_warnings(record=True) as caught:
            result = convert_folder_to_hdf5(
                args.src,
                args.out,
                args.size,
                workers=args.workers,
                progress=not args.no_progress,
                on_corrupt=args.on_corrupt,
                overwrite=args.overwrite,
                format=fmt,
            )
    # other ValueErrors (an unreadable image, another conversion writing OUT) reach cli.main, which says them
    # in one line with the command's flags
    except OutputExistsError:
        _fail(f"output {args.out!r} already exists; pass --overwrite or another name")
        return EXIT_USER
    except DecodeWorkerError as err:
        _fail(f"{err.what}; {args.out} was not written. Convert again with --workers 1 to find the image")
        return EXIT_FAILED
    except OSError as err:
        # a read-only, forbidden, missing or full destination is the user's to fix (2); a failed device
        # write (EIO) is not (1)
        _fail(_os_error_message(err, args.out))
        return EXIT_FAILED if err.errno == errno.EIO else EXIT_USER
    except KeyboardInterrupt:
        _fail(f"interrupted; {args.out} was not written")
        return EXIT_INTERRUPTED
    rate = result.num_images / result.seconds if result.seconds > 0 else float("nan")
    kind = "JPEG store" if result.format == "jpeg" else "raw store"
    print(
        f"wrote {result.path}: {kind}, {result.num_images} images, stored at {result.storage_size} px, "
        f"{len(result.classes)} classes, {result.seconds:.1f} s ({rate:,.0f} img/s)"
    )
    for line in _consequences(result, given, rates):
        print(f"  {line}")
    for warning in caught:
        text = str(warning.message)
        if re.match(UPSAMPLED, text):  # the library's words, spelled as the command's option
            print(
                f"lightning-gpuopt convert: warning: {text.replace('storage_size=', '--size ')}",
                file=sys.stderr,
            )
        else:
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    if result.skipped:
        shown = ", ".join(result.skipped[:5]) + (" ..." if len(result.skipped) > 5 else "")
        print(f"skipped {len(result.skipped)} unreadable image(s): {shown}", file=sys.stderr)
    return 0
