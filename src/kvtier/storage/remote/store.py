"""The interface a remote store implements under :class:`~kvtier.storage.remote.tier.RemoteTier`.

A store is what differs between Redis, S3 and the next shared store (GCS, Azure, Valkey):
the names it gives chunks, the calls that move a record's bytes, and how it knows it is
reachable. Everything else a remote tier does (the write queue, the record and its codec,
the outage window, pins, membership events, counters, the tenant ledger) is the tier's,
written once.

Protocol (who calls what, who owns what):

* The tier is the only caller. It builds the record (:mod:`kvtier.storage.records`) and
  hands the store its bytes; the store never encodes, and reads back through
  :mod:`kvtier.storage.record_reads` so a record is verified before a byte reaches a page.
* ``open()`` connects or lists and never raises for a store that is down (it starts
  unavailable and says so once); ``close()`` is called once, after the tier's writers have
  drained. Both are called from the tier's ``open``/``close`` only.
* ``get_into(key, out)`` lands ``key``'s record in ``out`` (a uint8 page) and returns its
  token count, or None when the store has no such record. Raises
  :class:`~kvtier.errors.CorruptRecord` (the tier deletes it and counts it),
  :class:`~kvtier.errors.UnknownRecordFormat` (a miss, kept) and
  :class:`~kvtier.errors.TierError` (a miss; :class:`~kvtier.errors.TierUnavailable`
  opens the tier's outage window when ``retry_after_s`` is above 0).
* ``put(key, parts, then)`` stores the record ``b"".join(parts)`` (header, then payload;
  ``parts`` are views of a page the caller keeps valid until ``put`` returns) and, once it is
  readable, calls ``then((key,))`` under whatever lock makes it visible (an index's), so its
  ADDED membership event can never follow its removal. Raises TierError.
* ``exists_many(keys)`` answers for a batch: one round trip, or none at all for a store
  that keeps an index (``indexed = True``, which also lets the tier answer a put of a key it
  holds EXISTS at once). Raises TierError.
* ``delete_many(keys)`` deletes; returns, per key, whether the store held it as far as it
  knows (a server's answer, or an index's). Raises TierError.
* ``list_keys()`` is every chunk key under this tier's namespace, read now (``clear``).
* ``usage()`` is the store's figures (a TierUsage); raises TierError when it cannot say.
* ``forget(key)``: the tier read ``key`` and the store had no record: True when the store
  believed it held one (an index: the key leaves it, and the tier reports it removed).
* ``available()`` is False while the store knows itself away (a link reconnecting in the
  background). A store whose ``retry_after_s`` is above 0 relies on the tier instead: after
  a :class:`TierUnavailable` the tier leaves it alone for that long.
* ``note_counters()`` copies counts the store keeps elsewhere (its link's) into
  ``counters``; the tier calls it at ``usage()``.
* ``name_of(key)`` is the store's name for a chunk (a Redis key, an object name): for log
  lines and tests, never parsed by the tier.
* ``on_failure(what, exc)`` is set by the tier: a store's background work (a listing)
  reports its failures through it, as a call's would be (an outage opens the window).
* ``counters`` is the tier's counters object, created by the store (its own fields beside
  every remote tier's); the store bumps only fields of its own, the tier the others.

Thread safety: every method but ``open``/``close`` may be called from the tier's writer and
reader threads and the engine's caller at once.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.keys import ChunkKey
from kvtier.storage.base import TierCounters, TierUsage

Visible = Callable[[Sequence[ChunkKey]], None]


@dataclass
class RemoteCounters(TierCounters):
    """Every remote tier's counts, beside every tier's; a store subclasses it with its own."""

    outages: int = 0  # the store became unreachable
    available: int = 1  # gauge: 0 while the store is away


class ObjectStore(ABC):
    """A shared store of records by chunk key. See the module docstring."""

    name: str = "remote"  # "redis", "s3": thread names and log lines
    indexed: bool = False  # exists_many answers from a local index, with no request
    read_threads: int = 0  # > 0: the tier overlaps a batch's reads on this many threads
    retry_after_s: float = 0.0  # > 0: the tier's outage window after a TierUnavailable
    counters: RemoteCounters
    log: logging.Logger  # the store's module logger: the tier logs its lines through it
    on_failure: Callable[[str, BaseException], None] | None = None  # set by the tier

    @property
    @abstractmethod
    def where(self) -> str:
        """Where the store is, for log lines an operator acts on (no secret)."""

    @property
    def timeout_s(self) -> float:
        """How long one call may take (``blocking_timeout_secs``)."""
        return 10.0

    def open(self) -> None:
        return None

    def close(self) -> None:
        return None

    def available(self) -> bool:
        return True

    @abstractmethod
    def name_of(self, key: ChunkKey) -> str | bytes: ...

    @abstractmethod
    def get_into(self, key: ChunkKey, out: torch.Tensor) -> int | None: ...

    @abstractmethod
    def put(self, key: ChunkKey, parts: Sequence[bytes | memoryview], then: Visible) -> None: ...

    @abstractmethod
    def exists_many(self, keys: Sequence[ChunkKey]) -> list[bool]: ...

    @abstractmethod
    def delete_many(self, keys: Sequence[ChunkKey]) -> list[bool]: ...

    @abstractmethod
    def list_keys(self) -> list[ChunkKey]: ...

    @abstractmethod
    def usage(self) -> TierUsage: ...

    def forget(self, key: ChunkKey) -> bool:
        return False

    def note_counters(self) -> None:
        """Copy counts kept elsewhere (a link's) into ``counters``; called at ``usage()``."""
        return None
