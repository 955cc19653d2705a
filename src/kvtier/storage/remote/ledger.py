"""The interface a remote store's tenant ledger implements under ``tenant_quotas``.

A shared store evicts on its own and knows no tenants, so a remote tier caps a tenant by
keeping a *ledger* of its chunks where the fleet can see it, and deleting the tenant's
oldest when it is over its limit. How that is kept is the store's, for real reasons (Redis:
a sorted set updated by a server-side script, :mod:`kvtier.storage.redis.quotas`; S3: an
empty marker object per chunk, :mod:`kvtier.storage.s3.quotas`); what the tier asks of it
is one protocol, and each call means one thing for every store::

    open                      opened()                   a store-specific check (S3: share rows
                                                         bind nothing; one warning)
    writer, before the write  refusal(tenant) -> why     a limit under one chunk: DROPPED, not
                                                         sent (a share's capacity read first
                                                         when stale)
    writer, after the write   charge(key, tenant)        count it; delete the tenant's oldest
                                -> victims               past its limit; return this tier's
                                                         keys deleted (the tier reports them
                                                         evicted). Raises TierError when the
                                                         chunk was not counted: the tier then
                                                         deletes it again, so none goes uncounted
    PUT /quota                enforce_all() -> victims   every tenant within its new limit now
    usage()                   capacity_read(bytes)       the figure a share is of
    stats(), metrics          rows()                     one TenantRow per ledger (``refresh``
                                                         first: Redis reads its counts now)

The tenant of each put, its limit in whole chunks and the rows are
:class:`~kvtier.storage.tenants.remote.RemoteQuotas`, which every ledger is; ``charge`` is
the one of :class:`~kvtier.storage.tenants.ledger.TenantLedger`, so the tier's one tenant
attribute (``Tier.tenants``) is this ledger.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable

from kvtier.keys import ChunkKey
from kvtier.storage.tenants.quotas import TenantQuotas
from kvtier.storage.tenants.remote import RemoteQuotas

CAPACITY_TTL_S = 10.0  # how stale the capacity a share is computed from may be

# What the tier hands a store's ledger factory: the engine's table, the bytes of one full
# chunk's record (the unit a limit is counted in) and a reader of the store's capacity.
LedgerFactory = Callable[[TenantQuotas, int, Callable[[], int]], "QuotaLedger"]


class QuotaLedger(RemoteQuotas, ABC):
    """A remote store's tenant ledger (module docstring). Thread-safe: writers charge, the
    engine's caller reports, the admin thread enforces."""

    def __init__(
        self, quotas: TenantQuotas, unit_bytes: int, read_capacity: Callable[[], int]
    ) -> None:
        super().__init__(quotas, unit_bytes)
        self._read_capacity = read_capacity
        self._capacity_at = float("-inf")

    def opened(self) -> None:
        """The tier opened (a store-specific check or warning); none by default."""
        return None

    def capacity_read(self, capacity: int) -> None:
        """The tier read the store's capacity (at open, at ``usage()``)."""
        if capacity > 0:
            self.capacity_bytes = capacity
            self._capacity_at = time.monotonic()

    def refusal(self, tenant: str) -> str | None:
        """Why a put of ``tenant`` is not kept (a limit under one chunk), else None. Reads
        the capacity first when the tenant's limit is a share and the figure is stale."""
        limit = self.quotas.limit(tenant)
        if limit is None:
            return None
        if limit.share is not None and time.monotonic() - self._capacity_at > CAPACITY_TTL_S:
            self.capacity_read(self._read_capacity())
        return self.below_one_chunk(tenant)

    @abstractmethod
    def charge(self, key: ChunkKey, tenant: str) -> list[ChunkKey]:
        """``key``'s record of ``tenant`` is in the store: count it, delete the tenant's
        oldest past its limit, return this tier's keys deleted. Raises TierError when the
        chunk was not counted (the tier deletes it again)."""

    @abstractmethod
    def enforce_all(self) -> list[ChunkKey]:
        """Every tenant within its limit now (a row changed); returns this tier's keys
        deleted. Never raises (a listener of the quota table): a failure is logged."""
