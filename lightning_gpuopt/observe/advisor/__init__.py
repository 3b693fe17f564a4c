"""Say what starves the GPU and what to change (docs/advisor.md).

``diagnose(evidence, config)`` is the pure part: one window's ``Evidence`` and ``RunConfig`` in, verdicts out.
``BottleneckAdvisor`` adapts it to a Trainer (or through ``observe.fabric.FabricObserver`` to a Fabric loop).
"""

from lightning_gpuopt.observe.advisor.callback import BottleneckAdvisor
from lightning_gpuopt.observe.advisor.config import (
    amp_facts,
    collect_config,
    conv_memory_formats,
    describe_feed,
)
from lightning_gpuopt.observe.advisor.evidence import Evidence, RankEvidence, RunConfig
from lightning_gpuopt.observe.advisor.ranks import AllReduceWaitTimer
from lightning_gpuopt.observe.advisor.rules import AdvisorThresholds, diagnose
from lightning_gpuopt.observe.advisor.verdict import KINDS, Hysteresis, Verdict, format_summary

__all__ = [
    "KINDS",
    "AdvisorThresholds",
    "AllReduceWaitTimer",
    "BottleneckAdvisor",
    "Evidence",
    "Hysteresis",
    "RankEvidence",
    "RunConfig",
    "Verdict",
    "amp_facts",
    "collect_config",
    "conv_memory_formats",
    "describe_feed",
    "diagnose",
    "format_summary",
]
