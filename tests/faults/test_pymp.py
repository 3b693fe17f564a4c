"""A folder fit stopped by a bad image (``on_corrupt="raise"``, one worker) leaves no ``pymp-*`` folder.

Each fit runs in its own process with a fresh ``TMPDIR`` and is checked after that process has exited: the
user sees an empty ``TMPDIR``. What can leave a folder there is a DataLoader worker's queue thread making
the worker's ``pymp-*`` folder (to hand a batch over) while the worker exits, after ``multiprocessing``
removed it; the workers keep their temporary files in a folder of their loader's, removed with them
(``_lifetime.worker_folder``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_FIT = """
import sys
from pathlib import Path
import lightning.pytorch as pl, torch
from torch import nn
from lightning_gpuopt.data.backends import FolderBackend
from lightning_gpuopt.data.datamodule import OptimizedDataModule

folder, own = Path(sys.argv[1]), sys.argv[2] == "own"


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 4))

    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Own(OptimizedDataModule):  # a user's own dataset: read by DataLoader worker processes
    def train_dataset(self):
        return FolderBackend().dataset(str(folder), storage_size=36, on_corrupt="raise", skip_log=None)


dm = (Own if own else OptimizedDataModule)(
    str(folder), batch_size=4, num_workers=1, image_size=32, on_corrupt="raise"
)
trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=3, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
try:
    trainer.fit(Tiny(), datamodule=dm)
except Exception as err:
    print("stopped:", type(err).__name__)
"""


@pytest.fixture(scope="module")
def bad_folder(tmp_path_factory) -> Path:
    from lightning_gpuopt.bench.synthetic import make_jpeg_folder

    folder = make_jpeg_folder(
        tmp_path_factory.mktemp("pymp") / "folder",
        num_images=32,
        num_classes=4,
        image_size=(48, 40),
        workers=1,
    )
    (folder / "class_02" / "zz_bad.jpg").write_bytes(b"not a jpeg")
    return folder


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "runs"), [("own", 5), ("default", 2)])
def test_fit_stopped_by_a_bad_image_leaves_no_pymp_folder(bad_folder, tmp_path, short_tmp, mode, runs):
    script = tmp_path / "fit.py"
    script.write_text(_FIT)
    left = []
    for run in range(runs):
        tmpdir = short_tmp / str(run)
        tmpdir.mkdir()
        env = {
            **os.environ,
            "TMPDIR": str(tmpdir),
            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        proc = subprocess.run(
            [sys.executable, str(script), str(bad_folder), mode],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "stopped:" in proc.stdout, proc.stderr[-2000:]
        left += [f"run {run}: {p.name}" for p in tmpdir.iterdir()]
    assert left == [], f"left in TMPDIR: {left}"
