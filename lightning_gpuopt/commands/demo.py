"""``lightning-gpuopt demo``: a short monitored fit, then the ladder on this machine beside a recorded GPU run
(``lightning_gpuopt.bench.demo``)."""

from __future__ import annotations

import argparse

HELP = "short monitored fit, then the ladder on this machine beside a recorded GPU run"

# (flag, type, default, help) of the flags that take a number
_FLAGS = (
    ("--steps", int, 40, "training steps of the fit"),
    ("--images", int, 256, "generated JPEGs"),
    ("--image-size", int, 32, "side of the square images the model sees"),
    ("--batch-size", int, 32, "batch size"),
    ("--ladder-seconds", float, 3.0, "measured seconds per ladder row, in 3 windows; 0 skips the ladder"),
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        default="./gpuopt_runs/demo",
        help="output folder; each run writes into a new version_<n> folder inside it (default: %(default)s)",
    )
    for flag, kind, default, text in _FLAGS:
        parser.add_argument(flag, type=kind, default=default, help=f"{text} (default: %(default)s)")
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="DataLoader workers (default: min(4, CPUs - 1): one core stays with training)",
    )
    parser.add_argument(
        "--accelerator", choices=("auto", "cpu", "gpu"), default="auto", help="where to train (default: auto)"
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo; exit 1 with the reasons when its ladder measured no row or a row failed."""
    import json
    import sys

    from lightning_gpuopt.bench.demo import DemoOptions, run_demo
    from lightning_gpuopt.commands.bench import ladder_failure

    names = ("out", "steps", "images", "image_size", "batch_size", "workers", "ladder_seconds", "accelerator")
    run = run_demo(DemoOptions(**{name: getattr(args, name) for name in names}))
    ladder = run / "ladder.json"
    if ladder.is_file():  # the ladder ran (--ladder-seconds > 0)
        failure = ladder_failure(json.loads(ladder.read_text())["rows"], set())
        if failure is not None:
            print(f"lightning-gpuopt demo: error: {failure}", file=sys.stderr)
            return 1
    return 0
