"""Resuming mid-epoch: the training loader continues the interrupted pass, so every epoch after a resume
is a whole epoch (each sample once), on the folder backend and the HDF5 store."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_gpuopt.data.datamodule import OptimizedDataModule
from lightning_gpuopt.data.loader import ContinuousDataLoader
from tests._lightning import quiet_trainer
from tests.data._images import save, smooth_rgb

SAMPLES, BATCH = 16, 4


class Boom(RuntimeError):
    pass


class Labels(pl.LightningModule):
    """Records the labels each epoch trains on; raises at global step ``fail_at``."""

    def __init__(self, fail_at: int | None = None):
        super().__init__()
        self.layer = torch.nn.Conv2d(3, 1, 1)
        self.fail_at = fail_at
        self.seen: dict[int, list[int]] = {}

    def training_step(self, batch, batch_idx):
        if self.global_step == self.fail_at:
            raise Boom("interrupted")
        x, y = batch
        self.seen.setdefault(self.current_epoch, []).extend(y.tolist())
        return self.layer(x).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _one_image_classes(root: Path) -> Path:
    """16 classes of one image each: a label names its sample."""
    for i in range(SAMPLES):
        save(smooth_rgb(16, 16, i), root / f"c{i:02d}" / "0.jpg", quality=90)
    return root


def _source(tmp_path: Path, backend: str) -> Path:
    folder = _one_image_classes(tmp_path / "src")
    if backend == "folder":
        return folder
    pytest.importorskip("h5py")
    from lightning_gpuopt.data.convert import convert_folder_to_hdf5

    convert_folder_to_hdf5(folder, tmp_path / "train.h5", 18, workers=1, progress=False)
    return tmp_path / "train.h5"


def _fit(source: Path, model: Labels, ckpt_dir: Path, ckpt_path: str | None = None) -> None:
    """Two worker processes for the folder, two reading threads for the store (``HDF5Options``: a raw store
    has no worker processes, so ``num_workers`` counts none for it)."""
    from lightning_gpuopt.data.hdf5 import HDF5Options

    store = source.suffix == ".h5"
    readers = {"num_workers": 0, "hdf5": HDF5Options(threads=2)} if store else {"num_workers": 2}
    dm = OptimizedDataModule(source, batch_size=BATCH, image_size=16, **readers)
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=6, save_top_k=-1)
    trainer = quiet_trainer(
        accelerator="cpu", max_epochs=4, enable_checkpointing=True, callbacks=[checkpoint]
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)


@pytest.mark.parametrize("backend", ["folder", "hdf5"])
def test_every_epoch_after_a_mid_epoch_resume_is_whole(tmp_path, backend):
    source = _source(tmp_path, backend)
    first = Labels(fail_at=7)
    with pytest.raises(Boom):
        _fit(source, first, tmp_path / "ckpt")  # checkpoint at step 6 (epoch 1, batch 2), fails at step 7
    (ckpt,) = (tmp_path / "ckpt").glob("*step=6*.ckpt")
    resumed = Labels()
    _fit(source, resumed, tmp_path / "ckpt", ckpt_path=str(ckpt))
    assert sorted(first.seen[0]) == list(range(SAMPLES))
    for epoch in (2, 3):
        assert sorted(set(resumed.seen[epoch])) == list(range(SAMPLES)), epoch
        assert len(resumed.seen[epoch]) == SAMPLES
    # the interrupted epoch: its first 2 batches before the checkpoint, the other 2 after the resume
    interrupted = first.seen[1][: 2 * BATCH] + resumed.seen[1]
    assert len(resumed.seen[1]) == 2 * BATCH and sorted(interrupted) == list(range(SAMPLES))
    state = torch.load(ckpt, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert [(s["pass"], s["batch"]) for s in state] == [(1, 2)]


def test_load_state_dict_replays_the_rest_of_the_pass():
    torch.manual_seed(0)
    loader = ContinuousDataLoader(range(16), batch_size=4, shuffle=True, drop_last=True)
    passes = [[b.tolist() for b in loader] for _ in range(2)]
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert (state["pass"], state["batch"], state["batches_per_pass"]) == (2, 1, 4)
    again = ContinuousDataLoader(range(16), batch_size=4, shuffle=True, drop_last=True)
    again.load_state_dict({**state, "pass": 1})  # back into the second pass, after its first batch
    assert [b.tolist() for b in again] == passes[1][1:]
    assert sorted(sum((b.tolist() for b in again), [])) == list(range(16))  # then whole passes


def test_a_distributed_sampler_resumes_its_pass_and_other_samplers_warn():
    from torch.utils.data import DistributedSampler, Sampler

    def loader(sampler):
        return ContinuousDataLoader(range(16), batch_size=2, sampler=sampler, drop_last=True)

    ranked = loader(DistributedSampler(range(16), num_replicas=2, rank=1, shuffle=True, seed=3))
    passes = [[b.tolist() for b in ranked] for _ in range(2)]
    again = loader(DistributedSampler(range(16), num_replicas=2, rank=1, shuffle=True, seed=3))
    again.load_state_dict({"pass": 1, "batch": 3, "batches_per_pass": 4, "seed": None})
    assert [b.tolist() for b in again] == passes[1][3:]

    class Reversed(Sampler):
        def __iter__(self):
            return iter(range(15, -1, -1))

        def __len__(self):
            return 16

    plain = loader(Reversed())
    with pytest.warns(UserWarning, match="cannot be replayed"):
        plain.load_state_dict({"pass": 0, "batch": 1, "batches_per_pass": 8, "seed": None})
    assert len(list(plain)) == 7 and len(list(plain)) == 8
    with pytest.warns(UserWarning, match="had 5 batches a pass, this one has 8"):
        plain.load_state_dict({"pass": 2, "batch": 1, "batches_per_pass": 5, "seed": None})
    assert len(list(plain)) == 8
