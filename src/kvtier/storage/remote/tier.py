"""One remote tier over any :class:`~kvtier.storage.remote.store.ObjectStore`: chunks in a
store a fleet of engines shares (Redis, S3), written once for every store.

Names and values: the store names a chunk under a namespace of the tier's fingerprint (which
keeps models, layouts and tenants apart and lets :meth:`clear` delete exactly this engine's
chunks); the value is one record of :mod:`kvtier.storage.records` (4 KiB checksummed header,
then the payload as the tier's codec stores it, identity by default). A lossy codec is
another cache: its own fingerprint, so its own namespace.

What the tier owns, and what it asks of the store and the ledger::

    RemoteTier                               ObjectStore (redis/, s3/)
    ------------------------------------     -------------------------------------
    write queue: put_threads writers,        put(key, parts, then)  the record's bytes
      at most inflight_bytes queued
    record + codec: encode, verify           get_into(key, out)     lands and verifies
    outage window (remote.outage)            available()            a link's own state
    pins (clear keeps them), membership      exists_many, delete_many, list_keys
    counters (the store adds its own)        usage()
    tenants -> QuotaLedger                   refusal, charge -> victims, enforce_all

Protocol (see :mod:`kvtier.storage.base`), and how each call behaves here:

* ``contains(keys)``: the store's ``exists_many`` (one round trip, or none for an indexed
  store); a store that does not answer: all False.
* ``get_into`` / ``get_many_into``: the store's ``get_into`` per chunk, on ``read_threads``
  threads when the store overlaps reads (the whole batch then waits at most
  ``blocking_timeout_secs``; reads still running raise :class:`ReadAbandoned` naming their
  pages). A corrupt record is a miss, deleted and counted; one of another format version or
  codec is a miss, kept (another engine of the fleet may read it), logged once per 30 s.
* ``put``: an indexed store's key (or one queued) completes EXISTS at once; otherwise queued
  to the writers (:mod:`kvtier.storage.write_queue`); beyond ``inflight_bytes`` queued or
  being sent, or while the store is away, DROPPED at once. ``on_done`` runs exactly once per
  put. ADDED is reported once the store has the record, not when it is queued.
* ``pin`` / ``unpin`` (:mod:`kvtier.storage.remote.pins`): a shared store cannot pin; True,
  and only this tier's :meth:`clear` keeps the pinned chunks.
* ``tenant_quotas`` (:mod:`kvtier.storage.remote.ledger`): each stored chunk is charged
  to its put's tenant (``PutJob.tenant``, carried by the queued write) in a ledger the
  fleet sees; a tenant over its limit loses its own oldest. A cap (the store's own eviction
  knows no tenants), never a guarantee. ``tenants`` is that ledger (None: quotas off).
* Faults: a store that is away (its ``available()`` is False, or it raised
  :class:`TierUnavailable` less than ``retry_after_s`` ago) costs nothing: reads miss and
  puts complete DROPPED at once, queued ones too. ``remove`` and ``clear`` raise
  :class:`TierUnavailable`; ``usage`` reports the last figures it read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvtier.errors import CorruptRecord, StateError, TierError, TierUnavailable, UnknownRecordFormat
from kvtier.fingerprint import Fingerprint
from kvtier.keys import ChunkKey
from kvtier.layout import KVLayout
from kvtier.lifecycle import CallGuard, Lifecycle
from kvtier.repeated_log import RepeatedLog
from kvtier.storage import records
from kvtier.storage.base import PutJob, PutOutcome, PutResult, ReadAbandoned, Tier, TierUsage
from kvtier.storage.codecs import IDENTITY, PayloadCodec
from kvtier.storage.remote.ledger import LedgerFactory, QuotaLedger
from kvtier.storage.remote.outage import OutageWindow
from kvtier.storage.remote.pins import PinCounts
from kvtier.storage.remote.store import ObjectStore, RemoteCounters
from kvtier.storage.tenants.ledger import NO_SALT
from kvtier.storage.tenants.quotas import TenantQuotas
from kvtier.storage.write_queue import Write, WriteQueue, complete


class WriteOptions(Protocol):
    """What the tier reads of a store's options (``RedisOptions``, ``S3Options``)."""

    @property
    def put_threads(self) -> int: ...  # writer threads

    @property
    def inflight_bytes(self) -> int: ...  # bytes queued or being sent; past it DROPPED


@dataclass(slots=True)
class TenantWrite(Write):
    """A queued write and the tenant its put named (charged when it lands)."""

    tenant: str = NO_SALT


class RemoteTier(Tier):
    """See the module docstring. ``fingerprint`` is the tier's own (the engine's, under
    :func:`~kvtier.storage.codecs.tier_fingerprint` for ``codec``), the one the store's
    namespace was built from; ``ledger`` makes the store's tenant ledger (None: the store
    keeps no tenants)."""

    medium = "REMOTE"  # shared by the fleet: events carry the shared-pool ownership
    counters: RemoteCounters

    def __init__(
        self,
        store: ObjectStore,
        layout: KVLayout,
        fingerprint: Fingerprint,
        options: WriteOptions,
        *,
        codec: PayloadCodec = IDENTITY,
        ledger: LedgerFactory | None = None,
    ) -> None:
        super().__init__()
        self.name = store.name
        self.store = store
        self.counters = store.counters
        self.layout = layout
        self.fingerprint = fingerprint
        self.codec = codec  # what writes encode with; reads decode any registered codec
        self.options = options
        self.writes = WriteQueue(
            options.put_threads, options.inflight_bytes, self._write, f"kvtier-{store.name}-writer"
        )
        self.pins = PinCounts()
        self.ledger: QuotaLedger | None = None  # tenant_quotas (attach_quotas)
        self._ledger_factory = ledger
        self._readers: ThreadPoolExecutor | None = None
        self._guard = CallGuard(f"{store.name} tier")
        self._lock = threading.Lock()
        # A store that refuses every chunk (full, at maxmemory): one line per 30 s, counted.
        self._repeated = RepeatedLog(store.log)
        self.outage = OutageWindow(store, self._repeated)
        store.on_failure = self.outage.failed
        self._last_usage = TierUsage(0, 0, 0)

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> None:
        """Open the store (one that is away starts the tier disabled, with one warning),
        then the ledger, the writers and the readers."""
        if self._guard.state is not Lifecycle.NEW:
            raise StateError(f"{self.name} tier is {self._guard.state.value}; open it once")
        self.store.open()
        if self.ledger is not None:
            self.ledger.capacity_read(0 if self.outage.is_down() else self._usage().capacity_bytes)
            self.ledger.opened()
            self.ledger.quotas.subscribe(self._quotas_changed)
        self.writes.open()
        if self.store.read_threads:
            reader = f"kvtier-{self.name}-reader"
            self._readers = ThreadPoolExecutor(self.store.read_threads, reader)
        self._guard.open()

    def close(self) -> None:
        """Refuse new calls, wait for running ones, drain queued writes (each bounded by the
        timeout), stop the threads, close the store. Idempotent."""
        was_open = self._guard.state is Lifecycle.OPEN
        timeout = self.store.timeout_s
        if not self._guard.close(timeout + 1.0):
            self.store.log.warning("%s tier closing with calls running past the timeout", self.name)
        if was_open:
            if self.ledger is not None:
                self.ledger.quotas.unsubscribe(self._quotas_changed)
            self.writes.close(timeout * 2 + 1.0)
            if self._readers is not None:
                self._readers.shutdown(wait=False, cancel_futures=True)
            self.store.close()

    # -- reads -----------------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._guard.call():
            if not keys:
                return []
            try:
                return self.store.exists_many(keys)
            except TierError as exc:
                self.outage.failed("lookup", exc)
                return [False] * len(keys)

    def get_into(self, key: ChunkKey, out: torch.Tensor) -> int | None:
        return self.get_many_into([(key, out)])[0]

    def get_many_into(self, items: Sequence[tuple[ChunkKey, torch.Tensor]]) -> list[int | None]:
        with self._guard.call():
            if not items:
                return []
            if self.outage.is_down():
                self._bump(misses=len(items))
                return [None] * len(items)
            if self._readers is None:
                return [self._read(key, out) for key, out in items]
            return self._read_overlapped(self._readers, items)

    def _read_overlapped(
        self, readers: ThreadPoolExecutor, items: Sequence[tuple[ChunkKey, torch.Tensor]]
    ) -> list[int | None]:
        timeout = self.store.timeout_s
        deadline = time.monotonic() + timeout
        futures = [readers.submit(self._read, key, out) for key, out in items]
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
            why = f"{len(busy)} {self.name} reads ran past {timeout:g}s"
            self.outage.failed("read", TierUnavailable(why))
            raise ReadAbandoned(why, busy, results)
        return results

    def _read(self, key: ChunkKey, out: torch.Tensor) -> int | None:
        try:
            tokens = self.store.get_into(key, out)
        except UnknownRecordFormat as exc:
            # Kept: another engine of the fleet may read it, and a store of ours replaces it.
            self._repeated.warning(
                "format",
                "%s record %s is in a format this kvtier does not read (%s): a miss, kept",
                self.name,
                self.store.name_of(key),
                exc,
            )
            self._bump(misses=1)
            return None
        except CorruptRecord as exc:
            name = self.store.name_of(key)
            self.store.log.warning("%s record %s is corrupt, deleting it: %s", self.name, name, exc)
            self.note_corrupt(key, str(exc))
            self._bump(corrupt=1, misses=1)
            self._delete_quietly(key, "corrupt")
            self.report_removed((key,))  # unreadable, deleted or not
            return None
        except TierError as exc:
            self.outage.failed("read", exc)
            self._bump(misses=1)
            return None
        if tokens is None:
            self._bump(misses=1)
            if self.store.forget(key):
                self.report_removed((key,))  # deleted behind our back (another engine)
            return None
        self._bump(hits=1, bytes_read=self.layout.payload_bytes(tokens))
        return tokens

    # -- writes ----------------------------------------------------------------------------
    def put(self, job: PutJob) -> None:
        """Raises StateError when closed; a put racing close is either queued before close
        drains the queue or refused here: its on_done always runs once."""
        key = job.key
        nbytes = records.header_size() + job.payload.numel()
        with self._guard.call():
            if self.store.indexed and (self.store.exists_many((key,))[0] or self.writes.holds(key)):
                job.done(PutOutcome.EXISTS)  # counted by the write that stored it
                return
            if self.outage.is_down():
                reason = f"the {self.name} store is not answering"
            else:
                write = TenantWrite(
                    key, job.payload, job.num_tokens, nbytes, job.on_done, job.tenant
                )
                reason = self.writes.submit(write)
        if reason:
            self._bump(dropped=1)
            complete(job.on_done, PutResult(key, PutOutcome.DROPPED, reason))

    def _write(self, job: Write) -> PutResult:
        ledger, tenant = self.ledger, job.tenant if isinstance(job, TenantWrite) else NO_SALT
        if (
            self.outage.is_down()
        ):  # queued before the store went away: dropped now, not sent to wait
            self._bump(dropped=1)
            return PutResult(job.key, PutOutcome.DROPPED, f"the {self.name} store is not answering")
        try:
            refused = ledger.refusal(tenant) if ledger is not None else None
            if refused:  # a limit under one chunk: not worth sending
                self._repeated.warning(("quota", tenant), "%s tier: %s", self.name, refused)
                self._bump(dropped=1)
                return PutResult(job.key, PutOutcome.DROPPED, refused)
            # Flat bytes, never a 2-D view; for identity, a view of the page itself.
            header, stored = records.encode_parts(
                job.key, self.fingerprint, job.num_tokens, job.payload, self.codec
            )
            self.store.put(job.key, (header, stored), self.report_added)
        except (TierError, ValueError, TypeError) as exc:
            self.outage.failed("write", exc)
            self._bump(failed=1)
            return PutResult(job.key, PutOutcome.FAILED, str(exc))
        try:
            victims = ledger.charge(job.key, tenant) if ledger is not None else []
        except TierError as exc:  # not counted: deleted again, so no chunk goes uncounted
            self._delete_quietly(job.key, "uncounted")
            self.report_removed((job.key,))
            self.outage.failed("write", exc)
            self._bump(failed=1)
            return PutResult(job.key, PutOutcome.FAILED, str(exc))
        self._bump(stored=1, bytes_written=stored.nbytes)
        self._evicted(victims)
        return PutResult(job.key, PutOutcome.STORED)

    def flush(self, timeout: float | None = None) -> bool:
        return self.writes.flush(timeout)

    # -- tenant_quotas (kvtier.storage.remote.ledger) -----------------------------------------
    def attach_quotas(self, quotas: TenantQuotas) -> None:
        """Charge each store to its tenant from now on; before :meth:`open` only."""
        if self._guard.state is not Lifecycle.NEW:
            raise StateError(f"{self.name} tier quotas are attached before it opens")
        if self._ledger_factory is None:
            return
        unit = records.header_size() + self.layout.payload_bytes(self.fingerprint.chunk_size)
        self.ledger = self._ledger_factory(quotas, unit, lambda: self._usage().capacity_bytes)
        self.tenants = self.ledger  # the tier's one tenant attribute (rows, explain)

    def _quotas_changed(self) -> None:
        """A row changed (``PUT /quota``): tenants now over their limit drop chunks now."""
        if self.ledger is not None and not self.outage.is_down():
            self._evicted(self.ledger.enforce_all())

    def _evicted(self, keys: Sequence[ChunkKey]) -> None:
        if keys:
            self._bump(evicted=len(keys))
            self.report_evicted(keys)

    # -- pins (kvtier.storage.remote.pins) ------------------------------------------------
    def pin(self, key: ChunkKey) -> bool:
        return self.pins.pin(key)

    def pin_many(self, keys: Sequence[ChunkKey]) -> int:
        return self.pins.pin_many(keys)

    def unpin(self, key: ChunkKey) -> None:
        self.pins.unpin(key)

    def unpin_many(self, keys: Sequence[ChunkKey]) -> None:
        self.pins.unpin_many(keys)

    # -- management ------------------------------------------------------------------------
    def remove(self, key: ChunkKey) -> bool:
        with self._guard.call():
            removed = self.store.delete_many((key,))[0]
        if removed:
            self.report_removed((key,))
        return removed

    def clear(self) -> int:
        """Delete this fingerprint's chunks (read now: other engines' too, never other
        models' or other data) except those pinned through this tier. Raises
        :class:`TierUnavailable` when the store is away."""
        with self._guard.call():
            keep = self.pins.pinned()
            gone = [key for key in self.store.list_keys() if key not in keep]
            self.store.delete_many(gone)
            self.report_removed(gone)
            return len(gone)

    def usage(self) -> TierUsage:
        """The store's figures (see its ``usage``); when it is away, the last ones read."""
        with self._guard.call():
            return self._usage()

    def _usage(self) -> TierUsage:
        try:
            self._last_usage = self.store.usage()
        except TierError as exc:
            self.outage.failed("usage", exc)
        if self.ledger is not None:
            self.ledger.capacity_read(self._last_usage.capacity_bytes)
        self.store.note_counters()
        self.counters.available = int(not self.outage.is_down())
        return self._last_usage

    # -- helpers ---------------------------------------------------------------------------
    def _delete_quietly(self, key: ChunkKey, why: str) -> None:
        try:
            self.store.delete_many((key,))
        except TierError as exc:
            name = self.store.name_of(key)
            self.store.log.warning("%s: %s record %s not deleted: %s", self.name, why, name, exc)

    def _bump(self, **deltas: int) -> None:
        with self._lock:
            for field_name, delta in deltas.items():
                setattr(self.counters, field_name, getattr(self.counters, field_name) + delta)
