"""kvtier's stores and evictions as vLLM KV cache events, in the form vllm-router's ``kv_aware``
policy matches against prompts and credits by tier (docs/fleet.md has the router's side).

An event says what a tier *holds*, never what was asked of it: a store is published when the
tier reports the chunk added (``Tier.add_membership_listener``: a CPU insert taken, a disk or
Redis write landed), a removal for every way a chunk leaves (evicted, removed, cleared, found
corrupt, its disk directory lost). Where they come from and how they travel::

    worker: WorkerSide.save ──▶ EventLog.expect(chunks)     (their blocks and tokens, kept)
            tier: chunk added ──▶ EventLog: "stored" in its medium, if expected
            tier: chunk gone  ──▶ EventLog: "removed" in its medium          (any thread)
    worker ──▶ KVTierWorkerMetadata.events (with the step's output) ──▶ scheduler
    scheduler: KVTierConnector.take_events() ──▶ vLLM's KV event publisher (ZMQ PUB, seq numbers,
               ROUTER replay buffer) ──▶ vllm-router --kv-event-source / --kv-event-replay-source

A tier only knows chunk keys, and an event needs the chunk's tokens: the save tells the log
first (``expect``), and the log keeps the last ``KNOWN_CHUNKS`` chunks' blocks, enough for
the writes in flight. A chunk added that the log does not know is not published: one read
back from disk into the CPU tier long after its save, the chunks a disk tier finds at open,
a chunk keyed by an adapter or an image (never expected, see the worker). The router then
credits less than kvtier holds, never more.

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

A tail shorter than one block is not published (the router matches whole blocks only). Tiers
report chunk by chunk; consecutive stores of one medium that chain are sent as one event.

Tiers, and what the router credits (``--kv-penalty-*``); each tier class names its own
medium (``Tier.medium``), and a tier without one (the PD buffer) is not published::

    kvtier tier   medium   ownership      router tier   credit
    cpu           CPU      -              host          0.8
    disk          DISK     -              disk          0.3   (vLLM's own "STORAGE" is not credited)
    redis         REMOTE   kvtier-redis   external      0.6   (to the publishing instance only)

Redis is shared by the fleet, but the router has no fleet-wide owner: a block with an
``ownership`` is a cache-pool copy credited to the instance that published it. kvtier sees
its own deletes of Redis chunks (clear, remove, corrupt) and publishes them; it cannot see a
chunk leave on the server's side (``remote_ttl_secs`` expiry, ``maxmemory`` eviction, another
instance's clear, a server restarted empty), so such a chunk stays credited to this instance
until it restarts. The cost is a routing choice, never a wrong answer: the request sent here
misses in Redis at lookup and is computed. A restarted instance starts vLLM's sequence
numbers again at 0; the router takes the drop as a new incarnation and forgets the old one's
blocks, so kvtier sends no "all cleared" of its own (in vLLM's batch it would follow, and wipe,
the GPU blocks of the same step); a clear sends the removals of what it dropped instead.

Order: the router ignores a store whose parent block it does not know, and a disk tier's
writes land out of order (several writer threads). So a chunk whose parent was expected in
the same store (:meth:`EventLog.expect`) and has not been added to that medium yet is held
until the parent is added, then published after it; one still held after ``HOLD_S`` (its
parent's write failed, or the tier had it already) is published as it is at the next drain
or add.

Events are plain tuples until the scheduler turns them into vLLM's types: the worker
metadata is pickled between processes, and the log may be filled from tier threads.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.keys import ChunkKey, ChunkSpan
from kvtier.storage.base import Membership, Tier

SHARED_POOL = "kvtier-redis"  # ``ownership`` of a block in the fleet-shared Redis tier
OWNERSHIP = {"REMOTE": SHARED_POOL}
MAX_PENDING = 100_000  # events kept when nobody takes them (vLLM's events are off)
KNOWN_CHUNKS = 4096  # chunks whose blocks are kept for their tiers' adds (oldest forgotten)
HOLD_S = 1.0  # how long a chunk waits for its parent's add before it is published anyway

# ("stored", hashes, parent hash or None, token ids, block size, medium)
# ("removed", hashes, medium)
Event = tuple[Any, ...]


def block_names(key: ChunkKey, blocks: int) -> list[bytes]:
    """The event names of a chunk's ``blocks`` blocks: the key, then the block's index."""
    return [key + j.to_bytes(2, "big") for j in range(blocks)]


@dataclass(frozen=True, slots=True)
class ChunkBlocks:
    """One chunk as a store event names it: its whole blocks, the block before the first
    (None at the start of the prompt) and the blocks' token ids."""

    names: list[bytes]
    parent: bytes | None
    ids: array[int]
    parent_chunk: ChunkKey | None = None  # the chunk before, when stored in the same call


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
        self._known: OrderedDict[ChunkKey, ChunkBlocks] = OrderedDict()
        self._added_in: dict[str, OrderedDict[ChunkKey, None]] = {}  # medium -> chunks added
        # medium -> parent chunk -> children waiting for it, with when they began to wait
        self._held: dict[str, dict[ChunkKey, list[tuple[ChunkKey, ChunkBlocks, float]]]] = {}
        self._lock = threading.Lock()

    def follow(self, tier: Tier, medium: str) -> None:
        """Publish what ``tier`` holds in ``medium``: a store for each expected chunk it adds,
        a removal for each chunk it loses (``Tier.add_membership_listener``)."""

        def report(change: Membership, keys: Sequence[ChunkKey]) -> None:
            if change is Membership.ADDED:
                self._added(keys, medium)
            else:
                self.removed(keys, medium)

        tier.add_membership_listener(report)

    def expect(
        self, spans: Sequence[ChunkSpan], parent: ChunkKey | None, tokens: Sequence[int]
    ) -> None:
        """Chunks ``spans`` (consecutive) are about to be stored: keep their blocks, so that
        each followed tier that then adds one publishes it. ``parent`` is the key of the
        chunk before the first (None at the start of the prompt)."""
        chunks = self._blocks(spans, parent, tokens)
        with self._lock:
            known = self._known
            for key, blocks in chunks:
                known[key] = blocks
                known.move_to_end(key)
            while len(known) > KNOWN_CHUNKS:
                known.popitem(last=False)

    def stored(
        self,
        spans: Sequence[ChunkSpan],
        parent: ChunkKey | None,
        tokens: Sequence[int],
        media: Sequence[str],
    ) -> None:
        """Chunks ``spans`` (consecutive) stored in ``media``, as the caller knows without
        seeing the tiers (a kvtier server's); ``parent`` as in :meth:`expect`."""
        chunks = self._blocks(spans, parent, tokens)
        with self._lock:
            for medium in media:
                for _, blocks in chunks:
                    self._add_stored(blocks, medium)

    def removed(self, keys: Sequence[ChunkKey], medium: str) -> None:
        """Chunks ``keys`` left the tier of ``medium`` (all their blocks)."""
        names = [name for key in keys for name in block_names(key, self.per_chunk)]
        with self._lock:
            added = self._added_in.get(medium)
            if added is not None:
                for key in keys:
                    added.pop(key, None)
            if names:
                self._append([("removed", names, medium)])

    def drain(self) -> list[Event]:
        with self._lock:
            self._release_stale(time.monotonic() - HOLD_S)
            events, self._events = self._events, []
        return events

    def _added(self, keys: Sequence[ChunkKey], medium: str) -> None:
        now = time.monotonic()
        with self._lock:
            # Also here, not only at drain: with vLLM's events off nobody drains, and a
            # parent that never lands must not keep its children forever.
            self._release_stale(now - HOLD_S)
            added = self._added_in.setdefault(medium, OrderedDict())
            held = self._held.setdefault(medium, {})
            for key in keys:
                blocks = self._known.get(key)
                if blocks is None:
                    continue
                parent = blocks.parent_chunk
                if parent is not None and parent not in added:
                    held.setdefault(parent, []).append((key, blocks, now))
                    continue
                self._publish(key, blocks, medium)

    def _publish(self, key: ChunkKey, blocks: ChunkBlocks, medium: str) -> None:
        """Under the lock: a store of ``key`` in ``medium``, then of every chunk that waited
        for it (in chain order)."""
        added, held = self._added_in[medium], self._held[medium]
        todo = [(key, blocks)]
        while todo:
            key, blocks = todo.pop()
            self._add_stored(blocks, medium)
            added[key] = None
            added.move_to_end(key)
            while len(added) > KNOWN_CHUNKS:
                added.popitem(last=False)
            todo.extend((k, b) for k, b, _ in reversed(held.pop(key, [])))

    def _release_stale(self, before: float) -> None:
        """Under the lock: publish chunks that waited since ``before`` for a parent."""
        for medium, held in self._held.items():
            stale = [p for p, waiting in held.items() if min(t for _, _, t in waiting) < before]
            for parent in stale:
                for key, blocks, _ in held.pop(parent, []):
                    self._publish(key, blocks, medium)

    def _blocks(
        self, spans: Sequence[ChunkSpan], parent: ChunkKey | None, tokens: Sequence[int]
    ) -> list[tuple[ChunkKey, ChunkBlocks]]:
        size, per_chunk = self.block_size, self.per_chunk
        before = block_names(parent, per_chunk)[-1] if parent is not None else None
        out: list[tuple[ChunkKey, ChunkBlocks]] = []
        previous: ChunkKey | None = None  # a parent stored in this call: waited for
        for span in spans:
            whole = (span.end - span.start) // size
            if not whole:
                break
            names = block_names(span.key, whole)
            ids = array("q", tokens[span.start : span.start + whole * size])
            out.append((span.key, ChunkBlocks(names, before, ids, previous)))
            if whole < per_chunk:
                break  # a partial chunk ends the prompt: its whole blocks only
            before, previous = names[-1], span.key
        return out

    def _add_stored(self, blocks: ChunkBlocks, medium: str) -> None:
        """Under the lock: a store event, joined to the last one when it continues it."""
        events = self._events
        if events:
            last = events[-1]
            if last[0] == "stored" and last[5] == medium and last[1][-1] == blocks.parent:
                last[1].extend(blocks.names)
                last[3].extend(blocks.ids)
                return
        names, ids = list(blocks.names), list(blocks.ids)
        self._append([("stored", names, blocks.parent, ids, self.block_size, medium)])

    def _append(self, batch: list[Event]) -> None:
        self._events.extend(batch)
        overflow = len(self._events) - MAX_PENDING
        if overflow > 0:
            del self._events[:overflow]


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
