"""kvtier's KV events as vllm-router matches them: vLLM-sized blocks named from chunk keys,
chained to their parent, tiers as the router's media (fast: no engine, no router)."""

from __future__ import annotations

from typing import Any, cast

import pytest

from kvtier.integrations.vllm.events import SHARED_POOL, EventLog, block_names, to_vllm
from kvtier.keys import ChunkSpan
from kvtier.pd.buffer import PDBuffer
from kvtier.storage.cpu import CpuTier
from kvtier.storage.disk.tier import DiskTier
from kvtier.storage.redis.tier import RedisTier

CHUNK, BLOCK = 256, 128


def spans(n: int, tokens: int | None = None, first: int = 0) -> list[ChunkSpan]:
    total = tokens if tokens is not None else (first + n) * CHUNK
    out = []
    for i in range(first, first + n):
        start, end = i * CHUNK, min((i + 1) * CHUNK, total)
        out.append(ChunkSpan(i, start, end, bytes([i]) * 16))
    return out


def test_a_chunk_is_published_as_vllm_sized_blocks_chained_to_its_parent() -> None:
    log = EventLog(BLOCK, CHUNK)
    tokens = list(range(3 * CHUNK))
    log.stored(spans(2, first=1), bytes([0]) * 16, tokens, [CpuTier.medium, DiskTier.medium])
    (cpu, disk) = to_vllm(log.drain())
    assert (cpu.medium, disk.medium) == ("CPU", "DISK")
    assert cpu.ownership is None and disk.ownership is None
    assert cpu.block_size == BLOCK and cpu.token_ids == tokens[CHUNK:]
    assert cpu.block_hashes == block_names(bytes([1]) * 16, 2) + block_names(bytes([2]) * 16, 2)
    assert len(set(cpu.block_hashes)) == 4
    # the parent is the last block of the chunk before: the router chains the store to it
    assert cpu.parent_block_hash == block_names(bytes([0]) * 16, 2)[-1]


def test_the_first_chunk_has_no_parent_and_a_tail_below_one_block_is_left_out() -> None:
    log = EventLog(BLOCK, CHUNK)
    tokens = list(range(CHUNK + 200))  # chunk 1 holds 200 tokens: one whole block
    log.stored(spans(2, tokens=len(tokens)), None, tokens, ["CPU"])
    (event,) = to_vllm(log.drain())
    assert event.parent_block_hash is None
    assert len(event.block_hashes) == 3 and event.token_ids == tokens[: 3 * BLOCK]
    assert len(event.token_ids) == event.block_size * len(event.block_hashes)


def test_redis_is_a_shared_pool_copy_and_evictions_remove_every_block() -> None:
    log = EventLog(BLOCK, CHUNK)
    log.stored(spans(1), None, list(range(CHUNK)), [RedisTier.medium])
    log.removed([bytes([0]) * 16], "CPU")
    stored, removed = to_vllm(log.drain())
    assert stored.medium == "REMOTE" and stored.ownership == SHARED_POOL
    assert removed.medium == "CPU" and removed.ownership is None
    assert removed.block_hashes == stored.block_hashes
    assert log.drain() == []


def test_a_chunk_that_is_not_whole_blocks_is_one_block_of_the_chunk_size() -> None:
    log = EventLog(96, CHUNK)
    log.stored(spans(1), None, list(range(CHUNK)), ["CPU"])
    (event,) = to_vllm(log.drain())
    assert event.block_size == CHUNK and len(event.block_hashes) == 1


def test_events_encode_as_vllms_batch_wire_format() -> None:
    """What the router decodes: msgpack ``[ts, [tagged events...]]``, hashes as bytes."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    log = EventLog(BLOCK, CHUNK)
    log.stored(spans(1), None, list(range(CHUNK)), ["CPU"])
    payload = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=to_vllm(log.drain())))
    ts, events = msgspec.msgpack.decode(payload)[:2]
    assert ts == 1.0 and events[0]["type"] == "BlockStored"
    assert events[0]["block_hashes"][0] == bytes([0]) * 16 + b"\x00\x00"
    assert events[0]["block_size"] == BLOCK


def test_each_tier_names_the_medium_the_router_credits() -> None:
    # vllm-router's kv_aware policy credits CPU as host, DISK as disk and REMOTE as external:
    # these values are its vocabulary, not kvtier's, and must not change with a tier's name.
    media = {t.name: t.medium for t in (CpuTier, DiskTier, RedisTier, PDBuffer)}
    assert media == {"cpu": "CPU", "disk": "DISK", "redis": "REMOTE", "pd": None}


def test_a_followed_tier_publishes_what_it_adds_if_expected_and_all_it_loses() -> None:
    """The log publishes a tier's adds of chunks a save announced (``expect``), joined into
    one event while they chain; a chunk nobody announced (keyed by an adapter or an image,
    or read back long after its save) is not published, and a removal always is."""
    from kvtier.memory.block_pool import BlockPool
    from tests.storage.tier_contract import CONTRACT_CHUNK, PAGE_BYTES, TOKEN_BYTES

    chunk, block = CONTRACT_CHUNK, CONTRACT_CHUNK // 2
    pool = BlockPool(4, PAGE_BYTES)
    tier = CpuTier(pool, TOKEN_BYTES)
    log = EventLog(block, chunk)
    log.follow(tier, "CPU")
    keys = [bytes([i]) * 16 for i in range(3)]
    tokens = list(range(3 * chunk))
    chunks = [ChunkSpan(i, i * chunk, (i + 1) * chunk, key) for i, key in enumerate(keys)]
    log.expect(chunks[:2], None, tokens)  # the third is never announced
    for key in keys:
        (page,) = pool.allocate(1) or []
        assert tier.insert(key, page, chunk)
    assert tier.remove(keys[0]) and tier.clear() == 2
    stored, removed, cleared = to_vllm(log.drain())
    assert stored.block_hashes == block_names(keys[0], 2) + block_names(keys[1], 2)
    assert stored.parent_block_hash is None and stored.token_ids == tokens[: 2 * chunk]
    assert removed.block_hashes == block_names(keys[0], 2)
    assert set(cleared.block_hashes) == set(block_names(keys[1], 2) + block_names(keys[2], 2))
    pool.close()


def test_adds_that_land_out_of_order_are_published_parent_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A disk tier's writers land a prompt's chunks in any order, and the router ignores a
    store whose parent it does not know: a chunk waits for its parent's add (stored in the
    same call), and one whose parent never lands is published at a drain after HOLD_S."""
    from kvtier.integrations.vllm import events
    from kvtier.storage.base import Membership

    log = EventLog(BLOCK, CHUNK)
    reports: list[Any] = []

    class Recorder:
        def add_membership_listener(self, listener: Any) -> None:
            reports.append(listener)

    log.follow(cast(Any, Recorder()), "DISK")
    (report,) = reports
    keys = [bytes([i + 1]) * 16 for i in range(4)]
    tokens = list(range(4 * CHUNK))
    chunks = [ChunkSpan(i, i * CHUNK, (i + 1) * CHUNK, key) for i, key in enumerate(keys)]
    log.expect(chunks, None, tokens)
    for i in (2, 1, 0):  # the writes of chunks 2 and 1 land before chunk 0's
        report(Membership.ADDED, [keys[i]])
    (stored,) = to_vllm(log.drain())
    assert stored.parent_block_hash is None
    assert stored.block_hashes == [n for k in keys[:3] for n in block_names(k, 2)]
    # a prompt whose first chunk's write failed: its second waits, then goes as it is
    other = [bytes([i + 9]) * 16 for i in range(2)]
    log.expect(
        [ChunkSpan(i, i * CHUNK, (i + 1) * CHUNK, k) for i, k in enumerate(other)], None, tokens
    )
    report(Membership.ADDED, [other[1]])
    assert to_vllm(log.drain()) == []  # waiting for other[0], which never lands
    monkeypatch.setattr(events, "HOLD_S", 0.0)
    (late,) = to_vllm(log.drain())
    assert late.block_hashes == block_names(other[1], 2)
