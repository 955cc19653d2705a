"""The remote tier: chunks in Redis or Redis Cluster (or Valkey), shared by a fleet of engines.

Names and values::

    key    kvtier:<fingerprint hex>:<chunk key hex>     e.g. kvtier:3f2a...:9c01...
    value  one record of kvtier.storage.records: 4 KiB checksummed header, then the payload
           as the tier's codec stores it (``codec``, identity by default)

The fingerprint in every name keeps models, layouts and tenants apart and lets :meth:`clear`
delete exactly this engine's namespace (``SCAN MATCH kvtier:<fp>:*``). Names carry no
``{hash tag}``, so a cluster spreads chunks over all its masters.

Protocol (see :mod:`kvtier.storage.base`), and how each call behaves here (the Redis commands
behind each, for one server or a cluster, are in :mod:`kvtier.storage.redis.commands`):

* ``contains(keys)``: one round trip: a script running ``EXISTS`` per key on one server, a
  pipeline of ``EXISTS`` on a cluster (one round per master).
* ``get_into``: ``GET`` read straight into the page (:mod:`kvtier.storage.redis.wire`),
  header and stored checksum verified; a corrupt record is a miss, deleted and counted. A
  record of another codec than identity lands in a scratch buffer and is decoded into the
  page; one of another format version or an unknown codec is a miss, kept, logged once per
  30 s (:mod:`kvtier.storage.records`).
* ``put``: queued to ``remote_put_threads`` writer threads (started in :meth:`open`); at
  most ``remote_inflight_bytes`` queued or being sent, beyond that a put completes DROPPED
  at once. ``on_done`` runs exactly once per put, from a writer thread or the caller's.
  Optional expiry: ``extra_config.remote_ttl_secs`` (``SET ... PX``).
* ``pin`` / ``unpin``: a shared store cannot pin, since other engines and Redis' own
  eviction or TTL may delete an entry at any time. ``pin`` returns True (the chunk may be
  used) and only keeps *this* tier's :meth:`clear` from deleting it; a later ``get_into`` may
  still miss, which the manager tolerates by ending the hit there.
* ``tenant_quotas`` (:mod:`kvtier.storage.redis.quotas`): each stored chunk is counted in
  its tenant's ledger in Redis, and a tenant over its limit loses its own oldest chunks,
  fleet-wide: a cap (Redis' own eviction knows no tenants), never a guarantee.
* Faults (:mod:`kvtier.storage.redis.link`): a server that is down at :meth:`open` leaves
  the tier disabled with one warning while a background thread reconnects with backoff;
  while disabled, ``contains`` answers all False, ``get_into`` misses and ``put`` completes
  DROPPED, all at once. A server that dies or stalls mid-run costs at most
  ``blocking_timeout_secs`` per call, then the same. ``remove``, ``clear`` raise
  :class:`TierUnavailable`; ``usage`` reports the last figures it read.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from redis.cluster import RedisCluster
from redis.exceptions import ResponseError

from kvtier.config import Config
from kvtier.config.remote_url import RemoteTarget, parse_remote_url
from kvtier.errors import CorruptRecord, StateError, TierError, TierUnavailable, UnknownRecordFormat
from kvtier.fingerprint import Fingerprint
from kvtier.keys import ChunkKey
from kvtier.layout import KVLayout
from kvtier.lifecycle import CallGuard, Lifecycle
from kvtier.repeated_log import RepeatedLog
from kvtier.storage import records
from kvtier.storage.base import OnDone, PutOutcome, PutResult, Tier, TierCounters, TierUsage
from kvtier.storage.codecs import IDENTITY, PayloadCodec, codec_from_config, tier_fingerprint
from kvtier.storage.policy.quotas import TenantQuotas
from kvtier.storage.redis.commands import (
    exists_by_script,
    exists_pipelined,
    read_record,
    send_record,
    server_usage,
    unlink_matching,
)
from kvtier.storage.redis.link import RedisLink
from kvtier.storage.redis.options import RedisOptions
from kvtier.storage.redis.quotas import RedisQuotas
from kvtier.storage.remote_pins import RemotePins
from kvtier.storage.remote_quotas import RemoteQuotaHooks
from kvtier.storage.write_queue import Write, WriteQueue, complete

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class RedisCounters(TierCounters):
    """The Redis tier's own counts, beside every tier's (copied from the link at usage())."""

    outages: int = 0  # the server became unreachable
    reconnects: int = 0  # ... and came back
    busy_timeouts: int = 0  # every connection was busy past the timeout
    available: int = 1  # gauge: 0 while the server is down


class RedisTier(RemotePins, RemoteQuotaHooks, Tier):
    """See the module docstring."""

    name = "redis"
    medium = "REMOTE"  # shared by the fleet: events carry the shared-pool ownership
    counters: RedisCounters

    def __init__(
        self,
        target: RemoteTarget,
        layout: KVLayout,
        fingerprint: Fingerprint,
        options: RedisOptions,
        codec: PayloadCodec = IDENTITY,
    ) -> None:
        super().__init__()
        self.counters = RedisCounters()
        self.target = target
        self.layout = layout
        # A lossy codec makes another cache: its own namespace and record headers.
        self.fingerprint = tier_fingerprint(fingerprint, codec)
        self.options = options
        self.codec = codec  # what writes encode with; reads decode any registered codec
        self.prefix = f"kvtier:{self.fingerprint.hex()}:".encode()
        self.link = RedisLink(
            target,
            options.timeout_s,
            # Writers and engine calls share the gate, so each writer has its connection and
            # the engine still has ``connections`` for lookups and reads.
            max_connections=options.put_threads + options.connections,
            name=self.name,
            tls_ca_file=options.tls_ca_file,
        )
        self.writes = WriteQueue(
            options.put_threads, options.inflight_bytes, self._write, "kvtier-redis-writer"
        )
        self._guard = CallGuard("redis tier")
        self._lock = threading.Lock()
        # A full disk / Redis at maxmemory fails every chunk: one line per 30 s, with a count.
        self._repeated = RepeatedLog(log)
        self._last_usage = TierUsage(0, 0, 0)
        self._use_script = True  # until the server refuses EVAL
        self._set_options: tuple[bytes, ...] = (
            (b"PX", str(int(options.ttl_s * 1000)).encode()) if options.ttl_s else ()
        )
        self._quotas: RedisQuotas | None = None  # tenant_quotas (attach_quotas)

    @classmethod
    def from_config(cls, config: Config, layout: KVLayout, fingerprint: Fingerprint) -> RedisTier:
        target = parse_remote_url(config.remote_url)
        codec = codec_from_config("remote_codec", config.remote_codec, layout.dtype)
        return cls(target, layout, fingerprint, RedisOptions.from_config(config), codec)

    def redis_name(self, key: ChunkKey) -> bytes:
        """The Redis key under which chunk ``key`` is stored."""
        return self.prefix + key.hex().encode()

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> None:
        if self._guard.state is not Lifecycle.NEW:
            raise StateError(f"redis tier is {self._guard.state.value}; open it once")
        self.link.open()
        if self._quotas is not None:
            self._quotas.capacity_read(self._usage().capacity_bytes if self.link.is_up else 0)
            self._quotas.quotas.subscribe(self._quotas_changed)
        self.writes.open()
        self._guard.open()

    def close(self) -> None:
        """Refuse new calls, wait for running ones (each bounded by the timeout), drain
        queued writes (each bounded too), stop the threads, disconnect. Idempotent."""
        was_open = self._guard.state is Lifecycle.OPEN
        if not self._guard.close(self.options.timeout_s + 1.0):
            log.warning("redis tier closing with calls still running past the timeout")
        if was_open:
            if self._quotas is not None:
                self._quotas.quotas.unsubscribe(self._quotas_changed)
            self.writes.close()
            self.link.close()

    # -- reads -----------------------------------------------------------------------------
    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._guard.call():
            return self._contains(keys)

    def _contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        names = [self.redis_name(k) for k in keys]

        def exists(client: Any) -> list[Any]:
            if self._use_script and not isinstance(client, RedisCluster):
                try:
                    return exists_by_script(client, names)
                except ResponseError as exc:
                    # Scripting disabled or restricted (some managed services): pipeline.
                    log.info("redis EVAL refused (%s); using pipelined EXISTS", exc)
                    self._use_script = False
            return exists_pipelined(client, names)

        try:
            return [bool(n) for n in self._call(exists)]
        except TierError as exc:
            self._note_failure("lookup", exc)
            return [False] * len(keys)

    def get_into(self, key: ChunkKey, out: torch.Tensor) -> int | None:
        with self._guard.call():
            return self._get_into(key, out)

    def _get_into(self, key: ChunkKey, out: torch.Tensor) -> int | None:
        name = self.redis_name(key)
        try:
            tokens = self._call(
                lambda client: read_record(client, name, key, self.fingerprint, out)
            )
        except UnknownRecordFormat as exc:
            # Kept: another engine of the fleet may read it, and a store of ours replaces it.
            self._repeated.warning(
                "format",
                "redis record %s is in a format this kvtier does not read (%s): a miss, kept",
                key.hex(),
                exc,
            )
            self._bump(misses=1)
            return None
        except CorruptRecord as exc:
            log.warning("redis record %s is corrupt, deleting it: %s", key.hex(), exc)
            self.note_corrupt(key, str(exc))
            self._bump(corrupt=1, misses=1)
            self._delete_quietly(key)
            self.report_removed((key,))  # unreadable, deleted or not
            return None
        except TierError as exc:
            self._note_failure("read", exc)
            self._bump(misses=1)
            return None
        if tokens is None:
            self._bump(misses=1)
        else:
            self._bump(hits=1, bytes_read=self.layout.payload_bytes(tokens))
        return tokens

    # -- writes ----------------------------------------------------------------------------
    def put(self, key: ChunkKey, payload: torch.Tensor, num_tokens: int, on_done: OnDone) -> None:
        """Raises StateError when closed (as before); a put racing close is either queued
        before close drains the queue or refused here: its on_done always runs once."""
        nbytes = records.header_size() + payload.numel()
        write = Write(key, payload, num_tokens, nbytes, on_done)
        with self._guard.call():
            reason = "remote tier is down" if not self.link.is_up else self.writes.submit(write)
        if reason:
            if self._quotas is not None:
                self._quotas.take(key)  # never written: its tenant is not needed
            self._bump(dropped=1)
            complete(on_done, PutResult(key, PutOutcome.DROPPED, reason))

    def _write(self, job: Write) -> PutResult:
        quotas = self._quotas
        tenant = quotas.take(job.key) if quotas is not None else ""
        try:
            refused = quotas.refusal(tenant) if quotas is not None else None
            if refused:  # a limit under one chunk: not worth sending
                self._repeated.warning(("quota", tenant), "redis tier: %s", refused)
                self._bump(dropped=1)
                return PutResult(job.key, PutOutcome.DROPPED, refused)
            # Flat bytes, never a 2-D view; for identity, a view of the page itself.
            header, stored = records.encode_parts(
                job.key, self.fingerprint, job.num_tokens, job.payload, self.codec
            )
            name = self.redis_name(job.key)
            parts: list[bytes | memoryview] = [header, stored]
            self._call(lambda client: send_record(client, name, parts, self._set_options))
            # Counted in its tenant's ledger; if that fails, the record is deleted again.
            evicted = quotas.stored(tenant, job.key) if quotas is not None else []
        except (TierError, ValueError, TypeError) as exc:
            self._note_failure("write", exc)
            self._bump(failed=1)
            return PutResult(job.key, PutOutcome.FAILED, str(exc))
        self._bump(stored=1, bytes_written=stored.nbytes)
        self.report_added((job.key,))  # the server has it now, not when it was queued
        self._evicted(evicted)
        return PutResult(job.key, PutOutcome.STORED)

    # -- tenant_quotas (kvtier.storage.redis.quotas) ----------------------------------------
    def attach_quotas(self, quotas: TenantQuotas) -> None:
        """Count each store in its tenant's ledger from now on; before :meth:`open` only."""
        if self._guard.state is not Lifecycle.NEW:
            raise StateError("redis tier quotas are attached before it opens")
        unit = records.header_size() + self.layout.payload_bytes(self.fingerprint.chunk_size)
        ttl_ms = int(self.options.ttl_s * 1000) if self.options.ttl_s else 0
        capacity = lambda: self._usage().capacity_bytes  # noqa: E731 (read when stale)
        ledger_hex = dataclasses.replace(self.fingerprint, tp_rank=0).hex()  # ranks share
        self._quotas = RedisQuotas(
            quotas, unit, ledger_hex, self.fingerprint.hex(), ttl_ms, self._call, capacity
        )

    def _quotas_changed(self) -> None:
        """A row changed (``PUT /quota``): tenants now over their limit drop chunks now."""
        if self._quotas is not None and self.link.is_up:
            self._evicted(self._quotas.enforce_all())

    def _evicted(self, keys: Sequence[ChunkKey]) -> None:
        if keys:
            self._bump(evicted=len(keys))
            self.report_evicted(keys)

    def flush(self, timeout: float | None = None) -> bool:
        return self.writes.flush(timeout)

    # -- management ------------------------------------------------------------------------
    def remove(self, key: ChunkKey) -> bool:
        with self._guard.call():
            removed = bool(self._call(lambda client: client.delete(self.redis_name(key))))
        if removed:
            self.report_removed((key,))
        return removed

    def clear(self) -> int:
        """Delete this fingerprint's chunks (not other models' or other data) except those
        pinned through this tier. Raises :class:`TierUnavailable` when the server is down."""
        with self._guard.call():
            return self._clear()

    def _clear(self) -> int:
        keep = {self.redis_name(k) for k in self.pinned()}
        pattern = self.prefix + b"*"
        removed = self._call(lambda client: unlink_matching(client, pattern, keep))
        self.report_removed([self._chunk_key(name) for name in removed])
        return len(removed)

    def _chunk_key(self, name: bytes) -> ChunkKey:
        """The chunk key of a Redis name of this tier (the inverse of :meth:`redis_name`)."""
        return bytes.fromhex(name[len(self.prefix) :].decode())

    def usage(self) -> TierUsage:
        """Server-wide figures summed over the masters: ``used_memory``, ``maxmemory`` (or
        the host's memory when unlimited) and ``DBSIZE``. They include other models' chunks
        and any other data on the server. When the server is down: the last figures read."""
        with self._guard.call():
            return self._usage()

    def _usage(self) -> TierUsage:
        try:
            self._last_usage = self._call(server_usage)
        except TierError as exc:
            self._note_failure("usage", exc)
        if self._quotas is not None:
            self._quotas.capacity_read(self._last_usage.capacity_bytes)
        self.counters.outages = self.link.outages
        self.counters.reconnects = self.link.reconnects
        self.counters.busy_timeouts = self.link.busy_timeouts
        self.counters.available = int(self.link.is_up)
        return self._last_usage

    # -- helpers ---------------------------------------------------------------------------
    def _call(self, fn: Callable[[Any], T]) -> T:
        return self.link.call(fn)

    def _delete_quietly(self, key: ChunkKey) -> None:
        try:
            self._call(lambda client: client.delete(self.redis_name(key)))
        except TierError as exc:
            log.warning("could not delete corrupt redis record %s: %s", key.hex(), exc)

    def _note_failure(self, what: str, exc: BaseException) -> None:
        # An outage is logged once by the link; other errors (a refused command) each time.
        if not isinstance(exc, TierUnavailable):
            self._repeated.warning((what, type(exc).__name__), "redis %s failed: %s", what, exc)

    def _bump(self, **deltas: int) -> None:
        with self._lock:
            for field_name, delta in deltas.items():
                setattr(self.counters, field_name, getattr(self.counters, field_name) + delta)
