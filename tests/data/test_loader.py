import time

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from lightning_gpuopt._common import FETCH_SECONDS_ATTR, FeedInfo
from lightning_gpuopt.data.loader import (
    CLOSE_WAIT_S,
    ContinuousDataLoader,
    HostDataLoader,
    UInt8Collate,
    close_workers,
)
from tests._lightning import quiet_trainer


def _epochs(loader, n):
    return [torch.cat([b[0] for b in loader]).tolist() for _ in range(n)]


@pytest.mark.parametrize("workers", [0, 2])
def test_each_epoch_is_one_pass_over_the_sampler(workers):
    ds = TensorDataset(torch.arange(50))
    loader = ContinuousDataLoader(
        ds, batch_size=8, shuffle=True, drop_last=True, num_workers=workers, persistent_workers=workers > 0
    )
    assert len(loader) == 6
    epochs = _epochs(loader, 3)
    for got in epochs:
        assert len(got) == 48 and len(set(got)) == 48  # no sample twice within an epoch
    assert epochs[0] != epochs[1]  # reshuffled every pass


def test_workers_outlive_the_epoch():
    ds = TensorDataset(torch.arange(32))
    loader = ContinuousDataLoader(ds, batch_size=8, num_workers=2, persistent_workers=True)
    first = iter(loader)
    list(first)
    source = loader._continuous_iter
    list(iter(loader))
    assert loader._continuous_iter is source  # one iterator (and one set of workers) for every epoch


def test_distributed_sampler_epochs_follow_passes():
    ds = TensorDataset(torch.arange(40))
    seen = []
    for rank in (0, 1):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3)
        loader = ContinuousDataLoader(ds, batch_size=5, sampler=sampler, drop_last=True)
        seen.append(_epochs(loader, 2))
    # the two ranks split each epoch exactly, and epoch 1 is the sampler's epoch-1 order, not a repeat
    for epoch in range(2):
        assert sorted(seen[0][epoch] + seen[1][epoch]) == list(range(40))
    reference = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=3)
    reference.set_epoch(1)
    assert seen[0][1] == list(reference)


def test_needs_automatic_batching():
    loader = ContinuousDataLoader(TensorDataset(torch.arange(4)), batch_size=None)
    with pytest.raises(TypeError, match="batch_size"):
        iter(loader)


class _Sum(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[0].tolist())
        return (self.w * batch[0].float().mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_lightning_fit_sees_each_sample_once_per_epoch():
    ds = TensorDataset(torch.arange(24))
    model = _Sum()
    trainer = quiet_trainer(
        accelerator="cpu",
        max_epochs=3,
    )
    loader = ContinuousDataLoader(ds, batch_size=4, shuffle=True, num_workers=1, persistent_workers=True)
    trainer.fit(model, train_dataloaders=loader)
    assert isinstance(trainer.train_dataloader, DataLoader)
    flat = [x for batch in model.seen for x in batch]
    for epoch in range(3):
        assert sorted(flat[epoch * 24 : (epoch + 1) * 24]) == list(range(24))


@pytest.mark.gpu
def test_cuda_staging_copies_and_transforms_ahead():
    from lightning_gpuopt.data.loader import StagedBatch

    ds = TensorDataset(torch.arange(64, dtype=torch.float32).view(64, 1), torch.arange(64))
    loader = ContinuousDataLoader(
        ds,
        batch_size=8,
        num_workers=1,
        pin_memory=True,
        persistent_workers=True,
        device_transform=lambda b: (b[0] * 2, b[1]),
    )
    for _ in range(2):
        seen = []
        for batch in loader:
            assert isinstance(batch, StagedBatch)
            x, y = batch
            assert x.is_cuda and y.is_cuda
            torch.testing.assert_close(x.cpu().view(-1), 2 * y.cpu().float())
            seen += y.tolist()
        assert sorted(seen) == list(range(64))


def test_close_stops_the_workers():
    ds = TensorDataset(torch.arange(32))
    loader = ContinuousDataLoader(ds, batch_size=8, num_workers=2, persistent_workers=True)
    next(iter(loader))
    workers = list(loader._continuous_iter._workers)
    assert all(w.is_alive() for w in workers)
    loader.close()
    for w in workers:
        w.join(timeout=10)
    assert not any(w.is_alive() for w in workers)
    assert len(torch.cat([b[0] for b in loader])) == 32  # a new iter() starts afresh


def test_datamodule_teardown_closes_the_training_loader(jpeg_folder):
    from lightning_gpuopt import OptimizedDataModule
    from lightning_gpuopt.bench.models import ImageClassifier

    dm = OptimizedDataModule(jpeg_folder, batch_size=8, num_workers=1, image_size=16)
    trainer = quiet_trainer(
        accelerator="cpu",
        max_steps=2,
    )
    trainer.fit(ImageClassifier("small", num_classes=3), datamodule=dm)
    loader = trainer.train_dataloader
    assert isinstance(loader, ContinuousDataLoader)
    assert loader._continuous_iter is None and loader._iterator is None


def test_staged_batches_survive_lightning_collection_helpers():
    # batch_to_device and precision plugins rebuild collections; the StagedBatch type must survive them
    from lightning.fabric.utilities.apply_func import move_data_to_device
    from lightning_utilities.core.apply_func import apply_to_collection

    from lightning_gpuopt.data.loader import StagedBatch

    batch = StagedBatch((torch.zeros(2, 3, 4, 4), torch.arange(2)))
    moved = move_data_to_device(batch, torch.device("cpu"))
    halved = apply_to_collection(moved, torch.Tensor, lambda t: t.half() if t.is_floating_point() else t)
    assert isinstance(moved, StagedBatch) and isinstance(halved, StagedBatch)
    assert halved[0].dtype == torch.float16


def test_datamodule_passes_staged_batches_through(jpeg_folder):
    from lightning_gpuopt import OptimizedDataModule
    from lightning_gpuopt.data.loader import StagedBatch

    dm = OptimizedDataModule(jpeg_folder, batch_size=4, num_workers=0, image_size=8)
    images = torch.rand(4, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    staged = StagedBatch((images, torch.arange(4)))
    assert (
        dm.on_after_batch_transfer(staged, 0) is staged
    )  # float images: would fail GPUAugment's uint8 check
    with pytest.raises(TypeError, match="uint8"):
        dm.on_after_batch_transfer((images, torch.arange(4)), 0)


def test_collate_fast_path_meta_and_errors():
    collate = UInt8Collate("train_dataset()")
    batch = [(np.full((4, 5, 3), i, np.uint8), i) for i in range(3)]
    x, y, meta = collate(batch)
    assert x.shape == (3, 4, 5, 3) and x.dtype == torch.uint8 and (x[2] == 2).all()
    assert y.tolist() == [0, 1, 2] and y.dtype == torch.int64
    assert meta.dtype == torch.int32 and meta.tolist() == [[4, 5, 0]] * 3  # fixed-size images: all valid
    xt, _, _ = collate([(torch.from_numpy(a), torch.tensor(lab)) for a, lab in batch])
    assert torch.equal(xt, x)
    canvases = [(np.zeros((4, 6, 3), np.uint8), i, np.array([4, 5 - i, i % 2], np.int32)) for i in range(3)]
    assert collate(canvases)[2].tolist() == [[4, 5, 0], [4, 4, 1], [4, 3, 0]]
    with pytest.raises(TypeError, match=r"train_dataset\(\).*float32"):
        collate([(np.zeros((4, 4, 3), np.float32), 0)])
    with pytest.raises(TypeError, match="looks like CHW"):
        collate([(np.zeros((3, 8, 8), np.uint8), 0)])
    with pytest.raises(TypeError, match="fixed size"):
        collate([(np.zeros((4, 4, 3), np.uint8), 0), (np.zeros((5, 4, 3), np.uint8), 1)])
    with pytest.raises(TypeError, match="valid region"):
        collate([(np.zeros((4, 6, 3), np.uint8), 0, np.array([5, 6, 0]))])  # h beyond the canvas
    with pytest.raises(TypeError, match="transposed flag"):
        collate([(np.zeros((4, 6, 3), np.uint8), 0, np.array([4, 6, 2]))])
    with pytest.raises(TypeError, match="mix 2-tuples and 3-tuples"):
        collate([canvases[0], (np.zeros((4, 6, 3), np.uint8), 1)])


class _SlowDataset(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        time.sleep(0.01)
        return torch.tensor(i)


@pytest.mark.parametrize("cls", [HostDataLoader, ContinuousDataLoader])
def test_loaders_count_the_seconds_their_consumer_waits(cls):
    info = FeedInfo(backend="folder", num_workers=0, pin_memory=False, batch_size=4, host_batches=True)
    loader = cls(_SlowDataset(), batch_size=4, feed_info=info)
    assert loader.feed_info is info and getattr(loader, FETCH_SECONDS_ATTR) == 0.0
    t0 = time.perf_counter()
    for _ in range(2):
        assert len(list(loader)) == 4
    wall = time.perf_counter() - t0
    # 2 epochs x 16 samples x 10 ms are spent inside next(), in the consumer's thread (no workers)
    assert 0.3 <= getattr(loader, FETCH_SECONDS_ATTR) <= wall
    start = getattr(loader, FETCH_SECONDS_ATTR)
    next(iter(loader))
    assert getattr(loader, FETCH_SECONDS_ATTR) - start >= 0.035


class _LoadLog(Dataset):
    """Appends ``index`` to a file each time a worker loads it, so the test sees what workers built when."""

    def __init__(self, n: int, log: str) -> None:
        self.n, self.log = n, log

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        with open(self.log, "a") as fh:
            fh.write(f"{index}\n")
        return torch.tensor(index)


def _loads(log) -> list[int]:
    return [int(line) for line in log.read_text().split()] if log.exists() else []


@pytest.mark.parametrize("loader_cls", [ContinuousDataLoader, DataLoader])
def test_next_epoch_is_built_before_this_one_ends(tmp_path, loader_cls):
    log = tmp_path / "loads.txt"
    loader = loader_cls(
        _LoadLog(8, str(log)), batch_size=2, num_workers=2, persistent_workers=True, prefetch_factor=2
    )
    assert len(list(loader)) == 4  # epoch 0 consumed; the next iter() has not been called
    # a per-epoch loader is given a second to show it builds nothing; the continuous one up to 20 s (2 cores)
    deadline = time.monotonic() + (1.0 if loader_cls is DataLoader else 20.0)
    while len(_loads(log)) < 8 + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    ahead = len(_loads(log)) - 8  # samples of epoch 1 loaded before epoch 1 was asked for
    if loader_cls is DataLoader:
        assert ahead == 0  # a per-epoch loader starts building epoch 1 only at the next iter()
    else:
        assert ahead >= 2  # at least epoch 1's first batch was built while nobody asked for it
    assert len(list(loader)) == 4
    close_workers(loader)


class _Reader(Dataset):
    """A ``BatchReader``: sample ``i`` is an image filled with ``i % 251``, label ``i``, meta ``(2, 3, i % 2)``;
    records the threads that read it and can be told to fail."""

    image_shape = (2, 3, 3)

    def __init__(self, n: int, fail_at: int | None = None, delay_s: float = 0.0) -> None:
        self.n, self.fail_at, self.delay_s = n, fail_at, delay_s
        self.threads: set[str] = set()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        raise AssertionError("a threaded loader reads whole batches with read_into")

    def read_into(self, indices, images):
        import threading

        self.threads.add(threading.current_thread().name)
        idx = np.asarray(indices, dtype=np.int64)
        if self.fail_at is not None and self.fail_at in idx:
            raise OSError(f"image {self.fail_at} cannot be read from reader.bin")
        time.sleep(self.delay_s)
        images[...] = (idx % 251).astype(np.uint8).reshape(-1, 1, 1, 1)
        meta = np.stack([np.full_like(idx, 2), np.full_like(idx, 3), idx % 2], axis=1).astype(np.int32)
        return idx * 10, meta


@pytest.mark.parametrize("cls", [HostDataLoader, ContinuousDataLoader])
def test_read_threads_read_whole_batches_in_sampler_order(cls):
    ds = _Reader(50)
    loader = cls(ds, batch_size=8, shuffle=True, drop_last=True, read_threads=3)
    epochs = []
    for _ in range(3):
        seen = []
        for images, labels, meta in loader:
            assert images.dtype == torch.uint8 and images.shape == (8, 2, 3, 3)
            assert labels.dtype == torch.int64 and meta.dtype == torch.int32 and meta.shape == (8, 3)
            idx = labels // 10
            assert torch.equal(images[:, 0, 0, 0].long(), idx % 251)
            assert torch.equal(meta[:, 2].long(), idx % 2) and (meta[:, :2] == torch.tensor([2, 3])).all()
            seen += idx.tolist()
        assert len(seen) == 48 and len(set(seen)) == 48
        epochs.append(seen)
    assert epochs[0] != epochs[1]  # reshuffled each pass
    assert ds.threads and all(t.startswith("lightning_gpuopt-read") for t in ds.threads)


def test_read_threads_follow_a_distributed_sampler_and_survive_lightnings_recreation():
    from lightning.pytorch.utilities.data import _update_dataloader

    ds = _Reader(40)
    loader = ContinuousDataLoader(ds, batch_size=5, shuffle=True, drop_last=True, read_threads=2)
    seen = []
    for rank in (0, 1):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3)
        again = _update_dataloader(loader, sampler)  # what Lightning does under DDP
        assert type(again) is ContinuousDataLoader and again.read_threads == 2 and again.num_workers == 0
        seen.append([(b[1] // 10).tolist() for b in again])
    flat = [x for rank in seen for batch in rank for x in batch]
    assert sorted(flat) == list(range(40))


def test_read_threads_errors_reach_the_consumer_and_the_threads_stop():
    import threading

    before = set(threading.enumerate())  # other tests' loaders may wait for the garbage collector

    def ours() -> list[str]:
        return [
            t.name for t in set(threading.enumerate()) - before if t.name.startswith("lightning_gpuopt-read")
        ]

    loader = ContinuousDataLoader(_Reader(64, fail_at=40), batch_size=8, read_threads=2)
    with pytest.raises(OSError, match=r"image 40 cannot be read from reader\.bin"):
        list(loader)
    loader.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and ours():
        time.sleep(0.05)
    assert not ours()


def test_read_threads_prefetch_across_the_epoch_boundary():
    done: list[list[int]] = []  # the batches read, in the order their reads ended

    class Recorded(_Reader):
        def read_into(self, indices, images):
            out = super().read_into(indices, images)
            done.append([int(i) for i in indices])
            return out

    loader = ContinuousDataLoader(Recorded(16, delay_s=0.05), batch_size=4, read_threads=2)
    assert len(list(loader)) == 4
    # the loop does something else between epochs (validation) while epoch 1's first batch is read
    deadline = time.monotonic() + 10
    while len(done) < 4 + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    read_before = list(done)
    first = next(iter(loader))
    # epoch 1's first batch was read before anybody asked for it: next() had no read to wait for
    assert len(first[0]) == 4 and (first[1] // 10).tolist() in read_before[4:]
    loader.close()


def test_read_threads_argument_errors():
    with pytest.raises(TypeError, match="BatchReader"):
        HostDataLoader(TensorDataset(torch.arange(4)), batch_size=2, read_threads=2)
    with pytest.raises(ValueError, match="num_workers=0"):
        HostDataLoader(_Reader(8), batch_size=2, num_workers=1, read_threads=2)
    with pytest.raises(ValueError, match="read_threads"):
        HostDataLoader(_Reader(8), batch_size=2, read_threads=-1)


@pytest.mark.gpu
def test_read_threads_fill_pinned_memory_and_stage_on_the_gpu():
    from lightning_gpuopt.data.loader import StagedBatch

    loader = ContinuousDataLoader(
        _Reader(64), batch_size=8, pin_memory=True, read_threads=2, device_transform=lambda b: b
    )
    raw = next(iter(HostDataLoader(_Reader(64), batch_size=8, pin_memory=True, read_threads=2)))
    assert all(t.is_pinned() for t in raw)
    for _ in range(3):
        seen = []
        for batch in loader:
            assert isinstance(batch, StagedBatch) and all(t.is_cuda for t in batch)
            images, labels, _meta = batch
            assert torch.equal(images[:, 0, 0, 0].long().cpu(), (labels.cpu() // 10) % 251)
            seen += (labels // 10).tolist()
        assert sorted(seen) == list(range(64))
    loader.close()


def test_an_abandoned_epoch_stops_its_reading_threads():
    import gc
    import threading

    def readers():
        return [t for t in threading.enumerate() if t.name.startswith("lightning_gpuopt-read")]

    loader = HostDataLoader(_Reader(64, delay_s=0.01), batch_size=4, read_threads=3)
    it = iter(loader)
    next(it)  # a validation pass cut short (limit_val_batches): the rest is never asked for
    assert readers()
    del it
    gc.collect()
    deadline = time.monotonic() + 10
    while readers() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not readers()


def test_closing_an_epoch_inside_a_lock_its_reads_wait_for_returns_at_once():
    # the garbage collector can close an epoch's generator inside h5py's lock while a reading thread waits
    # for that lock to open the store: closing must not wait for those reads
    import threading

    lock = threading.Lock()

    class Locked(_Reader):
        def read_into(self, indices, images):
            time.sleep(0.2)
            got = lock.acquire(timeout=10)  # a close that waited for this read would take these 10 s
            try:
                return super().read_into(indices, images)
            finally:
                if got:
                    lock.release()

    loader = HostDataLoader(Locked(64), batch_size=4, read_threads=2)
    it = iter(loader)
    next(it)
    with lock:
        time.sleep(0.5)  # the reads in flight now wait for the lock
        t0 = time.monotonic()
        it.close()
        took = time.monotonic() - t0
    # a close that waited for those reads would take the 10 s of their lock's timeout
    assert took < CLOSE_WAIT_S + 4.0, f"closing waited {took:.1f} s for reads blocked on the closer's lock"


def test_closing_an_epoch_lets_its_reads_in_flight_finish():
    # a read in flight holds the store's memory map: once the epoch is closed none may still run
    import threading

    active = []

    class Slow(_Reader):
        def read_into(self, indices, images):
            active.append(threading.current_thread().name)
            try:
                time.sleep(0.3)
                return super().read_into(indices, images)
            finally:
                active.pop()

    it = iter(HostDataLoader(Slow(64), batch_size=4, read_threads=2))
    next(it)
    deadline = time.monotonic() + 10
    while not active and time.monotonic() < deadline:  # the next reads have started
        time.sleep(0.01)
    assert active
    it.close()
    assert not active


def test_an_epoch_after_a_read_error_starts_afresh():
    ds = _Reader(32, fail_at=20)
    loader = ContinuousDataLoader(ds, batch_size=4, read_threads=2)
    with pytest.raises(OSError, match="image 20"):
        list(loader)
    ds.fail_at = None  # the cause is fixed; the loader reads whole epochs again, not an empty one
    for _ in range(2):
        seen = [i for batch in loader for i in (batch[1] // 10).tolist()]
        assert sorted(seen) == list(range(32))
    loader.close()
