"""Two nodes on one machine: ``launch_two_nodes`` starts two ``torchrun`` invocations on 127.0.0.1, and this
file, run by them, is each node's training process.

Each node is one ``torchrun --nnodes 2 --nproc-per-node 1 --node-rank N`` with its own cache folder
(``LIGHTNING_GPUOPT_CACHE_DIR``) and its own CPUs (node 1 gets fewer than node 0, as on a cluster whose
nodes differ), so what is resolved per node can be told apart from what is shared. The process runs
``Trainer(accelerator="cpu", strategy="ddp", num_nodes=2, devices=1)`` fits one after another over gloo
(the process group is made once and kept), each with ``GPUStatsMonitor(all_ranks=True)`` and
``BottleneckAdvisor``, and writes what its rank saw to ``<workdir>/rank<R>.json``:

- ``folder``: the JPEG folder, each image read 8 ms slower (an I/O-bound read, so more workers read
  faster on any core count), ``num_workers="auto"`` measured on every node;
- ``folder_again``: the same data in a new DataModule, its worker count read from each node's cache;
- ``hdf5``: the uint8 store, read by threads of the training process;
- ``dali``: DALI's CPU pipeline over the JPEG folder (left out with ``--no-dali``).

Labels are sample ids (one image a class), so the parent can check which samples each rank trained and
validated on (``tests/gpu/_ddp_child.py``'s ``Probe``).

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --node-rank 0 --master-addr 127.0.0.1 \\
        --master-port 29500 tests/_multinode.py --workdir W --train T --val V --train-h5 T.h5 --val-h5 V.h5 \\
        --classes 48 --cpus 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
#: per-image delay of the ``folder`` fits' reads, in seconds
READ_DELAY_S = 0.008
BATCH = 4
IMAGE = 16
#: the folder backend decodes to this shorter side; the store is converted at it too
STORAGE = 18
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
             "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")  # fmt: skip


# --------------------------------------------------------------------------------------------- parent side
def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node_cpus() -> tuple[set[int], set[int]]:
    """CPUs for node 0 (at most two of this process's) and node 1 (one of them)."""
    mine = sorted(os.sched_getaffinity(0))
    return set(mine[:2]), set(mine[:1])


def launch_two_nodes(args: list[str], workdir: Path, timeout_s: float = 150.0) -> list[str]:
    """Run this file as two ``torchrun`` nodes on 127.0.0.1 and return each node's output (node 0 first).

    Each node gets ``<workdir>/node<N>/cache`` as its cache folder and ``--cpus`` from ``node_cpus``. Both
    are killed (with their process groups) when they outlast ``timeout_s``, so a hang fails the test
    instead of blocking it; a node that fails makes the assertion show both outputs.
    """
    port = free_port()
    procs, logs = [], []
    for node, cpus in enumerate(node_cpus()):
        cache = workdir / f"node{node}" / "cache"
        cache.mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
        env.update(
            PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            LIGHTNING_GPUOPT_CACHE_DIR=str(cache),
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
            GLOO_SOCKET_IFNAME="lo",
        )
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "--max-restarts", "0", str(Path(__file__)), "--workdir", str(workdir),
               "--cpus", ",".join(map(str, sorted(cpus))), *args]  # fmt: skip
        log = (workdir / f"node{node}.log").open("w+")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                cmd, env=env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
    deadline = time.monotonic() + timeout_s
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        timed_out = [p for p in procs if p.poll() is None]
        for proc in timed_out:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the torchrun agent and the training process it started
            proc.wait()
        if timed_out:  # a training process (and its loader workers) the agent's end left behind
            _kill_processes_naming(str(workdir))
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    shown = "\n".join(f"--- node {n} (exit {p.returncode}) ---\n{o[-3000:]}" for n, (p, o) in
                      enumerate(zip(procs, outputs, strict=True)))  # fmt: skip
    assert not timed_out, f"the two-node run outlasted {timeout_s:.0f} s\n{shown}"
    assert all(p.returncode == 0 for p in procs), shown
    return outputs


def _kill_processes_naming(text: str) -> None:
    """SIGKILL every process of this machine whose command line contains ``text`` (Linux ``/proc``)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                os.kill(int(entry.name), signal.SIGKILL)


# --------------------------------------------------------------------------------------------- node side
def _slow_folder_module() -> type:
    """An ``OptimizedDataModule`` whose folder reads each take ``READ_DELAY_S`` longer."""
    from torch.utils.data import Dataset

    from lightning_gpuopt import OptimizedDataModule
    from lightning_gpuopt.data.tuning import dataset_fingerprint

    class SlowReads(Dataset):
        def __init__(self, inner: Any) -> None:
            self.inner, self.classes = inner, inner.classes

        def __len__(self) -> int:
            return len(self.inner)

        def __getitem__(self, index: int) -> Any:
            time.sleep(READ_DELAY_S)
            return self.inner[index]

        def fingerprint(self) -> dict[str, Any]:
            return {**dataset_fingerprint(self.inner), "read_delay_s": READ_DELAY_S}

    class SlowFolder(OptimizedDataModule):
        def train_dataset(self) -> Any:
            return SlowReads(super().train_dataset())

    return SlowFolder


def _fit(name: str, dm: Any, classes: int, workdir: Path) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
    from torch import nn

    from lightning_gpuopt import BottleneckAdvisor, GPUStatsMonitor
    from lightning_gpuopt._common import available_cpus
    from tests.gpu._ddp_child import Probe

    monitor = GPUStatsMonitor(all_ranks=True, log_every_n_steps=2)
    advisor = BottleneckAdvisor(warmup_steps=2)
    tiny = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, classes))  # fmt: skip
    model = Probe(model=tiny)
    start = time.perf_counter()
    trainer = pl.Trainer(
        accelerator="cpu", strategy="ddp", num_nodes=2, devices=1, max_epochs=2,
        callbacks=[monitor, advisor], logger=CSVLogger(str(workdir), name=name, version=0),
        log_every_n_steps=2, num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(model, datamodule=dm)
    tuning, feed = dm.tuning_result, getattr(trainer.train_dataloader, "feed_info", None)
    return {
        "seconds": time.perf_counter() - start,
        "rank": trainer.global_rank,
        "node_rank": trainer.node_rank,
        "local_rank": trainer.local_rank,
        "world_size": trainer.world_size,
        "cpus": available_cpus(),
        "records": model.records,
        "num_workers": dm.num_workers,
        "feed": feed.to_dict() if feed is not None else None,
        "tuning": None
        if tuning is None
        else {"best": tuning.best, "cached": tuning.cached, "key": tuning.key},
        "monitor": [{k: v for k, v in w.items() if k == "step" or "/rank" in k} for w in monitor.history],
        "advisor": {
            "windows": advisor.windows,
            "verdicts": [v.kind for v in advisor.verdicts],
            "ranks": [h["evidence"].get("ranks") for h in advisor.history],
            "processes_per_node": advisor.config.processes_per_node if advisor.config else None,
            "world_size": advisor.config.world_size if advisor.config else None,
        },
    }


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("--workdir", "--train", "--val", "--train-h5", "--val-h5", "--cpus"):
        p.add_argument(name, required=True)
    p.add_argument("--classes", type=int, required=True)
    p.add_argument("--no-dali", action="store_true")
    args = p.parse_args()
    # this node's cores, before anything starts a thread: DataLoader workers and DALI's threads inherit them
    os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    import torch

    from lightning_gpuopt import OptimizedDataModule, TuningConfig

    torch.set_num_threads(1)
    out = Path(args.workdir)
    common = {"batch_size": BATCH, "image_size": IMAGE, "storage_size": STORAGE, "num_workers": "auto"}
    slow = _slow_folder_module()
    fits: list[tuple[str, Any]] = [
        ("folder", lambda: slow(args.train, args.val, tuning=TuningConfig(budget_s=2.0), **common)),
        ("folder_again", lambda: slow(args.train, args.val, tuning=TuningConfig(budget_s=2.0), **common)),
        ("hdf5", lambda: OptimizedDataModule(args.train_h5, args.val_h5, **common)),
    ]
    if not args.no_dali:
        fits.append(("dali", lambda: OptimizedDataModule(args.train, args.val, backend="dali", **common)))
    result: dict[str, Any] = {}
    for name, make in fits:
        torch.manual_seed(0)
        result[name] = _fit(name, make(), args.classes, out)
    rank = result[fits[0][0]]["rank"]
    (out / f"rank{rank}.json").write_text(json.dumps(result, default=str))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
