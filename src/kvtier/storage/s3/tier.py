"""The object-store tier: chunks as objects in an S3 bucket (AWS, MinIO, Ceph, SeaweedFS),
shared by a fleet of engines and outliving all of them.

Names and values::

    object  <prefix>/<fingerprint hex>/<chunk key hex>      (remote_url: s3://bucket/prefix)
    value   one record of kvtier.storage.records: 4 KiB checksummed header, then the payload
            as the tier's codec stores it (``remote_codec``, identity by default)

Why an index: an object store answers in milliseconds to tens of them, and a 128k-token
prompt is 512 chunks of 256 tokens, so a HEAD per chunk would block vLLM's scheduler for
seconds. The tier keeps the set of chunk keys under its fingerprint's prefix in memory::

    open()       one listing of the prefix (waited for up to blocking_timeout_secs; a
                 listing still running after that finishes in the background)
    own writes   added once the PUT returned, removed on remove/clear/corrupt/404
    refresh      a listing every s3_list_interval_secs (another engine's chunks appear;
                 keys gone from the listing that this tier did not write since it began
                 leave the index)

``contains`` answers from the index and sends nothing: a lookup of any length costs zero
requests. Another engine's chunk is found by this one at the next refresh; a chunk deleted
behind the tier's back is a GET that answers 404: a miss, and it leaves the index.

Protocol (see :mod:`kvtier.storage.base`), and how each call behaves here:

* ``get_into`` / ``get_many_into``: one GET per chunk, ``s3_get_threads`` in flight, ranged
  to one byte over a record (a larger object is a miss, counted ``oversized``; listings
  skip it by its size, so it is never fetched whole); the record's header and stored
  checksum are verified before a byte reaches the page
  (:func:`kvtier.storage.record_reads.decode_record_into`). A corrupt record is a miss, deleted,
  counted; one of another format version or codec is a miss, kept. The whole batch waits at
  most ``blocking_timeout_secs``; GETs still running then raise :class:`ReadAbandoned`
  naming their pages (each GET is itself bounded by the same timeout, so they end).
* ``put``: a key in the index completes EXISTS at once (same key, same bytes); otherwise
  queued to ``s3_put_threads`` writers, at most ``s3_inflight_bytes`` queued or being sent
  (beyond that DROPPED at once). ``on_done`` runs exactly once per put.
* ``pin`` / ``unpin``: a shared store cannot pin (other engines, lifecycle rules delete at
  will): True, and only this tier's :meth:`clear` keeps the pinned objects.
* ``tenant_quotas`` (:mod:`kvtier.storage.s3.quotas`): an empty marker object per chunk
  names its tenant; a tenant over its limit loses its oldest, across the fleet as of the
  last listing; byte rows only.
* Faults: a request that cannot reach the store or runs past ``blocking_timeout_secs`` marks
  the store down for :data:`RETRY_AFTER_S`; while down, reads miss and puts complete DROPPED
  at once, queued ones too (no call waits on a store known to be away); the next call after
  that tries again.
  ``remove`` and ``clear`` raise :class:`TierUnavailable`. ``usage`` counts the index: the
  bytes of the objects it knows; capacity is the same figure (an object store has no
  ceiling kvtier can see, so the tier reports itself exactly full, never over).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.config import Config
from kvtier.errors import CorruptRecord, StateError, TierError, TierUnavailable, UnknownRecordFormat
from kvtier.fingerprint import Fingerprint
from kvtier.keys import ChunkKey
from kvtier.layout import KVLayout
from kvtier.lifecycle import CallGuard, Lifecycle
from kvtier.repeated_log import RepeatedLog
from kvtier.storage import record_reads, records
from kvtier.storage.base import (
    OnDone,
    PutOutcome,
    PutResult,
    ReadAbandoned,
    Tier,
    TierCounters,
    TierUsage,
)
from kvtier.storage.codecs import IDENTITY, PayloadCodec, codec_from_config, tier_fingerprint
from kvtier.storage.policy.quotas import TenantQuotas
from kvtier.storage.remote_pins import RemotePins
from kvtier.storage.remote_quotas import RemoteQuotaHooks
from kvtier.storage.s3.client import S3Client
from kvtier.storage.s3.index import ChunkIndex, chunk_key_of
from kvtier.storage.s3.listing import PrefixLister
from kvtier.storage.s3.options import S3Options
from kvtier.storage.s3.quotas import S3Quotas
from kvtier.storage.write_queue import Write, WriteQueue, complete

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1.0  # how long a store that failed to answer is left alone
# What a codec may add to a chunk's payload (blosc2's worst case is 32 bytes): an object
# above header + payload + this is no record of this tier's, and is not downloaded.
CODEC_SLACK_BYTES = 64 * 1024


@dataclass
class S3Counters(TierCounters):
    """The s3 tier's own counts, beside every tier's."""

    outages: int = 0  # the store stopped answering
    listings: int = 0  # listings of the prefix completed (open and refreshes)
    available: int = 1  # gauge: 0 while the store is marked down
    oversized: int = 0  # objects under a chunk's name too large to be its record: misses
    unlistable: int = 0  # names skipped by listings: no S3 client can address them


class S3Tier(RemotePins, RemoteQuotaHooks, Tier):
    """See the module docstring."""

    name = "s3"
    medium = "REMOTE"  # shared by the fleet: events carry the shared-pool ownership
    counters: S3Counters

    def __init__(
        self,
        options: S3Options,
        layout: KVLayout,
        fingerprint: Fingerprint,
        codec: PayloadCodec = IDENTITY,
    ) -> None:
        super().__init__()
        self.counters = S3Counters()
        self.options = options
        self.layout = layout
        self.fingerprint = tier_fingerprint(fingerprint, codec)  # a lossy codec: its own cache
        self.codec = codec
        prefix = options.location.prefix
        self.prefix = (
            f"{prefix}/{self.fingerprint.hex()}/" if prefix else f"{self.fingerprint.hex()}/"
        )
        self.client = S3Client(
            options.endpoint,
            options.location.bucket,
            options.credentials,
            timeout_s=options.timeout_s,
            region=options.region,
        )
        self.index = ChunkIndex()
        chunk = layout.payload_bytes(self.fingerprint.chunk_size)
        self.max_record_bytes = records.header_size() + chunk + CODEC_SLACK_BYTES
        self.writes = WriteQueue(
            options.put_threads, options.inflight_bytes, self._write, "kvtier-s3-writer"
        )
        self._readers: ThreadPoolExecutor | None = None
        self._guard = CallGuard("s3 tier")
        self._lock = threading.Lock()
        self._repeated = RepeatedLog(log)
        self._down_until = 0.0
        self.lister = PrefixLister(
            self.client,
            self.prefix,
            self.index,
            options.list_interval_s,
            on_listed=lambda: self._bump(listings=1),
            on_failed=lambda exc: self._failed("list", exc),
            max_size=self.max_record_bytes,
            on_skipped=lambda names: self._bump(unlistable=len(names)),
        )
        self._quotas: S3Quotas | None = None  # tenant_quotas (attach_quotas)

    @classmethod
    def from_config(cls, config: Config, layout: KVLayout, fingerprint: Fingerprint) -> S3Tier:
        codec = codec_from_config("remote_codec", config.remote_codec, layout.dtype)
        return cls(S3Options.from_config(config), layout, fingerprint, codec)

    def object_name(self, key: ChunkKey) -> str:
        """The object under which chunk ``key`` is stored."""
        return self.prefix + key.hex()

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> None:
        """Start the writers, the readers and the lister; wait for the first listing up to
        ``blocking_timeout_secs`` (a store that is down leaves an empty index, refilled by
        the next listing that succeeds)."""
        if self._guard.state is not Lifecycle.NEW:
            raise StateError(f"s3 tier is {self._guard.state.value}; open it once")
        self.writes.open()
        self._readers = ThreadPoolExecutor(self.options.get_threads, "kvtier-s3-reader")
        if not self.lister.start(self.options.timeout_s):
            log.warning(
                "s3 tier: listing s3://%s/%s took over %.1fs; lookups see it when it ends",
                self.options.location.bucket,
                self.prefix,
                self.options.timeout_s,
            )
        if self._quotas is not None:
            self._quotas.warn_shares()
            self._quotas.quotas.subscribe(self._quotas_changed)
        self._guard.open()

    def close(self) -> None:
        """Refuse new calls, wait for running ones, drain queued writes (each bounded by the
        timeout), stop the threads. Idempotent."""
        was_open = self._guard.state is Lifecycle.OPEN
        if not self._guard.close(self.options.timeout_s + 1.0):
            log.warning("s3 tier closing with calls still running past the timeout")
        if was_open:
            if self._quotas is not None:
                self._quotas.quotas.unsubscribe(self._quotas_changed)
            self.lister.stop(0)  # no listing starts from now on
            self.writes.close(self.options.timeout_s * 2 + 1.0)
            if self._readers is not None:
                self._readers.shutdown(wait=False, cancel_futures=True)
            self.lister.stop(self.options.timeout_s + 1.0)

    # -- the index (kvtier.storage.s3.listing) -----------------------------------------------
    def refresh(self) -> bool:
        """List the prefix once (and the tenants' markers); False when the store did not
        answer. The lister does this every ``s3_list_interval_secs``."""
        return self.lister.refresh()

    # -- reads -----------------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """From the index: no request (see the module docstring)."""
        with self._guard.call():
            return self.index.contains(keys)

    def get_into(self, key: ChunkKey, out: torch.Tensor) -> int | None:
        return self.get_many_into([(key, out)])[0]

    def get_many_into(self, items: Sequence[tuple[ChunkKey, torch.Tensor]]) -> list[int | None]:
        with self._guard.call():
            return self._get_many(items)

    def _get_many(self, items: Sequence[tuple[ChunkKey, torch.Tensor]]) -> list[int | None]:
        if not items:
            return []
        if self._is_down() or self._readers is None:
            self._bump(misses=len(items))
            return [None] * len(items)
        deadline = time.monotonic() + self.options.timeout_s
        futures = [self._readers.submit(self._read, key, out) for key, out in items]
        wait_futures(futures, timeout=max(0.0, deadline - time.monotonic()))
        results: list[int | None] = []
        busy: dict[int, Future[Any]] = {}
        for i, future in enumerate(futures):
            if future.done() and not future.cancelled():
                results.append(future.result())
            else:
                if not future.cancel():
                    busy[i] = future  # still writing into its page: the caller keeps it
                results.append(None)
                self._bump(misses=1)
        if busy:
            self._mark_down(TierUnavailable("s3 reads ran past blocking_timeout_secs"))
            raise ReadAbandoned(
                f"{len(busy)} s3 reads ran past {self.options.timeout_s:g}s", busy, results
            )
        return results

    def _read(self, key: ChunkKey, out: torch.Tensor) -> int | None:
        name = self.object_name(key)
        try:
            limit = self.max_record_bytes  # a GET of at most one byte more: never a huge one
            value = self.client.get(name, limit + 1)
            if value is not None and len(value) > limit:
                self._bump(oversized=1)
                self._repeated.warning("big", "s3 object %s is over %d bytes: a miss", name, limit)
                value = None  # as absent: it leaves the index (listings skip it too)
            if value is None:
                self._bump(misses=1)
                if self.index.discard(key):
                    self.report_removed((key,))  # deleted behind our back (another engine)
                return None
            tokens = record_reads.decode_record_into(value, self.fingerprint, key, out)
        except UnknownRecordFormat as exc:
            # Kept: another engine of the fleet may read it; a store of ours replaces it.
            self._repeated.warning(
                "format", "s3 object %s is in a format this kvtier does not read (%s)", name, exc
            )
            self._bump(misses=1)
            return None
        except CorruptRecord as exc:
            log.warning("s3 object %s is corrupt, deleting it: %s", name, exc)
            self.note_corrupt(key, str(exc))
            self._bump(corrupt=1, misses=1)
            self.index.discard(key)
            self._delete_quietly(name)
            self.report_removed((key,))
            return None
        except TierError as exc:
            self._failed("read", exc)
            self._bump(misses=1)
            return None
        self._bump(hits=1, bytes_read=self.layout.payload_bytes(tokens))
        return tokens

    # -- writes ----------------------------------------------------------------------------
    def put(self, key: ChunkKey, payload: torch.Tensor, num_tokens: int, on_done: OnDone) -> None:
        nbytes = records.header_size() + payload.numel()
        with self._guard.call():
            if self.index.contains((key,))[0] or self.writes.holds(key):
                if self._quotas is not None:
                    self._quotas.take(key)  # counted by the write that stored it
                complete(on_done, PutResult(key, PutOutcome.EXISTS))
                return
            if self._is_down():
                reason = "the object store is not answering"
            else:
                reason = self.writes.submit(Write(key, payload, num_tokens, nbytes, on_done))
        if reason:
            if self._quotas is not None:
                self._quotas.take(key)  # never written: its tenant is not needed
            self._bump(dropped=1)
            complete(on_done, PutResult(key, PutOutcome.DROPPED, reason))

    def _write(self, job: Write) -> PutResult:
        quotas = self._quotas
        tenant = quotas.take(job.key) if quotas is not None else ""
        refused = quotas.below_one_chunk(tenant) if quotas is not None else None
        if self._is_down():  # queued before the store went away: dropped now, not sent to wait
            self._bump(dropped=1)
            return PutResult(job.key, PutOutcome.DROPPED, "the object store is not answering")
        if refused:  # a limit under one chunk: not worth sending
            self._repeated.warning(("quota", tenant), "s3 tier: %s", refused)
            self._bump(dropped=1)
            return PutResult(job.key, PutOutcome.DROPPED, refused)
        try:
            header, stored = records.encode_parts(
                job.key, self.fingerprint, job.num_tokens, job.payload, self.codec
            )
            self.client.put(self.object_name(job.key), header, stored)
            if quotas is not None:  # its tenant's marker (if it fails, the chunk goes again)
                quotas.stored(tenant, job.key)
        except (TierError, ValueError, TypeError) as exc:
            self._failed("write", exc)
            self._bump(failed=1)
            return PutResult(job.key, PutOutcome.FAILED, str(exc))
        self._bump(stored=1, bytes_written=stored.nbytes)
        # Readable now (not when queued): into the index and published under one lock.
        self.index.add(job.key, len(header) + stored.nbytes, then=self.report_added)
        if quotas is not None:
            self._evicted(quotas.enforce(tenant))
        return PutResult(job.key, PutOutcome.STORED)

    # -- tenant_quotas (kvtier.storage.s3.quotas) -------------------------------------------
    def attach_quotas(self, quotas: TenantQuotas) -> None:
        """Cap each tenant's stores from now on; before :meth:`open` only."""
        if self._guard.state is not Lifecycle.NEW:
            raise StateError("s3 tier quotas are attached before it opens")
        unit = records.header_size() + self.layout.payload_bytes(self.fingerprint.chunk_size)
        base = self.prefix[: -len(self.fingerprint.hex()) - 1]  # the objects' prefix, its '/'
        self._quotas = S3Quotas(quotas, unit, self.index, self.client, base, self.fingerprint)
        self.lister.quotas = self._quotas

    def _quotas_changed(self) -> None:
        if self._quotas is not None:  # PUT /quota: tenants over their new limit drop now
            self._evicted(self._quotas.enforce_all())

    def _evicted(self, keys: list[ChunkKey]) -> None:
        if keys:
            self._bump(evicted=len(keys))
            self.report_evicted(keys)

    def flush(self, timeout: float | None = None) -> bool:
        return self.writes.flush(timeout)

    # -- management ------------------------------------------------------------------------
    def remove(self, key: ChunkKey) -> bool:
        with self._guard.call():
            name = self.object_name(key)
            held = self.index.discard(key) or self.client.exists(name)
            if held:
                self.client.delete([name])
                self.report_removed((key,))
            return held

    def clear(self) -> int:
        """Delete this fingerprint's objects (a fresh listing: other engines' too) except
        those pinned through this tier. Raises :class:`TierUnavailable` when the store is
        unreachable."""
        with self._guard.call():
            keep = self.pinned()
            named = (chunk_key_of(self.prefix, name) for name, _ in self.client.list(self.prefix))
            gone = [key for key in named if key is not None and key not in keep]
            self.client.delete([self.object_name(k) for k in gone])
            self.index.discard_many(gone)
            self.report_removed(gone)
            return len(gone)

    def usage(self) -> TierUsage:
        with self._guard.call():
            self.counters.available = int(not self._is_down())
            used, entries = self.index.totals()
            return TierUsage(used, used, entries)  # no ceiling kvtier can see: full = held

    # -- helpers ---------------------------------------------------------------------------
    @property
    def where(self) -> str:
        """The bucket, prefix and endpoint, for log lines an operator acts on."""
        options = self.options
        endpoint = options.endpoint or "AWS"
        return f"s3://{options.location.bucket}/{self.prefix} (endpoint {endpoint})"

    def _is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def _mark_down(self, exc: BaseException) -> None:
        with self._lock:
            if time.monotonic() >= self._down_until:
                self.counters.outages += 1
                log.warning(
                    "s3 tier %s: the store is not answering (%s); misses for now", self.where, exc
                )
            self._down_until = time.monotonic() + RETRY_AFTER_S

    def _failed(self, what: str, exc: BaseException) -> None:
        if isinstance(exc, TierUnavailable):
            self._mark_down(exc)
        else:
            key = (what, type(exc).__name__)
            self._repeated.warning(key, "s3 %s at %s failed: %s", what, self.where, exc)

    def _delete_quietly(self, name: str) -> None:
        try:
            self.client.delete([name])
        except TierError as exc:
            log.warning("could not delete corrupt s3 object %s: %s", name, exc)

    def _bump(self, **deltas: int) -> None:
        with self._lock:
            for field_name, delta in deltas.items():
                setattr(self.counters, field_name, getattr(self.counters, field_name) + delta)
