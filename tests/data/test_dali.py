"""DALI on the CPU (``device_id=None``): outputs, epochs and ranks, resume, options, errors, Lightning.

Pixels and crop distributions against torchvision's recipes: ``test_dali_pixels.py``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("nvidia.dali")

import lightning.pytorch as pl

from lightning_gpuopt._common import FETCH_SECONDS_ATTR, FeedInfo
from lightning_gpuopt.data import dali_pipeline, decode
from lightning_gpuopt.data.dali import DALIFeedInfo, DALILoader, DALIOptions, build_dali_loader
from lightning_gpuopt.data.datamodule import OptimizedDataModule
from lightning_gpuopt.data.decode_choice import choose_decoder
from lightning_gpuopt.data.folder import scan_image_folder
from lightning_gpuopt.data.transforms import AugmentConfig
from tests._ddp import CloseProcessGroup


def _indexed(folder: Path) -> tuple[list[str], list[int]]:
    """Files of the folder labelled by their index, so a batch's labels tell which samples it holds."""
    _, samples = scan_image_folder(folder)
    return [p for p, _ in samples], list(range(len(samples)))


def _index_folder(source: Path, out: Path, n: int | None = None) -> Path:
    """The first ``n`` images of ``source``, each in a class folder of its own: a sample's label is its
    index, so what a DataModule fed each rank can be read from the labels."""
    files, _ = _indexed(source)
    for i, path in enumerate(files[:n]):
        (out / f"c{i:03d}").mkdir(parents=True)
        shutil.copy(path, out / f"c{i:03d}" / Path(path).name)
    return out


@pytest.fixture
def index_folder(jpeg_folder, tmp_path) -> Path:
    return _index_folder(jpeg_folder, tmp_path / "indexed")


def _loader(files, labels, **kw) -> DALILoader:
    kw.setdefault("options", DALIOptions(threads=1))
    kw.setdefault("image_size", 16)
    return DALILoader(files, labels, **kw)


def _dm(train_dir, val_dir=None, **kw) -> OptimizedDataModule:
    kw = {"batch_size": 4, "image_size": 16, "dali": DALIOptions(threads=1), **kw}
    return OptimizedDataModule(train_dir, val_dir, backend="dali", **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_outputs_shape_dtype_layout_and_labels(jpeg_folder, dtype):
    _, samples = scan_image_folder(jpeg_folder)
    files, labels = [p for p, _ in samples], [y for _, y in samples]
    loader = _loader(files, labels, batch_size=48, image_size=24, train=False, dtype=dtype)
    (images, got), *rest = list(loader)
    assert rest == []
    assert images.shape == (48, 3, 24, 24) and images.dtype == dtype and images.device.type == "cpu"
    assert images.is_contiguous(memory_format=torch.channels_last)
    assert got.dtype == torch.int64 and got.shape == (48,)
    assert got.tolist() == labels  # evaluation does not shuffle


def test_the_datamodule_builds_float32_loaders_labelled_as_the_folder_backend(jpeg_folder):
    dm = _dm(jpeg_folder, jpeg_folder, batch_size=48, image_size=24)
    (images, labels), *rest = list(build_dali_loader(dm, "val"))
    assert rest == [] and images.shape == (48, 3, 24, 24) and images.dtype == torch.float32
    # same class mapping and order as the folder backend (evaluation does not shuffle)
    _, samples = scan_image_folder(jpeg_folder)
    assert labels.tolist() == [y for _, y in samples]
    train_images, train_labels = next(iter(build_dali_loader(dm, "train")))
    assert train_images.shape == (48, 3, 24, 24) and train_images.dtype == torch.float32
    assert train_labels.dtype == torch.int64


def test_mixed_sizes_and_modes_decode_like_the_folder_backend(tmp_path):
    # what backend="auto" may hand DALI: grey and CMYK JPEGs, palette and RGBA PNGs among RGB JPEGs
    from lightning_gpuopt.data.folder import UInt8ImageFolder
    from tests.data.test_folder import _mixed_folder

    root = _mixed_folder(tmp_path / "mixed")
    files, labels = _indexed(root)
    (images, _got), *rest = list(
        _loader(files, labels, batch_size=6, image_size=16, train=False, dtype=torch.float32)
    )
    assert rest == [] and images.shape == (6, 3, 16, 16) and torch.isfinite(images).all()
    # the evaluation view of each image against the folder backend's (Resize + CenterCrop of its canvas)
    folder = UInt8ImageFolder(root, size=16)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    for i in range(6):
        canvas, _, meta = folder[i]
        h, w, transposed = (int(v) for v in meta)
        ref = torch.from_numpy(canvas[:h, :w]).permute(2, 0, 1).float() / 255
        if transposed:
            ref = ref.transpose(1, 2)
        top, left = (ref.shape[1] - 16) // 2, (ref.shape[2] - 16) // 2
        ref = (ref[:, top : top + 16, left : left + 16] - mean) / std
        # the same colours: an image read wrong (inverted CMYK, palette indices) is off by a whole unit;
        # resampling at 16 px moves a channel's mean up to about 0.1 and the CMYK conversions differ by
        # about 10 of 255 levels (0.17 here)
        colours = (images[i].mean((1, 2)) - ref.mean((1, 2))).abs().max()
        assert colours < 0.25, (files[i], images[i].mean((1, 2)), ref.mean((1, 2)))


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("num_shards", [1, 3])
def test_epoch_lengths_and_coverage(jpeg_folder, train, num_shards):
    files, labels = _indexed(jpeg_folder)  # 48 files
    batch = 5
    seen_per_epoch = [[] for _ in range(3)]
    lengths = []
    for shard in range(num_shards):
        loader = _loader(files, labels, batch_size=batch, train=train, shard_id=shard, num_shards=num_shards)
        lengths.append(len(loader))
        for epoch in range(3):
            batches = [y.tolist() for _, y in loader]
            assert len(batches) == len(loader), (shard, epoch)
            assert all(len(b) == batch for b in (batches if train else batches[:-1]))
            seen_per_epoch[epoch] += [i for b in batches for i in b]
    assert len(set(lengths)) == 1  # every rank the same number of batches
    n = len(files)
    if train:  # whole batches only, no sample twice in a pass
        assert lengths[0] == (n // num_shards) // batch
        for seen in seen_per_epoch:
            assert len(seen) == len(set(seen)) == lengths[0] * batch * num_shards
    else:  # each sample exactly once across ranks
        for seen in seen_per_epoch:
            assert sorted(seen) == list(range(n))


def test_training_shards_are_disjoint_and_reshuffled(jpeg_folder):
    files, labels = _indexed(jpeg_folder)
    loaders = [_loader(files, labels, batch_size=4, train=True, shard_id=r, num_shards=2) for r in range(2)]
    orders = []
    for _ in range(3):
        per_rank = [[i for _, y in loader for i in y.tolist()] for loader in loaders]
        assert len(per_rank[0]) == len(per_rank[1]) == 24
        assert not set(per_rank[0]) & set(per_rank[1])  # no sample on two ranks in one pass
        assert sorted(per_rank[0] + per_rank[1]) == list(range(48))
        orders.append(per_rank[0])
    assert orders[0] != orders[1] != orders[2]
    assert orders[0] != sorted(orders[0])  # shuffled from the first epoch on


def test_partial_epochs_continue_for_training_and_restart_for_eval(jpeg_folder):
    files, labels = _indexed(jpeg_folder)
    train = _loader(files, labels, batch_size=4, train=True)  # 12 batches a pass
    stream = []
    for _ in range(5):  # like limit_train_batches=5: five partial epochs of 5 batches
        it = iter(train)
        stream += [next(it)[1].tolist() for _ in range(5)]
    flat = [i for b in stream for i in b]
    assert sorted(flat[:48]) == list(range(48))  # first pass: every sample once, none lost
    assert sorted(flat[48:96]) == list(range(48))  # second pass too
    full = [y.tolist() for _, y in train]
    assert len(full) == len(train) == 12

    val = _loader(files, labels, batch_size=5, train=False)
    it = iter(val)
    head = [next(it)[1].tolist() for _ in range(2)]  # like the sanity check
    epochs = [[y.tolist() for _, y in val] for _ in range(2)]
    assert epochs[0] == epochs[1] and epochs[0][:2] == head and len(epochs[0]) == len(val)


def test_state_dict_resumes_the_same_stream(jpeg_folder, tmp_path):
    files, labels = _indexed(jpeg_folder)
    first = _loader(files, labels, batch_size=4, train=True)
    it = iter(first)
    for _ in range(5):
        next(it)
    state = first.state_dict()
    assert state["yielded"] == 5 and isinstance(state["checkpoint"], (bytes, str))
    expected = [next(it) for _ in range(7)]  # the rest of the epoch
    expected += list(first)  # and the next one
    second = _loader(files, labels, batch_size=4, train=True)
    torch.save(state, tmp_path / "state.pt")  # as Lightning stores it in the checkpoint
    second.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    got = list(second) + list(second)
    assert len(got) == len(expected) == 19
    for (xa, ya), (xb, yb) in zip(expected, got, strict=True):
        assert torch.equal(ya, yb) and torch.equal(xa, xb)


def test_bad_files_are_named(jpeg_folder, tmp_path):
    files, _labels = _indexed(jpeg_folder)
    garbage = tmp_path / "garbage.jpg"
    garbage.write_bytes(b"not a jpeg at all" * 20)
    with pytest.raises(ValueError, match=r"garbage\.jpg"):
        iter(_loader([*files[:6], str(garbage)], [0] * 7, batch_size=4, train=False))
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(Path(files[0]).read_bytes()[:300])  # valid header, data cut short
    loader = _loader([*files[:6], str(truncated)], [0] * 7, batch_size=4, train=False)
    with pytest.raises(ValueError, match=r"truncated\.jpg"):
        list(loader)


def test_missing_dali_names_the_extras(jpeg_folder, monkeypatch):
    files, labels = _indexed(jpeg_folder)
    loader = _loader(files, labels, batch_size=4, train=False)
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # what a machine without DALI sees
    with pytest.raises(ModuleNotFoundError, match=r"lightning-gpuopt\[dali\].*lightning-gpuopt\[dali-cu13\]"):
        iter(loader)


def test_arguments_are_validated(jpeg_folder):
    files, labels = _indexed(jpeg_folder)
    with pytest.raises(ValueError, match="shard_id"):
        _loader(files, labels, batch_size=4, train=False, shard_id=2, num_shards=2)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        _loader(files, labels, batch_size=0, train=False)
    with pytest.raises(ValueError, match=r"labels must be one per file \(48\)"):
        _loader(files, labels[:3], batch_size=4, train=False)
    with pytest.raises(TypeError, match="options must be None or DALIOptions"):
        _loader(files, labels, batch_size=4, train=False, options={"decoder": "cpu"})
    with pytest.raises(TypeError, match="augment must be None or AugmentConfig"):
        _loader(files, labels, batch_size=4, train=True, augment=True)
    with pytest.raises(TypeError, match="num_threads"):
        _loader(
            files, labels, batch_size=4, train=False, num_threads=2
        )  # an option now: DALIOptions(threads=)
    with pytest.raises(ValueError, match="split"):
        build_dali_loader(_dm(jpeg_folder), "eval")
    with pytest.raises(ValueError, match=r"^train_dir must be a JPEG folder with backend='dali' to fit"):
        build_dali_loader(_dm(None, jpeg_folder), "train")
    assert build_dali_loader(_dm(jpeg_folder), "val") == []  # no val_dir: Lightning skips validation


def test_options_are_checked_when_made():
    with pytest.raises(
        ValueError, match=r"^dali\.decoder must be one of 'gpu', 'cpu', got 'nvjpeg'.*DALIOptions"
    ):
        DALIOptions(decoder="nvjpeg")
    with pytest.raises(TypeError, match=r"^dali\.decoder must be"):
        DALIOptions(decoder=5)  # type: ignore[arg-type]
    for bad in (0, -1):
        with pytest.raises(ValueError, match=r"^dali\.threads must be an int >= 1 or None"):
            DALIOptions(threads=bad)
    for bad in (2.0, True):
        with pytest.raises(TypeError, match=r"^dali\.threads must be an int >= 1 or None"):
            DALIOptions(threads=bad)  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        DALIOptions().decoder = "cpu"  # frozen


def test_hw_decoder_load_default_follows_the_gpu_generation(monkeypatch):
    assert dali_pipeline.default_hw_decoder_load(None) == dali_pipeline.DALI_HW_DECODER_LOAD  # CPU pipeline
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert dali_pipeline.default_hw_decoder_load(0) == 1.0  # Hopper: the hardware decoder takes every JPEG
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert dali_pipeline.default_hw_decoder_load(0) == 0.65  # A100: DALI's own default


def test_decoder_rule_weighs_the_rates_measured_on_the_runs_files():
    """The default decoder follows this host's rates, measured on the run's own files, not one host's
    training rate for one model: CPU threads where they decode at least as fast as nvJPEG here."""
    decoder, reason = choose_decoder(14, 5_900.0, 9_800.0, images=64)
    assert decoder == "gpu"
    assert reason == "nvJPEG 9,800 img/s > 14 CPU threads 5,900 img/s, measured on 64 of your files"
    decoder, reason = choose_decoder(30, 12_000.0, 9_800.0, images=64)
    assert decoder == "cpu" and reason.endswith("measured on 64 of your files: the GPU is left to the model")
    assert choose_decoder(1, 100.0, None, images=8)[0] == "cpu"
    assert not hasattr(dali_pipeline, "NVJPEG_TRAINING_RATE")  # no other host's figure stands in


def test_decode_rates_are_measured_on_the_files_with_dalis_own_decoder(jpeg_folder):
    files, _ = _indexed(jpeg_folder)
    jpegs = [Path(f).read_bytes() for f in files[:16]]
    crop = dali_pipeline.measure_decode_rates(jpegs, threads=2, device_id=None, crop=AugmentConfig())
    whole = dali_pipeline.measure_decode_rates(jpegs, threads=1, device_id=None, crop=None)
    assert crop.cpu > 0 and crop.gpu is None and (crop.images, crop.threads) == (16, 2)
    assert whole.cpu > 0 and whole.threads == 1


def test_options_resolve_the_decoder_per_run(monkeypatch):
    monkeypatch.setattr(decode, "available_cpus", lambda: 64)
    assert DALIOptions().decoder is None
    fast_cpu = dali_pipeline.DecodeRates(cpu=20_000.0, gpu=9_000.0, images=64, threads=62)
    asked: list[int] = []

    def measure(threads):
        asked.append(threads)
        return fast_cpu

    assert DALIOptions().resolved(1, measure=measure)[0] == "cpu"  # the threads decode faster here
    assert asked == [62]  # measured with the threads the CPU decoder would have: the rank's cores less two
    slow_cpu = dali_pipeline.DecodeRates(cpu=2_000.0, gpu=9_000.0, images=64, threads=14)
    assert DALIOptions().resolved(4, measure=lambda threads: slow_cpu)[:2] == ("gpu", 8)  # nvJPEG's threads
    assert DALIOptions().resolved(1)[1] == 8 and DALIOptions().resolved(8)[1] == 4
    assert DALIOptions("gpu").resolved(1) == ("gpu", 8, "DALIOptions(decoder='gpu')")  # the override
    assert DALIOptions("cpu").resolved(4, measure=measure) == ("cpu", 14, "DALIOptions(decoder='cpu')")
    assert DALIOptions("gpu").resolved(1, cuda=False)[0] == "cpu"  # a CPU pipeline decodes on the CPU
    assert DALIOptions("gpu", threads=3).resolved(1)[1] == 3
    assert len(asked) == 1  # an explicit decoder or a CPU run measures nothing


def test_the_decoder_picks_the_thread_default_and_the_datamodule_is_read(jpeg_folder, monkeypatch):
    monkeypatch.setattr(decode, "available_cpus", lambda: 16)
    assert decode.default_decode_threads("gpu", dali=True) == 8  # nvJPEG decodes: half the cores, at most 8
    assert decode.default_decode_threads("cpu", 1, dali=True) == 14  # the threads decode: all cores but two
    assert decode.default_decode_threads("cpu", 2, dali=True) == 6  # two local ranks share the 16 cores
    assert decode.default_decode_threads("cpu", 8, dali=True) == 1
    dm = _dm(jpeg_folder, dali=DALIOptions(decoder="cpu"))  # the decoder decides
    loader = build_dali_loader(dm, "train")
    assert loader.options == DALIOptions("cpu", 14)
    assert loader.feed_info == DALIFeedInfo(
        backend="dali",
        batch_size=4,
        host_batches=False,
        decoder="cpu",
        threads=14,
        decoder_reason="no CUDA device: the pipeline runs on the CPU",
    )
    assert isinstance(loader.feed_info, FeedInfo)  # the advisor reads it as any feed
    # no GPU here: the default decodes on the CPU threads, whose thread default follows
    default = build_dali_loader(dm, "train", options=DALIOptions())
    assert default.options == DALIOptions("cpu", 14)
    assert default.feed_info.decoder_reason == "no CUDA device: the pipeline runs on the CPU"
    dm = _dm(jpeg_folder, dali=DALIOptions(threads=5))  # the options' own count wins over the default
    assert build_dali_loader(dm, "train").options.threads == 5
    # num_workers counts DataLoader worker processes, which DALI has none of: refused with the option to use
    with pytest.raises(ValueError, match=r"with backend='dali'.*dali=DALIOptions\(threads=3\)"):
        _dm(jpeg_folder, num_workers=3)
    assert _dm(jpeg_folder, num_workers=0).num_workers == 0


def test_feed_info_and_fetch_seconds(jpeg_folder):
    files, labels = _indexed(jpeg_folder)
    loader = _loader(files, labels, batch_size=8, train=True, options=DALIOptions(decoder="gpu", threads=2))
    # a CPU run decodes on the CPU whatever the options say; batches are on the device, not the host
    assert loader.feed_info == DALIFeedInfo(
        backend="dali",
        batch_size=8,
        host_batches=False,
        decoder="cpu",
        threads=2,
        decoder_reason="no CUDA device: the pipeline runs on the CPU",
    )
    assert getattr(loader, FETCH_SECONDS_ATTR) == 0.0
    it = iter(loader)
    next(it)
    first = loader.fetch_seconds
    assert first > 0.0  # building the pipeline and decoding the first batch happen inside next()
    next(it)
    assert loader.fetch_seconds > first


def test_training_without_augmentation_uses_the_evaluation_transform(jpeg_folder):
    files, labels = _indexed(jpeg_folder)
    plain = _loader(files, labels, batch_size=48, train=True, augment=None)
    evaluation = _loader(files, labels, batch_size=48, train=False)
    (x_train, y_train), (x_eval, y_eval) = next(iter(plain)), next(iter(evaluation))
    assert y_train.tolist() != y_eval.tolist()  # still shuffled ...
    assert torch.equal(x_train[torch.argsort(y_train)], x_eval)  # ... the same pixels for the same files


def test_cpu_decoder_on_a_cpu_pipeline_gives_the_same_batches(jpeg_folder):
    files, labels = _indexed(jpeg_folder)
    kw = dict(batch_size=8, train=False, image_size=16, device="cpu")
    a, ya = next(iter(_loader(files[:8], labels[:8], **kw)))
    b, yb = next(iter(_loader(files[:8], labels[:8], options=DALIOptions("cpu", 1), **kw)))
    assert torch.equal(a, b) and torch.equal(ya, yb)  # without a GPU everything decodes on the CPU anyway


@pytest.mark.gpu
def test_gpu_cpu_decoder_feeds_the_gpu_like_nvjpeg(jpeg_folder):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    files, labels = _indexed(jpeg_folder)
    kw = dict(batch_size=8, train=False, image_size=24, device="cuda", dtype=torch.float16)
    gpu, gpu_labels = next(iter(_loader(files[:8], labels[:8], options=DALIOptions("gpu", 1), **kw)))
    cpu, cpu_labels = next(iter(_loader(files[:8], labels[:8], options=DALIOptions("cpu", 2), **kw)))
    assert cpu.device.type == "cuda" and cpu.dtype == torch.float16 and cpu.shape == gpu.shape
    assert cpu.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(cpu_labels, gpu_labels)
    # libjpeg-turbo and nvJPEG differ by JPEG rounding only (normalized units: 1 level is ~0.017)
    assert (cpu.float() - gpu.float()).abs().mean() < 0.05
    train = _loader(
        files, labels, batch_size=8, train=True, image_size=24, device="cuda", options=DALIOptions("cpu")
    )
    images, _ = next(iter(train))
    assert images.shape == (8, 3, 24, 24) and images.device.type == "cuda"


class _Recorder(pl.LightningModule):
    """Linear model over the batch; writes which samples each rank saw per epoch."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.lin = torch.nn.Linear(3, 1)
        self.seen: dict[str, list[int]] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.setdefault(f"train{self.current_epoch}", []).extend(y.tolist())
        return self.lin(x.float().mean((2, 3))).mean()

    def validation_step(self, batch, batch_idx):
        key = "sanity" if self.trainer.sanity_checking else f"val{self.current_epoch}"
        self.seen.setdefault(key, []).extend(batch[1].tolist())

    def on_fit_end(self):
        Path(self.out, f"rank{self.global_rank}.json").write_text(json.dumps(self.seen))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _trainer(tmp_path, **kw) -> pl.Trainer:
    kw = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 2,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "default_root_dir": str(tmp_path),
        **kw,
    }
    return pl.Trainer(**kw)


def test_lightning_fit_with_limits_validation_and_max_steps(index_folder, tmp_path):
    dm = _dm(index_folder, index_folder)
    model = _Recorder(str(tmp_path))
    trainer = _trainer(tmp_path, max_epochs=4, limit_train_batches=5, num_sanity_val_steps=2)
    trainer.fit(model, datamodule=dm)
    seen = json.loads((tmp_path / "rank0.json").read_text())
    train = [seen[f"train{e}"] for e in range(4)]
    assert all(len(t) == 20 for t in train)
    stream = [i for t in train for i in t]
    assert sorted(stream[:48]) == list(range(48))  # limited epochs still walk the whole data set once
    assert seen["sanity"] == list(range(8))
    for e in range(4):  # validation: all 48 every time, in the same order, despite the sanity check
        assert seen[f"val{e}"] == list(range(48))
    trainer = _trainer(tmp_path, max_steps=7, limit_val_batches=0)
    trainer.fit(_Recorder(str(tmp_path)), datamodule=_dm(index_folder))
    assert trainer.global_step == 7


def test_resume_from_checkpoint_mid_epoch(index_folder, tmp_path):
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    full_dir.mkdir()
    resumed_dir.mkdir()
    _trainer(tmp_path, max_epochs=2, limit_val_batches=0).fit(
        _Recorder(str(full_dir)), datamodule=_dm(index_folder)
    )
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    trainer = _trainer(
        tmp_path, max_steps=5, limit_val_batches=0, callbacks=[ckpt], enable_checkpointing=True
    )
    trainer.fit(_Recorder(str(tmp_path)), datamodule=_dm(index_folder))
    path = next((tmp_path / "ckpt").glob("*step=5*.ckpt"))
    resumed = _trainer(tmp_path, max_epochs=2, limit_val_batches=0)
    resumed.fit(_Recorder(str(resumed_dir)), datamodule=_dm(index_folder), ckpt_path=path)
    full = json.loads((full_dir / "rank0.json").read_text())
    rest = json.loads((resumed_dir / "rank0.json").read_text())
    assert rest["train0"] == full["train0"][5 * 4 :]  # the interrupted epoch continues where it stopped
    assert rest["train1"] == full["train1"]


@pytest.mark.slow
def test_ddp_two_cpu_processes(jpeg_folder, tmp_path):
    folder = _index_folder(jpeg_folder, tmp_path / "indexed", 46)  # 23 per rank: DROP keeps 5 batches of 4
    trainer = _trainer(
        tmp_path,
        devices=2,
        strategy="ddp_spawn",
        max_epochs=2,
        num_sanity_val_steps=0,
        callbacks=[CloseProcessGroup()],
    )
    trainer.fit(_Recorder(str(tmp_path)), datamodule=_dm(folder, folder))
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    for e in range(2):
        assert len(r0[f"train{e}"]) == len(r1[f"train{e}"]) == 20
        assert not set(r0[f"train{e}"]) & set(r1[f"train{e}"])
        assert sorted(r0[f"val{e}"] + r1[f"val{e}"]) == list(range(46))  # each sample once across ranks


def test_optimized_datamodule_dali_backend_fits(jpeg_folder, tmp_path):
    from lightning_gpuopt.bench.models import ImageClassifier

    dm = _dm(jpeg_folder, jpeg_folder, batch_size=8)
    trainer = _trainer(
        tmp_path, max_epochs=1, limit_train_batches=3, limit_val_batches=1, num_sanity_val_steps=0
    )
    trainer.fit(ImageClassifier("small", num_classes=3), datamodule=dm)
    assert trainer.global_step == 3
    assert torch.isfinite(trainer.callback_metrics["val/loss"])
    images, labels = next(iter(dm.train_dataloader()))
    assert images.dtype == torch.float32 and images.is_contiguous(memory_format=torch.channels_last)
    assert labels.dtype == torch.int64


@pytest.mark.gpu
def test_gpu_default_decoder_follows_the_rule_and_is_logged_once(jpeg_folder, monkeypatch, caplog):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import logging

    from lightning_gpuopt.data import dali as dali_module
    from lightning_gpuopt.data import decode_choice

    files, labels = _indexed(jpeg_folder)
    monkeypatch.setattr(decode_choice, "_LOGGED", set())
    monkeypatch.setattr(dali_module, "_MEASURED", {})
    kw = dict(batch_size=8, train=False, image_size=24, device="cuda", options=DALIOptions())
    with caplog.at_level(logging.INFO):
        loaders = [_loader(files[:8], labels[:8], **kw) for _ in range(2)]
    info = loaders[0].feed_info
    assert info.cpu_decode_rate > 0 and info.gpu_decode_rate > 0  # both measured on these files
    rule = choose_decoder(loaders[0]._rates.threads, info.cpu_decode_rate, info.gpu_decode_rate, images=8)
    assert (info.decoder, info.decoder_reason) == rule
    assert sum(info.decoder_reason in r.getMessage() for r in caplog.records) == 1  # logged once
    images, _ = next(iter(loaders[0]))
    assert images.device.type == "cuda" and images.shape == (8, 3, 24, 24)


# -- PIL's pixel limit, applied to DALI's file list as the other backends apply it -----------------------


def _limit_cases(tmp_path):
    """A PNG, a JPEG and a BMP (read by PIL's own header parser) of 100x80 = 8,000 pixels."""
    from PIL import Image

    img = Image.new("RGB", (100, 80), (200, 30, 90))
    paths = []
    for ext in ("png", "jpg", "bmp"):
        paths.append(str(tmp_path / f"big.{ext}"))
        img.save(paths[-1])
    return paths


@pytest.mark.parametrize("limit", [None, 8000, 5000, 4000, 3999, 100])
def test_the_pixel_limit_is_pils_rule_read_from_headers(tmp_path, monkeypatch, limit):
    import warnings

    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
    for path in _limit_cases(tmp_path):
        with warnings.catch_warnings(record=True) as pil_warned:
            warnings.simplefilter("always")
            try:
                Image.open(path).close()
                pil_refuses = False
            except Image.DecompressionBombError:
                pil_refuses = True
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            if pil_refuses:
                with pytest.raises(ValueError, match=rf"{path}.*decompression bomb.*MAX_IMAGE_PIXELS"):
                    dali_pipeline.validate_image_files([path], num_threads=1)
            else:
                dali_pipeline.validate_image_files([path], num_threads=1)

        def bombs(caught):
            return [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]

        assert len(bombs(warned)) == len(bombs(pil_warned))
    assert pil_refuses == (limit is not None and limit < 4000)  # PIL: refused above twice the limit


def test_a_file_over_the_pixel_limit_is_refused_before_training(jpeg_folder, tmp_path, monkeypatch):
    from PIL import Image

    from lightning_gpuopt.data.folder import load_canvas

    files, _ = _indexed(jpeg_folder)  # 64x48 = 3,072 pixels each
    big = _limit_cases(tmp_path)[0]  # 8,000 pixels
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 3500)  # refused above 7,000
    loader = _loader([*files[:6], big], [0] * 7, batch_size=4, train=True)
    with pytest.raises(ValueError, match=r"big\.png.* 100x80 = 8,000 pixels.*MAX_IMAGE_PIXELS = 3,500"):
        iter(loader)
    with pytest.raises(ValueError, match=r"big\.png.*DecompressionBombError"):  # the folder backend's refusal
        load_canvas(big, 16)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 4000)  # over it, within twice it: PIL's warning
    with pytest.warns(Image.DecompressionBombWarning, match=r"big\.png"):
        assert len(list(loader)) == 1  # trained on


def test_a_decompression_bomb_png_is_refused_at_pils_default_limit(tmp_path):
    from PIL import Image

    bomb = tmp_path / "bomb.png"
    Image.new("1", (13400, 13400)).save(bomb)  # 179.6 Mpx in about 22 kB
    assert bomb.stat().st_size < 64_000
    with pytest.raises(ValueError, match=r"bomb\.png.* 13400x13400 = 179,560,000 pixels"):
        dali_pipeline.validate_image_files([str(bomb)], num_threads=1)


def test_each_loader_measures_its_own_files_once_a_process(jpeg_folder, monkeypatch):
    """A folder's loader and a JPEG store's measure their own JPEGs (a store's are smaller, so decode
    faster); the same files, threads and device are measured once a process. The compile flag the rule once
    took in stead of the model's rate is gone: the loader measures instead."""
    from lightning_gpuopt.data import dali as dali_module

    monkeypatch.setattr(dali_module, "_MEASURED", {})
    seen: list[tuple[int, int]] = []
    real = dali_module.measure_decode_rates

    def counting(jpegs, **kw):
        seen.append((len(jpegs), sum(len(j) for j in jpegs)))
        return real(jpegs, **kw)

    monkeypatch.setattr(dali_module, "measure_decode_rates", counting)
    files, labels = _indexed(jpeg_folder)
    loader = _loader(files, labels, batch_size=4, train=True, options=DALIOptions(threads=1))
    jpegs = loader._sample_jpegs()
    assert len(jpegs) == len(files) and jpegs[0] == Path(files[0]).read_bytes()
    assert loader._measure(1) is loader._measure(1) and len(seen) == 1  # cached for the process
    assert loader._measure(2).threads == 2 and len(seen) == 2
    assert "compiled" not in DALIFeedInfo.__dataclass_fields__
