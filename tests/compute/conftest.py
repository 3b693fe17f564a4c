import pytest
import torch

from lightning_gpuopt._common import _warnings
from lightning_gpuopt.compute.precision import configure_backends


@pytest.fixture(autouse=True)
def _fresh_warnings():
    """Warnings are once a process (``warn_once``): each test starts with none given yet."""
    _warnings().clear()
    yield
    _warnings().clear()


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device of a chosen compute capability, faked at torch's boundary."""

    def install(capability: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    return install


@pytest.fixture
def restore_backends():
    """The process-wide TF32/cuDNN flags as they were before the test, put back after it."""
    previous = configure_backends(tf32=None, cudnn_benchmark=None)
    yield previous
    previous.restore()
