"""The quality gate: does a model still answer the same with KV that went through a codec?

Protocol (one :class:`QualityGate` per model; build it once, measure many codecs)::

    build     eval set: ``sequences`` recall sequences from a fixed seed
              per sequence: prefill BOS + context once -> its KV (fp32, as computed)
              reference: queries and answers fed on top of that KV  -> logits at each query
    measure   per sequence: KV -> codec, chunk by chunk (roundtrip.through_codec)
              the same queries and answers fed on top of the decoded KV -> logits
              compared at every query position (teacher-forced, so every position sees
              the same input on both sides):

                accuracy          argmax == the right answer               (vs the reference's)
                KL                KL(reference || codec), nats, mean over queries
                greedy agreement  argmax == the reference's argmax

The gate refuses to measure with a model that does not recall to its spec's ``min_accuracy``
on the eval set (:class:`~kvtier.quality.model.TrainingFailed`): the pass rule compares a
codec with the model's own answers, which mean nothing then.

A codec passes when its accuracy is within :data:`ACCURACY_SLACK` (1 point) of the
reference's and its greedy agreement is at least :data:`MIN_AGREEMENT` (99 %). KL is
reported, not judged: it sees losses too small to change an answer yet.

:func:`check` raises :class:`QualityGateFailed` naming the measured loss. Every measure
records its verdict (:mod:`kvtier.storage.codecs.verdicts`): a tier configured with a lossy
codec whose verdict failed for its KV dtype refuses to start, naming the same loss.
:func:`gate_figures` is the JSON-ready form ``kvtier bench codec --json`` prints.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvtier.errors import KVTierError
from kvtier.integrations.hf_kv import cache_from_kv, kv_from_cache, layout_from_model
from kvtier.layout import dtype_name
from kvtier.quality.model import RecallModel, TrainingFailed, recall_model
from kvtier.quality.roundtrip import through_codec
from kvtier.storage.codecs import PayloadCodec, verdicts
from kvtier.storage.codecs.verdicts import ACCURACY_SLACK, MIN_AGREEMENT, Verdict

EVAL_SEED = 1234  # the eval set: disjoint in practice from the training draws (seed 0)


@dataclass(frozen=True, slots=True)
class GateResult:
    """What the gate measured for one codec on one model."""

    codec: str
    model: str
    kv_dtype: str
    chunk_size: int
    queries: int  # answers compared
    recompute_accuracy: float
    accuracy: float
    kl_mean: float  # nats per query, KL(reference || codec)
    greedy_agreement: float
    ratio: float  # payload bytes / stored bytes
    passed: bool

    @property
    def verdict(self) -> Verdict:
        """What a tier at start checks (:mod:`kvtier.storage.codecs.verdicts`)."""
        return Verdict(
            self.codec,
            self.kv_dtype,
            self.model,
            self.queries,
            self.recompute_accuracy,
            self.accuracy,
            self.greedy_agreement,
            self.kl_mean,
        )

    def describe(self) -> str:
        return self.verdict.describe()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class QualityGateFailed(KVTierError):
    """A lossy codec changes the model's answers more than the gate allows."""

    def __init__(self, result: GateResult) -> None:
        self.result = result
        super().__init__(result.describe())


@dataclass(frozen=True, slots=True)
class _Sequence:
    kv: torch.Tensor  # [2, layers, prefix, hidden], fp32, as the model computed it
    suffix: torch.Tensor  # queries and answers, 1-D
    answers: torch.Tensor  # [queries]
    reference: torch.Tensor  # [queries, vocab] logits with the computed KV


class QualityGate:
    """The eval set of one recall model with its reference logits, ready to measure codecs.

    ``kv_dtype`` is the dtype a tier stores the KV in (the layout's): the model computes in
    fp32, its KV is cast to ``kv_dtype`` before the codec and back after, so a bf16 gate
    measures the codec on bf16 pages (and, for the identity codec, bf16's own rounding).
    """

    def __init__(
        self,
        model: RecallModel,
        *,
        sequences: int = 64,
        chunk_size: int = 64,
        kv_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.model = model
        self.chunk_size = chunk_size
        self.kv_dtype = kv_dtype
        self.compute_layout = layout_from_model(model.model)
        self.layout = layout_from_model(model.model, dtype=kv_dtype)
        task = model.spec.task
        batch = task.sample(torch.Generator().manual_seed(EVAL_SEED), sequences)
        self._sequences: list[_Sequence] = []
        for row in range(sequences):
            prefix = batch.prefix[row]
            with torch.inference_mode():
                cache = model.model(input_ids=prefix.unsqueeze(0), use_cache=True).past_key_values
                kv = kv_from_cache(cache, self.compute_layout, len(prefix))
            suffix = batch.suffix[row]
            self._sequences.append(
                _Sequence(kv, suffix, batch.answers[row], self._answer_logits(kv, suffix))
            )
        hits = sum(int((s.reference.argmax(-1) == s.answers).sum()) for s in self._sequences)
        self.queries = sequences * task.queries
        self.recompute_accuracy = hits / self.queries
        if self.recompute_accuracy < model.spec.min_accuracy:
            # The pass rule compares a codec with this model's own answers: a model that does
            # not recall (say, one that ignores its context) answers the same with any KV,
            # zeroed KV too, and would pass every codec.
            raise TrainingFailed(
                f"the recall model {model.name} answers {self.recompute_accuracy:.1%} of the "
                f"gate's {self.queries} queries with its own KV, below the "
                f"{model.spec.min_accuracy:.0%} the gate needs to mean anything; its weights "
                f"do not recall (remove {model.path} to train it again)"
            )

    def measure(self, codec: PayloadCodec) -> GateResult:
        """Run the eval set with every context's KV loaded through ``codec``."""
        hits = agree = 0
        kl = 0.0
        payload = stored = 0
        for seq in self._sequences:
            trip = through_codec(seq.kv, self.layout, codec, self.chunk_size)
            payload += trip.payload_bytes
            stored += trip.stored_bytes
            logits = self._answer_logits(trip.kv, seq.suffix)
            picked = logits.argmax(-1)
            hits += int((picked == seq.answers).sum())
            agree += int((picked == seq.reference.argmax(-1)).sum())
            ref_log = torch.log_softmax(seq.reference.double(), -1)
            got_log = torch.log_softmax(logits.double(), -1)
            kl += float((ref_log.exp() * (ref_log - got_log)).sum())
        accuracy = hits / self.queries
        agreement = agree / self.queries
        passed = accuracy >= self.recompute_accuracy - ACCURACY_SLACK and agreement >= MIN_AGREEMENT
        result = GateResult(
            codec=codec.name,
            model=self.model.name,
            kv_dtype=dtype_name(self.kv_dtype),
            chunk_size=self.chunk_size,
            queries=self.queries,
            recompute_accuracy=self.recompute_accuracy,
            accuracy=accuracy,
            kl_mean=max(kl / self.queries, 0.0),
            greedy_agreement=agreement,
            ratio=payload / stored if stored else 0.0,
            passed=passed,
        )
        verdicts.record(result.verdict)  # a tier configured with it from now on sees it
        return result

    def check(self, codec: PayloadCodec) -> GateResult:
        """:meth:`measure`, raising :class:`QualityGateFailed` when the codec fails."""
        result = self.measure(codec)
        if not result.passed:
            raise QualityGateFailed(result)
        return result

    def _answer_logits(self, kv: torch.Tensor, suffix: torch.Tensor) -> torch.Tensor:
        """Logits at each query of ``suffix`` fed on top of the context's ``kv``."""
        start = kv.shape[2]
        cache = cache_from_kv(kv, self.compute_layout, start)
        positions = torch.arange(start, start + len(suffix)).unsqueeze(0)
        with torch.inference_mode():
            out = self.model.model(
                input_ids=suffix.unsqueeze(0),
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            )
        logits: torch.Tensor = out.logits[0, 0::2].float()
        return logits


@functools.cache
def default_gate(kv_dtype: torch.dtype = torch.float32) -> QualityGate:
    """The gate on the default recall model (trained on first use, then cached on disk)."""
    return QualityGate(recall_model(), kv_dtype=kv_dtype)


def check(codec: PayloadCodec, kv_dtype: torch.dtype = torch.float32) -> GateResult:
    """Refuse ``codec`` (raise :class:`QualityGateFailed`) unless it passes the default gate
    (the refusal at start for a lossy codec configured on a tier)."""
    return default_gate(kv_dtype).check(codec)


def gate_figures(codec: PayloadCodec, kv_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The default gate's figures for ``codec``, JSON-ready (for ``kvtier bench codec``)."""
    return default_gate(kv_dtype).measure(codec).as_dict()
