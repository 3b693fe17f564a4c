"""Labels across splits: every split labels a class by its index among the training split's classes, and a
class the training split lacks is refused at setup, on each backend (folder, HDF5 store, DALI)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_gpuopt.data.datamodule import OptimizedDataModule
from lightning_gpuopt.data.folder import class_indices
from tests._lightning import quiet_trainer
from tests.data._images import save, smooth_rgb

TRAIN = ("cat", "dog", "fox")


def _split(root: Path, classes: tuple[str, ...], per_class: int = 2) -> Path:
    for c, name in enumerate(classes):
        for i in range(per_class):
            save(smooth_rgb(16, 16, 10 * c + i), root / name / f"{i}.jpg", quality=90)
    return root


def _store(folder: Path, path: Path) -> Path:
    pytest.importorskip("h5py")
    from lightning_gpuopt.data.convert import convert_folder_to_hdf5

    convert_folder_to_hdf5(folder, path, 18, workers=1, progress=False)  # eval_resize_size(16)
    return path


def _sources(tmp_path: Path, backend: str, val_classes: tuple[str, ...]) -> tuple[Path, Path]:
    train, val = _split(tmp_path / "train", TRAIN), _split(tmp_path / "val", val_classes)
    if backend == "hdf5":
        return _store(train, tmp_path / "train.h5"), _store(val, tmp_path / "val.h5")
    if backend == "mixed":  # a store for training, a folder for validation
        return _store(train, tmp_path / "train.h5"), val
    return train, val


def _dm(train: Path, val: Path, backend: str) -> OptimizedDataModule:
    backend = "auto" if backend == "mixed" else backend
    return OptimizedDataModule(
        train, val, test_dir=val, backend=backend, batch_size=2, num_workers=0, image_size=16
    )


def _labels(loader) -> list[int]:
    return [int(y) for batch in loader for y in batch[1].tolist()]


def test_class_indices_map_a_subset_and_refuse_a_class_training_lacks():
    assert class_indices(TRAIN, ["cat", "fox"], split="val", path="v") == [0, 2]
    assert class_indices(TRAIN, ["fox", "dog", "cat"], split="val", path="v") == [2, 1, 0]
    with pytest.raises(ValueError, match=r"val split \('/d/val'\).*training split \('/d/train'\).*'owl'"):
        class_indices(TRAIN, ["cat", "owl"], split="val", path="/d/val", train_path="/d/train")


@pytest.mark.parametrize("backend", ["folder", "hdf5", "mixed"])
def test_a_validation_subset_is_labelled_by_the_training_classes(tmp_path, backend):
    train, val = _sources(tmp_path, backend, ("cat", "fox"))
    dm = _dm(train, val, backend)
    dm.setup("fit")
    assert _labels(dm.val_dataloader()) == [0, 0, 2, 2]  # fox is training's 2, not the folder's own 1
    assert dm._dataset("val").classes == list(TRAIN)
    dm.setup("test")
    assert _labels(dm.test_dataloader()) == [0, 0, 2, 2]
    dm.teardown("fit")
    dm = _dm(train, val, backend)
    dm.setup("validate")  # the training split is not built: its class names are read from train_dir
    assert "train" not in dm._datasets
    assert _labels(dm.val_dataloader()) == [0, 0, 2, 2]
    dm.teardown("validate")


@pytest.mark.parametrize("backend", ["folder", "hdf5", "mixed"])
def test_a_class_training_lacks_fails_the_fit_at_setup(tmp_path, backend):
    train, val = _sources(tmp_path, backend, ("cat", "owl"))
    dm = _dm(train, val, backend)

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):  # pragma: no cover - setup fails first
            raise AssertionError("training started")

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    fails = r"the val split \('.*val.*'\) has 1 class\(es\) the training split .*lacks: 'owl'"
    with pytest.raises(ValueError, match=fails):
        quiet_trainer(accelerator="cpu", max_epochs=1).fit(Model(), datamodule=dm)


class _Fit(pl.LightningModule):
    """Records the labels of the training and validation batches, and the backend each loader reads with."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Conv2d(3, 3, 1)
        self.seen: dict[str, list[int]] = {"train": [], "val": []}

    def training_step(self, batch, batch_idx):
        self.seen["train"] += batch[1].tolist()
        return self.layer(batch[0]).mean()

    def validation_step(self, batch, batch_idx):
        self.seen["val"] += batch[1].tolist()

    def on_fit_end(self):
        self.feeds = (self.trainer.train_dataloader.feed_info, self.trainer.val_dataloaders.feed_info)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_store_for_training_and_a_folder_for_validation_fit_together(tmp_path):
    train, val = _sources(tmp_path, "mixed", ("cat", "fox"))
    dm = OptimizedDataModule(train, val, batch_size=2, num_workers=1, image_size=16)
    assert dm.backend == "hdf5+folder" and "each split is read by its kind" in dm.backend_reason
    model = _Fit()
    quiet_trainer(accelerator="cpu", max_epochs=1, num_sanity_val_steps=0).fit(model, datamodule=dm)
    assert sorted(model.seen["train"]) == [0, 0, 1, 1, 2, 2]
    assert sorted(model.seen["val"]) == [0, 0, 2, 2]  # the folder's fox is training's label 2
    assert [feed.backend for feed in model.feeds] == ["hdf5", "folder"]


def test_a_backend_named_for_one_kind_names_the_one_fix_for_the_other(tmp_path):
    """A folder given to the store backend names the command that converts it, a store given to the folder
    backend names backend='auto'; neither sends the user back to the other."""
    train, val = _sources(tmp_path, "mixed", ("cat", "fox"))
    with pytest.raises(ValueError) as refused:
        OptimizedDataModule(train, val, backend="hdf5")
    message = str(refused.value)
    assert message.startswith(f"val_dir must be an HDF5 store file for the hdf5 backend, got '{val}'")
    assert f"`lightning-gpuopt convert {val} {val}.h5`" in message and "backend='folder'" not in message
    with pytest.raises(ValueError) as refused:
        OptimizedDataModule(train, val, backend="folder")
    message = str(refused.value)
    assert message.startswith("train_dir must be a folder laid out as <root>/<class>/<image>")
    assert "backend='auto'" in message and "backend='hdf5'" not in message
    with pytest.raises(
        ValueError, match=r"^val_dir must be a JPEG folder, as train_dir is, with backend='dali'"
    ):
        OptimizedDataModule(val, train, backend="dali")  # DALI reads folders; auto reads each by its kind
    from lightning_gpuopt.data.hdf5 import HDF5ImageDataset

    with pytest.raises(ValueError, match="is a folder, not an HDF5 store") as refused:
        HDF5ImageDataset(val)
    assert str(refused.value).endswith(f"`lightning-gpuopt convert {val} {val}.h5`")


def test_dali_file_lists_are_labelled_by_the_training_classes(tmp_path):
    pytest.importorskip("nvidia.dali")
    from lightning_gpuopt.data.dali import DALIOptions

    train, val = _sources(tmp_path, "dali", ("cat", "fox"))
    kw = {"backend": "dali", "batch_size": 2, "image_size": 16}
    dm = OptimizedDataModule(train, val, dali=DALIOptions(threads=1, decoder="cpu"), **kw)
    dm.setup("fit")
    loader = dm.val_dataloader()
    assert loader.labels == [0, 0, 2, 2]
    assert _labels(loader) == [0, 0, 2, 2]
    loader.close()
    _split(tmp_path / "val", ("owl",))
    with pytest.raises(ValueError, match=r"val split .* lacks: 'owl'"):
        OptimizedDataModule(train, val, **kw).setup("fit")
