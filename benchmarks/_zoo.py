"""The benchmarks' models. The zoo of ``benchmarks/models.py``: each model, the batch it trains on, the user's
module around it, and the plain PyTorch loop it is held against.

``ZOO`` names each model's ``Spec``: its family, batch, input size and classes (a vocabulary for the language
model), the full model (torchvision's or ``transformers``', imported when built, random weights) and a small
stand-in built from ``torch.nn`` alone with the same shape of work (``--quick`` CPU runs):

============================  =================  ======================================================
model                         family             stand-in
============================  =================  ======================================================
``resnet50`` (batch 256/512)  ``conv``           ``SmallResNet``: convolutions with BatchNorm
``vit_b_16``                  ``vit``            a patch convolution, then a transformer encoder
``convnext_tiny``             ``depthwise``      depthwise 7x7 convolutions, LayerNorm, GELU
``efficientnet_b0``           ``depthwise``      depthwise 3x3 convolutions, BatchNorm, SiLU
``fcn_resnet50``              ``segmentation``   a strided conv encoder, upsampled per-pixel logits
``gpt2``                      ``lm``             a causal transformer over token embeddings
============================  =================  ======================================================

Every model trains on ``loss(model(x), y)`` with cross-entropy: labels for a classifier, a mask for the
segmentation net, next tokens for the language model. ``ZooModule`` is the user's LightningModule (SGD for
the conv nets, AdamW for the transformers and ConvNeXt); ``ZooLoop`` is the same model, loss and optimizer in
a plain loop under one ``Config`` (compile mode, autocast dtype, channels_last, fused optimizer).

The other scripts train what a user writes: ``UserClassifier`` (a ``build_model`` classifier taking the uint8
batches of a loader that leaves normalizing to the GPU), held against ``compiled_ceiling``: the same model in
a ``ZooLoop``. ``energy.py``'s rows train ``Uint8Classifier`` (uint8 batches normalized in ``forward``),
``InPlaceNormalize`` (the same, in place: no CUDA graphs) and ``GPUDecodeClassifier`` (JPEG bytes decoded on
the GPU); ``accuracy_parity.py``'s, ``ParityClassifier`` (a small ResNet, SGD with a cosine schedule, top-1).
The scripts import this module from their own folder (``python benchmarks/<script>.py`` puts
that folder first on ``sys.path``).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

from lightning_gpuopt._common import IMAGENET_MEAN, IMAGENET_STD, synchronize
from lightning_gpuopt._imports import require
from lightning_gpuopt.bench.models import ImageClassifier, SmallResNet, build_model
from lightning_gpuopt.bench.steady import Measurement, measure_loop
from lightning_gpuopt.compute.optimizer import init_momentum_buffers

#: compile modes a ``Config`` takes; ``"eager"`` is no compile, ``"default"`` is ``torch.compile``'s default
COMPILE_MODES = ("eager", "default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
#: modes that capture CUDA graphs (each step is marked as a new one)
GRAPH_MODES = ("reduce-overhead", "max-autotune")


# ------------------------------------------------------------------------------------------------ stand-ins
class TinyViT(nn.Module):
    """A patch convolution, a class token, position embeddings and a pre-norm transformer encoder."""

    def __init__(self, num_classes: int, size: int = 32, patch: int = 8, dim: int = 32) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.zeros(1, (size // patch) ** 2 + 1, dim))
        layer = nn.TransformerEncoderLayer(dim, 4, dim * 4, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.patch(x).flatten(2).transpose(1, 2)
        t = torch.cat([self.cls.expand(t.shape[0], -1, -1), t], 1) + self.pos
        return self.head(self.norm(self.encoder(t))[:, 0])


class _DepthwiseBlock(nn.Module):
    def __init__(self, dim: int, kernel: int, bn: bool) -> None:
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, kernel, padding=kernel // 2, groups=dim)
        self.norm: nn.Module = nn.BatchNorm2d(dim) if bn else nn.GroupNorm(1, dim)  # LayerNorm over C, H, W
        self.pw1, self.pw2 = nn.Conv2d(dim, dim * 4, 1), nn.Conv2d(dim * 4, dim, 1)
        self.act: nn.Module = nn.SiLU() if bn else nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pw2(self.act(self.pw1(self.norm(self.dw(x)))))


class TinyDepthwiseNet(nn.Module):
    """A strided stem, then depthwise-separable blocks (kernel 7: ConvNeXt-like; 3 with BN: EfficientNet)."""

    def __init__(self, num_classes: int, kernel: int = 7, bn: bool = False, dim: int = 32) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 4, 4)
        self.blocks = nn.Sequential(*(_DepthwiseBlock(dim, kernel, bn) for _ in range(2)))
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class TinySegNet(nn.Module):
    """A strided conv encoder with BatchNorm and per-pixel logits upsampled to the input's size."""

    def __init__(self, num_classes: int, dim: int = 16) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv2d(3, dim, 3, 2, 1, bias=False), nn.BatchNorm2d(dim), nn.ReLU(),
            nn.Conv2d(dim, dim * 2, 3, 2, 1, bias=False), nn.BatchNorm2d(dim * 2), nn.ReLU(),
        )  # fmt: skip
        self.classifier = nn.Conv2d(dim * 2, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.classifier(self.encoder(x))
        return F.interpolate(out, size=x.shape[-2:], mode="bilinear", align_corners=False)


class TinyCausalLM(nn.Module):
    """Token and position embeddings, a causal pre-norm transformer, a head tied to the embeddings."""

    def __init__(self, vocab: int, seq: int, dim: int = 32) -> None:
        super().__init__()
        self.tokens, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.zeros(1, seq, dim))
        layer = nn.TransformerEncoderLayer(dim, 4, dim * 4, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tokens(tokens) + self.pos[:, : tokens.shape[1]]
        h = self.blocks(h, mask=self.mask, is_causal=True)
        return self.norm(h) @ self.tokens.weight.t()


# ---------------------------------------------------------------------------------------------- full models
def _torchvision(name: str, **kwargs: Any) -> Callable[[int], nn.Module]:
    def build(classes: int) -> nn.Module:
        return getattr(require("torchvision").models, name)(weights=None, num_classes=classes, **kwargs)

    return build


def _fcn(classes: int) -> nn.Module:
    seg = require("torchvision").models.segmentation
    return seg.fcn_resnet50(weights=None, weights_backbone=None, num_classes=classes, aux_loss=False)


class GPT2Logits(nn.Module):
    """``transformers``' ``GPT2LMHeadModel`` of GPT-2 small's shape (random weights), returning its logits."""

    def __init__(self, vocab: int, seq: int) -> None:
        super().__init__()
        try:
            import transformers
        except ModuleNotFoundError as err:
            raise ModuleNotFoundError(
                "the gpt2 model needs transformers: `pip install transformers` (or run --quick)"
            ) from err
        config = transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=768, n_layer=12, n_head=12,
                                         use_cache=False)  # fmt: skip
        self.lm = transformers.GPT2LMHeadModel(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=tokens).logits


@dataclass(frozen=True)
class Spec:
    """One model of the zoo: what it is, what it trains on, and its stand-in.

    Attributes:
        family: ``"conv"``, ``"vit"``, ``"depthwise"``, ``"segmentation"`` or ``"lm"``.
        batch_size: samples a step (sequences for the language model).
        size: the image side, or the sequence length.
        classes: classes (a vocabulary for the language model).
        build: the full model, from ``classes`` (imports torchvision or transformers).
        stand_in: the ``--quick`` model, from ``classes``, on ``quick_size`` inputs.
        optimizer: ``"sgd"`` (momentum 0.9) or ``"adamw"``: what the user's module configures.
        run: the ``Trainer`` arguments of the long run the preset sees (its window stops it early).
        epoch_samples: samples an epoch (the loader's length is this over the batch).
    """

    family: str
    batch_size: int
    size: int
    classes: int
    build: Callable[[int], nn.Module]
    stand_in: Callable[[int], nn.Module]
    optimizer: str
    run: dict[str, Any] = field(default_factory=lambda: {"max_epochs": 90})
    epoch_samples: int = 1_281_167  # ImageNet's training set
    quick_batch: int = 4
    quick_size: int = 32
    quick_classes: int = 10

    @property
    def images(self) -> bool:
        return self.family != "lm"

    def make(self, quick: bool) -> nn.Module:
        return self.stand_in(self.quick_classes) if quick else self.build(self.classes)

    def shape(self, quick: bool) -> tuple[int, int, int]:
        """``(batch, size, classes)`` of a ``--quick`` run or of the real one."""
        if quick:
            return self.quick_batch, self.quick_size, self.quick_classes
        return self.batch_size, self.size, self.classes


_GPT2 = Spec("lm", 16, 1024, 50257, lambda v: GPT2Logits(v, 1024), lambda v: TinyCausalLM(v, 32), "adamw",
             run={"max_steps": 100_000}, quick_classes=128)  # fmt: skip
_EFFICIENTNET = Spec("depthwise", 256, 224, 1000, _torchvision("efficientnet_b0"),
                     lambda c: TinyDepthwiseNet(c, kernel=3, bn=True), "sgd")  # fmt: skip
#: the zoo, by the name ``--models`` takes
ZOO: dict[str, Spec] = {
    "resnet50": Spec("conv", 256, 224, 1000, _torchvision("resnet50"), SmallResNet, "sgd"),
    "resnet50_bs512": Spec(
        "conv", 512, 224, 1000, _torchvision("resnet50"), SmallResNet, "sgd", quick_batch=8
    ),
    "vit_b_16": Spec("vit", 128, 224, 1000, _torchvision("vit_b_16"), TinyViT, "adamw"),
    "convnext_tiny": Spec(
        "depthwise", 256, 224, 1000, _torchvision("convnext_tiny"), TinyDepthwiseNet, "adamw"
    ),
    "efficientnet_b0": _EFFICIENTNET,
    "fcn_resnet50": Spec("segmentation", 16, 512, 21, _fcn, TinySegNet, "sgd", epoch_samples=10_582),
    "gpt2": _GPT2,
}


# ------------------------------------------------------------------------------------------ batches, loss
def batches(spec: Spec, quick: bool, device: str, sets: int = 4) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One input batch on ``device`` (float channels_last images, or tokens) and ``sets`` target tensors to
    cycle through (labels, masks, next tokens), so the loss does not collapse on one fixed batch."""
    b, s, c = spec.shape(quick)
    if not spec.images:
        x = torch.randint(0, c, (b, s), device=device)
        return x, [torch.randint(0, c, (b, s), device=device) for _ in range(sets)]
    x = torch.randn(b, 3, s, s, device=device).contiguous(memory_format=torch.channels_last)
    target = (b, s, s) if spec.family == "segmentation" else (b,)
    return x, [torch.randint(0, c, target, device=device) for _ in range(sets)]


def task_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of logits (a torchvision segmentation net's ``{"out": ...}`` too) against ``y``: classes,
    a per-pixel mask, or a token at each position."""
    logits = out["out"] if isinstance(out, dict) else out
    if logits.ndim == 3:  # (batch, positions, vocabulary)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    return F.cross_entropy(logits, y)


def make_optimizer(spec: Spec, params: Any, fused: bool | None = None) -> torch.optim.Optimizer:
    """The user's optimizer: SGD (momentum 0.9, weight decay 1e-4, lr 0.01: the plain loops' rate) or AdamW
    (decay 0.05)."""
    if spec.optimizer == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=1e-4, fused=fused)
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.05, fused=fused)


class ZooModule(pl.LightningModule):
    """A zoo model as a user writes its LightningModule: ``loss(self(x), y)``, its own optimizer (unfused).

    Example:
        >>> module = ZooModule(ZOO["resnet50"], quick=True)
        >>> x, ys = batches(ZOO["resnet50"], True, "cpu")
        >>> module.training_step((x, ys[0]), 0).ndim
        0
    """

    def __init__(self, spec: Spec, quick: bool = False) -> None:
        super().__init__()
        self.spec = spec
        self.model = spec.make(quick)

    @override
    def forward(self, x: torch.Tensor) -> Any:
        return self.model(x)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = task_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.spec, self.parameters())


# ------------------------------------------------------------------------------------------------- ceiling
@dataclass(frozen=True)
class Config:
    """One plain-loop configuration: ``compile`` (a ``COMPILE_MODES`` entry), autocast ``dtype`` (``"fp16"``
    with a GradScaler), ``channels_last`` (model and batch), ``fused`` optimizer.

    Its ``name`` is ``mode:dtype[:cl][:unfused]``, which ``Config.parse`` reads back.

    Example:
        >>> Config.parse("reduce-overhead:bf16:cl")
        Config(compile='reduce-overhead', dtype='bf16', channels_last=True, fused=True)
        >>> Config("default", "fp16", False, False).name
        'default:fp16:unfused'
    """

    compile: str = "eager"
    dtype: str = "bf16"
    channels_last: bool = False
    fused: bool = True

    @property
    def name(self) -> str:
        return ":".join(
            [self.compile, self.dtype] + ["cl"] * self.channels_last + ["unfused"] * (not self.fused)
        )

    @classmethod
    def parse(cls, name: str) -> Config:
        mode, dtype, *flags = [*name.split(":"), ""][: max(2, name.count(":") + 1)]
        if mode not in COMPILE_MODES or dtype not in DTYPES or not set(flags) <= {"cl", "unfused"}:
            raise ValueError(
                f"--search: {name!r} is not a configuration; write mode:dtype[:cl][:unfused], mode one of "
                f"{', '.join(COMPILE_MODES)}, dtype one of {', '.join(DTYPES)} (e.g. default:bf16:cl)"
            )
        return cls(mode, dtype, "cl" in flags, "unfused" not in flags)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **asdict(self)}


class ZooLoop:
    """A plain PyTorch training loop of one zoo model on a batch kept on the device, under ``config``.

    ``step`` runs one asynchronous step; ``bench.steady.measure_loop(loop.step, ...)`` measures it. The first
    steps compile a compiled configuration (``warm`` runs them and returns their seconds).

    Example:
        >>> loop = ZooLoop(ZOO["gpt2"], Config("eager", "fp32"), "cpu", quick=True)
        >>> loop.warm(2) > 0
        True
    """

    def __init__(self, spec: Spec, config: Config, device: str, quick: bool = False) -> None:
        self.config, self.device = config, torch.device(device)
        self.batch_size = spec.shape(quick)[0]
        fmt = torch.channels_last if config.channels_last else torch.contiguous_format
        model = spec.make(quick).to(self.device)
        if spec.images:
            model = model.to(memory_format=fmt)  # type: ignore[call-overload]
        model.train()
        mode = None if config.compile == "default" else config.compile
        self.model = model if config.compile == "eager" else torch.compile(model, mode=mode, dynamic=False)
        x, self.ys = batches(spec, quick, device)
        self.x = x.contiguous(memory_format=fmt) if spec.images else x
        self.dtype = DTYPES[config.dtype]
        self.opt = make_optimizer(spec, model.parameters(), fused=config.fused or None)
        init_momentum_buffers(self.opt)  # a first step the GradScaler skips keeps zero momentum
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.dtype == torch.float16)
        self._count = 0

    def step(self) -> None:
        """One training step on the resident batch (its targets cycle)."""
        y = self.ys[self._count % len(self.ys)]
        self._count += 1
        self.opt.zero_grad(set_to_none=True)
        if self.config.compile in GRAPH_MODES:
            torch.compiler.cudagraph_mark_step_begin()
        dtype = self.dtype
        with torch.autocast(self.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = task_loss(self.model(self.x), y)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()

    def warm(self, steps: int) -> float:
        """Seconds of the first ``steps`` steps, synchronised (a compiled configuration compiles in them)."""
        synchronize(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        synchronize(self.device)
        return time.perf_counter() - t0


# ------------------------------------------------------------------------------------- the user's classifier
class UserClassifier(pl.LightningModule):
    """A classifier as a user writes it: ``arch`` (``"resnet50"``: torchvision's), cross-entropy, its own
    SGD (momentum 0.9) at the plain loop's rate, so both sides make the same update; uint8 batches are
    normalized in ``training_step``.

    Example:
        >>> model = UserClassifier("small", num_classes=10)
        >>> x = torch.randint(0, 255, (2, 3, 32, 32), dtype=torch.uint8)
        >>> model.training_step((x, torch.zeros(2).long()), 0).ndim
        0
    """

    def __init__(self, arch: str = "resnet50", num_classes: int = 10, lr: float = 0.01) -> None:
        super().__init__()
        self.model = build_model(arch, num_classes)
        self.lr = lr
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1) * 255, persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255, persistent=False)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if x.dtype == torch.uint8:  # a loader that leaves normalizing to the GPU
            x = ((x.float() - self.mean) / self.std).contiguous(memory_format=torch.channels_last)
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=1e-4)


def compiled_ceiling(arch: str, batch_size: int, image_size: int, num_classes: int, device: str,
                     compile: bool = True) -> tuple[ZooLoop, float]:
    """``UserClassifier``'s model in a ``ZooLoop`` on one batch kept on ``device`` (fp16 autocast on CUDA,
    channels_last, fused SGD there), compiled, and the seconds its first steps took (the compile)."""
    build = lambda classes: build_model(arch, classes)  # noqa: E731
    spec = Spec("conv", batch_size, image_size, num_classes, build, build, "sgd")
    cuda = device == "cuda"
    config = Config("default" if compile else "eager", "fp16" if cuda else "fp32", channels_last=True, fused=cuda)
    loop = ZooLoop(spec, config, device)
    return loop, loop.warm(3)


def measure_ceiling(loop: ZooLoop, warmup: int, steps: int) -> Measurement:
    """``steps`` steps of the plain loop after ``warmup``, on the GPU's clock."""
    return measure_loop(loop.step, loop.device, warmup, steps, loop.batch_size)


# ----------------------------------------------------------------------------- the energy rows' classifiers
class Uint8Classifier(ImageClassifier):
    """``ImageClassifier`` fed uint8 batches, as a user whose loader leaves normalizing to the GPU writes it:
    ``training_step`` makes them float (0-255) and ``forward`` normalizes them."""

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, model: Any = "small", num_classes: int = 10, lr: float = 0.05) -> None:
        super().__init__(model, num_classes, lr)
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1) * 255, persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model((x - self.mean) / self.std)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return super().training_step((x.float() if x.dtype == torch.uint8 else x, y), batch_idx)


class InPlaceNormalize(Uint8Classifier):
    """Normalizes its input in place inside ``forward``: the compiled graph changes one of its inputs, for
    which torch records no CUDA graphs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.sub_(self.mean).div_(self.std))


class EncodedJPEGs:
    """A batch's JPEG files as host tensors of bytes: not a collection, so Lightning leaves them on the host
    (``decode_jpeg(device="cuda")`` reads host bytes)."""

    def __init__(self, data: list[torch.Tensor]) -> None:
        self.data = data


def random_resized_crop(img: torch.Tensor, size: int) -> torch.Tensor:
    """torchvision's ``RandomResizedCrop(size)`` (scale 0.08-1, ratio 3/4-4/3) of a CHW uint8 image, resized
    antialiased: a ``(1, C, size, size)`` float tensor on the image's device."""
    _, h, w = img.shape
    ch, cw = min(h, w), min(h, w)
    top, left = (h - ch) // 2, (w - cw) // 2  # the central square where ten draws do not fit
    for _ in range(10):
        area = h * w * random.uniform(0.08, 1.0)
        ratio = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
        tw, th = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
        if 0 < tw <= w and 0 < th <= h:
            ch, cw, top, left = th, tw, random.randint(0, h - th), random.randint(0, w - tw)
            break
    crop = img[None, :, top : top + ch, left : left + cw].float()
    return F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)


class GPUDecodeClassifier(Uint8Classifier):
    """``Uint8Classifier`` whose batches arrive as JPEG bytes, decoded on the GPU by torchvision's batched
    ``decode_jpeg`` (nvJPEG) in ``on_after_batch_transfer``, then cropped and flipped there."""

    def __init__(self, model: Any = "small", num_classes: int = 10, image_size: int = 224) -> None:
        super().__init__(model, num_classes)
        self.image_size = image_size

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        encoded, y = batch
        if not isinstance(encoded, EncodedJPEGs):
            return batch
        from torchvision.io import ImageReadMode, decode_jpeg

        images = decode_jpeg(encoded.data, mode=ImageReadMode.RGB, device=self.device)
        x = torch.cat([random_resized_crop(img, self.image_size) for img in images])
        flip = torch.rand(x.shape[0], device=x.device) < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(3), x).round_().clamp_(0, 255)
        return x.to(torch.uint8).contiguous(memory_format=torch.channels_last), y


# ------------------------------------------------------------------------------------- accuracy_parity.py's
class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c, c, 3, 1, 1, bias=False),
            nn.BatchNorm2d(c),
            nn.ReLU(inplace=True),
            nn.Conv2d(c, c, 3, 1, 1, bias=False),
            nn.BatchNorm2d(c),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.body(x))


def _conv_bn(cin: int, cout: int, stride: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


class ParityNet(nn.Module):
    """Three stages (``width``, ``2 width``, ``4 width`` channels), each a strided conv + ``blocks`` residual
    blocks (a plain conv when ``blocks`` is 0), global average pooling and a linear classifier."""

    def __init__(self, num_classes: int, width: int = 16, blocks: int = 0) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for stage, c in enumerate((width, 2 * width, 4 * width)):
            layers += _conv_bn(cin, c, 1 if stage == 0 else 2)
            layers += [_Block(c) for _ in range(blocks)] if blocks else _conv_bn(c, c, 1)
            cin = c
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


class ParityClassifier(pl.LightningModule):
    """``ParityNet`` trained with SGD (momentum 0.9, nesterov, weight decay 5e-4), one epoch of linear
    warm-up then cosine decay; counts top-1 over each whole validation pass (``top1``).

    Example:
        >>> model = ParityClassifier(num_classes=4, width=16, blocks=0, lr=0.1)
        >>> pl.Trainer(max_epochs=16).fit(model, datamodule=dm)  # doctest: +SKIP
        >>> model.top1  # fraction correct in the last validation pass  # doctest: +SKIP
    """

    def __init__(self, num_classes: int, width: int, blocks: int, lr: float) -> None:
        super().__init__()
        self.net = ParityNet(num_classes, width, blocks)
        self.lr = lr
        self.correct = 0
        self.seen = 0
        self.top1: float | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def on_validation_epoch_start(self) -> None:
        self.correct, self.seen = 0, 0

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.correct += int((self(x).argmax(1) == y).sum())
        self.seen += int(y.numel())

    def on_validation_epoch_end(self) -> None:
        self.top1 = self.correct / max(1, self.seen)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
        total = int(self.trainer.estimated_stepping_batches)
        warm = max(1, total // max(1, self.trainer.max_epochs or 1))

        def factor(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
