"""The ``tenant_quotas`` key: how much of each tier a tenant (a ``cache_salt``) may hold.

Written as LMCache users write its per-``cache_salt`` quotas, one limit per tenant, with
``"*"`` for every tenant the table does not name::

    tenant_quotas:
      alice: "2GiB"     bytes, in every tier (the CPU tier, the disk tier, a server's model)
      bob: "25%"        a share of each tier's capacity
      "*": "10%"        any other tenant; without "*", unnamed tenants have no limit
      "": "50%"         the requests with no cache_salt

A number is GB, as every size key reads it. The limit is a ceiling and, while the limits
of the tenants a tier holds add up to at most its capacity, a guarantee
(:mod:`kvtier.storage.tenants.local` has the rules). The admin API changes the table at
run time (``PUT /quota``); this module parses both.

A size is at most :data:`MAX_LIMIT_BYTES` (1 PiB, the bound of every size key) however it is
set: the config, ``PUT /quota``, LMCache's ``limit_gb`` alias and the disk tier's saved table
all come through :func:`parse_limit` or :func:`limit_of_gib`, so a row one of them takes is a
row the others read back (a saved row that did not parse once cost the whole saved table).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.config.sizes import GIB, MAX_SIZE_BYTES, format_size, parse_size
from kvtier.errors import ConfigError

DEFAULT_TENANT = "*"  # the row that applies to every tenant the table does not name
MAX_TENANTS = 4096
MAX_TENANT_CHARS = 1024  # a cache_salt's own limit (kvtier.request_salt.MAX_SALT_CHARS)
MAX_LIMIT_BYTES = MAX_SIZE_BYTES  # 1 PiB: above it a limit is a typo, and a saved row unreadable
MAX_LIMIT_GIB = MAX_LIMIT_BYTES // GIB  # the same bound as a number of GB (GiB): 1048576

_ALLOWED = (
    f"a size from 0 to 1 PiB ('2GiB', or a number of GB from 0 to {MAX_LIMIT_GIB}) or a share "
    "of each tier ('25%', above 0 up to 100)"
)


@dataclass(frozen=True, slots=True, repr=False)
class TenantLimit:
    """One tenant's limit: ``nbytes`` in every tier, or ``share`` (0 < share <= 1) of each."""

    nbytes: int | None = None
    share: float | None = None

    def bytes_of(self, capacity: int) -> int:
        """The limit in a tier of ``capacity`` bytes."""
        if self.share is not None:
            return int(capacity * self.share)
        assert self.nbytes is not None
        return self.nbytes

    def spec(self) -> str:
        """The limit exactly, as :func:`parse_limit` reads it back (a saved table)."""
        return f"{self.share * 100!r}%" if self.share is not None else f"{self.nbytes}B"

    def __repr__(self) -> str:  # as a config shows it (check-config, GET /config)
        return repr(str(self))

    def __str__(self) -> str:
        if self.share is not None:
            return f"{self.share * 100:g}%"
        assert self.nbytes is not None
        return format_size(self.nbytes)


def parse_limit(key: str, raw: object) -> TenantLimit:
    """One limit (``"25%"``, ``"2GiB"``, ``2``); :class:`ConfigError` naming ``key``."""
    if not isinstance(raw, str):
        return limit_of_gib(key, raw)
    shown = raw if len(raw) <= 40 else f"{raw[:20]}... ({len(raw)} characters)"
    if raw.strip().endswith("%"):
        try:
            percent = float(raw.strip()[:-1])
        except ValueError:
            raise ConfigError(key, shown, _ALLOWED) from None
        share = percent / 100  # tested after dividing: '1e-323%' is a share of 0
        if not 0 < share <= 1:  # also refuses NaN
            raise ConfigError(key, shown, _ALLOWED)
        return TenantLimit(share=share)
    try:
        return TenantLimit(nbytes=parse_size(key, raw, GIB))  # bounded by MAX_SIZE_BYTES
    except ConfigError:
        raise ConfigError(key, shown, _ALLOWED) from None


def limit_of_gib(key: str, gib: object) -> TenantLimit:
    """A limit given as a number of GiB (a bare number in the table, LMCache's ``limit_gb``):
    from 0 to :data:`MAX_LIMIT_GIB`. The range is tested on the number as given, before any
    arithmetic: a 400-digit int does not fit a float, and 1e300 GiB overflows to inf bytes."""
    if isinstance(gib, bool) or not isinstance(gib, int | float):
        raise ConfigError(key, gib, _ALLOWED)
    if not 0 <= gib <= MAX_LIMIT_GIB:  # also refuses NaN
        shown: object = gib
        if isinstance(gib, int) and abs(gib) >= 10**30:  # named by its length, not quoted whole
            shown = f"an integer of about {gib.bit_length() * 30103 // 100000 + 1} digits"
        raise ConfigError(key, shown, _ALLOWED)
    return TenantLimit(nbytes=int(gib * GIB))


def check_tenant(key: str, tenant: object) -> str:
    """A tenant name as a table row names it: a ``cache_salt`` ("" for none) or ``"*"``."""
    if not isinstance(tenant, str) or len(tenant) > MAX_TENANT_CHARS:
        raise ConfigError(
            key, tenant, f"a cache_salt (a string of at most {MAX_TENANT_CHARS} characters)"
        )
    return tenant


def parse_tenant_quotas(key: str, raw: object) -> dict[str, TenantLimit]:
    """The whole table: tenant -> limit (empty: no quotas, the tiers run as without them)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(key, raw, "a mapping of cache_salt (or '*') to " + _ALLOWED)
    if len(raw) > MAX_TENANTS:
        raise ConfigError(key, f"{len(raw)} tenants", f"at most {MAX_TENANTS} tenants")
    return {
        check_tenant(key, tenant): parse_limit(f"{key}[{tenant!r}]", limit)
        for tenant, limit in raw.items()
    }
