"""The s3 tier's options: URL forms (kvtier's and LMCache's), where the endpoint, region and
credentials come from, bad values named, the secret never shown. No server needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import Config
from kvtier.errors import ConfigError
from kvtier.storage.s3.options import S3Location, S3Options, parse_s3_url
from tests.conftest import small_config

SECRET = "wJalrXUtnFEMI-not-a-real-secret"


@pytest.mark.parametrize(
    ("url", "tls", "expected"),
    [
        ("s3://kv-cache/prod/llama", True, S3Location("kv-cache", "prod/llama", None, None)),
        ("s3://kv-cache", True, S3Location("kv-cache", "", None, None)),
        ("s3://kv-cache/", True, S3Location("kv-cache", "", None, None)),
        (
            "s3://lmcache-bucket.s3.us-east-1.amazonaws.com",
            True,
            S3Location("lmcache-bucket", "", None, "us-east-1"),
        ),
        (
            "s3://localhost:8080/bench",
            False,
            S3Location("bench", "", "http://localhost:8080", None),
        ),
        (
            "s3://minio.local:9000/kvb/team-a",
            True,
            S3Location("kvb", "team-a", "https://minio.local:9000", None),
        ),
    ],
)
def test_url_forms(url: str, tls: bool, expected: S3Location) -> None:
    assert parse_s3_url(url, tls=tls) == expected


@pytest.mark.parametrize("url", ["s3://", "s3://Bad_Bucket/x", "s3://ab/x", "s3://h:9000/"])
def test_a_bad_url_names_remote_url_and_the_forms(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_s3_url(url)
    assert info.value.key == "remote_url" and "s3://BUCKET/PREFIX" in str(info.value)


def options(env: dict[str, str] | None = None, **extra: object) -> S3Options:
    config = small_config(remote_url=extra.pop("url", "s3://kv-cache/kv"), extra_config=extra)
    return S3Options.from_config(config, env=env or {"HOME": "/nonexistent"})


def test_endpoint_region_and_credentials_from_the_aws_environment() -> None:
    env = {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:8333",
        "AWS_REGION": "eu-west-1",
        "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_SESSION_TOKEN": "token",
    }
    opts = options(env)
    assert opts.endpoint == "http://127.0.0.1:8333" and opts.region == "eu-west-1"
    assert opts.credentials == {
        "access_key_id": "AKIDEXAMPLE",
        "secret_access_key": SECRET,
        "session_token": "token",
    }
    assert SECRET not in repr(opts) and "AKIDEXAMPLE" in repr(opts)


def test_extra_config_wins_over_the_environment() -> None:
    env = {"AWS_ENDPOINT_URL": "http://a:1", "AWS_REGION": "eu-west-1"}
    opts = options(env, s3_endpoint_url="http://b:2", s3_region="ap-south-1")
    assert opts.endpoint == "http://b:2" and opts.region == "ap-south-1"


def test_the_shared_credentials_file_profile(tmp_path: Path) -> None:
    creds = tmp_path / "credentials"
    creds.write_text(
        "[default]\naws_access_key_id = D\naws_secret_access_key = d\n"
        f"[team]\naws_access_key_id = T\naws_secret_access_key = {SECRET}\n"
    )
    env = {"AWS_SHARED_CREDENTIALS_FILE": str(creds), "AWS_PROFILE": "team"}
    assert options(env).credentials == {"access_key_id": "T", "secret_access_key": SECRET}
    del env["AWS_PROFILE"]
    assert options(env).credentials["access_key_id"] == "D"


def test_no_credentials_anywhere_leaves_obstores_chain() -> None:
    assert options({"HOME": "/nonexistent"}).credentials == {}


def test_lmcaches_s3_keys_map() -> None:
    opts = options(
        url="s3://localhost:8080/bench",
        disable_tls=True,
        s3_num_io_threads=12,
        s3_region="us-west-2",
        aws_access_key_id="AK",
        aws_secret_access_key=SECRET,
        s3_prefer_http2=False,
        save_chunk_meta=False,
    )
    assert opts.endpoint == "http://localhost:8080" and opts.location.bucket == "bench"
    assert opts.put_threads == opts.get_threads == 12 and opts.region == "us-west-2"
    assert opts.credentials == {"access_key_id": "AK", "secret_access_key": SECRET}


def test_lmcaches_aws_host_form_gives_the_region() -> None:
    opts = options(url="s3://lmcache-bucket.s3.us-east-2.amazonaws.com")
    assert opts.region == "us-east-2" and opts.endpoint is None


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("s3_put_threads", 0),
        ("s3_get_threads", "many"),
        ("s3_inflight_bytes", 0),
        ("s3_list_interval_secs", -1),
        ("s3_endpoint_url", "127.0.0.1:8333"),
        ("aws_access_key_id", "only-the-id"),
    ],
)
def test_a_bad_value_names_its_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        options(**{key: value})
    assert info.value.key == f"extra_config.{key}"


def test_a_config_never_shows_the_secret() -> None:
    config = Config.load(
        env={},
        overrides={
            "remote_url": "s3://kv-cache/kv",
            "extra_config": {"aws_access_key_id": "AK", "aws_secret_access_key": SECRET},
        },
    )
    assert SECRET not in repr(config) and SECRET not in str(config.as_dict())


def test_lmcaches_s3_example_file_builds_the_s3_tier(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """LMCache's S3 recipe as its users write it: the file loads unchanged and the engine's
    registry builds the s3 tier from it (nothing is sent: the tier is not opened)."""
    from kvtier.fingerprint import Fingerprint
    from kvtier.storage.registry import TIERS
    from kvtier.storage.s3.tier import S3Tier
    from tests.conftest import SMALL_LAYOUT

    path = tmp_path / "s3.yaml"
    path.write_text(
        "chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 1\n"
        'remote_url: "s3://lmcache-bucket.s3.us-east-1.amazonaws.com"\n'
        "save_unfull_chunk: true\nextra_config:\n"
        '  s3_region: "us-east-1"\n  s3_num_io_threads: 64\n  s3_prefer_http2: true\n'
        "  s3_enable_s3express: false\n  disable_tls: false\n  save_chunk_meta: false\n"
        f'  aws_access_key_id: "AKIDEXAMPLE"\n  aws_secret_access_key: "{SECRET}"\n'
    )
    config = Config.load(env={"LMCACHE_CONFIG_FILE": str(path)})
    tier = TIERS.build("remote_url", config, SMALL_LAYOUT, Fingerprint("m", SMALL_LAYOUT, 256))
    assert isinstance(tier, S3Tier)
    assert tier.options.location.bucket == "lmcache-bucket" and tier.options.endpoint is None
    assert tier.options.put_threads == tier.options.get_threads == 64
    assert SECRET not in repr(config) and SECRET not in caplog.text


def test_an_endpoint_with_credentials_is_refused_and_masked() -> None:
    with pytest.raises(ConfigError) as info:
        options(s3_endpoint_url=f"http://user:{SECRET}@127.0.0.1:8333")
    assert info.value.key == "extra_config.s3_endpoint_url" and SECRET not in str(info.value)
