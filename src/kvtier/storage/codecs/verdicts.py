"""The quality gate's verdicts on lossy codecs, and the refusal of a codec that failed it.

The gate (:mod:`kvtier.quality`) trains a small model that recalls exactly from its context
and measures what a codec's round trip of the context's KV costs it (accuracy, greedy
agreement, next-token KL). It takes minutes to train, so a tier cannot run it at start.
Instead a verdict is kept per (codec, KV dtype)::

    BUILTIN        measured for kvtier's own lossy codecs with the gate's model and pinned
                   here (tests/quality/test_verdicts.py measures them again and fails if
                   a codec or the gate changes what they say)
    record(v)      a verdict the gate measured in this process (every QualityGate.measure
                   records one: a codec registered at run time gets its verdict that way)

At start, a tier configured with a lossy codec calls :func:`check_codec` for the layout's
dtype (through ``codecs.codec_from_config``): a codec whose verdict failed is refused with a
:class:`~kvtier.errors.ConfigError` naming the key, the codec and the measured loss. A codec
with no verdict for that dtype is allowed with one warning saying so (the gate measured
float32, bfloat16 and float16 KV). The verdict is the gate model's, not the served model's:
one trained model says whether a codec keeps exact recall, which is what KV must carry; it
is a gate on the codec, not a promise about every model.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.storage.codecs.base import PayloadCodec

log = logging.getLogger(__name__)

ACCURACY_SLACK = 0.01  # a passing codec loses at most 1 point of accuracy
MIN_AGREEMENT = 0.99  # and picks the reference's answer token at 99 % of queries at least


@dataclass(frozen=True, slots=True)
class Verdict:
    """The gate's figures for one codec on one KV dtype."""

    codec: str
    kv_dtype: str
    model: str
    queries: int  # answers compared
    recompute_accuracy: float
    accuracy: float
    greedy_agreement: float
    kl_mean: float  # nats per query, KL(reference || codec)

    @property
    def passed(self) -> bool:
        return (
            self.accuracy >= self.recompute_accuracy - ACCURACY_SLACK
            and self.greedy_agreement >= MIN_AGREEMENT
        )

    def describe(self) -> str:
        verdict = "passes" if self.passed else "fails"
        return (
            f"codec {self.codec!r} {verdict} the quality gate for model {self.model} "
            f"({self.kv_dtype} KV): accuracy {self.accuracy:.1%} vs "
            f"{self.recompute_accuracy:.1%} recomputed, greedy agreement "
            f"{self.greedy_agreement:.1%}, next-token KL {self.kl_mean:.2e} nats over "
            f"{self.queries} answers (pass: accuracy within {ACCURACY_SLACK * 100:.0f} point "
            f"and agreement >= {MIN_AGREEMENT:.0%})"
        )


_MODEL = "recall-4e8c65f0c0c52228"
_RECOMPUTE = {"float32": 0.95654296875, "bfloat16": 0.95654296875, "float16": 0.95654296875}

# (codec, dtype) -> (accuracy, greedy agreement, KL): QualityGate(recall_model(),
# kv_dtype=dtype).measure(codec), 2,048 answers, on 2026-11-26 (tests/quality/test_verdicts.py
# measures them again).
_MEASURED: dict[tuple[str, str], tuple[float, float, float]] = {
    ("fp8", "float32"): (0.95703125, 0.99853515625, 6.40e-05),
    ("int8", "float32"): (0.95556640625, 0.9990234375, 8.96e-07),
    ("fp8", "bfloat16"): (0.95703125, 0.99853515625, 1.34e-04),
    ("int8", "bfloat16"): (0.95654296875, 1.0, 1.21e-06),
    ("fp8", "float16"): (0.95703125, 0.99853515625, 6.67e-05),
    ("int8", "float16"): (0.95556640625, 0.9990234375, 9.47e-07),
}

BUILTIN: dict[tuple[str, str], Verdict] = {
    (codec, dtype): Verdict(codec, dtype, _MODEL, 2048, _RECOMPUTE[dtype], acc, agree, kl)
    for (codec, dtype), (acc, agree, kl) in _MEASURED.items()
}

_lock = threading.Lock()
_recorded: dict[tuple[str, str], Verdict] = {}
_warned: set[tuple[str, str]] = set()


def record(verdict: Verdict) -> None:
    """Keep a verdict the gate measured in this process (it wins over a builtin one)."""
    with _lock:
        _recorded[verdict.codec, verdict.kv_dtype] = verdict


def forget(codec: str) -> None:
    """Drop the recorded verdicts of ``codec`` (a test codec leaving the registry)."""
    with _lock:
        for key in [k for k in _recorded if k[0] == codec]:
            del _recorded[key]


def verdict(codec: str, kv_dtype: str) -> Verdict | None:
    with _lock:
        found = _recorded.get((codec, kv_dtype))
    return found if found is not None else BUILTIN.get((codec, kv_dtype))


def check_codec(key: str, codec: PayloadCodec, kv_dtype: str) -> None:
    """Refuse (ConfigError naming ``key``, the codec and the measured loss) a lossy codec
    whose gate verdict for ``kv_dtype`` failed; warn once where there is none."""
    if codec.lossless:
        return
    found = verdict(codec.name, kv_dtype)
    if found is None:
        with _lock:
            first = (codec.name, kv_dtype) not in _warned
            _warned.add((codec.name, kv_dtype))
        if first:
            log.warning(
                "%s: codec %r has no quality-gate verdict for %s KV (kvtier.quality measures "
                "it); allowed unchecked",
                key,
                codec.name,
                kv_dtype,
            )
        return
    if not found.passed:
        raise ConfigError(
            key, codec.name, f"a codec that passes the quality gate; {found.describe()}"
        )
