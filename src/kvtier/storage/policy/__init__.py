"""Eviction policies behind one seam (:mod:`.base`), chosen by the ``cache_policy`` key.

``POLICIES`` maps each name ``cache_policy`` accepts to its class; the config's list of
names (``kvtier.config.schema.CACHE_POLICIES``) must equal its keys (a test checks).
"""

from __future__ import annotations

from kvtier.errors import ConfigError
from kvtier.storage.policy.base import Evictable, EvictionPolicy
from kvtier.storage.policy.lru import LruPolicy
from kvtier.storage.policy.reuse import ReusePolicy

POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (LruPolicy, ReusePolicy)}


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy by its ``cache_policy`` name."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ConfigError("cache_policy", name, "one of " + ", ".join(sorted(POLICIES))) from None
    return cls()


__all__ = ["POLICIES", "EvictionPolicy", "Evictable", "LruPolicy", "ReusePolicy", "make_policy"]
