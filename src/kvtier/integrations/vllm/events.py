"""kvtier's stores and evictions as vLLM KV cache events, so a cache-aware router sees them.

Where they come from and how they travel::

    worker: WorkerSide.save ──▶ EventLog.stored(chunks, medium per tier)
            tier eviction   ──▶ EventLog.removed(keys, medium)     (any thread)
    worker ──▶ KVTierWorkerMetadata.events (with the step's output) ──▶ scheduler
    scheduler: KVTierConnector.take_events() ──▶ vLLM's KV event publisher

One kvtier chunk is one event block: ``block_hashes`` are chunk keys (16 bytes, the prefix
hash chain, so a chunk's hash already names its whole prefix), ``parent_block_hash`` is the
previous chunk's key, ``block_size`` is the chunk size. ``medium`` says which tier: ``CPU``,
``DISK`` or ``REMOTE`` (Redis). Redis evicts on its own and tells no one, so REMOTE has
stores only.

Events are plain tuples until the scheduler turns them into vLLM's types: the worker
metadata is pickled between processes, and the log may be filled from tier threads.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from kvtier.keys import ChunkKey, ChunkSpan
from kvtier.storage.base import Tier

MEDIUM = {"cpu": "CPU", "disk": "DISK", "redis": "REMOTE"}
MAX_PENDING = 100_000  # events kept when nobody takes them (vLLM's events are off)

# ("stored", key, parent key or None, token ids, chunk size, medium) | ("removed", key, medium)
Event = tuple[Any, ...]


class EventLog:
    """Events since the last :meth:`drain`; thread-safe, bounded (oldest dropped)."""

    def __init__(self) -> None:
        self._events: list[Event] = []
        self._lock = threading.Lock()

    def stored(
        self,
        spans: Sequence[ChunkSpan],
        parent: ChunkKey | None,
        tokens: Sequence[int],
        media: Sequence[str],
    ) -> None:
        batch: list[Event] = []
        for span in spans:
            ids = list(tokens[span.start : span.end])
            for medium in media:
                batch.append(("stored", span.key, parent, ids, span.end - span.start, medium))
            parent = span.key
        self._add(batch)

    def removed(self, keys: Sequence[ChunkKey], medium: str) -> None:
        self._add([("removed", key, medium) for key in keys])

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
            _, key, parent, ids, size, medium = event
            out.append(
                BlockStored(
                    block_hashes=[key],
                    parent_block_hash=parent,
                    token_ids=ids,
                    block_size=size,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                )
            )
        else:
            _, key, medium = event
            out.append(BlockRemoved(block_hashes=[key], medium=medium))
    return out
