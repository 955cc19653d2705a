"""Builds the tiers below CPU from config, in search order: disk, then remote."""

from __future__ import annotations

from kvtier.config import Config
from kvtier.keys import Fingerprint
from kvtier.layout import KVLayout
from kvtier.storage.base import Tier


def build_lower_tiers(config: Config, layout: KVLayout, fingerprint: Fingerprint) -> list[Tier]:
    tiers: list[Tier] = []
    if config.enable_pd and config.pd_role == "receiver":
        # First below CPU: what the prefiller sent is what this decoder request needs.
        from kvtier.storage.pd import PDTier

        tiers.append(PDTier.from_config(config, layout, fingerprint))
    if config.local_disk:
        from kvtier.storage.disk import DiskTier

        tiers.append(DiskTier.from_config(config, layout, fingerprint))
    if config.remote_url:
        from kvtier.storage.redis import RedisTier

        tiers.append(RedisTier.from_config(config, layout, fingerprint))
    return tiers
