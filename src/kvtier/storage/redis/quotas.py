"""The Redis tier under ``tenant_quotas``: each store counted in its tenant's ledger in Redis.

What the tier does with it (:mod:`kvtier.storage.redis.tier`)::

    assign_tenant(key, t)   the manager names the next put's tenant          -> assign
    writer, before the SET  a limit under one chunk: the put is DROPPED      -> refusal
    writer, after the SET   ZADD + pop the oldest over the limit + DEL them  -> stored
                            (:mod:`kvtier.storage.redis.tenant_ledger`; if that fails, the
                            record just written is deleted again, so no chunk goes uncounted)
    PUT /quota              every tenant this engine stored for is brought
                            within its new limit at once                     -> enforce_all
    stats() / metrics       each known tenant's ledger size, one pipeline    -> report

A limit is the tenant's row of the engine's table, in whole chunks of the tier's full
record; a share is of the capacity the tier's ``usage()`` reports (``maxmemory`` summed over
the masters, or the host's memory without one), read at open and again at most every
:data:`CAPACITY_TTL_S` by the writers. Every tenant's stores are counted once quotas are on,
so a row added later bounds what the tenant stored before too. The salts the table does not
name share the ``"*"`` row's one ledger (``counted_as``): the row caps all of them together,
and a client sending a new salt with each request gets it once. A salt that gains a row of
its own (or a ``"*"`` row added later) counts from its next store: what it stored before
stays in the ledger it was counted in, until popped or expired.

What it is not: a guarantee. Redis' own maxmemory eviction knows no tenants, so a tenant
under its limit may still lose chunks to it; the ledger only caps. Its counts can err low
only (the ledger's docstring says why), so a tenant never holds more than its limit, but for
the chunks written and not yet counted (at most one per writer thread, for the moment between
its SET and its ledger update). Unlike the CPU and disk tiers, a chunk a request is using is
no exception: a shared store cannot pin (the tier's docstring), and a read that finds the
chunk gone is a miss the engine recomputes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import ResponseError

from kvtier.errors import TierError
from kvtier.keys import ChunkKey
from kvtier.storage.policy.quotas import TenantQuotas
from kvtier.storage.redis import tenant_ledger
from kvtier.storage.remote_quotas import RemoteQuotas

log = logging.getLogger(__name__)

CAPACITY_TTL_S = 10.0  # how stale the capacity a share is computed from may be


class RedisQuotas(RemoteQuotas):
    """A Redis tier's quotas; every Redis call goes through ``call`` (the tier's link)."""

    def __init__(
        self,
        quotas: TenantQuotas,
        unit_bytes: int,
        ledger_hex: str,
        fingerprint_hex: str,
        ttl_ms: int,
        call: Callable[[Callable[[Any], Any]], Any],
        read_capacity: Callable[[], int],
    ) -> None:
        super().__init__(quotas, unit_bytes)
        self.ledger_hex = ledger_hex  # the fingerprint but its TP rank: ranks share ledgers
        self.fingerprint_hex = fingerprint_hex.encode()  # this tier's own (a member's first part)
        self.ttl_ms = ttl_ms
        self._call = call
        self._read_capacity = read_capacity
        self._capacity_at = float("-inf")
        self._use_script = True  # until the server refuses EVAL

    def ledger(self, tenant: str) -> bytes:
        return tenant_ledger.ledger_name(self.ledger_hex, tenant)

    def capacity_read(self, capacity: int) -> None:
        """The tier read the store's capacity (at open, at ``usage()``)."""
        if capacity > 0:
            self.capacity_bytes = capacity
            self._capacity_at = time.monotonic()

    def refusal(self, tenant: str) -> str | None:
        """Why a put of ``tenant`` is not kept (a limit under one chunk), else None. Reads
        the capacity first when it is stale and the tenant's limit is a share."""
        limit = self.quotas.limit(tenant)
        if limit is None:
            return None
        if limit.share is not None and time.monotonic() - self._capacity_at > CAPACITY_TTL_S:
            self.capacity_read(self._read_capacity())
        return self.below_one_chunk(tenant)

    def stored(self, tenant: str, key: ChunkKey) -> list[ChunkKey]:
        """``key``'s record is in Redis: count it in ``tenant``'s ledger and delete the
        tenant's oldest chunks over its limit. Returns the keys deleted. Raises TierError
        when the ledger was not updated, after deleting the record again (best effort), so
        that no chunk goes uncounted."""
        member = self.fingerprint_hex + b":" + key.hex().encode()
        try:
            return self._update(self.counted_as(tenant), member)
        except TierError:
            name = tenant_ledger.CHUNK_PREFIX + member
            try:
                self._call(lambda client: client.delete(name))
            except TierError as exc:
                log.warning("redis tier: uncounted chunk %s not deleted: %s", key.hex(), exc)
            raise

    def enforce_all(self) -> list[ChunkKey]:
        """Every tenant this engine stored for, brought within its limit now (a row
        changed). Returns the keys deleted; a tenant whose update fails is logged."""
        evicted: list[ChunkKey] = []
        for tenant in self.tenants():
            if self.quotas.limit(tenant) is None:
                continue
            try:
                evicted += self._update(tenant, None)
            except Exception as exc:  # a listener of the quota table: never raise into it
                log.warning("redis tier: tenant %r's new quota not applied yet: %s", tenant, exc)
        return evicted

    def _update(self, tenant: str, member: bytes | None) -> list[ChunkKey]:
        ledger, limit = self.ledger(tenant), self.limit_chunks(tenant)

        def update(client: Any) -> tenant_ledger.LedgerUpdate:
            args = (client, ledger, member, limit, tenant_ledger.CHUNK_PREFIX, self.ttl_ms)
            if self._use_script:
                try:
                    return tenant_ledger.update(*args)
                except ResponseError as exc:
                    if not tenant_ledger.scripts_refused(exc):
                        raise
                    log.info("redis refuses scripts (%s): tenant ledgers by MULTI/EXEC", exc)
                    self._use_script = False
            return tenant_ledger.update_without_scripts(*args)

        result = self._call(update)
        # Another TP rank's chunks count as this engine's evictions, but only this tier's
        # own keys are reported (KV events, explain): the others are not this engine's keys.
        mine = [m for m in result.evicted if m.startswith(self.fingerprint_hex + b":")]
        evicted = [bytes.fromhex(m[len(self.fingerprint_hex) + 1 :].decode()) for m in mine]
        others = len(result.evicted) - len(mine)
        self.updated(tenant, result.chunks, evicted, result.stale, others=others)
        return evicted

    def report(self) -> dict[str, dict[str, int | None]]:
        """Per tenant this engine stored for, its ledger's size read now (fleet-wide; when
        the server does not answer, the last one read)."""
        tenants = self.tenants()
        ledgers = [self.ledger(t) for t in tenants]
        try:
            found: Sequence[int] = self._call(lambda c: tenant_ledger.counts(c, ledgers))
        except TierError as exc:
            log.debug("redis tier: tenant counts not read: %s", exc)
        else:
            for tenant, chunks in zip(tenants, found, strict=True):
                self.updated(tenant, chunks, ())
        return super().report()
