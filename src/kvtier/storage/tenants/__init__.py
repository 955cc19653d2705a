"""The one owner of "tenant": the salt of one request (its ``cache_salt``; "" for none).

What every tier that takes tenants shares lives here, so a new tier (or a new cross-cutting
feature: hits per tenant, a TTL) is written once::

    quotas.py   TenantQuotas   the quota table, one per engine (``Engine.quotas``): PUT /quota
                               and LMCache's alias edit it, every ledger reads it
    ledger.py   TenantLedger   the protocol each tier's ledger answers (charge -> victims,
                               release, evicted by quota, rows); the constants, once
    rows.py     TenantRow      the only tenant report (stats, metrics, explain)
    local.py    TenantPolicy   the ledger of a tier that holds every chunk (CPU, disk): a
                               composite over the eviction policy, one order per row
    groups.py   GroupSums      what each row holds, the "*" row once (the guarantees' scale)
    reuse.py    ReuseWatches   whether a row's chunks come back (its guarantee lapses if not)
    remote.py   RemoteQuotas   the common part of a remote store's ledger (Redis, S3)

The PD receive buffer's shares (:mod:`kvtier.pd.tenant_shares`) answer the same report from
the layer above; they hold a reservation back rather than evict, so they never charge here.
A tier reaches its ledger through one attribute, ``Tier.tenants`` (None: no quotas).
"""

from kvtier.storage.tenants.ledger import (
    NO_SALT,
    QUOTA_EVICTIONS_KEPT,
    TENANTS_KEPT,
    QuotaEvictions,
    TenantLedger,
    TenantReport,
)
from kvtier.storage.tenants.local import TenantPolicy
from kvtier.storage.tenants.quotas import TenantQuotas
from kvtier.storage.tenants.rows import TenantRow, rows_dict

__all__ = [
    "NO_SALT",
    "QUOTA_EVICTIONS_KEPT",
    "TENANTS_KEPT",
    "QuotaEvictions",
    "TenantLedger",
    "TenantPolicy",
    "TenantQuotas",
    "TenantReport",
    "TenantRow",
    "rows_dict",
]
