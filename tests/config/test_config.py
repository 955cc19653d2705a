from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvtier import Config, ConfigError
from kvtier.config.schema import KEYS


def test_defaults_follow_lmcache() -> None:
    cfg = Config.default()
    assert cfg.chunk_size == 256
    assert cfg.local_cpu is True
    assert cfg.max_local_cpu_size == 5 * 1024**3
    assert cfg.save_unfull_chunk is False
    assert cfg.cache_policy == "REUSE"
    assert cfg.blocking_timeout_secs == 10.0


def test_every_schema_key_is_a_config_field_with_the_same_default() -> None:
    fields = Config.__dataclass_fields__
    default = Config.default()
    for spec in KEYS:
        assert spec.name in fields, spec.name
        assert getattr(default, spec.name) == spec.parse(spec.name, spec.default)


def test_sources_apply_in_order_file_env_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("chunk_size: 128\nmax_local_cpu_size: 2\nsave_unfull_chunk: true\n")
    env = {
        "KVTIER_CONFIG_FILE": str(path),
        "LMCACHE_CHUNK_SIZE": "64",
        "KVTIER_MAX_LOCAL_CPU_SIZE": "512MiB",
    }
    cfg = Config.load(env=env, overrides={"save_unfull_chunk": False})
    assert cfg.chunk_size == 64
    assert cfg.max_local_cpu_size == 512 * 1024**2
    assert cfg.save_unfull_chunk is False
    assert cfg.origin["chunk_size"] == "env LMCACHE_CHUNK_SIZE"
    assert cfg.origin["save_unfull_chunk"] == "override"


def test_kvtier_env_wins_over_lmcache_env() -> None:
    cfg = Config.load(env={"LMCACHE_CHUNK_SIZE": "64", "KVTIER_CHUNK_SIZE": "32"})
    assert cfg.chunk_size == 32


def test_lmcache_config_file_is_read_when_no_kvtier_file(tmp_path: Path) -> None:
    path = tmp_path / "lmcache.yaml"
    path.write_text("chunk_size: 512\nlocal_cpu: false\nmax_local_cpu_size: 0.5\n")
    cfg = Config.load(env={"LMCACHE_CONFIG_FILE": str(path)})
    assert (cfg.chunk_size, cfg.local_cpu, cfg.max_local_cpu_size) == (512, False, 512 * 1024**2)


def test_lmcache_env_does_not_set_kvtier_only_keys() -> None:
    cfg = Config.load(env={"LMCACHE_CACHE_SALT": "tenant-a"})
    assert cfg.cache_salt == ""
    assert Config.load(env={"KVTIER_CACHE_SALT": "tenant-a"}).cache_salt == "tenant-a"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (5.0, 5 * 1024**3),
        (0.25, 256 * 1024**2),
        ("512MiB", 512 * 1024**2),
        ("2GB", 2_000_000_000),
        ("1.5 GiB", int(1.5 * 1024**3)),
        ("4096", 4096 * 1024**3),
    ],
)
def test_cpu_size_units(raw: object, expected: int) -> None:
    assert Config.load(env={}, overrides={"max_local_cpu_size": raw}).max_local_cpu_size == expected


def test_pd_buffer_size_numbers_are_bytes() -> None:
    cfg = Config.load(
        env={}, overrides={"enable_pd": True, "pd_role": "receiver", "pd_buffer_size": 1048576}
    )
    assert cfg.pd_buffer_size == 1048576


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("chunk_size", 0, "integer from 1"),
        ("chunk_size", "many", "integer from 1"),
        ("max_local_cpu_size", -1, "between 0 and 1 PiB"),
        ("max_local_cpu_size", "12 parsecs", "'512MiB'"),
        ("max_local_cpu_size", "1e30", "1 PiB"),
        ("local_cpu", "maybe", "boolean"),
        ("pre_caching_hash_algorithm", "builtin", "'xxh3_128'"),
        ("cache_policy", "LFU", "'LRU'"),
        ("pd_role", "both", "'sender', 'receiver'"),
        ("blocking_timeout_secs", float("inf"), "finite"),
        ("pd_peer_alloc_port", 70000, "TCP port"),
        ("extra_config", [1, 2], "mapping"),
    ],
)
def test_bad_values_name_key_value_and_what_is_allowed(
    key: str, value: object, fragment: str
) -> None:
    with pytest.raises(ConfigError) as info:
        Config.load(env={}, overrides={key: value})
    message = str(info.value)
    assert repr(key) in message and repr(value) in message and fragment in message
    assert info.value.key == key


def test_combination_rules() -> None:
    with pytest.raises(ConfigError, match="max_local_disk_size"):
        Config.load(env={}, overrides={"local_disk": "/tmp/x"})
    with pytest.raises(ConfigError, match="use_only_staging_buffer"):
        Config.load(env={}, overrides={"local_cpu": False, "use_only_staging_buffer": True})
    with pytest.raises(ConfigError, match="pd_role"):
        Config.load(env={}, overrides={"enable_pd": True})
    with pytest.raises(ConfigError, match="max_local_cpu_size"):
        Config(max_local_cpu_size=0)  # from a file, 0 is LMCache's "no CPU tier" (mapped)


@pytest.mark.parametrize(
    ("source", "typo", "nearest"),
    [
        ("file", "max_local_cpu_sise", "max_local_cpu_size"),
        ("env", "max_local_cpu_sise", "max_local_cpu_size"),
        ("override", "max_local_cpu_sise", "max_local_cpu_size"),
        ("env LMCACHE", "max_local_cpu_sise", "max_local_cpu_size"),
        ("file", "chunksize", "chunk_size"),
        ("override", "local_devce", "local_device"),
    ],
)
def test_a_misspelt_key_is_an_error_naming_the_key_it_is_near(
    tmp_path: Path, source: str, typo: str, nearest: str
) -> None:
    """A typo used to be one WARNING and the 5 GiB default: an OOM on a small host."""
    path = tmp_path / "c.yaml"
    path.write_text(f"{typo}: 2GiB\n" if source == "file" else "chunk_size: 64\n")
    env = {"KVTIER_CONFIG_FILE": str(path)}
    overrides = {}
    if source == "env":
        env[f"KVTIER_{typo.upper()}"] = "2GiB"
    elif source == "env LMCACHE":
        env[f"LMCACHE_{typo.upper()}"] = "2GiB"
    elif source == "override":
        overrides[typo] = "2GiB"
    with pytest.raises(ConfigError, match=f"did you mean '{nearest}'") as info:
        Config.load(env=env, overrides=overrides)
    assert info.value.key == typo and "2GiB" not in str(info.value)


def test_unknown_keys_far_from_any_are_refused_except_lmcaches_own_variables(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("chunk_size: 64\nbogus_key: 1\n")
    with pytest.raises(ConfigError, match=r"'also_bogus'.*also 'bogus_key'"):
        Config.load(path, env={"KVTIER_ALSO_BOGUS": "1"})
    # LMCache reads variables of its own that are no config keys: named once, not refused
    with caplog.at_level(logging.WARNING, logger="kvtier.config.model"):
        cfg = Config.load(
            env={
                "LMCACHE_TRACK_USAGE": "false",
                "KVTIER_CI": "1",
                "KVTIER_QUALITY_CACHE": "/tmp/q",  # kvtier's own, not a config key
            }
        )
    assert cfg.chunk_size == 256
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "track_usage" in warnings[0]


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_yaml_that_is_not_a_mapping_is_a_config_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="YAML mapping"):
        Config.load(path, env={})


def test_missing_or_broken_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="readable"):
        Config.load(tmp_path / "nope.yaml", env={})
    broken = tmp_path / "broken.yaml"
    broken.write_text("chunk_size: [1, 2\n")
    with pytest.raises(ConfigError, match="valid YAML"):
        Config.load(broken, env={})


def test_config_is_frozen_and_with_overrides_validates() -> None:
    cfg = Config.default()
    with pytest.raises(AttributeError):
        cfg.chunk_size = 1  # type: ignore[misc]
    assert cfg.with_overrides(chunk_size=64).chunk_size == 64
    with pytest.raises(ConfigError):
        cfg.with_overrides(chunk_size=-1)
    with pytest.raises(ConfigError, match="not a kvtier config key"):
        cfg.with_overrides(nonsense=1)


def test_secrets_are_masked() -> None:
    cfg = Config.load(env={"KVTIER_ADMIN_TOKEN": "s3cret"})
    assert cfg.admin_token == "s3cret"
    assert cfg.as_dict()["admin_token"] == "***"
    assert cfg.as_dict(mask_secrets=False)["admin_token"] == "s3cret"


def test_ports_take_one_or_a_list() -> None:
    cfg = Config.load(
        env={"LMCACHE_PD_PEER_ALLOC_PORT": "[8100, 8101]"}, overrides={"pd_serve_port": 8200}
    )
    assert cfg.pd_peer_alloc_port == (8100, 8101)
    assert cfg.pd_serve_port == (8200,)


def test_remote_url_is_checked_at_load_and_its_password_masked() -> None:
    with pytest.raises(ConfigError) as info:
        Config.load(env={}, overrides={"remote_url": "redis:/localhost:6379"})
    assert info.value.key == "remote_url" and "redis-cluster://" in str(info.value)
    cfg = Config.load(env={}, overrides={"remote_url": "redis://user:hunter2@localhost:6379/1"})
    assert cfg.remote_url == "redis://user:hunter2@localhost:6379/1"
    assert "hunter2" not in str(cfg.as_dict()["remote_url"])


def test_repr_and_str_never_show_a_secret(caplog: pytest.LogCaptureFixture) -> None:
    cfg = Config.load(
        env={"KVTIER_ADMIN_TOKEN": "s3cret-admin"},
        overrides={"remote_url": "redis://user:hunter2@localhost:6379/1"},
    )
    for shown in (repr(cfg), str(cfg), f"{cfg}", repr([cfg])):
        assert "s3cret-admin" not in shown and "hunter2" not in shown, shown
        assert "admin_token='***'" in shown and "redis://user:***@localhost" in shown
    logging.getLogger("test").warning("config: %s %r", cfg, cfg)
    assert "s3cret" not in caplog.text and "hunter2" not in caplog.text


def test_an_empty_admin_token_is_refused_not_taken_for_no_auth() -> None:
    for env in ({"KVTIER_ADMIN_TOKEN": ""}, {"KVTIER_ADMIN_TOKEN": "  "}):
        with pytest.raises(ConfigError, match="admin_token") as info:
            Config.load(env=env)
        assert "unset" in str(info.value)
    with pytest.raises(ConfigError, match="admin_token"):
        Config.default().with_overrides(admin_token="")
    assert Config.load(env={}).admin_token is None  # unset: no auth, as documented


SECRET_KEYS = [spec.name for spec in KEYS if spec.secret]


def test_the_secret_keys_are_the_ones_we_know() -> None:
    assert set(SECRET_KEYS) >= {"admin_token", "pd_auth_token"}


@pytest.mark.parametrize("key", SECRET_KEYS)
def test_a_rejected_secret_is_never_echoed(key: str) -> None:
    bad_values = ("s3cret" * 1000, ["s3cret-in-a-list"], {"s3cret": 1}, 12345678, 12345678.5)
    for bad in bad_values:
        with pytest.raises(ConfigError, match=key) as info:
            Config.load(env={}, overrides={key: bad})
        message = str(info.value) + repr(info.value.value)
        assert "s3cret" not in message and "12345678" not in message, message


@pytest.mark.parametrize("key", SECRET_KEYS)
def test_an_all_digit_secret_in_yaml_is_not_echoed(key: str, tmp_path: Path) -> None:
    """YAML reads an all-digit token as an int (or a float): the error that refuses it, as
    check-config and vLLM's start-up show it, still hides it, whatever the key."""
    for digits in ("98765432109876543210", "98765432109876543210.5"):
        path = tmp_path / "kvtier.yaml"
        path.write_text(f"{key}: {digits}\n")
        with pytest.raises(ConfigError, match=key) as info:
            Config.load(path, env={})
        message = str(info.value) + repr(info.value.value)
        assert "98765" not in message and "hidden" in message, message


@pytest.mark.parametrize(
    ("env", "key"),
    [
        ({"KVTIER_SERVER_SALT_QUOTA": "0"}, "server_salt_quota"),
        ({"KVTIER_PD_AUTH_TOKEN": " " * 20}, "pd_auth_token"),
        ({"KVTIER_PD_AUTH_TOKEN": "\t" * 8 + "short" + " " * 8}, "pd_auth_token"),
        ({"KVTIER_SERVER_SOCKET": ""}, "server_socket"),
    ],
    ids=["quota-0", "token-spaces", "token-padded", "socket-empty"],
)
def test_values_that_would_quietly_break_something_are_refused(
    env: dict[str, str], key: str
) -> None:
    with pytest.raises(ConfigError, match=key):
        Config.load(env=env)
