"""Energy per image: the joules a trained sample costs the GPU beside samples/s, the JPEG engine's load, and
whether the compiled step replays CUDA graphs. Rows (``_energy.py`` says what each trains):
``naive`` (the ladder's first row), ``preset`` (a batch kept on the GPU, through the preset), ``gpu_decode``
(JPEGs decoded on the GPU: DALI, else torchvision's nvJPEG) and ``graphs_skipped`` (the preset with an input
changed in place: no CUDA graphs). Rows take turns ``--repeats`` times, each repetition one fit measured by
``StepClock`` beside a ``GPUStatsMonitor``; a row this machine cannot run says why.

    python3 benchmarks/energy.py            # one H100 or H200: about 5 minutes -> results/energy_<gpu>.json
    python3 benchmarks/energy.py --quick    # CPU smoke run: naive trains, the others say why they cannot
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import _energy as energy
from _shared import RESULTS, add_common, add_model, chosen_rows, free, measured_fit, say, take_turns

from lightning_gpuopt._common import format_table
from lightning_gpuopt.bench.measure import machine_info, write_results
from lightning_gpuopt.bench.steady import Measurement
from lightning_gpuopt.bench.synthetic import make_jpeg_folder


def variant(name: str, args: argparse.Namespace, folder: Path) -> Callable[[], Measurement]:
    def run() -> Measurement:
        from lightning_gpuopt import CompileModel, GPUStatsMonitor

        model, fit, preset = energy.row_setup(name, folder, args.arch, args.batch_size, args.image_size,
                                              args.device, args.decoder)  # fmt: skip
        naive = name == "naive"  # about a second a step: fewer steps, shorter monitor windows
        warmup, steps = (min(args.warmup, 2), max(2, args.steps // 10)) if naive else (args.warmup, args.steps)  # fmt: skip
        monitor = GPUStatsMonitor(log_every_n_steps=2 if naive else 10, gpu=args.device == "cuda",
                                  ceiling=False, sync_steps=0)  # fmt: skip
        compiler = CompileModel() if preset else None
        try:
            m = measured_fit(model, warmup, steps, device=args.device, preset=preset, compile=preset,
                             callbacks=[c for c in (compiler, monitor) if c is not None], **fit)  # fmt: skip
        finally:
            del fit
            free()
        m.extra.update(energy.fit_figures(monitor, compiler, m.steps, m.samples_per_sec))
        return m

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common(p, warmup=10, steps=50, repeats=2)
    add_model(p, energy.ROWS)
    p.add_argument("--images", type=int, default=2048, help="JPEGs generated (500x375 RGB, 10 classes)")
    p.add_argument("--decoder", choices=("auto", "dali", "torchvision"), default="auto", help="gpu_decode's")
    args = p.parse_args(argv)
    rows, t0 = chosen_rows(p, args, energy.ROWS), time.perf_counter()
    cuda = args.device == "cuda"
    args.decoder = energy.gpu_decoder(args.decoder, cuda)
    size, images = ((64, 48), 32) if args.quick else ((500, 375), args.images)
    folder = make_jpeg_folder(Path(tempfile.gettempdir()) / f"energy_jpegs_{images}_{size[0]}", images, 10, size)  # fmt: skip
    why = {n: energy.why_not(n, cuda, args.decoder) for n in rows}
    results = take_turns({n: variant(n, args, folder) for n in rows if why[n] is None}, args.repeats, say)
    table = energy.rows_of(results, why)
    out = Path(args.out or (Path(tempfile.gettempdir()) if args.quick else RESULTS)
               / f"energy_{energy.gpu_tag(machine_info()['gpu'])}.json")  # fmt: skip
    write_results(out, table, benchmark="energy", decoder=args.decoder, settings=vars(args),
                  seconds=time.perf_counter() - t0)  # fmt: skip
    print(format_table(table, energy.COLUMNS))
    print(f"wrote {out}")
    return 0 if all(r["status"] != "failed" for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
