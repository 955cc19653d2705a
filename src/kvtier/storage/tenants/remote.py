"""A remote tier's side of ``tenant_quotas``: each put's tenant, its limit in chunks, and
what the tier reports per tenant.

The CPU and disk tiers bound a tenant through their eviction policy
(:class:`~kvtier.storage.tenants.local.TenantPolicy`): they hold every chunk and choose
every victim. A remote store (Redis, S3) is shared by a fleet and evicts on its own, so its
tier keeps a *ledger* of each tenant's chunks where the fleet can see it (Redis: a sorted set
beside the chunks, :mod:`kvtier.storage.redis.tenant_ledger`) and, after a store of a tenant
over its limit, deletes that tenant's oldest chunks. This module is what the ledger needs
from the engine, whatever the store:

* the put's tenant rides the put (``PutJob.tenant``) and its queued write to the store's
  ledger, which charges it when the write lands (``charge(key, tenant) -> victims``, the
  ledger protocol of :mod:`kvtier.storage.tenants.ledger`:
  :class:`~kvtier.storage.remote.ledger.QuotaLedger` adds it per store);
* the tenant's limit in whole chunks of ``unit_bytes`` (the record of a full chunk as the
  identity codec writes it, so a coded chunk is charged as a whole one, never less), read
  from the engine's one :class:`~kvtier.storage.tenants.quotas.TenantQuotas` at each store,
  so a ``PUT /quota`` reaches the remote tier at its next store (or at once: the tier
  subscribes); a share is of ``capacity_bytes``, the store's capacity as the tier reads it;
* the ledger a tenant is counted in (:meth:`RemoteQuotas.counted_as`): its own when it has
  a row or no row applies, else ``"*"``'s, ONE ledger for every salt the table does not name
  (vLLM takes ``cache_salt`` from each request: a ledger per unnamed salt, each capped at the
  ``"*"`` row, let one client spraying salts store the row as many times over as it had
  salts). The report has a row per ledger, so those salts show as one row, ``"*"``;
* per ledger: chunks it held at its last update (the fleet's, not this engine's),
  this engine's quota evictions, and members found stale (their chunk was gone already).
  ``hits`` is None: a read does not know its tenant (the key's salt is hashed into it).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.config.tenant_quotas import DEFAULT_TENANT
from kvtier.keys import ChunkKey
from kvtier.storage.tenants.ledger import TENANTS_KEPT, QuotaEvictions
from kvtier.storage.tenants.quotas import TenantQuotas
from kvtier.storage.tenants.rows import TenantRow


@dataclass(slots=True)
class RemoteTenantUsage:
    chunks: int = 0  # the ledger's members at its last update seen here (fleet-wide)
    quota_evictions: int = 0  # chunks this engine deleted because the tenant was over
    stale: int = 0  # ledger members whose chunk the store had dropped already


class RemoteQuotas:
    """Thread-safe (writer threads and the engine's caller both use it)."""

    def __init__(self, quotas: TenantQuotas, unit_bytes: int) -> None:
        self.quotas = quotas
        self.unit_bytes = unit_bytes
        self.capacity_bytes = 0  # 0: not read yet (a share cannot be computed)
        self._usage: dict[str, RemoteTenantUsage] = {}
        self._quota_evicted = QuotaEvictions()
        self._lock = threading.Lock()

    def release(self, key: ChunkKey) -> None:
        """Nothing here: the store's ledger holds the members (a stale one is found and
        counted at its next update)."""
        return None

    # -- limits -----------------------------------------------------------------------------
    def counted_as(self, tenant: str) -> str:
        """The ledger ``tenant``'s chunks are counted and capped in: ``"*"`` for a salt the
        table does not name while a ``"*"`` row binds here (all such salts together), else its
        own (a share row binds no S3 tier: its salts stay counted each on its own)."""
        pooled = self.quotas.row_of(tenant) == DEFAULT_TENANT
        return DEFAULT_TENANT if pooled and self.limit_bytes(tenant) is not None else tenant

    def limit_bytes(self, tenant: str) -> int | None:
        """``tenant``'s limit in this tier; None: no limit. A share of a capacity not read
        yet is 0 (the caller reads the capacity before it stores)."""
        limit = self.quotas.limit(tenant)
        return None if limit is None else limit.bytes_of(self.capacity_bytes)

    def limit_chunks(self, tenant: str) -> int | None:
        """The limit in whole chunks (rounded down: a tenant never holds more than it)."""
        limit = self.limit_bytes(tenant)
        return None if limit is None else limit // self.unit_bytes

    def below_one_chunk(self, tenant: str) -> str | None:
        """Why a put of ``tenant`` cannot be kept (its limit is under one chunk), or None."""
        limit = self.limit_bytes(tenant)
        if limit is None or limit >= self.unit_bytes:
            return None
        return (
            f"the quota of tenant {tenant!r} ({self.quotas.limit(tenant)}: {limit} bytes here) "
            f"is below one chunk ({self.unit_bytes} bytes); raise it to at least that"
        )

    # -- what the ledger said ---------------------------------------------------------------
    def updated(
        self,
        tenant: str,
        chunks: int,
        evicted: Sequence[ChunkKey],
        stale: int = 0,
        others: int = 0,
    ) -> None:
        """The tenant's ledger holds ``chunks`` now; this engine deleted ``evicted`` (its
        oldest, over the limit) and ``others`` chunks not under this tier's keys (another
        TP rank's), and found ``stale`` members whose chunk was gone already."""
        with self._lock:
            usage = self._usage.get(tenant)
            if usage is None:
                if len(self._usage) >= TENANTS_KEPT:
                    self._forget_one_empty()
                usage = self._usage[tenant] = RemoteTenantUsage()
            usage.chunks = chunks
            usage.quota_evictions += len(evicted) + others
            usage.stale += stale
            for key in evicted:
                self._quota_evicted.record(key, tenant)

    def _forget_one_empty(self) -> None:
        for tenant, usage in self._usage.items():
            if usage.chunks == 0:
                del self._usage[tenant]
                return

    def tenants(self) -> list[str]:
        """The tenants this engine has stored for (and still remembers)."""
        with self._lock:
            return list(self._usage)

    def evicted_by_quota(self, keys: Sequence[ChunkKey]) -> dict[ChunkKey, str]:
        with self._lock:
            return self._quota_evicted.among(keys)

    def refresh(self) -> None:
        """Re-read what the fleet's ledgers hold, before a report; a store whose counts this
        engine cannot see change overrides it (none by default)."""
        return None

    def rows(self) -> list[TenantRow]:
        """Per ledger: what it held at its last update (fleet-wide), this engine's quota
        evictions (its only evictions: the store's own are not seen), and stale members.
        ``hits`` is None: a read does not know its tenant."""
        self.refresh()
        with self._lock:
            usages = list(self._usage.items())
        return [
            TenantRow(
                tenant,
                held_bytes=usage.chunks * self.unit_bytes,
                limit_bytes=self.limit_bytes(tenant),
                chunks=usage.chunks,
                hits=None,
                evictions=usage.quota_evictions,
                quota_evictions=usage.quota_evictions,
                stale_entries=usage.stale,
            )
            for tenant, usage in usages
        ]
