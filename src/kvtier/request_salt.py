"""A request's salt: what names its KV besides its tokens, and the check of what callers pass.

A request may carry a plain string (vLLM's per-request ``cache_salt``) or :class:`ExtraKeys`:
the salt widened by everything else an engine keys its own prefix cache by (a LoRA adapter's
identity, content-keyed token ranges such as images). How each part enters the chunk keys is
the hash chain's spec, in :mod:`kvtier.keys`; this module holds the values and their limits.
"""

from __future__ import annotations

from typing import TypeAlias

import msgspec

from kvtier.errors import InputError

MAX_SALT_CHARS = 1024
MAX_DIGEST_BYTES = 64  # an adapter's or an item's digest (sha256 is 32)
MAX_ITEMS = 1 << 16  # keyed token ranges of one request: vLLM's give one per chunk (16M tokens)
MAX_LABELS = 16


class ExtraKeys(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What names a request's KV besides its tokens (see :mod:`kvtier.keys`).

    ``salt``: the request's ``cache_salt``. ``adapter``: a digest of its LoRA adapter's
    weights (empty: the base model). ``items``: ``(start, end, digest)`` token ranges keyed
    by content, sorted by start. ``labels``: what :mod:`kvtier.observability.explain` says
    about them ("lora adapter 'B'", "2 images"); not part of any key. ``tenant``: the
    ``tenant_quotas`` tenant of a request with no salt (vLLM's connector names a LoRA
    adapter's requests ``lora:NAME``, docs/tenants.md); not part of any key either.

    Passed wherever a request's ``cache_salt`` goes (lookup, retrieve, store, the server's
    wire, vLLM's lookup channel): it is the request's salt, widened."""

    salt: str | None = None
    adapter: bytes = b""
    items: tuple[tuple[int, int, bytes], ...] = ()
    labels: tuple[str, ...] = ()
    tenant: str = ""  # tenant_quotas: whose share a request with no salt counts against

    def plain_chunks(self, chunk_size: int) -> int | None:
        """How many leading chunks are keyed as plain text of this salt is (None: all of
        them): none under an adapter, those before the first item otherwise."""
        if self.adapter:
            return 0
        return self.items[0][0] // chunk_size if self.items else None

    def describe(self) -> str:
        """One phrase for logs and explain: the labels, or what the keys hold."""
        if self.labels:
            return ", ".join(self.labels)
        parts = ["a LoRA adapter"] if self.adapter else []
        if self.items:
            parts.append(f"{len(self.items)} content-keyed token ranges")
        return ", ".join(parts) or "no extra keys"


RequestSalt: TypeAlias = str | ExtraKeys  # what a request's ``cache_salt`` may be


def check_salt(salt: object) -> RequestSalt | None:
    """A per-request salt: None, a string (``""`` means none) of at most
    :data:`MAX_SALT_CHARS` characters, or :class:`ExtraKeys` (with no adapter and no items
    it is its plain salt). Anything else is an :class:`InputError` naming what is wrong."""
    if isinstance(salt, ExtraKeys):
        return _check_extra_keys(salt)
    if salt is None or salt == "":
        return None
    if not isinstance(salt, str):
        raise InputError(
            f"cache_salt must be a string, ExtraKeys or None, got {type(salt).__name__}"
        )
    if len(salt) > MAX_SALT_CHARS:
        raise InputError(
            f"cache_salt has {len(salt)} characters; at most {MAX_SALT_CHARS} are accepted"
        )
    return salt


def _check_extra_keys(extra: ExtraKeys) -> RequestSalt | None:
    salt = check_salt(extra.salt)
    if not isinstance(extra.adapter, bytes) or len(extra.adapter) > MAX_DIGEST_BYTES:
        raise InputError(f"ExtraKeys.adapter must be a digest of at most {MAX_DIGEST_BYTES} bytes")
    if len(extra.items) > MAX_ITEMS:
        raise InputError(
            f"ExtraKeys has {len(extra.items)} items; at most {MAX_ITEMS} are accepted"
        )
    previous = 0
    for item in extra.items:
        if not (isinstance(item, tuple) and len(item) == 3):
            raise InputError(f"ExtraKeys item {item!r} must be (start, end, digest)")
        start, end, digest = item
        if not (
            isinstance(start, int)
            and isinstance(end, int)
            and 0 <= start < end
            and start >= previous
            and isinstance(digest, bytes)
            and 0 < len(digest) <= MAX_DIGEST_BYTES
        ):
            raise InputError(
                f"ExtraKeys item {item!r}: need 0 <= start < end, items sorted by start, and a "
                f"digest of 1 to {MAX_DIGEST_BYTES} bytes"
            )
        previous = start
    if not isinstance(extra.tenant, str) or len(extra.tenant) > MAX_SALT_CHARS:
        raise InputError(
            f"ExtraKeys.tenant must be a string of at most {MAX_SALT_CHARS} characters"
        )
    if len(extra.labels) > MAX_LABELS or not all(
        isinstance(label, str) and len(label) <= 200 for label in extra.labels
    ):
        raise InputError(f"ExtraKeys.labels: at most {MAX_LABELS} strings of 200 characters")
    if not extra.adapter and not extra.items:
        return salt  # nothing but a salt: keyed exactly as the plain salt is
    if salt != extra.salt:
        return msgspec.structs.replace(extra, salt=salt)
    return extra


def keyed_by(salt: RequestSalt | None) -> str:
    """What besides its tokens keys a request, in words ("" for none)."""
    if isinstance(salt, ExtraKeys):
        return ", ".join((["cache salt"] if salt.salt else []) + [salt.describe()])
    return "cache salt" if salt else ""


def tenant_of(salt: RequestSalt | None) -> str | None:
    """The request's tenant under ``tenant_quotas``: its ``cache_salt``, else the tenant
    its :class:`ExtraKeys` name (a LoRA adapter's), else None (the unsalted tenant)."""
    if isinstance(salt, ExtraKeys):
        return salt.salt or salt.tenant or None
    return salt


def salt_of(salt: RequestSalt | None) -> str | None:
    """The plain ``cache_salt`` part of a request's salt."""
    return salt.salt if isinstance(salt, ExtraKeys) else salt
