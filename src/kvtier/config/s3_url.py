"""Parsing an ``s3://`` ``remote_url``: the bucket, the prefix, and LMCache's endpoint or
region. It runs when the config loads (:func:`kvtier.config.parsers.remote_url`), so
``kvtier check-config`` refuses what the s3 tier could not use, before vLLM starts.

Forms (kvtier's, then LMCache's two)::

    s3://BUCKET/PREFIX                   AWS, or the endpoint extra_config names
    s3://BUCKET.s3.REGION.amazonaws.com  LMCache's AWS form (region from the host)
    s3://HOST:PORT/BUCKET/PREFIX         LMCache's endpoint form

The prefix is the part of every object name the store is asked for, and the S3 client
(obstore, over Rust's object_store) refuses names with an empty, ``.`` or ``..`` segment or a
control character; SeaweedFS stores a ``\\`` as ``/``, so a chunk is written but never listed
back. A prefix is therefore segments of :data:`PREFIX_CHARS` joined by single ``/``, checked
here rather than met as a dead tier.

No credentials in the URL: ``s3://KEY:SECRET@...`` is refused (they go in
``extra_config.aws_access_key_id`` / ``aws_secret_access_key`` or ``AWS_*``), and the error
shows the URL with its userinfo masked (:func:`kvtier.config.remote_url.mask_password`, the
same as ``Config`` shows ``remote_url``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvtier.config.remote_url import mask_password
from kvtier.errors import ConfigError

URL_FORMS = (
    "s3://BUCKET/PREFIX, s3://BUCKET.s3.REGION.amazonaws.com or s3://HOST:PORT/BUCKET/PREFIX"
)
# AWS's "safe" key characters and the punctuation every S3 here stores as written.
PREFIX_CHARS = "letters, digits and ! - _ . * ' ( ) = + , ; : $ &"
PREFIX_RULE = (
    f"a prefix of segments of {PREFIX_CHARS}, joined by single '/' (no '.', '..' or empty segment)"
)
_SEGMENT_CHAR = re.compile(r"[A-Za-z0-9!\-_.*'()=+,;:$&]")
_AWS_HOST = re.compile(
    r"^(?P<bucket>[^/]+?)\.s3(?:express-[^.]+)?[.-](?P<region>[a-z0-9-]+)\.amazonaws\.com$"
)
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True, slots=True)
class S3Location:
    bucket: str
    prefix: str  # no leading or trailing '/', may be empty
    endpoint: str | None  # from the URL's HOST:PORT form
    region: str | None  # from the URL's AWS host form


def parse_s3_url(url: str, *, tls: bool = True) -> S3Location:
    """The bucket, prefix (and LMCache's endpoint or region) a ``remote_url`` names."""
    shown = mask_password(url)
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() != "s3" or not rest.strip("/"):
        raise ConfigError("remote_url", shown, URL_FORMS)
    if "@" in rest:
        raise ConfigError(
            "remote_url",
            shown,
            "no credentials in an s3 URL: give them as extra_config.aws_access_key_id and "
            f"aws_secret_access_key, or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY ({URL_FORMS})",
        )
    host, _, path = rest.partition("/")
    path = path.strip("/")
    endpoint = region = None
    aws = _AWS_HOST.match(host)
    if re.search(r":\d+$", host):  # LMCache's s3://host:port/bucket
        endpoint = f"{'https' if tls else 'http'}://{host}"
        host, _, path = path.partition("/")
    elif aws:
        host, region = aws["bucket"], aws["region"]
    if not _BUCKET.match(host):
        raise ConfigError(
            "remote_url",
            shown,
            f"a bucket name of 3-63 lower-case letters, digits, '.', '-' ({URL_FORMS})",
        )
    prefix = path.strip("/")
    bad = prefix_problem(prefix)
    if bad:
        raise ConfigError("remote_url", shown, f"the prefix {prefix!r} has {bad}: {PREFIX_RULE}")
    return S3Location(host, prefix, endpoint, region)


def prefix_problem(prefix: str) -> str:
    """What makes ``prefix`` (no leading or trailing '/') unaddressable, or ``""``."""
    if not prefix:
        return ""
    for segment in prefix.split("/"):
        if segment in ("", ".", ".."):
            return "an empty segment ('//')" if not segment else f"a {segment!r} segment"
        for char in segment:
            if not _SEGMENT_CHAR.match(char):
                return f"the character {char!r}"
    return ""
