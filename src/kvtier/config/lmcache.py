"""LMCache config keys that kvtier reads under another name, ignores, or refuses.

kvtier's own keys follow LMCache's names (:mod:`kvtier.config.schema`, ``lmcache=True``);
every other key of LMCache's schema has a row in :mod:`kvtier.config.lmcache_keys`, so that
LMCache's files load unchanged or are refused for a feature kvtier lacks, named.
:func:`translate` runs on the raw values of every source (file, environment, overrides) before
they are parsed:

``mapped``
    the value is rewritten into kvtier's key(s): ``local_device: "file://..."`` is the disk
    tier, ``remote_url: "resp://h:p"`` is Redis, ``max_local_cpu_size: 0`` is no CPU tier,
    ``extra_config.username`` / ``password`` are the Redis ACL user (put into the URL,
    masked wherever the config is shown), the legacy ``nixl_*`` keys are PD keys.
``ignored``
    accepted; one WARNING per load names them all, each with why it has no effect.
``refused``
    a value that turns on a feature kvtier lacks raises :class:`ConfigError` naming the key,
    the value and what kvtier offers instead.

A key in neither kvtier's schema nor LMCache's is left for the loader to refuse, with
:func:`nearest_key` as its suggestion.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from difflib import get_close_matches
from urllib.parse import quote

from kvtier.config.lmcache_keys import (
    BY_NAME,
    ENCODER_CACHE_PREFIX,
    IGNORED,
    LMCACHE_KEYS,
    NO_CPU_TIER_STAGING,
    PD_RENAMES,
    REFUSED,
    WHEN_TRUE,
    LMCacheKey,
)
from kvtier.config.remote_url import mask_password
from kvtier.config.schema import KEYS_BY_NAME
from kvtier.config.sizes import GIB, parse_size
from kvtier.errors import ConfigError

__all__ = [
    "LMCACHE_KEYS",
    "NO_CPU_TIER_STAGING",
    "Raw",
    "nearest_key",
    "secret_extra_key",
    "translate",
]

log = logging.getLogger(__name__)

_OFF = (None, False, 0, "", "false", "False")

# LMCache's size (GB) of a local_device read from a config file without max_local_cache_size.
LEGACY_DEVICE_GB = 20

_SERDES = {"naive": "identity", "fp8": "fp8"}  # LMCache's remote_serde -> remote_codec
_REDIS_SCHEMES = (
    "redis://",
    "rediss://",
    "valkey://",
    "valkeys://",
    "redis-cluster://",
    "valkey-cluster://",
)


def nearest_key(name: str) -> str | None:
    """The kvtier or LMCache key closest to ``name`` (a typo's likely meaning), or None."""
    matches = get_close_matches(name, [*KEYS_BY_NAME, *BY_NAME], n=1, cutoff=0.8)
    return matches[0] if matches else None


# raw: key -> (value, source). Every function here edits it in place.
Raw = dict[str, tuple[object, str]]


def translate(
    raw: Raw,
    note: Callable[[str], None],
    errors: list[ConfigError] | None = None,
    ignored_keys: dict[str, str] | None = None,
) -> None:
    """Rewrite LMCache-only keys of ``raw`` into kvtier's, ``note`` each rewrite (one line
    each), drop the ignored ones with one WARNING naming them all and why (and into
    ``ignored_keys``, key -> why, if given), raise :class:`ConfigError` for a refused one
    (with ``errors``: append each and go on)."""
    ignored: list[str] = []
    for key in list(raw):
        value, source = raw[key]
        row = BY_NAME.get(key) or _encoder_cache_override(key)
        if row is None:
            continue
        if row.status == REFUSED:
            if value not in _OFF and value != []:
                refusal = ConfigError(key, value, f"{row.refusal} (from {source})")
                if errors is None:
                    raise refusal
                errors.append(refusal)
            del raw[key]  # switched off: it asks for nothing kvtier lacks
        elif row.status == IGNORED:
            if row.meaning.startswith(WHEN_TRUE) and value in _OFF:
                del raw[key]  # a switch left off: nothing to warn about
                continue
            ignored.append(f"{key} ({source}: {row.meaning})")
            if ignored_keys is not None:
                ignored_keys[key] = f"LMCache's key, ignored by kvtier: {row.meaning}"
            del raw[key]
    if ignored:
        # One line, and a WARNING: a key that does nothing must be seen once, not buried in
        # one INFO line per key (LMCache's examples carry several at a time).
        log.warning("LMCache keys with no effect in kvtier: %s", "; ".join(ignored))
    for step in (_serde, _legacy_device, _xpyd, _nixl, _remote, _no_cpu_tier):
        try:
            step(raw, note)
        except ConfigError as exc:
            if errors is None:
                raise
            errors.append(exc)


def _encoder_cache_override(key: str) -> LMCacheKey | None:
    """``ec_<key>``: LMCache's override of an LMCache key for its encoder-cache engine."""
    if not key.startswith(ENCODER_CACHE_PREFIX):
        return None
    rest = key.removeprefix(ENCODER_CACHE_PREFIX)
    known = rest in BY_NAME or (rest in KEYS_BY_NAME and KEYS_BY_NAME[rest].lmcache)
    return BY_NAME["ec"] if known else None


def _serde(raw: Raw, note: Callable[[str], None]) -> None:
    """remote_serde: naive or fp8 set remote_codec (unless it says otherwise: refused)."""
    if "remote_serde" not in raw:
        return
    value, source = raw.pop("remote_serde")
    if value is None:
        return
    codec = _SERDES.get(value) if isinstance(value, str) else None
    if codec is None:
        raise ConfigError(
            "remote_serde",
            value,
            f"'naive' or 'fp8'; kvtier has no CacheGen codec (it needs a GPU to encode): it "
            f"offers remote_codec lossless, fp8 or int8 instead (from {source})",
        )
    if "remote_codec" in raw and raw["remote_codec"][0] != codec:
        other, where = raw["remote_codec"]
        raise ConfigError(
            "remote_serde",
            value,
            f"the remote_codec it means ({codec!r}); remote_codec is {other!r} (from {where})",
        )
    if codec != "identity":
        note(f"remote_serde {value!r} ({source}) is remote_codec {codec!r}")
        raw["remote_codec"] = (codec, source)


def _legacy_device(raw: Raw, note: Callable[[str], None]) -> None:
    device = raw.pop("local_device", None)
    size = raw.pop("max_local_cache_size", None)
    is_file = device is not None and isinstance(device[0], str) and device[0].startswith("file://")
    if device is not None:
        value, source = device
        if is_file:
            raw.setdefault("local_disk", (value, source))
            note(f"local_device {value!r} ({source}) -> local_disk (the disk tier)")
        elif value not in (None, "cpu"):
            raise ConfigError(
                "local_device",
                value,
                f"'cpu' or 'file://DIR' (from {source}): a GPU-memory tier is not implemented; "
                "kvtier's tiers are CPU memory, local_disk and remote_url",
            )
    if size is not None:
        target = "max_local_disk_size" if is_file else "max_local_cpu_size"
        raw.setdefault(target, size)
        note(f"max_local_cache_size ({size[1]}) -> {target}")
    elif is_file and device is not None and "max_local_disk_size" not in raw:
        # LMCache sizes a local_device read from a file at max_local_cache_size 20 (GB).
        raw["max_local_disk_size"] = (LEGACY_DEVICE_GB, f"LMCache's default, {device[1]}")
        note(f"local_device with no max_local_cache_size -> max_local_disk_size {LEGACY_DEVICE_GB}")


def _xpyd(raw: Raw, note: Callable[[str], None]) -> None:
    if "enable_xpyd" in raw:
        value, source = raw.pop("enable_xpyd")
        raw.setdefault("enable_pd", (value, source))
        note(f"enable_xpyd ({source}) -> enable_pd")


def _nixl(raw: Raw, note: Callable[[str], None]) -> None:
    if "enable_nixl" in raw:
        value, source = raw.pop("enable_nixl")
        if value not in _OFF:
            raw.setdefault("enable_pd", (True, source))
            raw.setdefault("transfer_channel", ("nixl", source))
            note(f"enable_nixl ({source}) -> enable_pd true, transfer_channel nixl")
    for old, new in PD_RENAMES.items():
        if old in raw:
            raw.setdefault(new, raw[old])
            note(f"{old} ({raw[old][1]}) -> {new}")
            del raw[old]


def _remote(raw: Raw, note: Callable[[str], None]) -> None:
    if "remote_url" in raw:
        url, source = raw["remote_url"]
        if isinstance(url, str) and url.lower().startswith(("resp://", "resps://")):
            scheme, rest = url.split("://", 1)
            new = ("rediss://" if scheme.lower() == "resps" else "redis://") + rest
            raw["remote_url"] = (new, source)
            note(f"remote_url resp:// ({source}) -> {new.split('://')[0]}:// (RESP is Redis)")
        elif isinstance(url, str) and url.lower().startswith("lm://"):
            raise ConfigError(
                "remote_url",
                mask_password(url),
                f"a Redis URL (from {source}): lm:// is LMCache's own cache server, which kvtier "
                "does not speak; run `kvtier server` for one cache per host (vLLM: "
                '"server": "unix:///run/kvtier/kvtier.sock"), or redis://host:port for a '
                "store shared by a fleet",
            )
    extra = raw.get("extra_config")
    if extra is None or not isinstance(extra[0], dict):
        return
    values, source = extra
    assert isinstance(values, dict)
    user, password = values.get("username"), values.get("password")
    if user is None and password is None:
        return
    url = raw.get("remote_url", (None, ""))[0]
    if not isinstance(url, str) or not url.lower().startswith(_REDIS_SCHEMES):
        raise ConfigError(
            "extra_config.username/password",
            "<hidden>",
            "set only with a redis:// (or rediss://, redis-cluster://) remote_url: they are "
            "the Redis ACL user and password",
        )
    scheme, rest = url.split("://", 1)
    if "@" in rest:  # the URL has credentials (they end at its last @: remote_url.py)
        raise ConfigError(
            "extra_config.password",
            "<hidden>",
            "either in remote_url (user:password@host) or in extra_config, not both",
        )
    creds = quote(str(user or ""), safe="") + ":" + quote(str(password or ""), safe="") + "@"
    raw["remote_url"] = (f"{scheme}://{creds}{rest}", raw["remote_url"][1])
    note(f"extra_config.username/password ({source}) -> remote_url credentials")


def _no_cpu_tier(raw: Raw, note: Callable[[str], None]) -> None:
    size = raw.get("max_local_cpu_size")
    if size is None or _bytes(size[0]) != 0:
        return
    raw["max_local_cpu_size"] = (NO_CPU_TIER_STAGING, size[1])
    if raw.get("local_cpu", (False, ""))[0] not in _OFF:
        note(f"max_local_cpu_size 0 ({size[1]}) overrides local_cpu true")
    raw["local_cpu"] = (False, size[1])
    if "local_disk" in raw or "remote_url" in raw:
        raw.setdefault("use_only_staging_buffer", (True, size[1]))  # lookups never see CPU
    note(
        f"max_local_cpu_size 0 ({size[1]}) -> local_cpu false with a {NO_CPU_TIER_STAGING} "
        "staging buffer (no CPU cache tier)"
    )


def _bytes(value: object) -> int | None:
    try:
        return parse_size("max_local_cpu_size", value, GIB)
    except ConfigError:
        return None  # the key's own parser names the problem


def secret_extra_key(key: str) -> bool:
    """``extra_config`` keys whose values are never shown."""
    lowered = key.lower()
    return any(word in lowered for word in ("password", "token", "secret"))
