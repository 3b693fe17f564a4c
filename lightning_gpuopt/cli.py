"""The ``lightning-gpuopt`` command (also ``python -m lightning_gpuopt``): each subcommand is
``lightning_gpuopt/commands/<name>.py`` (``configure(parser)``, ``run(args) -> int``), imported only when it runs;
a failure is one line on stderr (exit codes: docs/troubleshooting.md)."""

from __future__ import annotations

import argparse
import errno
import importlib
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from typing_extensions import override

from lightning_gpuopt import __version__

# subcommand (the module lightning_gpuopt.commands.<name>) -> one-line help, here so --help needs no import
COMMANDS: dict[str, str] = {
    "demo": "short monitored fit, then the ladder on this machine beside a recorded GPU run",
    "bench": "benchmark a ladder of settings from naive to fully optimized",
    "convert": "convert a class-per-subfolder image folder to an HDF5 store (raw uint8 or JPEG)",
    "tune": "the num_workers that OptimizedDataModule(num_workers='auto') uses for a folder or store",
    "check": "decode every image of a folder and list each one that cannot be decoded",
}

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

# what to do about an OSError, by errno
_OS_FIXES = {
    errno.EROFS: "the file system is read-only; choose a path on a writable disk",
    **dict.fromkeys((errno.EACCES, errno.EPERM), "choose a path you can write to, or change its permissions"),
    errno.ENOTDIR: "a part of the path is a file, not a folder; choose another path",
    errno.EISDIR: "it is a folder; give a file name",
    errno.EEXIST: "it already exists; choose another path or remove it",
    errno.ENOSPC: "the disk is full; free some space or choose another disk",
    errno.ENOENT: "check the path",
}


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: a usage error is one line (exit status 2), and ``cli_advice`` spells advice
    written for the Python API with its options."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._options: list[argparse.Action] = []
        super().__init__(*args, **kwargs)

    @override
    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        if action.option_strings:
            self._options.append(action)
        return action

    @override
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def cli_advice(self, message: str) -> str:
        """``message`` with a keyword argument it advises (``on_corrupt='skip'``) spelled as this command's option
        (``--on-corrupt skip``), and a clause ``, or pass name=value ...`` naming no option left out."""
        for action in self._options:
            for choice in action.choices or ():  # the package's messages spell values with repr()
                message = message.replace(
                    f"{action.dest}={choice!r}", f"{action.option_strings[-1]} {choice}"
                )
        start = message.find(", or pass ")
        if start >= 0:
            name, equals, _ = message[start + len(", or pass ") :].partition(" ")[0].partition("=")
            if equals and name.isidentifier():
                end = message.find(";", start)
                message = message[:start] + (message[end:] if end >= 0 else "")
        return message


def describe_os_error(err: OSError) -> str:
    """One line: what failed, on which path, and what to do about it."""
    if err.filename is None:
        return str(err)  # raised by this package with its own message
    path = err.filename if err.filename2 is None else f"{err.filename} -> {err.filename2}"
    fix = _OS_FIXES.get(err.errno or 0, "check the path and its permissions")
    return f"{err.strerror or type(err).__name__}: {path!r}; {fix}"


def _one_line(err: BaseException) -> str:
    """The message of ``err`` on one line (a DataLoader worker's error: the worker's own message)."""
    from lightning_gpuopt._compat import worker_error_message

    text = str(err).strip()
    lines = text.splitlines()
    return worker_error_message(text, type(err)) or (lines[0].strip() if lines else type(err).__name__)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        parser = CommandParser(
            prog="lightning-gpuopt", description="Keep the GPU busy in PyTorch Lightning training."
        )
        parser.add_argument("--version", action="version", version=f"lightning-gpuopt {__version__}")
        sub = parser.add_subparsers(dest="command", metavar="COMMAND")
        for command, help_text in COMMANDS.items():
            sub.add_parser(command, help=help_text, description=help_text, add_help=False)
        args = parser.parse_args(argv)  # handles --help / --version / unknown commands
        parser.print_help()
        return 0 if args.command is None and not argv else EXIT_USAGE
    name = argv[0]
    prefix = f"lightning-gpuopt {name}"
    sub_parser = CommandParser(prog=prefix, description=COMMANDS[name])
    from lightning_gpuopt._imports import torchvision_problem

    broken = torchvision_problem()  # before Lightning, which a broken torchvision takes down
    if broken is not None:
        print(f"{prefix}: error: {broken}", file=sys.stderr)
        return EXIT_USAGE
    try:
        module = importlib.import_module(f"lightning_gpuopt.commands.{name}")
        module.configure(sub_parser)
        args = sub_parser.parse_args(argv[1:])
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ValueError, OSError, ModuleNotFoundError) as err:
        # user errors: one clear line, no traceback
        message = describe_os_error(err) if isinstance(err, OSError) else _one_line(err)
        print(f"{prefix}: error: {sub_parser.cli_advice(message)}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
