"""``kvtier bench redis --quota``: what ``tenant_quotas`` cost a Redis tier's put.

Three tiers on the same server (or cluster: ``--url redis-cluster://...``) put the same
small records (``--chunk-size`` tokens of a 2-layer layout: the ledger's cost, not the
network's, is what shows) through the tier's own write path, taking turns in every round:

* ``quota_off_put_us``: no quotas (no ledger);
* ``quota_ledger_put_us``: quotas on, the tenant under its limit (one script per put: the
  chunk added to its tenant's ledger);
* ``quota_evict_put_us``: quotas on, the tenant at its limit, so every put also pops and
  deletes the tenant's oldest chunk (on a cluster, a second round trip: the unlink).

Each figure is writer time per put (``--put-threads`` writers, best of ``--repeats``); a
store does not wait for it, the writers do. The run checks what it measures: after the last
round the evicting tenant holds exactly its limit.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kvtier.bench.checks import require
from kvtier.bench.tier_puts import put_all
from kvtier.bench.timing import best_interleaved
from kvtier.config.remote_url import parse_remote_url
from kvtier.config.tenant_quotas import TenantLimit
from kvtier.fingerprint import Fingerprint
from kvtier.layout import KVLayout
from kvtier.storage import records
from kvtier.storage.redis.options import RedisOptions
from kvtier.storage.redis.tenant_ledger import ledger_name
from kvtier.storage.redis.tier import RedisTier
from kvtier.storage.tenants.quotas import TenantQuotas

SMALL_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
PUTS = 1000  # per round and tier
LIMIT_CHUNKS = 100  # the evicting tenant's limit


def quota_costs(url: str, chunk_size: int, repeats: int, put_threads: int) -> dict[str, Any]:
    fingerprint = Fingerprint("bench-redis-quota", SMALL_LAYOUT, chunk_size)
    unit = records.header_size() + SMALL_LAYOUT.payload_bytes(chunk_size)
    rows = {"under": TenantLimit(share=1.0), "over": TenantLimit(nbytes=LIMIT_CHUNKS * unit)}
    options = RedisOptions(timeout_s=30.0, put_threads=put_threads)
    tiers: dict[str, RedisTier] = {}
    for name in ("off", "ledger", "evict"):
        tier = RedisTier(parse_remote_url(url), SMALL_LAYOUT, fingerprint, options)
        if name != "off":
            tier.attach_quotas(TenantQuotas(rows))
        tier.open()
        tiers[name] = tier
    pages = torch.randint(0, 256, (PUTS, SMALL_LAYOUT.payload_bytes(chunk_size)), dtype=torch.uint8)
    try:
        require(tiers["off"].store.link.wait_up(10.0), f"redis at {url} did not answer")

        def puts(name: str, tenant: str) -> None:
            tier = tiers[name]
            keys = [os.urandom(16) for _ in range(PUTS)]
            put_all(tier, keys, pages, chunk_size, tenant)

        best = best_interleaved(
            {
                "off": lambda: puts("off", "under"),
                "ledger": lambda: puts("ledger", "under"),
                "evict": lambda: puts("evict", "over"),
            },
            repeats,
        )
        ledger = tiers["evict"].ledger
        held = next((r.chunks for r in ledger.rows() if r.tenant == "over"), 0) if ledger else 0
        require(held == LIMIT_CHUNKS, f"the evicting tenant holds {held}, not {LIMIT_CHUNKS}")
        for tier in tiers.values():
            tier.clear()
        ledgers = [ledger_name(tiers["evict"].fingerprint.hex(), t) for t in rows]
        tiers["evict"].store.link.call(lambda client: [client.delete(n) for n in ledgers])
    finally:
        for tier in tiers.values():
            tier.close()
    per_put = {name: seconds / PUTS * 1e6 for name, seconds in best.items()}
    return {
        "quota_record_bytes": unit,
        "quota_puts": PUTS,
        "put_threads": put_threads,
        "quota_off_put_us": round(per_put["off"], 1),
        "quota_ledger_put_us": round(per_put["ledger"], 1),
        "quota_evict_put_us": round(per_put["evict"], 1),
    }
