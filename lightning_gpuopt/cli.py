"""The ``lightning-gpuopt`` command (also ``python -m lightning_gpuopt``).

Each subcommand lives in ``lightning_gpuopt/commands/<name>.py`` and defines ``HELP`` (one line),
``configure(parser)`` and ``run(args) -> int``. The module is imported only when its subcommand runs, so
``lightning-gpuopt --help`` stays fast.

A user error (a bad value, a missing file, a path that cannot be written, a missing optional package) ends
the command with one line, ``lightning-gpuopt <cmd>: error: ...``, and exit code 2; Ctrl-C ends it with
``lightning-gpuopt <cmd>: interrupted`` and exit code 130. Neither prints a traceback.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import re
import sys
from collections.abc import Sequence

from lightning_gpuopt import __version__

# subcommand -> (module, one-line help). Help is duplicated here so --help needs no heavy import.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "lightning_gpuopt.commands.demo",
        "short monitored fit, then the ladder on this machine beside a recorded GPU run",
    ),
    "bench": (
        "lightning_gpuopt.commands.bench",
        "benchmark a ladder of settings from naive to fully optimized",
    ),
    "convert": (
        "lightning_gpuopt.commands.convert",
        "convert a class-per-subfolder image folder to uint8 HDF5",
    ),
    "tune": (
        "lightning_gpuopt.commands.tune",
        "the num_workers that OptimizedDataModule(num_workers='auto') uses for a folder or store",
    ),
}

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

# what to do about an OSError, by errno
_OS_FIXES = {
    errno.EROFS: "the file system is read-only; choose a path on a writable disk",
    errno.EACCES: "choose a path you can write to, or change its permissions",
    errno.EPERM: "choose a path you can write to, or change its permissions",
    errno.ENOTDIR: "a part of the path is a file, not a folder; choose another path",
    errno.EISDIR: "it is a folder; give a file name",
    errno.EEXIST: "it already exists; choose another path or remove it",
    errno.ENOSPC: "the disk is full; free some space or choose another disk",
    errno.ENOENT: "check the path",
}
# a decode error names the Python argument; the command line has a flag for it, or none
_PY_ON_CORRUPT = re.compile(r"""on_corrupt\s*=\s*['"]skip['"]""")
_PY_ON_CORRUPT_CLAUSE = re.compile(r""",?\s*or pass on_corrupt\s*=\s*['"]skip['"][^;]*""")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-gpuopt",
        description="Keep the GPU busy in PyTorch Lightning training.",
    )
    parser.add_argument("--version", action="version", version=f"lightning-gpuopt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, description=help_text, add_help=False)
    return parser


def describe_os_error(err: OSError) -> str:
    """One line: what failed, on which path, and what to do about it."""
    if err.filename is None:
        return str(err)  # raised by this package with its own message
    path = err.filename if err.filename2 is None else f"{err.filename} -> {err.filename2}"
    fix = _OS_FIXES.get(err.errno or 0, "check the path and its permissions")
    return f"{err.strerror or type(err).__name__}: {path!r}; {fix}"


def _one_line(err: BaseException) -> str:
    """The message of ``err`` on one line; for an error re-raised from a DataLoader worker, the worker's own
    message rather than the traceback text torch wraps around it."""
    text = str(err).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) > 1 and "Original Traceback" in text:
        last = lines[-1]
        return last.split(": ", 1)[1] if re.match(r"^[\w.]+(Error|Exception): ", last) else last
    return lines[0] if lines else type(err).__name__


def _message(err: BaseException, args: argparse.Namespace) -> str:
    message = describe_os_error(err) if isinstance(err, OSError) else _one_line(err)
    if hasattr(args, "on_corrupt"):
        return _PY_ON_CORRUPT.sub("--on-corrupt skip", message)
    return _PY_ON_CORRUPT_CLAUSE.sub("", message)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        args = parser.parse_args(argv)  # handles --help / --version / unknown commands
        parser.print_help()
        return 0 if args.command is None and not argv else EXIT_USAGE
    name = argv[0]
    module_name, help_text = COMMANDS[name]
    prefix = f"lightning-gpuopt {name}"
    args = argparse.Namespace()
    try:
        module = importlib.import_module(module_name)
        sub_parser = argparse.ArgumentParser(prog=prefix, description=help_text)
        module.configure(sub_parser)
        args = sub_parser.parse_args(argv[1:])
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ValueError, OSError, ModuleNotFoundError) as err:
        # user errors: one clear line, no traceback
        print(f"{prefix}: error: {_message(err, args)}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
