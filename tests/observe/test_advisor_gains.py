"""Every warning states the most its fix is worth (``Verdict.gain``), from the ceiling where the monitor
measured it and from the share of time the verdict rests on otherwise; the host-sync locator's lines reach
the advice; the summary leads with the run's share of its ceiling."""

from __future__ import annotations

import pytest

from lightning_gpuopt.observe.advisor import Verdict, diagnose, format_summary

CUDA = {"device_type": "cuda", "cpus": 16, "num_workers": 2, "batch_size": 64}


def _one(window, cfg, kind):
    (v,) = [v for v in diagnose(window, cfg) if v.kind == kind]
    return v


def test_input_bound_gain_from_the_ceiling_else_from_the_idle_share():
    window = {"gpu/idle_frac": 0.4, "time/loader_wait_frac": 0.35, "gpu/util": 55.0}
    assert _one(window, CUDA, "input-bound").gain == pytest.approx(1 / 0.6)
    measured = _one({**window, "gpu/ceiling_frac": 0.625}, CUDA, "input-bound")
    assert measured.gain == pytest.approx(1.6) and measured.evidence["ceiling_frac"] == 0.625
    assert measured.gain_text == "up to 1.60x"
    cpu = _one(
        {"time/data_wait_frac": 0.375, "time/data_wait_ms": 30.0}, {"device_type": "cpu"}, "input-bound"
    )
    assert cpu.gain == pytest.approx(1.6)


def test_host_bound_launch_bound_and_ranks_gains():
    host = _one({"gpu/idle_frac": 0.5, "time/loader_wait_frac": 0.01, "gpu/util": 50.0}, CUDA, "host-bound")
    assert host.gain == pytest.approx(2.0)
    launch = {
        "gpu/idle_frac": 0.02,
        "gpu/util": 36.0,
        "gpu/step_idle_frac": 0.62,
        "time/data_wait_frac": 0.01,
    }
    assert _one(launch, CUDA, "launch-bound").gain == pytest.approx(1 / (1 - 0.64))
    # the replay holds the same syncs: a ceiling at 1.10 does not hide the idle share inside steps
    assert _one({**launch, "gpu/ceiling_frac": 1.1}, CUDA, "launch-bound").gain == pytest.approx(1 / 0.36)
    unmeasured = {k: v for k, v in launch.items() if k != "gpu/step_idle_frac"}
    assert _one({**unmeasured, "gpu/ceiling_frac": 0.5}, CUDA, "launch-bound").gain == pytest.approx(2.0)
    ranks = {"step_ms": [100.0, 100.0], "data_wait_ms": [1.0, 1.0], "allreduce_wait_ms": [30.0, 5.0]}
    late = _one({"ranks": ranks}, {"device_type": "cuda", "world_size": 2}, "straggler")
    assert late.gain == pytest.approx(1 / (1 - 0.25))


def test_compute_verdicts_say_no_figure_bounds_them():
    cfg = {"device_type": "cuda", "capability": (9, 0), "precision": "32-true"}
    v = _one({"gpu/util": 99.0, "gpu/idle_frac": 0.0}, cfg, "fp32-on-tensor-cores")
    assert v.gain is None and v.gain_text == "gain not bounded by these figures"


def test_the_locators_lines_lead_the_launch_bound_advice():
    site = "`model.py:42` synchronizes every step (`loss.item()`)"
    window = {"gpu/idle_frac": 0.026, "gpu/util": 82.0, "gpu/step_idle_frac": 0.15, "sync_sites": [site]}
    v = _one(window, CUDA, "launch-bound")  # GPU-Util 82% alone would not make it launch-bound
    assert v.advice.startswith(site) and "Keep those values on the GPU" in v.advice
    assert ".item(), .cpu(), printing tensors" not in v.advice  # the generic list gives way to the lines
    assert not [x for x in diagnose({**window, "sync_sites": []}, CUDA) if x.kind == "launch-bound"]


def test_the_summary_states_the_ceiling_and_each_warnings_gain():
    v = Verdict("input-bound", {"gpu_idle_frac": 0.4}, "Use more workers.", cause="too-few-workers", gain=1.6)
    text = format_summary([v], 3, 50, 20, ceiling_frac=0.62)
    lines = text.splitlines()
    assert lines[1] == (
        "  This run trains at 0.62 of its own ceiling (the model replayed on a batch kept on the device)."
    )
    assert lines[2] == "  [warning] input-bound (too-few-workers): up to 1.60x; gpu_idle_frac=0.4"
    assert format_summary([], 3, 50, 20, ceiling_frac=0.97).endswith("no bottleneck found; this run trains at "
                                                                     "0.97 of its own ceiling (the model "
                                                                     "replayed on a batch kept on the device).")  # fmt: skip
    assert "trains at its own ceiling (1.10 of" in format_summary([], 3, 50, 20, ceiling_frac=1.1)
    assert Verdict.from_dict(v.to_dict()) == v
