"""A listing that survives a name obstore cannot parse: ListObjectsV2, signed here.

Why: obstore (Rust's object_store) parses every name of a listed page, and one name with a
control character, an empty segment or a ``.``/``..`` segment fails the whole page, so one
foreign object under the prefix would fail every listing of it. There is no way round that
inside obstore (a page holds up to 1,000 names and has no end bound), so when it happens
:meth:`~kvtier.storage.s3.client.S3Client.list` asks the store itself, page by page,
with ``encoding-type=url`` (a control character cannot travel in XML), and hands every
name back, with the ones obstore could not address put aside.

Signing (AWS Signature Version 4, header form)::

    canonical = GET \\n /bucket \\n sorted query \\n host, x-amz-* headers \\n signed names
                \\n sha256("")
    to_sign   = AWS4-HMAC-SHA256 \\n time \\n date/region/s3/aws4_request \\n sha256(canonical)
    key       = HMAC chain of "AWS4"+secret over date, region, "s3", "aws4_request"

It needs the keys themselves: with obstore's own chain (instance metadata, web identity) the
keys are inside obstore, and a page with such a name still fails (the listing is logged as
failed, naming the store's error).
"""

from __future__ import annotations

import hashlib
import hmac
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from urllib.parse import quote, unquote, urlsplit
from xml.etree import ElementTree

from kvtier.errors import TierError, TierUnavailable

_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def addressable(name: str) -> bool:
    """Whether obstore can name ``name`` (object_store's ``Path::parse`` rules)."""
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        return False
    return all(part not in ("", ".", "..") for part in name.strip("/").split("/"))


def list_objects(
    endpoint: str | None,
    bucket: str,
    region: str,
    credentials: dict[str, str],
    prefix: str,
    timeout_s: float,
) -> Iterator[tuple[str, int]]:
    """Every object under ``prefix`` (a plain string prefix): (name, size)."""
    base = endpoint or f"https://s3.{region}.amazonaws.com"
    token = ""
    while True:
        query = {"list-type": "2", "prefix": prefix, "encoding-type": "url"}
        if token:
            query["continuation-token"] = token
        body = _get(base, bucket, region, credentials, query, timeout_s)
        try:
            root = ElementTree.fromstring(body)
        except ElementTree.ParseError as exc:
            raise TierError(f"s3 list {prefix}: the answer is not XML ({exc})") from exc
        for item in root.iter(f"{_NS}Contents"):
            yield unquote(item.findtext(f"{_NS}Key", "")), int(item.findtext(f"{_NS}Size", "0"))
        token = root.findtext(f"{_NS}NextContinuationToken", "")
        if root.findtext(f"{_NS}IsTruncated", "false") != "true" or not token:
            return


def _get(
    base: str,
    bucket: str,
    region: str,
    credentials: dict[str, str],
    query: dict[str, str],
    timeout_s: float,
) -> bytes:
    if not credentials.get("access_key_id") or not credentials.get("secret_access_key"):
        raise TierError(f"s3 list {query['prefix']}: a name obstore cannot parse, and no keys")
    host = urlsplit(base).netloc
    path = "/" + quote(bucket, safe="")
    canonical_query = "&".join(
        f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(query.items())
    )
    now = datetime.now(UTC)
    stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    headers = {"host": host, "x-amz-content-sha256": _EMPTY_SHA256, "x-amz-date": stamp}
    if credentials.get("session_token"):
        headers["x-amz-security-token"] = credentials["session_token"]
    names = ";".join(sorted(headers))
    canonical = "\n".join(
        [
            "GET",
            path,
            canonical_query,
            "".join(f"{k}:{headers[k]}\n" for k in sorted(headers)),
            names,
            _EMPTY_SHA256,
        ]
    )
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(
        ["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()]
    )
    key = ("AWS4" + credentials["secret_access_key"]).encode()
    for part in (day, region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={credentials['access_key_id']}/{scope}, "
        f"SignedHeaders={names}, Signature={signature}"
    )
    del headers["host"]  # urllib sends it from the URL
    request = urllib.request.Request(f"{base.rstrip('/')}{path}?{canonical_query}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body: bytes = response.read()
            return body
    except urllib.error.HTTPError as exc:
        raise TierError(f"s3 list {query['prefix']}: HTTP {exc.code}") from exc
    except OSError as exc:
        raise TierUnavailable(f"s3 list {query['prefix']}: {exc}") from exc
