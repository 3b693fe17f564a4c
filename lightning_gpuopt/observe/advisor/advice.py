"""The advice text of each verdict: what the figures mean and the change to make, in this package's terms."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_gpuopt.compute.optimizer import FUSED_OPTIMIZERS
from lightning_gpuopt.observe.advisor.evidence import Evidence, RunConfig

_STORE = (
    "Convert the images once with `lightning-gpuopt convert SRC OUT.h5 --format auto` (decoded uint8 where the "
    "store fits in memory, else the compact JPEG store, about a quarter of the source's bytes) and read it "
    'with OptimizedDataModule("OUT.h5")'
)
_HDF5 = _STORE + ', or decode on the GPU with backend="dali".'
_HOST_SYNCS = ".item(), .cpu(), printing tensors, self.log(..., sync_dist=True) every step"
_COMPILE = 'torch.compile(model) fuses kernels and mode="reduce-overhead" replays them as CUDA graphs.'
_NSIGHT = "NVTXRanges with Nsight Systems shows where the host's time goes."
_MOMENTUM = "lightning_gpuopt.compute.optimizer.init_momentum_buffers(optimizer)"


def sync_sentence(ev: Evidence) -> str:
    """The host-sync locator's lines, as one sentence; empty where it did not run or found none."""
    if not ev.sync_sites:
        return ""
    sites = list(ev.sync_sites[:3]) + ([f"{len(ev.sync_sites) - 3} more"] if len(ev.sync_sites) > 3 else [])
    return (
        "; ".join(sites) + ": the host waits there until the GPU has finished all queued work, and the GPU "
        "then idles while Python launches the next kernels. Keep those values on the GPU (log the tensor, "
        "read it on the host every log_every_n_steps)."
    )


def graphs_sentence(cfg: RunConfig) -> str:
    """Where a compiled step's CUDA graphs were skipped, torch's reason and the fix (after a space); else empty."""
    if not cfg.cuda_graphs_skipped:
        return ""
    return (
        f" CUDA graphs were skipped: {cfg.cuda_graphs_skipped}. The compiled step launches its kernels one by one "
        "instead of replaying them: remove what torch names (an input changed in place inside forward, a CPU "
        "tensor created in forward, varying input shapes) and the step replays as CUDA graphs."
    )


def cpu_sentence(ev: Evidence, cfg: RunConfig, full_frac: float) -> str:
    """One sentence on the CPU load from the monitor's host figures; empty when unmeasured."""
    if ev.cpu_busy_frac is None:
        return ""
    cores = f" of {ev.cpu_cores:.0f}" if ev.cpu_cores else ""
    busy = f"{ev.cpu_busy_frac:.0%}{cores} cores busy"
    if cfg.num_workers == 0:
        main = "" if ev.cpu_main_pct is None else f" (its main thread at {ev.cpu_main_pct:.0f}% of a core)"
        return f"The training process builds every batch itself{main}; {busy}. "
    others = ""
    if ev.cpu_workers_pct:
        others = f"; worker processes and other threads use {ev.cpu_workers_pct / 100:.1f} cores"
    state = "full" if ev.cpu_busy_frac >= full_frac else "not full"
    return f"The CPU cores are {state} ({busy}{others}). "


def _auto_workers(cfg: RunConfig) -> str:
    """What ``num_workers="auto"`` does for this loader's data, in the advice's words."""
    if cfg.backend in ("folder", "hdf5"):  # an image folder or a JPEG store: worker processes decode
        return 'OptimizedDataModule(num_workers="auto") (one worker process a CPU: chosen, not measured)'
    return 'OptimizedDataModule(num_workers="auto") (for a dataset of yours it measures the loader)'


def _workers(cause: str, cfg: RunConfig, cores: int | None, cores_full: bool | None, threads: bool) -> str:
    """Advice of too many, too few or busy decoding workers (or a folder's reading threads)."""
    n, who = (cfg.decode_threads, "reading threads") if threads else (cfg.num_workers, "workers")
    suggest = max(1, (cores or 2) - 1)
    default = "Leave the thread count to its default (one a CPU, chosen, not measured)."
    if cause == "too-many-workers":
        fix = default if threads else f"Use {_auto_workers(cfg)} or at most num_workers={suggest}."
        return (
            f"{n} {who} x {cfg.processes_per_node} process(es) oversubscribe {cfg.cpus} cores, so "
            f"{'the threads' if threads else 'workers'} and the training loop compete. {fix}"
        )
    if cause == "too-few-workers" and threads:
        return (
            f"The folder's {n} reading threads use few of the {cores} cores this process has, and each decodes "
            f"JPEGs. {default} {_HDF5}"
        )
    if cause == "too-few-workers":
        text = (
            f"num_workers={n} uses few of the {cores} cores this process has. Use {_auto_workers(cfg)} or "
            f"DataLoader(num_workers={suggest}, persistent_workers=True)."
        )
        if cfg.backend == "folder":
            text += (
                ' JPEG decoding is what the workers spend their time on: backend="hdf5" (after '
                '`lightning-gpuopt convert`) or backend="dali" removes most of it.'
            )
        return text
    more = f"{_auto_workers(cfg)}, or a larger num_workers"
    more = "the default: one a CPU, chosen, not measured" if threads else more
    idle = (
        f", yet cores are idle: more {who.split()[-1]} can use them ({more})" if cores_full is False else ""
    )
    on = f"on {cores} cores " if cores else ""
    return (
        f"{'The' if n is None else n} {who} {on}cannot decode JPEGs as fast as the GPU trains{idle}. {_HDF5}"
    )


def _dali_bound(cfg: RunConfig, cores_per_process: int | None, threads: str) -> str:
    """Advice of a ``dali-bound`` verdict: the other decoder where it is the remedy, else a store."""
    slow_threads = f"DALI's {threads}CPU threads decode JPEGs more slowly than the GPU trains"
    cpu, gpu = cfg.cpu_decode_rate, cfg.gpu_decode_rate
    if cfg.decoder == "cpu" and cpu is not None and gpu is not None and gpu <= cpu:
        # the loader measured nvJPEG on its own files: no faster than these threads
        return (
            f'{slow_threads} (decoder="cpu", {cores_per_process} cores a process; nvJPEG decoded {gpu:,.0f} img/s '
            f"of these files against the threads' {cpu:,.0f}, measured when the loader was built: slower "
            f"still). {_STORE}: either store fed a compiled ResNet-50 at its ceiling on a 16-core host. More "
            "cores per GPU add decoding threads."
        )
    if cfg.decoder == "cpu":
        return (
            f'{slow_threads} (decoder="cpu"). Decode with nvJPEG (DALIOptions(decoder="gpu")), which the default '
            f"chooses where it decodes the files faster than these threads. {_STORE}."
        )
    return (
        "The DALI pipeline (nvJPEG) does not keep up: give it more CPU threads; with many cores per GPU "
        'decode on them instead (DALIOptions(decoder="cpu")), or store decoded uint8 once (backend="hdf5").'
    )


def _store_bound(ev: Evidence, cfg: RunConfig, threads: str) -> str:
    """Advice of a ``store-bound`` verdict: the disk's rate where it was measured, else the reading threads."""
    if ev.read_mb_s is None:
        return (
            f"The HDF5 store's {threads}reading threads do not deliver batches as fast as the GPU trains. A store "
            "larger than the page cache can hold, or on a network filesystem, is read at the storage's speed: keep "
            "it on a local NVMe disk or in memory (/dev/shm), or read with more threads for more reads in flight "
            "(OptimizedDataModule(..., hdf5=HDF5Options(threads=8)))."
        )
    per = f" ({1000.0 * ev.read_mb_s / ev.samples_per_sec:.0f} kB a sample)" if ev.samples_per_sec else ""
    text = (
        f"The store is read from the disk at {ev.read_mb_s:.0f} MB/s{per}: its pages are not in the page cache "
        "(a store larger than the memory left for it, or evicted), so the disk's rate bounds the loader. "
    )
    if cfg.decoder is None:
        text += (
            "Convert to the compact store, about the size of the source JPEGs (`lightning-gpuopt convert "
            "--format jpeg`), so each image reads fewer bytes; or keep the store on a faster local NVMe disk"
        )
    else:
        text += (
            "The store is already compact (JPEG bytes): keep it on a faster local NVMe disk or in memory "
            "(/dev/shm)"
        )
    return text + ", or give the page cache room for it."


def input_bound(cause: str, ev: Evidence, cfg: RunConfig, cores: int | None, cores_full: bool | None) -> str:
    """Advice of an ``input-bound`` verdict of ``cause``."""
    threads = f"{cfg.decode_threads} " if cfg.decode_threads else ""
    folder_threads = cfg.backend == "folder" and cfg.num_workers is None and cfg.decode_threads is not None
    if cause in ("too-many-workers", "too-few-workers", "decode-bound"):
        text = _workers(cause, cfg, cores, cores_full, folder_threads)
    elif cause == "jpeg-engine":
        text = (
            f"The GPU's JPEG decoder is busy {ev.jpeg_util or 0:.0f}% of the time: that hardware engine (nvJPEG's, "
            "which DALI's GPU decoder uses) is the limit, not the CPU or the SMs. Give it fewer pixels: the compact "
            "store (`lightning-gpuopt convert SRC OUT.h5 --format jpeg`, 256 px on the shorter side); or store "
            'decoded uint8 (`--format raw`); or decode on spare CPU cores (DALIOptions(decoder="cpu")).'
        )
    elif cause == "dali-bound":
        text = _dali_bound(cfg, cores, threads)
    elif cause == "store-bound":
        text = _store_bound(ev, cfg, threads)
    else:
        text = (
            "The loader does not keep up. Profile the dataset's __getitem__; move augmentation to the GPU "
            '(GPUAugment); try OptimizedDataModule(num_workers="auto") and a decoded store (backend="hdf5") or '
            'GPU decoding (backend="dali").'
        )
    if cfg.device_type == "cuda" and cfg.pin_memory is False and cfg.host_batches is not False:
        text += " Part of this wait can be the pageable host-to-GPU copy waiting for the GPU (see pageable-copies)."
    return text


def host_bound(ev: Evidence, cfg: RunConfig, idle: float, wait: float | None, small_batch: bool) -> str:
    """Advice of a ``host-bound`` verdict: the GPU idles between steps although the loader is quick."""
    waited = f", and the loader accounts for only {wait:.0%}" if wait is not None else ""
    text = (
        f"The GPU sits idle {idle:.0%} of the time between steps{waited}: the host is late with the next step, "
        f"not the data. Lightning's hooks and callbacks, per-step host syncs ({_HOST_SYNCS}) and launching "
        "many small kernels all run on the training process's one Python thread."
    )
    if ev.sync_sites:
        text += " " + sync_sentence(ev)
    if ev.cpu_main_pct is not None and ev.cpu_main_pct >= 90:
        text += f" That thread keeps a core busy ({ev.cpu_main_pct:.0f}%): Python overhead is the limit."
    if cfg.grad_scaler and cfg.unfused_optimizers:
        text += " The GradScaler's found_inf check is one such sync (see amp-host-sync)."
    text += graphs_sentence(cfg)
    text += " Remove per-step syncs; log less often (log_every_n_steps)"
    if small_batch and cfg.batch_size:
        text += f"; grow the batch (batch_size={cfg.batch_size}) so each launch does more work"
    return f"{text}. {'' if cfg.cuda_graphs_skipped else _COMPILE + ' '}{_NSIGHT}"


def launch_bound(ev: Evidence, cfg: RunConfig, util: float) -> str:
    """Advice of a ``launch-bound`` verdict: the locator's lines first where it found them."""
    grow = f"grow the batch (batch_size={cfg.batch_size})" if cfg.batch_size else "grow the batch"
    graphs = graphs_sentence(cfg)
    if ev.sync_sites:
        inside = (
            f" ({ev.step_idle_frac:.0%} of its time inside steps)" if ev.step_idle_frac is not None else ""
        )
        text = f"{sync_sentence(ev)} The GPU waits on the host{inside}: GPU-Util {util:.0f}%.{graphs} Then "
        return text + f"{grow} so each kernel does more work" + ("." if graphs else f"; {_COMPILE}")
    sm = f", SM activity {ev.sm_active:.0f}%" if ev.sm_active is not None else ""
    step = f" at {ev.step_ms:.1f} ms a step" if ev.step_ms is not None else ""
    text = (
        f"GPU-Util {util:.0f}%{sm}{step} without waiting for data: the GPU runs short kernels and idles while "
        f"Python launches the next ones (or while the host synchronizes).{graphs} {grow[0].upper()}{grow[1:]} "
        f"so each kernel does more work; remove per-step host syncs ({_HOST_SYNCS})"
    )
    return text + ("." if graphs else f"; {_COMPILE}")


def amp_host_sync(
    names: Sequence[str], precision: str | None, clip: float | None, cap: tuple[int, int] | None
) -> str:
    """Advice of an ``amp-host-sync`` verdict for the unfused optimizers ``names``."""
    listed = ", ".join(names)
    head = (
        f"The optimizer{'s' if len(names) > 1 else ''} {listed} cannot skip an inf/NaN step on the device, so "
        f"under {precision or 'fp16 mixed precision'} GradScaler.step reads found_inf with .item(): the host "
        "waits for the GPU every step, and the GPU idles through what the host does next."
    )
    if clip is not None:
        bf16 = 'use Trainer(precision="bf16-mixed") instead: no GradScaler, no sync, and clipping works'
        if cap is None:
            bf16 = f"On compute capability >= 8.0 {bf16}"
        elif cap >= (8, 0):
            bf16 = f"Compute capability {cap[0]}.{cap[1]} has bf16 tensor cores: {bf16}"
        else:
            bf16 = f"bf16 is not fast on compute capability {cap[0]}.{cap[1]} (bf16-mixed needs >= 8.0), so "
            bf16 += "choose between clipping and the sync"
        return (
            f"{head} The fused optimizers that avoid it are not an option as configured: with "
            f"gradient_clip_val={clip:g}, Lightning refuses gradient clipping under 16-mixed for optimizers "
            f"that unscale inside their step (it raises RuntimeError). {bf16}; or drop gradient_clip_val and "
            "add FusedOptimizer() to the Trainer's callbacks (it also zeroes a fused SGD's momentum buffers "
            "before its first step); or accept the sync."
        )
    fusable = [n for n in names if n in FUSED_OPTIMIZERS]
    others = ", ".join(n for n in names if n not in FUSED_OPTIMIZERS)
    example = fusable[0] if fusable else "SGD"
    momentum = ", momentum=0.9" if example == "SGD" else ""
    line = f"`torch.optim.{example}(self.parameters(), lr=lr{momentum}, fused=True)`"
    how = "in configure_optimizers: the GradScaler then skips an inf/NaN step on the device."
    if not fusable:
        return (
            f"{head} {listed} has no fused step: switch to one that has ({', '.join(FUSED_OPTIMIZERS)}) with "
            f'fused=True, e.g. {line} {how} Or train in precision="bf16-mixed" on compute capability >= 8.0 '
            "(no GradScaler)."
        )
    text = (
        f"{head} Construct the optimizer with fused=True ({', '.join(FUSED_OPTIMIZERS)} have it on CUDA), "
        f"e.g. {line} {how} Where you do not construct it yourself, add FusedOptimizer() to the Trainer's "
        "callbacks (fast_trainer_kwargs adds it under 16-mixed): it switches them in place."
    )
    if others:
        text += f" {others} has no fused step: switch it to one of those too."
    if "SGD" in fusable:
        text += (
            " A fused SGD with momentum needs its momentum buffers made before its first step, which fp16 often "
            "skips (torch's are left uninitialized, and the weights turn to NaN): FusedOptimizer() makes them "
            f"zero; by hand, call {_MOMENTUM} before the first step."
        )
    return text


def fp16_overflow(
    start: float, end: float, falls: int, steps: int, low: bool, floor: float, cap: tuple[int, int] | None
) -> str:
    """``fp16-overflow``: what the GradScaler's falls mean; bf16 as the fix (fp32 where bf16 is slow)."""
    text = f"The GradScaler's scale is {end:g} after warm-up."
    if falls:
        text = (
            f"The GradScaler backed off at least {falls} time(s) in {steps} optimizer steps since warm-up, "
            f"its scale falling from {start:g} to {end:g}: each fall is a step whose fp16 gradients held inf "
            "or NaN, which the scaler skipped (the weights did not change)."
        )
    if low:
        text += (
            f" Below {floor:g} the scale no longer lifts small gradients: the model's values overflow fp16 "
            "(largest 65504) without any scaling, and no scale makes them fit."
        )
    fix = (
        'Train with precision="bf16-mixed": bf16 has fp32\'s exponent range, so nothing overflows and no '
        "GradScaler is needed (no step skipped), and on compute capability >= 8.0 (Ampere, Hopper) it trains "
        'about as fast as fp16 for most models: `Trainer(**fast_trainer_kwargs(model, precision="bf16-mixed"))`.'
    )
    if cap is not None and cap < (8, 0):
        fix = (
            f"bf16-mixed is the fix on compute capability >= 8.0, but {cap[0]}.{cap[1]} has no fast bf16: keep "
            'the layers that overflow in fp32 (`with torch.autocast("cuda", enabled=False):` around them, their '
            'inputs cast with .float()), or train in precision="32-true".'
        )
    if low:  # every step skipped: a loss that is inf or NaN in any precision also does this
        fix += (
            " If the loss itself is inf or NaN (log it, or run a few steps in bf16 or fp32), the model has "
            "diverged and no precision fixes it: a learning rate too high for the batch (warm it up), or bad "
            "inputs; or, with a fused SGD with momentum whose first step the scaler skipped, torch's "
            f"uninitialized momentum buffers (FusedOptimizer() zeroes them before the first step, as {_MOMENTUM} "
            "does by hand)."
        )
    return f"{text} {fix}"
