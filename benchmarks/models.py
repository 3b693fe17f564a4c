"""Models: each model of the zoo against its own ceiling, the fastest plain PyTorch loop found for it, and the
preset through Lightning on the same batches.

For each model (``_zoo.ZOO``: ResNet-50 at batch 256 and 512, ViT-B/16, ConvNeXt-T, EfficientNet-B0,
FCN-ResNet50 on 512x512 masks, a GPT-2-small-shaped causal LM on 1024-token sequences; random weights, one
batch kept on the GPU):

1. the ceiling search: the plain loop (``_zoo.ZooLoop``) under each configuration of ``--search``, one
   window each (a compile past ``--compile-timeout`` is abandoned and recorded). ``quick``: compiled bf16
   (channels_last for the conv nets), its CUDA-graph variant, the same eager and the plain-loop twin of
   what the preset picks; ``full``: compile modes (eager, default, reduce-overhead,
   max-autotune-no-cudagraphs, max-autotune) x fp16/bf16 x channels_last on/off (conv nets), fused, and
   eager unfused; or comma-separated ``mode:dtype[:cl][:unfused]`` names. The fastest is the ceiling.
2. ``Trainer(**fast_trainer_kwargs(model, ...))`` fitting the user's module (``_zoo.ZooModule``: SGD with
   momentum for conv nets, AdamW for transformers and ConvNeXt) on a batch of the same shape kept on the
   GPU, configured as a long run (90 epochs, 100,000 steps for the LM: the preset judges that run) and
   stopped after ``StepClock``'s window; what the preset chose is read back (``preset_config``).
3. the ceiling's configuration and the preset take turns ``--repeats`` times; each row holds both medians,
   their range, p50/p90 and ``ratio`` = preset / ceiling (medians).
4. ``--advise``: ``_zoo_advice``'s scenarios on the same module, ``GPUStatsMonitor``, ``NVTXRanges`` and
   ``BottleneckAdvisor`` on a healthy fit (no warning), a starved one (``input-bound``) and an fp32 one
   (``fp32-on-tensor-cores``), into the row's ``advisor``. ``--advise-only``: those alone, into ``--out``'s
   rows (the starved wait from the healthy fit's step).

    python3 benchmarks/models.py                                  # the zoo on one H200
    python3 benchmarks/models.py --models gpt2 --update           # one model, the file's other rows kept
    python3 benchmarks/models.py --models vit_b_16 --search full  # the whole grid (long: compiles)
    python3 benchmarks/models.py --quick --models resnet50,gpt2   # CPU smoke run: the stand-ins, eager
    python3 benchmarks/models.py --models vit_b_16 --advise       # and the advisor's three scenarios

It writes ``--out``, else ``results/<date>-models-<gpu>.json``; ``--update`` keeps that file's rows of the
models not run now (``--out`` names a file of another day). The file is written after each model
(``complete``: false and ``models_left`` until the last), so a run stopped by a time limit keeps the models
it finished; ``--update`` with the models left goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _shared import add_common, device_of, free, measured_fit, results_path, say, take_turns
from _zoo import COMPILE_MODES, ZOO, Config, Spec, ZooLoop, ZooModule, batches
from _zoo_advice import advise
from typing_extensions import override

from lightning_gpuopt._common import format_table
from lightning_gpuopt.bench.measure import command_line, machine_info, write_results
from lightning_gpuopt.bench.rows import DeviceBatches
from lightning_gpuopt.bench.steady import Measurement, measure_loop, summarize

#: the preset's target: its share of each model's ceiling
TARGET = 0.97
#: steps of each window the advisor's scenarios judge (``--advise``)
ADVISE_WINDOW = 20
#: ResNet-50's record: MLPerf Training v4.0, H200 system, images a second a GPU (MXNet, DALI, CUDA graphs)
RESNET50_RECORD = 7950.0
#: families whose convolutions make channels_last a candidate of the search
CONV_FAMILIES = ("conv", "depthwise", "segmentation")
#: a row's ``ceiling_<key>`` and ``preset_<key>``: ``summarize``'s field of that side
SIDE_FIELDS = {"samples_per_sec": "samples_per_sec", "min": "samples_per_sec_min",
               "max": "samples_per_sec_max"}  # fmt: skip
SIDE_FIELDS |= {k: k for k in ("spread", "p50_ms", "p90_ms", "repeats", "error")}


# ---------------------------------------------------------------------------------------------- the search
def preset_twin(model: torch.nn.Module, device: str) -> Config:
    """The plain-loop configuration of what ``fast_trainer_kwargs(model)`` picks for a long run on ``device``:
    its precision, ``ChannelsLast``, ``CompileModel`` (``choose_mode``'s mode) and ``FusedOptimizer``."""
    from lightning_gpuopt import ChannelsLast, CompileModel, FusedOptimizer, fast_trainer_kwargs
    from lightning_gpuopt.compute import _model, compile

    kw = fast_trainer_kwargs(model, device)
    has = {t: any(isinstance(c, t) for c in kw["callbacks"])
           for t in (ChannelsLast, CompileModel, FusedOptimizer)}  # fmt: skip
    dtype = {"16-mixed": "fp16", "bf16-mixed": "bf16"}.get(str(kw["precision"]), "fp32")
    mode = compile.choose_mode(family=_model.family(model), device=device)[0]
    return Config(mode if has[CompileModel] else "eager", dtype, has[ChannelsLast], has[FusedOptimizer])


def search_configs(spec: Spec, search: str, twin: Config, device: str) -> tuple[list[Config], str | None]:
    """The configurations ``--search`` asks for on this model, and a note when some were left out.

    On a CPU, ``quick`` and ``full`` keep their eager configurations (inductor's CPU build takes minutes a
    model): a compiled one runs there only when named.
    """
    layouts = (True, False) if spec.family in CONV_FAMILIES else (False,)
    cl = layouts[0]
    if search == "quick":
        configs = [Config("eager", "bf16", cl), Config("default", "bf16", cl)]
        configs += [Config("reduce-overhead", "bf16", cl), twin]
    elif search == "full":
        configs = [Config(m, d, c) for m in COMPILE_MODES for d in ("bf16", "fp16") for c in layouts]
        configs += [Config("eager", d, c, fused=False) for d in ("bf16", "fp16") for c in layouts] + [twin]
    else:
        return list(dict.fromkeys(Config.parse(n) for n in search.split(",") if n)), None
    note = None
    if device == "cpu":
        kept = [Config("eager", c.dtype, c.channels_last, c.fused) for c in configs]
        configs, note = kept, "on a CPU compiled configurations run eager (name them in --search to compile)"
    return list(dict.fromkeys(configs)), note


@contextlib.contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """Raise ``TimeoutError`` in the block after ``seconds`` (SIGALRM; the main thread only; 0: no limit)."""
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"{what} took longer than --compile-timeout {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def try_config(spec: Spec, config: Config, args: argparse.Namespace) -> tuple[ZooLoop | None, dict[str, Any]]:
    """Build and compile ``config``'s loop (within ``--compile-timeout``) and measure one window."""
    out: dict[str, Any] = {"config": config.to_dict(), "samples_per_sec": None, "error": None}
    try:
        loop = ZooLoop(spec, config, args.device, quick=args.quick)
        with deadline(args.compile_timeout if config.compile != "eager" else 0, f"compiling {config.name}"):
            out["compile_seconds"] = loop.warm(3)
        m = measure_loop(loop.step, loop.device, args.warmup, args.search_steps, loop.batch_size)
    except Exception as err:  # a configuration that fails is recorded; the search goes on
        out["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        if config.compile != "eager":
            torch._dynamo.reset()  # a half-built compile leaves nothing behind for the next configuration
        return None, out
    out.update(samples_per_sec=m.samples_per_sec, p50_ms=m.p50_ms, p90_ms=m.p90_ms)
    return loop, out


def find_ceiling(
    spec: Spec, configs: list[Config], args: argparse.Namespace
) -> tuple[ZooLoop | None, list[dict[str, Any]]]:
    """Each configuration once, in order; the fastest loop is kept (the others freed) with every result."""
    best: ZooLoop | None = None
    best_rate, tried = 0.0, []
    for config in configs:
        loop, result = try_config(spec, config, args)
        tried.append(result)
        rate = result["samples_per_sec"] or 0.0
        error = (result["error"] or "").strip().split("\n")[0]
        print(f"  search {config.name:34s} {rate:10,.0f}/s  {error}", flush=True)
        if loop is not None and rate > best_rate:
            best, best_rate = loop, rate
        del loop
        free()
    return best, tried


# ------------------------------------------------------------------------------------------------ the preset
class PresetReadBack(pl.Callback):
    """What the preset's ``Trainer`` ran with, read at the end of training (before its callbacks tear down):
    precision, channels_last, compile and its decision, the optimizers and whether they are fused."""

    def __init__(self) -> None:
        self.config: dict[str, Any] = {}

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_gpuopt import ChannelsLast, CompileModel, FusedOptimizer
        from lightning_gpuopt.compute.optimizer import is_fused

        cbs = list(trainer.callbacks)  # type: ignore[attr-defined]
        channels = [c for c in cbs if isinstance(c, ChannelsLast)]
        compiles = [c for c in cbs if isinstance(c, CompileModel)]
        decision = compiles[0].decision if compiles else None
        self.config = {
            "precision": str(trainer.precision),
            "channels_last": bool(channels and channels[0].active),
            "compile": bool(compiles and compiles[0].compiled),
            "compile_mode": compiles[0].mode_used if compiles and compiles[0].compiled else None,
            "compile_reason": decision.reason if decision is not None else None,
            "fused_optimizer_callback": any(isinstance(c, FusedOptimizer) for c in cbs),
            "optimizers": [type(getattr(o, "optimizer", o)).__name__ for o in trainer.optimizers],
            # fused kernels: under bf16-mixed a switched optimizer is not marked as unscaling itself
            "fused": [is_fused(o) or bool(getattr(o, "optimizer", o).defaults.get("fused"))
                      for o in trainer.optimizers],
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "callbacks": sorted({type(c).__name__ for c in cbs} - {"StepClock", "PresetReadBack"}),
        }


def preset_variant(
    spec: Spec, args: argparse.Namespace, readback: PresetReadBack, module: ZooModule, data: Any
) -> Any:
    """One fit of the user's module through ``fast_trainer_kwargs`` on the model's long run, stopped after
    the window. The module and its batch (``data``: the input and its targets) are kept across the turns
    (a compiled forward compiles once)."""
    x, ys = data
    length = epoch_batches(spec, args)

    def run() -> Measurement:
        loader = DeviceBatches(x, ys, length=length)
        return measured_fit(module, args.warmup, args.steps, device=args.device, compile=None, settle=True,
                            callbacks=[readback], trainer=dict(spec.run), train_dataloaders=loader)  # fmt: skip

    return run


def epoch_batches(spec: Spec, args: argparse.Namespace) -> int:
    """Batches in an epoch of the model's data set: the length of the loader its long run is judged on."""
    return max(1, spec.epoch_samples // spec.shape(args.quick)[0])


def read_results(path: str | Path) -> dict[str, Any]:
    """The results file at ``path`` (as ``write_results`` writes it), ``{"rows": []}`` where there is none; a
    file that is not one raises ``ValueError`` naming it, before a run that would add to it starts."""
    path = Path(path)
    if not path.is_file():
        return {"rows": []}
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not a results file ({err}); pass another path or remove it") from err
    if not isinstance(doc, dict) or not isinstance(doc.get("rows", []), list):
        raise ValueError(f"{path} is not a results file (no list of rows); pass another path or remove it")
    return doc


# ------------------------------------------------------------------------------------------------- a model
def model_row(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The search, then the ceiling and the preset taking turns: one row of the results."""
    spec = ZOO[name]
    torch._dynamo.reset()  # each model starts with no compiled code from the last one
    batch, size, _ = spec.shape(args.quick)
    print(f"{name}: batch {batch}, {'sequence' if spec.family == 'lm' else 'image'} {size}", flush=True)
    twin = preset_twin(spec.make(args.quick), args.device)
    configs, note = search_configs(spec, args.search, twin, args.device)
    loop, tried = find_ceiling(spec, configs, args)
    row: dict[str, Any] = {
        "name": name,
        "family": spec.family,
        "batch_size": batch,
        "size": size,
        "search": tried,
        "search_note": note,
        "preset_twin": twin.name,
    }
    if loop is None:
        return {**row, "error": "no configuration of the search ran"}
    variants = {"ceiling": lambda: measure_loop(loop.step, loop.device, args.warmup, args.steps, batch)}
    readback = PresetReadBack()
    module = ZooModule(spec, quick=args.quick)
    data = batches(spec, args.quick, args.device)
    if not args.only_ceiling:
        variants["preset"] = preset_variant(spec, args, readback, module, data)
    results = take_turns(variants, args.repeats, on_result=say)
    summary = {r["name"]: r for r in summarize(results, "ceiling")}
    row.update(ceiling_config=loop.config.to_dict(), preset_config=readback.config or None,
               ceiling_grad_scale=loop.scaler.get_scale() if loop.scaler.is_enabled() else None)
    for side in ("ceiling", "preset"):
        r = summary.get(side, {})
        row.update({f"{side}_{key}": r.get(field) for key, field in SIDE_FIELDS.items()})
    del loop, variants
    free()
    if args.advise and row["preset_p50_ms"]:
        row["advisor"] = advise(module, *data, row["preset_p50_ms"], device=args.device,
                                window=3 if args.quick else ADVISE_WINDOW, run=dict(spec.run),
                                length=epoch_batches(spec, args))  # fmt: skip
    return finish_row(row, spec, summary.get("preset", {}), args)


def finish_row(
    row: dict[str, Any], spec: Spec, preset: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    """``ratio`` (preset over ceiling, medians), its turn-by-turn median and worst, the target, the record."""
    ceiling, got = row["ceiling_samples_per_sec"], row["preset_samples_per_sec"]
    ratio = got / ceiling if got and ceiling else None
    row.update(
        ratio=ratio,
        ratio_turns=preset.get("of_ceiling"),
        ratio_worst=preset.get("of_ceiling_worst"),
        target_met=None if ratio is None else ratio >= TARGET,
        repeats=args.repeats,
        samples_per_sec=got,
        ratio_to_ceiling=ratio,
        error=row.get("ceiling_error") or row.get("preset_error"),
    )
    if spec.family == "lm" and ceiling:
        row.update(
            ceiling_tokens_per_sec=ceiling * row["size"], preset_tokens_per_sec=(got or 0) * row["size"]
        )
    if row["name"].startswith("resnet50") and ceiling and not args.quick:
        row["ceiling_of_record"] = ceiling / RESNET50_RECORD  # MLPerf v4.0's 7,950 img/s a GPU
    return row


# ------------------------------------------------------------------------------------------------ the output
def table(rows: list[dict[str, Any]]) -> str:
    """The printed summary: each model's ceiling and preset, medians [range], ratio, configurations."""

    def rate(r: dict[str, Any], side: str) -> str | None:
        v = r.get(f"{side}_samples_per_sec")
        return None if v is None else f"{v:,.0f} [{r[f'{side}_min']:,.0f}-{r[f'{side}_max']:,.0f}]"

    def preset(c: dict[str, Any] | None) -> str | None:
        if not c:
            return None
        parts = [c["precision"], "cl" if c["channels_last"] else "", "compiled" if c["compile"] else "eager",
                 "fused" if all(c["fused"]) else "unfused"]  # fmt: skip
        return " ".join(p for p in parts if p)

    cols = "model|ceiling/s [range]|ceiling config|preset/s [range]|preset config|ratio|worst|p50 ms c/p"
    body = [{"model": r["name"], "ceiling/s [range]": rate(r, "ceiling") or r.get("error"),
             "ceiling config": (r.get("ceiling_config") or {}).get("name"),
             "preset/s [range]": rate(r, "preset"), "preset config": preset(r.get("preset_config")),
             "ratio": r.get("ratio"), "worst": r.get("ratio_worst"), "p50 ms c/p": _pair(r, "p50_ms", 2),
             "spread c/p": _pair(r, "spread", 3)} for r in rows]  # fmt: skip
    return format_table(body, [*cols.split("|"), "spread c/p"])


def _pair(r: dict[str, Any], key: str, digits: int) -> str:
    vals = [r.get(f"{side}_{key}") for side in ("ceiling", "preset")]
    return "/".join("-" if v is None else f"{v:.{digits}f}" for v in vals)


def advise_rows(args: argparse.Namespace, path: Path) -> int:
    """``--advise-only``: the advisor's scenarios on each of ``--models`` into its row of ``path`` (a new row
    where there is none; the rest kept), the starved loader waiting on the healthy fit's median step."""
    doc = read_results(path)
    rows = {r["name"]: r for r in doc["rows"]}
    for name in args.models:
        spec, row, t0 = ZOO[name], rows.setdefault(name, {"name": name}), time.perf_counter()
        torch._dynamo.reset()
        print(f"{name}: the advisor's scenarios", flush=True)
        data = batches(spec, args.quick, args.device)
        row["advisor"] = advise(ZooModule(spec, quick=args.quick), *data, None, device=args.device,
                                run=dict(spec.run), window=3 if args.quick else ADVISE_WINDOW,
                                length=epoch_batches(spec, args))  # fmt: skip
        row["advisor_run"] = {"command": command_line(), "date": time.strftime("%Y-%m-%d"),
                              "seconds": round(time.perf_counter() - t0, 1), "machine": machine_info()}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**doc, "rows": list(rows.values())}, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return 0 if all(s["pass"] is not False for m in args.models for s in rows[m]["advisor"].values()) else 1


def kept_rows(path: Path, names: list[str]) -> list[dict[str, Any]]:
    """With ``--update``: the rows of models not run now, from the file already at ``path``."""
    return [r for r in read_results(path).get("rows", []) if r.get("name") not in names]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common(p, warmup=50, steps=200)
    p.add_argument("--models", default=",".join(ZOO), help=f"comma-separated: {', '.join(ZOO)}")
    p.add_argument("--search", default="quick",
                   help="quick, full, or comma-separated mode:dtype[:cl][:unfused] configurations")
    p.add_argument("--compile-timeout", type=float, default=600.0,
                   help="seconds a configuration may spend compiling (its first steps); 0: no limit")
    p.add_argument("--search-steps", type=int, default=100, help="steps of a configuration's search window")
    p.add_argument("--only-ceiling", action="store_true", help="the search and the ceiling; no preset fit")
    p.add_argument("--update", action="store_true", help="keep the --out file's rows of models not run now")
    p.add_argument("--advise", action="store_true",
                   help="after the turns: the monitor, NVTX ranges and the advisor on a healthy, a starved and an fp32 fit")
    p.add_argument("--advise-only", action="store_true", help="--advise's scenarios alone, into --out's rows")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    if unknown := sorted(set(args.models) - set(ZOO)):
        p.error(f"--models: unknown {unknown}; choose from {', '.join(ZOO)}")
    if args.search not in ("quick", "full"):
        try:
            [Config.parse(n) for n in args.search.split(",") if n]
        except ValueError as err:
            p.error(str(err))
    args.device = device_of(args)
    if args.quick:
        args.warmup, args.steps, args.search_steps, args.repeats = 2, 4, 4, min(args.repeats, 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    if args.device == "cuda":
        torch.backends.cudnn.benchmark = True  # as the preset's Trainer(benchmark=True)
        torch.set_float32_matmul_precision("high")  # TF32, as the preset sets it
    # every configuration of the search compiles the model's forward again, a new module each time
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    rows: list[dict[str, Any]] = []
    path = results_path(args.out, "models", args.quick)
    if args.advise_only:
        return advise_rows(args, path)
    kept = kept_rows(path, args.models) if args.update else []

    def write(done: bool) -> None:
        ratios = [r["ratio"] for r in kept + rows if r.get("ratio") is not None]
        write_results(path, kept + rows, quick=args.quick, settings={**vars(args), "models": args.models},
                      target=TARGET, min_ratio=min(ratios, default=None),
                      median_ratio=statistics.median(ratios) if ratios else None,
                      seconds=time.perf_counter() - t0, complete=done, models_left=args.models[len(rows):])  # fmt: skip

    with torch._dynamo.config.patch(**{limit: 64}):
        for name in args.models:
            rows.append(model_row(name, args))
            free()
            write(done=len(rows) == len(args.models))  # a run stopped by a time limit keeps its models
    print(table(kept + rows))
    print(f"wrote {path}")
    return 0 if all(r.get("error") is None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
