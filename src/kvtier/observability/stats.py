"""``Engine.stats()``: one plain snapshot of an engine that every report reads.

Keys: ``open_requests``, ``pinned_pages``, ``pinned_bytes``, ``pinned_by_request``
(request -> pages, bytes), ``allocator`` (page_bytes, pages_total/free/used), ``tiers`` (name
-> used_bytes, capacity_bytes, entries and the tier's counters; with ``tenant_quotas`` also
``tenants``: tenant -> a :class:`~kvtier.storage.tenants.rows.TenantRow` as a dict),
then the engine's counters (:class:`~kvtier.storage.counters.EngineCounters`) and
``miss_tokens``. The admin API, the Prometheus metrics (:mod:`.metrics`) and the demo report
read these names.
"""

from __future__ import annotations

from typing import Any

from kvtier.lease import LeaseTable
from kvtier.storage.counters import EngineCounters
from kvtier.storage.manager import StorageManager
from kvtier.storage.tenants.rows import rows_dict


def engine_stats(
    manager: StorageManager, leases: LeaseTable[Any], counters: EngineCounters
) -> dict[str, Any]:
    pool = manager.pool
    lease_infos = leases.snapshot()
    tiers: dict[str, Any] = {}
    for tier in manager.tiers:
        usage = tier.usage()  # first: a tier refreshes its gauges here
        tiers[tier.name] = {
            "used_bytes": usage.used_bytes,
            "capacity_bytes": usage.capacity_bytes,
            "entries": usage.entries,
            **tier.counters.as_dict(),
        }
        rows = tier.tenants.rows() if tier.tenants is not None else []  # tenant_quotas
        if rows:
            tiers[tier.name]["tenants"] = rows_dict(rows)
    counts = counters.as_dict()
    counts["miss_tokens"] = max(0, counts["lookup_tokens"] - counts["found_tokens"])
    return {
        "open_requests": len(lease_infos),
        "pinned_pages": sum(i.pinned_pages for i in lease_infos),
        "pinned_bytes": sum(i.pinned_bytes for i in lease_infos),
        "pinned_by_request": {
            i.request_id: {"pages": i.pinned_pages, "bytes": i.pinned_bytes} for i in lease_infos
        },
        "allocator": {
            "page_bytes": pool.page_bytes,
            "pages_total": pool.num_pages,
            "pages_free": pool.free_pages,
            "pages_used": pool.used_pages,
        },
        "tiers": tiers,
        # tier name -> its medium in KV events, for the tiers that are published (a vLLM
        # worker of a kvtier server learns the server's media from here)
        "tier_media": {t.name: t.medium for t in manager.tiers if t.medium is not None},
        **counts,
    }
