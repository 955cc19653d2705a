"""The Redis tier's tenant ledger under ``tenant_quotas``: each store counted in its
tenant's ledger in Redis (the protocol: :mod:`kvtier.storage.remote.ledger`).

What each call of the protocol is here::

    refusal        a limit under one chunk: the put is DROPPED (a share's capacity,
                   ``maxmemory``, read again when stale)
    charge         ZADD + pop the oldest over the limit + DEL them, in one script
                   (:mod:`kvtier.storage.redis.tenant_ledger`); if that fails, the tier
                   deletes the record just written, so no chunk goes uncounted
    enforce_all    every tenant this engine stored for, brought within its new limit
    refresh        each known tenant's ledger size, read in one pipeline (before rows)

A limit is the tenant's row of the engine's table, in whole chunks of the tier's full
record; a share is of the capacity the tier's ``usage()`` reports (``maxmemory`` summed over
the masters, or the host's memory without one), read at open and again at most every
:data:`~kvtier.storage.remote.ledger.CAPACITY_TTL_S` by the writers. Every tenant's stores
are counted once quotas are on, so a row added later bounds what the tenant stored before
too. The salts the table does not
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
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import ResponseError

from kvtier.errors import TierError
from kvtier.keys import ChunkKey
from kvtier.storage.redis import tenant_ledger
from kvtier.storage.remote.ledger import QuotaLedger
from kvtier.storage.tenants.quotas import TenantQuotas

log = logging.getLogger(__name__)


class RedisLedger(QuotaLedger):
    """A Redis tier's tenant ledger; every Redis call goes through ``call`` (the link)."""

    def __init__(
        self,
        quotas: TenantQuotas,
        unit_bytes: int,
        read_capacity: Callable[[], int],
        *,
        ledger_hex: str,
        fingerprint_hex: str,
        ttl_ms: int,
        call: Callable[[Callable[[Any], Any]], Any],
    ) -> None:
        super().__init__(quotas, unit_bytes, read_capacity)
        self.ledger_hex = ledger_hex  # the fingerprint but its TP rank: ranks share ledgers
        self.fingerprint_hex = fingerprint_hex.encode()  # this tier's own (a member's first part)
        self.ttl_ms = ttl_ms
        self._call = call
        self._use_script = True  # until the server refuses EVAL

    def ledger(self, tenant: str) -> bytes:
        return tenant_ledger.ledger_name(self.ledger_hex, tenant)

    def charge(self, key: ChunkKey, tenant: str) -> list[ChunkKey]:
        """``key``'s record is in Redis: count it in ``tenant``'s ledger and delete the
        tenant's oldest chunks over its limit. Returns the keys deleted; raises TierError
        when the ledger was not updated."""
        member = self.fingerprint_hex + b":" + key.hex().encode()
        return self._update(self.counted_as(tenant), member)

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

    def refresh(self) -> None:
        """Before the rows: each tenant this engine stored for, its ledger's size read now
        (fleet-wide; when the server does not answer, the last one read)."""
        tenants = self.tenants()
        ledgers = [self.ledger(t) for t in tenants]
        try:
            found: Sequence[int] = self._call(lambda c: tenant_ledger.counts(c, ledgers))
        except TierError as exc:
            log.debug("redis tier: tenant counts not read: %s", exc)
        else:
            for tenant, chunks in zip(tenants, found, strict=True):
                self.updated(tenant, chunks, ())
