"""Every key of LMCache's config schema that kvtier does not implement under the same name.

A row's status says what a load does with the key (:mod:`kvtier.config.lmcache` applies it):

``mapped``
    read into kvtier's key(s) for the same thing, with an INFO line.
``ignored``
    accepted; one WARNING per load lists every such key given, each with why it has no effect
    (a tuning knob of LMCache's own machinery, or a setting of a feature kvtier refuses). A
    "when true" row is a switch: switched off it asks for nothing and loads silently.
``refused``
    a value that turns a missing feature on ("when true" / "when set") raises
    :class:`~kvtier.errors.ConfigError` naming the key and what kvtier offers instead; the
    same key switched off loads silently (it asks for nothing).

The keys LMCache and kvtier share (``lmcache=True`` in :mod:`kvtier.config.schema`) have no
row. Rows whose name holds a space are about a value (``remote_url (lm://)``), not a key.
The key list was read from LMCache's ``lmcache/v1/config.py`` (its definitions, aliases and
deprecated names), its v0 ``lmcache/config.py``, and the keys its own examples carry that its
schema lacks (``async_loading``); ``tests/config/test_lmcache_schema.py`` walks all of them
and docs/lmcache.md publishes this table (a test keeps them equal).
"""

from __future__ import annotations

from dataclasses import dataclass

# CPU staging buffer given to an LMCache config that says "no CPU tier" (max_local_cpu_size:
# 0): kvtier moves every load and store through CPU pages, so it keeps this much, as staging.
NO_CPU_TIER_STAGING = "1GiB"

MAPPED, IGNORED, REFUSED = "mapped", "ignored", "refused"
# The prefixes of a refused row's meaning: which values turn the feature on.
WHEN_TRUE, WHEN_SET = "when true: ", "when set: "


@dataclass(frozen=True, slots=True)
class LMCacheKey:
    """One row of the table: an LMCache key kvtier does not read under the same name."""

    name: str
    status: str  # MAPPED, IGNORED or REFUSED
    meaning: str

    @property
    def is_key(self) -> bool:
        """A key of LMCache's schema (not a row about one of its values)."""
        return " " not in self.name

    @property
    def refusal(self) -> str:
        """What a refused key's error says kvtier offers instead."""
        return self.meaning.removeprefix(WHEN_TRUE).removeprefix(WHEN_SET)


def _ignored(why: str, *names: str) -> tuple[LMCacheKey, ...]:
    return tuple(LMCacheKey(name, IGNORED, why) for name in names)


def _renamed(pairs: dict[str, str]) -> tuple[LMCacheKey, ...]:
    return tuple(LMCacheKey(old, MAPPED, new) for old, new in pairs.items())


# LMCache's old names of the PD keys (v1 aliases, and the legacy NIXL keys) -> kvtier's key.
PD_RENAMES = {
    "nixl_role": "pd_role",
    "nixl_receiver_host": "pd_peer_host",
    "nixl_receiver_port": "pd_peer_alloc_port",
    "nixl_peer_port": "pd_peer_alloc_port",
    "nixl_buffer_size": "pd_buffer_size",
    "nixl_buffer_device": "pd_buffer_device",
    "nixl_peer_host": "pd_peer_host",
    "nixl_peer_alloc_port": "pd_peer_alloc_port",
}

_TUNING = "a tuning knob of LMCache's own machinery, with no counterpart in kvtier"
_BLEND = "a CacheBlend setting, read only with enable_blending (refused)"
_P2P = "a P2P setting, read only with enable_p2p (refused)"
_CONTROLLER = "a controller setting, read only with enable_controller (refused)"
_GDS = "a GPUDirect Storage setting, read only with gds_path (refused)"
_HIDDEN = "a hidden-state cache setting, read only with enable_hidden_state_cache (refused)"
_LOOKUP = "kvtier's scheduler side looks its tiers up itself (no lookup server)"
_STATS = "kvtier counts always: the admin API's /stats and the vLLM metrics"
_PLUGINS = (
    "kvtier has no plugins: its tiers are CPU, local_disk and remote_url (a new tier is a "
    "URL scheme registered in kvtier.storage.registry)"
)

LMCACHE_KEYS: tuple[LMCacheKey, ...] = (
    LMCacheKey(
        "local_device",
        MAPPED,
        'legacy tier setting: "cpu" is local_cpu true; "file://DIR" is local_disk DIR; '
        '"cuda" is refused (a GPU-memory tier: kvtier\'s tiers are CPU, disk, Redis)',
    ),
    LMCacheKey(
        "max_local_cache_size",
        MAPPED,
        "legacy size (GB) of local_device: max_local_disk_size for a file:// device, "
        "else max_local_cpu_size",
    ),
    LMCacheKey(
        "remote_url (resp://, resps://)",
        MAPPED,
        "RESP is the Redis protocol: redis://host:port (rediss:// for resps://)",
    ),
    LMCacheKey(
        "remote_url (lm://)",
        REFUSED,
        "LMCache's own cache server: run `kvtier server` (one cache per host) or give a "
        "redis:// URL (a store shared by a fleet)",
    ),
    LMCacheKey(
        "remote_url (mooncakestore://, infinistore://, fs://, ...)",
        REFUSED,
        "remote backends kvtier has no client for: use redis://, rediss://, "
        "redis-cluster://, valkey:// or s3://",
    ),
    LMCacheKey(
        "remote_url (s3://)",
        MAPPED,
        "the s3 tier: s3://BUCKET.s3.REGION.amazonaws.com and s3://HOST:PORT/BUCKET as LMCache "
        "writes them, or kvtier's s3://BUCKET/PREFIX (docs/s3.md)",
    ),
    LMCacheKey(
        "extra_config.s3_region, extra_config.s3_num_io_threads, extra_config.disable_tls, "
        "extra_config.aws_access_key_id, extra_config.aws_secret_access_key",
        MAPPED,
        "the s3 tier's signing region, its GET and PUT threads, http:// for a HOST:PORT URL, "
        "and its credentials (the secret masked by check-config, /config and logs); "
        "s3_prefer_http2, s3_enable_s3express and save_chunk_meta have no effect",
    ),
    LMCacheKey(
        "max_local_cpu_size: 0",
        MAPPED,
        f"no CPU cache tier: local_cpu false, with a {NO_CPU_TIER_STAGING} CPU staging buffer "
        "(kvtier moves every load and store through CPU pages)",
    ),
    LMCacheKey(
        "extra_config.username, extra_config.password",
        MAPPED,
        "Redis ACL user and password: used for remote_url when the URL has none; masked by "
        "check-config, /config and logs",
    ),
    LMCacheKey("enable_nixl", MAPPED, "legacy PD switch: enable_pd true, transfer_channel nixl"),
    *_renamed(PD_RENAMES),
    LMCacheKey(
        "enable_xpyd",
        MAPPED,
        "enable_pd (LMCache's alias); a prefiller with no pd_peer_alloc_port serves any decoder "
        "behind the router, which pulls from it (docs/pd.md, xPyD)",
    ),
    LMCacheKey(
        "remote_serde",
        MAPPED,
        '"naive" is remote_codec identity, "fp8" is remote_codec fp8 (kvtier\'s e4m3 codec, '
        'lossy: docs/codecs.md); "cachegen" is refused: kvtier offers remote_codec lossless, '
        "fp8 or int8",
    ),
    # use_layerwise is a shared key (kvtier.config.schema): layer-by-layer loads and saves.
    *_ignored(
        "kvtier always loads disk and Redis hits in the background (async_lower_loads in the "
        "vLLM connector)",
        "enable_async_loading",
    ),
    *_ignored(
        "not in LMCache's schema either (LMCache warns and drops it; its resp.yaml example "
        "sets it): kvtier always loads disk and Redis hits in the background",
        "async_loading",
    ),
    *_ignored(
        "LMCache's legacy (v0) pipelining switch; kvtier has one load path", "pipelined_backend"
    ),
    *_ignored(
        "kvtier loads every hit, however short",
        "min_retrieve_tokens",
    ),
    # Memory and process tuning.
    *_ignored(
        _TUNING,
        "local_cpu_use_hugepages",
        "reserve_local_cpu_size",
        "nixl_enable_gc",
        "py_enable_gc",
        "numa_mode",
        "enable_lazy_memory_allocator",
        "lazy_memory_initial_ratio",
        "lazy_memory_expand_trigger_ratio",
        "lazy_memory_step_ratio",
        "lazy_memory_safe_size",
        "use_gpu_connector_v3",
        "lookup_timeout_ms",
    ),
    *_ignored("kvtier keeps one directory per tier", "local_disk_path_sharding"),
    *_ignored(
        "pins end with the request (leases), never by time",
        "pin_timeout_sec",
        "pin_check_interval_sec",
    ),
    *_ignored("kvtier caches every request, whatever its priority", "priority_limit"),
    *_ignored(
        "kvtier stores to every tier it has and reads the fastest holding a chunk; choose tiers "
        "with local_cpu, local_disk and remote_url",
        "retrieve_locations",
        "store_location",
    ),
    *_ignored("kvtier treats a failing tier as a miss and logs it, always", "error_handling"),
    *_ignored(
        "LMCache's audit wrapper; kvtier checks every record it reads against its checksums",
        "audit_actual_remote_url",
    ),
    # Naming, lookup and statistics.
    *_ignored("kvtier names instances by vLLM's engine_id", "lmcache_instance_id"),
    *_ignored(
        _LOOKUP, "lookup_server_worker_ids", "enable_scheduler_bypass_lookup", "hit_miss_ratio"
    ),
    *_ignored(
        _STATS,
        "enable_chunk_statistics",
        "chunk_statistics_auto_start_statistics",
        "chunk_statistics_auto_exit_timeout_hours",
        "chunk_statistics_auto_exit_target_unique_chunks",
        "chunk_statistics_strategy",
    ),
    *_ignored(
        "kvtier publishes KV events when vLLM's kv_events_config enables them",
        "enable_kv_events",
    ),
    *_ignored(
        "kvtier serves one admin API per process, on internal_api_server_port_start",
        "internal_api_server_include_index_list",
    ),
    *_ignored("kvtier runs no scripts", "script_allowed_imports"),
    *_ignored("sent only to remote_config_url (refused)", "app_id"),
    *_ignored(
        "overrides for LMCache's encoder-cache engine, which kvtier does not run (nor do "
        "ec_<key> keys)",
        "ec",
    ),
    # PD: kvtier's one PD mode; its timeouts are pd_* keys of its own.
    *_ignored("kvtier has one PD mode", "pd_backend_mode"),
    *_ignored("kvtier's NIXL channel uses UCX", "nixl_backends"),
    *_ignored(
        "kvtier notifies no proxy: the proxy reads kv_transfer_params from the prefiller",
        "pd_skip_proxy_notification",
    ),
    *_ignored(
        "kvtier's PD receiver answers on pd_peer_alloc_port alone",
        "pd_peer_query_port",
        "pd_peer_init_port",
        "nixl_peer_init_port",
    ),
    *_ignored(
        "kvtier notifies no proxy: vllm-router (`kvtier pd-proxy`) reads kv_transfer_params "
        "from the prefiller's answer",
        "pd_proxy_host",
        "pd_proxy_port",
        "nixl_proxy_host",
        "nixl_proxy_port",
    ),
    *_ignored(
        "kvtier's PD waits on events, with pd_message_timeout_sec and pd_idle_timeout_sec",
        "pd_shutdown_timeout_sec",
        "pd_condition_poll_interval_sec",
    ),
    *_ignored(
        "a start-up check; kvtier sizes by pd_buffer_size and fails a request that finds no "
        "room within pd_allocation_timeout_sec",
        "pd_max_prefill_len",
    ),
    LMCacheKey(
        "pd_bidirectional",
        REFUSED,
        f"{WHEN_TRUE}kvtier's PD moves KV one way, from pd_role sender to receiver",
    ),
    # Features kvtier lacks: the switch is refused, its settings have no effect without it.
    LMCacheKey(
        "enable_blending",
        REFUSED,
        f"{WHEN_TRUE}CacheBlend (non-prefix reuse) is not implemented; kvtier reuses prefixes",
    ),
    *_ignored(
        _BLEND,
        "blend_recompute_ratio",
        "blend_recompute_ratios",
        "blend_thresholds",
        "blend_check_layers",
        "blend_min_tokens",
        "blend_special_str",
        "blend_separator",
        "blend_add_special_in_precomp",
    ),
    LMCacheKey(
        "enable_p2p",
        REFUSED,
        f"{WHEN_TRUE}LMCache's peer-to-peer (a controller, lookup ports per instance) is not "
        "kvtier's: kvtier servers share their CPU tiers with p2p_listen and p2p_peers "
        "(docs/fleet.md), or share a cache through Redis or S3",
    ),
    *_ignored(
        _P2P, "p2p_host", "p2p_init_ports", "p2p_lookup_ports", "lookup_url", "distributed_url"
    ),
    LMCacheKey(
        "enable_controller",
        REFUSED,
        f"{WHEN_TRUE}LMCache's controller is not "
        "implemented; kvtier's admin API (internal_api_server_enabled) serves stats, "
        "explain and clear",
    ),
    *_ignored(
        _CONTROLLER,
        "controller_url",
        "controller_pull_url",
        "controller_reply_url",
        "lmcache_worker_port",
        "lmcache_worker_ports",
        "lmcache_worker_ids",
        "lmcache_worker_heartbeat_delay_time",
        "lmcache_worker_heartbeat_time",
    ),
    LMCacheKey(
        "gds_path", REFUSED, f"{WHEN_SET}GPUDirect Storage is not implemented; use local_disk"
    ),
    *_ignored(
        _GDS, "gds_path_sharding", "gds_buffer_size", "cufile_buffer_size", "use_gds", "gds_backend"
    ),
    LMCacheKey("weka_path", REFUSED, f"{WHEN_SET}use local_disk on the WEKA mount"),
    LMCacheKey(
        "maru_path",
        REFUSED,
        f"{WHEN_SET}the CXL shared-memory (Maru) backend is not implemented; share a host's "
        "cache with `kvtier server`",
    ),
    *_ignored("a Maru setting, read only with maru_path (refused)", "maru_pool_size"),
    LMCacheKey(
        "mp_host",
        REFUSED,
        f"{WHEN_SET}LMCache's multi-process server is not implemented; kvtier's shared cache "
        "per host is `kvtier server` (server_socket)",
    ),
    *_ignored("the port of mp_host's server, read only with mp_host (refused)", "mp_port"),
    LMCacheKey(
        "enable_hidden_state_cache",
        REFUSED,
        f"{WHEN_TRUE}hidden-state caching (vLLM-Omni) is not implemented; kvtier caches KV",
    ),
    *_ignored(
        _HIDDEN, "max_hidden_state_cpu_size", "hidden_state_layers", "hidden_states_retrieve_mode"
    ),
    LMCacheKey(
        "external_lookup_client",
        REFUSED,
        f"{WHEN_SET}an external lookup service is not implemented; {_LOOKUP}",
    ),
    LMCacheKey(
        "remote_config_url",
        REFUSED,
        f"{WHEN_SET}kvtier fetches no config: it reads a file, KVTIER_* / LMCACHE_* variables "
        "and vLLM's kv_connector_extra_config",
    ),
    LMCacheKey(
        "internal_api_server_socket_path_prefix",
        REFUSED,
        f"{WHEN_SET}kvtier's admin API listens on TCP (internal_api_server_host and _port_start, "
        "with admin_token), never on a Unix socket",
    ),
    *(
        LMCacheKey(name, REFUSED, f"{WHEN_SET}{_PLUGINS}")
        for name in (
            "external_backends",
            "storage_plugins",
            "remote_storage_plugins",
            "plugin_locations",
            "runtime_plugin_locations",
        )
    ),
)

BY_NAME = {row.name: row for row in LMCACHE_KEYS if row.is_key}
# A key of the form ec_<LMCache key> overrides that key for LMCache's encoder-cache engine.
ENCODER_CACHE_PREFIX = "ec_"
