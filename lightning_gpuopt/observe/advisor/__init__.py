"""Say what starves the GPU and what to change.

``diagnose(evidence, config)`` is the pure part: one window's measurements (``Evidence``: GPU idle share
between steps, host data and loader wait, GPU-Util, SM activity, memory, CPU load, every rank's all-reduce
wait under DDP) and the run's configuration (``RunConfig``) in, a list of ``Verdict`` out, one rule a
verdict kind (``rules``). ``BottleneckAdvisor`` adapts it to a Trainer (or, through
``observe.fabric.FabricObserver``, to a Fabric loop): it times the host side, reads the
``GPUStatsMonitor``'s windows, reads the configuration through public API when it judges, and keeps a
verdict raised only once it held for ``min_windows`` windows (``Hysteresis``).

Modules: ``verdict`` (the finding and its kinds), ``evidence`` (what is judged), ``config`` (reading a run's
configuration), ``rules`` (one function a kind, ``diagnose``), ``advice`` (the text), ``summary``
(hysteresis and the end-of-fit text), ``ranks`` (per-rank all-reduce wait under DDP), ``scale`` (the
GradScaler's scale at window ends, read without a sync), ``callback``.
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
from lightning_gpuopt.observe.advisor.summary import Hysteresis, format_summary
from lightning_gpuopt.observe.advisor.verdict import INPUT_CAUSES, KINDS, RANK_CAUSES, Verdict

__all__ = [
    "INPUT_CAUSES",
    "KINDS",
    "RANK_CAUSES",
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
