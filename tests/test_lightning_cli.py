"""``GPUOptCLI``: the config of docs/lightning_cli.md runs as written, ``--print_config`` shows the preset's
choices, a value the config sets wins, and a bad value ends with the package's one-line message."""

from __future__ import annotations

import logging
import re
import shlex
import sys
import types
from pathlib import Path

import pytest
import yaml

pytest.importorskip("jsonargparse")

from lightning_gpuopt import OptimizedDataModule
from lightning_gpuopt.bench.synthetic import make_jpeg_folder
from lightning_gpuopt.compute.precision import choose_precision
from lightning_gpuopt.lightning_cli import GPUOptCLI, parse_error_line, preset_choices

DOC = Path(__file__).resolve().parents[1] / "docs" / "lightning_cli.md"


def _blocks(language: str) -> list[str]:
    """The fenced ``language`` blocks of the docs page, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", DOC.read_text(encoding="utf-8"), re.S | re.M)


@pytest.fixture(scope="module")
def doc_main():
    """The docs page's ``main.py``, as a module (its ``__main__`` block does not run)."""
    module = types.ModuleType("lightning_cli_doc_main")
    sys.modules[module.__name__] = module
    exec(compile(_blocks("python")[0], str(DOC), "exec"), module.__dict__)
    yield module
    del sys.modules[module.__name__]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_data")
    for split, seed in (("train", 0), ("val", 1)):
        make_jpeg_folder(root / split, num_images=8, num_classes=2, image_size=(48, 36), seed=seed, workers=1)
    return root


@pytest.fixture
def config(tmp_path, monkeypatch, data):
    """The docs page's config.yaml in a folder of the test's own (the run's working directory)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["main.py"])  # the program the docs run
    monkeypatch.setenv("LIGHTNING_GPUOPT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "config.yaml"
    path.write_text(_blocks("yaml")[0], encoding="utf-8")
    return path


def _paths(data: Path) -> list[str]:
    return ["--data.train_dir", str(data / "train"), "--data.val_dir", str(data / "val")]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def log_lines():
    """The messages Lightning's logger shows (it does not propagate to pytest's capture)."""
    handler, logger = _Lines(), logging.getLogger("lightning.pytorch")
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


def _print_config(doc_main, config, data, capsys, *extra: str) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        GPUOptCLI(
            doc_main.TinyConvNet,
            OptimizedDataModule,
            args=["fit", "--config", str(config), *_paths(data), *extra, "--print_config"],
        )
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def _preset_line(lines: list[str]) -> str:
    found = [line for line in lines if line.startswith("GPUOptCLI preset")]
    assert len(found) == 1, lines
    return found[0]


def test_the_documented_config_runs_and_saves_the_preset_choices(doc_main, config, data, log_lines):
    cli = GPUOptCLI(
        doc_main.TinyConvNet,
        OptimizedDataModule,
        args=[
            "fit",
            "--config",
            str(config),
            *_paths(data),
            "--data.batch_size=4",
            "--data.num_workers=0",
            "--trainer.accelerator=cpu",
            "--trainer.max_steps=2",
            "--trainer.limit_val_batches=1",
            "--trainer.enable_progress_bar=false",
        ],
    )
    precision = choose_precision("cpu", cli.model)
    assert cli.trainer.global_step == 2
    names = [type(c).__name__ for c in cli.trainer.callbacks]
    assert {"GPUStatsMonitor", "BottleneckAdvisor", "NVTXRanges", "ChannelsLast"} <= set(names)
    assert names.count("ChannelsLast") == 1
    assert cli.preset["precision"] == precision and cli.preset["device"] == "cpu"
    saved = yaml.safe_load(Path(cli.trainer.log_dir, "config.yaml").read_text(encoding="utf-8"))
    assert saved["trainer"]["precision"] == precision
    assert [c["class_path"] for c in saved["trainer"]["callbacks"]] == [
        "lightning_gpuopt.GPUStatsMonitor",
        "lightning_gpuopt.BottleneckAdvisor",
        "lightning_gpuopt.NVTXRanges",
        "lightning_gpuopt.ChannelsLast",
    ]
    assert saved["data"]["augment"] == {"scale": [0.08, 1.0], "ratio": [0.75, 4 / 3], "flip_p": 0.5}
    line = _preset_line(log_lines)
    documented = next(b for b in _blocks("text") if b.startswith("GPUOptCLI preset")).strip()
    assert line == documented.replace("'32-true'", repr(precision))


def test_a_saved_config_runs_with_the_same_settings(doc_main, config, data, capsys, log_lines):
    first = _print_config(doc_main, config, data, capsys, "--trainer.accelerator=cpu")
    saved = config.with_name("saved.yaml")
    saved.write_text(yaml.safe_dump(first), encoding="utf-8")
    again = _print_config(doc_main, saved, data, capsys)
    paths = [[c["class_path"] for c in shown["trainer"]["callbacks"]] for shown in (first, again)]
    assert paths[0] == paths[1] and paths[1].count("lightning_gpuopt.ChannelsLast") == 1
    assert again["trainer"]["precision"] == first["trainer"]["precision"]
    assert "nothing to add" in log_lines[-1] and "kept from the config" in log_lines[-1]


def test_print_config_shows_the_preset_choices(doc_main, config, data, capsys, log_lines):
    shown = _print_config(doc_main, config, data, capsys, "--trainer.accelerator=cpu")
    precision = choose_precision("cpu", doc_main.TinyConvNet())
    assert shown["trainer"]["precision"] == precision
    assert shown["trainer"]["callbacks"][-1] == {"class_path": "lightning_gpuopt.ChannelsLast"}
    assert shown["preset"] == {"tf32": True, "fused_optimizer": True, "compile": None}
    assert shown["data"]["tuning"]["budget_s"] == 30.0
    assert f"precision={precision!r}" in _preset_line(log_lines)


def test_a_value_the_config_sets_wins(doc_main, config, data, capsys, log_lines):
    shown = _print_config(
        doc_main,
        config,
        data,
        capsys,
        "--trainer.accelerator=cpu",
        "--trainer.precision=bf16-mixed",
        "--trainer.callbacks+=lightning_gpuopt.ChannelsLast",
        "--trainer.callbacks.convert_inputs=false",
        "--preset.compile=true",
    )
    assert shown["trainer"]["precision"] == "bf16-mixed"
    callbacks = shown["trainer"]["callbacks"]
    channels_last = [c for c in callbacks if c["class_path"] == "lightning_gpuopt.ChannelsLast"]
    assert len(channels_last) == 1 and channels_last[0]["init_args"]["convert_inputs"] is False
    assert callbacks[-1] == {"class_path": "lightning_gpuopt.CompileModel"}  # preset.compile: true
    line = _preset_line(log_lines)
    assert "kept from the config: precision='bf16-mixed'" in line and "precision='32-true'" not in line


def test_trainer_defaults_callbacks_are_not_added_twice(doc_main, config, data, capsys, log_lines):
    from lightning_gpuopt import ChannelsLast

    with pytest.raises(SystemExit):
        GPUOptCLI(
            doc_main.TinyConvNet,
            OptimizedDataModule,
            trainer_defaults={"callbacks": [ChannelsLast()]},
            args=[
                "fit",
                "--config",
                str(config),
                *_paths(data),
                "--trainer.accelerator=cpu",
                "--print_config",
            ],
        )
    shown = yaml.safe_load(capsys.readouterr().out)
    assert "lightning_gpuopt.ChannelsLast" not in [c["class_path"] for c in shown["trainer"]["callbacks"]]
    assert "ChannelsLast" not in _preset_line(log_lines)


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [
        line for line in err.splitlines() if line.strip() and "Seed set" not in line and "seed.py" not in line
    ]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "Union" not in err
    return lines[0]


@pytest.mark.parametrize("print_config", [False, True], ids=["fit", "print_config"])
def test_a_bad_yaml_value_exits_with_one_line(doc_main, config, data, capsys, print_config):
    text = config.read_text(encoding="utf-8")
    assert "scale: [0.08, 1.0]" in text
    config.write_text(text.replace("scale: [0.08, 1.0]", "scale: [2, 1]"), encoding="utf-8")
    args = ["fit", "--config", str(config), *_paths(data), "--trainer.accelerator=cpu"]
    with pytest.raises(SystemExit) as exit_info:
        GPUOptCLI(
            doc_main.TinyConvNet,
            OptimizedDataModule,
            args=args + (["--print_config"] if print_config else []),
        )
    assert exit_info.value.code == 2
    assert _error_line(capsys).endswith(
        " fit: error: data.augment.scale must be a finite range with 0.0 < min <= max <= 1.0, got (2.0, 1.0)"
    )


def test_the_documented_errors(doc_main, config, data, capsys):
    """Each ``$ python main.py ...`` of the page's Errors block prints the line under it."""
    errors = next(b for b in _blocks("text") if b.startswith("$ python main.py"))
    lines = errors.strip().splitlines()
    pairs = list(zip(lines[::2], lines[1::2], strict=True))
    assert len(pairs) >= 2
    for command, expected in pairs:
        argv = shlex.split(command.removeprefix("$ "))[2:]
        argv = [str(config) if a == "config.yaml" else a for a in argv]
        with pytest.raises(SystemExit) as exit_info:
            GPUOptCLI(doc_main.TinyConvNet, OptimizedDataModule, args=[*argv, *_paths(data)])
        assert exit_info.value.code == 2
        assert _error_line(capsys) == expected


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--data.batch_size=0"], "data.batch_size must be an int >= 1, got 0"),
        (
            ["--data.tuning.budget_s=-1"],
            "data.tuning.budget_s must be a finite number > 0 (seconds), got -1.0",
        ),
        (
            [
                "--trainer.callbacks+=lightning_gpuopt.GPUStatsMonitor",
                "--trainer.callbacks.sample_period_s=-1",
            ],
            "trainer.callbacks: GPUStatsMonitor's sample_period_s must be a finite number > 0",
        ),
        (
            ["--trainer.callbacks+=lightning_gpuopt.NVTXRanges", "--trainer.callbacks.colour=red"],
            "trainer.callbacks: lightning_gpuopt.NVTXRanges has no argument 'colour'; list its arguments with "
            "`--trainer.callbacks.help lightning_gpuopt.NVTXRanges`",
        ),
    ],
    ids=["datamodule", "tuning", "callback", "callback-argument"],
)
def test_bad_values_of_the_package_classes(doc_main, config, data, capsys, args, expected):
    with pytest.raises(SystemExit) as exit_info:
        GPUOptCLI(
            doc_main.TinyConvNet,
            OptimizedDataModule,
            args=["fit", "--config", str(config), *_paths(data), *args],
        )
    assert exit_info.value.code == 2
    assert _error_line(capsys).startswith(f"main.py fit: error: {expected}")  # then the check's own fix


def test_print_config_of_an_incomplete_config_prints_it_as_lightning_does(config, capsys):
    import lightning.pytorch as pl

    class NeedsClasses(pl.LightningModule):
        def __init__(self, num_classes: int) -> None:
            super().__init__()

    with pytest.raises(SystemExit) as exit_info:
        GPUOptCLI(NeedsClasses, OptimizedDataModule, args=["fit", "--print_config"])
    assert exit_info.value.code in (0, None)
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["model"] == {"num_classes": None}
    assert "the config is incomplete" in err and "model.num_classes" in err


def test_other_classes_keep_jsonargparse_messages():
    assert parse_error_line("Parser key \"model.lr\":\n  Expected a <class 'float'>. Got value: x") is None
    line = parse_error_line(
        "Parser key \"data.batch_size\":\n  Expected a <class 'int'>. Got value: x", ["data"]
    )
    assert line == "data.batch_size must be an int, got 'x'"


def test_preset_choices_follow_the_model_and_accelerator():
    from torch import nn

    settings, callbacks, device = preset_choices(nn.Linear(4, 2), {"accelerator": "cpu", "callbacks": None})
    assert device == "cpu" and settings == {"precision": choose_precision("cpu", nn.Linear(4, 2))}
    assert callbacks == []  # no convolution: no ChannelsLast
    assert preset_choices(nn.Conv2d(3, 4, 3), {"accelerator": "tpu"}) == ({}, [], None)
