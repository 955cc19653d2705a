"""The S3 calls the s3 tier makes, through obstore (Rust: object_store over reqwest), with its
errors translated into kvtier's where they enter.

Why obstore: ``scripts/s3-clients.py`` measured it against the AWS CRT client (LMCache's
choice) and boto3 on the same 1-8 MB objects against SeaweedFS here; it led on gets (the
path a hit waits on) at every size and tied on puts, which the server bounded for all three
(docs/s3.md has the figures). It also takes the record's header and payload as two buffers
(no join in Python) and returns a get as a Rust-owned buffer (no copy into ``bytes``).

Every call is bounded: ``timeout_s`` is the whole request's limit (connect included) and
retries are off, so one call never runs past it (a retry would be the caller's choice).

Errors::

    object absent (404)                     -> None / False (a miss, not an error)
    connection refused, reset, timed out    -> TierUnavailable (the store is unreachable)
    refused by the server (403, 5xx, ...)   -> TierError, naming the call and the status
    a name obstore cannot parse             -> TierError (a listing: see raw_list)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import obstore
from obstore.exceptions import AlreadyExistsError, BaseError, InvalidPathError
from obstore.store import S3Store

from kvtier.errors import TierError, TierUnavailable
from kvtier.storage.s3.raw_list import addressable, list_objects

T = TypeVar("T")

# Words of an obstore error that say the store was not reached (or did not answer in time).
_UNREACHABLE = ("error sending request", "timed out", "timeout", "connection", "dns error")
DELETE_BATCH = 1000  # names one DeleteObjects takes at most
_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([A-Za-z]+)</Code>")


class S3Client:
    """One bucket on one endpoint. ``credentials`` holds ``access_key_id`` /
    ``secret_access_key`` (and ``session_token``) when given; without them obstore's own
    chain runs (instance metadata, web identity, container credentials)."""

    def __init__(
        self,
        endpoint: str | None,
        bucket: str,
        credentials: dict[str, str],
        *,
        timeout_s: float,
        region: str | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.bucket = bucket
        self._raw = (region or credentials.get("region") or "us-east-1", credentials, timeout_s)
        limit = timedelta(seconds=timeout_s)
        config: dict[str, Any] = {
            "region": region or credentials.get("region") or "us-east-1",
            # Path style works on every S3 (MinIO, Ceph, SeaweedFS); AWS still serves it.
            "virtual_hosted_style_request": False,
        }
        for name in ("access_key_id", "secret_access_key", "session_token"):
            if credentials.get(name):
                config[name] = credentials[name]
        if endpoint:
            config["endpoint"] = endpoint
        self.store = S3Store(
            bucket,
            config=config,  # type: ignore[arg-type]
            client_options={
                "allow_http": bool(endpoint and endpoint.startswith("http://")),
                "timeout": limit,
                "connect_timeout": limit,
            },
            retry_config={
                "max_retries": 0,
                "retry_timeout": limit,
                "backoff": {
                    "init_backoff": timedelta(milliseconds=10),
                    "max_backoff": limit,
                    "base": 2,
                },
            },
        )

    def put(self, name: str, *parts: bytes | memoryview) -> None:
        """Write the object ``name`` from ``parts`` in order (a single PUT)."""
        _call("put", name, lambda: obstore.put(self.store, name, list(parts), use_multipart=False))

    def put_new(self, name: str, *parts: bytes | memoryview) -> bool:
        """Write ``name`` unless it exists (a conditional PUT): False when it did."""
        try:
            _call(
                "put",
                name,
                lambda: obstore.put(
                    self.store, name, list(parts), use_multipart=False, mode="create"
                ),
            )
        except _Exists:
            return False
        return True

    def get(self, name: str, max_bytes: int | None = None) -> memoryview | None:
        """The object ``name`` (a view of obstore's buffer), or None when absent; with
        ``max_bytes``, only its first ``max_bytes`` (a ranged GET: an object larger than
        the caller can use is never downloaded whole)."""
        options: Any = {} if max_bytes is None else {"range": (0, max_bytes)}
        try:
            got = _call("get", name, lambda: obstore.get(self.store, name, options=options))
            return memoryview(_call("get", name, got.bytes))
        except FileNotFoundError:
            return None
        except TierError as exc:
            if max_bytes is not None and "HTTP 416" in str(exc):
                return memoryview(b"")  # an empty object: no byte 0 to range over
            raise

    def exists(self, name: str) -> bool:
        """One HEAD."""
        try:
            _call("head", name, lambda: obstore.head(self.store, name))
        except FileNotFoundError:
            return False
        return True

    def delete(self, names: Sequence[str]) -> None:
        """Delete ``names`` (one DeleteObjects per 1,000, its most; an absent one is no
        error)."""
        for start in range(0, len(names), DELETE_BATCH):
            self._delete(list(names[start : start + DELETE_BATCH]))

    def _delete(self, batch: list[str]) -> None:
        _call("delete", batch[0], lambda: obstore.delete(self.store, batch))

    def list(self, prefix: str, unlistable: list[str] | None = None) -> Iterator[tuple[str, int]]:
        """Every object under ``prefix``: (name, size), 1000 per request. A name obstore
        cannot parse fails its page; then the listing starts again through
        :mod:`~kvtier.storage.s3.raw_list`, and such names go to ``unlistable`` instead."""
        try:
            found = [(meta["path"], int(meta["size"])) for meta in self._list(prefix)]
        except _Unparsable:
            skipped = [] if unlistable is None else unlistable
            region, credentials, timeout_s = self._raw
            found = []
            for name, size in list_objects(
                self.endpoint, self.bucket, region, credentials, prefix.strip("/") + "/", timeout_s
            ):
                if addressable(name):
                    found.append((name, size))
                else:
                    skipped.append(name)
        yield from found

    def list_dated(self, prefix: str) -> Iterator[tuple[str, float]]:
        """Every object under ``prefix``: (name, when it was last written, as a POSIX
        time), 1000 per request."""
        for meta in self._list(prefix):
            yield meta["path"], meta["last_modified"].timestamp()

    def _list(self, prefix: str) -> Iterator[Any]:
        stream = _call("list", prefix, lambda: obstore.list(self.store, prefix, chunk_size=1000))
        while True:
            batch = _call("list", prefix, lambda: next(stream, None))
            if batch is None:
                return
            yield from batch


class _Exists(Exception):
    """A conditional put found the object there (inside this module only)."""


class _Unparsable(TierError):
    """A listed name obstore cannot parse (:meth:`S3Client.list` lists again without it)."""


def _call(what: str, name: str, fn: Callable[[], T]) -> T:
    try:
        return fn()
    except FileNotFoundError:
        raise
    except AlreadyExistsError as exc:
        raise _Exists(name) from exc
    except InvalidPathError as exc:
        raise _Unparsable(f"s3 {what} {name}: {str(exc).split(chr(10), 1)[0]}") from exc
    except ValueError as exc:  # obstore refused a name of ours before sending anything
        raise TierError(f"s3 {what} {name!r}: {str(exc).split(chr(10), 1)[0]}") from exc
    except BaseError as exc:
        raise _translate(what, name, str(exc)) from exc
    except OSError as exc:
        raise TierUnavailable(f"s3 {what} {name}: {exc}") from exc


def _translate(what: str, name: str, text: str) -> TierError:
    """A server's answer (an HTTP status, with S3's error code) is a TierError; no answer
    (refused, reset, timed out) is a TierUnavailable."""
    status = _STATUS.search(text)
    if status:
        code = _CODE.search(text)
        detail = f"HTTP {status[1]}" + (f" {code[1]}" if code else "")
        return TierError(f"s3 {what} {name}: {detail}")
    first = text.split("\n", 1)[0]
    if any(word in text.lower() for word in _UNREACHABLE):
        return TierUnavailable(f"s3 {what} {name}: {first}")
    return TierError(f"s3 {what} {name}: {first}")


def create_bucket(
    endpoint: str, bucket: str, credentials: dict[str, str], *, timeout_s: float
) -> None:
    """Create ``bucket`` on ``endpoint`` (tests and benchmarks; an operator makes the bucket
    in production). A signed ``PUT /bucket`` through obstore's request signer."""
    import urllib.error
    import urllib.request

    store = S3Client(endpoint, bucket, credentials, timeout_s=timeout_s).store
    url = obstore.sign(store, "PUT", "", timedelta(seconds=60))
    request = urllib.request.Request(url, method="PUT")
    try:
        urllib.request.urlopen(request, timeout=timeout_s).close()
    except urllib.error.HTTPError as exc:
        if exc.code != 409:  # BucketAlreadyOwnedByYou
            raise TierError(f"s3 create bucket {bucket}: HTTP {exc.code} {exc.reason}") from exc
    except OSError as exc:
        raise TierUnavailable(f"s3 create bucket {bucket}: {exc}") from exc
