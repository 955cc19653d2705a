"""Builds the tiers below CPU that a config asks for, in search order::

    pd     the decoder's PD receive buffer (enable_pd, pd_role: receiver): first, because what
           the prefiller sent is what this decoder needs next
    disk   local_disk   } the tier each key's URL scheme names in the tier registry
    redis  remote_url   } (:mod:`kvtier.storage.registry`: file://, redis://, resp://, ...)

The one place a config's tier keys become tiers: the engine takes the storage that
:func:`open_storage` assembles (page pool, CPU tier, these lower tiers, the manager over them)
and never names a role. A caller with ready-made lower tiers (a test, an embedding) passes them
to :func:`open_storage` instead, and the config's tier keys are not read. This module sits
above both ``storage`` and ``pd`` in the layer order (``tests/test_layers.py``), since it
builds tiers of both.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence

from kvtier.config import Config
from kvtier.errors import InputError, TierError
from kvtier.keys import Fingerprint
from kvtier.layout import KVLayout
from kvtier.memory.block_pool import BlockPool
from kvtier.storage.base import Tier
from kvtier.storage.counters import EngineCounters
from kvtier.storage.cpu import CpuTier
from kvtier.storage.manager import StorageManager
from kvtier.storage.policy import make_policy
from kvtier.storage.registry import TIER_KEYS, TIERS, TierRegistry


def build_lower_tiers(
    config: Config, layout: KVLayout, fingerprint: Fingerprint, registry: TierRegistry = TIERS
) -> list[Tier]:
    """The lower tiers, constructed (validated, nothing opened: the engine opens them)."""
    tiers: list[Tier] = []
    if config.enable_pd and config.pd_role == "receiver":
        from kvtier.pd.buffer import PDBuffer

        tiers.append(PDBuffer.from_config(config, layout, fingerprint))
    for key in TIER_KEYS:  # local_disk, then remote_url
        if getattr(config, key):
            tiers.append(registry.build(key, config, layout, fingerprint))
    return tiers


def check_tier_urls(config: Config, registry: TierRegistry = TIERS) -> None:
    """Raise ConfigError if a tier key's URL has a scheme no tier is registered for (the
    engine's constructor and ``kvtier check-config`` call it: nothing is built)."""
    registry.check(config)


def given_lower_tiers(tiers: Sequence[Tier]) -> list[Tier]:
    """``tiers`` checked as lower tiers handed to an engine: Tier instances with names
    unique among themselves and the CPU tier's (stats and ``Engine.tier`` go by name)."""
    names = ["cpu"]
    for tier in tiers:
        if not isinstance(tier, Tier):
            raise InputError(f"lower_tiers holds {type(tier).__name__}, not a Tier")
        if tier.name in names:
            raise InputError(f"lower_tiers: two tiers are named {tier.name!r} (with cpu)")
        names.append(tier.name)
    return list(tiers)


def open_storage(
    config: Config,
    layout: KVLayout,
    fingerprint: Fingerprint,
    num_pages: int,
    counters: EngineCounters,
    page_memory: Callable[[int], mmap.mmap] | None = None,
    lower_tiers: Sequence[Tier] | None = None,
) -> StorageManager:
    """The page pool (``num_pages`` pages of one chunk, in ``page_memory(nbytes)`` when
    given, else anonymous memory), the CPU tier over it and the lower tiers, all open, under
    one manager. ``lower_tiers``: unopened tiers to use, in search order, instead of those the
    config names; the manager owns them from here (opens them now, closes them with itself).
    If a tier fails to open, what was built or given is closed again and the error raised."""
    page_bytes = layout.chunk_bytes(config.chunk_size)
    mapping = page_memory(num_pages * page_bytes) if page_memory else None
    pool = BlockPool(num_pages, page_bytes, mapping=mapping)
    lower: list[Tier] = list(lower_tiers) if lower_tiers is not None else []
    try:
        if lower_tiers is None:
            lower.extend(build_lower_tiers(config, layout, fingerprint))
        for tier in lower:
            tier.open()
    except BaseException:
        for tier in lower:
            tier.close()
        pool.close()
        raise
    cpu = CpuTier(pool, layout.payload_bytes, make_policy(config.cache_policy))
    return StorageManager(config, layout, pool, cpu, lower, counters)


def clear_tiers(tiers: Sequence[Tier]) -> dict[str, int]:
    """Drop every unpinned entry of every tier; tier name -> entries dropped. A tier that
    fails is skipped, the others are cleared, then :class:`TierError` names it."""
    dropped: dict[str, int] = {}
    failed: list[str] = []
    for tier in tiers:
        try:
            dropped[tier.name] = tier.clear()
        except TierError as exc:
            failed.append(f"{tier.name}: {exc}")
    if failed:
        raise TierError(f"clear dropped {dropped} but failed on " + "; ".join(failed))
    return dropped
