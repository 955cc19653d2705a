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
    # s3:// is no Redis URL: parsed by kvtier.config.s3_url (tests/config/test_s3_url.py)
    # and kept as written for kvtier.storage.registry, which builds its tier
    url = "s3://kv-bucket/k"
    assert Config.load(env={}, overrides={"remote_url": url}).remote_url == url
    with pytest.raises(ConfigError, match="not a URL"):
        Config.load(env={}, overrides={"remote_url": "localhost:6379"})


def test_a_bad_url_does_not_leak_its_password() -> None:
    with pytest.raises(ConfigError) as info:
        parse_remote_url("redis://u:topsecret@h")
    assert "topsecret" not in str(info.value)


# A password with each of / @ : # ? % unencoded (base64 secrets hold '/'); each piece between
# them is distinctive, so a leak of any part of it shows.
PIECES = ("Zq9", "Wk8", "Hy7", "Jm6", "Rt5", "Vb4", "Xc3")
SECRET = "Zq9/Wk8@Hy7:Jm6#Rt5?Vb4%Xc3"


def shows_no_secret(text: str) -> bool:
    return not any(piece in text for piece in PIECES)


@pytest.mark.parametrize("user", ["", "alice"])
def test_a_password_with_url_delimiters_parses_whole_and_is_never_shown(user: str) -> None:
    url = f"redis://{user}:{SECRET}@h:6379/2"
    target = parse_remote_url(url)
    assert (target.username, target.password) == (user or None, SECRET)
    assert (target.nodes, target.db) == ((("h", 6379),), 2)
    assert mask_password(url) == f"redis://{user}:***@h:6379/2"
    config = Config.load(env={}, overrides={"remote_url": url})
    assert shows_no_secret(str(config.as_dict()["remote_url"]))


@pytest.mark.parametrize(
    "url",
    [
        f"redis://:{SECRET}@h/0",  # no port
        f"redis://u:{SECRET}@",  # no host
        f"rediss://{SECRET}@h:1/0",  # user:password split inside the secret
        f"redis://:{SECRET}@h:1/x",  # bad database
        f"redis-cluster://:{SECRET}@a:1,,b:2",
        f"redis://:{SECRET}@a:1,b:2",
        f"unix://:{SECRET}@/tmp/r.sock",
        f"valkey://{SECRET}",  # no @ after the secret: read as host
        f"redis://u:{SECRET.replace('@', '')}@{SECRET}",  # a second @ inside the "host"
        f"redis://%zz:{SECRET}@h:1/0/extra",
    ],
)
def test_no_error_shows_any_part_of_a_password_with_url_delimiters(url: str) -> None:
    try:
        parse_remote_url(url)
    except ConfigError as exc:
        assert shows_no_secret(str(exc)), str(exc)
    assert shows_no_secret(mask_password(url)) or "@" not in url


def test_an_unregistered_scheme_is_refused_without_its_password() -> None:
    from kvtier.storage.registry import TIERS

    with pytest.raises(ConfigError) as info:
        TIERS.resolve("remote_url", f"redsi://:{SECRET}@h:1/0")
    assert shows_no_secret(str(info.value)) and "redsi://:***@h:1/0" in str(info.value)


def test_an_lmcache_server_url_is_refused_without_its_password() -> None:
    with pytest.raises(ConfigError, match="lm://") as info:
        Config.load(env={"LMCACHE_REMOTE_URL": f"lm://:{SECRET}@h:65432"})
    assert shows_no_secret(str(info.value))
