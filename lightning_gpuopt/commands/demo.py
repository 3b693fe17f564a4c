"""``lightning-gpuopt demo``: a short monitored fit, then the ladder on this machine beside a recorded GPU run
(``lightning_gpuopt.bench.demo``)."""

from __future__ import annotations

import argparse

HELP = "short monitored fit, then the ladder on this machine beside a recorded GPU run"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        default="./gpuopt_runs/demo",
        help="output folder; each run writes into a new version_<n> folder inside it (default: %(default)s)",
    )
    parser.add_argument(
        "--steps", type=int, default=40, help="training steps of the fit (default: %(default)s)"
    )
    parser.add_argument("--images", type=int, default=256, help="generated JPEGs (default: %(default)s)")
    parser.add_argument(
        "--image-size",
        type=int,
        default=32,
        help="side of the square images the model sees (default: %(default)s)",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="batch size (default: %(default)s)")
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="DataLoader workers (default: min(4, CPUs - 1): one core stays with training)",
    )
    parser.add_argument(
        "--ladder-seconds",
        type=float,
        default=3.0,
        help="measured seconds per ladder row, in 3 windows; 0 skips the ladder (default: %(default)s)",
    )
    parser.add_argument(
        "--accelerator",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="where to train (default: %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo; exit 1 with the reasons when its ladder measured no row or a row failed."""
    import json
    import sys

    from lightning_gpuopt.bench.demo import DemoOptions, run_demo
    from lightning_gpuopt.commands.bench import ladder_failure

    run = run_demo(
        DemoOptions(
            out=args.out,
            steps=args.steps,
            images=args.images,
            image_size=args.image_size,
            batch_size=args.batch_size,
            workers=args.workers,
            ladder_seconds=args.ladder_seconds,
            accelerator=args.accelerator,
        )
    )
    ladder = run / "ladder.json"
    if ladder.is_file():  # the ladder ran (--ladder-seconds > 0)
        failure = ladder_failure(json.loads(ladder.read_text())["rows"], set())
        if failure is not None:
            print(f"lightning-gpuopt demo: error: {failure}", file=sys.stderr)
            return 1
    return 0
