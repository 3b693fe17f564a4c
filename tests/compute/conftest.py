import pytest

from lightning_gpuopt._common import _warnings


@pytest.fixture(autouse=True)
def _fresh_warnings():
    """Warnings are once a process (``warn_once``): each test starts with none given yet."""
    _warnings().clear()
    yield
    _warnings().clear()
