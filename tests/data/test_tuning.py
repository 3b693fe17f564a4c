import json
import multiprocessing
import re
import time
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from lightning_gpuopt.data import tuning as tuning_mod
from lightning_gpuopt.data.loader import PREFETCH_FACTOR
from lightning_gpuopt.data.tuning import (
    TuningConfig,
    WorkerTuner,
    default_cache_path,
    default_candidates,
    tune_num_workers,
)
from tests._lightning import quiet_trainer


class _Clock:
    """The tuner's clock (``time`` of ``tuning``), moved only by the fake loaders:
    what the tuner measures is their nominal rate, on a loaded machine too."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = _Clock()
    monkeypatch.setattr(tuning_mod, "time", fake)
    return fake


class _PacedLoader:
    """An iterable of batches delivered at a fixed rate (batches/s) on ``clock``: a loader with known
    throughput."""

    def __init__(self, clock: _Clock, rate: float, batch: int = 4, startup_s: float = 0.0) -> None:
        self.clock, self.rate, self.batch, self.startup_s = clock, rate, batch, startup_s

    def __iter__(self):
        self.clock.sleep(self.startup_s)
        while True:
            self.clock.sleep(1.0 / self.rate)
            yield torch.zeros(self.batch, 1)


def _factory(clock: _Clock, rates: dict[int, float], calls: list[int] | None = None):
    def make(n: int):
        if calls is not None:
            calls.append(n)
        return _PacedLoader(clock, rates[n])

    return make


def test_default_candidates():
    assert default_candidates(1) == [1]
    assert default_candidates(2) == [1, 2]
    assert default_candidates(16) == [1, 2, 4, 6, 8, 12, 16]
    assert default_candidates(10) == [1, 2, 4, 6, 8, 10]


def test_smallest_within_tolerance_of_best(clock):
    rates = {1: 15.0, 2: 60.0, 4: 62.0, 8: 40.0}
    res = tune_num_workers(_factory(clock, rates), candidates=[8, 1, 4, 2], budget_s=3.0, cache=False)
    assert [r["num_workers"] for r in res.table] == [1, 2, 4, 8]  # ascending
    measured = {r["num_workers"]: r["samples_per_sec"] / 4 for r in res.table}
    for n, rate in rates.items():
        assert measured[n] == pytest.approx(rate, rel=1e-6)
    assert res.best == 2  # 4 is the fastest, but 2 is within 5% of it
    assert res.seconds <= 3.0


def test_zero_workers_is_measured_and_chosen_when_fastest(clock):
    """0 (reading in the loop) is a count like any other: measured first and chosen when it is the fastest."""
    rates = {0: 60.0, 1: 20.0, 2: 15.0}
    res = tune_num_workers(_factory(clock, rates), candidates=[2, 0, 1], budget_s=3.0, cache=False)
    assert [r["num_workers"] for r in res.table] == [0, 1, 2]
    assert res.best == 0 and res.how().startswith("measured over 0, 1, 2 in ")


def test_stops_when_throughput_stops_improving(clock):
    calls: list[int] = []
    rates = {1: 40.0, 2: 41.0, 4: 40.0, 8: 40.0, 16: 40.0}
    res = tune_num_workers(_factory(clock, rates, calls), candidates=list(rates), budget_s=2.5, cache=False)
    assert res.stop_reason == "no improvement"
    assert [r["num_workers"] for r in res.table] == [1, 2, 4]
    assert res.best == 1


def test_stops_at_target_with_headroom(clock):
    rates = {1: 20.0, 2: 40.0, 4: 80.0, 8: 160.0}  # batches of 4: 80, 160, 320, 640 samples/s
    res = tune_num_workers(
        _factory(clock, rates),
        candidates=list(rates),
        budget_s=2.0,
        target_samples_per_sec=120.0,
        cache=False,
    )
    assert res.stop_reason == "target reached"
    # the default headroom asks for 2 x 120 = 240 samples/s measured alone: 4 workers (320), not 2 (160)
    assert res.best == 4
    assert [r["num_workers"] for r in res.table] == [1, 2, 4]


def test_headroom_one_stops_at_the_bare_target(clock):
    rates = {1: 20.0, 2: 40.0, 4: 80.0, 8: 160.0}
    res = tune_num_workers(
        _factory(clock, rates),
        candidates=list(rates),
        budget_s=2.0,
        target_samples_per_sec=120.0,
        cache=False,
        headroom=1.0,
    )
    assert res.stop_reason == "target reached"
    assert res.best == 2  # 160 samples/s >= 120
    assert [r["num_workers"] for r in res.table] == [1, 2]


def test_headroom_below_one_is_refused(clock):
    with pytest.raises(ValueError, match="headroom"):
        tune_num_workers(_factory(clock, {1: 10.0}), candidates=[1], budget_s=1.0, cache=False, headroom=0.5)


def test_slow_startup_stays_in_budget(clock):
    def make(n):
        return _PacedLoader(clock, 5.0, startup_s=0.4)

    t0 = clock.now
    res = tune_num_workers(make, candidates=[1, 2, 3], budget_s=1.5, cache=False)
    # the last count started inside the budget may overrun it by its start-up and first batch
    assert clock.now - t0 == res.seconds <= 1.5 + 0.4 + 0.2
    assert res.best in (1, 2, 3) and all(r["samples_per_sec"] > 0 for r in res.table)


class _CostlyDataset(Dataset):
    """Each item costs ``cost_s`` of CPU-free waiting (so worker processes overlap, even on 2 cores)."""

    def __init__(self, n: int = 64, cost_s: float = 0.004) -> None:
        self.n, self.cost_s = n, cost_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.cost_s)
        return torch.zeros(2), i


def test_real_dataloader_and_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_GPUOPT_CACHE_DIR", str(tmp_path / "cache"))
    ds = _CostlyDataset()
    res = tune_num_workers(ds, candidates=[1, 2], budget_s=4.0, batch_size=8)
    assert not res.cached and len(res.table) == 2
    one, two = (r["samples_per_sec"] for r in res.table)
    assert two > 1.3 * one  # sleeping items overlap across workers
    assert res.best == 2
    data = json.loads((tmp_path / "cache" / "workers.json").read_text())
    assert data[res.key]["best"] == 2
    again = tune_num_workers(ds, candidates=[1, 2], budget_s=4.0, batch_size=8)
    assert again.cached and again.best == 2 and again.seconds == 0.0  # nothing measured
    # another batch size is another key
    other = tune_num_workers(ds, candidates=[1], budget_s=0.5, batch_size=4)
    assert not other.cached and other.key != res.key
    assert "num_workers=2 (cached)" in again.format_table()


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("best", 40, "best=40 is not one of the candidate"),
        ("best", -1, "best=-1 is not one of the candidate"),
        ("best", True, "best=True is not one of the candidate"),
        ("best", "2", "best='2' is not one of the candidate"),
        ("table", [{"num_workers": 2, "samples_per_sec": "fast"}], "a row that is not a measurement"),
    ],
)
def test_an_edited_cache_entry_is_ignored_with_a_warning_and_measured_again(
    tmp_path, clock, field, value, problem
):
    kw = {"candidates": [1, 2], "budget_s": 0.4, "cache_dir": tmp_path}
    first = tune_num_workers(_factory(clock, {1: 40.0, 2: 80.0}), **kw)
    path = tmp_path / "workers.json"
    data = json.loads(path.read_text())
    data[first.key][field] = value
    path.write_text(json.dumps(data))
    pattern = rf"worker-tuning cache {re.escape(str(path))} \(.*{re.escape(problem)}.*measuring again"
    with pytest.warns(UserWarning, match=pattern):
        again = tune_num_workers(_factory(clock, {1: 40.0, 2: 80.0}), **kw)
    assert not again.cached and again.best in (1, 2) and again.table
    assert json.loads(path.read_text())[first.key]["best"] == again.best  # the entry is written again
    assert tune_num_workers(_factory(clock, {1: 40.0, 2: 80.0}), **kw).cached


def test_cache_writes_from_many_processes_at_once_lose_no_entry_and_leave_only_the_cache(tmp_path):
    """Six processes writing at once (as six `tune` runs on six folders): every entry is kept, and the
    folder holds the cache file alone (no lock file, no temporary file)."""
    from tests.data._cache_writers import write_entries

    ctx = multiprocessing.get_context("spawn")
    path = tmp_path / "cache" / "workers.json"
    start = ctx.Event()
    procs = [ctx.Process(target=write_entries, args=(path, w, 20, start)) for w in range(6)]
    for proc in procs:
        proc.start()
    start.set()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    assert sorted(json.loads(path.read_text())) == sorted(f"w{w}-{i}" for w in range(6) for i in range(20))
    assert [p.name for p in path.parent.iterdir()] == ["workers.json"]


def test_a_cache_that_is_not_an_object_of_entries_is_ignored_with_a_warning(tmp_path, clock):
    kw = {"candidates": [1, 2], "budget_s": 0.4, "cache_dir": tmp_path}
    path = tmp_path / "workers.json"
    path.write_text("[40]")
    pattern = (
        rf"worker-tuning cache {re.escape(str(path))} \(it holds a JSON list, not an object of entries\)"
    )
    with pytest.warns(UserWarning, match=pattern):
        result = tune_num_workers(_factory(clock, {1: 40.0, 2: 80.0}), **kw)
    assert not result.cached and isinstance(json.loads(path.read_text()), dict)
    path.write_text("")  # created by a writer that has yet to replace it: no entries, no warning
    assert tune_num_workers(_factory(clock, {1: 40.0, 2: 80.0}), **kw).cached is False


def test_argument_errors():
    with pytest.raises(ValueError, match="budget_s"):
        tune_num_workers(_CostlyDataset(), budget_s=0)
    with pytest.raises(ValueError, match="tolerance"):
        tune_num_workers(_CostlyDataset(), tolerance=1.5)
    with pytest.raises(ValueError, match="candidates"):
        tune_num_workers(_CostlyDataset(), candidates=[-1])
    with pytest.raises(ValueError, match=r"^budget_s must be a finite number > 0 \(seconds\), got -1"):
        WorkerTuner(budget_s=-1)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"apply": "no"}, TypeError),
        ({"cache": "false"}, TypeError),
        ({"budget_s": float("inf")}, ValueError),
        ({"tolerance": "0.05"}, TypeError),
        ({"candidates": [1.5, 2]}, ValueError),
        ({"candidates": [True]}, ValueError),
        ({"candidates": "12"}, ValueError),
        ({"candidates": 4}, TypeError),
        ({"candidates": []}, ValueError),
        ({"target_samples_per_sec": -1}, ValueError),
        ({"cache_dir": 3}, TypeError),
    ],
)
def test_worker_tuner_checks_every_argument(kwargs, error):
    (name,) = kwargs
    with pytest.raises(error, match=rf"^{name} must be"):
        WorkerTuner(**kwargs)


def test_tuning_config_checks_its_fields():
    assert TuningConfig() == TuningConfig(budget_s=30.0, target_samples_per_sec=None, cache_dir=None)
    with pytest.raises(ValueError, match=r"^tuning\.budget_s must be a finite number > 0"):
        TuningConfig(budget_s=0)
    with pytest.raises(ValueError, match=r"^tuning\.budget_s must be a finite number > 0"):
        TuningConfig(budget_s=float("inf"))
    with pytest.raises(TypeError, match=r"^tuning\.budget_s must be"):
        TuningConfig(budget_s="30")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^tuning\.target_samples_per_sec must be a finite number > 0"):
        TuningConfig(target_samples_per_sec=-5)
    with pytest.raises(TypeError, match=r"^tuning\.cache_dir must be None or a folder path"):
        TuningConfig(cache_dir=3)
    with pytest.raises(AttributeError):
        TuningConfig().budget_s = 1.0  # frozen: one object can be shared by several DataModules


def test_cache_folder_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_GPUOPT_CACHE_DIR", str(tmp_path / "env"))
    assert default_cache_path() == tmp_path / "env" / "workers.json"
    assert default_cache_path(tmp_path / "given") == tmp_path / "given" / "workers.json"


class _TinyModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)

    def training_step(self, batch, batch_idx):
        x, _ = batch
        return self.layer(x).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_worker_tuner_sets_user_loader(tmp_path):
    loader = DataLoader(_CostlyDataset(n=32, cost_s=0.002), batch_size=8, num_workers=0)
    tuner = WorkerTuner(budget_s=2.0, candidates=[1, 2], cache_dir=tmp_path)
    trainer = quiet_trainer(
        accelerator="cpu",
        max_epochs=1,
        callbacks=[tuner],
    )
    trainer.fit(_TinyModel(), train_dataloaders=loader)
    assert tuner.num_workers in (1, 2)
    assert trainer.train_dataloader.num_workers == tuner.num_workers
    assert trainer.train_dataloader.prefetch_factor == PREFETCH_FACTOR  # as it was measured
    assert len(tuner.results) == 1 and tuner.results[0].table


def test_cli_tune_prints_table_and_suggestion(jpeg_folder, tmp_path, monkeypatch, capsys):
    from lightning_gpuopt.cli import main

    monkeypatch.setenv("LIGHTNING_GPUOPT_CACHE_DIR", str(tmp_path))
    argv = [
        "tune",
        str(jpeg_folder),
        "--batch-size",
        "8",
        "--budget",
        "2",
        "--size",
        "16",
        "--candidates",
        "1,2",
    ]
    assert main([*argv, "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "samples_per_sec" in out
    assert 'suggestion: OptimizedDataModule(..., backend="folder", num_workers=' in out
    assert json.loads((tmp_path / "r.json").read_text())["best"] in (1, 2)
    assert main(["tune", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


# -- num_workers="auto" on a small dataset: cost that scales with the data; tune gives the same answer ------


class _FolderImages(Dataset):
    """A user Dataset over a folder of JPEGs: ``(uint8 HWC image, label)`` decoded by PIL."""

    def __init__(self, root):
        self.root = str(root)
        self.files = sorted(p for p in Path(root).rglob("*.jpg"))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        with Image.open(self.files[i]) as im:
            return np.asarray(im.convert("RGB")), int(self.files[i].parent.name)


@pytest.fixture(scope="module")
def eight_batches(tmp_path_factory):
    """8 batches of 64 images of 64x48 (4 classes of 128 JPEGs)."""
    root = tmp_path_factory.mktemp("eight_batches")
    rng = np.random.default_rng(0)
    for c in range(4):
        (root / str(c)).mkdir()
        for i in range(128):
            Image.fromarray(rng.integers(0, 256, (48, 64, 3), np.uint8)).save(root / str(c) / f"{i}.jpg")
    return root


def _recording(monkeypatch, modules):
    """Record the keyword arguments of every tune_num_workers call made through ``modules``."""
    calls = []
    real = tuning_mod.tune_num_workers

    def recorder(**kwargs):
        calls.append(kwargs)
        return real(**kwargs)

    for module in modules:
        monkeypatch.setattr(module, "tune_num_workers", recorder)
    return calls


def test_auto_on_eight_small_batches_is_quick_and_says_it_measured(eight_batches, tmp_path, monkeypatch):
    """``lightning-gpuopt tune`` reads folders and stores only, whose counts are chosen, not measured: it no
    longer has a path of its own for a dataset of the user's (the DataModule measures those), so the half of
    this test that compared the two is gone; the setup line now says how the count was chosen."""
    from lightning_gpuopt.data import datamodule
    from lightning_gpuopt.data.datamodule import OptimizedDataModule

    monkeypatch.setenv("LIGHTNING_GPUOPT_CACHE_DIR", str(tmp_path / "cache"))
    # no floor of seconds under the epoch share (MIN_BUDGET_S): on a busy machine a count's slot could end
    # before the data does, and what is tested here is that each count ends with the data
    monkeypatch.setattr(tuning_mod, "MIN_BUDGET_S", TuningConfig().budget_s)
    _recording(monkeypatch, [tuning_mod])

    class Data(OptimizedDataModule):
        def train_dataset(self):
            return _FolderImages(eight_batches)

    lines = []
    monkeypatch.setattr(datamodule, "rank_zero_info", lines.append)
    dm = Data(batch_size=64, num_workers="auto", image_size=32)
    t0 = time.perf_counter()
    dm.setup("fit")
    took = time.perf_counter() - t0
    assert not dm.tuning_result.cached and dm.tuning_result.table
    # each count ended with the data (a pass over it, or a steady rate), none ran to the end of its slot
    assert all(row["until"] in ("steady", "one pass") for row in dm.tuning_result.table)
    assert took < 15.0, dm.tuning_result.format_table()  # a hang guard: slots would take the 30 s budget
    assert dm.num_workers == dm.tuning_result.best
    assert any("measuring num_workers=1 (1 of" in line for line in lines)  # progress while it measures
    dm.train_dataloader()
    said = [line for line in lines if line.startswith("OptimizedDataModule: train: ")]
    assert len(said) == 1 and f"num_workers={dm.num_workers} (measured over " in said[0], said


def test_tune_on_an_image_folder_reports_the_datamodules_worker_processes(eight_batches, capsys):
    from lightning_gpuopt.cli import main
    from lightning_gpuopt.data.datamodule import OptimizedDataModule

    dm = OptimizedDataModule(eight_batches, batch_size=64, num_workers="auto", image_size=32, storage_size=48)
    dm.setup("fit")
    t0 = time.perf_counter()
    assert main(["tune", str(eight_batches), "--batch-size", "64", "--size", "48"]) == 0
    out = capsys.readouterr().out
    assert f": {dm.num_workers} worker processes (" in out and "not measured" in out
    assert "(worker processes, a batch each, chosen, not measured)  or  HostDataLoader(WholeBatches(" in out
    assert f'suggestion: OptimizedDataModule(..., backend="folder", num_workers={dm.num_workers})' in out
    assert time.perf_counter() - t0 < 30.0  # a hang guard ("not measured" above says nothing was measured)


def test_measuring_ends_after_one_pass_over_the_data():
    loads = []

    class Counted(_CostlyDataset):
        def __getitem__(self, i):
            loads.append(i)
            return super().__getitem__(i)

    ds = Counted(n=64, cost_s=0.0)
    res = tune_num_workers(ds, candidates=[0], budget_s=20.0, batch_size=8, cache=False)
    assert res.table[0]["until"] in ("steady", "one pass") and res.seconds < 2.0
    assert len(loads) <= 64  # never more than the dataset once


class _Slowing:
    """Batches of 4 on ``clock`` that come ever slower (never a steady rate), over a dataset of ``n``
    samples."""

    def __init__(self, clock: _Clock, n: int) -> None:
        self.clock, self.dataset, self.batch_size = clock, list(range(n)), 4

    def __iter__(self):
        for k in range(10**6):
            self.clock.sleep(0.01 * (1 + 0.2 * k))
            yield torch.zeros(4, 1)


def test_measurement_is_bounded_by_a_share_of_an_epoch(monkeypatch, clock):
    monkeypatch.setattr(tuning_mod, "MIN_BUDGET_S", 0.3)
    # about 100 samples/s: an epoch of 800 samples takes about 8 s, a quarter of it 2 s (budget_s: 30 s)
    t0 = clock.now
    res = tune_num_workers(
        lambda n: _Slowing(clock, 800), candidates=[1, 2, 3, 4], budget_s=30.0, cache=False
    )
    assert clock.now - t0 < 3.5, res.format_table()
    assert {row["until"] for row in res.table} == {"slot"}


def test_a_loader_that_yields_nothing_is_refused():
    with pytest.raises(ValueError, match="yielded no batch, so nothing could be measured"):
        tune_num_workers(lambda n: [], candidates=[0], budget_s=1.0, cache=False)


def test_tune_candidates_on_an_image_folder_measure_whole_batch_workers(eight_batches, tmp_path, capsys):
    import json

    from lightning_gpuopt.cli import main

    out_json = tmp_path / "tune.json"
    argv = ["tune", str(eight_batches), "--candidates", "0,1", "--budget", "3", "--batch-size", "16"]
    assert main([*argv, "--size", "48", "--no-cache", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "measuring worker processes (num_workers) for UInt8ImageFolder" in out
    assert "(worker processes, a batch each, measured)" in out
    table = json.loads(out_json.read_text())["table"]
    assert {row["num_workers"] for row in table} == {0, 1} and all(
        row["samples_per_sec"] > 0 for row in table
    )


@pytest.mark.parametrize(
    "flag", [["--budget", "5"], ["--target", "100"], ["--tolerance", "0"], ["--no-cache"]]
)
def test_tune_refuses_a_measuring_flag_when_nothing_is_measured(eight_batches, flag, capsys):
    """Without --candidates tune reports the count the DataModule chooses for a folder (not measured), so a
    flag that only shapes a measurement is refused with why, not ignored."""
    from lightning_gpuopt.cli import main

    assert main(["tune", str(eight_batches), *flag]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lightning-gpuopt tune: error: {flag[0]} must be given only with --candidates")
    assert "nothing is measured" in err and "add --candidates 0,1,2" in err


def test_tune_refuses_folder_flags_for_a_store(jpeg_folder, tmp_path, capsys):
    """--size and --on-corrupt describe an image folder; given for a store file they are refused."""
    pytest.importorskip("h5py")
    from lightning_gpuopt.cli import main
    from lightning_gpuopt.data.convert import convert_folder_to_hdf5

    store = tmp_path / "s.h5"
    convert_folder_to_hdf5(jpeg_folder, store, 32, workers=1, progress=False)
    for flag in (["--size", "64"], ["--on-corrupt", "skip"]):
        assert main(["tune", str(store), *flag]) == 2
        assert "given only for an image folder" in capsys.readouterr().err
    assert main(["tune", str(store), "--batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert ": 0 worker processes (a raw store has none" in out and "reading threads for" in out
    assert "not measured; HDF5Options(threads=...) sets them" in out
