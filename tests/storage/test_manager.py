"""The storage manager with a lower tier that misbehaves: no page may be left without an
owner, whatever the tier (or the caller's tensor) does."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch

from kvtier.fingerprint import Fingerprint
from kvtier.keys import ChunkKey, KeyChain
from kvtier.lease import LeaseTable
from kvtier.memory.block_pool import BlockPool
from kvtier.storage.base import PutJob, PutOutcome, Tier, TierUsage
from kvtier.storage.counters import EngineCounters
from kvtier.storage.cpu import CpuTier
from kvtier.storage.manager import StorageManager
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, make_tokens, small_config

PAGE = SMALL_LAYOUT.chunk_bytes(SMALL_CHUNK)


class DictTier(Tier):
    """An in-memory lower tier; ``fail_put`` / ``fail_get`` make it raise a plain bug."""

    name = "dict"

    def __init__(self) -> None:
        super().__init__()
        self.data: dict[ChunkKey, tuple[int, bytes]] = {}
        self.fail_put = False
        self.fail_get = False

    def open(self) -> None: ...

    def close(self) -> None: ...

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return [k in self.data for k in keys]

    def get_into(self, key: ChunkKey, out: torch.Tensor) -> int | None:
        if self.fail_get:
            raise ValueError("a bug in the tier")
        if key not in self.data:
            return None
        tokens, payload = self.data[key]
        out[: len(payload)].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        return tokens

    def put(self, job: PutJob) -> None:
        if self.fail_put:
            raise RuntimeError("a bug in the tier")
        self.data[job.key] = (job.num_tokens, job.payload.numpy().tobytes())
        job.done(PutOutcome.STORED)

    def remove(self, key: ChunkKey) -> bool:
        return self.data.pop(key, None) is not None

    def pin(self, key: ChunkKey) -> bool:
        return key in self.data  # nothing evicts here: present is pinned

    def usage(self) -> TierUsage:
        return TierUsage(0, 0, len(self.data))

    def clear(self) -> int:
        n = len(self.data)
        self.data.clear()
        return n


@pytest.fixture
def setup() -> Iterator[tuple[StorageManager, DictTier, LeaseTable, KeyChain]]:
    pool = BlockPool(4, PAGE)
    cpu = CpuTier(pool, SMALL_LAYOUT.token_bytes())
    lower = DictTier()
    config = small_config(
        local_cpu=False,
        use_only_staging_buffer=True,
        local_disk="/unused",
        max_local_disk_size="1MiB",
    )
    manager = StorageManager(config, SMALL_LAYOUT, pool, cpu, [lower], EngineCounters())
    chain = KeyChain(Fingerprint("m", SMALL_LAYOUT, SMALL_CHUNK))
    yield manager, lower, LeaseTable(pool), chain
    pool.close()


def test_a_put_that_raises_still_gives_its_page_back(setup) -> None:  # type: ignore[no-untyped-def]
    manager, lower, _, chain = setup
    lower.fail_put = True
    spans = chain.keys(make_tokens(32), include_partial=False)
    assert manager.store(spans, make_kv(32)) == (2, 0)
    assert manager.pool.free_pages == 4  # staging pages returned although put raised
    assert manager.counters.writes_by_tier["dict"]["failed"] == 2


def test_a_get_that_raises_gives_the_page_back_and_propagates(setup) -> None:  # type: ignore[no-untyped-def]
    manager, lower, leases, chain = setup
    tokens, kv = make_tokens(32), make_kv(32)
    spans = chain.keys(tokens, include_partial=False)
    manager.store(spans, kv)
    lease = leases.open("r")
    plan = manager.locate(spans, lease, 0)
    assert [h.tier for h in plan.hits] == [lower, lower]  # the tier itself, not its name
    lower.fail_get = True
    plan.hits = plan.hits[:1]  # one chunk: the single-read path, not the batched one
    with pytest.raises(ValueError, match="bug in the tier"):
        manager.load(plan, lease, torch.zeros_like(kv), 0)
    leases.end("r")
    assert manager.pool.free_pages == 4


def test_a_kv_that_cannot_be_copied_gives_the_page_back(setup) -> None:  # type: ignore[no-untyped-def]
    manager, _, _, chain = setup
    spans = chain.keys(make_tokens(16), include_partial=False)
    unreadable = torch.empty(SMALL_LAYOUT.kv_shape(16), device="meta")
    with pytest.raises((NotImplementedError, RuntimeError)):
        manager.store(spans, unreadable)
    assert manager.pool.free_pages == 4


def test_a_tier_that_takes_no_puts_costs_a_store_nothing(setup) -> None:  # type: ignore[no-untyped-def]
    """``accepts_puts = False`` (the p2p tier): a store of chunks only it lacks reserves no
    page, copies nothing and calls no put; its chunks are still found by lookups."""
    manager, lower, leases, chain = setup
    lower.accepts_puts = False  # an instance attribute shadows the class's default
    tokens, kv = make_tokens(32, 5), make_kv(32, 5)
    spans = chain.keys(tokens, include_partial=False)
    assert manager.store(spans, kv) == (0, 0)  # CPU only stages here: nothing to write
    assert lower.data == {} and manager.pool.free_pages == 4
    for span in spans:  # what a peer announced: readable, never written by this engine
        lower.data[span.key] = (SMALL_CHUNK, b"\0" * SMALL_LAYOUT.payload_bytes(SMALL_CHUNK))
    lease = leases.open("r")
    assert [h.tier for h in manager.locate(spans, lease, 0).hits] == [lower, lower]
    leases.end("r")
