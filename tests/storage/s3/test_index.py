"""The s3 tier's index under interleaved writes, removals and listings (hypothesis): after
any sequence, it holds exactly what the last listing saw plus what was written since that
listing began, minus what was removed since."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.storage.s3.index import ChunkIndex

KEYS = [bytes([i]) * 16 for i in range(6)]


class IndexMachine(RuleBasedStateMachine):
    """``store`` is the bucket; a listing is begun (its generation taken, the bucket's
    contents read) and ended later, with writes and removals landing in between."""

    def __init__(self) -> None:
        super().__init__()
        self.index = ChunkIndex()
        self.store: dict[bytes, int] = {}
        self.model: dict[bytes, int] = {}
        self.listing: tuple[int, dict[bytes, int]] | None = None
        self.touched_since: set[bytes] = set()
        self.removed_since: set[bytes] = set()

    @rule(key=st.sampled_from(KEYS), size=st.integers(1, 100))
    def write(self, key: bytes, size: int) -> None:
        self.store[key] = size
        self.index.add(key, size)
        self.model[key] = size
        self.touched_since.add(key)
        self.removed_since.discard(key)

    @rule(key=st.sampled_from(KEYS))
    def other_writer(self, key: bytes) -> None:
        self.store[key] = 7  # another engine: only a listing tells this index

    @rule(key=st.sampled_from(KEYS))
    def remove(self, key: bytes) -> None:
        self.store.pop(key, None)
        assert self.index.discard(key) == (key in self.model)
        self.model.pop(key, None)
        self.removed_since.add(key)

    @precondition(lambda self: self.listing is None)
    @rule()
    def begin_listing(self) -> None:
        self.listing = (self.index.generation(), dict(self.store))
        self.touched_since, self.removed_since = set(), set()

    @precondition(lambda self: self.listing is not None)
    @rule()
    def end_listing(self) -> None:
        assert self.listing is not None
        since, seen = self.listing
        self.index.replace(seen, since=since)
        written = {k: self.model[k] for k in self.touched_since if k in self.model}
        kept = {k: v for k, v in seen.items() if k not in self.removed_since}
        self.model = {**kept, **written}
        self.listing = None

    @invariant()
    def holds_the_model(self) -> None:
        assert self.index.contains(KEYS) == [k in self.model for k in KEYS]
        assert self.index.totals() == (sum(self.model.values()), len(self.model))


TestIndex = IndexMachine.TestCase
TestIndex.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
