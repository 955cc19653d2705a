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
from dataclasses import dataclass

from kvtier.config import Config
from kvtier.errors import ConfigError, InputError, TierError
from kvtier.fingerprint import Fingerprint
from kvtier.layout import KVLayout
from kvtier.memory.block_pool import BlockPool, pages_for_capacity
from kvtier.memory.device import CopyEngine
from kvtier.storage.base import Tier
from kvtier.storage.codecs import IDENTITY, PayloadCodec, QuantizedCodec, codec_from_config
from kvtier.storage.counters import EngineCounters
from kvtier.storage.cpu import CpuTier
from kvtier.storage.cpu_coded import CodedCpuTier, slot_shape, split_capacity
from kvtier.storage.manager import StorageManager
from kvtier.storage.policy import make_policy
from kvtier.storage.registry import TIER_KEYS, TIERS, TierRegistry
from kvtier.storage.tenants import TenantPolicy, TenantQuotas
from kvtier.storage.tenants.ledger import TakesQuotas


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
    copies: CopyEngine | None = None,
) -> StorageManager:
    """The page pool (``num_pages`` pages of one chunk, in ``page_memory(nbytes)`` when
    given, else anonymous memory), the CPU tier over it and the lower tiers, all open, under
    one manager. ``lower_tiers``: unopened tiers to use, in search order, instead of those the
    config names; the manager owns them from here (opens them now, closes them with itself).
    If a tier fails to open, what was built or given is closed again and the error raised.
    ``copies``: the device-copy owner the manager's stores and loads go through."""
    page_bytes = layout.chunk_bytes(config.chunk_size)
    store = _coded_store(config, layout)  # before any memory: its ConfigError first
    quotas = _quotas(config, store[0] if store is not None else None)
    mapping = page_memory(num_pages * page_bytes) if page_memory else None
    pool = BlockPool(num_pages, page_bytes, mapping=mapping)
    lower: list[Tier] = list(lower_tiers) if lower_tiers is not None else []
    slots: BlockPool | None = None
    try:
        if store is not None:
            slots = BlockPool(store[2], store[1])  # the coded chunks' memory, touched now
        if lower_tiers is None:
            lower.extend(build_lower_tiers(config, layout, fingerprint))
        for tier in lower:
            if quotas is not None and isinstance(tier, TakesQuotas):  # disk, pd, remote
                tier.attach_quotas(quotas)
            tier.open()
    except BaseException:
        for tier in lower:
            tier.close()
        pool.close()
        if slots is not None:
            slots.close()
        raise
    # A tenant's share is counted in what holds its chunks: pages, or a codec's slots.
    units, unit_bytes = (num_pages, page_bytes) if store is None else (store[2], store[1])
    tenants = _cpu_tenants(config, units, unit_bytes, quotas)
    policy = make_policy(config.cache_policy) if tenants is None else None
    if store is None or slots is None:
        cpu = CpuTier(pool, layout.payload_bytes, policy, tenants=tenants)
    else:
        cpu = CodedCpuTier(pool, slots, layout, store[0], fingerprint, policy, tenants=tenants)
    return StorageManager(config, layout, pool, cpu, lower, counters, copies, quotas)


def _quotas(config: Config, codec: PayloadCodec | None) -> TenantQuotas | None:
    """The engine's quota table (one, for all its tiers), None without ``tenant_quotas``.
    ``codec``: the CPU tier's, when it codes its chunks. A fixed-size codec's chunk is one
    slot, counted as a page is; a codec whose stored size varies (lossless) has no per-chunk
    unit a quota could count in, so quotas are refused with it."""
    if not config.tenant_quotas:
        return None
    if codec is not None and not isinstance(codec, QuantizedCodec):
        raise ConfigError(
            "tenant_quotas",
            {t: str(q) for t, q in config.tenant_quotas.items()},
            f"no quotas with cpu_codec {config.cpu_codec!r}, whose chunks vary in size "
            "(identity, fp8 or int8 take quotas)",
        )
    return TenantQuotas(config.tenant_quotas)


def _cpu_tenants(
    config: Config, units: int, unit_bytes: int, quotas: TenantQuotas | None
) -> TenantPolicy | None:
    """Under ``quotas`` (``tenant_quotas`` set), the CPU tier's ledger: ``cache_policy``'s
    policy per row, over ``units`` of ``unit_bytes`` that each hold one chunk (pages, or a
    fixed codec's slots); None without quotas."""
    if quotas is None:
        return None
    return TenantPolicy(
        lambda: make_policy(config.cache_policy), quotas, unit_bytes, units * unit_bytes
    )


@dataclass(frozen=True, slots=True)
class CpuCapacity:
    """What ``max_local_cpu_size`` buys for a config and layout."""

    codec: str
    staging_pages: int  # decoded pages: the whole tier with identity, else its staging share
    slots: int  # the coded store's slots (0 with identity)
    slot_bytes: int
    chunks: int  # whole chunks the tier holds at least (exactly, for identity, fp8 and int8)
    bytes_used: int  # of max_local_cpu_size, after rounding down to pages and slots


def cpu_capacity(config: Config, layout: KVLayout) -> CpuCapacity:
    """The CPU tier's capacity: every whole chunk of ``max_local_cpu_size`` as pages, or with
    a ``cpu_codec`` other than identity the staging pages plus the slots of the coded store
    (:mod:`kvtier.storage.cpu_coded`). ConfigError naming the key when it is too small, or
    when the codec failed the quality gate for the layout's dtype."""
    chunk_bytes = layout.chunk_bytes(config.chunk_size)
    if config.cpu_codec == IDENTITY.name:
        pages = pages_for_capacity("max_local_cpu_size", config.max_local_cpu_size, chunk_bytes)
        return CpuCapacity(IDENTITY.name, pages, 0, 0, pages, pages * chunk_bytes)
    codec = codec_from_config("cpu_codec", config.cpu_codec, layout.dtype)
    slot_bytes, per_chunk = slot_shape(codec, layout, config.chunk_size)
    pages, slots = split_capacity(
        config.max_local_cpu_size, config.cpu_codec_staging, chunk_bytes, (slot_bytes, per_chunk)
    )
    used = pages * chunk_bytes + slots * slot_bytes
    return CpuCapacity(codec.name, pages, slots, slot_bytes, slots // per_chunk, used)


def cpu_pages(config: Config, layout: KVLayout) -> int:
    """The page pool's size for ``config`` (:func:`cpu_capacity`'s staging pages)."""
    return cpu_capacity(config, layout).staging_pages


def _coded_store(config: Config, layout: KVLayout) -> tuple[PayloadCodec, int, int] | None:
    """(codec, slot bytes, slots) of the coded CPU store, or None for the identity codec."""
    if config.cpu_codec == IDENTITY.name:
        return None
    capacity = cpu_capacity(config, layout)
    return codec_from_config("cpu_codec", config.cpu_codec), capacity.slot_bytes, capacity.slots


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
