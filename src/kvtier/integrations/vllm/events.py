"""kvtier's stores and evictions as vLLM KV cache events, in the form vllm-router's ``kv_aware``
policy matches against prompts and credits by tier (docs/fleet.md has the router's side).

Where they come from and how they travel::

    worker: WorkerSide.save ──▶ EventLog.stored(chunks, tiers)
            tier eviction   ──▶ EventLog.removed(keys, tier)       (any thread)
    worker ──▶ KVTierWorkerMetadata.events (with the step's output) ──▶ scheduler
    scheduler: KVTierConnector.take_events() ──▶ vLLM's KV event publisher (ZMQ PUB, seq numbers,
               ROUTER replay buffer) ──▶ vllm-router --kv-event-source / --kv-event-replay-source

What the router does with an event (vllm-router 0.1.17, measured): it hashes ``token_ids`` in
runs of ``block_size`` (sha256 of the ids) and walks its prefix tree with those hashes, so a
block is matched by its tokens; ``block_hashes`` are opaque names used only to chain a store to
its parent and to find a block again on removal. It ignores an event whose ``block_size`` is
not its ``--kv-event-block-size``, and a store whose parent it does not know. So one kvtier
chunk becomes ``chunk_size / block_size`` event blocks of vLLM's block size (128 on the CPU
build), each named by the chunk key plus its index in the chunk::

    chunk i (key K_i, 256 tokens)        event blocks (block_size 128)
    ┌──────────────┬──────────────┐      K_i‖00 : tokens [256i, 256i+128)   parent K_{i-1}‖01
    │  block 2i    │  block 2i+1  │  ──▶ K_i‖01 : tokens [256i+128, 256i+256)  parent K_i‖00
    └──────────────┴──────────────┘

A tail shorter than one block is not published (the router matches whole blocks only).

Tiers, and what the router credits (``--kv-penalty-*``); each tier class names its own
medium (``Tier.medium``), and a tier without one (the PD buffer) is not published::

    kvtier tier   medium   ownership      router tier   credit
    cpu           CPU      -              host          0.8
    disk          DISK     -              disk          0.3   (vLLM's own "STORAGE" is not credited)
    redis         REMOTE   kvtier-redis   external      0.6   (to the publishing instance only)

Redis is shared by the fleet, but the router has no fleet-wide owner: a block with an
``ownership`` is a cache-pool copy credited to the instance that published it. Redis evicts on
its own and tells no one, so REMOTE has stores only. A restarted instance starts vLLM's sequence
numbers again at 0; the router takes the drop as a new incarnation and forgets the old one's
blocks, so kvtier sends no "all cleared" of its own (in vLLM's batch it would follow, and wipe,
the GPU blocks of the same step).

Events are plain tuples until the scheduler turns them into vLLM's types: the worker
metadata is pickled between processes, and the log may be filled from tier threads.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from kvtier.keys import ChunkKey, ChunkSpan
from kvtier.storage.base import Tier

SHARED_POOL = "kvtier-redis"  # ``ownership`` of a block in the fleet-shared Redis tier
OWNERSHIP = {"REMOTE": SHARED_POOL}
MAX_PENDING = 100_000  # events kept when nobody takes them (vLLM's events are off)

# ("stored", hashes, parent hash or None, token ids, block size, medium)
# ("removed", hashes, medium)
Event = tuple[Any, ...]


def block_names(key: ChunkKey, blocks: int) -> list[bytes]:
    """The event names of a chunk's ``blocks`` blocks: the key, then the block's index."""
    return [key + j.to_bytes(2, "big") for j in range(blocks)]


class EventLog:
    """Events since the last :meth:`drain`; thread-safe, bounded (oldest dropped).

    ``block_size`` is vLLM's (the router's ``--kv-event-block-size``) and ``chunk_size``
    kvtier's; a chunk size that is not a whole number of blocks is published in one block of
    the chunk size (the router then matches it only if told that block size)."""

    def __init__(self, block_size: int, chunk_size: int) -> None:
        whole = block_size > 0 and chunk_size % block_size == 0
        self.block_size = block_size if whole else chunk_size
        self.per_chunk = chunk_size // self.block_size
        self._events: list[Event] = []
        self._lock = threading.Lock()

    def stored(
        self,
        spans: Sequence[ChunkSpan],
        parent: ChunkKey | None,
        tokens: Sequence[int],
        media: Sequence[str],
    ) -> None:
        """Chunks ``spans`` (consecutive) stored in ``media``; ``parent`` is the key of the
        chunk before the first (None at the start of the prompt)."""
        size = self.block_size
        names: list[bytes] = []
        for span in spans:
            whole = (span.end - span.start) // size
            names.extend(block_names(span.key, whole))
            if whole < self.per_chunk:
                break  # a partial chunk ends the prompt: its whole blocks only
        if not names:
            return
        start = spans[0].start
        ids = list(tokens[start : start + len(names) * size])
        first_parent = block_names(parent, self.per_chunk)[-1] if parent is not None else None
        self._add([("stored", names, first_parent, ids, size, medium) for medium in media])

    def removed(self, keys: Sequence[ChunkKey], medium: str) -> None:
        """Chunks ``keys`` left the tier of ``medium`` (all their blocks)."""
        names = [name for key in keys for name in block_names(key, self.per_chunk)]
        if names:
            self._add([("removed", names, medium)])

    def drain(self) -> list[Event]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def _add(self, batch: list[Event]) -> None:
        with self._lock:
            self._events.extend(batch)
            overflow = len(self._events) - MAX_PENDING
            if overflow > 0:
                del self._events[:overflow]


def chain_evictions(tier: Tier, medium: str, log: EventLog) -> None:
    """Report ``tier``'s evictions to ``log`` as ``removed`` events, beside the tier's other
    eviction listeners (explain's): ``Tier.add_evict_listener`` keeps them all."""

    def report(keys: Sequence[ChunkKey]) -> None:
        log.removed(keys, medium)

    tier.add_evict_listener(report)


def to_vllm(events: Sequence[Event]) -> list[Any]:
    """The scheduler side: plain tuples -> vLLM's BlockStored / BlockRemoved."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    out: list[Any] = []
    for event in events:
        if event[0] == "stored":
            _, names, parent, ids, size, medium = event
            out.append(
                BlockStored(
                    block_hashes=list(names),
                    parent_block_hash=parent,
                    token_ids=ids,
                    block_size=size,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                    ownership=OWNERSHIP.get(medium),
                )
            )
        else:
            _, names, medium = event
            ownership = OWNERSHIP.get(medium)
            out.append(BlockRemoved(block_hashes=list(names), medium=medium, ownership=ownership))
    return out
