"""A tier refuses at start a lossy codec whose quality-gate verdict failed for its KV dtype,
naming the key and the measured loss; a passing or lossless codec starts; a lossy codec
with no verdict for that dtype starts with a warning. (The verdicts the gate really measures
are checked in tests/quality/test_verdicts.py; here the rule that reads them.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.storage import codecs
from kvtier.storage.codecs import FP8, INT8, LOSSLESS, verdicts
from kvtier.storage.codecs.verdicts import Verdict
from tests.quality.codecs import Ternary

# What the gate measured for the ternary test codec on float32 KV (docs/codecs.md).
TERNARY = Verdict("test-ternary", "float32", "recall-test", 2048, 0.957, 0.823, 0.828, 0.75)


@pytest.fixture
def ternary() -> Iterator[Ternary]:
    codec = Ternary()
    codecs.register(codec)
    yield codec
    codecs.unregister(codec.codec_id)
    verdicts.forget(codec.name)


def test_a_codec_that_failed_the_gate_is_refused_naming_the_measured_loss(
    ternary: Ternary,
) -> None:
    verdicts.record(TERNARY)
    with pytest.raises(ConfigError) as info:
        codecs.codec_from_config("disk_codec", ternary.name, torch.float32)
    message = str(info.value)
    assert info.value.key == "disk_codec" and "'test-ternary'" in message
    assert "accuracy 82.3% vs 95.7% recomputed, greedy agreement 82.8%" in message
    # Without a dtype (a benchmark measuring codecs), or on a dtype it has no verdict for:
    assert codecs.codec_from_config("disk_codec", ternary.name) is ternary
    assert codecs.codec_from_config("disk_codec", ternary.name, torch.bfloat16) is ternary


def test_kvtiers_lossy_codecs_pass_on_the_dtypes_the_gate_measured() -> None:
    for codec in (FP8, INT8):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            found = verdicts.verdict(codec.name, str(dtype).removeprefix("torch."))
            assert found is not None and found.passed, (codec.name, dtype)
            assert codecs.codec_from_config("cpu_codec", codec.name, dtype) is codec
    assert codecs.codec_from_config("cpu_codec", LOSSLESS.name, torch.float32) is LOSSLESS


def test_the_pass_rule_is_one_point_of_accuracy_and_99_percent_agreement() -> None:
    base = Verdict("c", "float32", "m", 1000, 0.95, 0.94, 0.99, 0.0)
    assert base.passed
    assert not Verdict("c", "float32", "m", 1000, 0.95, 0.939, 0.99, 0.0).passed
    assert not Verdict("c", "float32", "m", 1000, 0.95, 0.95, 0.989, 0.0).passed
