"""What a killed or stopped run leaves behind: DataLoader workers, their temporary files, the skip folder."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from lightning_gpuopt.data._lifetime import die_with_parent
from lightning_gpuopt.data.loader import HostDataLoader, close_workers
from tests._lightning import quiet_trainer

REPO = Path(__file__).resolve().parents[2]
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
#: seconds a dead parent's DataLoader workers may take to end: PyTorch's workers check their parent every 5 s
ORPHAN_GRACE_S = 10.0


@pytest.fixture
def short_tmp():
    """A ``TMPDIR`` short enough that a worker's socket fits inside its loader's folder (AF_UNIX paths are
    short; pytest's own ``tmp_path`` is too long for that)."""
    path = Path(tempfile.mkdtemp(prefix="lt-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _child(script: str, *args: str, tmpdir: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmpdir)}
    return subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True, cwd=REPO, env=env
    )


def _lines_until(proc: subprocess.Popen, prefix: str) -> str:
    for line in proc.stdout:
        if line.startswith(prefix):
            return line[len(prefix) :].strip()
    raise AssertionError(f"the child ended before printing {prefix!r} (exit code {proc.wait()})")


@linux_only
def test_a_worker_whose_parent_already_died_exits():
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        die_with_parent(expected_ppid=1 if os.getppid() != 1 else 2)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 1


@linux_only
def test_a_worker_made_as_its_parent_died_removes_the_folder_and_exits(tmp_path):
    from lightning_gpuopt.data._lifetime import InWorkerFolder

    folder = tmp_path / "gpuopt-orphan"
    folder.mkdir()  # a sibling made it before the parent died
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:  # the parent named is not this one's: it died while making this worker
            InWorkerFolder(str(folder), parent=os.getppid() + 1)(0)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 1
    assert not folder.exists()


_PARENT_OF_A_SET_UP_WORKER = """
import os, sys, time
from lightning_gpuopt.data._lifetime import InWorkerFolder
child = os.fork()
if child == 0:  # a worker whose worker_init_fn ran, then waits as PyTorch's watchdog does with pid 1
    InWorkerFolder(sys.argv[1], parent=os.getppid())(0)
    time.sleep(60)
    os._exit(0)
while not os.path.isdir(sys.argv[1]):
    time.sleep(0.01)
print("child", child, flush=True)
time.sleep(60)
"""


@linux_only
def test_a_set_up_worker_whose_parent_dies_removes_the_folder_and_exits(short_tmp):
    folder = short_tmp / "gpuopt-set-up"
    proc = _child(_PARENT_OF_A_SET_UP_WORKER, str(folder), tmpdir=short_tmp)
    child = int(_lines_until(proc, "child "))
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert _gone_within([child], 5.0) == [], "the worker outlived its parent"
        assert not folder.exists()
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


@linux_only
def test_forkserver_workers_whose_parent_is_the_server_run():
    loader = HostDataLoader(range(8), batch_size=2, num_workers=2, multiprocessing_context="forkserver")
    assert sorted(int(x) for b in loader for x in b) == list(range(8))


def test_a_loaders_own_worker_init_fn_runs_in_each_worker_and_stays_its_own():
    def init(worker_id: int) -> None:
        torch.manual_seed(1000 + worker_id)

    loader = HostDataLoader(
        _SeedProbe(), batch_size=1, num_workers=2, worker_init_fn=init, collate_fn=lambda b: b[0]
    )
    assert sorted(loader) == [1000, 1000, 1001, 1001]
    assert loader.worker_init_fn is init  # not wrapped: Lightning and the user see their own


def _worker_folders() -> list[str]:
    import tempfile

    return sorted(p.name for p in Path(tempfile.gettempdir()).glob("gpuopt-*"))


def test_the_workers_temporary_folder_goes_with_them(tmp_path):
    before = _worker_folders()
    loader = HostDataLoader(range(8), batch_size=2, num_workers=1, persistent_workers=True)
    list(loader)
    assert len(_worker_folders()) == len(before) + 1  # made when the workers started
    close_workers(loader)
    assert _worker_folders() == before
    per_epoch = HostDataLoader(range(8), batch_size=2, num_workers=1)  # workers end with each epoch
    for _ in range(2):
        list(per_epoch)
    assert _worker_folders() == before


def test_a_worker_takes_only_a_folder_of_this_user(tmp_path):
    from lightning_gpuopt.data._lifetime import _own_folder

    made = tmp_path / "gpuopt-made"
    assert _own_folder(str(made)) and made.is_dir()  # the first worker makes it
    assert _own_folder(str(made))  # a sibling takes it
    (tmp_path / "gpuopt-link").symlink_to(made)
    assert not _own_folder(str(tmp_path / "gpuopt-link"))  # a link someone put there is not taken


class _TempDirProbe(torch.utils.data.Dataset):
    """Writes the temporary folder each worker sees into ``log`` (a file a worker)."""

    def __init__(self, log: Path) -> None:
        self.log = log

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> torch.Tensor:
        (self.log / str(os.getpid())).write_text(tempfile.gettempdir())
        return torch.zeros(2)


def test_worker_tuning_gives_its_workers_a_folder_that_goes_with_them(tmp_path):
    from lightning_gpuopt.data.tuning import tune_num_workers

    ds = _TempDirProbe(tmp_path)
    tune_num_workers(
        lambda n: torch.utils.data.DataLoader(ds, batch_size=2, num_workers=n),
        candidates=[1],
        budget_s=2.0,
        cache=False,
    )
    seen = {p.read_text() for p in tmp_path.iterdir()}
    assert len(seen) == 1 and Path(next(iter(seen))).name.startswith("gpuopt-")
    assert not Path(next(iter(seen))).exists()


class _SeedProbe(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return int(torch.initial_seed())


_KILLED_WITH_WORKERS = """
import os, sys, time
from lightning_gpuopt.data.loader import HostDataLoader

class Slow:
    def __len__(self):
        return 10_000
    def __getitem__(self, i):
        time.sleep(0.01)
        return os.getpid()

loader = HostDataLoader(Slow(), batch_size=1, num_workers=2, persistent_workers=True)
it = iter(loader)
pids = {int(next(it)[0]) for _ in range(20)}
print("workers", *sorted(pids), flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("tmp", ["short", "long"])
def test_workers_of_a_killed_parent_end_and_leave_no_temporary_folder(short_tmp, tmp):
    """PyTorch's workers notice their parent's death within 5 s and exit through Python, so
    ``multiprocessing`` removes their ``pymp-*`` folders and the last one removes the loader's folder.

    What is asserted is what a user sees (no process, nothing in ``TMPDIR``), not how it is done. Under a
    long ``TMPDIR`` the workers keep ``multiprocessing``'s own folders (their sockets would not fit in a
    folder of the loader's) and still hand batches over.
    """
    tmp_path = short_tmp if tmp == "short" else short_tmp / ("x" * 40)  # 57 characters or so
    tmp_path.mkdir(exist_ok=True)
    proc = _child(_KILLED_WITH_WORKERS, tmpdir=tmp_path)
    workers = [int(p) for p in _lines_until(proc, "workers ").split()]
    assert len(workers) == 2
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _gone_within(workers, ORPHAN_GRACE_S) == [], "DataLoader workers outlived their killed parent"
    deadline = time.monotonic() + 3.0
    while any(tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p.name for p in tmp_path.iterdir()]
    assert left == [], f"the workers of a killed parent left {left}"


_TERMINATED_WORKER = """
import time, torch
from lightning_gpuopt.data.loader import HostDataLoader, close_workers

class SlowSecondBatch(torch.utils.data.Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        if i >= 4:
            time.sleep(60)  # longer than PyTorch's 5 s shutdown wait: the worker is terminated
        return torch.zeros(4)  # in shared memory: handing it over makes the worker's pymp-* folder

loader = HostDataLoader(SlowSecondBatch(), batch_size=4, num_workers=1, persistent_workers=True)
next(iter(loader))
close_workers(loader)
print("closed", flush=True)
"""


@pytest.mark.slow
def test_a_worker_terminated_at_shutdown_leaves_no_temporary_folder(short_tmp):
    """A worker still reading a batch 5 s after it was told to stop is terminated by PyTorch and leaves its
    ``pymp-*`` folder behind (PyTorch's SIGTERM handler ends it without Python's exit handlers): the
    platform leaks here, which is why a ``HostDataLoader``'s workers keep their temporary files in a folder
    of the loader's that goes with them (docs/reliability.md)."""
    proc = _child(_TERMINATED_WORKER, tmpdir=short_tmp)
    _lines_until(proc, "closed")
    assert proc.wait(timeout=60) == 0
    left = [p.name for p in short_tmp.iterdir()]
    assert left == [], f"the terminated worker left {left}"


_KILLED_AFTER_SETUP = """
import sys, time
from lightning_gpuopt.data.datamodule import OptimizedDataModule

dm = OptimizedDataModule(sys.argv[1], batch_size=4, num_workers=0, image_size=8, on_corrupt="skip")
dm.setup("fit")
print("skip_dir", dm._skip_dir, flush=True)
time.sleep(60)
"""


@linux_only
def test_the_skip_folder_is_removed_after_a_sigkill(jpeg_folder, tmp_path):
    proc = _child(_KILLED_AFTER_SETUP, str(jpeg_folder), tmpdir=tmp_path)
    skip_dir = Path(_lines_until(proc, "skip_dir "))
    assert skip_dir.parent == tmp_path and skip_dir.is_dir()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and list(tmp_path.iterdir()):
        time.sleep(0.05)
    assert list(tmp_path.iterdir()) == [], "the skip folder outlived the killed process"


_OWNER_WITH_A_FORKED_CHILD = """
import os, sys, time
from lightning_gpuopt.data._lifetime import Janitor
Janitor(sys.argv[1])
os.mkdir(sys.argv[1])
child = os.fork()
if child == 0:  # holds the janitor's pipe, as a DataLoader worker forked by the owner does
    time.sleep(60)
    os._exit(0)
print("child", child, flush=True)
time.sleep(60)
"""


@linux_only
def test_a_janitor_removes_its_path_when_the_owner_dies_while_a_forked_child_holds_the_pipe(tmp_path):
    path = tmp_path / "skipped"
    proc = _child(_OWNER_WITH_A_FORKED_CHILD, str(path), tmpdir=tmp_path)
    child = int(_lines_until(proc, "child "))
    try:
        assert path.is_dir()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and path.exists():
            time.sleep(0.05)
        assert _alive(child), "the forked child was to hold the pipe throughout"
        assert not path.exists(), "the path outlived its owner while a forked child held the pipe"
    finally:
        os.kill(child, signal.SIGKILL)


def test_the_skip_folder_janitor_leaves_with_teardown(jpeg_folder):
    from lightning_gpuopt.data.datamodule import OptimizedDataModule

    dm = OptimizedDataModule(jpeg_folder, batch_size=4, num_workers=0, image_size=8, on_corrupt="skip")
    dm.setup("fit")
    janitor = dm._skip_janitor.proc
    skip_dir = dm._skip_dir
    assert janitor.poll() is None and os.path.isdir(skip_dir)
    dm.teardown("fit")
    assert janitor.poll() is not None and not os.path.exists(skip_dir) and dm._skip_janitor is None


def test_teardown_stops_every_loaders_persistent_workers(jpeg_folder, monkeypatch):
    from lightning.fabric.utilities.seed import pl_worker_init_function

    from lightning_gpuopt import OptimizedDataModule
    from lightning_gpuopt.bench.models import ImageClassifier

    class PerImage(OptimizedDataModule):  # per-image datasets read by worker processes
        def _default_dataset(self, split):
            folder = super()._default_dataset(split)
            return None if folder is None else torch.utils.data.Subset(folder, range(len(folder)))

    monkeypatch.setenv("PL_SEED_WORKERS", "1")  # seed_everything(workers=True): Lightning seeds the workers
    dm = PerImage(jpeg_folder, jpeg_folder, batch_size=8, num_workers=1, image_size=16)
    trainer = quiet_trainer(accelerator="cpu", max_epochs=1, limit_train_batches=2, limit_val_batches=2)
    trainer.fit(ImageClassifier("small", num_classes=3), datamodule=dm)
    val = trainer.val_dataloaders
    assert isinstance(val, HostDataLoader) and val.persistent_workers
    assert val._iterator is None, "the validation loader's persistent workers still run after fit"
    assert getattr(val.worker_init_fn, "func", None) is pl_worker_init_function


def test_close_workers_stops_a_plain_loaders_workers():
    loader = torch.utils.data.DataLoader(range(8), batch_size=2, num_workers=1, persistent_workers=True)
    list(loader)
    iterator = loader._iterator
    pids = [w.pid for w in iterator._workers]
    close_workers([loader])
    assert loader._iterator is None
    assert _gone_within(pids, 5.0) == []
    close_workers(loader)  # closing again is harmless


def test_teardown_stops_the_workers_of_a_loader_the_users_own_loop_took(jpeg_folder):
    import pickle

    from lightning_gpuopt import OptimizedDataModule

    dm = OptimizedDataModule(jpeg_folder, batch_size=4, num_workers=1, image_size=16, backend="folder")
    dm.setup("fit")
    loader = dm.train_dataloader()  # no Trainer: a loop of the user's own
    next(iter(loader))
    iterator = loader._iterator
    pids = [w.pid for w in iterator._workers]
    assert pids and all(_alive(p) for p in pids)
    assert pickle.loads(pickle.dumps(dm))._handed_out is not dm._handed_out  # a copy tracks its own loaders
    dm.teardown("fit")
    assert loader._iterator is None
    assert _gone_within(pids, 5.0) == []


def test_teardown_closes_a_stores_reading_threads_the_users_own_loop_took(jpeg_folder, tmp_path):
    from lightning_gpuopt import OptimizedDataModule
    from lightning_gpuopt.data.convert import convert_folder_to_hdf5

    store = tmp_path / "train.h5"
    convert_folder_to_hdf5(jpeg_folder, store, storage_size=32)
    dm = OptimizedDataModule(str(store), batch_size=4, image_size=16)
    dm.setup("fit")
    loader = dm.train_dataloader()
    next(iter(loader))
    dm.teardown("fit")  # the store's reads ahead stop: its file and map can go
    assert getattr(loader, "_continuous_iter", None) is None
