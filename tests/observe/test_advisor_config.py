"""BottleneckAdvisor: reading a run's configuration (the feed, the optimizers, the memory formats)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from lightning_gpuopt._common import FeedInfo
from lightning_gpuopt.observe.advisor import amp_facts, conv_memory_formats, describe_feed
from tests.observe.advisor_cases import SleepyImages


class _Store(Dataset):
    """A dataset that describes itself, as the package's stores do."""

    feed_info = FeedInfo(backend="hdf5", host_batches=True)

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.zeros(3, 4, 4), 0


class _FolderLike(Dataset):
    """torchvision's ImageFolder keeps (path, class) pairs in ``samples``."""

    samples = [("/data/train/cat/001.JPEG", 0), ("/data/train/dog/002.JPEG", 1)]

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.zeros(3, 4, 4), i


def test_plain_dataloader_is_described_from_its_public_attributes():
    loader = DataLoader(SleepyImages(16), batch_size=4, num_workers=1, pin_memory=False)
    assert describe_feed(loader) == FeedInfo(num_workers=1, pin_memory=False, batch_size=4, host_batches=True)
    # without workers one item says where batches come from
    on_host = DataLoader(TensorDataset(torch.zeros(4, 3)), batch_size=2)
    assert describe_feed(on_host).host_batches is True
    assert describe_feed(on_host, probe_dataset=False).host_batches is None


def test_a_loaders_feed_info_wins_and_its_dataset_fills_the_rest():
    loader = DataLoader(Subset(_Store(), [0, 1, 2]), batch_size=2, num_workers=0)
    feed = describe_feed(loader)
    assert (feed.backend, feed.host_batches, feed.num_workers, feed.batch_size) == ("hdf5", True, 0, 2)
    loader.feed_info = FeedInfo(backend="folder", num_workers=6, pin_memory=True, decoder="cpu")
    feed = describe_feed(loader)
    assert (feed.backend, feed.num_workers, feed.pin_memory, feed.decoder) == ("folder", 6, True, "cpu")
    assert feed.batch_size == 2  # left None by both feed_infos: the DataLoader's own


def test_a_loader_read_by_threads_has_threads_not_workers(tmp_path):
    from lightning_gpuopt.data.loader import HostDataLoader

    class Reader(TensorDataset):
        image_shape = (2, 2, 3)

        def read_into(self, indices, images):  # pragma: no cover - not read here
            raise AssertionError

    loader = HostDataLoader(Reader(torch.zeros(8)), batch_size=4, read_threads=3)
    feed = describe_feed(loader, probe_dataset=False)
    assert (feed.num_workers, feed.threads, feed.batch_size) == (None, 3, 4)


def test_a_loader_that_is_not_a_dataloader_is_described_by_its_feed_info_only():
    dali_like = SimpleNamespace(
        feed_info=FeedInfo(backend="dali", decoder="cpu", threads=6, host_batches=False)
    )
    assert describe_feed(dali_like) == dali_like.feed_info
    assert describe_feed(object()) == FeedInfo()


def test_a_dali_loaders_measured_decode_rates_reach_the_advisor():
    from lightning_gpuopt.data.dali import DALIFeedInfo
    from lightning_gpuopt.observe.advisor.config import loop_config
    from lightning_gpuopt.observe.advisor.rules import diagnose

    info = DALIFeedInfo(
        backend="dali", decoder="cpu", threads=6, cpu_decode_rate=900.0, gpu_decode_rate=500.0
    )
    feed = describe_feed(SimpleNamespace(feed_info=info))
    assert (feed.cpu_decode_rate, feed.gpu_decode_rate) == (900.0, 500.0)
    loop = SimpleNamespace(
        device=torch.device("cpu"), precision="32-true", processes_per_node=1, world_size=1, callbacks=[],
        module=nn.Linear(2, 2),
    )  # fmt: skip
    cfg = loop_config(loop, gpu_monitor=False, feed=feed)
    assert (cfg.cpu_decode_rate, cfg.gpu_decode_rate) == (900.0, 500.0)
    (v,) = diagnose({"time/data_wait_frac": 0.5, "time/data_wait_ms": 20.0}, cfg)
    assert v.cause == "dali-bound" and "nvJPEG decoded 500 img/s" in v.advice


def test_a_dataset_listing_image_files_is_a_folder_decoded_on_the_cpu():
    feed = describe_feed(DataLoader(_FolderLike(), batch_size=2, num_workers=2))
    assert (feed.backend, feed.decoder, feed.num_workers) == ("folder", "cpu", 2)


def test_amp_facts_reads_public_attributes_only():
    fused = SimpleNamespace(_step_supports_amp_scaling=True)
    scaler = torch.amp.GradScaler("cpu")
    trainer = SimpleNamespace(
        precision_plugin=SimpleNamespace(scaler=scaler),
        optimizers=[torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), fused],
        gradient_clip_val=1,
    )
    assert amp_facts(trainer) == {
        "grad_scaler": True,
        "unfused_optimizers": ("SGD",),
        "gradient_clip_val": 1.0,
    }
    # plugins without a scaler attribute (32-true, bf16-mixed, DeepSpeed...) have no GradScaler
    no_scaler = SimpleNamespace(precision_plugin=object(), optimizers=[fused], gradient_clip_val=0)
    assert amp_facts(no_scaler) == {"grad_scaler": False, "unfused_optimizers": (), "gradient_clip_val": None}
    # what cannot be read stays unknown
    assert amp_facts(SimpleNamespace()) == {"gradient_clip_val": None}


def test_conv_memory_formats():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 1), nn.Conv2d(8, 4, 3))
    assert conv_memory_formats(model) == (2, 0)  # the 1x1 kernel cannot tell
    model.to(memory_format=torch.channels_last)
    assert conv_memory_formats(model) == (2, 2)
