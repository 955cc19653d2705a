"""The recall task: answers that exist only in the context, so only exact KV recalls them.

A sequence is a context of scattered key/value facts among filler tokens, then queries::

    BOS | f f P(k3,v1) f f f P(k0,v6) f ... f P(k9,v2) f | Q(k0) A(v6) Q(k9) A(v2) ...
        └───────────── context: `context` tokens ────────┘ └─ `queries` query/answer pairs ─┘

Every key 0..keys-1 appears in the context exactly once, as a fact token ``P(k, v)`` with a
random value ``v`` drawn per sequence; the rest of the context is filler (random tokens that
carry nothing). A query ``Q(k)`` asks for the value of key ``k``; the model must answer
``A(v)``. The value is random per sequence, so no weight can know it: the only way to answer
is to find the one fact token for ``k`` among ``context`` tokens and read its value out of
the cached K and V. A codec that blurs keys misdirects that attention, one that blurs values
misreads the fact: both show up as wrong answers.

A fact is one token (not a key token followed by a value token) so that a single attention
hop solves the task: a two-hop (induction-head) task trains too slowly on two CPU cores.

Vocabulary, in order::

    0                 BOS
    1 ..              Q(k)      keys
    then              P(k, v)   keys * values        id = first + k * values + v
    then              A(v)      values
    then              fillers   fillers
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BOS = 0


@dataclass(frozen=True, slots=True)
class RecallTask:
    """The task's sizes. The context is ``1 + context`` tokens (BOS first)."""

    keys: int = 32
    values: int = 8
    fillers: int = 64
    context: int = 256
    queries: int = 32

    @property
    def vocab_size(self) -> int:
        return self._filler0 + self.fillers

    @property
    def prefix_tokens(self) -> int:
        """Tokens whose KV is cached before the queries: BOS and the context."""
        return 1 + self.context

    @property
    def _query0(self) -> int:
        return 1

    @property
    def _fact0(self) -> int:
        return self._query0 + self.keys

    @property
    def _answer0(self) -> int:
        return self._fact0 + self.keys * self.values

    @property
    def _filler0(self) -> int:
        return self._answer0 + self.values

    def sample(self, generator: torch.Generator, batch: int) -> Batch:
        """``batch`` sequences drawn from ``generator`` (the same seed: the same sequences)."""
        keys = torch.argsort(torch.rand(batch, self.keys, generator=generator), dim=1)
        values = torch.randint(0, self.values, (batch, self.keys), generator=generator)
        facts = self._fact0 + keys * self.values + values
        filler = self._filler0 + torch.randint(
            0, self.fillers, (batch, self.context - self.keys), generator=generator
        )
        context = torch.cat([facts, filler], dim=1)
        order = torch.argsort(torch.rand(batch, self.context, generator=generator), dim=1)
        context = context.gather(1, order)
        asked = torch.randint(0, self.keys, (batch, self.queries), generator=generator)
        answer_of_key = torch.empty_like(values)
        answer_of_key.scatter_(1, keys, values)
        answers = self._answer0 + answer_of_key.gather(1, asked)
        pairs = torch.stack([self._query0 + asked, answers], dim=2).reshape(batch, -1)
        bos = torch.full((batch, 1), BOS, dtype=torch.long)
        return Batch(tokens=torch.cat([bos, context, pairs], dim=1), task=self)


@dataclass(frozen=True, slots=True)
class Batch:
    """Sequences of a :class:`RecallTask`: ``tokens`` is ``[batch, prefix + 2 * queries]``."""

    tokens: torch.Tensor
    task: RecallTask

    @property
    def prefix(self) -> torch.Tensor:
        """BOS and the context: the part whose KV a tier would store."""
        return self.tokens[:, : self.task.prefix_tokens]

    @property
    def suffix(self) -> torch.Tensor:
        """The queries and answers, fed on top of the prefix's KV (teacher-forced)."""
        return self.tokens[:, self.task.prefix_tokens :]

    @property
    def answer_slots(self) -> torch.Tensor:
        """Positions in :attr:`suffix` whose logits predict an answer (each query token)."""
        return torch.arange(0, 2 * self.task.queries, 2)

    @property
    def answers(self) -> torch.Tensor:
        """``[batch, queries]``: the right answer token of each query."""
        return self.suffix[:, 1::2]
