"""Lightning's batch hooks on an ``OptimizedDataModule`` subclass see what Lightning's docs say they see.

A subclass that overrides ``on_before_batch_transfer``, ``transfer_batch_to_device`` and
``on_after_batch_transfer`` (each calling ``super()``) records what each hook received and returned, in a
short CPU fit on every backend: the host backends (an image folder, a raw HDF5 store, a JPEG store, a store
for training with a folder for validation) hand ``on_before_batch_transfer`` the host batch ``(uint8 NHWC,
int64 labels, int32 meta)``, ``transfer_batch_to_device`` moves it, ``super().on_after_batch_transfer``
returns ``(normalized float32 NCHW, labels)``; DALI (its CPU pipeline here) makes its batches on the device,
normalized, and every hook sees them so. On a CUDA run the training loader stages batches on the GPU ahead of
the step only where no such hook is overridden: the decision and the setup line are tested here on the CPU,
the staged path itself in ``test_gpu_*``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_gpuopt.data import datamodule as datamodule_module
from lightning_gpuopt.data.datamodule import OptimizedDataModule
from tests._lightning import quiet_trainer

IMAGE = 16


def _describe(batch: Any) -> list[tuple[str, str, str, tuple[int, ...]]]:
    """``(type, dtype, device, shape)`` of each tensor of ``batch`` (a tuple or list of tensors)."""
    assert isinstance(batch, (tuple, list)), type(batch)
    return [(type(t).__name__, str(t.dtype), t.device.type, tuple(t.shape)) for t in batch]


class Hooked(OptimizedDataModule):
    """Records what each batch hook saw and returned, per stage; each calls ``super()``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[str, str, Any, Any]] = []

    def _stage(self) -> str:
        return "train" if self.trainer.training else "eval"

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        out = super().on_before_batch_transfer(batch, dataloader_idx)
        self.seen.append(("before", self._stage(), _describe(batch), _describe(out)))
        return out

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        out = super().transfer_batch_to_device(batch, device, dataloader_idx)
        self.seen.append(("transfer", self._stage(), _describe(batch), _describe(out)))
        return out

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        out = super().on_after_batch_transfer(batch, dataloader_idx)
        self.seen.append(("after", self._stage(), _describe(batch), _describe(out)))
        return out


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Conv2d(3, 2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.layer(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(dm: Hooked) -> pl.Trainer:
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
    )
    trainer.fit(Model(), datamodule=dm)
    return trainer


def _host(n: int, canvas: tuple[int, int, int]) -> list[tuple[str, str, str, tuple[int, ...]]]:
    """The host batch Lightning's docs describe for this package: uint8 canvases, labels, meta."""
    return [
        ("Tensor", "torch.uint8", "cpu", (n, *canvas)),
        ("Tensor", "torch.int64", "cpu", (n,)),
        ("Tensor", "torch.int32", "cpu", (n, 3)),
    ]


def _normalized(n: int) -> list[tuple[str, str, str, tuple[int, ...]]]:
    return [("Tensor", "torch.float32", "cpu", (n, 3, IMAGE, IMAGE)), ("Tensor", "torch.int64", "cpu", (n,))]


def _check_host_path(dm: Hooked, train_canvas: tuple[int, ...], val_canvas: tuple[int, ...]) -> None:
    for stage, canvas in (("train", train_canvas), ("eval", val_canvas)):
        seen = {hook: (got, out) for hook, s, got, out in dm.seen if s == stage}
        assert set(seen) == {"before", "transfer", "after"}, (stage, dm.seen)
        host = _host(4, canvas)  # type: ignore[arg-type]
        assert seen["before"] == (host, host)  # the host batch, not yet on the device
        assert seen["transfer"] == (host, host)  # moved to the device: the CPU here
        assert seen["after"] == (host, _normalized(4))  # super() normalizes it, NCHW float32


@pytest.fixture
def stores(jpeg_folder, tmp_path):
    pytest.importorskip("h5py")
    from lightning_gpuopt.data.convert import convert_folder_to_hdf5

    raw, jpeg = tmp_path / "raw.h5", tmp_path / "jpeg.h5"
    convert_folder_to_hdf5(jpeg_folder, raw, 18, workers=1, progress=False)
    convert_folder_to_hdf5(jpeg_folder, jpeg, 18, workers=1, progress=False, format="jpeg")
    return raw, jpeg


def test_an_image_folder_hands_each_hook_what_lightnings_docs_say(jpeg_folder):
    dm = Hooked(jpeg_folder, jpeg_folder, backend="folder", batch_size=4, image_size=IMAGE, storage_size=18)
    trainer = _fit(dm)
    canvas = (18, 27, 3)  # the whole image on its canvas: shorter side 18, room for 1.5x
    _check_host_path(dm, canvas, canvas)
    assert trainer.train_dataloader.device_transform is None  # the training loader stages nothing


@pytest.mark.parametrize("kind", ["raw", "jpeg", "raw+folder"])
def test_stores_hand_each_hook_what_lightnings_docs_say(stores, jpeg_folder, kind):
    raw, jpeg = stores
    train, val = {"raw": (raw, raw), "jpeg": (jpeg, jpeg), "raw+folder": (raw, jpeg_folder)}[kind]
    dm = Hooked(train, val, batch_size=4, image_size=IMAGE, storage_size=18)
    assert dm.backend == ("hdf5+folder" if kind == "raw+folder" else "hdf5")
    _fit(dm)
    _check_host_path(dm, (18, 27, 3), (18, 27, 3))


def test_dali_hands_each_hook_its_device_batches_normalized(jpeg_folder):
    pytest.importorskip("nvidia.dali")
    from lightning_gpuopt.data.dali import DALIOptions

    dm = Hooked(
        jpeg_folder, jpeg_folder, backend="dali", batch_size=4, image_size=IMAGE, dali=DALIOptions(threads=1)
    )
    _fit(dm)
    for stage in ("train", "eval"):
        seen = {hook: (got, out) for hook, s, got, out in dm.seen if s == stage}
        made = _normalized(4)  # made on the device by DALI: normalized NCHW already, at every hook
        assert seen == {"before": (made, made), "transfer": (made, made), "after": (made, made)}, stage


def test_the_training_loader_stages_only_where_no_batch_hook_is_overridden(jpeg_folder, monkeypatch):
    """The decision: overridden hooks (the DataModule's or the LightningModule's) turn staging off, and the
    setup line says which; without them the training loader keeps its GPU transform."""
    lines: list[str] = []
    monkeypatch.setattr(datamodule_module, "rank_zero_info", lines.append)
    kw = {"backend": "folder", "batch_size": 4, "image_size": IMAGE, "num_workers": 0}
    plain = OptimizedDataModule(jpeg_folder, **kw)
    plain.setup("fit")
    assert plain.train_dataloader().device_transform is not None
    hooked = Hooked(jpeg_folder, **kw)
    hooked.setup("fit")
    assert hooked.train_dataloader().device_transform is None
    (line,) = [x for x in lines if x.startswith("OptimizedDataModule: train: ") and "Hooked" in x]
    assert "not staged: Hooked.on_before_batch_transfer, Hooked.transfer_batch_to_device, " in line
    assert "Hooked.on_after_batch_transfer overridden, so Lightning's batch hooks see each host batch" in line

    class OwnTransfer(Model):
        def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
            return super().transfer_batch_to_device(batch, device, dataloader_idx)

    trainer = quiet_trainer(accelerator="cpu", devices=1, max_steps=1, limit_val_batches=0)
    trainer.fit(OwnTransfer(), datamodule=OptimizedDataModule(jpeg_folder, **kw))
    assert trainer.train_dataloader.device_transform is None  # Lightning calls the module's hook
    assert any("not staged: OwnTransfer.transfer_batch_to_device overridden" in x for x in lines)


@pytest.mark.gpu
@pytest.mark.parametrize("hooked", [True, False])
def test_gpu_staging_follows_the_batch_hooks(jpeg_folder, hooked):
    """On CUDA: with hooks overridden the hooks see the pinned host batch, then the device batch, and
    ``super().on_after_batch_transfer`` normalizes it there; without, the loader stages the batches."""
    cls = Hooked if hooked else OptimizedDataModule
    dm = cls(jpeg_folder, jpeg_folder, backend="folder", batch_size=4, image_size=IMAGE, storage_size=18)
    seen: list[tuple[str, str, tuple[int, ...]]] = []

    class Seen(Model):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            seen.append((str(batch[0].dtype), batch[0].device.type, tuple(batch[0].shape)))
            return super().training_step(batch, batch_idx)

    trainer = quiet_trainer(
        accelerator="gpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
    )
    trainer.fit(Seen(), datamodule=dm)
    assert seen == [("torch.float32", "cuda", (4, 3, IMAGE, IMAGE))] * 2
    assert (trainer.train_dataloader.device_transform is None) == hooked
    if hooked:
        train = {hook: (got, out) for hook, s, got, out in dm.seen if s == "train"}
        host = [(t, d, "cpu", shape) for t, d, _, shape in _host(4, (18, 27, 3))]
        cuda = [(t, d, "cuda", shape) for t, d, _, shape in host]
        assert train["before"] == (host, host)
        assert train["transfer"] == (host, cuda)
        assert train["after"][1] == [("Tensor", "torch.float32", "cuda", (4, 3, IMAGE, IMAGE)),
                                     ("Tensor", "torch.int64", "cuda", (4,))]  # fmt: skip
