"""LMCache config keys that kvtier reads under another name, ignores, or refuses.

kvtier's own keys follow LMCache's names (:mod:`kvtier.config.schema`, ``lmcache=True``);
this module covers the rest of an LMCache config so that LMCache's files load unchanged or
are refused for a feature kvtier lacks, named. :func:`translate` runs on the raw values of
every source (file, environment, overrides) before they are parsed:

``mapped``
    the value is rewritten into kvtier's key(s): ``local_device: "file://..."`` is the disk
    tier, ``remote_url: "resp://h:p"`` is Redis, ``max_local_cpu_size: 0`` is no CPU tier,
    ``extra_config.username`` / ``password`` are the Redis ACL user (put into the URL,
    masked wherever the config is shown), the legacy ``nixl_*`` keys are PD keys.
``ignored``
    accepted with an INFO line: a tuning knob or a switch left off, with nothing to change
    in what kvtier stores or serves.
``refused``
    a value that turns on a feature kvtier lacks raises :class:`ConfigError` naming the key,
    the value and what kvtier offers instead.

:data:`LMCACHE_KEYS` is the table docs/lmcache.md publishes (a test keeps them equal).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from difflib import get_close_matches
from urllib.parse import quote

from kvtier.config.remote_url import mask_password
from kvtier.config.schema import KEYS_BY_NAME
from kvtier.config.sizes import GIB, parse_size
from kvtier.errors import ConfigError

# CPU staging buffer given to an LMCache config that says "no CPU tier" (max_local_cpu_size:
# 0): kvtier moves every load and store through CPU pages, so it keeps this much, as staging.
NO_CPU_TIER_STAGING = "1GiB"

_OFF = (None, False, 0, "", "false", "False")

# LMCache's size (GB) of a local_device read from a config file without max_local_cache_size.
LEGACY_DEVICE_GB = 20


@dataclass(frozen=True, slots=True)
class LMCacheKey:
    """One row of the table: an LMCache key kvtier does not read under the same name."""

    name: str
    status: str  # mapped, ignored or refused (refused: when it turns a feature on)
    meaning: str


LMCACHE_KEYS: tuple[LMCacheKey, ...] = (
    LMCacheKey(
        "local_device",
        "mapped",
        'legacy tier setting: "cpu" is local_cpu true; "file://DIR" is local_disk DIR; '
        '"cuda" is refused (a GPU-memory tier: kvtier\'s tiers are CPU, disk, Redis)',
    ),
    LMCacheKey(
        "max_local_cache_size",
        "mapped",
        "legacy size (GB) of local_device: max_local_disk_size for a file:// device, "
        "else max_local_cpu_size",
    ),
    LMCacheKey(
        "remote_url (resp://, resps://)",
        "mapped",
        "RESP is the Redis protocol: redis://host:port (rediss:// for resps://)",
    ),
    LMCacheKey(
        "remote_url (lm://)",
        "refused",
        "LMCache's own cache server: run `kvtier server` (one cache per host) or give a "
        "redis:// URL (a store shared by a fleet)",
    ),
    LMCacheKey(
        "remote_url (mooncakestore://, infinistore://, s3://, fs://, ...)",
        "refused",
        "remote backends kvtier has no client for: use redis://, rediss://, "
        "redis-cluster:// or valkey://",
    ),
    LMCacheKey(
        "max_local_cpu_size: 0",
        "mapped",
        f"no CPU cache tier: local_cpu false, with a {NO_CPU_TIER_STAGING} CPU staging buffer "
        "(kvtier moves every load and store through CPU pages)",
    ),
    LMCacheKey(
        "extra_config.username, extra_config.password",
        "mapped",
        "Redis ACL user and password: used for remote_url when the URL has none; masked by "
        "check-config, /config and logs",
    ),
    LMCacheKey("enable_nixl", "mapped", "legacy PD switch: enable_pd true, transfer_channel nixl"),
    LMCacheKey("nixl_role", "mapped", "pd_role (sender / receiver)"),
    LMCacheKey("nixl_receiver_host", "mapped", "pd_peer_host"),
    LMCacheKey("nixl_receiver_port", "mapped", "pd_peer_alloc_port"),
    LMCacheKey("nixl_buffer_size", "mapped", "pd_buffer_size (bytes)"),
    LMCacheKey("nixl_buffer_device", "mapped", "pd_buffer_device"),
    LMCacheKey(
        "remote_serde",
        "mapped",
        '"naive" is remote_codec identity, "fp8" is remote_codec fp8 (kvtier\'s e4m3 codec, '
        'lossy: docs/codecs.md); "cachegen" is refused: kvtier offers remote_codec lossless, '
        "fp8 or int8",
    ),
    LMCacheKey(
        "use_layerwise",
        "refused",
        "when true: layer-by-layer loading is not implemented; kvtier loads whole chunks "
        "before the forward (disk and Redis hits in the background): set it false",
    ),
    LMCacheKey(
        "enable_async_loading",
        "ignored",
        "kvtier always loads disk and Redis hits in "
        "the background (async_lower_loads in the vLLM connector)",
    ),
    LMCacheKey("pipelined_backend", "ignored", "legacy tuning knob"),
    LMCacheKey("local_cpu_use_hugepages", "ignored", "tuning knob"),
    LMCacheKey("reserve_local_cpu_size", "ignored", "tuning knob"),
    LMCacheKey("local_disk_path_sharding", "ignored", "kvtier keeps one directory per tier"),
    LMCacheKey("nixl_backends", "ignored", "kvtier's NIXL channel uses UCX"),
    LMCacheKey("nixl_enable_gc", "ignored", "tuning knob"),
    LMCacheKey("py_enable_gc", "ignored", "tuning knob"),
    LMCacheKey("numa_mode", "ignored", "tuning knob"),
    LMCacheKey("lmcache_instance_id", "ignored", "kvtier names instances by vLLM's engine_id"),
    LMCacheKey("pd_backend_mode", "ignored", "kvtier has one PD mode"),
    LMCacheKey("pin_timeout_sec", "ignored", "pins end with the request (leases), never by time"),
    LMCacheKey("pin_check_interval_sec", "ignored", "as pin_timeout_sec"),
    LMCacheKey(
        "enable_blending",
        "refused",
        "when true: CacheBlend (non-prefix reuse) is not implemented; kvtier reuses prefixes",
    ),
    LMCacheKey(
        "enable_p2p",
        "refused",
        "when true: peer-to-peer lookup is not implemented; "
        "share a cache through Redis or kvtier server",
    ),
    LMCacheKey(
        "enable_controller",
        "refused",
        "when true: LMCache's controller is not "
        "implemented; kvtier's admin API (internal_api_server_enabled) serves stats, "
        "explain and clear",
    ),
    LMCacheKey(
        "enable_xpyd",
        "mapped",
        "enable_pd (LMCache's alias); a prefiller with no pd_peer_alloc_port serves any decoder "
        "behind the router, which pulls from it (docs/pd.md, xPyD)",
    ),
    LMCacheKey("external_backends", "refused", "when set: kvtier has no storage plugins"),
    LMCacheKey(
        "gds_path", "refused", "when set: GPUDirect Storage is not implemented; use local_disk"
    ),
    LMCacheKey("weka_path", "refused", "when set: use local_disk on the WEKA mount"),
)

_REFUSED_WHEN_ON = {
    row.name: row.meaning.removeprefix("when true: ").removeprefix("when set: ")
    for row in LMCACHE_KEYS
    if row.status == "refused" and " " not in row.name
}
_IGNORED = {row.name for row in LMCACHE_KEYS if row.status == "ignored"}
_SERDES = {"naive": "identity", "fp8": "fp8"}  # LMCache's remote_serde -> remote_codec
_NIXL = {
    "nixl_role": "pd_role",
    "nixl_receiver_host": "pd_peer_host",
    "nixl_receiver_port": "pd_peer_alloc_port",
    "nixl_buffer_size": "pd_buffer_size",
    "nixl_buffer_device": "pd_buffer_device",
}
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
    known = [*KEYS_BY_NAME, *(row.name for row in LMCACHE_KEYS if " " not in row.name)]
    matches = get_close_matches(name, known, n=1, cutoff=0.8)
    return matches[0] if matches else None


# raw: key -> (value, source). Every function here edits it in place.
Raw = dict[str, tuple[object, str]]


def translate(raw: Raw, note: Callable[[str], None]) -> None:
    """Rewrite LMCache-only keys of ``raw`` into kvtier's, ``note`` each rewrite and each
    ignored key (one line each), raise :class:`ConfigError` for a refused one."""
    for key in list(raw):
        value, source = raw[key]
        if key in _REFUSED_WHEN_ON:
            if value not in _OFF and value != []:
                raise ConfigError(key, value, f"{_REFUSED_WHEN_ON[key]} (from {source})")
            del raw[key]
        elif key in _IGNORED:
            note(f"{key} ({source}) has no effect in kvtier")
            del raw[key]
    _serde(raw, note)
    _legacy_device(raw, note)
    _xpyd(raw, note)
    _nixl(raw, note)
    _remote(raw, note)
    _no_cpu_tier(raw, note)


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
    for old, new in _NIXL.items():
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
