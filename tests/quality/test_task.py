from __future__ import annotations

import torch

from kvtier.quality.task import BOS, RecallTask


def test_every_answer_is_written_in_the_context_once() -> None:
    task = RecallTask(keys=8, values=4, fillers=5, context=20, queries=6)
    batch = task.sample(torch.Generator().manual_seed(3), 4)
    assert batch.tokens.shape == (4, 1 + 20 + 12)
    assert (batch.tokens[:, 0] == BOS).all()
    fact0 = 1 + task.keys
    answer0 = fact0 + task.keys * task.values
    for row in range(4):
        context = batch.prefix[row, 1:].tolist()
        facts = [t - fact0 for t in context if fact0 <= t < answer0]
        assert sorted(f // task.values for f in facts) == list(range(task.keys))
        value_of = {f // task.values: f % task.values for f in facts}
        queries = batch.suffix[row, 0::2] - 1
        expected = [answer0 + value_of[int(k)] for k in queries]
        assert batch.answers[row].tolist() == expected


def test_the_same_seed_draws_the_same_sequences() -> None:
    task = RecallTask()
    first = task.sample(torch.Generator().manual_seed(7), 2).tokens
    second = task.sample(torch.Generator().manual_seed(7), 2).tokens
    assert torch.equal(first, second)
    assert first.max() < task.vocab_size
