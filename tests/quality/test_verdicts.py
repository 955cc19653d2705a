"""The verdicts a tier reads at start (kvtier.storage.codecs.verdicts) are the gate's: the
pinned ones for kvtier's lossy codecs are what the gate measures now, and a codec the gate
fails is refused at start with the figures the gate just measured."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.quality import QualityGate
from kvtier.storage import codecs
from kvtier.storage.codecs import FP8, INT8, verdicts
from tests.quality.codecs import Ternary


@pytest.mark.parametrize("dtype", sorted({d for _, d in verdicts.BUILTIN}), ids=str)
def test_the_pinned_verdicts_are_what_the_gate_measures(gate: QualityGate, dtype: str) -> None:
    torch_dtype = getattr(torch, dtype)
    on_dtype = (
        gate if torch_dtype == gate.kv_dtype else QualityGate(gate.model, kv_dtype=torch_dtype)
    )
    for codec in (FP8, INT8):
        if (codec.name, dtype) not in verdicts.BUILTIN:
            continue
        measured = on_dtype.measure(codec).verdict
        pinned = verdicts.BUILTIN[codec.name, measured.kv_dtype]
        assert measured.model == pinned.model and measured.queries == pinned.queries
        assert measured.passed == pinned.passed
        # Another x86-64 box may round a few answers differently: a margin of 8 of 2,048.
        for field in ("recompute_accuracy", "accuracy", "greedy_agreement"):
            assert getattr(measured, field) == pytest.approx(getattr(pinned, field), abs=0.004)


def test_a_codec_the_gate_fails_is_refused_at_start_with_what_it_measured(
    gate: QualityGate,
) -> None:
    codec = Ternary()
    codecs.register(codec)
    try:
        result = gate.measure(codec)  # recorded for this process
        with pytest.raises(ConfigError) as info:
            codecs.codec_from_config("remote_codec", codec.name, gate.kv_dtype)
        assert info.value.key == "remote_codec"
        assert result.describe() in str(info.value)
        assert f"accuracy {result.accuracy:.1%} vs {result.recompute_accuracy:.1%}" in str(
            info.value
        )
    finally:
        codecs.unregister(codec.codec_id)
        verdicts.forget(codec.name)
