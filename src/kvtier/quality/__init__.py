"""The quality gate for lossy payload codecs: a tiny model trained to recall exactly from its
context, and the measure of what a codec's round trip costs it.

Modules, one job each: :mod:`~kvtier.quality.task` (the recall task), :mod:`~kvtier.quality.model`
(training and caching the model), :mod:`~kvtier.quality.roundtrip` (KV through a codec as a
tier stores it), :mod:`~kvtier.quality.gate` (the figures and the pass rule).
"""

from __future__ import annotations

from kvtier.quality.gate import (
    GateResult,
    QualityGate,
    QualityGateFailed,
    check,
    default_gate,
    gate_figures,
)
from kvtier.quality.model import RecallModel, RecallModelSpec, TrainingFailed, recall_model
from kvtier.quality.task import RecallTask
from kvtier.storage.codecs.verdicts import ACCURACY_SLACK, MIN_AGREEMENT

__all__ = [
    "ACCURACY_SLACK",
    "MIN_AGREEMENT",
    "GateResult",
    "QualityGate",
    "QualityGateFailed",
    "RecallModel",
    "RecallModelSpec",
    "RecallTask",
    "TrainingFailed",
    "check",
    "default_gate",
    "gate_figures",
    "recall_model",
]
