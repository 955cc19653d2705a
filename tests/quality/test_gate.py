"""The gate itself: exact for the identity codec, passes a sound int8 codec, fails a bad one.

Margins: the figures below are deterministic on one machine (fixed seeds, one thread); the
asserts leave room for another x86-64 box's float rounding (measured figures in
docs/codecs.md)."""

from __future__ import annotations

import fcntl
import json
import os
import threading

import pytest

from kvtier.quality import QualityGate, QualityGateFailed, RecallModel, recall_model
from kvtier.storage.codecs import IDENTITY
from tests.quality.codecs import Int8Absmax, Ternary


def test_the_model_recalls_with_recomputed_kv(gate: QualityGate) -> None:
    assert gate.recompute_accuracy >= 0.93
    assert gate.model.accuracy >= 0.93


def test_identity_codec_is_exact(gate: QualityGate) -> None:
    result = gate.check(IDENTITY)
    assert result.passed
    assert result.accuracy == result.recompute_accuracy
    assert result.greedy_agreement == 1.0
    assert result.kl_mean == 0.0
    assert result.ratio == 1.0


def test_a_bad_codec_fails_the_gate(gate: QualityGate) -> None:
    result = gate.measure(Ternary())
    assert not result.passed
    assert result.accuracy < result.recompute_accuracy - 0.05  # measured: 82.3% vs 95.7%
    assert result.greedy_agreement < 0.9  # measured: 82.8%
    with pytest.raises(QualityGateFailed) as raised:
        gate.check(Ternary())
    message = str(raised.value)
    assert "codec 'test-ternary' fails the quality gate" in message
    assert f"recomputed, greedy agreement {result.greedy_agreement:.1%}" in message
    assert raised.value.result == result


def test_a_sound_int8_codec_passes(gate: QualityGate) -> None:
    result = gate.check(Int8Absmax())
    assert result.passed
    assert result.accuracy >= result.recompute_accuracy - 0.005
    assert result.greedy_agreement >= 0.995
    assert result.kl_mean < 1e-3
    assert 3.5 < result.ratio < 4.0  # fp32 -> int8 plus one fp32 scale per head_dim row


def test_figures_are_json_ready(gate: QualityGate) -> None:
    figures = json.loads(json.dumps(gate.measure(Int8Absmax()).as_dict()))
    assert figures["codec"] == "test-int8-absmax"
    assert figures["kv_dtype"] == "float32"
    assert set(figures) >= {"accuracy", "recompute_accuracy", "kl_mean", "greedy_agreement"}


def test_the_trained_model_is_loaded_from_its_cache_file(gate: QualityGate) -> None:
    again = recall_model(gate.model.spec, directory=gate.model.path.parent)
    assert again.train_s == 0.0
    assert again.path == gate.model.path
    assert again.accuracy == gate.model.accuracy


def test_a_second_asker_waits_for_the_training_under_way_then_loads_it(
    gate: QualityGate,
) -> None:
    """Another process training the same spec holds the cache's lock: this one waits for it
    (not training a second copy) and then loads the file it wrote."""
    lock = os.open(gate.model.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)  # as a trainer in another process would hold it
    got: list[RecallModel] = []
    asker = threading.Thread(
        target=lambda: got.append(recall_model(gate.model.spec, directory=gate.model.path.parent))
    )
    try:
        asker.start()
        asker.join(0.5)
        assert asker.is_alive() and not got  # waiting on the trainer
    finally:
        os.close(lock)  # the trainer is done
    asker.join(30)
    assert got and got[0].train_s == 0.0 and got[0].path == gate.model.path
