"""What the benchmark scripts share: a uint8 HDF5 store in the current format, the Trainer arguments of a
fit that measures training alone, and where a quick run writes.

The scripts import it from their own folder (``python benchmarks/<script>.py`` puts that folder first on
``sys.path``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

#: a fit that measures training alone: no logger, bars, summary, checkpoints or validation
QUIET_FIT: dict[str, Any] = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
    "num_sanity_val_steps": 0,
    "limit_val_batches": 0,
}


def hdf5_store(
    src: str | os.PathLike[str], path: str | os.PathLike[str], storage_size: int
) -> dict[str, Any]:
    """Make ``path`` a store of the JPEG folder ``src`` at ``storage_size``; return what the conversion cost.

    A store already there is reused when this version of the package reads it at that size; one of an
    older format (or another size) is converted again, so a data folder kept between runs never breaks a
    benchmark.

    Returns:
        ``{"cached": True}`` for a reused store, else ``{"cached": False, "seconds", "images_per_sec"}``.
    """
    from lightning_gpuopt.data.hdf5 import HDF5ImageDataset, convert_folder_to_hdf5

    path = Path(path)
    if path.exists():
        try:
            if HDF5ImageDataset(path).storage_size == storage_size:
                return {"cached": True}
        except (ValueError, RuntimeError):  # another format version, or damaged: convert again below
            pass
    path.parent.mkdir(parents=True, exist_ok=True)
    res = convert_folder_to_hdf5(src, path, storage_size=storage_size, progress=False, overwrite=True)
    return {
        "cached": False,
        "seconds": res.seconds,
        "images_per_sec": res.num_images / max(res.seconds, 1e-9),
    }


def quick_out(out: str, default: str, quick: bool) -> str:
    """``out`` unless it is the script's default and the run is ``--quick``: then a file of the same name in
    the temp folder, so a smoke run never replaces a recorded result."""
    if quick and out == default:
        return os.path.join(tempfile.gettempdir(), f"{Path(default).stem}_quick{Path(default).suffix}")
    return out
