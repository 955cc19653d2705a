"""The tier registry (``kvtier.storage.registry``): a config URL's scheme picks the tier.

Every accepted scheme builds its tier; an unknown one is refused naming the key, the value
(password masked) and the registered schemes; ``file://`` and a plain path are one directory;
one ``register_tier`` call makes a new scheme work in ``build_lower_tiers`` and an Engine; the
in-test :class:`DictTier` those tests use passes the tier contract."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier import Engine
from kvtier.config import Config
from kvtier.config.remote_url import REDIS_SCHEMES
from kvtier.errors import ConfigError
from kvtier.fingerprint import Fingerprint
from kvtier.pd.buffer import PDBuffer
from kvtier.storage.disk.tier import DiskTier
from kvtier.storage.redis.tier import RedisTier
from kvtier.storage.registry import TIERS, TierRegistry, register_tier
from kvtier.tiers import build_lower_tiers
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, small_config
from tests.storage.dict_tier import DictTier
from tests.storage.tier_contract import TierContract

FINGERPRINT = Fingerprint("m", SMALL_LAYOUT, SMALL_CHUNK)
DISK_SIZE = "1MiB"


class TestDictTierContract(TierContract):
    @pytest.fixture
    def tier(self) -> Iterator[DictTier]:
        tier = DictTier()
        tier.open()
        yield tier
        tier.close()


@pytest.fixture
def mem_scheme() -> Iterator[None]:
    """``remote_url: mem://...`` builds a DictTier, for this test only."""
    register_tier("remote_url", "mem", DictTier.from_config)
    yield
    TIERS.unregister("remote_url", "mem")


def build(key: str, value: str, **config: object) -> object:
    extra: dict[str, object] = {key: value}
    if key == "local_disk":
        extra["max_local_disk_size"] = DISK_SIZE
    return TIERS.build(key, small_config(**extra, **config), SMALL_LAYOUT, FINGERPRINT)


def url_of(scheme: str) -> str:
    if scheme == "unix":
        return "unix:///run/redis.sock"
    if scheme.endswith("-cluster"):
        return f"{scheme}://a:7000,b:7001"
    return f"{scheme}://h:6379"


@pytest.mark.parametrize("scheme", [*REDIS_SCHEMES])
def test_every_redis_scheme_builds_the_redis_tier(scheme: str) -> None:
    tier = build("remote_url", url_of(scheme))
    assert isinstance(tier, RedisTier)
    assert tier.store.target.tls == (scheme in ("rediss", "valkeys", "resps"))
    kind = "cluster" if scheme.endswith("-cluster") else "unix" if scheme == "unix" else "single"
    assert tier.store.target.kind == kind


def test_resp_is_accepted_by_the_config_as_plain_redis() -> None:
    # a plain RESP server speaks Redis's protocol: the same tier, the same target
    resp, redis = build("remote_url", "resp://h:1/2"), build("remote_url", "redis://h:1/2")
    assert isinstance(resp, RedisTier) and isinstance(redis, RedisTier)
    assert resp.store.target == redis.store.target


def test_every_accepted_scheme_is_registered() -> None:
    assert TIERS.schemes("remote_url") == sorted([*REDIS_SCHEMES, "s3"])
    assert TIERS.schemes("local_disk") == ["file"]


def test_file_url_and_plain_path_are_the_same_directory(tmp_path: Path) -> None:
    by_url, by_path = build("local_disk", f"file://{tmp_path}"), build("local_disk", str(tmp_path))
    assert isinstance(by_url, DiskTier) and isinstance(by_path, DiskTier)
    assert by_url.options == by_path.options
    assert by_url.options.path == str(tmp_path)


@pytest.mark.parametrize(
    ("key", "value", "listed"),
    [
        ("remote_url", "gs://bucket/kv", "redis://"),
        ("remote_url", "http://h:80", "resp://"),
        ("local_disk", "s3://bucket/kv", "file://"),
    ],
)
def test_an_unknown_scheme_names_the_key_the_value_and_the_registered_schemes(
    key: str, value: str, listed: str
) -> None:
    with pytest.raises(ConfigError) as info:
        build(key, value)
    assert info.value.key == key and info.value.value == value
    assert listed in str(info.value)
    if key == "local_disk":
        assert "plain path" in str(info.value)


def test_an_engine_refuses_an_unknown_scheme_when_it_is_built() -> None:
    # config load parses Redis URLs in full; another scheme waits for the registry
    config = small_config(remote_url="mem://h:1")
    with pytest.raises(ConfigError, match="remote_url") as info:
        Engine(config, SMALL_LAYOUT, model_name="m")
    assert "redis-cluster://" in str(info.value)


def test_a_password_never_appears_in_the_refusal() -> None:
    with pytest.raises(ConfigError) as info:
        build("remote_url", "mem://alice:hunter2@h:1")
    assert "hunter2" not in str(info.value) and "alice:***@h:1" in str(info.value)


@pytest.mark.usefixtures("mem_scheme")
def test_a_registered_scheme_is_built_by_build_lower_tiers_in_search_order(
    tmp_path: Path,
) -> None:
    config = small_config(
        remote_url="mem://anywhere",
        local_disk=str(tmp_path),
        max_local_disk_size=DISK_SIZE,
        enable_pd=True,
        pd_role="receiver",
        pd_buffer_size=f"{4 * SMALL_LAYOUT.chunk_bytes(SMALL_CHUNK)}B",
    )
    tiers = build_lower_tiers(config, SMALL_LAYOUT, FINGERPRINT)
    assert [type(t) for t in tiers] == [PDBuffer, DiskTier, DictTier]  # pd, disk, remote
    assert isinstance(tiers[2], DictTier) and tiers[2].url == "mem://anywhere"


@pytest.mark.usefixtures("mem_scheme")
def test_one_register_call_makes_an_engine_use_the_tier(
    engine_factory: Callable[..., Engine],
) -> None:
    engine = engine_factory(remote_url="mem://anywhere")
    tier = engine.tier("dict")
    assert isinstance(tier, DictTier) and tier.state == "open"


def test_a_registry_of_its_own_builds_only_what_it_registers() -> None:
    registry = TierRegistry()
    registry.register("remote_url", "mem", DictTier.from_config)
    config = small_config(remote_url="mem://x")
    (tier,) = build_lower_tiers(config, SMALL_LAYOUT, FINGERPRINT, registry)
    assert isinstance(tier, DictTier)
    with pytest.raises(ConfigError, match="mem://"):
        build_lower_tiers(
            small_config(remote_url="redis://h:1"), SMALL_LAYOUT, FINGERPRINT, registry
        )


@pytest.mark.parametrize(
    ("key", "scheme"),
    [("pd_role", "x"), ("remote_url", "S3"), ("remote_url", "s3://"), ("remote_url", "")],
)
def test_register_refuses_a_key_without_tiers_and_a_malformed_scheme(key: str, scheme: str) -> None:
    with pytest.raises(ValueError):
        TierRegistry().register(key, scheme, DictTier.from_config)


def test_unregister_forgets_a_scheme() -> None:
    registry = TierRegistry()
    registry.register("local_disk", "mem", DictTier.from_config, bare_paths=True)
    registry.unregister("local_disk", "mem")
    assert registry.schemes("local_disk") == []
    with pytest.raises(ConfigError):
        registry.resolve("local_disk", "/plain/path")


def test_config_load_still_parses_a_redis_url_in_full() -> None:
    # only other schemes wait for the registry: a bad Redis URL fails at load, as before
    with pytest.raises(ConfigError, match="remote_url"):
        Config.load(env={}, overrides={"remote_url": "redis://h"})


def test_an_s3_url_builds_the_s3_tier_without_a_request() -> None:
    from kvtier.storage.s3.tier import S3Tier

    config = small_config(
        remote_url="s3://kv-bucket/team/kv",
        extra_config={"s3_endpoint_url": "http://127.0.0.1:1", "s3_region": "eu-west-1"},
    )
    tier = TIERS.build("remote_url", config, SMALL_LAYOUT, FINGERPRINT)
    assert isinstance(tier, S3Tier) and tier.medium == "REMOTE"
    assert tier.options.location.bucket == "kv-bucket"
    assert tier.store.prefix.startswith("team/kv/")
