"""An ``s3://`` remote_url is parsed when the config loads: a prefix no S3 client can
address and credentials in the URL are refused there (so ``kvtier check-config`` refuses
them too), naming the key, the bad part and what is allowed, with the secret masked."""

from __future__ import annotations

import pytest

from kvtier.config import Config
from kvtier.config.s3_url import PREFIX_RULE, parse_s3_url
from kvtier.errors import ConfigError

SECRET = "wJalrXUtnFEMI/K7MDENG-not-a-real-secret"


def load(url: str) -> Config:
    return Config.load(env={}, overrides={"remote_url": url})


@pytest.mark.parametrize(
    ("url", "part"),
    [
        ("s3://kv-cache/a/../b", "a '..' segment"),
        ("s3://kv-cache/a/./b", "a '.' segment"),
        ("s3://kv-cache/a//b", "an empty segment ('//')"),
        ("s3://kv-cache/a\x01b", "the character '\\x01'"),
        ("s3://kv-cache/a\nb", "the character '\\n'"),
        ("s3://kv-cache/team\\kv", "the character '\\\\'"),
        ("s3://minio.local:9000/kvb/a/../b", "a '..' segment"),
    ],
)
def test_a_prefix_the_client_cannot_address_is_refused_at_load(url: str, part: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(url)
    error = info.value
    assert error.key == "remote_url" and error.value == url
    assert part in str(error) and PREFIX_RULE in str(error)


@pytest.mark.parametrize(
    "url", ["s3://kv-cache/prod/llama-3.1_8b", "s3://kv-cache/a=b+c,d;e:f!$&'()*", "s3://kv-cache"]
)
def test_an_addressable_prefix_loads(url: str) -> None:
    assert load(url).remote_url == url


@pytest.mark.parametrize(
    "url",
    [
        f"s3://AKIAEXAMPLE:{SECRET}@kv-cache/kv",
        f"s3://user:{SECRET}@minio.local:9000/kvb/team-a",  # LMCache's endpoint form
        f"s3://AKIAEXAMPLE:{SECRET}@kv-cache.s3.eu-west-1.amazonaws.com",
        f"s3://{SECRET}@kv-cache/kv",
    ],
)
def test_credentials_in_the_url_are_refused_and_never_shown(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(url)
    assert info.value.key == "remote_url" and "aws_secret_access_key" in str(info.value)
    assert SECRET not in str(info.value) and SECRET not in repr(info.value.value)
    with pytest.raises(ConfigError) as direct:
        parse_s3_url(url, tls=False)
    assert SECRET not in str(direct.value)
