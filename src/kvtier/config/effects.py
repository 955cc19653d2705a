"""Keys a config sets that load but change nothing, given the other keys it sets.

A value that parses is not a value that acts: ``pd_buffer_size`` without ``enable_pd``,
``max_local_disk_size`` without ``local_disk``. Each rule below names the key the value
waits on; ``kvtier check-config`` marks every key that breaks one. Only keys given
explicitly (a file, the environment, an override) are reported: a default asks for nothing.
LMCache keys kvtier ignores whatever the config (``pd_proxy_host``, ``async_loading``...) are
dropped at load with their own WARNING (:mod:`kvtier.config.lmcache_keys`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvtier.config.model import Config

# Every PD key but enable_pd itself: read only when enable_pd is true.
_PD_KEYS = (
    "pd_role",
    "pd_buffer_size",
    "pd_buffer_device",
    "pd_peer_host",
    "pd_peer_alloc_port",
    "pd_serve_host",
    "pd_serve_port",
    "pd_allocation_timeout_sec",
    "pd_auth_token",
    "pd_reservation_ttl_sec",
    "pd_max_connections",
    "pd_idle_timeout_sec",
    "pd_message_timeout_sec",
    "transfer_channel",
)
_ADMIN_KEYS = ("internal_api_server_host", "internal_api_server_port_start", "admin_token")


@dataclass(frozen=True, slots=True)
class _Rule:
    keys: tuple[str, ...]
    idle: Callable[[Config], bool]  # true when these keys do nothing in this config
    why: str


# LMCache's PD configs say pd_buffer_device: cuda; the receiver accepts it (PDBuffer says so
# in one WARNING) and check-config shows the same words on the key's row.
HOST_RECEIVE_BUFFER = (
    "accepted as host memory: kvtier's PD receive buffer is host pages, so received KV lands "
    "in host memory and each load copies it host-to-device (as a CPU-tier hit does)"
)


def _pushing_sender(c: Config) -> bool:
    return c.pd_role == "sender" and bool(c.pd_peer_alloc_port)


_RULES: tuple[_Rule, ...] = (
    _Rule(_PD_KEYS, lambda c: not c.enable_pd, "read only with enable_pd: true"),
    _Rule(
        ("use_only_staging_buffer",),
        lambda c: c.local_cpu,
        "read only with local_cpu: false (the tier-role table)",
    ),
    _Rule(("max_local_disk_size", "disk_codec"), lambda c: not c.local_disk, "no local_disk"),
    _Rule(("remote_codec",), lambda c: not c.remote_url, "no remote_url"),
    _Rule(
        ("cpu_codec_staging",), lambda c: c.cpu_codec == "identity", "read only with a cpu_codec"
    ),
    _Rule(
        ("pd_buffer_device",),
        lambda c: c.enable_pd and c.pd_role == "sender",
        "a PD sender keeps no receive buffer (pd_buffer_device is the receiver's)",
    ),
    _Rule(
        ("pd_buffer_device",),
        lambda c: c.enable_pd and c.pd_role == "receiver" and c.pd_buffer_device == "cuda",
        HOST_RECEIVE_BUFFER,
    ),
    _Rule(
        ("pd_serve_host", "pd_serve_port"),
        lambda c: c.enable_pd and c.pd_role != "sender",
        "read only by a PD sender (pd_role: sender)",
    ),
    _Rule(
        ("pd_serve_host", "pd_serve_port"),
        lambda c: c.enable_pd and _pushing_sender(c),
        "this sender pushes to pd_peer_alloc_port; decoders pull only from a sender without it",
    ),
    _Rule(
        _ADMIN_KEYS,
        lambda c: not c.internal_api_server_enabled,
        "read only with internal_api_server_enabled: true",
    ),
)


def keys_with_no_effect(config: Config) -> dict[str, str]:
    """Key -> why it does nothing, for each key ``config`` was given that no code will act on
    (the first rule that applies to a key names why)."""
    found: dict[str, str] = {}
    for rule in _RULES:
        if not rule.idle(config):
            continue
        for key in rule.keys:
            if key in config.origin and key not in found:
                found[key] = rule.why
    return found
