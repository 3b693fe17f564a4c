"""What the command tests share: a cache folder of the test's own, and the one-line error a command prints."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test measures and caches into its own folder."""
    monkeypatch.setenv("LIGHTNING_GPUOPT_CACHE_DIR", str(tmp_path / "cache"))


def one_error_line(err: str, command: str) -> str:
    """The single line ``lightning-gpuopt <command>: error: ...`` of ``err``, with no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"lightning-gpuopt {command}: error: ")
    assert "Traceback" not in err
    return lines[0]
