"""Every key of LMCache's config schema loads as classified: kvtier's own key, mapped, accepted
with one WARNING saying why it has no effect, or refused naming what kvtier offers instead.

``LMCACHE_SCHEMA`` is the key list of LMCache's ``lmcache/v1/config.py`` (definitions,
aliases, deprecated names), the v0 and older v1 keys kvtier already read, and the one key
LMCache's own examples carry without its schema having it (``async_loading``, in
``examples/kv_cache_reuse/remote_backends/resp/resp.yaml``). Written out here, apart from the
table it checks, so that a key dropped from the table fails.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvtier.config import Config
from kvtier.config.lmcache_keys import BY_NAME, IGNORED, MAPPED, REFUSED, WHEN_TRUE
from kvtier.config.schema import KEYS_BY_NAME
from kvtier.config.sizes import GIB
from kvtier.errors import ConfigError

# One line per group of LMCache's schema, as it lists them.
_SCHEMA_TEXT = """
chunk_size local_cpu max_local_cpu_size local_cpu_use_hugepages reserve_local_cpu_size
local_disk local_disk_path_sharding max_local_disk_size remote_url remote_serde
use_layerwise save_decode_cache pre_caching_hash_algorithm
enable_blending blend_recompute_ratios blend_thresholds blend_check_layers blend_min_tokens
blend_special_str retrieve_locations store_location
enable_p2p p2p_host p2p_init_ports p2p_lookup_ports mp_host mp_port
enable_controller lmcache_instance_id controller_pull_url controller_reply_url
lmcache_worker_ports lmcache_worker_ids lmcache_worker_heartbeat_delay_time
lmcache_worker_heartbeat_time
enable_pd pd_role pd_buffer_size pd_buffer_device pd_peer_host pd_peer_init_port
pd_peer_alloc_port pd_peer_query_port pd_proxy_host pd_proxy_port pd_allocation_timeout_sec
pd_shutdown_timeout_sec pd_condition_poll_interval_sec pd_max_prefill_len pd_backend_mode
pd_skip_proxy_notification pd_bidirectional transfer_channel
nixl_backends nixl_buffer_size nixl_buffer_device
gds_path gds_path_sharding gds_buffer_size maru_path maru_pool_size use_gds gds_backend
audit_actual_remote_url internal_api_server_host extra_config save_unfull_chunk
blocking_timeout_secs external_lookup_client py_enable_gc cache_policy numa_mode
enable_async_loading internal_api_server_enabled internal_api_server_port_start priority_limit
internal_api_server_include_index_list internal_api_server_socket_path_prefix
runtime_plugin_locations storage_plugins remote_storage_plugins
lookup_timeout_ms min_retrieve_tokens hit_miss_ratio lookup_server_worker_ids
enable_scheduler_bypass_lookup script_allowed_imports
enable_lazy_memory_allocator lazy_memory_initial_ratio lazy_memory_expand_trigger_ratio
lazy_memory_step_ratio lazy_memory_safe_size
enable_chunk_statistics chunk_statistics_auto_start_statistics
chunk_statistics_auto_exit_timeout_hours chunk_statistics_auto_exit_target_unique_chunks
chunk_statistics_strategy enable_kv_events use_gpu_connector_v3 pin_timeout_sec
pin_check_interval_sec remote_config_url app_id enable_hidden_state_cache
max_hidden_state_cpu_size hidden_state_layers hidden_states_retrieve_mode ec
enable_xpyd nixl_peer_host nixl_peer_init_port nixl_peer_alloc_port nixl_proxy_host
nixl_proxy_port nixl_role controller_url lmcache_worker_port plugin_locations
external_backends nixl_peer_port
local_device max_local_cache_size pipelined_backend blend_recompute_ratio blend_separator
blend_add_special_in_precomp enable_nixl nixl_receiver_host nixl_receiver_port nixl_enable_gc
weka_path cufile_buffer_size lookup_url distributed_url error_handling
async_loading
"""
LMCACHE_SCHEMA = _SCHEMA_TEXT.split()

# A mapped key, a config that gives it, and what kvtier then holds.
PD = {"pd_buffer_size": 1 << 20, "pd_buffer_device": "cpu", "pd_peer_host": "decoder"}
MAPPED_SAMPLES: dict[str, tuple[dict[str, object], dict[str, object]]] = {
    "local_device": ({"local_device": "file://d/"}, {"local_disk": "file://d/"}),
    "max_local_cache_size": ({"max_local_cache_size": 3}, {"max_local_cpu_size": 3 * GIB}),
    "remote_serde": (
        {"remote_serde": "fp8", "remote_url": "redis://h:1"},
        {"remote_codec": "fp8"},
    ),
    "enable_nixl": (
        {"enable_nixl": True, "pd_role": "receiver", "pd_peer_alloc_port": 7400, **PD},
        {"enable_pd": True, "transfer_channel": "nixl"},
    ),
    "enable_xpyd": ({"enable_xpyd": True, "pd_role": "sender", **PD}, {"enable_pd": True}),
    "nixl_role": ({"nixl_role": "receiver"}, {"pd_role": "receiver"}),
    "nixl_receiver_host": ({"nixl_receiver_host": "h"}, {"pd_peer_host": "h"}),
    "nixl_receiver_port": ({"nixl_receiver_port": 7400}, {"pd_peer_alloc_port": (7400,)}),
    "nixl_peer_port": ({"nixl_peer_port": 7400}, {"pd_peer_alloc_port": (7400,)}),
    "nixl_buffer_size": ({"nixl_buffer_size": 1 << 20}, {"pd_buffer_size": 1 << 20}),
    "nixl_buffer_device": ({"nixl_buffer_device": "cpu"}, {"pd_buffer_device": "cpu"}),
    "nixl_peer_host": ({"nixl_peer_host": "h"}, {"pd_peer_host": "h"}),
    "nixl_peer_alloc_port": ({"nixl_peer_alloc_port": 7400}, {"pd_peer_alloc_port": (7400,)}),
}


def load(overrides: dict[str, object]) -> Config:
    return Config.load(env={}, overrides=overrides, overrides_from="test")


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_every_lmcache_key_is_kvtiers_or_classified_and_no_row_is_invented() -> None:
    shared = {name for name, spec in KEYS_BY_NAME.items() if spec.lmcache}
    unclassified = [key for key in LMCACHE_SCHEMA if key not in shared and key not in BY_NAME]
    assert unclassified == []
    assert not shared & set(BY_NAME)  # one place says what a key does
    assert sorted(set(BY_NAME) - set(LMCACHE_SCHEMA)) == []
    assert {row.status for row in BY_NAME.values()} == {MAPPED, IGNORED, REFUSED}


@pytest.mark.parametrize(
    "key", sorted(k for k in LMCACHE_SCHEMA if k in KEYS_BY_NAME and KEYS_BY_NAME[k].lmcache)
)
def test_a_key_kvtier_shares_loads_under_its_name(key: str) -> None:
    spec = KEYS_BY_NAME[key]
    config = load({key: spec.default})
    assert config.origin[key] == "test"


@pytest.mark.parametrize("key", sorted(k for k, row in BY_NAME.items() if row.status == MAPPED))
def test_a_mapped_key_sets_kvtiers_key(key: str, caplog: pytest.LogCaptureFixture) -> None:
    given, expected = MAPPED_SAMPLES[key]
    with caplog.at_level(logging.INFO, logger="kvtier.config"):
        config = load(given)
    assert {name: getattr(config, name) for name in expected} == expected
    assert any(key in r.getMessage() for r in caplog.records)  # the rewrite is said
    assert warnings(caplog) == []


@pytest.mark.parametrize("key", sorted(k for k, row in BY_NAME.items() if row.status == IGNORED))
def test_an_ignored_key_loads_with_one_warning_saying_why(
    key: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvtier.config"):
        config = load({key: True, "chunk_size": 64})
    assert config.chunk_size == 64
    (line,) = warnings(caplog)
    assert f"{key} (test: {BY_NAME[key].meaning})" in line and "no effect in kvtier" in line


@pytest.mark.parametrize("key", sorted(k for k, row in BY_NAME.items() if row.status == REFUSED))
def test_a_refused_key_names_itself_and_what_kvtier_offers_and_loads_switched_off(
    key: str, caplog: pytest.LogCaptureFixture
) -> None:
    row = BY_NAME[key]
    on: object = True if row.meaning.startswith(WHEN_TRUE) else "something"
    with pytest.raises(ConfigError) as info:
        load({key: on})
    assert info.value.key == key and row.refusal in str(info.value)
    with caplog.at_level(logging.INFO, logger="kvtier.config"):
        load({key: False if on is True else None})
    assert warnings(caplog) == []


def test_all_ignored_keys_at_once_are_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    ignored = sorted(k for k, row in BY_NAME.items() if row.status == IGNORED)
    with caplog.at_level(logging.INFO, logger="kvtier.config"):
        load(dict.fromkeys(ignored, 1))
    (line,) = warnings(caplog)
    assert all(f"{key} (test: " in line for key in ignored)


def test_lmcaches_resp_example_loads(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The keys and values of LMCache's resp.yaml (its password replaced)."""
    path = tmp_path / "resp.yaml"
    path.write_text(
        "chunk_size: 256\nlocal_cpu: false\nmax_local_cpu_size: 20.0\n"
        'remote_url: "resp://localhost:6379"\nasync_loading: false\nremote_serde: "naive"\n'
        "blocking_timeout_secs: 120\nextra_config:\n  resp_num_threads: 8\n"
        '  save_chunk_meta: False\n  username: "default"\n  password: "not-a-real-one"\n'
    )
    with caplog.at_level(logging.INFO, logger="kvtier.config"):
        config = Config.load(env={"LMCACHE_CONFIG_FILE": str(path)})
    assert config.remote_url == "redis://default:not-a-real-one@localhost:6379"
    assert config.remote_codec == "identity" and config.blocking_timeout_secs == 120
    assert not config.local_cpu and config.max_local_cpu_size == 20 * GIB
    (line,) = warnings(caplog)
    assert "async_loading" in line and "not-a-real-one" not in line


def test_encoder_cache_overrides_are_ignored_and_other_ec_keys_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="kvtier.config"):
        load({"ec_max_local_cpu_size": 1, "ec_pin_timeout_sec": 3, "ec": {"chunk_size": 8}})
    (line,) = warnings(caplog)
    assert all(key in line for key in ("ec_max_local_cpu_size", "ec_pin_timeout_sec", "ec ("))
    with pytest.raises(ConfigError, match="no such key"):
        load({"ec_no_such_thing": 1})


def test_a_key_in_neither_schema_is_refused_naming_the_nearest() -> None:
    with pytest.raises(ConfigError, match="did you mean 'pin_timeout_sec'"):
        load({"pin_timout_sec": 3})
    with pytest.raises(ConfigError, match="did you mean 'enable_async_loading'"):
        load({"enable_asyn_loading": True})
    with pytest.raises(ConfigError, match="no kvtier or LMCache key is near it"):
        load({"completely_unrelated": 1})
