import os

import pytest
import torch

# Keep CPU tests quiet and deterministic on 2-core CI machines.
os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")


def pytest_collection_modifyitems(config, items):
    """Skip the tests marked ``gpu`` when torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        # the marker only: item.keywords also holds the names of the test's folders, so it would skip
        # everything under tests/gpu/, CPU-only tests included
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def jpeg_folder(tmp_path_factory):
    """A small class-per-subfolder JPEG folder (48 images, 3 classes, 64x48)."""
    from lightning_gpuopt.bench.synthetic import make_jpeg_folder

    root = tmp_path_factory.mktemp("jpegs")
    return make_jpeg_folder(root, num_images=48, num_classes=3, image_size=(64, 48), workers=1)


_DIST_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "LOCAL_WORLD_SIZE",
)


@pytest.fixture(autouse=True)
def _isolate_distributed():
    """Each test starts without a process group or a MASTER_PORT left by an earlier DDP test.

    Lightning's DDP strategies set MASTER_PORT in the parent and leave the default process group (and its
    TCP store, bound to that port) alive after fit; a later DDP test would reuse the port and fail with
    EADDRINUSE, or hang when forked children join the stale store.
    """
    saved = {k: os.environ.get(k) for k in _DIST_ENV}
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
