"""Which tier a config value builds, by the scheme of its URL (as httpx mounts a transport
by URL).

Two config keys name a lower tier, each by a URL; the scheme picks the tier class::

    key          scheme                                            tier        medium
    local_disk   file://PATH, or a plain PATH                      DiskTier    DISK
    remote_url   redis, rediss, unix, redis-cluster,               RedisTier   REMOTE
                 valkey, valkeys, valkey-cluster, resp, resps      (RemoteTier)
    remote_url   s3 (s3://bucket/prefix: AWS, MinIO, SeaweedFS)    S3Tier      REMOTE
                                                                   (RemoteTier)

A factory is a tier's ``from_config(config, layout, fingerprint)``: it reads its key's URL
and its own options (``extra_config``) from the config, validates them and returns the
tier unopened (the engine opens it). The tier class says how KV events publish it
(``Tier.medium``), so nothing outside the tier decides by its name. The search order of the
lower tiers is the order of the keys (:data:`TIER_KEYS`), below the PD buffer
(:mod:`kvtier.tiers`).

Registering a scheme is one call. A remote store is a
:class:`~kvtier.storage.remote.tier.RemoteTier` over its store, its ledger and its options
(:mod:`kvtier.storage.remote`); the ``s3://`` tier (:mod:`kvtier.storage.s3`) plugs in as::

    from kvtier.storage.registry import register_tier
    from kvtier.storage.remote.tier import RemoteTier

    class S3Tier(RemoteTier):  # name "s3", medium "REMOTE": published as a shared store
        def __init__(self, options, layout, fingerprint, codec=IDENTITY):
            store = S3Store(options, layout, fingerprint)          # names, requests, index
            ledger = lambda quotas, unit, capacity: S3Ledger(...)   # tenant markers
            super().__init__(store, layout, fingerprint, options, codec=codec, ledger=ledger)

        @classmethod
        def from_config(cls, config, layout, fingerprint) -> "S3Tier":
            # parse config.remote_url (s3://bucket/prefix) and extra_config's s3_* keys
            ...

    register_tier("remote_url", "s3", S3Tier.from_config)

after which ``remote_url: s3://bucket/kv`` builds an ``S3Tier`` where the Redis tier would
have been (registered below; obstore is imported only when one is built). A scheme nobody
registered is a :class:`~kvtier.errors.ConfigError` naming the key, the value (any password
masked) and the schemes registered for that key.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.config import Config
from kvtier.config.remote_url import REDIS_SCHEMES, mask_password
from kvtier.errors import ConfigError
from kvtier.fingerprint import Fingerprint
from kvtier.layout import KVLayout
from kvtier.storage.base import Tier

TierFactory = Callable[[Config, KVLayout, Fingerprint], Tier]

# The config keys that name a lower tier by URL, in search order.
TIER_KEYS = ("local_disk", "remote_url")


@dataclass(frozen=True, slots=True)
class Scheme:
    """One registration: ``key``'s URLs of ``scheme`` are built by ``factory``."""

    key: str
    scheme: str
    factory: TierFactory


class TierRegistry:
    """Schemes per config key. :data:`TIERS` is the process's; a test may build its own."""

    def __init__(self) -> None:
        self._schemes: dict[tuple[str, str], Scheme] = {}
        self._bare: dict[str, str] = {}  # key -> the scheme a value without "://" means
        self._lock = threading.Lock()

    def register(
        self, key: str, scheme: str, factory: TierFactory, *, bare_paths: bool = False
    ) -> None:
        """Build ``key``'s ``scheme://`` URLs with ``factory`` (replacing an earlier one).
        ``bare_paths``: a value with no ``scheme://`` at all is this scheme (``local_disk:
        /var/cache/kvtier`` is ``file://``)."""
        if key not in TIER_KEYS:
            raise ValueError(f"{key!r} is not a tier key; one of {', '.join(TIER_KEYS)}")
        if not scheme or "://" in scheme or scheme != scheme.lower():
            raise ValueError(f"scheme {scheme!r}: a lower-case name such as 's3', no '://'")
        with self._lock:
            self._schemes[(key, scheme)] = Scheme(key, scheme, factory)
            if bare_paths:
                self._bare[key] = scheme

    def unregister(self, key: str, scheme: str) -> None:
        """Forget ``key``'s ``scheme`` (a no-op if it was not registered)."""
        with self._lock:
            self._schemes.pop((key, scheme), None)
            if self._bare.get(key) == scheme:
                del self._bare[key]

    def schemes(self, key: str) -> list[str]:
        """The schemes registered for ``key``, sorted."""
        with self._lock:
            return sorted(s for k, s in self._schemes if k == key)

    def resolve(self, key: str, value: str) -> Scheme:
        """The registration that builds ``value`` of ``key``; a ConfigError if there is none."""
        scheme, sep, _ = value.partition("://")
        with self._lock:
            found = self._schemes.get((key, scheme.lower() if sep else self._bare.get(key, "")))
        if found is None:
            bare = " (or a plain path)" if key in self._bare else ""
            schemes = ", ".join(f"{s}://" for s in self.schemes(key)) or "(none registered)"
            raise ConfigError(key, mask_password(value), f"a URL of scheme {schemes}{bare}")
        return found

    def build(self, key: str, config: Config, layout: KVLayout, fingerprint: Fingerprint) -> Tier:
        """The tier ``config``'s ``key`` names, constructed (validated, not opened)."""
        value = getattr(config, key)
        if not isinstance(value, str) or not value:
            raise ConfigError(key, value, "a URL naming the tier (this key builds no tier unset)")
        return self.resolve(key, value).factory(config, layout, fingerprint)

    def check(self, config: Config) -> None:
        """Raise ConfigError if a tier key of ``config`` has a scheme nobody registered."""
        for key in TIER_KEYS:
            value = getattr(config, key)
            if value:
                self.resolve(key, value)


def _disk(config: Config, layout: KVLayout, fingerprint: Fingerprint) -> Tier:
    from kvtier.storage.disk.tier import DiskTier  # lazy: only an engine with a disk tier

    return DiskTier.from_config(config, layout, fingerprint)


def _redis(config: Config, layout: KVLayout, fingerprint: Fingerprint) -> Tier:
    from kvtier.storage.redis.tier import RedisTier  # lazy: redis-py only when it is used

    return RedisTier.from_config(config, layout, fingerprint)


def _s3(config: Config, layout: KVLayout, fingerprint: Fingerprint) -> Tier:
    from kvtier.storage.s3.tier import S3Tier  # lazy: obstore only when it is used

    return S3Tier.from_config(config, layout, fingerprint)


TIERS = TierRegistry()
TIERS.register("local_disk", "file", _disk, bare_paths=True)
for _scheme in REDIS_SCHEMES:  # every form config.remote_url parses, resp:// included
    TIERS.register("remote_url", _scheme, _redis)
TIERS.register("remote_url", "s3", _s3)

register_tier = TIERS.register
