"""Builds the cache tiers below CPU from config, in search order: disk, then remote.

The decoder's PD receive buffer is not built here: storage knows nothing of PD (the engine
puts that buffer first, above these).
"""

from __future__ import annotations

from kvtier.config import Config
from kvtier.keys import Fingerprint
from kvtier.layout import KVLayout
from kvtier.storage.base import Tier


def build_lower_tiers(config: Config, layout: KVLayout, fingerprint: Fingerprint) -> list[Tier]:
    tiers: list[Tier] = []
    if config.local_disk:
        from kvtier.storage.disk.tier import DiskTier

        tiers.append(DiskTier.from_config(config, layout, fingerprint))
    if config.remote_url:
        from kvtier.storage.redis.tier import RedisTier

        tiers.append(RedisTier.from_config(config, layout, fingerprint))
    return tiers
