"""cpu_codec, disk_codec and remote_codec: validated by name, read by the tiers (a lossy one
gives the tier a fingerprint of its own), and LMCache's remote_serde mapped onto
remote_codec; cpu_codec_staging a size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.config import Config
from kvtier.config.schema import PAYLOAD_CODECS
from kvtier.errors import ConfigError
from kvtier.fingerprint import Fingerprint
from kvtier.layout import KVLayout
from kvtier.storage import codecs
from kvtier.storage.disk.tier import DiskTier
from kvtier.storage.redis.tier import RedisTier

LAYOUT = KVLayout(2, 2, 8, torch.float32)
FP = Fingerprint("codec-config", LAYOUT, 16)


def test_the_config_names_every_builtin_codec_and_defaults_to_identity() -> None:
    assert tuple(c.name for c in codecs.BUILTIN) == PAYLOAD_CODECS
    config = Config.load(env={})
    assert (config.cpu_codec, config.disk_codec, config.remote_codec) == ("identity",) * 3
    assert config.cpu_codec_staging == 0  # auto: 1/16 of max_local_cpu_size


@pytest.mark.parametrize("key", ["cpu_codec", "disk_codec", "remote_codec"])
@pytest.mark.parametrize("value", ["zstd", "cachegen", 8, None])
def test_a_bad_codec_names_key_value_and_the_choices(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        Config.load(env={}, overrides={key: value})
    message = str(info.value)
    assert info.value.key == key and repr(value) in message
    assert all(repr(name) in message for name in PAYLOAD_CODECS)


def test_the_environment_sets_a_codec() -> None:
    assert Config.load(env={"KVTIER_DISK_CODEC": "lossless"}).disk_codec == "lossless"
    env = {"KVTIER_CPU_CODEC": "fp8", "KVTIER_CPU_CODEC_STAGING": "64MiB"}
    config = Config.load(env=env)
    assert (config.cpu_codec, config.cpu_codec_staging) == ("fp8", 64 << 20)


@pytest.mark.parametrize("value", ["lots", -1, [1]])
def test_a_bad_staging_size_names_the_key(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        Config.load(env={}, overrides={"cpu_codec_staging": value})
    assert info.value.key == "cpu_codec_staging"


@pytest.mark.parametrize("name", PAYLOAD_CODECS)
def test_tiers_write_with_their_configured_codec_under_its_fingerprint(
    tmp_path: Path, name: str
) -> None:
    config = Config.load(
        env={},
        overrides={
            "local_disk": str(tmp_path),
            "max_local_disk_size": "1MiB",
            "disk_codec": name,
            "remote_url": "redis://127.0.0.1:1",
            "remote_codec": name,
        },
    )
    codec = codecs.codec_by_name(name)
    assert codec is not None
    disk = DiskTier.from_config(config, LAYOUT, FP)
    redis = RedisTier.from_config(config, LAYOUT, FP)  # not opened: nothing connects
    for tier in (disk, redis):
        assert tier.codec is codec
        assert tier.fingerprint.lossy_codec == ("" if codec.lossless else name)
        assert (tier.fingerprint == FP) == codec.lossless


def test_a_lossy_codec_changes_the_fingerprint_digest_a_lossless_one_keeps_it() -> None:
    assert codecs.tier_fingerprint(FP, codecs.LOSSLESS) is FP
    fp8 = codecs.tier_fingerprint(FP, codecs.FP8)
    int8 = codecs.tier_fingerprint(FP, codecs.INT8)
    assert len({FP.digest(), fp8.digest(), int8.digest()}) == 3
    assert Fingerprint("codec-config", LAYOUT, 16).canonical() == FP.canonical()
    assert b"lossy-codec=fp8" in fp8.canonical() and b"lossy-codec" not in FP.canonical()


# -- LMCache's remote_serde ----------------------------------------------------------------
@pytest.mark.parametrize(("serde", "codec"), [("naive", "identity"), ("fp8", "fp8")])
def test_remote_serde_naive_and_fp8_are_remote_codecs(serde: str, codec: str) -> None:
    config = Config.load(env={}, overrides={"remote_serde": serde})
    assert config.remote_codec == codec and config.disk_codec == "identity"


def test_remote_serde_cachegen_is_refused_with_what_kvtier_offers() -> None:
    with pytest.raises(ConfigError) as info:
        Config.load(env={}, overrides={"remote_serde": "cachegen"})
    assert info.value.key == "remote_serde"
    assert "remote_codec lossless, fp8 or int8" in str(info.value)


def test_remote_serde_against_another_remote_codec_is_refused() -> None:
    with pytest.raises(ConfigError, match="remote_codec is 'int8'"):
        Config.load(env={}, overrides={"remote_serde": "fp8", "remote_codec": "int8"})
    same = Config.load(env={}, overrides={"remote_serde": "fp8", "remote_codec": "fp8"})
    assert same.remote_codec == "fp8"
