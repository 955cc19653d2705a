"""The CPU tier through a codec (``cpu_codec``, kvtier.storage.cpu_coded).

It passes the whole tier contract with each codec (lossy ones on KV payloads, within their
error), and holds the CPU tier's own promises: a corrupt stored byte is a miss never data,
a pinned entry is never evicted, every slot reference has an owner, a lossy codec names
itself in the tier's fingerprint, and the same RAM holds more chunks.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.fingerprint import Fingerprint
from kvtier.keys import ChunkKey
from kvtier.memory.block_pool import BlockPool
from kvtier.storage.codecs import FP8, INT8, LOSSLESS, PayloadCodec, QuantizedCodec
from kvtier.storage.cpu_coded import CodedCpuTier, slot_shape
from tests.storage.codec_contract import assert_close_kv, kv_payload
from tests.storage.tier_contract import (
    CONTRACT_CHUNK,
    CONTRACT_LAYOUT,
    PAGE_BYTES,
    TierContract,
    put_and_wait,
    random_key,
)

FP = Fingerprint("cpu-codec", CONTRACT_LAYOUT, CONTRACT_CHUNK)


def coded_tier(codec: PayloadCodec, chunks: int = 16, staging: int = 2) -> CodedCpuTier:
    """A coded tier whose store holds ``chunks`` whole chunks."""
    size, per_chunk = slot_shape(codec, CONTRACT_LAYOUT, CONTRACT_CHUNK)
    store = BlockPool(chunks * per_chunk, size)
    tier = CodedCpuTier(BlockPool(staging, PAGE_BYTES), store, CONTRACT_LAYOUT, codec, FP)
    tier.open()
    return tier


def close_and_check(tier: CodedCpuTier) -> None:
    assert tier.audit_slots() == []
    tier.close()
    assert tier.pool.free_pages == tier.pool.num_pages  # every staging page went back


class CodedContract(TierContract):
    codec: PayloadCodec

    @pytest.fixture
    def tier(self) -> Iterator[CodedCpuTier]:
        tier = coded_tier(self.codec)
        yield tier
        close_and_check(tier)


class TestLosslessCpuTier(CodedContract):
    codec = LOSSLESS  # random bytes round trip exactly (and do not compress)


class LossyContract(CodedContract):
    stored_fraction = 0.25  # fp32 KV in one byte per element (scales besides)

    def payload(self, num_tokens: int, seed: int) -> torch.Tensor:
        return kv_payload(CONTRACT_LAYOUT, num_tokens, seed)

    def assert_same(self, out: torch.Tensor, data: torch.Tensor, num_tokens: int) -> None:
        assert_close_kv(CONTRACT_LAYOUT, num_tokens, data, out[: data.numel()])


class TestFp8CpuTier(LossyContract):
    codec = FP8


class TestInt8CpuTier(LossyContract):
    codec = INT8


CODECS = {c.name: c for c in (LOSSLESS, FP8, INT8)}


@pytest.mark.parametrize("name", sorted(CODECS))
def test_a_corrupt_stored_byte_is_a_miss_never_data(name: str) -> None:
    tier = coded_tier(CODECS[name])
    key, data = random_key(), kv_payload(CONTRACT_LAYOUT, CONTRACT_CHUNK, 7)
    put_and_wait(tier, key, data, CONTRACT_CHUNK)
    (entry,) = tier.entries([key])
    assert entry is not None
    tier.store.page_bytes_view(entry.slots[-1])[entry.stored % tier.store.page_bytes - 1] ^= 1
    out = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
    assert tier.get_into(key, out) is None
    assert not bool(out.any())  # nothing decoded
    assert tier.contains([key]) == [False] and tier.counters.corrupt == 1
    assert "checksum" in (tier.corruption(key) or "")
    close_and_check(tier)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_a_pinned_entry_outlives_a_store_full_of_newer_chunks(name: str) -> None:
    tier = coded_tier(CODECS[name], chunks=4)
    pinned = random_key()
    put_and_wait(tier, pinned, kv_payload(CONTRACT_LAYOUT, CONTRACT_CHUNK, 1), CONTRACT_CHUNK)
    assert tier.pin(pinned)
    for seed in range(12):
        put_and_wait(tier, random_key(), kv_payload(CONTRACT_LAYOUT, CONTRACT_CHUNK, seed), 16)
    assert tier.contains([pinned]) == [True] and tier.counters.evicted >= 8
    assert len(tier) <= 4
    tier.unpin(pinned)
    close_and_check(tier)


def test_a_lossy_codec_names_itself_in_the_tier_fingerprint_a_lossless_one_does_not() -> None:
    for codec in (LOSSLESS, FP8, INT8):
        tier = coded_tier(codec)
        assert tier.fingerprint.lossy_codec == ("" if codec.lossless else codec.name)
        assert (tier.fingerprint == FP) == codec.lossless
        close_and_check(tier)


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_a_fixed_size_codec_stores_each_chunk_in_one_slot_that_fits_it(name: str) -> None:
    codec = CODECS[name]
    assert isinstance(codec, QuantizedCodec)
    tier = coded_tier(codec)
    keys = [random_key() for _ in range(3)]
    for n, key in zip((CONTRACT_CHUNK, 5, 1), keys, strict=True):
        put_and_wait(tier, key, kv_payload(CONTRACT_LAYOUT, n, n), n)
    for entry in tier.entries(keys):
        assert entry is not None and len(entry.slots) == 1
        assert entry.stored <= tier.store.page_bytes < CONTRACT_LAYOUT.chunk_bytes(16) // 2
    assert tier.store.page_bytes == -(-codec.stored_bytes(CONTRACT_LAYOUT, 16) // 64) * 64
    close_and_check(tier)


class CodedTierMachine(RuleBasedStateMachine):
    """Puts, pins, unpins, removes and clears in any order: every slot reference has an
    owner (an entry or a pin), a pinned key is never evicted, and after the pins end and a
    forced clear every slot and staging page is free."""

    def __init__(self) -> None:
        super().__init__()
        self.tier = coded_tier(LOSSLESS, chunks=3)
        self.keys = [random_key() for _ in range(6)]
        # A pin holds the entry it was taken on: once that entry is removed, a new store of
        # the same key is a new entry, unpinned. So each pin records the key's generation
        # (bumped by every remove), and a key's pins end last-taken first, as the tier's do.
        self.pins: dict[ChunkKey, list[int]] = {}
        self.generation = dict.fromkeys(self.keys, 0)

    def held(self) -> list[ChunkKey]:
        """Keys whose current entry some pin holds."""
        return [k for k, gens in self.pins.items() if self.generation[k] in gens]

    @rule(i=st.integers(0, 5), seed=st.integers(0, 3))
    def put(self, i: int, seed: int) -> None:
        held = self.held()
        assert all(self.tier.contains(held))
        put_and_wait(self.tier, self.keys[i], kv_payload(CONTRACT_LAYOUT, 16, seed), 16)
        assert all(self.tier.contains(held))  # a put evicts, but never a pinned entry

    @rule(i=st.integers(0, 5))
    def pin(self, i: int) -> None:
        key = self.keys[i]
        if self.tier.pin(key):
            self.pins.setdefault(key, []).append(self.generation[key])

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.pins)))
        self.pins[key].pop()
        if not self.pins[key]:
            del self.pins[key]
        self.tier.unpin(key)

    @rule(i=st.integers(0, 5))
    def remove(self, i: int) -> None:
        if self.tier.remove(self.keys[i]):
            self.generation[self.keys[i]] += 1

    @rule()
    def clear(self) -> None:
        held = self.held()
        self.tier.clear()
        assert all(self.tier.contains(held))  # a clear keeps what a pin holds

    @invariant()
    def every_reference_has_an_owner(self) -> None:
        assert self.tier.audit_slots() == []

    def teardown(self) -> None:
        for key, gens in self.pins.items():
            for _ in gens:
                self.tier.unpin(key)
        self.tier.unpin(self.keys[0])  # no pin left: a no-op, never a second release
        self.tier.clear(force=True)
        assert self.tier.store.free_pages == self.tier.store.num_pages
        close_and_check(self.tier)


TestCodedTierMachine = CodedTierMachine.TestCase
TestCodedTierMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
