"""Builds the tiers below CPU that a config asks for, in search order::

    pd     the decoder's PD receive buffer (enable_pd, pd_role: receiver): first, because what
           the prefiller sent is what this decoder needs next
    disk   local_disk
    redis  remote_url

The one place a config's tier keys become tiers: the engine takes the storage that
:func:`open_storage` assembles (page pool, CPU tier, these lower tiers, the manager over them)
and never names a role. This module sits above both ``storage`` and ``pd`` in the layer order
(``tests/test_layers.py``), since it builds tiers of both.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence

from kvtier.config import Config
from kvtier.errors import TierError
from kvtier.keys import Fingerprint
from kvtier.layout import KVLayout
from kvtier.memory.block_pool import BlockPool
from kvtier.storage.base import Tier
from kvtier.storage.counters import EngineCounters
from kvtier.storage.cpu import CpuTier
from kvtier.storage.manager import StorageManager
from kvtier.storage.policy import make_policy


def build_lower_tiers(config: Config, layout: KVLayout, fingerprint: Fingerprint) -> list[Tier]:
    """The lower tiers, constructed (validated, nothing opened: the engine opens them)."""
    tiers: list[Tier] = []
    if config.enable_pd and config.pd_role == "receiver":
        from kvtier.pd.buffer import PDBuffer

        tiers.append(PDBuffer.from_config(config, layout, fingerprint))
    if config.local_disk:
        from kvtier.storage.disk.tier import DiskTier

        tiers.append(DiskTier.from_config(config, layout, fingerprint))
    if config.remote_url:
        from kvtier.storage.redis.tier import RedisTier

        tiers.append(RedisTier.from_config(config, layout, fingerprint))
    return tiers


def open_storage(
    config: Config,
    layout: KVLayout,
    fingerprint: Fingerprint,
    num_pages: int,
    counters: EngineCounters,
    page_memory: Callable[[int], mmap.mmap] | None = None,
) -> StorageManager:
    """The page pool (``num_pages`` pages of one chunk, in ``page_memory(nbytes)`` when
    given, else anonymous memory), the CPU tier over it and the lower tiers, all open, under
    one manager. If a tier fails to open, what was built is closed again and the error raised."""
    page_bytes = layout.chunk_bytes(config.chunk_size)
    mapping = page_memory(num_pages * page_bytes) if page_memory else None
    pool = BlockPool(num_pages, page_bytes, mapping=mapping)
    lower: list[Tier] = []
    try:
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
