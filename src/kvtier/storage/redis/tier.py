"""The Redis tier: a :class:`~kvtier.storage.remote.tier.RemoteTier` over a
:class:`~kvtier.storage.redis.store.RedisStore`, with a
:class:`~kvtier.storage.redis.quotas.RedisLedger` under ``tenant_quotas``.

Everything a remote tier does is :mod:`kvtier.storage.remote.tier`; what is Redis' own is
the store (names, commands, the link that reconnects), the ledger (a sorted set per tenant,
updated by a script) and the options (:mod:`kvtier.storage.redis.options`). This module only
assembles them from the config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvtier.config import Config
from kvtier.config.remote_url import RemoteTarget, parse_remote_url
from kvtier.fingerprint import Fingerprint
from kvtier.layout import KVLayout
from kvtier.storage.codecs import IDENTITY, PayloadCodec, codec_from_config, tier_fingerprint
from kvtier.storage.redis.options import RedisOptions
from kvtier.storage.redis.quotas import RedisLedger
from kvtier.storage.redis.store import RedisCounters, RedisStore
from kvtier.storage.remote.tier import RemoteTier
from kvtier.storage.tenants.quotas import TenantQuotas

__all__ = ["RedisCounters", "RedisTier"]


class RedisTier(RemoteTier):
    """Chunks in Redis or Redis Cluster (or Valkey), shared by a fleet of engines."""

    name = "redis"
    counters: RedisCounters
    store: RedisStore

    def __init__(
        self,
        target: RemoteTarget,
        layout: KVLayout,
        fingerprint: Fingerprint,
        options: RedisOptions,
        codec: PayloadCodec = IDENTITY,
    ) -> None:
        # A lossy codec makes another cache: its own namespace and record headers.
        fingerprint = tier_fingerprint(fingerprint, codec)
        store = RedisStore(target, fingerprint, options)

        def ledger(quotas: TenantQuotas, unit: int, capacity: Callable[[], int]) -> RedisLedger:
            return RedisLedger(
                quotas,
                unit,
                capacity,
                # The ranks of one model share a ledger: the fingerprint but its TP rank.
                ledger_hex=dataclasses.replace(fingerprint, tp_rank=0).hex(),
                fingerprint_hex=fingerprint.hex(),
                ttl_ms=int(options.ttl_s * 1000) if options.ttl_s else 0,
                call=store.call,
            )

        super().__init__(store, layout, fingerprint, options, codec=codec, ledger=ledger)

    @classmethod
    def from_config(cls, config: Config, layout: KVLayout, fingerprint: Fingerprint) -> RedisTier:
        target = parse_remote_url(config.remote_url)
        codec = codec_from_config("remote_codec", config.remote_codec, layout.dtype)
        return cls(target, layout, fingerprint, RedisOptions.from_config(config), codec)
