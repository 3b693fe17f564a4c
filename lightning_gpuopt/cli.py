"""The ``lightning-gpuopt`` command (also ``python -m lightning_gpuopt``).

Each subcommand lives in ``lightning_gpuopt/commands/<name>.py`` and defines ``HELP`` (one line),
``configure(parser)`` and ``run(args) -> int``. The module is imported only when its subcommand runs, so
``lightning-gpuopt --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from lightning_gpuopt import __version__

# subcommand -> (module, one-line help). Help is duplicated here so --help needs no heavy import.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "lightning_gpuopt.commands.demo",
        "short Lightning fit on generated images with the GPU monitor on",
    ),
    "bench": (
        "lightning_gpuopt.commands.bench",
        "benchmark a ladder of settings from naive to fully optimized",
    ),
    "convert": (
        "lightning_gpuopt.commands.convert",
        "convert a class-per-subfolder image folder to uint8 HDF5",
    ),
    "tune": ("lightning_gpuopt.commands.tune", "measure DataLoader throughput per num_workers for a folder"),
}


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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        args = parser.parse_args(argv)  # handles --help / --version / unknown commands
        parser.print_help()
        return 0 if args.command is None and not argv else 2
    name = argv[0]
    module_name, help_text = COMMANDS[name]
    module = importlib.import_module(module_name)
    sub_parser = argparse.ArgumentParser(prog=f"lightning-gpuopt {name}", description=help_text)
    module.configure(sub_parser)
    args = sub_parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as err:
        # user errors: one clear line, no traceback
        print(f"lightning-gpuopt {name}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
