"""The s3 tier's options: where the bucket is, who signs, and how much runs at once.

``remote_url`` forms (kvtier's, then LMCache's two)::

    s3://BUCKET/PREFIX                         AWS, or the endpoint named below
    s3://BUCKET.s3.REGION.amazonaws.com        LMCache's AWS form (region from the host)
    s3://HOST:PORT/BUCKET/PREFIX               LMCache's endpoint form (https, or http with
                                               extra_config.disable_tls)

They are parsed when the config loads (:mod:`kvtier.config.s3_url`: the prefix's rules, and
no ``user:secret@`` in any form).

The endpoint (any S3: MinIO, Ceph, SeaweedFS) comes from ``extra_config.s3_endpoint_url``,
else ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, else the URL's ``HOST:PORT``, else AWS.
The region from ``extra_config.s3_region``, else ``AWS_REGION`` / ``AWS_DEFAULT_REGION``,
else the AWS host, else us-east-1. Credentials: ``extra_config.aws_access_key_id`` and
``aws_secret_access_key`` (LMCache's keys), else ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` (and ``AWS_SESSION_TOKEN``), else the shared credentials file's
profile (``AWS_SHARED_CREDENTIALS_FILE`` or ~/.aws/credentials, ``AWS_PROFILE`` or
``default``), else obstore's chain (instance metadata, web identity, container). The secret
is never shown: :class:`S3Options`' repr masks it, ``Config`` masks ``extra_config`` keys
holding "secret", and a URL with credentials is refused with them masked.

From ``blocking_timeout_secs``: every request's whole time. From ``extra_config`` (a bad
value is a :class:`ConfigError` naming ``extra_config.<key>``):

====================== ========= =================================================================
key                    default   meaning
====================== ========= =================================================================
s3_endpoint_url        (AWS)     the S3 endpoint, http(s)://host:port
s3_region              us-east-1 the signing region
s3_put_threads         4         writer threads (each one PUT at a time)
s3_get_threads         8         GETs of one retrieve in flight at once
s3_num_io_threads      (none)    LMCache's knob: both thread counts above, when they are unset
s3_inflight_bytes      256MiB    bytes queued or being sent; a put beyond it is DROPPED at once
s3_list_interval_secs  30        re-list the prefix this often to learn other writers' chunks
                                 (0: only at open)
====================== ========= =================================================================
"""

from __future__ import annotations

import configparser
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.config import Config
from kvtier.config import parsers as p
from kvtier.config.remote_url import mask_password
from kvtier.config.s3_url import URL_FORMS, S3Location, parse_s3_url
from kvtier.config.sizes import MIB, parse_size
from kvtier.errors import ConfigError

__all__ = ["URL_FORMS", "S3Location", "S3Options", "parse_s3_url"]  # the URL: kvtier.config

DEFAULT_INFLIGHT_BYTES = 256 * MIB
DEFAULT_REGION = "us-east-1"


@dataclass(frozen=True, slots=True)
class S3Options:
    location: S3Location
    endpoint: str | None = None
    region: str = DEFAULT_REGION
    credentials: dict[str, str] = field(default_factory=dict, repr=False)
    timeout_s: float = 10.0
    put_threads: int = 4
    get_threads: int = 8
    inflight_bytes: int = DEFAULT_INFLIGHT_BYTES
    list_interval_s: float = 30.0

    def __repr__(self) -> str:
        who = self.credentials.get("access_key_id", "(chain)")
        return (
            f"S3Options(s3://{self.location.bucket}/{self.location.prefix}, "
            f"endpoint={self.endpoint or 'AWS'}, region={self.region}, key_id={who}, secret=***)"
        )

    @classmethod
    def from_config(cls, config: Config, env: Mapping[str, str] | None = None) -> S3Options:
        env = os.environ if env is None else env
        extra = config.extra_config or {}
        tls = not p.boolean("extra_config.disable_tls", extra.get("disable_tls", False))
        location = parse_s3_url(str(config.remote_url), tls=tls)
        endpoint = extra.get("s3_endpoint_url") or env.get("AWS_ENDPOINT_URL_S3")
        endpoint = endpoint or env.get("AWS_ENDPOINT_URL") or location.endpoint
        if endpoint is not None and not re.match(r"^https?://[^/\s@]+/?$", str(endpoint)):
            raise ConfigError(  # credentials in it are refused, and never shown
                "extra_config.s3_endpoint_url",
                mask_password(str(endpoint)),
                "an http(s)://host[:port] URL, no user:secret@ (credentials go in "
                "extra_config.aws_access_key_id and aws_secret_access_key)",
            )
        region = extra.get("s3_region") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
        region = str(region or location.region or DEFAULT_REGION)
        io_threads = extra.get("s3_num_io_threads")
        threads = p.integer(1, 256)
        put_threads = threads(
            "extra_config.s3_put_threads", extra.get("s3_put_threads", io_threads or 4)
        )
        get_threads = threads(
            "extra_config.s3_get_threads", extra.get("s3_get_threads", io_threads or 8)
        )
        inflight = parse_size(
            "extra_config.s3_inflight_bytes",
            extra.get("s3_inflight_bytes", DEFAULT_INFLIGHT_BYTES),
            1,
        )
        if inflight == 0:
            raise ConfigError("extra_config.s3_inflight_bytes", 0, "a size above 0, e.g. '256MiB'")
        interval = extra.get("s3_list_interval_secs", 30.0)
        if not isinstance(interval, int | float) or isinstance(interval, bool) or interval < 0:
            raise ConfigError(
                "extra_config.s3_list_interval_secs", interval, "seconds >= 0 (0: only at open)"
            )
        return cls(
            location=location,
            endpoint=str(endpoint).rstrip("/") if endpoint else None,
            region=region,
            credentials=_credentials(extra, env),
            timeout_s=config.blocking_timeout_secs,
            put_threads=put_threads,
            get_threads=get_threads,
            inflight_bytes=inflight,
            list_interval_s=float(interval),
        )


def _credentials(extra: Mapping[str, object], env: Mapping[str, str]) -> dict[str, str]:
    key_id, secret = extra.get("aws_access_key_id"), extra.get("aws_secret_access_key")
    if key_id or secret:
        if not (isinstance(key_id, str) and key_id and isinstance(secret, str) and secret):
            raise ConfigError(
                "extra_config.aws_access_key_id",
                key_id if isinstance(key_id, str) else type(key_id).__name__,
                "both aws_access_key_id and aws_secret_access_key as strings, or neither",
            )
        return {"access_key_id": key_id, "secret_access_key": secret}
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        found = {
            "access_key_id": env["AWS_ACCESS_KEY_ID"],
            "secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        }
        if env.get("AWS_SESSION_TOKEN"):
            found["session_token"] = env["AWS_SESSION_TOKEN"]
        return found
    return _shared_file(env)


def _shared_file(env: Mapping[str, str]) -> dict[str, str]:
    """The profile's keys in the shared credentials file, when it has them."""
    path = Path(env.get("AWS_SHARED_CREDENTIALS_FILE") or Path.home() / ".aws" / "credentials")
    profile = env.get("AWS_PROFILE") or "default"
    parser = configparser.ConfigParser()
    try:
        parser.read(path)
    except (OSError, configparser.Error):
        return {}
    if not parser.has_section(profile):
        return {}
    section = parser[profile]
    if not (section.get("aws_access_key_id") and section.get("aws_secret_access_key")):
        return {}
    found = {
        "access_key_id": section["aws_access_key_id"],
        "secret_access_key": section["aws_secret_access_key"],
    }
    if section.get("aws_session_token"):
        found["session_token"] = section["aws_session_token"]
    return found
