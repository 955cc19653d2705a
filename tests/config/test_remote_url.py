from __future__ import annotations

import pytest

from kvtier.config import Config
from kvtier.config.remote_url import RemoteTarget, mask_password, parse_remote_url
from kvtier.errors import ConfigError


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://localhost:6379", RemoteTarget("single", (("localhost", 6379),))),
        ("redis://10.0.0.2:7000/3", RemoteTarget("single", (("10.0.0.2", 7000),), db=3)),
        ("valkey://h:1/", RemoteTarget("single", (("h", 1),))),
        ("rediss://h:6380", RemoteTarget("single", (("h", 6380),), tls=True)),
        ("valkeys://h:6380/2", RemoteTarget("single", (("h", 6380),), db=2, tls=True)),
        ("redis://[::1]:6379", RemoteTarget("single", (("::1", 6379),))),
        ("unix:///run/redis.sock", RemoteTarget("unix", path="/run/redis.sock")),
        ("unix:///tmp/r.sock?db=4", RemoteTarget("unix", path="/tmp/r.sock", db=4)),
        (
            "redis-cluster://a:7000,b:7001,c:7002",
            RemoteTarget("cluster", (("a", 7000), ("b", 7001), ("c", 7002))),
        ),
        ("valkey-cluster://a:7000", RemoteTarget("cluster", (("a", 7000),))),
        ("resp://h:1/2", RemoteTarget("single", (("h", 1),), db=2)),
        ("resps://h:6380", RemoteTarget("single", (("h", 6380),), tls=True)),
    ],
)
def test_accepted_forms(url: str, expected: RemoteTarget) -> None:
    assert parse_remote_url(url) == expected


def test_credentials_are_parsed_and_never_shown() -> None:
    target = parse_remote_url("redis://alice:s%40cret@h:6379/1")
    assert (target.username, target.password, target.db) == ("alice", "s@cret", 1)
    assert "cret" not in repr(target) and "cret" not in target.describe()
    assert parse_remote_url("redis://:pw@h:1").username is None
    assert mask_password("redis://u:pw@h:1") == "redis://u:***@h:1"


@pytest.mark.parametrize(
    "url",
    [
        "localhost:6379",
        "http://h:6379",
        "redis://h",
        "redis://h:0",
        "redis://h:70000",
        "redis://h:6379/x",
        "redis://h:6379/²",  # a Unicode digit: str.isdigit() says yes, int() says no
        "unix:///tmp/r.sock?db=٣",
        "redis://a:1,b:2",
        "redis-cluster://a:1,,b:2",
        "redis-cluster://a:1/0",
        "unix://relative.sock",
        "unix:///",
        "redis://user@h:1",
        42,
        "",
    ],
)
def test_bad_urls_name_the_key_the_value_and_the_forms(url: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_remote_url(url)
    assert info.value.key == "remote_url"
    assert "redis-cluster://" in str(info.value) and "unix://" in str(info.value)


def test_config_load_parses_redis_urls_and_leaves_other_schemes_to_the_tier_registry() -> None:
    # (resp:// loads too; the LMCache mapping writes it as redis://, with a note)
    assert Config.load(env={}, overrides={"remote_url": "resp://h:1"}).remote_url == "redis://h:1"
    # s3:// is no Redis URL: kept for kvtier.storage.registry, which refuses or builds it
    assert Config.load(env={}, overrides={"remote_url": "s3://b/k"}).remote_url == "s3://b/k"
    with pytest.raises(ConfigError, match="not a URL"):
        Config.load(env={}, overrides={"remote_url": "localhost:6379"})


def test_a_bad_url_does_not_leak_its_password() -> None:
    with pytest.raises(ConfigError) as info:
        parse_remote_url("redis://u:topsecret@h")
    assert "topsecret" not in str(info.value)
