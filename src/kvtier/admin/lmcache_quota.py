"""LMCache's quota endpoint, read as an alias of kvtier's ``PUT /quota``.

LMCache's HTTP server (``lmcache/v1/multiprocess/http_apis/quota_api.py``, documented in its
``docs/source/mp/http_api.rst``) sets a ``cache_salt``'s quota with::

    PUT    /api/quota/{cache_salt}   body {"limit_gb": <finite number >= 0>}
           200 {"cache_salt": ..., "limit_gb": ..., "status": "ok"}
    DELETE /api/quota/{cache_salt}   200 {"cache_salt": ..., "status": "removed" | "not_found"}

with ``_default`` in the path for the empty salt (a path parameter cannot be empty), GB
meaning GiB (``limit_gb * 1024**3`` bytes) and errors as ``400 {"error": ...}``. kvtier
answers the same requests, in the same shapes, by changing its own quota table (every tier
of the engine, as ``PUT /quota`` does; the same bearer token). Where the two differ, kvtier's
rules hold: a salt without a row of its own falls under the ``"*"`` row (or has no limit),
where LMCache gives it a limit of 0, and ``limit_gb`` is at most
:data:`~kvtier.config.tenant_quotas.MAX_LIMIT_GIB` (1 PiB, the bound of every kvtier limit:
a larger one could not be read back from the disk tier's saved table). LMCache's ``GET``
routes are not aliased: their usage figure is one storage manager's, and kvtier has one per
tier (``GET /quotas``).
"""

from __future__ import annotations

import json
from urllib.parse import unquote

from kvtier.config.tenant_quotas import (
    MAX_LIMIT_GIB,
    MAX_TENANT_CHARS,
    TenantLimit,
    limit_of_gib,
)
from kvtier.errors import ConfigError

PREFIX = "/api/quota/"
METHODS = ("PUT", "DELETE")
DEFAULT_SALT = "_default"  # LMCache's path spelling of the empty cache_salt


class AliasError(Exception):
    """A request LMCache would refuse with 400; the message names what was wrong."""


def salt_of_path(path: str) -> str:
    """The ``cache_salt`` a ``/api/quota/{cache_salt}`` path names ("" for ``_default``)."""
    raw = unquote(path[len(PREFIX) :])
    if not raw:
        raise AliasError(f"name the cache_salt: {PREFIX}SALT ({DEFAULT_SALT} for none)")
    if len(raw) > MAX_TENANT_CHARS:
        raise AliasError(f"cache_salt is over {MAX_TENANT_CHARS} characters")
    return "" if raw == DEFAULT_SALT else raw


def path_salt(salt: str) -> str:
    """How LMCache names ``salt`` in its answers (the empty salt as ``_default``)."""
    return DEFAULT_SALT if salt == "" else salt


def limit_of_body(body: bytes) -> tuple[float, TenantLimit]:
    """``{"limit_gb": N}`` -> (N, the limit of N GiB in bytes, rounded down). N is a number
    (or a string of one, as LMCache's parser takes it) from 0 to :data:`MAX_LIMIT_GIB`."""
    try:
        payload = json.loads(body or b"null")
    except (ValueError, RecursionError):  # RecursionError: a body of 4 KiB of "["
        raise AliasError('invalid JSON body: expected {"limit_gb": <number>}') from None
    if not isinstance(payload, dict) or "limit_gb" not in payload:
        raise AliasError(f'body must be {{"limit_gb": <number>}}, got {payload!r}')
    raw = payload["limit_gb"]
    number = raw
    if isinstance(raw, str):
        try:
            number = float(raw)
        except ValueError:
            raise AliasError(f"limit_gb must be a number of GiB, got {raw!r}") from None
    if isinstance(number, bool) or not isinstance(number, int | float):
        raise AliasError(f"limit_gb must be a number of GiB, got {raw!r}")
    try:
        limit = limit_of_gib("limit_gb", number)  # the bound every kvtier limit has
    except ConfigError as exc:
        shown = exc.value if isinstance(raw, int) else raw  # a 400-digit int by its length
        raise AliasError(
            f"limit_gb must be finite, >= 0 and at most {MAX_LIMIT_GIB} (GiB: 1 PiB), got {shown!r}"
        ) from None
    return float(number), limit
