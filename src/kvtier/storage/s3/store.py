"""Chunks as objects in an S3 bucket (AWS, MinIO, Ceph, SeaweedFS): the store under the
remote tier, outliving every engine that shares it.

Names and values::

    object  <prefix>/<fingerprint hex>/<chunk key hex>      (remote_url: s3://bucket/prefix)
    value   one record of kvtier.storage.records (built by the tier)

Why an index: an object store answers in milliseconds to tens of them, and a 128k-token
prompt is 512 chunks of 256 tokens, so a HEAD per chunk would block vLLM's scheduler for
seconds. The store keeps the set of chunk keys under its fingerprint's prefix in memory
(:mod:`kvtier.storage.s3.index`)::

    open()       one listing of the prefix (waited for up to blocking_timeout_secs; a
                 listing still running after that finishes in the background)
    own writes   added once the PUT returned, removed on delete and on a GET that found
                 nothing (``forget``)
    refresh      a listing every s3_list_interval_secs (:mod:`kvtier.storage.s3.listing`:
                 another engine's chunks appear; keys gone from the listing that this store
                 did not write since it began leave the index)

Each call of :class:`~kvtier.storage.remote.store.ObjectStore` here:

* ``exists_many`` answers from the index and sends nothing (``indexed``): a lookup of any
  length costs zero requests, and a put of a key the index holds completes EXISTS.
* ``get_into``: one GET, ranged to one byte over a record: a larger object is a miss,
  counted ``oversized`` (listings skip it by its size, so it is never fetched whole); the
  tier overlaps a batch's GETs on ``s3_get_threads`` (``read_threads``).
* ``put``: one PUT; the key enters the index (and ADDED is reported) once it returned.
* ``delete_many``: ``DeleteObjects``; the keys leave the index. True where the index held
  the key (an object another engine wrote since the last listing counts as not held).
* ``list_keys``: a fresh listing; ``usage``: the index's bytes, and the same as capacity (an
  object store has no ceiling kvtier can see, so the tier reports itself exactly full).
* Faults: a request that cannot reach the store or runs past ``blocking_timeout_secs``
  raises :class:`TierUnavailable`; the tier then leaves the store alone for
  :data:`RETRY_AFTER_S` (``retry_after_s``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.fingerprint import Fingerprint
from kvtier.keys import ChunkKey
from kvtier.layout import KVLayout
from kvtier.repeated_log import RepeatedLog
from kvtier.storage import record_reads, records
from kvtier.storage.base import TierUsage
from kvtier.storage.remote.store import ObjectStore, RemoteCounters, Visible
from kvtier.storage.s3.client import S3Client
from kvtier.storage.s3.index import ChunkIndex, chunk_key_of
from kvtier.storage.s3.listing import PrefixLister
from kvtier.storage.s3.options import S3Options

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1.0  # how long a store that failed to answer is left alone
# What a codec may add to a chunk's payload (blosc2's worst case is 32 bytes): an object
# above header + payload + this is no record of this tier's, and is not downloaded.
CODEC_SLACK_BYTES = 64 * 1024


@dataclass
class S3Counters(RemoteCounters):
    """The s3 tier's own counts, beside every remote tier's."""

    listings: int = 0  # listings of the prefix completed (open and refreshes)
    oversized: int = 0  # objects under a chunk's name too large to be its record: misses
    unlistable: int = 0  # names skipped by listings: no S3 client can address them


class S3Store(ObjectStore):
    """See the module docstring."""

    name = "s3"
    log = log
    indexed = True
    retry_after_s = RETRY_AFTER_S
    counters: S3Counters

    def __init__(self, options: S3Options, layout: KVLayout, fingerprint: Fingerprint) -> None:
        self.counters = S3Counters()
        self.options = options
        self.fingerprint = fingerprint  # records are verified against it
        self.read_threads = options.get_threads
        self._lock = threading.Lock()
        self._repeated = RepeatedLog(log)
        prefix = options.location.prefix
        self.base = f"{prefix}/" if prefix else ""  # every fingerprint's objects, with its '/'
        self.prefix = f"{self.base}{fingerprint.hex()}/"
        self.client = S3Client(
            options.endpoint,
            options.location.bucket,
            options.credentials,
            timeout_s=options.timeout_s,
            region=options.region,
        )
        self.index = ChunkIndex()
        chunk = layout.payload_bytes(fingerprint.chunk_size)
        self.max_record_bytes = records.header_size() + chunk + CODEC_SLACK_BYTES
        self.lister = PrefixLister(
            self.client,
            self.prefix,
            self.index,
            options.list_interval_s,
            on_listed=lambda: self._count("listings", 1),
            on_failed=lambda exc: self._failed("list", exc),
            max_size=self.max_record_bytes,
            on_skipped=lambda names: self._count("unlistable", len(names)),
        )

    @property
    def where(self) -> str:
        """The bucket, prefix and endpoint, for log lines an operator acts on."""
        endpoint = self.options.endpoint or "AWS"
        return f"s3://{self.options.location.bucket}/{self.prefix} (endpoint {endpoint})"

    @property
    def timeout_s(self) -> float:
        return self.options.timeout_s

    def open(self) -> None:
        """Start the lister; wait for the first listing up to ``blocking_timeout_secs`` (a
        store that is down leaves an empty index, refilled by the next listing)."""
        if not self.lister.start(self.options.timeout_s):
            log.warning(
                "s3 tier: listing %s took over %.1fs; lookups see it when it ends",
                self.where,
                self.options.timeout_s,
            )

    def close(self) -> None:
        self.lister.stop(self.options.timeout_s + 1.0)

    def refresh(self) -> bool:
        """List the prefix once (and the tenants' markers); False when the store did not
        answer. The lister does this every ``s3_list_interval_secs``."""
        return self.lister.refresh()

    def name_of(self, key: ChunkKey) -> str:
        """The object under which chunk ``key`` is stored."""
        return self.prefix + key.hex()

    def get_into(self, key: ChunkKey, out: torch.Tensor) -> int | None:
        name, limit = self.name_of(key), self.max_record_bytes
        value = self.client.get(name, limit + 1)  # at most one byte more: never a huge GET
        if value is not None and len(value) > limit:
            self._count("oversized", 1)
            self._repeated.warning("big", "s3 object %s is over %d bytes: a miss", name, limit)
            return None  # as absent: it leaves the index (listings skip it too)
        if value is None:
            return None
        return record_reads.decode_record_into(value, self.fingerprint, key, out)

    def put(self, key: ChunkKey, parts: Sequence[bytes | memoryview], then: Visible) -> None:
        self.client.put(self.name_of(key), *parts)
        size = sum(memoryview(part).nbytes for part in parts)
        # Readable now (not when queued): into the index and published under one lock.
        self.index.add(key, size, then=then)

    def exists_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return self.index.contains(keys)

    def delete_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        held = self.index.contains(keys)
        self.client.delete([self.name_of(k) for k in keys])
        self.index.discard_many(keys)
        return held

    def list_keys(self) -> list[ChunkKey]:
        named = (chunk_key_of(self.prefix, name) for name, _ in self.client.list(self.prefix))
        return [key for key in named if key is not None]

    def usage(self) -> TierUsage:
        used, entries = self.index.totals()
        return TierUsage(used, used, entries)  # no ceiling kvtier can see: full = held

    def forget(self, key: ChunkKey) -> bool:
        return self.index.discard(key)

    def _failed(self, what: str, exc: BaseException) -> None:
        if self.on_failure is not None:
            self.on_failure(what, exc)
        else:  # not under a tier (a test's store): still said
            log.warning("s3 %s at %s failed: %s", what, self.where, exc)

    def _count(self, field_name: str, delta: int) -> None:
        with self._lock:  # the store's own fields (the tier bumps the others, under its lock)
            setattr(self.counters, field_name, getattr(self.counters, field_name) + delta)
