import os

import pytest
import torch

# Keep CPU tests quiet and deterministic on 2-core CI machines.
os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker); run on the lent H200")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def jpeg_folder(tmp_path_factory):
    """A small class-per-subfolder JPEG folder (48 images, 3 classes, 64x48)."""
    from lightning_gpuopt.data.synthetic import make_jpeg_folder

    root = tmp_path_factory.mktemp("jpegs")
    return make_jpeg_folder(root, num_images=48, num_classes=3, image_size=(64, 48), workers=1)
