"""The object-store tier: a :class:`~kvtier.storage.remote.tier.RemoteTier` over an
:class:`~kvtier.storage.s3.store.S3Store`, with an :class:`~kvtier.storage.s3.quotas.S3Ledger`
under ``tenant_quotas``.

Everything a remote tier does is :mod:`kvtier.storage.remote.tier`; what is S3's own is the
store (names, the client, the index and its listings), the ledger (a marker object per chunk
naming its tenant) and the options (:mod:`kvtier.storage.s3.options`). This module only
assembles them from the config.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.config import Config
from kvtier.fingerprint import Fingerprint
from kvtier.layout import KVLayout
from kvtier.storage.codecs import IDENTITY, PayloadCodec, codec_from_config, tier_fingerprint
from kvtier.storage.remote.tier import RemoteTier
from kvtier.storage.s3.options import S3Options
from kvtier.storage.s3.quotas import S3Ledger
from kvtier.storage.s3.store import RETRY_AFTER_S, S3Counters, S3Store
from kvtier.storage.tenants.quotas import TenantQuotas

__all__ = ["RETRY_AFTER_S", "S3Counters", "S3Tier"]


class S3Tier(RemoteTier):
    """Chunks as objects in an S3 bucket, shared by a fleet of engines and outliving them."""

    name = "s3"
    counters: S3Counters
    store: S3Store

    def __init__(
        self,
        options: S3Options,
        layout: KVLayout,
        fingerprint: Fingerprint,
        codec: PayloadCodec = IDENTITY,
    ) -> None:
        fingerprint = tier_fingerprint(fingerprint, codec)  # a lossy codec: its own cache
        store = S3Store(options, layout, fingerprint)

        def ledger(quotas: TenantQuotas, unit: int, capacity: Callable[[], int]) -> S3Ledger:
            made = S3Ledger(
                quotas,
                unit,
                capacity,
                index=store.index,
                client=store.client,
                base=store.base,
                fingerprint=fingerprint,
            )
            store.lister.ledger = made  # each listing relists the markers too
            return made

        super().__init__(store, layout, fingerprint, options, codec=codec, ledger=ledger)

    @classmethod
    def from_config(cls, config: Config, layout: KVLayout, fingerprint: Fingerprint) -> S3Tier:
        codec = codec_from_config("remote_codec", config.remote_codec, layout.dtype)
        return cls(S3Options.from_config(config), layout, fingerprint, codec)
