"""``GPUOptCLI``: ``LightningCLI`` with the compute preset applied to the model the config builds and written
into the config, and one-line errors for this package's classes (docs/lightning_cli.md)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import re
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
from lightning.pytorch import Callback, LightningDataModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_gpuopt.compute.preset import PRESET_DDP_KWARGS, fast_trainer_kwargs

__all__ = ["GPUOptArgumentParser", "GPUOptCLI", "preset_choices"]

_PACKAGE = "lightning_gpuopt"
_PACKAGE_DIR = str(Path(__file__).resolve().parent)
_THIS_FILE = str(Path(__file__).resolve())  # an error of the CLI's own code keeps its traceback
_PRINT_CONFIG = "--print_config"
#: the Trainer settings the preset chooses when the config leaves them unset (``None``)
_CHOSEN = ("precision", "benchmark")
#: the Trainer settings ``fast_trainer_kwargs`` reads from the config
_READ = ("precision", "benchmark", "deterministic", "strategy")
#: a message of the package's own argument checks: ``<name> must be ..., got ...`` or ``<name>=... does not ...``
_OWN_MESSAGE = re.compile(r"^[A-Za-z_][\w.\[\]]*(?: must | ?=.* (?:does not|is not|cannot) )")
_PARSER_KEY = re.compile(r'^Parser key "([^"]+)":\s*\n?(.*)\Z', re.S)
_CLASS_PROBLEM = re.compile(
    r"Problem with given class_path '([\w.]+)':\s*\n(.*?)(?=\n\s*- |\n\s*Given value|\Z)", re.S
)
_EXPECTED = re.compile(r"^Expected an? <class '([\w.]+)'>\.? ?(?:Got value: (.*))?\Z", re.S)
_NOT_ACCEPTED = re.compile(r"^Option '([^']+)' is not accepted")
_SUBTYPES = re.compile(r"Subtypes: \[(.*?)\]\n")
_GIVEN = re.compile(r"Given value: (.*)\Z", re.S)
_KINDS = {"str": "a string", "int": "an int", "float": "a number", "bool": "true or false"}
#: the ``preset:`` section: name, type, default, help
_PRESET_OPTIONS = (
    ("tf32", bool, True, "Enable TF32 for fp32 matmuls and convolutions on CUDA."),
    ("fused_optimizer", bool, True, "Under 16-mixed (and bf16-mixed on CUDA), add FusedOptimizer."),
    ("compile", bool | None, None, "null: CompileModel(when='auto'); true: CompileModel(); false: none."),
)


def _device(trainer_config: dict[str, Any]) -> str | None:
    """The device ``trainer.accelerator`` names; ``None``: not CPU or CUDA."""
    accelerator = trainer_config.get("accelerator", "auto")
    name = accelerator.lower() if isinstance(accelerator, str) else type(accelerator).__name__.lower()
    cuda = torch.cuda.is_available()
    if name in ("cpu", "cpuaccelerator") or (name == "auto" and not cuda):
        return "cpu"
    if name in ("gpu", "cuda", "auto", "cudaaccelerator") and cuda:
        devices = trainer_config.get("devices", "auto")
        if isinstance(devices, (list, tuple)) and devices and isinstance(devices[0], int):
            return f"cuda:{devices[0]}"
        return "cuda"
    return None


def preset_choices(
    model: nn.Module | None,
    trainer_config: dict[str, Any],
    *,
    tf32: bool = True,
    fused_optimizer: bool = True,
    compile: bool | None = None,
) -> tuple[dict[str, Any], list[Callback], str | None]:
    """What ``fast_trainer_kwargs`` adds to a config's trainer settings for ``model``.

    Args:
        model: the model the run trains (``None``: unknown).
        trainer_config: the ``Trainer`` arguments the config gives (instantiated: callbacks are objects); its
            ``precision``, ``benchmark`` and callbacks are kept.
        tf32, fused_optimizer, compile: as ``fast_trainer_kwargs`` takes them.

    Returns:
        ``(settings, callbacks, device)``: the Trainer settings the preset chooses, the callbacks it adds after
        the config's, and the device it chose for (``None`` for an accelerator other than CPU and CUDA).

    Example:
        >>> from torch import nn
        >>> settings, callbacks, device = preset_choices(nn.Conv2d(3, 8, 3), {"accelerator": "cpu"})
        >>> sorted(settings), [type(c).__name__ for c in callbacks], device
        (['precision'], ['ChannelsLast'], 'cpu')
    """
    device = _device(trainer_config)
    if device is None:
        return {}, [], None
    given = {key: trainer_config[key] for key in _READ if trainer_config.get(key) is not None}
    listed = _as_list(trainer_config.get("callbacks"))
    kwargs = fast_trainer_kwargs(
        model, device, tf32=tf32, fused_optimizer=fused_optimizer, compile=compile, callbacks=listed, **given
    )
    settings = {key: kwargs[key] for key in _CHOSEN if key not in given and key in kwargs}
    if "strategy" in given and kwargs["strategy"] is not given["strategy"]:
        settings["strategy"] = kwargs["strategy"]
    added = [c for c in kwargs["callbacks"] if not any(c is mine for mine in listed)]
    return settings, added, device


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _config_entry(obj: Any) -> Any:
    """``obj`` as a config entry: its class path and the constructor arguments that differ from defaults."""
    from jsonargparse import Namespace

    cls = type(obj)
    public = (
        cls.__module__.startswith(_PACKAGE + ".")
        and cls.__name__ in importlib.import_module(_PACKAGE).__all__
    )
    entry = Namespace(class_path=f"{_PACKAGE if public else cls.__module__}.{cls.__name__}")
    init_args = {
        p.name: getattr(obj, p.name)
        for p in inspect.signature(cls).parameters.values()
        if hasattr(obj, p.name) and getattr(obj, p.name) != p.default
    }
    if init_args:
        entry.init_args = Namespace(**init_args)
    return entry


def _describe(settings: dict[str, Any], callbacks: Sequence[Callback], kept: dict[str, Any]) -> str:
    parts = [
        f"{k}={'DDPStrategy(...)' if isinstance(v, DDPStrategy) else repr(v)}" for k, v in settings.items()
    ]
    if callbacks:
        parts.append("callbacks + " + ", ".join(type(c).__name__ for c in callbacks))
    text = "; ".join(parts) if parts else "nothing to add"
    if kept:
        text += "; kept from the config: " + ", ".join(f"{k}={v!r}" for k, v in kept.items())
    return text


def _fail(prog: str, message: str) -> NoReturn:
    sys.stderr.write(f"{prog.replace(' [options]', '')}: error: {message}\n")
    raise SystemExit(2)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _own_message(text: str) -> str | None:
    """The first line of ``text`` that one of the package's checks wrote."""
    for line in text.splitlines():
        line = line.strip().removeprefix("- ").strip()
        if _OWN_MESSAGE.match(line):
            return line
    return None


def _expected(key: str, detail: str) -> str | None:
    found = _EXPECTED.match(detail.strip())
    if found is None:
        return None
    kind, given = found.group(1).rpartition(".")[2], found.group(2)
    return f"{key} must be {_KINDS.get(kind, f'a {kind}')}" + (
        f", got {given.strip()!r}" if given is not None else ""
    )


def _subtype_names(text: str) -> list[str]:
    found = _SUBTYPES.search(text)
    names = []
    for path in re.findall(r"<class '([\w.]+)'>", found.group(1) if found else ""):
        module, _, name = path.rpartition(".")
        if name in ("NoneType", "bool"):
            names.append("null" if name == "NoneType" else "true or false")
            continue
        cls = getattr(sys.modules.get(module), name, None)
        fields = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []
        article = "an" if name[:1].lower() in "aeiou" else "a"
        names.append(f"{article} {name} mapping ({', '.join(fields)})" if fields else name)
    return names


def parse_error_line(message: str, package_keys: Sequence[str] = ()) -> str | None:
    """One line for a jsonargparse parse ``message`` about one of this package's classes (or under one of the
    ``package_keys``, such as ``"data"``); ``None`` for other errors."""
    found = _PARSER_KEY.match(message.strip())
    if found is None:
        return None
    key, rest = found.groups()
    if _PACKAGE not in rest and key.split(".")[0] not in package_keys:
        return None
    problem = next((p for p in _CLASS_PROBLEM.finditer(rest) if p.group(1).startswith(_PACKAGE)), None)
    if problem is not None:
        cls, detail = problem.group(1), problem.group(2).strip()
        inner = _PARSER_KEY.match(detail)
        if inner is not None:
            line = _expected(f"{key}.{inner.group(1)}", inner.group(2))
            return line or f"{key}.{inner.group(1)}: {_one_line(inner.group(2))}"
        unknown = _NOT_ACCEPTED.match(detail)
        if unknown is not None:
            return (
                f"{key}: {cls} has no argument {unknown.group(1)!r}; "
                f"list its arguments with `--{key}.help {cls}`"
            )
        return f"{key} ({cls}): {_one_line(detail)}"
    line = _expected(key, rest)
    if line is not None:
        return line
    names = _subtype_names(rest)
    if names:
        given = _GIVEN.search(rest)
        return f"{key} must be " + " or ".join(names) + (f", got {given.group(1).strip()!r}" if given else "")
    return f"{key}: {_one_line(rest)}"


def _from_package(err: BaseException) -> bool:
    frames = [frame.f_code.co_filename for frame, _ in traceback.walk_tb(err.__traceback__)]
    return bool(frames) and _in_package(frames[-1])


def _chain(err: BaseException) -> list[BaseException]:
    seen = [err]
    while (cause := seen[-1].__cause__ or seen[-1].__context__) and all(cause is not s for s in seen):
        seen.append(cause)
    return seen


def instantiation_error_line(err: BaseException, config: Any) -> str | None:
    """One line for an error one of this package's classes raised while the ``config`` was built, its
    argument named by its config key (``data.augment.scale``); ``None`` for an error from other code."""
    ours = next(
        (e for e in _chain(err) if _from_package(e) and isinstance(e, (ValueError, TypeError, OSError))), None
    )
    if ours is None or not str(ours):
        return None
    text = _own_message(str(ours)) or _one_line(str(ours))
    owner = _raising_class(ours)
    if owner is not None and issubclass(owner, Callback):
        return f"trainer.callbacks: {owner.__name__}'s {text}"
    name = re.split(r"[ =]", text, maxsplit=1)[0]
    keys = [k for k in config.keys(branches=True) if not k.rpartition(".")[2].startswith("__")]
    if owner is not None and issubclass(owner, LightningDataModule):
        keys = [k for k in keys if k.startswith("data.")]
    matches = [k for k in keys if k == name or k.endswith("." + name)]
    if len(matches) == 1 and matches[0] != name:
        return matches[0] + text[len(name) :]
    return f"{owner.__name__}: {text}" if owner is not None and not matches else text


def _in_package(filename: str) -> bool:
    path = str(Path(filename).resolve())
    return path.startswith(_PACKAGE_DIR) and path != _THIS_FILE


def _raising_class(err: BaseException) -> type | None:
    """The class whose method in this package raised ``err`` (the outermost such frame)."""
    for frame, _ in traceback.walk_tb(err.__traceback__):
        owner = frame.f_locals.get("self")
        if owner is not None and _in_package(frame.f_code.co_filename):
            return type(owner)
    return None


class GPUOptArgumentParser(LightningArgumentParser):
    """``LightningArgumentParser`` whose parse errors about this package's classes are one line
    (``data.augment.flip_p must be a number, got 'foo'``); ``GPUOptCLI`` uses it."""

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if self.exit_on_error:
            keys = [
                key
                for key, group in getattr(self, "groups", {}).items()
                if getattr(getattr(group, "group_class", None), "__module__", "").startswith(_PACKAGE)
            ]
            line = parse_error_line(message, keys)
            if line is not None:
                _fail(self.prog, line)
        super().error(message, ex)


class GPUOptCLI(LightningCLI):
    """``LightningCLI`` that applies ``fast_trainer_kwargs`` to the model it builds and writes the choices into
    the config (a value the config sets wins); a ``preset:`` section holds its options, and a bad value for
    this package's classes ends with one line (docs/lightning_cli.md).

    Example::

        GPUOptCLI(MyLightningModule, OptimizedDataModule)  # python main.py fit --config config.yaml
    """

    def __init__(
        self, *args: Any, parser_class: type[LightningArgumentParser] = GPUOptArgumentParser, **kwargs: Any
    ):
        if importlib.util.find_spec("jsonargparse") is None:
            raise ModuleNotFoundError(
                "GPUOptCLI needs jsonargparse. Install it with `pip install 'lightning-gpuopt[all]'` "
                "(or `pip install 'jsonargparse[signatures]'`)."
            )
        self._print_flags: list[str] | None = None
        self._parsers: list[LightningArgumentParser] = []
        self.preset: dict[str, Any] = {}
        super().__init__(*args, parser_class=parser_class, **kwargs)

    @override
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        parser = super().init_parser(**kwargs)
        self._parsers.append(parser)  # the subcommand's, found by its prog, dumps --print_config
        return parser

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        for name, kind, default, help_text in _PRESET_OPTIONS:
            parser.add_argument(f"--preset.{name}", type=kind, default=default, help=help_text)

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        argv = sys.argv[1:] if args is None else args
        argv = [str(a) for a in argv] if isinstance(argv, (list, tuple)) else []  # a dict: no flags
        flags = [a for a in argv if a == _PRINT_CONFIG or a.startswith(_PRINT_CONFIG + "=")]
        if not flags:
            super().parse_arguments(parser, args)
            return
        rest = [a for a in argv if a not in flags]
        exit_on_error, parser.exit_on_error = parser.exit_on_error, False
        try:
            self.config = parser.parse_args(rest)
        except Exception as err:  # an incomplete config (or a bad one): LightningCLI's own path reports it
            if "required" in str(err):
                sys.stderr.write(
                    f"{parser.prog}: the config is incomplete ({_one_line(str(err))}); printing it without the "
                    "preset's choices\n"
                )
            parser.exit_on_error = exit_on_error
            self.config = parser.parse_args(argv)
            return
        finally:
            parser.exit_on_error = exit_on_error
        self._print_flags = [f for flag in flags for f in flag.partition("=")[2].split(",") if f]

    @override
    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError, OSError) as err:
            line = instantiation_error_line(err, self._section(self.config))
            if line is None:
                raise
            _fail(self.parser.prog + (f" {self.subcommand}" if self.subcommand else ""), line)

    def _section(self, config: Any) -> Any:
        return config.get(str(self.subcommand), config) if self.subcommand else config

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        section, built = self._section(self.config), self._section(self.config_init)
        trainer_config = {**(built.get("trainer") or {}), **kwargs}
        options = section.get("preset")
        options = options.as_dict() if hasattr(options, "as_dict") else dict(options or {})
        model = self.model if isinstance(self.model, nn.Module) else None
        listed = _as_list(trainer_config.get("callbacks"))
        defaults = _as_list(self.trainer_defaults.get("callbacks"))  # LightningCLI adds these itself
        settings, added, device = preset_choices(
            model,
            {**trainer_config, "callbacks": listed + defaults},
            **options,  # type: ignore[arg-type]
        )
        kept = {k: trainer_config[k] for k in _CHOSEN if trainer_config.get(k) is not None}
        self._record(section, settings, added)
        self.preset = {**settings, "callbacks": added, "device": device}
        what = type(model).__name__ if model is not None else "no model"
        rank_zero_info(
            f"GPUOptCLI preset for {what} on {device}: {_describe(settings, added, kept)} "
            "(a value the config sets wins; the preset's options are under preset:)"
            if device is not None
            else "GPUOptCLI preset: nothing chosen (it chooses for CPU and CUDA runs; "
            f"trainer.accelerator is {trainer_config.get('accelerator')!r})"
        )
        if self._print_flags is not None:
            self._print_config(self._print_flags)
        return super().instantiate_trainer(**{**kwargs, **settings, "callbacks": listed + added})

    def _record(self, section: Any, settings: dict[str, Any], added: list[Callback]) -> None:
        """Write the preset's choices into the config (the saved config.yaml and --print_config show them)."""
        from jsonargparse import Namespace

        trainer = section.get("trainer")
        if trainer is None:
            return
        ddp = Namespace(
            class_path="lightning.pytorch.strategies.DDPStrategy", init_args=Namespace(**PRESET_DDP_KWARGS)
        )
        for key, value in settings.items():
            trainer[key] = ddp if isinstance(value, DDPStrategy) else value
        if added:
            trainer["callbacks"] = _as_list(trainer.get("callbacks")) + [_config_entry(c) for c in added]

    def _print_config(self, flags: list[str]) -> NoReturn:
        """Print the subcommand's config as ``--print_config`` does, and exit."""
        known = {"skip_default", "skip_unset"}
        if importlib.util.find_spec("ruamel") is not None:  # jsonargparse writes comments with ruamel.yaml
            known.add("comments")
        unknown = [f for f in flags if f not in known]
        if unknown:
            _fail(
                self.parser.prog, f"{_PRINT_CONFIG} flags must be among {sorted(known)}, got {unknown[0]!r}"
            )
        mine = [p for p in self._parsers if self.subcommand and p.prog.endswith(f" {self.subcommand}")]
        sys.stdout.write(
            (mine[0] if mine else self.parser).dump(
                self._section(self.config),
                skip_unset="skip_unset" in flags,
                skip_default="skip_default" in flags,
                with_comments="comments" in flags,
            )
        )
        raise SystemExit(0)
